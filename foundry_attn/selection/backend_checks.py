"""Whether one backend can run here, with the reason either way: the model checks (its class, its config, what the
backend honours) and the machine's (CUDA, compute capability, dtype, head dim, the installed kernel, a tiny call).

    candidate = check("flash_attention_2", probe(), torch.bfloat16, traits)
    candidate.available, candidate.check, candidate.reason, candidate.fix

Core module: torch only. :mod:`foundry_attn.selection.policy` walks the chain over these checks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from packaging.version import Version

from foundry_attn.attention.backends import EAGER, FA2, FLEX, NAMES, SDPA, TORCH_VARLEN, refusal
from foundry_attn.attention.fa2_reference import REFERENCE_NAME
from foundry_attn.attention.torch_varlen import call_varlen, torch_varlen_kernel
from foundry_attn.selection.capability import Capability, rng_untouched
from foundry_attn.selection.flash_compat import preflight
from foundry_attn.selection.surfaces import Surface, spoken
from foundry_attn.selection.traits import ModelTraits

FA2_MIN_VERSION = Version("2.1.0")
FA2_MAX_HEAD_DIM = 256
HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class Candidate:
    name: str
    available: bool
    reason: str  # why not, or what it will run as
    check: str = ""  # the name of the failed check, empty when available
    fix: str = ""
    warning: str = ""  # what may still go wrong where it runs (a TransformerEngine pair outside this model)


SmokeTest = Callable[[torch.device, torch.dtype], str | None]


def fa2_smoke_test(device: torch.device, dtype: torch.dtype) -> str | None:
    """Run one tiny FA2 call on ``device``: pre-Ampere GPUs only fail here, not at load.

    Args:
        device: the CUDA device to call on.
        dtype: the compute dtype (fp16 or bf16).

    Returns:
        The failure, with the exception, or None when the call ran.

    Example::

        >>> fa2_smoke_test(torch.device("cuda"), torch.bfloat16)   # no GPU here; an A100 with flash-attn: None
        'a tiny flash_attn_func call failed on the device: ...'
    """
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
    asks, or (``reference``) the FA2 reference kernel cannot stand in for the class's own FA2 class.

    Args:
        name: the backend.
        traits: the model's traits.
        reference: FA2 would run on the pure-PyTorch reference kernel.

    Returns:
        ``(check, reason)`` of the first failed model check, or None.

    Example::

        >>> from transformers import Gemma2Config, Gemma2ForCausalLM
        >>> gemma2 = ModelTraits.from_model_class(Gemma2ForCausalLM, Gemma2Config())
        >>> model_check("flex_attention", gemma2)
        ('exactness', "flex_attention cannot apply Gemma2ForCausalLM's attention logit softcap (50.0) per document")
    """
    stand_in = reference_refusal(traits) if name == FA2 and reference else None
    if name not in traits.supports:
        return "model class", f"{traits.class_name} has no {name} support"
    if why := dict(traits.config_refuses).get(name):
        return "model config", f"its config refuses {name}: {why}"
    if why := refusal(name, traits.needs):
        return "exactness", why
    return ("model class", stand_in) if stand_in else None


def model_refusal(
    traits: ModelTraits, backend: str, reference: bool = False, surface: Surface | None = None
) -> str | None:
    """Why attach refuses ``backend`` for this model before anything is pointed, or None: a backend the class does not
    declare (stock refuses it at load) or whose kernel cannot honour the config (a softcap under sdpa, ALiBi under
    FA2) runs neither path exactly (:func:`model_check`); the refusal names the backends that do run the model.

    Args:
        traits: the model's traits (:meth:`ModelTraits.from_model_class`).
        backend: the backend attach was asked for.
        reference: FA2 on the pure-PyTorch reference kernel.
        surface: whose keys the fix names (None: :func:`~foundry_attn.selection.surfaces.spoken`).

    Returns:
        The failed check, its cause and the backends that run the model; None where ``backend`` passes.

    Example::

        >>> from transformers import Gemma2Config, Gemma2ForCausalLM
        >>> gemma2 = ModelTraits.from_model_class(Gemma2ForCausalLM, Gemma2Config())
        >>> print(model_refusal(gemma2, "flex_attention"))
        attach: flex_attention cannot run Gemma2ForCausalLM exactly: check 'exactness' failed: flex_attention cannot
        apply Gemma2ForCausalLM's attention logit softcap (50.0) per document. Fix: call attach(model, backend) with
        one of "flash_attention_2", "eager" (stock transformers refuses this pair at load too)
    """
    failed = {name: model_check(name, traits, reference) for name in {*NAMES, backend}}
    asked = failed[backend]
    if asked is None:
        return None
    check, refused = asked
    runs = [name for name in NAMES if failed[name] is None]
    surface = surface or spoken()
    return (
        f"{surface.key('backend')}: {backend} cannot run {traits.class_name} exactly: check '{check}' failed: "
        f"{refused}. Fix: {surface.fix_choice('backend', runs)} (stock transformers refuses this pair at load too)"
    )


