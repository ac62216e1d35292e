"""torch's varlen flash kernel called directly (``aten._flash_attention_forward`` / ``_backward``), without the
work ``varlen_attn``'s wrapper does again on every call: its custom-op dispatch and log line, a fresh RNG-state
tensor, a choice of cuDNN's route (pytorch#191576: about 236 us of host time a call against 101 us on flash), and, on
torch 2.10-2.11, grouped KV heads repeated (flash takes them as they are).

    out = flash_varlen(q, k, v, cu, cu, longest, longest, scale, (-1, 0))   # q [T, Hq, D], k/v [T, Hk, D], CUDA

Used only where :func:`runs_directly` has checked it once per device and dtype against ``varlen_attn`` itself (the
output and the three gradients on a small grouped-head call); else, or where the check fails, ``varlen_attn`` runs and
the reason is logged once. Core module: torch only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

#: the kernels called: (forward, backward), aten's flash ops (tests put a CPU reference of the same signature here)
OPS: list[Callable[..., Any]] = []


def _ops() -> list[Callable[..., Any]]:
    if not OPS:
        OPS.extend((torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_backward))
    return OPS


class _FlashVarlen(torch.autograd.Function):
    """Forward and backward of aten's varlen flash kernel (no dropout)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        max_q: int,
        max_k: int,
        scale: float | None,
        left: int,
        right: int,
    ) -> torch.Tensor:
        causal = (left, right) == (-1, 0)
        forward, _ = _ops()
        out, lse, rng, unused, _ = forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale,
            window_size_left=left, window_size_right=right,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng, unused)
        ctx.args = (max_q, max_k, causal, scale, left, right)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, cu_q, cu_k, rng, unused = ctx.saved_tensors
        max_q, max_k, causal, scale, left, right = ctx.args
        _, backward = _ops()
        dq, dk, dv = backward(
            grad.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng, unused, scale=scale,
            window_size_left=left, window_size_right=right,
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None, None, None, None


def flash_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float | None,
    window: tuple[int, int],
) -> torch.Tensor:
    """Varlen attention through aten's flash kernel: ``q [T, Hq, D]``, ``k``/``v [T, Hk, D]`` (``Hk`` divides ``Hq``,
    taken as they are) -> ``[T, Hq, D]``.

    Args:
        q: the queries of every sequence, concatenated.
        k: the keys.
        v: the values.
        cu_q: int32 query bounds ``(0, l0, l0 + l1, ...)`` on ``q``'s device.
        cu_k: int32 key bounds, likewise.
        max_q: the longest query sequence.
        max_k: the longest key sequence.
        scale: the softmax scale (None: ``1/sqrt(D)``).
        window: ``(left, right)`` keys a query sees beside its diagonal, as flash-attn counts; ``(-1, 0)``: causal.

    Returns:
        The output ``[T, Hq, D]``.

    This example is not run here: needs a CUDA GPU (aten's flash kernel has no CPU version).

    Example::

        >>> q = torch.randn(40, 8, 64, device="cuda", dtype=torch.bfloat16)  # documents of 17, 23  # doctest: +SKIP
        >>> k = v = torch.randn(40, 2, 64, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
        >>> cu = torch.tensor([0, 17, 40], dtype=torch.int32, device="cuda")  # doctest: +SKIP
        >>> flash_varlen(q, k, v, cu, cu, 23, 23, 0.125, (-1, 0)).shape  # doctest: +SKIP
        torch.Size([40, 8, 64])
    """
    return _FlashVarlen.apply(q, k, v, cu_q, cu_k, max_q, max_k, scale, *window)


_CHECKED: dict[tuple[torch.device, torch.dtype], bool] = {}


def runs_directly(q: torch.Tensor, kernel: Callable[..., torch.Tensor], call: Callable[..., torch.Tensor]) -> bool:
    """Whether :func:`flash_varlen` runs on ``q``'s device and dtype: CUDA, and the first time there, its output and
    gradients match ``call`` through ``kernel`` (``varlen_attn``) on a small grouped-head call; said once if not.

    Args:
        q: a query of the call about to be made.
        kernel: ``varlen_attn``.
        call: calls ``kernel`` as :func:`~foundry_attn.attention.torch_varlen.call_varlen` does, with
            ``direct=False``.

    Returns:
        True where the direct call is checked here.

    Example::

        >>> from foundry_attn.attention.torch_varlen import call_varlen, torch_varlen_kernel
        >>> runs_directly(torch.zeros(40, 8, 64), torch_varlen_kernel(), call_varlen)   # the CPU: varlen_attn runs
        False
    """
    key = (q.device, q.dtype)
    if key not in _CHECKED:
        if torch.compiler.is_compiling():  # checked eagerly first (the first batch's proof runs eagerly)
            return False
        _CHECKED[key] = q.is_cuda and _agrees(q.device, q.dtype, kernel, call)
    return _CHECKED[key]


def _agrees(
    device: torch.device, dtype: torch.dtype, kernel: Callable[..., torch.Tensor], call: Callable[..., torch.Tensor]
) -> bool:
    """The direct call against ``varlen_attn`` on two sequences (9 and 23 tokens), 4 heads over 2 KV heads."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(32, h, 64, generator=gen).to(device, dtype) for h in (4, 2, 2))
    cu = torch.tensor([0, 9, 32], dtype=torch.int32, device=device)
    weight = torch.randn(32, 4, 64, generator=gen).to(device, dtype)
    results = []
    try:
        for direct in (True, False):
            qi, ki, vi = inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            if direct:
                out = flash_varlen(qi, ki, vi, cu, cu, 23, 23, 0.125, (-1, 0))
            else:
                out = call(kernel, qi, ki, vi, cu, cu, 23, 23, scale=0.125, direct=False)
            grads = torch.autograd.grad((out.float() * weight.float()).sum(), inputs)
            results.append([out, *grads])
    except Exception as exc:  # a kernel this torch does not call this way: varlen_attn runs
        log.warning("foundry_attn: torch's flash kernel called directly fails here (%s); varlen_attn runs", exc)
        return False
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    ours, theirs = results
    worst = max(
        ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(ours, theirs, strict=True)
    )
    if worst > tol:
        log.warning("foundry_attn: torch's flash kernel called directly differs by %.1e here; varlen_attn runs", worst)
    return worst <= tol
