"""Which attention implementation runs: FA2 -> torch_varlen -> SDPA -> eager, decided from checks, not from luck:
the chain walked over :mod:`foundry_attn.selection.backend_checks`, the :class:`Decision` and its strict rule.

    model:
      name: foundry_attn_causal_lm
      attn_implementation: auto          # or flash_attention_2 | flex_attention | sdpa | eager
      attn_fallback: [flash_attention_2, torch_varlen, sdpa, eager]
      attn_strict: false                 # true: the request must run or the build fails

Core module: torch only (transformers-free: it reads the backend table, :mod:`foundry_attn.attention.backends`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from foundry_attn.attention.backends import (
    NAMES,
)
from foundry_attn.checks import check_choice
from foundry_attn.selection.backend_checks import Candidate, SmokeTest, check, fa2_smoke_test
from foundry_attn.selection.capability import Capability
from foundry_attn.selection.options import AUTO as AUTO
from foundry_attn.selection.options import DEFAULT_FALLBACK as DEFAULT_FALLBACK
from foundry_attn.selection.surfaces import Surface, spoken
from foundry_attn.selection.traits import ModelTraits


class AttentionUnavailableError(RuntimeError):
    """Strict mode: the requested implementation cannot run here. The message says why and how to fix it; where no
    backend of a chain runs, ``candidates`` holds each one's failed check and ``where`` the machine."""

    candidates: tuple[Candidate, ...] = ()
    where: str = ""


def strict_error(
    name: str,
    check: str,
    reason: str,
    fix: str,
    where: str,
    fallback: Sequence[str] = (),
    surface: Surface | None = None,
) -> AttentionUnavailableError:
    """The one strict-mode message: which implementation, which check, on which device and host, how to fix it.

    Args:
        name: the implementation that cannot run.
        check: the check it failed (``compute capability``, ``dtype``, ``load``, ...).
        reason: why it failed.
        fix: how to fix it.
        where: ``<device> (<sm>) on <host>``.
        fallback: the chain ``attn_strict: false`` would walk (empty: no such hint).
        surface: whose keys the message names (None: :func:`~foundry_attn.selection.surfaces.spoken`).

    Returns:
        The error, for the caller to raise.

    Example::

        >>> where = "Tesla T4 (sm75) on node-3"
        >>> raise strict_error(FA2, "compute capability", "Tesla T4 sm75 < 8.0", "use sdpa on this GPU", where)
        Traceback (most recent call last):
        foundry_attn.selection.policy.AttentionUnavailableError: strict: flash_attention_2 cannot run on Tesla T4 (sm75)
        on node-3: check 'compute capability' failed: Tesla T4 sm75 < 8.0. Fix: use sdpa on this GPU.
    """
    surface = surface or spoken()
    relax = f"; or {surface.fix('strict', False)} to fall back along {list(fallback)}" if fallback else ""
    return AttentionUnavailableError(
        f"{surface.key('strict')}: {name} cannot run on {where}: check '{check}' failed: {reason}. Fix: {fix}{relax}."
    )


