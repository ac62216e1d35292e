"""PyTorch's own varlen flash kernel (``torch.nn.attention.varlen.varlen_attn``, torch >= 2.10, CUDA), called in
whichever signature this torch has (2.10: ``is_causal``, no ``scale``; 2.11: ``scale``, ``window_size``; 2.12+:
``enable_gqa`` too); on CUDA its flash kernel directly where that is checked here
(:mod:`foundry_attn.attention.aten_flash`).

Core module: torch only.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from foundry_attn.attention.aten_flash import flash_varlen, runs_directly


@functools.cache
def _varlen_module() -> ModuleType | None:
    try:
        import torch.nn.attention.varlen as varlen
    except ImportError:
        return None
    return varlen


def torch_varlen_kernel() -> Callable | None:
    """``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10), or None; read off its module at each call (a patch
    of it is what runs).

    Returns:
        The kernel, or None where this torch has none.

    Example::

        >>> (torch_varlen_kernel() is not None) == (torch.__version__ >= "2.10")   # None on torch 2.7-2.9
        True
    """
    module = _varlen_module()
    return None if module is None else getattr(module, "varlen_attn", None)


_VARLEN_PARAMETERS: dict[Callable, frozenset[str]] = {}


def varlen_parameters(kernel: Callable | None) -> frozenset[str]:
    """The keywords a ``varlen_attn`` takes (2.10: ``is_causal``; 2.11: ``scale``, ``window_size``; 2.12+:
    ``enable_gqa`` too), read once per kernel; empty for None.

    Args:
        kernel: a ``varlen_attn`` (from :func:`torch_varlen_kernel`), or None.

    Returns:
        The names of its parameters.

    Example::

        >>> varlen_parameters(None)   # no kernel (torch < 2.10): no parameters
        frozenset()
        >>> "window_size" in varlen_parameters(torch_varlen_kernel()) or torch.__version__ < "2.11"   # from 2.11
        True
    """
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
    direct: bool = True,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hk, D] -> [T, Hq, D] through torch's ``varlen_attn`` in whichever signature it has:
    a window ``(left, right)`` as flash-attn counts it, grouped KV heads (repeated where there is no
    ``enable_gqa``), and ``scale`` (folded into the query where the kernel takes none).

    Args:
        kernel: the ``varlen_attn`` to call (:func:`torch_varlen_kernel`).
        q: the queries of every sequence, concatenated ``[T, Hq, D]``.
        k: the keys ``[T, Hk, D]`` (``Hq`` a multiple of ``Hk``).
        v: the values ``[T, Hk, D]``.
        cu_q: int32 query bounds ``(0, l0, l0 + l1, ...)`` on ``q``'s device.
        cu_k: int32 key bounds, likewise.
        max_q: the longest query sequence.
        max_k: the longest key sequence.
        scale: the softmax scale (None: ``1/sqrt(D)``).
        window: ``(left, right)`` keys a query sees beside its diagonal, as flash-attn counts (-1: unbounded).
        causal: causal within each sequence.
        direct: on CUDA, the flash kernel without ``varlen_attn``'s wrapper where it is checked here
            (:func:`~foundry_attn.attention.aten_flash.runs_directly`).

    Returns:
        The output ``[T, Hq, D]``.

    Raises:
        ValueError: a window was asked of a kernel without ``window_size`` (torch 2.10).

    This example is not run here: needs a CUDA GPU (torch's varlen kernel has no CPU version; torch >= 2.10).

    Example::

        >>> q = torch.randn(40, 8, 64, device="cuda", dtype=torch.bfloat16)  # documents of 17, 23  # doctest: +SKIP
        >>> k = v = torch.randn(40, 2, 64, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
        >>> cu = torch.tensor([0, 17, 40], dtype=torch.int32, device="cuda")  # doctest: +SKIP
        >>> call_varlen(torch_varlen_kernel(), q, k, v, cu, cu, 23, 23, scale=0.125).shape  # doctest: +SKIP
        torch.Size([40, 8, 64])
    """
    left, right = window
    if direct and q.is_cuda and runs_directly(q, kernel, call_varlen):
        return flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, (left, 0 if causal else right))
    params = varlen_parameters(kernel)
    extra: dict[str, Any] = {}
    if "window_size" in params:
        extra["window_size"] = (left, 0 if causal else right)
    elif (left, right) != (-1, -1):
        raise ValueError(f"foundry_attn: torch {torch.__version__} varlen_attn has no window_size (torch >= 2.11)")
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
