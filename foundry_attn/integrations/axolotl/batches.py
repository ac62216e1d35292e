"""axolotl's packed batches (several documents a row, restarting ``position_ids``), read as they are: one flat row
for the attached model, and the Trainer's target count per document (docs/axolotl.md, "How axolotl's batches are read").
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import torch

from foundry_attn.checks import short

IGNORE_INDEX = -100
#: the keys a packed call carries per token; read and flattened together
TOKEN_KEYS = ("input_ids", "labels", "position_ids")


def _restarts(pos: torch.Tensor) -> torch.Tensor:
    """``[rows, width]`` booleans: True where a position does not follow the one before (a document starts)."""
    first = torch.ones_like(pos[:, :1], dtype=torch.bool)
    return torch.cat([first, pos[:, 1:] <= pos[:, :-1]], dim=1)


def check_document_mask(mask: torch.Tensor, positions: torch.Tensor) -> None:
    """Check a packed batch's ``attention_mask`` against its ``position_ids`` (one host sync): padding (0) is one run
    at an end of a row and starts a document; document numbers (beyond 1) change exactly where the positions restart.

    Args:
        mask: ``[rows, width]``, document numbers (1, 2, 3, 0 on padding) or 1/0.
        positions: ``[rows, width]`` position ids.

    Raises:
        ValueError: the row, what the mask says and what the positions say.

    Example::

        >>> check_document_mask(torch.tensor([[1, 1, 2, 2, 2, 0]]), torch.tensor([[0, 1, 0, 1, 2, 0]]))
    """
    for r, (m, p) in enumerate(zip(mask.tolist(), positions.tolist(), strict=True)):
        real = [k for k, v in enumerate(m) if v > 0]
        if not real:
            continue
        first, last = real[0], real[-1]
        if last - first + 1 != len(real):
            gaps = [k for k in range(first, last + 1) if m[k] == 0]
            raise ValueError(
                f"axolotl packed batch, row {r}: attention_mask has padding (0) inside the row at {short(gaps)}; "
                "foundry_attn reads padding only as one run at an end of a row"
            )
        for edge in (first, last + 1):  # where padding meets a document, the positions must restart
            if 0 < edge < len(p) and p[edge] > p[edge - 1]:
                raise ValueError(
                    f"axolotl packed batch, row {r}: padding meets a document at column {edge} but position_ids "
                    f"go on ({p[edge - 1]} -> {p[edge]}); the padding would read as part of a document"
                )
        starts = [k for k in real if k == first or p[k] <= p[k - 1]]
        if max(m) > 1:
            changes = [k for k in real if k == first or m[k] != m[k - 1]]
            if changes != starts:
                raise ValueError(
                    f"axolotl packed batch, row {r}: attention_mask document numbers start documents at "
                    f"{short(changes)} but position_ids restart at {short(starts)}; both must mark the same "
                    "documents"
                )


def read_packed(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[int, int] | None] | None:
    """A model call's keywords as the one flat row an attached model takes, or None for a call that is not packed.

    Packed: ``position_ids`` restarting inside a row of real tokens, or a mask of document numbers. Several rows become
    one row of ``rows x width`` tokens (each row's padding a document without targets); the mask, once checked
    (:func:`check_document_mask`), is dropped: the positions carry the documents.

    Args:
        kwargs: the keywords of the call (``input_ids``, ``labels``, ``position_ids``, ``attention_mask``, ...).

    Returns:
        The keywords to call with and ``(rows, width)`` to shape the logits back to (None: one row already), or None.

    Raises:
        ValueError: a mask that disagrees with the positions, or another per-token key this reader does not know.

    Example::

        >>> ids = torch.tensor([[5, 6, 7, 0], [8, 9, 10, 11]])
        >>> out, shape = read_packed({"input_ids": ids, "position_ids": torch.tensor([[0, 1, 0, 0], [0, 1, 0, 1]])})
        >>> out["input_ids"].shape, shape
        (torch.Size([1, 8]), (2, 4))
    """
    ids, pos, mask = kwargs.get("input_ids"), kwargs.get("position_ids"), kwargs.get("attention_mask")
    if not isinstance(ids, torch.Tensor) or not isinstance(pos, torch.Tensor) or ids.dim() != 2:
        return None
    if pos.shape != ids.shape or kwargs.get("past_key_values") is not None or torch.compiler.is_compiling():
        return None
    rows, width = ids.shape
    out = dict(kwargs)
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
            return None
        real = mask > 0
        inner = _restarts(pos)[:, 1:] & real[:, 1:] & real[:, :-1]
        if not bool(torch.stack([(mask > 1).any(), inner.any()]).any()):
            return None  # padded rows, one document each: stock trains them as they are
        check_document_mask(mask, pos)
        del out["attention_mask"]
    elif rows == 1 or not bool(_restarts(pos)[:, 1:].any()):
        return None  # one row: the attached forward reads it; no restart: not packed
    if rows == 1:
        return out, None
    others = [k for k, v in out.items() if k not in TOKEN_KEYS and isinstance(v, torch.Tensor) and v.shape == ids.shape]
    if others:
        raise ValueError(
            f"axolotl packed batch: per-token keys {others} beside {list(TOKEN_KEYS)}; foundry_attn reads packed rows "
            "with input_ids, labels, position_ids and an attention_mask only"
        )
    for key in TOKEN_KEYS:
        if isinstance(out.get(key), torch.Tensor):
            out[key] = out[key].reshape(1, rows * width)
    return out, (rows, width)


def shaped_back(output: Any, shape: tuple[int, int]) -> Any:
    """``output.logits`` of one flat row back to the batch's ``[rows, width, vocab]`` (where logits were returned).

    Args:
        output: the model's output.
        shape: ``(rows, width)`` of the batch (:func:`read_packed`).

    Returns:
        ``output``, its logits reshaped in place.

    Example::

        >>> shaped_back(model(**flat), (2, 128)).logits.shape
        torch.Size([2, 128, 64])
    """
    logits = getattr(output, "logits", None)
    rows, width = shape
    if isinstance(logits, torch.Tensor) and logits.dim() == 3 and logits.shape[:2] == (1, rows * width):
        output.logits = logits.reshape(rows, width, logits.shape[-1])
    return output


def document_targets(batch: Mapping[str, Any]) -> Mapping[str, Any]:
    """``batch`` (a copy) with each document's first token no target: what ``num_items_in_batch`` should count.

    Args:
        batch: a batch with ``labels`` and ``position_ids`` (anything else is returned as it is).

    Returns:
        The batch, or a copy whose ``labels`` are -100 where a document starts.

    Example::

        >>> document_targets({"labels": torch.tensor([[5, 6, 7, 8]]), "position_ids": torch.tensor([[0, 1, 0, 1]])})
        {'labels': tensor([[   5,    6, -100,    8]]), 'position_ids': tensor([[0, 1, 0, 1]])}
    """
    labels, pos = batch.get("labels"), batch.get("position_ids")
    if not isinstance(labels, torch.Tensor) or not isinstance(pos, torch.Tensor) or labels.shape != pos.shape:
        return batch
    if labels.dim() != 2:
        return batch
    starts = _restarts(pos)
    starts[:, 0] = False  # a row's first token is never a target (the Trainer counts labels[..., 1:])
    return {**batch, "labels": labels.masked_fill(starts, IGNORE_INDEX)}


def documents(positions: list[int]) -> list[int]:
    """The lengths of the documents a row of positions marks (a restart starts one).

    Args:
        positions: one row's position ids.

    Returns:
        The lengths, in order.

    Example::

        >>> documents([0, 1, 2, 0, 1, 0])
        [3, 2, 1]
    """
    starts = [k for k in range(len(positions)) if k == 0 or positions[k] <= positions[k - 1]]
    return [b - a for a, b in itertools.pairwise([*starts, len(positions)])]
