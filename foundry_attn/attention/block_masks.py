"""The flex ``BlockMask`` cache: one document-causal (optionally windowed) mask per (device, documents, window),
built on the query's device and never moved, so pipeline stages and ``device_map`` each get their own.

    mask = BLOCK_MASKS.get(docs, sliding_window, query.device)

Core module: torch only.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from foundry_attn.attention.documents import Documents


class _BlockMasks:
    """Flex ``BlockMask`` per (device, documents, window), built on ``q.device`` (never moved); least recently
    used out past ``size``."""

    def __init__(self, size: int = 16) -> None:
        self.size = size
        self._cache: OrderedDict[tuple, Any] = OrderedDict()

    def get(self, docs: Documents, window: int | None, device: torch.device) -> Any:
        from torch.nn.attention.flex_attention import create_block_mask

        key = (str(device), docs.bounds, window)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        ids = docs.document_ids(device)

        def document_causal(b, h, q_idx, kv_idx):  # flex's mask_mod signature
            same = (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)
            return same & (q_idx - kv_idx < window) if window else same

        total = docs.bounds[-1]
        # torch 2.7 annotates ``device`` as str; it takes a torch.device (and 2.13 says so)
        mask = create_block_mask(document_causal, B=None, H=None, Q_LEN=total, KV_LEN=total, device=device)  # type: ignore[arg-type,unused-ignore]
        self._cache[key] = mask
        if len(self._cache) > self.size:
            self._cache.popitem(last=False)
        return mask


BLOCK_MASKS = _BlockMasks()
