"""A flat row padded to a capacity: a few fixed shapes for every batch, so a CUDA graph can capture the step and a
compiled step meets a few shapes; the kernel reads the documents' bounds on the device, so no host sync either.

    sizes = capacity_for(total=41, documents=2, capacity=4096)     # (512, 16): 512 tokens, 16 documents
    inputs = at_capacity(inputs, sizes)                             # the flat row padded, its Documents too

The padding is one more document after the real ones (pad tokens at position 0, no target), then zero-length
documents up to the document capacity (``cu_seqlens`` repeating its last offset, as torchtitan pins them);
``max_seqlen`` is pinned to the token capacity. The real documents keep their tokens, positions and targets, and
attend only to themselves, so the loss (a mean over the real targets) and every gradient are those of the row
unpadded: the proof runs these very inputs. Core module: torch only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from foundry_attn.attention.documents import DOCS_KEY, Documents
from foundry_attn.flat.packing import IGNORE_INDEX

#: token buckets per capacity: a row pads up to the next multiple of capacity / BUCKETS
BUCKETS = 8
#: the fewest document slots (real documents, the padding and zero-length ones); else the next power of two
LEAST_DOCUMENTS = 16


def bucket(capacity: int) -> int:
    """The step a row's length rounds up to: ``capacity / BUCKETS`` tokens (at least 1).

    Args:
        capacity: the most tokens a padded row holds.

    Returns:
        The bucket's size in tokens.

    Example::

        >>> bucket(4096)
        512
    """
    return max(1, capacity // BUCKETS)


def capacity_for(total: int, documents: int, capacity: int) -> tuple[int, int] | None:
    """The padded sizes of a flat row of ``total`` tokens in ``documents`` documents, or None past ``capacity``.

    Args:
        total: the row's real tokens.
        documents: its documents.
        capacity: the most tokens a padded row holds (its largest bucket).

    Returns:
        ``(tokens, slots)``: the row's padded length (a multiple of ``capacity / BUCKETS``) and its document slots
        (a power of two, at least ``LEAST_DOCUMENTS``, room for the padding's), or None where ``total`` exceeds
        ``capacity``.

    Example::

        >>> capacity_for(41, 2, 4096), capacity_for(5000, 2, 4096)
        ((512, 16), None)
    """
    if total > capacity or capacity < 1:
        return None
    step = bucket(capacity)
    tokens = min(capacity, -(-total // step) * step)
    slots = max(LEAST_DOCUMENTS, 1 << documents.bit_length())  # > documents: room for the padding's
    return tokens, slots


def at_capacity(inputs: Mapping[str, Any], sizes: tuple[int, int]) -> dict[str, Any]:
    """The flat row of ``inputs`` (``[1, T]``, its documents under ``DOCS_KEY``) padded to ``sizes``.

    Args:
        inputs: a flat row's model keywords (:func:`~foundry_attn.flat.inputs.flat_inputs`).
        sizes: ``(tokens, slots)`` from :func:`capacity_for`.

    Returns:
        The keywords with ``input_ids``, ``position_ids`` and ``labels`` padded to ``tokens``, and the
        :class:`~foundry_attn.attention.documents.Documents` padded to ``slots`` documents, ``max_seqlen`` pinned.

    Example::

        >>> padded = at_capacity(inputs, (512, 16))      # a 41-token row of two documents
        >>> padded["input_ids"].shape, padded[DOCS_KEY].bounds[:5], padded[DOCS_KEY].real
        (torch.Size([1, 512]), (0, 28, 41, 512, 512), 2)
    """
    docs: Documents = inputs[DOCS_KEY]
    tokens, slots = sizes
    ids = inputs["input_ids"]
    total, pad = ids.shape[1], tokens - ids.shape[1]
    out = dict(inputs)

    def padded(values: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        return torch.cat([values, fill.to(values.dtype)[None]], dim=1)

    out["input_ids"] = padded(ids, torch.zeros(pad, dtype=ids.dtype, device=ids.device))
    out["position_ids"] = padded(inputs["position_ids"], torch.zeros(pad, dtype=torch.long, device=ids.device))
    if inputs.get("labels") is not None:
        out["labels"] = padded(inputs["labels"], torch.full((pad,), IGNORE_INDEX, device=ids.device))
    bounds = (*docs.bounds[: docs.real + 1], *([tokens] * (slots - docs.real)))
    assert docs.bounds[-1] == total, (docs.bounds, total)
    out[DOCS_KEY] = padded_docs = Documents.of(bounds, ids.device, real=docs.real, pinned=tokens)
    # compiled: one graph for every bucket (as the unpadded row's); CUDA graphs then record one per bucket
    for value in (out["input_ids"], out["position_ids"], out.get("labels"), padded_docs.device_bounds):
        if value is not None:
            torch._dynamo.maybe_mark_dynamic(value, value.dim() - 1)
    return out
