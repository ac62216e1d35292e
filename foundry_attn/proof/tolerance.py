"""What exact means: the limits a proof tolerates, fp32 and half precision, stock's own noise that raises them, and
each document's slice of a packed run against its run alone within them.

    limits = limits_for(subject, alone_inputs(documents[-1]), alone[-1])   # fp32: max |diff|; half: per token, noise
    diff, bad = differs(got, want, limits.fp32, limits.logits)
    result = against_alone(packed, spans, alone, limits)                   # result.worst, result.differ
    undefined_values(alone, spans)                                         # "" where every value is finite

fp32 compares max |diff| (logits ``ATOL_FP32`` x max |logit|, gradients ``GRAD_RTOL_FP32`` x max |grad|). Half
precision (autocast or half weights) compares **per token**, the worst token's relative L2 difference over the
vocabulary (or the hidden size, for gradients), against limits set from measured bf16 noise and raised to
``NOISE_FACTOR`` times stock's own noise (:func:`stock_noise`), so a leak confined to a few tokens is not averaged
away. Core module: torch and transformers only.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from foundry_attn.attention.config_values import config_value
from foundry_attn.proof.runs import Run, embeddings, next_token_loss, run
from foundry_attn.proof.subject import Subject

#: fp32: logits max |diff| <= ATOL_FP32 * max(1, max |logit|); gradients max |diff| <= GRAD_RTOL_FP32 * max |grad|
ATOL_FP32 = 1e-4


GRAD_RTOL_FP32 = 1e-4


#: half precision, per token: logits' relative L2 difference over the vocabulary, gradients' over the hidden size
#: (relative to the token's norm plus the mean token norm: a token whose gradient is ~0 is no scale). Floors set
#: from measured bf16 noise of exact paths on the CPU (logits 0, gradients up to 9.5e-3; leaks: logits from 4.4e-3,
#: gradients from 2.3e-2 normed; ``foundry-attn bench proof`` measures them again), raised to NOISE_FACTOR times
#: stock's own noise where a device has more (:func:`stock_noise`: stock against itself, measured at each proof)
TOKEN_RTOL_HALF = 2e-3


GRAD_TOKEN_RTOL_HALF = 2e-2


NOISE_FACTOR = 4.0


#: every parameter that trains, fp32: max |diff| <= PARAM_RTOL x max(its own largest truth gradient, PARAM_FLOOR x the
#: largest truth gradient of any parameter); the floor keeps a gradient that is rounding noise (a key bias, which
#: softmax cancels) from being judged relative to itself. Half precision: present where the truth has one
PARAM_RTOL = 1e-3


PARAM_FLOOR = 1e-4


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a proof tolerates: fp32 (max |diff|) or half precision (per token, with the noise measured)."""

    fp32: bool = True
    logits: float = ATOL_FP32
    grads: float = GRAD_RTOL_FP32
    noise: tuple[float, float] | None = None  # stock against itself (logits, gradients), half precision

    @classmethod
    def half(cls, noise: tuple[float, float]) -> Limits:
        """Half-precision limits: the per-token floors, raised to ``NOISE_FACTOR`` times stock's own noise.

        Args:
            noise: stock against itself (logits, gradients), as :func:`stock_noise` measures it.

        Returns:
            Per-token :class:`Limits` (``fp32`` False) that keep ``noise``.

        Example::

            >>> Limits.half((1e-3, 8e-3))
            Limits(fp32=False, logits=0.004, grads=0.032, noise=(0.001, 0.008))
        """
        return cls(
            False,
            max(TOKEN_RTOL_HALF, NOISE_FACTOR * noise[0]),
            max(GRAD_TOKEN_RTOL_HALF, NOISE_FACTOR * noise[1]),
            noise,
        )


