"""The dense backends' document-aware functions: ``sdpa`` and ``eager`` per document, ``flex_attention`` on a mask.

sdpa and eager run each document alone in at most 8 calls per layer, whatever the document count: the documents
grouped by length into right-padded batches (:mod:`foundry_attn.attention.length_groups`, :func:`by_length`; on the
CPU a document of 64 tokens or more is a call of its own, as cheap there as its share of a batch); eager on a flat
row of at most :data:`SHORT_ROW` tokens in one call under a block-diagonal mask; under ``torch.compile`` every
document in one opaque op (:mod:`foundry_attn.attention.compiled_op`). flex makes one call
over the flat row with a document ``BlockMask`` (:mod:`foundry_attn.attention.block_masks`). sdpa, eager and flex let a
query see ``sliding_window`` keys (itself included), as their stock code in transformers 4.51 does. Each opens with
:func:`~foundry_attn.attention.function_calls.open_call`; :mod:`foundry_attn.attention.functions` registers them.
Core module: torch and transformers only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import torch

from foundry_attn.attention.backends import EAGER, FLEX, SDPA
from foundry_attn.attention.block_masks import BLOCK_MASKS
from foundry_attn.attention.compiled_op import document_attention, eager_document, eager_math, sdpa_document
from foundry_attn.attention.documents import Documents
from foundry_attn.attention.function_calls import expand_kv, open_call, softmax_scale

#: eager on a flat row this short whose documents would take several calls runs them in one, under a block-diagonal
#: mask: its ``T x T`` scores (at most 16k a head) cost less than the calls saved (``foundry-attn bench host``, six
#: documents of 3-13 tokens: 0.83x the time of stock's padded rows, from 1.29x). Not sdpa: our flat path hands
#: torch's SDPA one document at a time, never a mask to honour (a patch that ignores masks cannot make it leak)
SHORT_ROW = 128


def _one_call(docs: Documents, query: torch.Tensor) -> bool:
    """A flat row of at most :data:`SHORT_ROW` tokens whose documents :func:`by_length` would run in several calls."""
    return query.shape[0] == 1 and query.shape[2] <= SHORT_ROW and len(docs.groups(query.device).shapes) > 1


def _compiled(
    kind: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    docs: Documents,
    window: int | None,
    scaling: float | None,
    softcap: float | None,
    dropout: float,
) -> torch.Tensor:
    """Under ``torch.compile``: every document in one opaque op over host-side bounds (no recompile per layout)."""
    if dropout:
        raise ValueError(
            f"foundry_attn: {kind} with attention dropout {dropout} under torch.compile is not "
            "supported; set attention_dropout: 0, or train uncompiled"
        )
    return document_attention(
        query, key, value, docs.bounds_on("cpu"), kind, window or 0, softmax_scale(query, scaling), softcap or 0.0
    )[0]


# ---- sdpa and eager: one call per group of documents of about one length -----------------------------------


def by_length(
    docs: Documents,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    grouped: bool = False,
) -> torch.Tensor:
    """Every document alone, in one call of ``attend`` per group of documents of about one length
    (:meth:`Documents.groups`, at most :data:`~foundry_attn.attention.length_groups.MAX_GROUPS`): each group
    right-padded into one batch, causal within each document, its real tokens put back in row order. Documents of one
    length are a reshape (one document: the row as it is); on the CPU a long document runs alone, a view of the row
    (:data:`~foundry_attn.attention.length_groups.CPU_ALONE`); grouped KV heads are repeated in the gather (unless
    ``grouped``). Where every document runs alone (each of its own length; on the CPU, groups that would not halve the
    calls), ``LengthGroups.pad`` splits the row once and ``LengthGroups.unpad`` joins the outputs by one cat. Rows
    (``B > 1``: documents of one length laid out once per batch, one per row) are attended as they are.

    Args:
        docs: the documents of the row.
        query: ``[B, H, S, D]``.
        key: ``[B, H_kv, S, D]``.
        value: ``[B, H_kv, S, Dv]``.
        attend: causal attention over right-padded documents, ``(q, k, v)`` -> ``[n, H, L, Dv]``
            (:func:`~foundry_attn.attention.compiled_op.sdpa_document`: a real query sees only real keys).
        grouped: ``attend`` takes grouped KV heads as they are (sdpa); else they are repeated to the query's heads.

    Returns:
        The output ``[B, S, H, Dv]``, contiguous.

    Example::

        >>> q = k = v = torch.randn(1, 4, 57, 16)
        >>> docs = Documents.of([0, 17, 40, 57])   # on a GPU two calls: [2, 4, 17, 16] and [1, 4, 23, 16]
        >>> by_length(docs, q, k, v, lambda q, k, v: sdpa_document(q, k, v, None, None)).shape   # on the CPU three
        torch.Size([1, 57, 4, 16])
    """
    if query.shape[0] > 1:  # rows of one length, each a whole document (flat_inputs' even rows): no regrouping
        key, value = (key, value) if grouped else expand_kv(query, key, value)
        return attend(query, key, value).transpose(1, 2).contiguous()
    groups = docs.groups(query.device)
    if not groups.shapes:  # a row of no tokens
        return query.new_empty((*query.shape[:1], 0, query.shape[1], value.shape[-1]))
    repeat = 1 if grouped else query.shape[1] // key.shape[1]
    batches = zip(groups.pad(query), groups.pad(key, repeat), groups.pad(value, repeat), strict=True)
    return groups.unpad([attend(q, k, v) for q, k, v in batches])


def sdpa_documents(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal SDPA per document, one call per group of documents of about one length (:func:`by_length`: at most
    8 calls, right-padded batches, and on the CPU one per long document; one document or documents of one length: one
    plain causal call). A window adds a small mask of the group's padded length; no L x L mask.

    Args:
        module: the attention layer that calls (its ``is_causal``, ``training``).
        query: ``[B, H, S, D]``; on the flat path one row holding every document.
        key: ``[B, H_kv, S, D]`` (grouped KV heads go to SDPA as they are, as stock's call takes them).
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
        >>> out, _ = sdpa_documents(layer, q, k, v, None, foundry_documents=docs)   # q: [1, 4, 40, 16]
        >>> out.shape                                         # registered as "foundry_sdpa"
        torch.Size([1, 40, 4, 16])
    """
    docs = open_call(SDPA, module, query, attention_mask, dropout, softcap, kwargs)
    if docs is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if torch.compiler.is_compiling():
        key, value = expand_kv(query, key, value)
        out = _compiled(SDPA, query, key, value, docs, sliding_window, scaling, None, dropout)
        return out.transpose(1, 2).contiguous(), None
    return by_length(
        docs, query, key, value, lambda q, k, v: sdpa_document(q, k, v, sliding_window, scaling, dropout), grouped=True
    ), None


