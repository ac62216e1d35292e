"""Which attention implementation runs: FA2 -> torch_varlen -> SDPA -> eager, decided from checks, not from luck.

    model:
      name: foundry_attn_causal_lm
      attn_implementation: auto          # or flash_attention_2 | flex_attention | sdpa | eager
      attn_fallback: [flash_attention_2, torch_varlen, sdpa, eager]
      attn_strict: false                 # true: the request must run or the build fails

Core module: torch only (transformers-free: it reads the backend table, :mod:`foundry_attn.attention.backends`).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence

import torch
from packaging.version import Version

from foundry_attn.attention.backends import (
    EAGER,
    FA2,
    FLEX,
    NAMES,
    SDPA,
    TORCH_VARLEN,
    ModelNeeds,
    config_refusals,
    config_value,
    refusal,
)
from foundry_attn.attention.fa2_reference import REFERENCE_NAME
from foundry_attn.attention.torch_varlen import call_varlen, torch_varlen_kernel
from foundry_attn.checks import check_choice
from foundry_attn.selection.capability import Capability, rng_untouched
from foundry_attn.selection.flash_compat import preflight

AUTO = "auto"
DEFAULT_FALLBACK: tuple[str, ...] = (FA2, TORCH_VARLEN, SDPA, EAGER)
FA2_MIN_VERSION = Version("2.1.0")
FA2_MAX_HEAD_DIM = 256
HALF_DTYPES = (torch.float16, torch.bfloat16)


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
class ModelTraits:
    """What the model asks of an attention kernel. ``supports`` holds the implementations its class has;
    ``needs`` what each backend must honour per document (softcap, dropout); ``config_refuses`` the backends its
    config refuses to be set to, with the config's words."""

    class_name: str = "?"
    head_dim: int | None = None
    supports: frozenset[str] = frozenset(NAMES)
    needs: ModelNeeds = ModelNeeds()
    config_refuses: tuple[tuple[str, str], ...] = ()
    fa2_calls_flash_attn: bool = False  # its FA2 class, built at construction, calls flash-attn itself (4.51)
    te_attention: bool = False  # its code builds TransformerEngine's own attention (which calls flash-attn itself)

    @classmethod
    def from_model_class(cls, model_class: type, config: object | None = None) -> ModelTraits:
        flags = {  # transformers 4.51 names first; later releases renamed the FA2 flag
            FA2: ("_supports_flash_attn_2", "_supports_flash_attn"),
            FLEX: ("_supports_flex_attn",),
            SDPA: ("_supports_sdpa",),
        }
        supports = {EAGER} | {
            impl for impl, names in flags.items() if any(getattr(model_class, n, False) for n in names)
        }
        compatible = getattr(model_class, "_compatible_flash_implementations", None)
        if compatible is not None and FA2 not in compatible:  # 5.x: stock runs another kernel (sinks) under FA2
            supports.discard(FA2)
        if supports & {FA2, SDPA}:  # our varlen function serves any class built on the attention interface
            supports.add(TORCH_VARLEN)
        name = model_class.__name__
        if config is None:
            return cls(name, None, frozenset(supports))
        refuses = config_refusals(config, sorted(supports - {EAGER}))
        needs = ModelNeeds.of(name, config)
        return cls(
            name,
            head_dim_of(config),
            frozenset(supports),
            needs,
            refuses,
            _fa2_calls_flash_attn(model_class),
            _te_attention(model_class),
        )


def _te_attention(model_class: type) -> bool:
    """Whether the modules ``model_class`` is made of import TransformerEngine (remote code built on
    ``transformer_engine.pytorch``); a transformers model never is."""
    modules = (sys.modules.get(klass.__module__) for klass in model_class.__mro__)
    names = (
        getattr(v, "__module__", None) or getattr(v, "__name__", "") for m in modules if m for v in vars(m).values()
    )
    return any(isinstance(n, str) and n.startswith("transformer_engine") for n in names)


def _fa2_calls_flash_attn(model_class: type) -> bool:
    """Whether ``model_class`` builds its attention classes at construction (a module-level ``*_ATTENTION_CLASSES``
    table, transformers 4.51: GPT-J, Falcon, OPT, DBRX, ...) and its module imported transformers' flash forward only
    with flash-attn installed: its FA2 class then cannot run without flash-attn, reference kernel or not."""
    module = sys.modules.get(model_class.__module__)
    if module is None:
        return False
    tables = [v for k, v in vars(module).items() if k.endswith("_ATTENTION_CLASSES") and isinstance(v, dict)]
    return any(FA2 in t for t in tables) and "_flash_attention_forward" not in vars(module)


