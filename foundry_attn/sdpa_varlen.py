"""SDPA over packed documents without an L x L mask: one causal SDPA call per document.

A dense 4-D block-diagonal mask is correct but makes SDPA compute every score of the packed row (an
explicit mask skips nothing, not even the causal half). Here the batch is unpadded once into one flat row
of real tokens, as for FA2, and ``transformers``' ``sdpa`` attention function is wrapped for the duration of
the forward so that each document runs ``scaled_dot_product_attention(..., is_causal=True)`` on its own
slice. The document bounds travel as Python ints in one keyword, so no layer syncs the host.

Only models whose attention dispatches through ``ALL_ATTENTION_FUNCTIONS`` (Llama, Mistral, Qwen2,
GPT-NeoX, ... in transformers 4.51) can take this path; others keep the 4-D mask.
Core module: torch and transformers only.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

BOUNDS_KEY = "foundry_doc_bounds"
MAX_DOCUMENTS = 256  # past this many documents per batch, one masked call beats a Python loop per layer
_lock = threading.RLock()


def routes_through_attention_interface(model: torch.nn.Module) -> bool:
    """Whether ``model``'s modeling module picks attention from ``ALL_ATTENTION_FUNCTIONS``."""
    module = sys.modules.get(type(model).__module__)
    return module is not None and hasattr(module, "ALL_ATTENTION_FUNCTIONS")


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _document_sdpa(original: Any) -> Any:
    def sdpa_by_document(
        module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        bounds: Sequence[int] | None = kwargs.pop(BOUNDS_KEY, None)
        if bounds is None:
            return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        groups = getattr(module, "num_key_value_groups", 1)
        key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
        pieces = [
            F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e],
                                           dropout_p=dropout, scale=scaling, is_causal=True)
            for s, e in zip(bounds[:-1], bounds[1:], strict=True)
        ]
        return torch.cat(pieces, dim=2).transpose(1, 2).contiguous(), None

    return sdpa_by_document


@contextlib.contextmanager
def document_sdpa() -> Iterator[None]:
    """Wrap the ``sdpa`` attention function; calls without ``foundry_doc_bounds`` go to the original."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    with _lock:
        local = ALL_ATTENTION_FUNCTIONS._local_mapping
        had, previous = "sdpa" in local, local.get("sdpa")
        ALL_ATTENTION_FUNCTIONS["sdpa"] = _document_sdpa(ALL_ATTENTION_FUNCTIONS["sdpa"])
    try:
        yield
    finally:
        with _lock:
            if had:
                local["sdpa"] = previous
            else:
                local.pop("sdpa", None)
