"""The varlen backends' document-aware functions: one varlen call over the flat row, the documents as ``cu_seqlens``.

``flash_attention_2`` runs transformers' own FA2 code path with the documents as ``cu_seq_lens_*`` /
``max_length_*`` (no per-layer unpad, no host sync; a window lets a query see ``sliding_window + 1`` keys, as stock
FA2 does), ``fa2_reference`` the same on the pure-PyTorch reference kernel
(:mod:`foundry_attn.attention.fa2_reference`), ``torch_varlen`` PyTorch's own varlen kernel
(:mod:`foundry_attn.attention.torch_varlen`; ``sliding_window`` keys, as our sdpa). A call without documents runs the
backend's stock code on the model's own mask. Each opens with
:func:`~foundry_attn.attention.function_calls.open_call`; :mod:`foundry_attn.attention.functions` registers them.
Core module: torch and transformers only.
"""

from __future__ import annotations

import inspect
from typing import Any, cast

import torch
from transformers import modeling_flash_attention_utils as _fa_utils

from foundry_attn.attention.backends import FA2, TORCH_VARLEN
from foundry_attn.attention.dense_functions import sdpa_documents
from foundry_attn.attention.documents import Documents
from foundry_attn.attention.fa2_reference import reference_flash_attn
from foundry_attn.attention.function_calls import open_call, softmax_scale
from foundry_attn.attention.torch_varlen import call_varlen, torch_varlen_kernel

#: transformers 5.x picks the flash kernel by the name it is given; 4.51 by what is installed
_FA_NAMES_ITS_KERNEL = "attn_implementation" in inspect.signature(_fa_utils._flash_attention_forward).parameters
_FA_TOP_LEFT = _fa_utils.flash_attn_supports_top_left_mask()  # flash-attn < 2.1 (read once, as transformers does)


def _longest(docs: Documents, query: torch.Tensor) -> int:
    """The longest document, or the capacity it is pinned to; compiled, the row length: it bounds every document and
    is already a shape, so the graph guards on no layout."""
    return query.shape[2] if torch.compiler.is_compiling() else docs.pinned or docs.max_length


def padding_of(mask: Any) -> torch.Tensor | None:
    """The ``[batch, keys]`` real-key mask inside a model's 4-D mask (a key no query may see is padding), for FA2's
    stock unpad; None when every key is real (or there is no mask). Causal and window structure is FA2's own.

    Args:
        mask: a model's attention mask (4-D bool, or additive with 0 where visible), or anything else.

    Returns:
        An int32 ``[batch, keys]`` tensor, 1 for a real key, or None.

    Example::

        >>> mask = torch.ones(2, 1, 4, 4, dtype=torch.bool).tril()   # causal, two rows of 4 tokens
        >>> mask[1, :, :, 0] = False                                   # row 1's first key is padding: no query sees it
        >>> padding_of(mask)
        tensor([[1, 1, 1, 1],
                [0, 1, 1, 1]], dtype=torch.int32)
    """
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return None
    visible = mask if mask.dtype == torch.bool else mask == 0
    real = visible.any(dim=-2)[:, 0]
    return None if bool(real.all()) else real.to(torch.int32)


def _fa2(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
    kwargs: dict,
) -> tuple[torch.Tensor, None]:
    """transformers' own FA2 code path with the documents as ``cu_seq_lens_*`` / ``max_length_*``."""
    docs = open_call(FA2, module, query, attention_mask, dropout, softcap, kwargs)
    if docs is None:  # rows, eval, generation: stock FA2 on the padding the model's own mask holds
        padding = padding_of(attention_mask)
        return _flash_forward(
            module, query, key, value, dropout, scaling, sliding_window, softcap, kwargs, padding
        ), None
    cu, longest = docs.bounds_on(query.device), _longest(docs, query)
    kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    if kwargs.get("position_ids") is None:  # 4.51 takes the varlen path only when position_ids is given
        kwargs["position_ids"] = docs.positions(query.device)
    return _flash_forward(module, query, key, value, dropout, scaling, sliding_window, softcap, kwargs), None


def _flash_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
    kwargs: dict,
    padding: torch.Tensor | None = None,
) -> torch.Tensor:
    """transformers' ``_flash_attention_forward`` as its own ``flash_attention_forward`` calls it, but for the
    stock FA2 kernel by name: 5.x resolves the kernel from ``config._attn_implementation``, which is ours here.
    ``padding``: a 2-D mask of real keys (stock's per-layer unpad), for calls without our documents."""
    if _FA_NAMES_ITS_KERNEL:
        kwargs["attn_implementation"] = FA2
    kwargs.pop("is_causal", None)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    target = None
    if q.dtype == torch.float32:  # PEFT-style fp32 activations: back to what the kernel computes in
        if torch.is_autocast_enabled(q.device.type):
            target = torch.get_autocast_dtype(q.device.type)
        else:  # the projections' dtype (GPT-2's are Conv1D, not Linear)
            target = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    return _fa_utils._flash_attention_forward(
        q,
        k,
        v,
        padding,
        query_length=query.shape[2],
        is_causal=cast(bool, module.is_causal),
        dropout=dropout,
        softmax_scale=scaling,
        sliding_window=sliding_window,
        softcap=softcap,
        use_top_left_mask=_FA_TOP_LEFT,
        target_dtype=target,
        **kwargs,
    )