def reference_refusal(traits: ModelTraits) -> str | None:
    """Why the FA2 reference kernel cannot stand in for flash-attn under this class, or None."""
    if not traits.fa2_calls_flash_attn:
        return None
    return (
        f"{traits.class_name} builds its flash-attention class at construction and that class calls flash-attn "
        f"itself, so {REFERENCE_NAME} cannot stand in for it"
    )


def head_dim_of(config: object) -> int | None:
    head_dim = config_value(config, "head_dim")  # the largest layer's on a heterogeneous config
    if head_dim:
        return int(head_dim)
    hidden, heads = config_value(config, "hidden_size"), config_value(config, "num_attention_heads", pick=min)
    return hidden // heads if hidden and heads else None


@dataclasses.dataclass(frozen=True)
class Candidate:
    name: str
    available: bool
    reason: str  # why not, or what it will run as
    check: str = ""  # the name of the failed check, empty when available
    fix: str = ""
    warning: str = ""  # what may still go wrong where it runs (a TransformerEngine pair outside this model)


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


SmokeTest = Callable[[torch.device, torch.dtype], str | None]


def fa2_smoke_test(device: torch.device, dtype: torch.dtype) -> str | None:
    """Run one tiny FA2 call on ``device``: pre-Ampere GPUs only fail here, not at load."""
    try:
        from foundry_attn.selection.flash_compat import call

        with rng_untouched(device):
            q = torch.randn(1, 8, 2, 64, device=device, dtype=dtype)
            call("flash_attn_func", q, q, q, causal=True)
            torch.cuda.synchronize(device)
    except Exception as exc:
        return f"a tiny flash_attn_func call failed on the device: {type(exc).__name__}: {exc}"
    return None


def model_check(name: str, traits: ModelTraits, reference: bool = False) -> tuple[str, str] | None:
    """The model check ``name`` fails on any path, wherever it runs, as (check, reason), or None: its class does not
    declare the backend (stock refuses it at load), its config refuses it, the backend cannot honour what the config
    asks, or (``reference``) the FA2 reference kernel cannot stand in for the class's own FA2 class."""
    if name not in traits.supports:
        return "model class", f"{traits.class_name} has no {name} support"
    if why := dict(traits.config_refuses).get(name):
        return "model config", f"its config refuses {name}: {why}"
    if why := refusal(name, traits.needs):
        return "exactness", why
    if name == FA2 and reference and (why := reference_refusal(traits)):
        return "model class", why
    return None


def _fail(name: str, check: str, reason: str, fix: str) -> Candidate:
    return Candidate(name, False, reason, check, fix)


#: the fix each GPU-class check names, per implementation
FA2_FIXES = {
    "CUDA device": "run on an NVIDIA Ampere-or-newer GPU",
    "compute capability": "FA2 needs Ampere or newer (A100, A10, L4, H100); use sdpa on this GPU",
    "dtype": "train with precision: amp_bf16 (or load the model in bf16)",
    "head dim": "use sdpa for models with head_dim > 256",
}
TORCH_VARLEN_FIXES = {
    "CUDA device": "use sdpa here",
    "compute capability": "use sdpa on this GPU",
    "dtype": "train with precision: amp_bf16",
    "head dim": "use sdpa",
}


def _failed_flash_check(
    name: str, kernel: str, cap: Capability, dtype: torch.dtype, traits: ModelTraits, fixes: dict[str, str]
) -> Candidate | None:
    """The first failed check of those every flash-class kernel shares (CUDA, sm80+, fp16/bf16, head dim <= 256),
    as a rejected candidate; None when all pass."""
    if not cap.cuda or cap.compute_capability is None:
        return _fail(name, "CUDA device", f"no CUDA device ({kernel} runs on NVIDIA GPUs only)", fixes["CUDA device"])
    if cap.compute_capability < (8, 0):
        return _fail(name, "compute capability", f"{cap.device_name} {cap.sm} < 8.0", fixes["compute capability"])
    if dtype not in HALF_DTYPES:
        return _fail(
            name, "dtype", f"compute dtype {str(dtype).removeprefix('torch.')} is not fp16/bf16", fixes["dtype"]
        )
    if traits.head_dim is not None and traits.head_dim > FA2_MAX_HEAD_DIM:
        return _fail(name, "head dim", f"head dim {traits.head_dim} > {FA2_MAX_HEAD_DIM}", fixes["head dim"])
    return None