@dataclasses.dataclass(frozen=True)
class Decision:
    requested: str
    chosen: str
    candidates: tuple[Candidate, ...]
    strict: bool = False
    compute_dtype: str = "float32"
    proof: str = ""  # the flat-path proof at build: "passed in N ms (...)", "failed (...)", "off", "first batch"
    where: str = ""  # "<device> (<sm>) on <host>", for error messages
    path: str = ""  # "flat" | "rows" (foundry_attn.path.attach), empty before the model is attached
    path_reason: str = ""
    layout: str = ""  # what the last batch ran: "flat" | "rows" (the cheaper proven layout, per batch)
    layout_reason: str = ""
    execution: str = ""  # how the flat step runs: "eager" | "compiled" | "graphed" (foundry_attn.path.execution)
    execution_reason: str = ""

    @classmethod
    def given(
        cls, name: str, reason: str, *, strict: bool = False, compute_dtype: str = "float32", proof: str = ""
    ) -> Decision:
        """A decision no chain made: the implementation a user named (``attach(model, "sdpa")``) or the one a model
        runs that we never attached, with why.

        Args:
            name: the implementation.
            reason: why it runs (``attach(model, 'sdpa')``, ``set by the model, ...``).
            strict: ``attn_path: flat`` with ``strict``: a failed proof raises.
            compute_dtype: the weights' dtype (``float32``, ``bfloat16``).
            proof: what is proven so far (``first batch``: the first training batch proves; empty: nothing will).

        Returns:
            A decision with one candidate, ``name``, available.

        Example::

            >>> Decision.given("sdpa", "named at attach").as_dict()["fell_back"]
            False
        """
        return cls(name, name, (Candidate(name, True, reason),), strict, compute_dtype, proof)

    @property
    def binding(self) -> bool:
        """The strict rule: ``attn_strict`` binds an explicit request (``auto`` + strict fails only if nothing runs).

        Returns:
            True when a failure of the requested implementation must raise rather than fall back.

        Example::

            >>> choose(SDPA, strict=True).binding, choose(AUTO, strict=True).binding   # here, on a CPU
            (True, False)
        """
        return self.strict and self.requested != AUTO

    @property
    def fell_back(self) -> bool:
        """True when the run does not use what was asked for (for ``auto``: not the chain's first).

        Returns:
            Whether ``chosen`` differs from the first candidate.

        Example::

            >>> choose(AUTO, cap=t4_capability).fell_back      # FA2 needs sm80: sdpa runs
            True
        """
        return self.chosen != self.candidates[0].name

    @property
    def reason(self) -> str:
        """Why the chosen implementation is not the first choice, or why it was chosen.

        Returns:
            ``<first rejected>: <its reason>`` after a fallback, else the chosen candidate's reason.

        Example::

            >>> choose(AUTO, cap=t4_capability).reason
            'flash_attention_2: Tesla T4 sm75 < 8.0'
        """
        rejected = [c for c in self.candidates if not c.available]
        if self.fell_back and rejected:
            return f"{rejected[0].name}: {rejected[0].reason}"
        return next(c.reason for c in self.candidates if c.name == self.chosen)

    @property
    def warning(self) -> str:
        """What may still go wrong with the chosen implementation (empty: nothing known).

        Returns:
            The chosen candidate's warning (a TransformerEngine pair outside this model), or an empty string.

        Example::

            >>> decision.warning
            ''
        """
        return next((c.warning for c in self.candidates if c.name == self.chosen), "")

    def as_dict(self) -> dict:
        """The decision as plain JSON-ready values, for logs and events.

        Returns:
            Every field, the ``fell_back``/``reason``/``warning`` properties, and each candidate as a dict.

        Example::

            >>> choose(AUTO, cap=t4_capability).as_dict()["candidates"][0]["check"]
            'compute capability'
        """
        return {
            "requested": self.requested,
            "chosen": self.chosen,
            "fell_back": self.fell_back,
            "reason": self.reason,
            "strict": self.strict,
            "compute_dtype": self.compute_dtype,
            "proof": self.proof,
            "path": self.path,
            "path_reason": self.path_reason,
            "layout": self.layout,
            "layout_reason": self.layout_reason,
            "execution": self.execution,
            "execution_reason": self.execution_reason,
            "warning": self.warning,
            "candidates": [dataclasses.asdict(c) for c in self.candidates],
        }

    def with_rejection(self, name: str, reason: str, check: str = "load", fix: str = "see the error above") -> Decision:
        """The same decision after ``name`` failed a later check (transformers' load, the documents, the proof).

        Args:
            name: the candidate that failed.
            reason: why it failed.
            check: the check it failed (``load``, ``attach``, ``flat path``).
            fix: how to fix it, for the strict message.

        Returns:
            A copy with ``name`` rejected and the next available candidate chosen.

        Raises:
            AttentionUnavailableError: the decision is binding (strict, named request), or no candidate is left.

        Example::

            >>> decision.with_rejection(FA2, "ImportError: flash_attn_2_cuda undefined symbol").reason
            'flash_attention_2: ImportError: flash_attn_2_cuda undefined symbol'
        """
        cands = tuple(Candidate(c.name, False, reason, check, fix) if c.name == name else c for c in self.candidates)
        chosen = next((c.name for c in cands if c.available), None)
        if self.binding:
            raise strict_error(name, check, reason, fix, self.where, [c.name for c in cands])
        if chosen is None:
            raise nothing_runs(cands, self.where)
        return dataclasses.replace(self, chosen=chosen, candidates=cands)


def validate_names(requested: str, fallback: Sequence[str]) -> tuple[str, tuple[str, ...]]:
    """Fail before any model is built when a name is unknown; the message lists the valid names.

    Args:
        requested: ``attn_implementation`` (``auto`` or a backend name).
        fallback: ``attn_fallback``, a list of backend names (a single name is taken as a list of one).

    Returns:
        ``(requested, fallback)`` with the fallback as a tuple, duplicates dropped.

    Raises:
        ValueError: an unknown name, or an empty fallback.

    Example::

        >>> validate_names("auto", ["sdpa", "sdpa", "eager"])
        ('auto', ('sdpa', 'eager'))
    """
    check_choice("attn_implementation", requested, (AUTO, *NAMES))
    if isinstance(fallback, str):
        fallback = [fallback]
    for name in fallback:
        check_choice("attn_fallback", name, NAMES)
    if not fallback:
        raise ValueError(f"attn_fallback: empty; give an ordered list from {', '.join(NAMES)}")
    return requested, tuple(dict.fromkeys(fallback))


