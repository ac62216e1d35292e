"""What every document-aware attention function does with its call before it attends.

    docs = open_call(SDPA, module, query, attention_mask, dropout, softcap, kwargs)   # None: a call without documents

Each function of :mod:`foundry_attn.attention.functions` opens the same way (:func:`open_call`): take the documents
out of the call (``foundry_documents``, :mod:`foundry_attn.attention.documents`), refuse any argument the flat row
would drop (:func:`unhonoured`) and any mask content beyond the structure the documents replace
(:func:`mask_content`), and refuse a ``softcap`` or ``dropout`` that the backend table
(:data:`foundry_attn.attention.backends.BACKENDS`) says this backend cannot apply. Beside it, what the functions read
off a call the same way: grouped KV heads repeated to the query's (:func:`expand_kv`) and the softmax scale
(:func:`softmax_scale`).
Core module: torch and transformers only.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.integrations.sdpa_attention import repeat_kv

from foundry_attn.attention.backends import BACKENDS
from foundry_attn.attention.documents import DOCS_KEY, Documents, DocumentsDropped, FlatUnsupported, is_placeholder

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

        >>> sinks = torch.zeros(4)   # gpt-oss's attention sinks, one per head
        >>> unhonoured({"position_ids": torch.arange(8)[None], "s_aux": sinks, "dropout": 0.0})
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


def open_call(
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
    row would drop, or a softcap or dropout ``backend`` cannot apply (:data:`BACKENDS`), raises.

    Args:
        backend: the backend whose function is called (a key of :data:`BACKENDS`).
        module: the attention layer that calls.
        query: ``[B, H, S, D]``.
        attention_mask: the model's mask (on the flat path a placeholder).
        dropout: the attention dropout probability.
        softcap: the attention logit softcap (None: none).
        kwargs: the call's other keyword arguments; ``foundry_documents`` is popped from them.

    Returns:
        The :class:`Documents` of the row, or None for a call without them.

    Raises:
        DocumentsDropped: a placeholder mask reached the call without its documents.
        FlatUnsupported: the call passes an argument or mask content the flat path would drop.
        ValueError: a softcap or dropout this backend cannot apply (:data:`BACKENDS`).

    Example::

        >>> docs = Documents.of([0, 17, 40])
        >>> kwargs = {"foundry_documents": docs, "position_ids": torch.arange(40)[None]}   # moot on the flat row
        >>> open_call("sdpa", layer, q, None, 0.0, None, kwargs) is docs, list(kwargs)   # the documents, popped
        (True, ['position_ids'])
    """
    docs = kwargs.pop(DOCS_KEY, None)
    if docs is None:
        if query.shape[2] > 1 and is_placeholder(attention_mask):
            raise DocumentsDropped(module)
    else:
        # uncompiled, the common call's arguments are checked in one C-level test: only moot ones
        compiling = torch.compiler.is_compiling()
        extra = [] if not compiling and IGNORED_KWARGS.issuperset(kwargs) else unhonoured(kwargs)
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
        if not compiling:
            docs.calls += 1
    if softcap or dropout:
        caps = BACKENDS[backend]
        if softcap and not caps.softcap:
            raise ValueError(
                f"foundry_attn: {backend} cannot apply attention logit softcap {softcap}; use {_SOFTCAPPING} for this "
                "model"
            )
        if dropout and not caps.dropout:
            raise ValueError(f"foundry_attn: {backend} cannot apply attention dropout {dropout}")
    return docs


def expand_kv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped KV heads repeated to the query's heads (transformers' ``repeat_kv``).

    Args:
        query: ``[B, H, S, D]``.
        key: ``[B, H_kv, S, D]``.
        value: ``[B, H_kv, S, Dv]``.

    Returns:
        ``(key, value)`` with ``H`` heads each.

    Example::

        >>> k, v = expand_kv(torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16))
        >>> k.shape
        torch.Size([1, 4, 8, 16])
    """
    groups = query.shape[1] // key.shape[1]
    return (key, value) if groups == 1 else (repeat_kv(key, groups), repeat_kv(value, groups))


def softmax_scale(query: torch.Tensor, scaling: float | None) -> float:
    """The softmax scale of a call: the layer's ``scaling``, else ``D ** -0.5``.

    Args:
        query: ``[..., D]``.
        scaling: the layer's scale, or None.

    Returns:
        The scale.

    Example::

        >>> softmax_scale(torch.randn(1, 4, 8, 16), None)
        0.25
    """
    return scaling if scaling is not None else query.shape[-1] ** -0.5
