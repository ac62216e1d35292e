"""Document-aware attention functions, registered in transformers' attention interface by name.

    from foundry_attn.flat.attach import attach
    attach(hf_model, "sdpa")            # proven: config._attn_implementation = "foundry_sdpa" (flat), or rows
    out = forward_documents(hf_model, batch)

Each backend (``flash_attention_2``, ``torch_varlen``, ``sdpa``, ``eager``, ``flex_attention``) has one function
here, registered once under ``foundry_<backend>`` with ``AttentionInterface.register``. The model runs one flat
row of real tokens, and every layer's call carries the documents as a keyword argument (``foundry_documents``,
:mod:`foundry_attn.attention.documents`) that transformers passes through to the attention function. Nothing is patched
for the length of a forward: checkpoint recompute, DDP/FSDP wrappers and ``torch.compile`` re-run the same
call with the same arguments, so they see the same documents. A call without documents (eval, generation, the
rows path) runs the backend's stock code on the model's own mask.

Every function opens the same way (:func:`_open`): take the documents out of the call, refuse any argument the
flat row would drop, and refuse a ``softcap`` or ``dropout`` that the backend table
(:data:`foundry_attn.attention.backends.BACKENDS`) says this backend cannot apply; the policy reads the same table, so a
model is refused before it is built rather than at its first call. Each function honours ``sliding_window``
(per layer), ``scaling`` and grouped KV heads. Windows follow each backend's stock convention in transformers
4.51: sdpa, eager and flex let a query see ``sliding_window`` keys (itself included), FA2 ``sliding_window + 1``.
sdpa and eager run each document alone in at most 8 calls per layer, whatever the document count: the documents
grouped by length into right-padded batches (:mod:`foundry_attn.attention.length_groups`, :func:`by_length`; on the
CPU a document of 64 tokens or more is a call of its own, as cheap there as its share of a batch).
Core module: torch and transformers only.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, cast

import torch
from transformers import modeling_flash_attention_utils as _fa_utils
from transformers.integrations.sdpa_attention import repeat_kv

from foundry_attn.attention.backends import (
    BACKENDS,
    EAGER,
    FA2,
    FA2_REFERENCE,
    FLEX,
    PREFIX,
    SDPA,
    TORCH_VARLEN,
)
from foundry_attn.attention.block_masks import BLOCK_MASKS
from foundry_attn.attention.compiled_op import document_attention, eager_document, eager_math, sdpa_document
from foundry_attn.attention.documents import DOCS_KEY, Documents, DocumentsDropped, FlatUnsupported, is_placeholder
from foundry_attn.attention.fa2_reference import reference_flash_attn
from foundry_attn.attention.torch_varlen import call_varlen, torch_varlen_kernel

#: transformers 5.x picks the flash kernel by the name it is given; 4.51 by what is installed
_FA_NAMES_ITS_KERNEL = "attn_implementation" in inspect.signature(_fa_utils._flash_attention_forward).parameters
_FA_TOP_LEFT = _fa_utils.flash_attn_supports_top_left_mask()  # flash-attn < 2.1 (read once, as transformers does)
#: the backends whose functions apply a softcap, named in the refusal of the others
_SOFTCAPPING = " or ".join(name for name, caps in BACKENDS.items() if caps.softcap)

#: what a layer may pass to attention that the flat row makes moot (positions and lengths are ours, no cache)
IGNORED_KWARGS = frozenset(
    (
        "position_ids",
        "cache_position",
        "past_key_value",
        "past_key_values",
        "use_cache",
        "output_attentions",
        "is_causal",
        "layer_idx",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "position_embeddings",
        "attn_implementation",
        "num_items_in_batch",  # the Trainer's loss normaliser (transformers 5.x passes it down to attention)
        # model-level flags transformers 5.x threads through every layer's **kwargs (TransformersKwargs): what the
        # model returns, not what attention computes; seq_idx numbers the documents we already carry
        "output_hidden_states",
        "output_router_logits",
        "return_dict",
        "seq_idx",
    )
)


def unhonoured(kwargs: dict) -> list[str]:
    """The arguments of an attention call that the flat path would drop: any that carries a value and is not
    known to be moot. Refusing them (rather than ignoring) keeps sinks, biases and the like exact.

    Args:
        kwargs: the keyword arguments of one attention call.

    Returns:
        Their names, sorted; empty when the flat path honours the call.

    Example::

        >>> unhonoured({"position_ids": pos, "s_aux": sinks, "dropout": 0.0})   # gpt-oss's attention sinks
        ['s_aux']
    """
    return sorted(
        k
        for k, v in kwargs.items()
        if k not in IGNORED_KWARGS and v is not None and v is not False and not (isinstance(v, float) and v == 0.0)
    )


def mask_content(mask: Any) -> str | None:
    """What a mask reaching a flat call carries beyond the structure our documents replace (causal, padding,
    documents: booleans, integers, zeros and the most negative values), or None: a learnable bias (the mask
    requires grad: Doge's dynamic mask), or values that are neither zero nor a masked score. The placeholder and
    None carry nothing; under ``torch.compile`` nothing is read (the proof, uncompiled, has read it).

    Args:
        mask: the ``attention_mask`` of one attention call.

    Returns:
        What it carries, in words, or None.

    Example::

        >>> mask_content(torch.zeros(1, 1, 4, 4)), mask_content(torch.randn(1, 1, 4, 4))
        (None, 'values that are neither 0 nor a masked score (a [1, 1, 4, 4] bias)')
    """
    if not isinstance(mask, torch.Tensor) or is_placeholder(mask) or torch.compiler.is_compiling():
        return None
    if mask.requires_grad:
        return f"a learnable bias (a {list(mask.shape)} tensor that requires grad)"
    if not mask.is_floating_point():
        return None
    masked = mask <= torch.finfo(mask.dtype).min / 2
    if bool(((mask == 0) | masked).all()):
        return None
    return f"values that are neither 0 nor a masked score (a {list(mask.shape)} bias)"


# ---- what every function shares -------------------------------------------------------------------------


def _open(
    backend: str,
    module: torch.nn.Module,
    query: torch.Tensor,
    attention_mask: Any,
    dropout: float,
    softcap: float | None,
    kwargs: dict,
) -> Documents | None:
    """The opening of every function: the documents of this call (popped from ``kwargs``), or None for a call
    without them (a placeholder mask without them means a caller dropped our argument); an argument the flat
    row would drop, or a softcap or dropout ``backend`` cannot apply (:data:`BACKENDS`), raises."""
    docs = kwargs.pop(DOCS_KEY, None)
    if docs is None:
        if query.shape[2] > 1 and is_placeholder(attention_mask):
            raise DocumentsDropped(module)
    else:
        extra = unhonoured(kwargs)
        if extra:
            raise FlatUnsupported(
                f"{type(module).__name__} passes {', '.join(repr(k) for k in extra)} to attention, which the flat "
                "path does not honour"
            )
        content = mask_content(attention_mask)
        if content:
            raise FlatUnsupported(
                f"{type(module).__name__} passes an attention_mask that carries {content}, which the flat path "
                "does not honour (our documents replace only causal, padding and document structure)"
            )
        if not torch.compiler.is_compiling():
            docs.calls += 1
    caps = BACKENDS[backend]
    if softcap and not caps.softcap:
        raise ValueError(
            f"foundry_attn: {backend} cannot apply attention logit softcap {softcap}; use {_SOFTCAPPING} for this model"
        )
    if dropout and not caps.dropout:
        raise ValueError(f"foundry_attn: {backend} cannot apply attention dropout {dropout}")
    return docs


def _expand_kv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped KV heads repeated to the query's heads (transformers' ``repeat_kv``)."""
    groups = query.shape[1] // key.shape[1]
    return repeat_kv(key, groups), repeat_kv(value, groups)


def _scale(query: torch.Tensor, scaling: float | None) -> float:
    return scaling if scaling is not None else query.shape[-1] ** -0.5


def _longest(docs: Documents, query: torch.Tensor) -> int:
    """The longest document; compiled, the row length: it bounds every document and is already a (dynamic)
    shape, so the graph guards on no layout."""
    return query.shape[2] if torch.compiler.is_compiling() else docs.max_length


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
        query, key, value, docs.bounds_on("cpu"), kind, window or 0, _scale(query, scaling), softcap or 0.0
    )[0]


