"""Padding-aware collation: real masks from true lengths, and packed documents.

    train_loader:
      name: foundry_attn_text
      padding: pack            # mask | pack | none
      overflow: split          # a document longer than max_seq_len: split | truncate
      dataset: {local: ./data, max_seq_len: 2048, ...}

Every batch (``mask`` and ``pack``) carries, besides ``input_ids``/``labels``/``position_ids``:

- ``doc_lens``: per row, the lengths of its documents as Python ints. Real tokens sit at the start of
  each row, padding after them. The model derives ``cu_seq_lens``/``max_length`` (FA2), block masks
  (SDPA, eager, flex) from these on the host, per microbatch, without a device sync.
- ``total_tokens`` / ``loss_generating_tokens``: per-row counts that LLM-Foundry's token counter reads.
- ``attention_mask`` (``mask`` mode only), so a stock HF model also sees the padding.

Labels are ``-100`` on padding and on the first token of every document, so no document is trained
to predict its neighbour. When pad == EOS, the first EOS after a row's content is a real token.
Core module: torch only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

PADDING_MODES = ("mask", "pack", "none")
OVERFLOW_MODES = ("split", "truncate")
IGNORE_INDEX = -100


def check_choice(key: str, value: str, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"{key}: unknown value {value!r}; valid values: {', '.join(choices)}")
    return value


def true_lengths(input_ids: torch.Tensor, pad_id: int, eos_id: int | None) -> torch.Tensor:
    """Real length of each row of ``input_ids`` [B, S] from its trailing pad run.

    With pad == EOS the first EOS of the trailing run ends the document, so it counts as real.
    A row made only of padding has length 0.
    """
    seq = input_ids.shape[-1]
    positions = torch.arange(seq, device=input_ids.device)
    last = torch.where(input_ids != pad_id, positions, -1).amax(dim=-1)
    length = last + 1
    if pad_id == eos_id:
        length = torch.where((last >= 0) & (length < seq), length + 1, length)
    return length


def split_at_eos(tokens: torch.Tensor, eos_id: int | None) -> list[torch.Tensor]:
    """Split a 1-D token row into documents; each EOS ends (and belongs to) its document."""
    if eos_id is None or tokens.numel() == 0:
        return [tokens] if tokens.numel() else []
    ends = (tokens == eos_id).nonzero().flatten().add_(1).tolist()
    if not ends or ends[-1] != tokens.numel():
        ends.append(tokens.numel())
    sizes = [b - a for a, b in zip([0, *ends[:-1]], ends, strict=True)]
    return list(torch.split(tokens, sizes))


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
    """

    def __init__(
        self, pad_id: int | None, eos_id: int | None, max_seq_len: int, mode: str = "mask",
        overflow: str = "split", split_text_at_eos: bool = True,
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

    def _rows(self, examples: Sequence[torch.Tensor | Mapping]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(real tokens, labels or None) per example, from explicit lengths when there are any."""
        if not examples:
            raise ValueError("empty batch: the collator got no examples (check device_batch_size and the dataset)")
        out: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        tensors = [torch.as_tensor(e if not isinstance(e, Mapping) else e["input_ids"]) for e in examples]
        explicit = [self._explicit_length(e) for e in examples]
        need = [i for i, n in enumerate(explicit) if n is None]
        if need:
            width = max(tensors[i].numel() for i in need)
            stacked = torch.full((len(need), width), self.pad_id, dtype=torch.long)
            for j, i in enumerate(need):
                stacked[j, : tensors[i].numel()] = tensors[i]
            for i, n in zip(need, true_lengths(stacked, self.pad_id, self.eos_id).tolist(), strict=True):
                explicit[i] = n
        for example, ids, n in zip(examples, tensors, explicit, strict=True):
            labels = example.get("labels") if isinstance(example, Mapping) else None
            labels = torch.as_tensor(labels)[:n] if labels is not None else None
            out.append((ids[:n].long(), labels))
        return out

    @staticmethod
    def _explicit_length(example: torch.Tensor | Mapping) -> int | None:
        if not isinstance(example, Mapping):
            return None
        if "length" in example:
            return int(example["length"])
        if "attention_mask" in example:
            return int(torch.as_tensor(example["attention_mask"]).sum())
        if "labels" in example:  # finetuning examples come unpadded
            return len(example["input_ids"])
        return None

    def _pieces(self, ids: torch.Tensor, labels: torch.Tensor | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The documents of one example, each at most ``max_seq_len`` long."""
        if self.mode == "pack" and labels is None and self.split_text_at_eos:
            pieces = [(d, d) for d in split_at_eos(ids, self.eos_id)]
        else:
            pieces = [(ids, ids if labels is None else labels)] if ids.numel() else []
        return [chunk for doc, lab in pieces for chunk in _fit(doc, lab, self.max_seq_len, self.overflow)]

    def _first_fit(self, docs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[list[int]]:
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
        docs: list[tuple[torch.Tensor, torch.Tensor]] = []
        layout: list[list[int]] = []  # mask mode: one row per document, an empty row stays empty
        for ids, lab in self._rows(examples):
            pieces = self._pieces(ids, lab)
            layout.extend([[len(docs) + k] for k in range(len(pieces))] or [[]])
            docs.extend(pieces)
        if self.mode == "pack":
            layout = self._first_fit(docs)
        doc_lens = [[docs[i][0].numel() for i in row] for row in layout]
        width = max(1, max(sum(lens) for lens in doc_lens))
        n = len(layout)
        input_ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        labels = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.zeros((n, width), dtype=torch.long)
        positions = torch.arange(width)
        for r, row in enumerate(layout):
            start = 0
            for i in row:
                doc, lab = docs[i]
                end = start + doc.numel()
                input_ids[r, start:end] = doc
                labels[r, start:end] = lab
                labels[r, start] = IGNORE_INDEX  # a document never predicts its neighbour
                position_ids[r, start:end] = positions[: end - start]
                start = end
            position_ids[r, start:] = positions[: width - start]  # the pad tail is its own segment
        total = [sum(lens) for lens in doc_lens]
        batch = {
            "input_ids": input_ids,
            "labels": labels,
            "position_ids": position_ids,
            "doc_lens": doc_lens,
            "total_tokens": total,
            "loss_generating_tokens": (labels[:, 1:] != IGNORE_INDEX).sum(dim=1).tolist(),
        }
        if self.mode == "mask":
            batch["attention_mask"] = (positions[None, :] < torch.tensor(total)[:, None]).long()
        return batch


def fill_ratio(batch: Mapping) -> float:
    """Real tokens / positions of a collated batch."""
    return sum(batch["total_tokens"]) / max(1, batch["input_ids"].numel())
