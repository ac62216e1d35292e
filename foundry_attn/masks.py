"""Document masks for the backends that ignore packed ``position_ids`` (SDPA, eager, flex).

transformers 4.51 uses a 4-D additive mask as given, and a ``BlockMask`` as given under flex, so
handing them a block-diagonal causal mask makes packed documents independent under every backend.
Core module: torch and transformers only.
"""

from __future__ import annotations

import contextlib
import importlib
from collections import OrderedDict
from collections.abc import Iterator

import torch

from foundry_attn.layout import Layout
from foundry_attn.patching import patch_attribute


def block_causal_additive(segments: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[rows, 1, L, L] additive mask: 0 where a query may see a key (same segment, not later), min elsewhere.

    ``segments`` [rows, L] come from ``Layout.segment_ids`` on the batch's device; every position can
    see itself, so no softmax row is empty.
    """
    width = segments.shape[-1]
    causal = torch.ones(width, width, dtype=torch.bool, device=segments.device).tril_()
    allowed = (segments[:, :, None] == segments[:, None, :]) & causal
    mask = torch.zeros(allowed.shape, dtype=dtype, device=segments.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze_(1)


class BlockMaskCache:
    """Flex ``BlockMask`` per (device, layout): the ``mask_mod`` only captures tensors on that device."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._cache: OrderedDict[tuple, object] = OrderedDict()

    def get(self, layout: Layout, device: torch.device) -> object:
        from torch.nn.attention.flex_attention import create_block_mask

        key = (str(device), layout.signature())
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        segments = layout.segment_ids(device)

        def document_causal(b, h, q_idx, kv_idx):  # noqa: ANN001 - flex's mask_mod signature
            return (segments[b, q_idx] == segments[b, kv_idx]) & (q_idx >= kv_idx)

        block_mask = create_block_mask(
            document_causal, B=layout.rows, H=None, Q_LEN=layout.width, KV_LEN=layout.width, device=device
        )
        self._cache[key] = block_mask
        if len(self._cache) > self.size:
            self._cache.popitem(last=False)
        return block_mask


def _eager_flex(query, key, value, training=False, **kwargs):  # noqa: ANN001 - transformers' signature
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(query, key, value, **kwargs)


@contextlib.contextmanager
def eager_flex_attention() -> Iterator[None]:
    """Run transformers' flex path uncompiled (the only dependable flex on CPU in torch 2.7)."""
    module = importlib.import_module("transformers.integrations.flex_attention")
    patch = patch_attribute(module, "compile_friendly_flex_attention", replace=_eager_flex)
    try:
        yield
    finally:
        patch.remove()