def fa2_documents(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """FA2 varlen through transformers' FA2 code path: no per-layer unpad, no host sync.

    Args:
        module: the attention layer that calls (its ``is_causal``, ``training``).
        query: ``[B, H, S, D]``; on the flat path one row holding every document.
        key: ``[B, H_kv, S, D]`` (grouped KV heads are repeated here).
        value: ``[B, H_kv, S, D]``.
        attention_mask: the model's mask (on the flat path a placeholder); without documents, what stock applies.
        dropout: the attention dropout probability.
        scaling: the softmax scale (None: ``D ** -0.5``).
        sliding_window: the layer's window (None: none).
        softcap: the attention logit softcap (None: none).
        **kwargs: the layer's other arguments; ``foundry_documents`` carries the :class:`Documents` of the row.

    Returns:
        ``(output, None)``: the output ``[B, S, H, D]`` and no attention weights.

    Raises:
        FlatUnsupported: the call passes an argument or mask content the flat path would drop.
        ValueError: a softcap or dropout this backend cannot apply (:data:`BACKENDS`).

    This example is not run here: needs flash-attn and a CUDA GPU (on a CPU :func:`fa2_reference_documents` runs
    the same code path).

    Example::

        >>> docs = Documents.of([0, 17, 40], "cuda")   # two documents in one 40-token row  # doctest: +SKIP
        >>> q, k, v = (t.to("cuda", torch.bfloat16) for t in (q, k, v))   # q: [1, 4, 40, 16]  # doctest: +SKIP
        >>> out, _ = fa2_documents(layer, q, k, v, None, foundry_documents=docs)  # doctest: +SKIP
        >>> out.shape                                  # registered as "foundry_flash_attention_2"  # doctest: +SKIP
        torch.Size([1, 40, 4, 16])
    """
    return _fa2(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, kwargs)


def fa2_reference_documents(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """:func:`fa2_documents` on the pure-PyTorch REFERENCE kernel (not flash-attn), installed for this call only.

    Args:
        module: the attention layer that calls (its ``is_causal``, ``training``).
        query: ``[B, H, S, D]``; on the flat path one row holding every document.
        key: ``[B, H_kv, S, D]`` (grouped KV heads are repeated here).
        value: ``[B, H_kv, S, D]``.
        attention_mask: the model's mask (on the flat path a placeholder); without documents, what stock applies.
        dropout: the attention dropout probability.
        scaling: the softmax scale (None: ``D ** -0.5``).
        sliding_window: the layer's window (None: none).
        softcap: the attention logit softcap (None: none).
        **kwargs: the layer's other arguments; ``foundry_documents`` carries the :class:`Documents` of the row.

    Returns:
        ``(output, None)``: the output ``[B, S, H, D]`` and no attention weights.

    Raises:
        FlatUnsupported: the call passes an argument or mask content the flat path would drop.
        ValueError: a softcap or dropout this backend cannot apply (:data:`BACKENDS`).

    Example::

        >>> docs = Documents.of([0, 17, 40])                  # two documents in one 40-token row
        >>> out, _ = fa2_reference_documents(layer, q, k, v, None, foundry_documents=docs)   # q: [1, 4, 40, 16]
        >>> out.shape                                         # registered as "foundry_fa2_reference"
        torch.Size([1, 40, 4, 16])
    """
    with reference_flash_attn():
        return _fa2(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, kwargs)


def torch_varlen_documents(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """PyTorch's varlen flash kernel over the flat row: the FA2 layout (``cu_seqlens``, no per-layer unpad, no
    host sync) without flash-attn. A window lets a query see ``sliding_window`` keys (as our sdpa does).

    Args:
        module: the attention layer that calls (its ``is_causal``, ``training``).
        query: ``[B, H, S, D]``; on the flat path one row holding every document.
        key: ``[B, H_kv, S, D]`` (grouped KV heads are repeated here).
        value: ``[B, H_kv, S, D]``.
        attention_mask: the model's mask (on the flat path a placeholder); without documents, what stock applies.
        dropout: the attention dropout probability.
        scaling: the softmax scale (None: ``D ** -0.5``).
        sliding_window: the layer's window (None: none).
        softcap: the attention logit softcap (None: none).
        **kwargs: the layer's other arguments; ``foundry_documents`` carries the :class:`Documents` of the row.

    Returns:
        ``(output, None)``: the output ``[B, S, H, D]`` and no attention weights.

    Raises:
        FlatUnsupported: the call passes an argument or mask content the flat path would drop.
        ValueError: a softcap or dropout this backend cannot apply, or torch < 2.10 (no varlen kernel).

    This example is not run here: needs a CUDA GPU (torch's varlen kernel has no CPU version; torch >= 2.10).

    Example::

        >>> docs = Documents.of([0, 17, 40], "cuda")   # two documents in one 40-token row  # doctest: +SKIP
        >>> q, k, v = (t.to("cuda", torch.bfloat16) for t in (q, k, v))   # q: [1, 4, 40, 16]  # doctest: +SKIP
        >>> out, _ = torch_varlen_documents(layer, q, k, v, None, foundry_documents=docs)  # doctest: +SKIP
        >>> out.shape                                  # registered as "foundry_torch_varlen"  # doctest: +SKIP
        torch.Size([1, 40, 4, 16])
    """
    docs = open_call(TORCH_VARLEN, module, query, attention_mask, dropout, softcap, kwargs)
    if docs is None:  # rows, eval, generation: stock sdpa on the model's own mask, what the rows path runs
        return sdpa_documents(module, query, key, value, attention_mask, dropout, scaling, sliding_window, **kwargs)
    kernel = torch_varlen_kernel()
    if kernel is None:
        raise ValueError(f"foundry_attn: torch {torch.__version__} has no torch.nn.attention.varlen (torch >= 2.10)")
    cu, longest = docs.bounds_on(query.device), _longest(docs, query)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [1, H, T, D] -> [T, H, D]
    window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
    out = call_varlen(kernel, q, k, v, cu, cu, longest, longest, scale=softmax_scale(query, scaling), window=window)
    return out[None], None
