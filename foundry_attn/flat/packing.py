"""Padding-aware collation: real masks from true lengths, and packed documents.

    train_loader:
      name: foundry_attn_text
      padding: pack            # mask | pack | none
      overflow: split          # a document longer than max_seq_len: split | truncate
      dataset: {local: ./data, max_seq_len: 2048, ...}

Every batch (``mask`` and ``pack``) carries, besides ``input_ids``/``labels``/``position_ids``:

- ``doc_lens``: per row, the lengths of its documents as Python ints. Real tokens sit at the start of
  each row, padding after them. The forward derives the flat path's document bounds from these on the host, per
  microbatch, without a device sync (FA2's ``cu_seq_lens``/``max_length``, one SDPA or eager call per document,
  flex's block mask).
- ``total_tokens`` / ``loss_generating_tokens``: per-row counts that LLM-Foundry's token counter reads.
- ``sequence_id``: per token, the index of its document in the row (LLM-Foundry's packing key; the pad tail is
  a segment of its own, as in ``position_ids``), so MPT with ``attn_uses_sequence_id: true`` keeps them apart.
- ``attention_mask`` (``mask`` mode only), so a stock HF model also sees the padding.
- ``examples``: per row, how many examples begin in it; they sum to the examples the batch was made from
  (Composer's sample clock counts these, not rows, so a resumed run restarts at the right example).

Labels are ``-100`` on padding and on the first token of every document, so no document is trained
to predict its neighbour. When pad == EOS, the first EOS after a row's content is a real token.
Core module: torch only.
"""

from __future__ import annotations

import array
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from itertools import pairwise

import torch

from foundry_attn.checks import check_choice

PADDING_MODES = ("mask", "pack", "none")
OVERFLOW_MODES = ("split", "truncate")
IGNORE_INDEX = -100
Example = tuple[torch.Tensor, torch.Tensor | None]  # real tokens, labels (None: a text example)
Document = tuple[torch.Tensor, torch.Tensor]  # tokens, labels


def true_lengths(input_ids: torch.Tensor, pad_id: int, eos_id: int | None) -> torch.Tensor:
    """Real length of each row of ``input_ids`` [B, S] from its trailing pad run.

    With pad == EOS the first EOS of the trailing run ends the document, so it counts as real.
    A row made only of padding has length 0.

    Args:
        input_ids: ``[B, S]`` token ids, padded at the end.
        pad_id: the pad token.
        eos_id: the EOS token, or None.

    Returns:
        A ``[B]`` long tensor of lengths.

    Example::

        >>> true_lengths(torch.tensor([[5, 6, 2, 2, 2], [5, 6, 7, 8, 9]]), pad_id=2, eos_id=2)
        tensor([3, 5])
    """
    seq = input_ids.shape[-1]
    positions = torch.arange(seq, device=input_ids.device)
    last = torch.where(input_ids != pad_id, positions, -1).amax(dim=-1)
    length = last + 1
    if pad_id == eos_id:
        length = torch.where((last >= 0) & (length < seq), length + 1, length)
    return length


def _doc_sizes(ends: list[int], n: int) -> list[int]:
    """Sizes of the documents of an ``n``-token row whose documents end (exclusive) at ``ends``.

    Tokens after the last end form a last document of their own.
    """
    if n and (not ends or ends[-1] != n):
        ends = [*ends, n]
    return [b - a for a, b in pairwise([0, *ends])]


def _as_tensor(values: object) -> torch.Tensor:
    """``torch.as_tensor``, fast for a list of ints.

    For speed: torch converts a list element by element (~60 us for a few hundred tokens); ``array("q")`` +
    ``frombuffer`` copies it in one go. Anything else (tensors, arrays, empty or non-int lists) goes to torch.
    """
    if isinstance(values, list | tuple) and values:
        try:
            return torch.frombuffer(array.array("q", values), dtype=torch.long)
        except (TypeError, OverflowError):
            pass
    return torch.as_tensor(values)


def _fit(doc: torch.Tensor, labels: torch.Tensor, max_seq_len: int, overflow: str):
    """A document longer than ``max_seq_len``: split it into independent chunks, or truncate it."""
    if doc.numel() <= max_seq_len:
        return [(doc, labels)]
    if overflow == "truncate":
        return [(doc[:max_seq_len], labels[:max_seq_len])]
    return list(zip(doc.split(max_seq_len), labels.split(max_seq_len), strict=True))