def reference_refusal(traits: ModelTraits) -> str | None:
    """Why the FA2 reference kernel cannot stand in for flash-attn under this class, or None.

    Args:
        traits: the model's traits (:meth:`ModelTraits.from_model_class`).

    Returns:
        The refusal, naming the class, or None where the reference kernel can stand in.

    Example::

        >>> from transformers import GPTJConfig, GPTJForCausalLM
        >>> reference_refusal(ModelTraits.from_model_class(GPTJForCausalLM, GPTJConfig()))
        'GPTJForCausalLM builds its flash-attention class at construction and that class calls flash-attn itself, ...'
    """
    if not traits.fa2_calls_flash_attn:
        return None
    return (
        f"{traits.class_name} builds its flash-attention class at construction and that class calls flash-attn "
        f"itself, so {REFERENCE_NAME} cannot stand in for it"
    )


def _fail(name: str, check: str, reason: str, fix: str) -> Candidate:
    return Candidate(name, False, reason, check, fix)


#: the fix each GPU-class check names, per implementation; ``{sdpa}`` and ``{half}`` in the keys of the surface in use
#: (:func:`~foundry_attn.selection.surfaces.spoken`: ``set attn_implementation: sdpa``, ``set bf16: true``, ...)
FA2_FIXES = {
    "CUDA device": "run on an NVIDIA Ampere-or-newer GPU, or {sdpa}",
    "compute capability": "FA2 needs Ampere or newer (A100, A10, L4, H100); {sdpa} on this GPU",
    "dtype": "{half}",
    "head dim": "{sdpa} for models with head_dim > 256",
}
TORCH_VARLEN_FIXES = {
    "CUDA device": "{sdpa} here",
    "compute capability": "{sdpa} on this GPU",
    "dtype": "{half}",
    "head dim": "{sdpa}",
}


def _fix(template: str) -> str:
    """A fix of :data:`FA2_FIXES` in the keys of the surface in use."""
    surface = spoken()
    return template.format(sdpa=surface.fix("backend", SDPA), half=surface.fix("half"))


def _failed_flash_check(
    name: str, kernel: str, cap: Capability, dtype: torch.dtype, traits: ModelTraits, fixes: dict[str, str]
) -> Candidate | None:
    """The first failed check of those every flash-class kernel shares (CUDA, sm80+, fp16/bf16, head dim <= 256),
    as a rejected candidate; None when all pass."""
    if not cap.cuda or cap.compute_capability is None:
        return _fail(
            name, "CUDA device", f"no CUDA device ({kernel} runs on NVIDIA GPUs only)", _fix(fixes["CUDA device"])
        )
    if cap.compute_capability < (8, 0):
        return _fail(name, "compute capability", f"{cap.device_name} {cap.sm} < 8.0", _fix(fixes["compute capability"]))
    if dtype not in HALF_DTYPES:
        return _fail(
            name, "dtype", f"compute dtype {str(dtype).removeprefix('torch.')} is not fp16/bf16", _fix(fixes["dtype"])
        )
    if traits.head_dim is not None and traits.head_dim > FA2_MAX_HEAD_DIM:
        return _fail(name, "head dim", f"head dim {traits.head_dim} > {FA2_MAX_HEAD_DIM}", _fix(fixes["head dim"]))
    return None


