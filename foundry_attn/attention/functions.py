"""The table of document-aware attention functions, one per backend, registered in transformers by name.

    from foundry_attn.path.attach import attach
    attach(hf_model, "sdpa")            # proven: config._attn_implementation = "foundry_sdpa" (flat), or rows
    out = forward_documents(hf_model, batch)

Each backend (``flash_attention_2``, ``torch_varlen``, ``sdpa``, ``eager``, ``flex_attention``) has one function
in :data:`FUNCTIONS`, registered once under ``foundry_<backend>`` with ``AttentionInterface.register``
(:func:`register`). The model runs one flat row of real tokens, and every layer's call carries the documents as a
keyword argument (``foundry_documents``, :mod:`foundry_attn.attention.documents`) that transformers passes through to
the attention function. Nothing is patched for the length of a forward: checkpoint recompute, DDP/FSDP wrappers and
``torch.compile`` re-run the same call with the same arguments, so they see the same documents. A call without
documents (eval, generation, the rows path) runs the backend's stock code on the model's own mask.

Every function opens the same way (:func:`~foundry_attn.attention.function_calls.open_call`): take the documents out
of the call, refuse any argument the flat row would drop, and refuse a ``softcap`` or ``dropout`` that the backend
table (:data:`foundry_attn.attention.backends.BACKENDS`) says this backend cannot apply; the policy reads the same
table, so a model is refused before it is built rather than at its first call. Each function honours
``sliding_window`` (per layer), ``scaling`` and grouped KV heads. Windows follow each backend's stock convention in
transformers 4.51: sdpa, eager and flex let a query see ``sliding_window`` keys (itself included), FA2
``sliding_window + 1``.

The functions live by family: the opening they share in :mod:`foundry_attn.attention.function_calls`; sdpa, eager
and flex in :mod:`foundry_attn.attention.dense_functions` (sdpa and eager: at most 8 calls per layer, the documents
grouped by length, :func:`by_length`); FA2, its reference and torch_varlen in
:mod:`foundry_attn.attention.varlen_functions`. This module is their table and its registration; every name the
functions had here is still importable from it.
Core module: torch and transformers only.
"""

from __future__ import annotations

import functools
import importlib

from foundry_attn.attention.backends import EAGER, FA2, FA2_REFERENCE, FLEX, PREFIX, SDPA, TORCH_VARLEN
from foundry_attn.attention.dense_functions import by_length, eager_documents, flex_documents, sdpa_documents
from foundry_attn.attention.function_calls import IGNORED_KWARGS, mask_content, unhonoured
from foundry_attn.attention.varlen_functions import (
    fa2_documents,
    fa2_reference_documents,
    padding_of,
    torch_varlen_documents,
)

__all__ = [
    "FUNCTIONS",
    "IGNORED_KWARGS",
    "by_length",
    "eager_documents",
    "fa2_documents",
    "fa2_reference_documents",
    "flex_documents",
    "mask_content",
    "padding_of",
    "register",
    "sdpa_documents",
    "torch_varlen_documents",
    "unhonoured",
]

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

        >>> from transformers import AttentionInterface
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


def bypassed_by(backend: str) -> str | None:
    """A function a user registered under the stock name ``backend`` that our dispatch bypasses, named, or None.

    Args:
        backend: the stock name (``sdpa``, ``flash_attention_2``, ``flex_attention``).

    Returns:
        What the flat path bypasses and where it still runs, or None where the stock function is registered.

    Example::

        >>> from transformers import AttentionInterface
        >>> stock = AttentionInterface._global_mapping["sdpa"]
        >>> def my_sdpa(module, query, key, value, attention_mask, **kwargs): ...
        >>> AttentionInterface.register("sdpa", my_sdpa)
        >>> bypassed_by("sdpa")
        "...my_sdpa is registered as 'sdpa'; the flat path runs foundry_sdpa instead and bypasses it (...)"
        >>> AttentionInterface.register("sdpa", stock)   # the stock function back: nothing bypassed
        >>> bypassed_by("sdpa") is None
        True
    """
    from transformers.modeling_utils import AttentionInterface

    stock = {
        SDPA: ("transformers.integrations.sdpa_attention", "sdpa_attention_forward"),
        FA2: ("transformers.integrations.flash_attention", "flash_attention_forward"),
        FLEX: ("transformers.integrations.flex_attention", "flex_attention_forward"),
    }.get(backend)
    registered = AttentionInterface._global_mapping.get(backend)
    if stock is None or registered is None:
        return None
    original = getattr(importlib.import_module(stock[0]), stock[1], None)
    if registered is original:
        return None
    name = getattr(registered, "__qualname__", repr(registered))
    module = getattr(registered, "__module__", "?")
    return (
        f"{module}.{name} is registered as '{backend}'; the flat path runs foundry_{backend} instead and bypasses "
        "it (attn_path: rows runs it)"
    )