def check_fa2(
    cap: Capability,
    dtype: torch.dtype,
    traits: ModelTraits,
    smoke_test: SmokeTest | None,
    fa2_reference: bool = False,
) -> Candidate:
    if FA2 not in traits.supports:
        return _fail(
            FA2,
            "model class",
            f"{traits.class_name} has no flash_attention_2 support",
            "use a model class with _supports_flash_attn_2, or sdpa",
        )
    if fa2_reference:  # an explicit YAML opt-in, never chosen silently: FA2 code paths on the CPU reference kernel
        inexact = refusal(FA2, traits.needs) or (
            f"the reference kernel has no dropout ({traits.needs.dropout})" if traits.needs.dropout else None
        )
        if inexact:
            return _fail(FA2, "exactness", f"{REFERENCE_NAME}: {inexact}", "set attention_dropout: 0, or use eager")
        if why := reference_refusal(traits):
            return _fail(FA2, "model class", why, "use sdpa or eager here; FA2 runs it on a GPU with flash-attn")
        return Candidate(FA2, True, f"{REFERENCE_NAME}: fa2_reference_kernel is set; for CPU tests and diagnosis only")
    # flash-attn missing, transformers' hub kernel usable here (the kernels release it wants, CUDA, a cached copy):
    # flash-attn's own GPU, dtype and exactness checks, none of the installed package's
    hub = cap.flash_attn_version is None and bool(cap.hub_kernel) and cap.hub_kernel_missing is None
    warnings: list[str] = []
    if not hub:
        failed = _failed_install(cap, traits, warnings)
        if failed:
            return failed
    unfit = _failed_flash_check(FA2, "FA2", cap, dtype, traits, FA2_FIXES)
    if unfit:
        return unfit
    if smoke_test is not None and not hub:
        error = smoke_test(torch.device("cuda"), dtype)
        if error:
            return _fail(
                FA2,
                "kernel call",
                f"{cap.device_name} {cap.sm}: {error}",
                "reinstall flash-attn built for this GPU and torch, or use sdpa",
            )
    inexact = refusal(FA2, traits.needs, cap.flash_attn_version)
    if inexact:
        return _fail(FA2, "exactness", inexact, "pick a backend that honours it, or change the model config")
    kernel = (
        f"hub kernel {cap.hub_kernel} (transformers' stand-in for flash-attn, cached)"
        if hub
        else f"flash-attn {cap.flash_attn_version}"
    )
    return Candidate(FA2, True, f"{kernel} on {cap.device_name} {cap.sm}", warning="; ".join(warnings))


def _failed_install(cap: Capability, traits: ModelTraits, warnings: list[str]) -> Candidate | None:
    """The installed flash-attn's checks (it imports, its version, the preflight's known-bad installs), or None;
    a known-bad pair outside this model (TransformerEngine's own attention) goes to ``warnings``."""
    if cap.flash_attn_version is None:
        hub = (
            f"; transformers' stand-in, the hub kernel {cap.hub_kernel}, is not usable here either: "
            f"{cap.hub_kernel_missing}"
            if cap.hub_kernel
            else ""
        )
        return _fail(
            FA2,
            "flash-attn import" if cap.flash_attn_installed else "flash-attn installed",
            (cap.flash_attn_error or "flash-attn is not installed") + hub,
            cap.flash_attn_fix or "pip install flash-attn --no-build-isolation",
        )
    if Version(cap.flash_attn_version) < FA2_MIN_VERSION:
        return _fail(
            FA2,
            "flash-attn version",
            f"flash-attn {cap.flash_attn_version} < {FA2_MIN_VERSION}",
            f"pip install 'flash-attn>={FA2_MIN_VERSION}'",
        )
    for problem in preflight(cap):  # known-bad installs (TransformerEngine pairs, transformers' minimum, ...)
        if problem.rejects != FA2:
            continue
        if problem.te_attention and not traits.te_attention:  # TE's attention is not in this model: ours runs
            warnings.append(
                f"{problem.reason}; only TransformerEngine's own attention, not in this model (fix: {problem.fix})"
            )
            continue
        return _fail(FA2, problem.check, problem.reason, problem.fix)
    return None