class PaddingCollator:
    """Collate token rows or ``{input_ids, labels?, attention_mask?, length?}`` examples.

    ``mode="mask"``: one example per row, real ``attention_mask`` from true lengths.
    ``mode="pack"``: documents (a text row split at EOS; a whole finetuning example) laid end to end
    into rows of at most ``max_seq_len`` tokens, first fit in order, ``position_ids`` restarting at
    every document. In both modes the batch is trimmed to its longest row.

    Args:
        pad_id: the pad token (the EOS token is fine: true lengths come from the data, not from the pad).
        eos_id: the EOS token, where text rows split into documents (None: never split).
        max_seq_len: the longest row.
        mode: ``mask`` or ``pack``.
        overflow: what a document longer than ``max_seq_len`` does (``split`` into rows, ...).
        split_text_at_eos: split text rows at EOS into documents (``pack``).

    Returns:
        A callable: examples in, a batch out: ``input_ids`` and ``labels``; with ``mask`` the ``attention_mask``;
        with ``pack`` the ``position_ids``, ``sequence_id`` and ``doc_lens`` (the document lengths of each row,
        which :func:`~foundry_attn.path.forward.forward_documents` reads).

    Example::

        >>> collate = PaddingCollator(pad_id=0, eos_id=2, max_seq_len=8, mode="pack")
        >>> batch = collate([torch.tensor([5, 6, 2, 7, 8, 9, 2]), torch.tensor([4, 4, 2])])
        >>> batch["doc_lens"]
        [[3, 4], [3]]
    """

    def __init__(
        self,
        pad_id: int | None,
        eos_id: int | None,
        max_seq_len: int,
        mode: str = "mask",
        overflow: str = "split",
        split_text_at_eos: bool = True,
    ) -> None:
        if pad_id is None:
            raise ValueError(
                "the tokenizer has no pad token; set one, e.g. in YAML "
                "`tokenizer: {kwargs: {pad_token: <|endoftext|>}}` (the EOS token is fine here)"
            )
        self.mode = check_choice("padding", mode, ("mask", "pack"))
        self.overflow = check_choice("overflow", overflow, OVERFLOW_MODES)
        self.pad_id, self.eos_id, self.max_seq_len = pad_id, eos_id, max_seq_len
        self.split_text_at_eos = split_text_at_eos

    def _rows(self, examples: Sequence[torch.Tensor | Mapping]) -> list[Example]:
        """(real tokens, labels or None) per example, from explicit lengths when there are any."""
        if not examples:
            raise ValueError("empty batch: the collator got no examples (check device_batch_size and the dataset)")
        tensors = [_as_tensor(e["input_ids"] if isinstance(e, Mapping) else e).long() for e in examples]
        explicit = [self._explicit_length(e) for e in examples]
        need = [i for i, n in enumerate(explicit) if n is None]
        if need:
            width = max(tensors[i].numel() for i in need)
            stacked = torch.full((len(need), width), self.pad_id, dtype=torch.long)
            for j, i in enumerate(need):
                stacked[j, : tensors[i].numel()] = tensors[i]
            for i, n in zip(need, true_lengths(stacked, self.pad_id, self.eos_id).tolist(), strict=True):
                explicit[i] = n
        out: list[Example] = []
        for example, ids, n in zip(examples, tensors, explicit, strict=True):
            labels = example.get("labels") if isinstance(example, Mapping) else None
            out.append((ids[:n], _as_tensor(labels)[:n].long() if labels is not None else None))
        return out

    @staticmethod
    def _explicit_length(example: torch.Tensor | Mapping) -> int | None:
        if not isinstance(example, Mapping):
            return None
        if "length" in example:
            return int(example["length"])
        if "attention_mask" in example:
            return int(_as_tensor(example["attention_mask"]).sum())
        if "labels" in example:  # finetuning examples come unpadded
            return len(example["input_ids"])
        return None

    def _documents(self, examples: list[Example]) -> list[list[Document]]:
        """The documents (tokens, labels) of each example, each at most ``max_seq_len`` long.

        ``pack`` splits a text example (no labels) at EOS (unless ``split_text_at_eos`` is off); a finetuning
        example is one document.
        """
        split = self.mode == "pack" and self.split_text_at_eos and self.eos_id is not None
        text = [ids for ids, labels in examples if labels is None] if split else []
        # For speed: one EOS search over all text examples together, not one per example.
        eos_id = self.eos_id
        ends = (torch.cat(text) == eos_id).nonzero().flatten().add_(1).tolist() if text and eos_id is not None else []
        offset = 0  # where the next text example starts in that concatenation
        out = []
        for ids, labels in examples:
            n = ids.numel()
            if split and labels is None:
                mine = ends[bisect_right(ends, offset) : bisect_right(ends, offset + n)]
                pieces = [(d, d) for d in ids.split(_doc_sizes([e - offset for e in mine], n))]
                offset += n
            else:
                pieces = [(ids, ids if labels is None else labels)] if n else []
            out.append([chunk for doc, lab in pieces for chunk in _fit(doc, lab, self.max_seq_len, self.overflow)])
        return out

    def _first_fit(self, docs: list[Document]) -> list[list[int]]:
        """Indices of the documents in each packed row, placed first-fit in order."""
        rows: list[list[int]] = []
        room: list[int] = []
        for i, (doc, _) in enumerate(docs):
            j = next((r for r, free in enumerate(room) if free >= doc.numel()), None)
            if j is None:
                rows.append([])
                room.append(self.max_seq_len)
                j = len(rows) - 1
            rows[j].append(i)
            room[j] -= doc.numel()
        return rows or [[]]

    def __call__(self, examples: Sequence[torch.Tensor | Mapping]) -> dict:
        docs: list[Document] = []
        layout: list[list[int]] = []  # mask mode: one row per document, an empty row stays empty
        firsts: set[int] = set()  # the documents that begin an example
        empty_rows: list[int] = []  # the rows of examples without tokens (mask mode keeps them as empty rows)
        for pieces in self._documents(self._rows(examples)):
            if pieces:
                firsts.add(len(docs))
            else:
                empty_rows.append(len(layout))
            layout.extend([[len(docs) + k] for k in range(len(pieces))] or [[]])
            docs.extend(pieces)
        if self.mode == "pack":
            layout = self._first_fit(docs)
            empty_rows = [0] * len(empty_rows)
        started = [sum(i in firsts for i in row) for row in layout]
        for r in empty_rows:
            started[r] += 1
        doc_lens = [[docs[i][0].numel() for i in row] for row in layout]
        total = [sum(lens) for lens in doc_lens]
        width = max(1, max(total))
        n = len(layout)
        # The batch laid out flat, row after row: its documents, then its pad tail. For speed, each field is one
        # torch.cat of those parts, not one slice assignment per document.
        pad_ids = torch.full((width,), self.pad_id, dtype=torch.long)
        pad_labels = torch.full((width,), IGNORE_INDEX, dtype=torch.long)
        positions = torch.arange(width)
        id_parts, label_parts, position_parts, sequence_parts = [], [], [], []
        doc_starts = []
        start = 0
        for row, lens, tail in zip(layout, doc_lens, [width - t for t in total], strict=True):
            for k, (i, size) in enumerate(zip(row, lens, strict=True)):
                id_parts.append(docs[i][0])
                label_parts.append(docs[i][1])
                position_parts.append(positions[:size])
                sequence_parts.append(torch.full((size,), k, dtype=torch.long))
                doc_starts.append(start)
                start += size
            if tail:
                id_parts.append(pad_ids[:tail])
                label_parts.append(pad_labels[:tail])
                position_parts.append(positions[:tail])  # the pad tail is its own segment
                sequence_parts.append(torch.full((tail,), len(row), dtype=torch.long))
                start += tail
        input_ids = torch.cat(id_parts).view(n, width)
        labels = torch.cat(label_parts)
        labels[doc_starts] = IGNORE_INDEX  # a document never predicts its neighbour
        labels = labels.view(n, width)
        position_ids = torch.cat(position_parts).view(n, width)
        batch = {
            "input_ids": input_ids,
            "labels": labels,
            "position_ids": position_ids,
            "sequence_id": torch.cat(sequence_parts).view(n, width),
            "doc_lens": doc_lens,
            "total_tokens": total,
            "loss_generating_tokens": (labels[:, 1:] != IGNORE_INDEX).sum(dim=1).tolist(),
            "examples": started,  # per row, the examples that begin in it: they sum to len(examples)
        }
        if self.mode == "mask":
            batch["attention_mask"] = (positions[None, :] < torch.tensor(total)[:, None]).long()
        return batch
