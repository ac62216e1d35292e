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
    EAGER,
    FA2,
    NAMES,
    SDPA,
    TORCH_VARLEN,
)
from foundry_attn.checks import check_choice
from foundry_attn.selection.backend_checks import Candidate, SmokeTest, check, fa2_smoke_test
from foundry_attn.selection.capability import Capability
from foundry_attn.selection.traits import ModelTraits

AUTO = "auto"
DEFAULT_FALLBACK: tuple[str, ...] = (FA2, TORCH_VARLEN, SDPA, EAGER)


class AttentionUnavailableError(RuntimeError):
    """Strict mode: the requested implementation cannot run here. The message says why and how to fix it."""


def strict_error(
    name: str, check: str, reason: str, fix: str, where: str, fallback: Sequence[str] = ()
) -> AttentionUnavailableError:
    """The one strict-mode message: which implementation, which check, on which device and host, how to fix it."""
    relax = f"; or set attn_strict: false to fall back along {list(fallback)}" if fallback else ""
    return AttentionUnavailableError(
        f"attn_strict: {name} cannot run on {where}: check '{check}' failed: {reason}. Fix: {fix}{relax}."
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
    path: str = ""  # "flat" | "rows" (foundry_attn.flat.attach), empty before the model is attached
    path_reason: str = ""

    @classmethod
    def given(cls, name: str, reason: str, *, strict: bool = False, compute_dtype: str = "float32") -> Decision:
        """A decision no chain made: the implementation a user named (``attach(model, "sdpa")``) or the one a model
        runs that we never attached, with why.

        Args:
            name: the implementation.
            reason: why it runs (``attach(model, 'sdpa')``, ``set by the model, ...``).
            strict: ``attn_path: flat`` with ``strict``: a failed proof raises.
            compute_dtype: the weights' dtype (``float32``, ``bfloat16``).

        Returns:
            A decision with one candidate, ``name``, available.

        Example::

            >>> Decision.given("sdpa", "attach(model, 'sdpa')").as_dict()["fell_back"]
            False
        """
        return cls(name, name, (Candidate(name, True, reason),), strict, compute_dtype)

    @property
    def binding(self) -> bool:
        """The strict rule: ``attn_strict`` binds an explicit request (``auto`` + strict fails only if nothing runs)."""
        return self.strict and self.requested != AUTO

    @property
    def fell_back(self) -> bool:
        """True when the run does not use what was asked for (for ``auto``: not the chain's first)."""
        return self.chosen != self.candidates[0].name

    @property
    def reason(self) -> str:
        """Why the chosen implementation is not the first choice, or why it was chosen."""
        rejected = [c for c in self.candidates if not c.available]
        if self.fell_back and rejected:
            return f"{rejected[0].name}: {rejected[0].reason}"
        return next(c.reason for c in self.candidates if c.name == self.chosen)

    @property
    def warning(self) -> str:
        """What may still go wrong with the chosen implementation (empty: nothing known)."""
        return next((c.warning for c in self.candidates if c.name == self.chosen), "")

    def as_dict(self) -> dict:
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
            "warning": self.warning,
            "candidates": [dataclasses.asdict(c) for c in self.candidates],
        }

    def with_rejection(self, name: str, reason: str, check: str = "load", fix: str = "see the error above") -> Decision:
        """The same decision after ``name`` failed a later check (transformers' load, the documents, the proof)."""
        cands = tuple(Candidate(c.name, False, reason, check, fix) if c.name == name else c for c in self.candidates)
        chosen = next((c.name for c in cands if c.available), None)
        if self.binding:
            raise strict_error(name, check, reason, fix, self.where, [c.name for c in cands])
        if chosen is None:
            raise nothing_runs(cands, self.where)
        return dataclasses.replace(self, chosen=chosen, candidates=cands)


def validate_names(requested: str, fallback: Sequence[str]) -> tuple[str, tuple[str, ...]]:
    """Fail before any model is built when a name is unknown; the message lists the valid names."""
    check_choice("attn_implementation", requested, (AUTO, *NAMES))
    if isinstance(fallback, str):
        fallback = [fallback]
    for name in fallback:
        check_choice("attn_fallback", name, NAMES)
    if not fallback:
        raise ValueError(f"attn_fallback: empty; give an ordered list from {', '.join(NAMES)}")
    return requested, tuple(dict.fromkeys(fallback))


def candidate_order(requested: str, fallback: Sequence[str]) -> tuple[str, ...]:
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


def nothing_runs(candidates: Sequence[Candidate], where: str) -> AttentionUnavailableError:
    failures = "; ".join(f"{c.name}: check '{c.check}' failed: {c.reason} (fix: {c.fix})" for c in candidates)
    return AttentionUnavailableError(
        f"attention: no implementation in {[c.name for c in candidates]} can run on {where}: {failures}. "
        f"Fix one of these, or add sdpa/eager to attn_fallback."
    )