def candidate_order(requested: str, fallback: Sequence[str]) -> tuple[str, ...]:
    """The order the candidates are checked in: the chain for ``auto``, else the request first, then the chain.

    Args:
        requested: ``auto`` or a backend name.
        fallback: the chain, fastest first.

    Returns:
        The backend names to check, without duplicates.

    Example::

        >>> candidate_order("sdpa", (FA2, SDPA, EAGER)), candidate_order(AUTO, (FA2, SDPA))
        (('sdpa', 'flash_attention_2', 'eager'), ('flash_attention_2', 'sdpa'))
    """
    return tuple(fallback) if requested == AUTO else tuple(dict.fromkeys((requested, *fallback)))


def choose(
    requested: str = AUTO,
    fallback: Sequence[str] = DEFAULT_FALLBACK,
    cap: Capability | None = None,
    dtype: torch.dtype = torch.float32,
    traits: ModelTraits | None = None,
    strict: bool = False,
    smoke_test: SmokeTest | None = fa2_smoke_test,
    fa2_reference: bool = False,
) -> Decision:
    """Check every candidate in order and pick the first that runs.

    ``dtype`` is the *compute* dtype: under Composer's ``amp_bf16`` the weights are fp32 but attention
    runs in bf16, so pass ``torch.bfloat16`` there (the model builder does this for you).

    Args:
        requested: ``auto`` or a backend name.
        fallback: the chain, fastest first.
        cap: the machine (None: :func:`~foundry_attn.selection.capability.probe` this one).
        dtype: the compute dtype.
        traits: the model's traits (None: a model that supports every backend and asks nothing).
        strict: an explicit request must run, or this raises.
        smoke_test: the tiny kernel call FA2 must pass on the device (None: skipped).
        fa2_reference: FA2 on the pure-PyTorch reference kernel (CPU tests).

    Returns:
        The decision: the chosen backend and every candidate with its reason.

    Raises:
        AttentionUnavailableError: a binding request fails a check, or nothing in the chain can run.

    Example::

        >>> decision = choose(AUTO, cap=t4_capability, dtype=torch.bfloat16, traits=traits)   # on a Tesla T4
        >>> decision.chosen, decision.reason
        ('sdpa', 'flash_attention_2: Tesla T4 sm75 < 8.0')
    """
    from foundry_attn.selection.capability import probe

    requested, fallback = validate_names(requested, fallback)
    cap = cap or probe()
    traits = traits or ModelTraits()
    candidates = tuple(
        check(n, cap, dtype, traits, smoke_test, fa2_reference) for n in candidate_order(requested, fallback)
    )
    chosen = next((c for c in candidates if c.available), None)
    first = candidates[0]
    where = f"{cap.device_name} ({cap.sm}) on {cap.host}"
    decision = Decision(requested, first.name, candidates, strict, str(dtype).removeprefix("torch."), where=where)
    if decision.binding and not first.available:
        raise strict_error(first.name, first.check, first.reason, first.fix, where, fallback)
    if chosen is None:  # strict or not, nothing in the chain runs: falling back cannot help
        raise nothing_runs(candidates, where)
    return dataclasses.replace(decision, chosen=chosen.name)


def nothing_runs(
    candidates: Sequence[Candidate], where: str, surface: Surface | None = None
) -> AttentionUnavailableError:
    """The error when no candidate of the chain can run: each one's failed check, reason and fix.

    Args:
        candidates: the checked candidates, all rejected.
        where: ``<device> (<sm>) on <host>``.
        surface: whose keys the message names (None: :func:`~foundry_attn.selection.surfaces.spoken`).

    Returns:
        The error, for the caller to raise.

    Example::

        >>> t4 = choose(AUTO, cap=t4_capability)
        >>> raise nothing_runs(t4.candidates[:1], t4.where)
        Traceback (most recent call last):
        foundry_attn.selection.policy.AttentionUnavailableError: attention: no implementation in ['flash_attention_2']
        can run on Tesla T4 (sm75) on node-3: flash_attention_2: check 'compute capability' failed: ...
    """
    failures = "; ".join(f"{c.name}: check '{c.check}' failed: {c.reason} (fix: {c.fix})" for c in candidates)
    chain = (surface or spoken()).key("fallback")
    error = AttentionUnavailableError(
        f"attention: no implementation in {[c.name for c in candidates]} can run on {where}: {failures}. "
        f"Fix one of these{f', or add sdpa/eager to {chain}' if chain else ''}."
    )
    error.candidates, error.where = tuple(candidates), where
    return error
