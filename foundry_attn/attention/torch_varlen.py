"""PyTorch's own varlen flash kernel (``torch.nn.attention.varlen.varlen_attn``, torch >= 2.10, CUDA), called in
whichever signature this torch has: 2.10-2.11 ``is_causal``; 2.12+ ``window_size`` and ``enable_gqa``.

Core module: torch only.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch


def torch_varlen_kernel() -> Callable | None:
    """``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


_VARLEN_PARAMETERS: dict[Callable, frozenset[str]] = {}


def varlen_parameters(kernel: Callable | None) -> frozenset[str]:
    """The keywords a ``varlen_attn`` takes (2.10-2.11: ``is_causal``; 2.12+: ``window_size``, ``enable_gqa``),
    read once per kernel; empty for None."""
    if kernel is None:
        return frozenset()
    if kernel not in _VARLEN_PARAMETERS:
        _VARLEN_PARAMETERS[kernel] = frozenset(inspect.signature(kernel).parameters)
    return _VARLEN_PARAMETERS[kernel]


def call_varlen(
    kernel: Callable,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    causal: bool = True,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hk, D] -> [T, Hq, D] through torch's ``varlen_attn`` in whichever signature it has:
    a window ``(left, right)`` as flash-attn counts it, grouped KV heads (repeated where there is no
    ``enable_gqa``), and ``scale`` (folded into the query where the kernel takes none)."""
    params = varlen_parameters(kernel)
    left, right = window
    extra: dict[str, Any] = {}
    if "window_size" in params:
        extra["window_size"] = (left, 0 if causal else right)
    elif (left, right) != (-1, -1):
        raise ValueError(f"foundry_attn: torch {torch.__version__} varlen_attn has no window_size (torch >= 2.12)")
    else:
        extra["is_causal"] = causal
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    if "scale" in params:
        extra["scale"] = scale
    elif scale is not None and scale != q.shape[-1] ** -0.5:
        q = q * (scale * q.shape[-1] ** 0.5)
    return kernel(q, k, v, cu_q, cu_k, max_q, max_k, **extra)