def check_fa2(
    cap: Capability,
    dtype: torch.dtype,
    traits: ModelTraits,
    smoke_test: SmokeTest | None,
    fa2_reference: bool = False,
) -> Candidate:
    """Whether ``flash_attention_2`` can run here: the model class, the install (or transformers' hub kernel), the
    GPU checks and a tiny kernel call (exactness is :func:`check`'s, last); with ``fa2_reference``, the reference
    kernel's checks only.

    Args:
        cap: the machine.
        dtype: the compute dtype.
        traits: the model's traits.
        smoke_test: the tiny kernel call (None: skipped).
        fa2_reference: run FA2 on the pure-PyTorch reference kernel (CPU tests).

    Returns:
        The FA2 candidate, available or with its failed check, reason and fix.

    Example::

        >>> check_fa2(t4_capability, torch.bfloat16, traits, None).reason
        'Tesla T4 sm75 < 8.0'
    """
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
    """One tiny ``varlen_attn`` call (forward and backward) on ``device``.

    Args:
        device: the CUDA device to call on.
        dtype: the compute dtype (fp16 or bf16).

    Returns:
        The failure, or None when the call ran.

    The example is not run here: the call needs a CUDA GPU and a torch with varlen_attn, and on a CPU its answer
    differs between torch releases. Its output is torch 2.7's, which has no varlen_attn.

    Example::

        >>> torch_varlen_smoke_test(torch.device("cuda"), torch.bfloat16)   # torch 2.7  # doctest: +SKIP
        'torch 2.7.0+cu126 has no torch.nn.attention.varlen'
    """
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
    """Whether ``torch_varlen`` can run here: the model class, torch >= 2.10, the GPU checks and a tiny kernel call
    (exactness is :func:`check`'s, last).

    Args:
        cap: the machine.
        dtype: the compute dtype.
        traits: the model's traits.
        smoke_test: the tiny kernel call (None: skipped).

    Returns:
        The torch_varlen candidate, available or with its failed check, reason and fix.

    Example::

        >>> check_torch_varlen(t4_capability, torch.bfloat16, traits, None).reason   # torch 2.7
        'torch 2.7.0+cu126 has no torch.nn.attention.varlen (>= 2.10)'
    """
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
    if smoke_test is not None:
        error = smoke_test(torch.device("cuda"), dtype)
        if error:
            return _fail(name, "kernel call", f"{cap.device_name} {cap.sm}: {error}", _fix("{sdpa} on this GPU"))
    return Candidate(name, True, f"torch {cap.torch_version} varlen_attn on {cap.device_name} {cap.sm}")


def check(
    name: str,
    cap: Capability,
    dtype: torch.dtype,
    traits: ModelTraits,
    smoke_test: SmokeTest | None = fa2_smoke_test,
    fa2_reference: bool = False,
) -> Candidate:
    """Whether ``name`` can run here, with the reason either way.

    Args:
        name: the backend.
        cap: the machine (:func:`~foundry_attn.selection.capability.probe`).
        dtype: the compute dtype.
        traits: the model's traits.
        smoke_test: FA2's tiny kernel call (None: no kernel is called, torch_varlen's neither).
        fa2_reference: FA2 on the pure-PyTorch reference kernel (CPU tests).

    Returns:
        The candidate: ``available``, ``reason``, and for a rejection the failed ``check`` and its ``fix``.

    Example::

        >>> check("sdpa", probe(), torch.float32, traits)     # on a CPU
        Candidate(name='sdpa', available=True, reason='torch scaled_dot_product_attention on cpu', ...)
    """
    config_refuses = dict(traits.config_refuses).get(name)
    if config_refuses:
        return _fail(name, "model config", config_refuses, "pick another implementation, or change the model config")
    if name == FA2:
        here = check_fa2(cap, dtype, traits, smoke_test, fa2_reference)
    elif name == TORCH_VARLEN:
        here = check_torch_varlen(cap, dtype, traits, None if smoke_test is None else torch_varlen_smoke_test)
    else:
        here = _check_torch_attention(name, cap, traits)
    if not here.available:
        return here
    # exactness last, on the machine that runs it: FA2's softcap needs flash-attn >= 2.6 (not the reference kernel's)
    inexact = refusal(name, traits.needs, cap.flash_attn_version if name == FA2 and not fa2_reference else None)
    if inexact and name in (FA2, TORCH_VARLEN):
        return _fail(name, "exactness", inexact, "pick a backend that honours it, or change the model config")
    if inexact:
        return _fail(name, "exactness", inexact, "pick a backend that honours it (eager honours all)")
    return here


def _check_torch_attention(name: str, cap: Capability, traits: ModelTraits) -> Candidate:
    """Whether torch's own ``flex_attention``, ``sdpa`` or ``eager`` can run here (the class, torch's version, flex's
    backward on this device), exactness aside."""
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
    where = f"{cap.device_name} {cap.sm}" if cap.cuda else "cpu"
    detail = {FLEX: "torch flex_attention", SDPA: "torch scaled_dot_product_attention", EAGER: "plain matmul"}
    return Candidate(name, True, f"{detail[name]} on {where}")
