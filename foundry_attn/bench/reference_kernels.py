"""Stand-in kernels with the signatures of kernels a machine may not have, for tests and benchmarks.

- :func:`flash_varlen_from_torch`: flash-attn's ``flash_attn_varlen_func`` over torch's ``varlen_attn`` (in
  either of its signatures), and :func:`flash_attn_func_via_sdpa`: flash-attn's dense ``flash_attn_func``
  through SDPA. Installed with ``fa2_reference.reference_flash_attn(varlen=, dense=)``, transformers' stock FA2
  code path runs on a GPU without flash-attn (``foundry-attn bench gpu``'s ``stock_unpad_per_layer`` tier).
- :func:`reference_varlen_attn`: torch >= 2.12 ``varlen_attn``'s signature over the pure-PyTorch reference of
  :mod:`foundry_attn.attention.fa2_reference`: the CPU stand-in for torch's CUDA-only kernel (NOT a GPU kernel).

Core module: torch only.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from foundry_attn.attention.fa2_reference import flash_attn_varlen_func as reference_varlen
from foundry_attn.attention.torch_varlen import call_varlen, torch_varlen_kernel, varlen_parameters


def _unsupported(
    dropout_p: float, softcap: float, alibi_slopes: object, return_attn_probs: bool, block_table: object = None
) -> None:
    if dropout_p or softcap or alibi_slopes is not None or return_attn_probs or block_table is not None:
        raise NotImplementedError(
            "flash-attn wrapper: dropout_p, softcap, alibi_slopes, return_attn_probs and block_table are not supported"
        )


def flash_varlen_from_torch(kernel: Callable | None = None) -> Callable:
    """flash-attn's ``flash_attn_varlen_func`` over torch's ``varlen_attn`` (or ``kernel``, with one of its
    signatures: 2.10 ``is_causal``, no ``scale`` (default scale only); 2.11 ``scale``, ``window_size=(left, right)``;
    2.12+ ``enable_gqa`` too), read from the signature."""
    kernel = kernel or torch_varlen_kernel()
    if kernel is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn (torch >= 2.10)")
    params = varlen_parameters(kernel)

    def flash_attn_varlen_func(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        alibi_slopes: object = None,
        deterministic: bool = False,
        return_attn_probs: bool = False,
        block_table: object = None,
    ) -> torch.Tensor:
        _unsupported(dropout_p, softcap, alibi_slopes, return_attn_probs, block_table)
        if "window_size" not in params and tuple(window_size) != (-1, -1):
            raise NotImplementedError(f"torch {torch.__version__} varlen_attn has no window_size (torch >= 2.11)")
        default = q.shape[-1] ** -0.5
        if (
            "scale" not in params
            and softmax_scale is not None
            and not math.isclose(softmax_scale, default, rel_tol=1e-6)
        ):
            raise NotImplementedError(
                f"torch {torch.__version__} varlen_attn has no scale (only 1/sqrt(head_dim)), asked for {softmax_scale}"
            )
        return call_varlen(
            kernel,
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            int(max_seqlen_q),
            int(max_seqlen_k),
            scale=softmax_scale,
            window=(window_size[0], window_size[1]),
            causal=causal,
        )

    return flash_attn_varlen_func


def flash_attn_func_via_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: object = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> torch.Tensor:
    """flash-attn's dense ``flash_attn_func`` (q [B, S, H, D]) through SDPA (flash on CUDA): rows with no padding."""
    _unsupported(dropout_p, softcap, alibi_slopes, return_attn_probs)
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError("flash_attn_func via SDPA: no window_size")
    if causal and q.shape[1] != k.shape[1]:  # flash-attn aligns bottom-right, SDPA's is_causal top-left
        raise NotImplementedError("flash_attn_func via SDPA: causal with query length != key length")
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=causal,
        scale=softmax_scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def reference_varlen_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
) -> torch.Tensor:
    """torch >= 2.12 ``varlen_attn``'s signature over the pure-PyTorch reference: the CPU stand-in (NOT a GPU
    kernel, not torch's), so the CPU run goes through the same wrapper and adapter code as a GPU run."""
    if not enable_gqa and query.shape[1] != key.shape[1]:
        raise ValueError("varlen_attn: query and key heads differ and enable_gqa is False")
    left, right = window_size
    return reference_varlen(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        softmax_scale=scale,
        causal=right == 0,
        window_size=(left, -1 if right == 0 else right),
    )