def _eager(
    module: torch.nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    additive: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """transformers' eager attention with the model's own additive mask (no documents). -> [B, H, S, D].

    Causal (bottom-right) where the module is and the model's mask is not: none, or padding only (GPT-2's
    ``[B, 1, 1, K]``); a full ``[B, 1, Q, K]`` mask is the model's own causal one and is used as it is."""
    k, v = expand_kv(q, k, v)
    mask = additive[..., : k.shape[-2]] if additive is not None else None
    padding_only = mask is None or mask.shape[-2] == 1
    if padding_only and getattr(module, "is_causal", False) and q.shape[-2] > 1:
        ql, kl = q.shape[-2], k.shape[-2]
        future = torch.ones(ql, kl, dtype=torch.bool, device=q.device).triu_(kl - ql + 1)
        causal = torch.zeros(ql, kl, dtype=q.dtype, device=q.device).masked_fill_(future, torch.finfo(q.dtype).min)
        mask = causal if mask is None else torch.maximum(mask + causal, mask.new_tensor(torch.finfo(q.dtype).min))
    return eager_math(q, k, v, softmax_scale(q, scaling), softcap, mask, dropout, module.training)


def eager_documents(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' eager math per document (causal and window per document), one call per group of documents of
    about one length (:func:`by_length`: at most 8 calls, right-padded batches; on the CPU one per long document,
    and a batch split past :data:`~foundry_attn.attention.compiled_op.CPU_SCORES` scores); a flat row of at most
    :data:`SHORT_ROW` tokens that would take several calls: one, under :meth:`Documents.block_mask`.

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
        >>> out, _ = eager_documents(layer, q, k, v, None, foundry_documents=docs)   # q: [1, 4, 40, 16]
        >>> out.shape                                         # registered as "foundry_eager"
        torch.Size([1, 40, 4, 16])
    """
    docs = open_call(EAGER, module, query, attention_mask, dropout, softcap, kwargs)
    if docs is None:
        out = _eager(module, query, key, value, attention_mask, dropout, scaling, softcap)
        return out.transpose(1, 2).contiguous(), None
    if torch.compiler.is_compiling():
        key, value = expand_kv(query, key, value)
        out = _compiled(
            EAGER, query, key, value, docs, sliding_window, scaling, softcap, dropout if module.training else 0.0
        )
        return out.transpose(1, 2).contiguous(), None
    scale, training = softmax_scale(query, scaling), module.training

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        mask = docs.mask(q.shape[2], sliding_window, q)
        return eager_document(q, k, v, sliding_window, scale, softcap, dropout, training, mask)

    if query.shape[0] > 1:  # even rows, each a whole document: attended as they are (by_length's first case)
        return attend(query, *expand_kv(query, key, value)).transpose(1, 2).contiguous(), None
    if _one_call(docs, query):
        mask = docs.block_mask(sliding_window, query)
        out = eager_math(query, *expand_kv(query, key, value), scale, softcap, mask, dropout, training)
        return out.transpose(1, 2).contiguous(), None
    return by_length(docs, query, key, value, attend), None


# ---- flex: one call over the flat row with a document BlockMask -------------------------------------------


@functools.cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_documents(
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
    """One flex call over the flat row with a document ``BlockMask`` (:mod:`foundry_attn.attention.block_masks`; the
    window in the mask). Uncompiled on CPU (the only dependable flex there in torch 2.7), compiled elsewhere.

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
        >>> out, _ = flex_documents(layer, q, k, v, None, foundry_documents=docs)   # q: [1, 4, 40, 16]
        >>> out.shape                                         # registered as "foundry_flex_attention"
        torch.Size([1, 40, 4, 16])
    """
    docs = open_call(FLEX, module, query, attention_mask, dropout, softcap, kwargs)
    if docs is None:
        from transformers.integrations.flex_attention import flex_attention_forward

        out, _ = flex_attention_forward(module, query, key, value, attention_mask, scaling=scaling, softcap=softcap)
        return out, None
    from torch.nn.attention.flex_attention import flex_attention

    kernel = flex_attention if query.device.type == "cpu" else _compiled_flex()
    key, value = expand_kv(query, key, value)
    # a tensor: without return_lse flex_attention returns no (out, lse) pair, which its annotation does not say
    out = cast(
        torch.Tensor,
        kernel(query, key, value, block_mask=BLOCK_MASKS.get(docs, sliding_window, query.device), scale=scaling),
    )
    return out.transpose(1, 2).contiguous(), None
