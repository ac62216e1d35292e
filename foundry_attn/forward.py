"""One forward of a HF causal LM that honours document boundaries under every backend.

    out = forward_documents(hf_model, batch)        # batch from foundry_attn.packing
    logits = repad_logits(out)                      # [rows, width, vocab], only if you need them

- ``flash_attention_2``: unpad once into one flat row of real tokens and pass ``cu_seq_lens_q/k`` and
  ``max_length_q/k``; every layer runs ``flash_attn_varlen_func`` with no unpad, re-pad or host sync.
- ``sdpa``: the same flat row; each document runs its own causal SDPA call (``sdpa_varlen``), so no
  L x L mask is built and no masked score is computed. Models outside transformers' attention registry,
  or batches of more than ``MAX_DOCUMENTS`` documents, get eager's 4-D mask instead.
- ``eager``: a 4-D block-diagonal causal additive mask, built once on the batch's device.
- ``flex_attention``: a document ``BlockMask`` cached per device and layout (eager flex on CPU).

Core module: torch and transformers only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

from foundry_attn.fa2_reference import reference_flash_attn
from foundry_attn.layout import Layout
from foundry_attn.masks import BlockMaskCache, block_causal_additive, eager_flex_attention
from foundry_attn.packing import IGNORE_INDEX
from foundry_attn.policy import EAGER, FA2, FLEX, SDPA
from foundry_attn.sdpa_varlen import BOUNDS_KEY, MAX_DOCUMENTS, document_sdpa, routes_through_attention_interface

_BLOCK_MASKS = BlockMaskCache()


def kernel_context(impl: str, device: torch.device, fa2_reference: bool = False) -> contextlib.AbstractContextManager:
    """The patch a backend needs around its forward: the FA2 reference kernel, or eager flex on CPU."""
    if impl == FA2 and fa2_reference:
        return reference_flash_attn()
    if impl == FLEX and device.type == "cpu":
        return eager_flex_attention()
    return contextlib.nullcontext()


def forward_documents(model: Any, batch: Mapping, block_masks: BlockMaskCache | None = None) -> Any:
    """Run ``model`` (a HF causal LM) on ``batch`` so that no document sees another."""
    ids = batch["input_ids"]
    layout = Layout.from_batch(batch)
    if layout.real_tokens == 0:
        raise ValueError("empty batch: no real tokens (every row is padding)")
    impl = model.config._attn_implementation
    positions = batch.get("position_ids")
    if positions is None:
        positions = layout.position_ids(ids.device)
    labels = batch.get("labels")
    if impl == FA2:
        cu = layout.cu_seq_lens(ids.device)
        return _forward_flat(model, ids, positions, labels, layout, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                             max_length_q=layout.max_length, max_length_k=layout.max_length)
    if impl == SDPA and len(layout.lengths) <= MAX_DOCUMENTS and routes_through_attention_interface(model):
        with document_sdpa():
            return _forward_flat(model, ids, positions, labels, layout, **{BOUNDS_KEY: layout.bounds()})
    if impl == FLEX:
        mask: Any = (block_masks or _BLOCK_MASKS).get(layout, ids.device)
    elif impl in (SDPA, EAGER):
        mask = block_causal_additive(layout.segment_ids(ids.device), model.dtype)
    else:
        raise ValueError(f"unsupported attention implementation {impl!r}; valid: {FA2}, {FLEX}, {SDPA}, {EAGER}")
    return model(input_ids=ids, position_ids=positions, attention_mask=mask, labels=labels, use_cache=False)


def _forward_flat(
    model: Any, ids: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor | None, layout: Layout,
    **attention_kwargs: Any,
) -> Any:
    """Unpad once into one flat row of real tokens; ``attention_kwargs`` tell each layer the documents."""
    flat = layout.real_indices(ids.device)
    if labels is not None:
        starts = torch.tensor(layout.bounds()[:-1], device=ids.device)
        labels = labels.reshape(-1)[flat][None].clone()
        labels[0, starts] = IGNORE_INDEX  # one flat row: no document predicts the next
    out = model(input_ids=ids.reshape(-1)[flat][None], position_ids=positions.reshape(-1)[flat][None],
                labels=labels, use_cache=False, **attention_kwargs)
    out.foundry_layout = (flat, layout.rows, layout.width)
    return out


def repad_logits(out: Any) -> torch.Tensor:
    """``[rows, width, vocab]`` logits; a flat FA2 output is scattered back once (zeros at padding)."""
    packed = getattr(out, "foundry_layout", None)
    if packed is None:
        return out.logits
    flat, rows, width = packed
    logits = out.logits[0]
    padded = logits.new_zeros(rows * width, logits.shape[-1])
    padded[flat] = logits
    out.logits = padded.view(rows, width, -1)
    out.foundry_layout = None
    return out.logits


def has_layout(batch: Mapping) -> bool:
    """A batch to lay out ourselves: ours (``doc_lens``), or any with a 2-D right-padding mask."""
    if batch.get("mode") is not None:  # ICL / generation batches keep the stock path
        return False
    mask = batch.get("attention_mask")
    return batch.get("doc_lens") is not None or (isinstance(mask, torch.Tensor) and mask.dim() == 2)