def half(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a forward in ``dtype`` on ``device`` computes in half precision (half weights or autocast).

    Args:
        dtype: the weights' dtype.
        device: the device the forward runs on (autocast is read for its type).

    Returns:
        True for fp16/bf16 weights or an autocast enabled on ``device``'s type.

    Example::

        >>> half(next(hf_model.parameters()).dtype, ids.device)     # fp32 weights, no autocast
        False
    """
    return dtype in (torch.float16, torch.bfloat16) or torch.is_autocast_enabled(device.type)


def per_token(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> torch.Tensor:
    """Each token's (last dimension's) relative L2 difference; ``floor`` adds that share of the mean token norm to
    each denominator.

    Args:
        got: the tensor compared, ``[..., d]``.
        want: the truth, of the same shape.
        floor: the share of the mean token norm added to each denominator (1.0 for gradients).

    Returns:
        One relative difference per token, of shape ``got.shape[:-1]``.

    Example::

        >>> logits = torch.randn(13, 64)
        >>> per_token(logits * 1.01, logits)     # [13, vocab] -> [13]
        tensor([0.0100, 0.0100, ..., 0.0100])
    """
    got, want = got.float(), want.float()
    norms = want.norm(dim=-1)
    scale = norms + floor * norms.mean() if norms.numel() else norms
    return (got - want).norm(dim=-1) / scale.clamp_min(1e-12)


def differs(got: torch.Tensor, want: torch.Tensor, fp32: bool, limit: float | None = None) -> tuple[float, bool]:
    """The difference of two logits tensors and whether it is beyond tolerance (nan always is). fp32: max |diff|
    against ``limit`` (default :data:`ATOL_FP32`) x max(1, max |want|); half: the worst token's relative L2
    difference against ``limit`` (default :data:`TOKEN_RTOL_HALF`).

    Args:
        got: the packed slice's logits ``[n, vocab]``.
        want: the document's logits alone ``[n, vocab]``.
        fp32: compare max |diff| (True) or per token (False: half precision).
        limit: the tolerance (None: the default above).

    Returns:
        The difference and whether it is beyond tolerance (another shape: ``(inf, True)``).

    Example::

        >>> differs(packed_run.logits[28:41], alone_runs[1].logits, fp32=True)     # the 13-token document
        (..., False)
    """
    if got.shape != want.shape:
        return float("inf"), True
    if not got.numel():
        return 0.0, False
    if fp32:
        worst = (got.float() - want.float()).abs().max().item()
        return worst, not worst <= (limit or ATOL_FP32) * max(1.0, want.float().abs().max().item())
    worst = per_token(got, want).max().item()
    return worst, not worst <= (limit or TOKEN_RTOL_HALF)


def grad_differs(got: torch.Tensor, want: torch.Tensor, limits: Limits) -> tuple[float, bool]:
    """Gradients: fp32 relative to the largest (a gradient has no unit scale); half per token.

    Args:
        got: the packed slice's input-embedding gradient ``[n, hidden]``.
        want: the document's gradient alone ``[n, hidden]``.
        limits: the proof's :class:`Limits` (``fp32`` and ``grads`` are read).

    Returns:
        The worst relative difference and whether it is beyond ``limits.grads`` (another shape: ``(inf, True)``).

    Example::

        >>> grad_differs(packed_run.grad[28:41], alone_runs[1].grad, Limits())     # the 13-token document
        (..., False)
    """
    if got.shape != want.shape:
        return float("inf"), True
    if not got.numel():
        return 0.0, False
    if limits.fp32:
        scale = want.float().abs().max().item()
        worst = (got.float() - want.float()).abs().max().item() / max(scale, 1e-30)
    else:
        worst = per_token(got, want, floor=1.0).max().item()
    return worst, not worst <= limits.grads


def training_noise(hf: Any) -> str | None:
    """What makes ``hf``'s training-mode forward random, or None: a dropout module with p > 0, or a float
    attribute of a module (functional attention dropout, router jitter) or of the config above 0.

    Args:
        hf: the transformers model.

    Returns:
        The first source of randomness found, named with where it is, or None.

    Example::

        >>> training_noise(hf_model) is None     # the tiny Llama: no dropout
        True
        >>> hf_model.model.layers[0].self_attn.attention_dropout = 0.1
        >>> training_noise(hf_model)
        'attention_dropout=0.1 in model.layers.0.self_attn'
    """
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            return f"dropout p={module.p} at {name}"
        noisy = [k for k, v in vars(module).items() if _NOISY.search(k) and isinstance(v, float) and v > 0]
        if noisy:
            return f"{noisy[0]}={getattr(module, noisy[0])} in {name or 'the model'}"
    for key in ("attention_dropout", "attn_pdrop"):
        value = config_value(getattr(hf, "config", None), key, 0.0)
        if isinstance(value, int | float) and value > 0:
            return f"{key}={value}"
    return None


#: module attributes that make training mode random (functional attention dropout, router jitter)
_NOISY = re.compile(r"dropout|pdrop|jitter")


def stock_noise(subject: Subject, alone: Mapping[str, Any], run: Run, stock: str | None = None) -> tuple[float, float]:
    """Stock against itself, no leak: the document alone (``run``) against the same document as the first row of
    a right-padded two-row batch (another shape, so other kernel tiles and reduction orders), and with ``stock``
    against the same document alone under another stock kernel of the same function (:func:`kernel_spread`: a
    flash kernel and stock sdpa round differently), per token, logits and gradients: the half-precision noise
    floor of this model on this device, at the comparison's own precision.

    Args:
        subject: the model, under its stock implementation.
        alone: the document's inputs alone (:func:`alone_inputs`).
        run: its :class:`Run` alone.
        stock: the stock implementation ``run`` ran under (None: the shape's noise only).

    Returns:
        The worst token's relative difference in the logits and in the gradients (0.0: gradients not compared).

    Example::

        >>> logits, grads = stock_noise(subject, alone, run_alone, "sdpa")
        >>> logits < 1e-5, grads < 1e-5     # fp32 on a CPU: rounding only
        (True, True)
    """
    shape = _shape_noise(subject, alone, run)
    kernel = (0.0, 0.0) if stock is None else kernel_spread(subject, alone, run, stock)
    return max(shape[0], kernel[0]), max(shape[1], kernel[1])


def kernel_spread(subject: Subject, alone: Mapping[str, Any], run_: Run, stock: str) -> tuple[float, float]:
    """The document alone under a second stock kernel (eager against sdpa or a flash kernel, sdpa against eager)
    against ``run_``, its run under ``stock``: how far two stock kernels of one function round apart here, per
    token. 0.0 where the class has no second kernel, where it raises, or where it is not finite (no spread is
    measured from a kernel that fails).

    Args:
        subject: the model.
        alone: the document's inputs alone (:func:`alone_inputs`).
        run_: its :class:`Run` under ``stock``.
        stock: the stock implementation ``run_`` ran under.

    Returns:
        The worst token's relative difference in the logits and in the gradients.

    Example::

        >>> logits, grads = kernel_spread(subject, alone, run_alone, "sdpa")     # eager against sdpa
        >>> logits < 1e-5, grads < 1e-5     # fp32 on a CPU: the two kernels a rounding apart
        (True, True)
    """
    other = "sdpa" if stock == "eager" else "eager"
    if other == "sdpa" and not getattr(type(subject.model), "_supports_sdpa", False):
        return 0.0, 0.0
    n = alone["input_ids"].shape[1]
    try:
        with subject.running(other):
            second = run(subject, alone, [(0, n)], run_.grad is not None)
    except Exception:
        return 0.0, 0.0
    logits = per_token(second.logits, run_.logits).max().item() if second.logits.shape == run_.logits.shape else 0.0
    grads = 0.0
    if second.grad is not None and run_.grad is not None and second.grad.shape == run_.grad.shape:
        grads = per_token(second.grad, run_.grad, floor=1.0).max().item()
    return (logits if math.isfinite(logits) else 0.0), (grads if math.isfinite(grads) else 0.0)


def _shape_noise(subject: Subject, alone: Mapping[str, Any], run: Run) -> tuple[float, float]:
    """The document alone against itself as the first row of a right-padded two-row batch, per token."""
    ids = alone["input_ids"]
    n = ids.shape[1]
    pair = {
        "input_ids": torch.cat([ids, torch.cat([ids[:, : (n + 1) // 2], ids.new_zeros(1, n // 2)], 1)]),
        "attention_mask": torch.cat([torch.ones_like(ids), torch.ones_like(ids)]),
    }
    pair["attention_mask"][1, (n + 1) // 2 :] = 0
    if "position_ids" in alone:
        pair["position_ids"] = torch.cat([alone["position_ids"], alone["position_ids"]])
    with embeddings(subject.model, run.grad is not None) as captured:
        logits = subject.forward(**pair, use_cache=False).logits[0]
    noise = per_token(logits.detach(), run.logits).max().item()
    if run.grad is None or not captured or not captured[0].requires_grad:
        return noise, 0.0
    (grad,) = torch.autograd.grad(next_token_loss(logits, ids[0]), captured[0])
    return noise, per_token(grad[0], run.grad, floor=1.0).max().item()


def worse(worst: float, diff: float) -> float:
    """The worse of two differences, a nan kept.

    Args:
        worst: the worst difference so far.
        diff: the next difference.

    Returns:
        ``max(worst, diff)``, or nan where either is nan.

    Example::

        >>> worse(0.1, 0.2), worse(0.1, float("nan"))
        (0.2, nan)
    """
    return math.nan if math.isnan(diff) or math.isnan(worst) else max(worst, diff)  # max would drop a nan


def limits_for(subject: Subject, alone: Mapping[str, Any], run_alone: Run, stock: str | None = None) -> Limits:
    """fp32 limits, or in half precision (half weights or autocast) the limits raised to stock's own noise on the
    document ``alone`` (whose run is ``run_alone``), at its shape and, with ``stock``, across stock's kernels.

    Args:
        subject: the model (its first parameter's dtype is read).
        alone: the document's inputs alone (:func:`alone_inputs`).
        run_alone: its :class:`Run` alone.
        stock: the stock implementation it ran under (:func:`stock_noise`).

    Returns:
        :class:`Limits`: the fp32 defaults, or :meth:`Limits.half` of :func:`stock_noise`.

    Example::

        >>> limits_for(subject, alone, run_alone)     # fp32 weights, no autocast
        Limits(fp32=True, logits=0.0001, grads=0.0001, noise=None)
    """
    ids = alone["input_ids"]
    if not half(next(subject.model.parameters()).dtype, ids.device):
        return Limits()
    return Limits.half(stock_noise(subject, alone, run_alone, stock))


def limits_note(limits: Limits) -> str:
    """The half-precision limits and the noise they were raised to, for a failure's reason.

    Args:
        limits: the limits the proof ran with.

    Returns:
        The note, with a leading space; "" for fp32 limits.

    Example::

        >>> limits_note(Limits.half((1e-3, 8e-3)))
        ' (half precision, worst token; limits 4.0e-03 logits, 3.2e-02 gradients; stock against itself ...)'
    """
    if limits.fp32 or limits.noise is None:
        return ""
    return (
        f" (half precision, worst token; limits {limits.logits:.1e} logits, {limits.grads:.1e} gradients; stock "
        f"against itself {limits.noise[0]:.1e}, {limits.noise[1]:.1e})"
    )


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Packed runs against runs alone: the worst differences (gradients: None if not compared) and the indices of
    the documents beyond the limits."""

    worst: float
    worst_grad: float | None
    differ: tuple[int, ...]


def against_alone(packed: Run, spans: Sequence[tuple[int, int]], alone: Sequence[Run], limits: Limits) -> Comparison:
    """Each document's slice ``spans[i]`` of the ``packed`` run against ``alone[i]``: logits and, where both
    have them, gradients.

    Args:
        packed: the packed row's :class:`Run`.
        spans: each compared document's ``(start, end)`` in that row.
        alone: each document's :class:`Run` alone, in the order of ``spans``.
        limits: the tolerances (:func:`limits_for`).

    Returns:
        A :class:`Comparison`: the worst differences and the documents beyond the limits.

    Example::

        >>> against_alone(packed_run, [(0, 28), (28, 41)], alone_runs, limits)
        Comparison(worst=..., worst_grad=..., differ=())
    """
    worst, worst_grad, differ = 0.0, None, []
    for i, ((s, e), mine) in enumerate(zip(spans, alone, strict=True)):
        diff, bad = differs(packed.logits[s:e], mine.logits, limits.fp32, limits.logits)
        worst = worse(worst, diff)
        if packed.grad is not None and mine.grad is not None:
            gdiff, gbad = grad_differs(packed.grad[s:e], mine.grad, limits)
            worst_grad, bad = worse(worst_grad or 0.0, gdiff), bad or gbad
        if bad:
            differ.append(i)
    return Comparison(worst, worst_grad, tuple(differ))


def undefined_values(runs: Sequence[Run], spans: Sequence[tuple[int, int]], packed: bool = False) -> str:
    """Where runs are not finite (a fully masked score row, a softmax over nothing), in words; "" where they are.

    Args:
        runs: one run per span, or with ``packed`` one run of the whole row.
        spans: the documents' ``(start, end)`` in the row.
        packed: read the one run at each span (else each run whole).

    Returns:
        Each document with non-finite logits or gradients, and at how many tokens; "" where every value is finite.

    Example::

        >>> logits = torch.zeros(5, 64)
        >>> logits[3, 0] = float("nan")
        >>> undefined_values([Run(logits)], [(0, 3), (3, 5)], packed=True)     # a nan at token 3
        'document of 2 tokens: nan or inf logits at 1 of its 2 tokens'
    """
    bad = []
    for i, (s, e) in enumerate(spans):
        mine = runs[0] if packed else runs[i]
        logits = mine.logits[s:e] if packed else mine.logits
        tokens = int((~torch.isfinite(logits.float())).any(-1).sum())
        grads = mine.grad is not None and not bool(torch.isfinite(mine.grad[s:e] if packed else mine.grad).all())
        if tokens or grads:
            what = f"nan or inf logits at {tokens} of its {e - s} tokens" if tokens else "nan or inf gradients"
            bad.append(f"document of {e - s} tokens: {what}")
    return "; ".join(bad)