# ---- sdpa and eager: one call per group of documents of about one length -----------------------------------


def by_length(
    docs: Documents,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Every document alone, in one call of ``attend`` per group of documents of about one length
    (:meth:`Documents.groups`, at most :data:`~foundry_attn.attention.length_groups.MAX_GROUPS`): each group
    right-padded into one batch, causal within each document, its real tokens put back in row order. Documents of one
    length are a reshape (one document: the row as it is); on the CPU a long document runs alone, a view of the row
    (:data:`~foundry_attn.attention.length_groups.CPU_ALONE`); grouped KV heads are repeated in the gather. Where
    every document runs alone (each of its own length; on the CPU, groups that would not halve the calls),
    ``LengthGroups.pad`` splits the row once and ``LengthGroups.unpad`` joins the outputs by one cat. Rows
    (``B > 1``: documents of one length laid out once per batch, one per row) are attended as they are.

    Args:
        docs: the documents of the row.
        query: ``[B, H, S, D]``.
        key: ``[B, H_kv, S, D]``.
        value: ``[B, H_kv, S, Dv]``.
        attend: causal attention over right-padded documents, ``(q, k, v)`` -> ``[n, H, L, Dv]``
            (:func:`~foundry_attn.attention.compiled_op.sdpa_document`: a real query sees only real keys).

    Returns:
        The output ``[B, S, H, Dv]``, contiguous.

    Example::

        >>> docs = Documents.of([0, 17, 40, 57])   # lengths 17, 23, 17: two calls, [2, H, 17, D] and [1, H, 23, D]
        >>> by_length(docs, q, k, v, lambda q, k, v: sdpa_document(q, k, v, None, None)).shape   # q: [1, 4, 57, 16]
        torch.Size([1, 57, 4, 16])
    """
    if query.shape[0] > 1:  # rows of one length, each a whole document (flat_inputs' even rows): no regrouping
        key, value = _expand_kv(query, key, value)
        return attend(query, key, value).transpose(1, 2).contiguous()
    groups = docs.groups(query.device)
    if not groups.shapes:  # a row of no tokens
        return query.new_empty((*query.shape[:1], 0, query.shape[1], value.shape[-1]))
    repeat = query.shape[1] // key.shape[1]
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
        >>> out, _ = sdpa_documents(layer, q, k, v, None, foundry_documents=docs)   # q: [1, 4, 40, 16]
        >>> out.shape                                         # registered as "foundry_sdpa"
        torch.Size([1, 40, 4, 16])
    """
    docs = _open(SDPA, module, query, attention_mask, dropout, softcap, kwargs)
    if docs is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if torch.compiler.is_compiling():
        key, value = _expand_kv(query, key, value)
        out = _compiled(SDPA, query, key, value, docs, sliding_window, scaling, None, dropout)
        return out.transpose(1, 2).contiguous(), None
    return by_length(
        docs, query, key, value, lambda q, k, v: sdpa_document(q, k, v, sliding_window, scaling, dropout)
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
    k, v = _expand_kv(q, k, v)
    mask = additive[..., : k.shape[-2]] if additive is not None else None
    padding_only = mask is None or mask.shape[-2] == 1
    if padding_only and getattr(module, "is_causal", False) and q.shape[-2] > 1:
        ql, kl = q.shape[-2], k.shape[-2]
        future = torch.ones(ql, kl, dtype=torch.bool, device=q.device).triu_(kl - ql + 1)
        causal = torch.zeros(ql, kl, dtype=q.dtype, device=q.device).masked_fill_(future, torch.finfo(q.dtype).min)
        mask = causal if mask is None else torch.maximum(mask + causal, mask.new_tensor(torch.finfo(q.dtype).min))
    return eager_math(q, k, v, _scale(q, scaling), softcap, mask, dropout, module.training)


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
    and a batch split past :data:`~foundry_attn.attention.compiled_op.CPU_SCORES` scores).

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
    docs = _open(EAGER, module, query, attention_mask, dropout, softcap, kwargs)
    if docs is None:
        out = _eager(module, query, key, value, attention_mask, dropout, scaling, softcap)
        return out.transpose(1, 2).contiguous(), None
    if torch.compiler.is_compiling():
        key, value = _expand_kv(query, key, value)
        out = _compiled(
            EAGER, query, key, value, docs, sliding_window, scaling, softcap, dropout if module.training else 0.0
        )
        return out.transpose(1, 2).contiguous(), None
    scale = _scale(query, scaling)
    return by_length(
        docs,
        query,
        key,
        value,
        lambda q, k, v: eager_document(
            q, k, v, sliding_window, scale, softcap, dropout, module.training, docs.mask(q.shape[2], sliding_window, q)
        ),
    ), None


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
    docs = _open(FLEX, module, query, attention_mask, dropout, softcap, kwargs)
    if docs is None:
        from transformers.integrations.flex_attention import flex_attention_forward

        out, _ = flex_attention_forward(module, query, key, value, attention_mask, scaling=scaling, softcap=softcap)
        return out, None
    from torch.nn.attention.flex_attention import flex_attention

    kernel = flex_attention if query.device.type == "cpu" else _compiled_flex()
    key, value = _expand_kv(query, key, value)
    # a tensor: without return_lse flex_attention returns no (out, lse) pair, which its annotation does not say
    out = cast(
        torch.Tensor,
        kernel(query, key, value, block_mask=BLOCK_MASKS.get(docs, sliding_window, query.device), scale=scaling),
    )
    return out.transpose(1, 2).contiguous(), None


# ---- FA2 and torch_varlen: one varlen call over the flat row ----------------------------------------------


def padding_of(mask: Any) -> torch.Tensor | None:
    """The ``[batch, keys]`` real-key mask inside a model's 4-D mask (a key no query may see is padding), for FA2's
    stock unpad; None when every key is real (or there is no mask). Causal and window structure is FA2's own.

    Args:
        mask: a model's attention mask (4-D bool, or additive with 0 where visible), or anything else.

    Returns:
        An int32 ``[batch, keys]`` tensor, 1 for a real key, or None.

    Example::

        >>> padding_of(mask)      # row 1's first key is padding: no query sees it
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
    docs = _open(FA2, module, query, attention_mask, dropout, softcap, kwargs)
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

    Example::

        >>> docs = Documents.of([0, 17, 40])                  # two documents in one 40-token row
        >>> out, _ = fa2_documents(layer, q, k, v, None, foundry_documents=docs)   # q: [1, 4, 40, 16], bf16 on a GPU
        >>> out.shape                                         # registered as "foundry_flash_attention_2"
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

    Example::

        >>> docs = Documents.of([0, 17, 40])                  # two documents in one 40-token row
        >>> out, _ = torch_varlen_documents(layer, q, k, v, None, foundry_documents=docs)   # q: [1, 4, 40, 16]
        >>> out.shape                                         # registered as "foundry_torch_varlen"
        torch.Size([1, 40, 4, 16])
    """
    docs = _open(TORCH_VARLEN, module, query, attention_mask, dropout, softcap, kwargs)
    if docs is None:  # rows, eval, generation: stock sdpa on the model's own mask, what the rows path runs
        return sdpa_documents(module, query, key, value, attention_mask, dropout, scaling, sliding_window, **kwargs)
    kernel = torch_varlen_kernel()
    if kernel is None:
        raise ValueError(f"foundry_attn: torch {torch.__version__} has no torch.nn.attention.varlen (torch >= 2.10)")
    cu, longest = docs.bounds_on(query.device), _longest(docs, query)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [1, H, T, D] -> [T, H, D]
    window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
    out = call_varlen(kernel, q, k, v, cu, cu, longest, longest, scale=_scale(query, scaling), window=window)
    return out[None], None


# ---- registration --------------------------------------------------------------------------------------------

FUNCTIONS = {
    FA2: fa2_documents,
    TORCH_VARLEN: torch_varlen_documents,
    SDPA: sdpa_documents,
    EAGER: eager_documents,
    FLEX: flex_documents,
    FA2_REFERENCE: fa2_reference_documents,
}


@functools.cache
def register() -> None:
    """Register every function with transformers (idempotent; registering changes nothing for other names).

    Example::

        >>> register()
        >>> "foundry_sdpa" in AttentionInterface._global_mapping     # flat/implementation.point sets it on a model
        True
    """
    from transformers.modeling_utils import AttentionInterface

    for name, fn in FUNCTIONS.items():
        AttentionInterface.register(PREFIX + name, fn)
    try:  # transformers 5.x builds masks per name, and none at all for a name it does not know
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:  # 4.51: the model's own mask code builds a 4-D mask for any name but its own
        return
    masks = {SDPA: SDPA, FLEX: FLEX}  # FA2, torch_varlen and eager take the additive mask on their mask branch
    for name in FUNCTIONS:
        AttentionMaskInterface.register(PREFIX + name, ALL_MASK_ATTENTION_FUNCTIONS[masks.get(name, EAGER)])