def torch_varlen_smoke_test(device: torch.device, dtype: torch.dtype) -> str | None:
    """One tiny ``varlen_attn`` call (forward and backward) on ``device``."""
    kernel = torch_varlen_kernel()
    if kernel is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    try:
        with rng_untouched(device):
            q = torch.randn(8, 2, 64, device=device, dtype=dtype, requires_grad=True)
            cu = torch.tensor([0, 3, 8], device=device, dtype=torch.int32)
            call_varlen(kernel, q, q, q, cu, cu, 5, 5).sum().backward()
            torch.cuda.synchronize(device)
    except Exception as exc:
        return f"a tiny varlen_attn call failed on the device: {type(exc).__name__}: {exc}"
    return None


def check_torch_varlen(
    cap: Capability, dtype: torch.dtype, traits: ModelTraits, smoke_test: SmokeTest | None
) -> Candidate:
    name = TORCH_VARLEN
    if name not in traits.supports:
        return _fail(
            name,
            "model class",
            f"{traits.class_name} has no attention-interface support",
            "pick another implementation",
        )
    if Version(cap.torch_version.split("+")[0]) < Version("2.10") or torch_varlen_kernel() is None:
        return _fail(
            name,
            "torch version",
            f"torch {cap.torch_version} has no torch.nn.attention.varlen (>= 2.10)",
            "pip install 'torch>=2.10', or use flash_attention_2 / sdpa",
        )
    unfit = _failed_flash_check(name, "varlen_attn", cap, dtype, traits, TORCH_VARLEN_FIXES)
    if unfit:
        return unfit
    inexact = refusal(name, traits.needs)
    if inexact:
        return _fail(name, "exactness", inexact, "pick a backend that honours it, or change the model config")
    if smoke_test is not None:
        error = smoke_test(torch.device("cuda"), dtype)
        if error:
            return _fail(name, "kernel call", f"{cap.device_name} {cap.sm}: {error}", "use sdpa on this GPU")
    return Candidate(name, True, f"torch {cap.torch_version} varlen_attn on {cap.device_name} {cap.sm}")


def check(
    name: str,
    cap: Capability,
    dtype: torch.dtype,
    traits: ModelTraits,
    smoke_test: SmokeTest | None = fa2_smoke_test,
    fa2_reference: bool = False,
) -> Candidate:
    """Whether ``name`` can run here, with the reason either way."""
    config_refuses = dict(traits.config_refuses).get(name)
    if config_refuses:
        return _fail(name, "model config", config_refuses, "pick another implementation, or change the model config")
    if name == FA2:
        return check_fa2(cap, dtype, traits, smoke_test, fa2_reference)
    if name == TORCH_VARLEN:
        return check_torch_varlen(cap, dtype, traits, None if smoke_test is None else torch_varlen_smoke_test)
    if name not in traits.supports:
        return _fail(name, "model class", f"{traits.class_name} has no {name} support", "pick another implementation")
    torch_version = Version(cap.torch_version.split("+")[0])
    if name == FLEX and torch_version < Version("2.5"):
        return _fail(name, "torch version", f"torch {cap.torch_version} < 2.5", "pip install 'torch>=2.5'")
    if name == FLEX and cap.flex_backward_error:
        return _fail(
            name,
            "flex backward",
            cap.flex_backward_error,
            "train with sdpa or eager on this device (flex trains on CUDA GPUs)",
        )
    if name == SDPA and torch_version < Version("2.1.1"):
        return _fail(name, "torch version", f"torch {cap.torch_version} < 2.1.1", "pip install 'torch>=2.1.1'")
    inexact = refusal(name, traits.needs)
    if inexact:
        return _fail(name, "exactness", inexact, "pick a backend that honours it (eager honours all)")
    where = f"{cap.device_name} {cap.sm}" if cap.cuda else "cpu"
    detail = {FLEX: "torch flex_attention", SDPA: "torch scaled_dot_product_attention", EAGER: "plain matmul"}
    return Candidate(name, True, f"{detail[name]} on {where}")


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
