"""Where the documents of a batch are: the one reader of a batch, on the host, no device sync.

    layout = Layout.from_batch(batch)    # what the forward lays out: doc_lens, else a 2-D mask's real tokens
    layout.bounds(), layout.real_tokens, layout.max_length, layout.restarting_positions()
    packed_rows(batch)                   # rows the batch marks as holding 2+ documents (what the verdict judges)

A batch from ``foundry_attn.flat.packing`` carries ``doc_lens`` (per row, its documents' lengths, real
tokens first and padding after); a user's 2-D ``attention_mask`` may pad on either side
(``starts``). From that alone this module derives what the forward needs: the document ``bounds`` in the flat
row (:class:`foundry_attn.attention.documents.Documents` carries them to attention), ``max_length``, the flat indices of
real tokens for unpad-once, and position ids that restart per document. :func:`packed_rows` reads the documents a
batch marks by other means too (LLM-Foundry's ``sequence_id``, restarting ``position_ids``), which stock models do
not honour: the inspector's verdict judges those, the forward does not lay them out (it trains as stock does).
Core module: torch only.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Mapping
from typing import NamedTuple

import torch

from foundry_attn.checks import short
from foundry_attn.flat.packing import IGNORE_INDEX


@dataclasses.dataclass(frozen=True)
class Layout:
    """Document layout of a ``[rows, width]`` batch."""

    doc_lens: tuple[tuple[int, ...], ...]
    width: int
    starts: tuple[int, ...] = ()  # per row, where its first real token sits (left padding); empty: all 0
    # what else the forward reads of the batch (not part of the layout's identity)
    marked: bool = dataclasses.field(default=False, compare=False)  # ``doc_lens``: positions restart per document
    positions: torch.Tensor | None = dataclasses.field(default=None, compare=False)  # its own ``position_ids``

    @classmethod
    def from_batch(cls, batch: Mapping) -> Layout:
        """From ``doc_lens``; else from a 2-D ``attention_mask`` (one host sync); else full rows.

        A mask row must be one contiguous run of ones (right, left or both sides padded); a row with gaps
        is refused, never misread.

        Args:
            batch: its ``input_ids`` ``[rows, width]``, and ``doc_lens``, ``attention_mask``, ``position_ids`` if any.

        Returns:
            The batch's layout.

        Raises:
            ValueError: an ``attention_mask`` row with more than one run of real tokens.

        Example::

            >>> Layout.from_batch({"input_ids": ids, "doc_lens": [[3, 4], [5]]}).bounds()  # ids: [2, 8]
            [0, 3, 7, 12]
        """
        ids = batch["input_ids"]
        rows, width = ids.shape
        positions = batch.get("position_ids")
        if batch.get("doc_lens") is not None:
            return cls(tuple(tuple(int(n) for n in row) for row in batch["doc_lens"]), width, (), True, positions)
        mask = batch.get("attention_mask")
        if mask is None or mask.dim() != 2:
            return cls(((width,),) * rows, width, positions=positions)
        real = mask.bool()
        pos = torch.arange(width, device=mask.device)
        first: list[int] = torch.where(real, pos, width).amin(-1).tolist()
        last: list[int] = torch.where(real, pos, -1).amax(-1).tolist()
        count: list[int] = real.sum(-1).tolist()
        gaps = [r for r in range(rows) if count[r] and last[r] - first[r] + 1 != count[r]]
        if gaps:
            raise ValueError(
                f"attention_mask rows {gaps[:8]} have gaps (more than one run of real tokens); "
                "foundry_attn takes one contiguous run per row (right or left padding), or doc_lens"
            )
        return cls(
            tuple((n,) if n else () for n in count),
            width,
            tuple(f if n else 0 for f, n in zip(first, count, strict=True)),
            positions=positions,
        )

    @property
    def own_positions(self) -> torch.Tensor | None:
        """The batch's own ``position_ids`` where they came with a mask (a user's), else None: with ``doc_lens`` or
        none given, each document counts from 0 (:meth:`restarting_positions`).

        Returns:
            The ``[rows, width]`` positions, or None.

        Example::

            >>> pos = torch.arange(8).expand(2, 8)                   # ids: [2, 8]
            >>> packed = Layout.from_batch({"input_ids": ids, "doc_lens": [[3, 4], [5]], "position_ids": pos})
            >>> full = Layout.from_batch({"input_ids": ids, "position_ids": pos})   # full rows, the user's positions
            >>> packed.own_positions is None, full.own_positions is pos
            (True, True)
        """
        return None if self.marked else self.positions

    @property
    def rows(self) -> int:
        """The number of rows of the batch.

        Returns:
            ``len(doc_lens)``.

        Example::

            >>> Layout(((3, 4), (5,)), 8).rows
            2
        """
        return len(self.doc_lens)

    def start(self, row: int) -> int:
        """Where ``row``'s first real token sits (0 unless left-padded).

        Args:
            row: the row's index.

        Returns:
            The column of its first real token.

        Example::

            >>> Layout(((4,), (4,)), 6, starts=(0, 2)).start(1)
            2
        """
        return self.starts[row] if self.starts else 0

    @functools.cached_property  # read by every derived quantity below; the layout is frozen
    def lengths(self) -> list[int]:
        """All document lengths, row after row.

        Returns:
            The lengths, flat.

        Example::

            >>> Layout(((3, 4), (5,)), 8).lengths
            [3, 4, 5]
        """
        return [n for row in self.doc_lens for n in row]

    @property
    def real_tokens(self) -> int:
        """How many real tokens the batch holds.

        Returns:
            The sum of all document lengths.

        Example::

            >>> Layout(((3, 4), (5,)), 8).real_tokens
            12
        """
        return sum(self.lengths)

    @property
    def max_length(self) -> int:
        """The longest document (FA2's ``max_length``).

        Returns:
            Its length; 0 for a batch without documents.

        Example::

            >>> Layout(((3, 4), (5,)), 8).max_length
            5
        """
        return max(self.lengths, default=0)

    def bounds(self) -> list[int]:
        """``[0, l0, l0+l1, ...]``: where each document starts and ends in the flat row of real tokens.

        Returns:
            The document bounds, ``len(lengths) + 1`` of them.

        Example::

            >>> Layout(((3, 4), (5,)), 8).bounds()
            [0, 3, 7, 12]
        """
        return [0, *itertools.accumulate(self.lengths)]

    def real_indices(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Flat indices (into ``rows * width``) of the real tokens, in order.

        Args:
            device: where the indices go.

        Returns:
            A ``[real_tokens]`` long tensor.

        Example::

            >>> Layout(((4,), (4,)), 6, starts=(0, 2)).real_indices()
            tensor([ 0,  1,  2,  3,  8,  9, 10, 11])
        """
        idx = [
            torch.arange(r * self.width + self.start(r), r * self.width + self.start(r) + sum(row))
            for r, row in enumerate(self.doc_lens)
        ]
        return torch.cat(idx).to(device, non_blocking=True) if idx else torch.zeros(0, dtype=torch.long)

    def restarting_positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The flat row's position ids: each document's real tokens count from 0 (what each document alone counts
        from, whichever side a row was padded on). A few host ops whatever the document count.

        Args:
            device: where the positions go.

        Returns:
            A ``[real_tokens]`` long tensor.

        Example::

            >>> Layout(((3, 4), (5,)), 8).restarting_positions()
            tensor([0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 4])
        """
        lengths = self.lengths
        if len(set(lengths)) <= 1:  # documents of one length: one arange, repeated
            return torch.arange(lengths[0] if lengths else 0, device=device).repeat(len(lengths))
        total = sum(lengths)
        starts = torch.repeat_interleave(torch.tensor(self.bounds()[:-1]), torch.tensor(lengths), output_size=total)
        return (torch.arange(total) - starts).to(device, non_blocking=True)


@dataclasses.dataclass(frozen=True)
class Truth:
    """What each document alone is given, read from the batch, never from the row a forward trains on: the batch's
    own ``position_ids`` (a user's, beside a 2-D mask) and ``labels`` at its real tokens, ``[1, tokens]`` each in the
    flat row's order. None: the model's own positions; every next token of a document is a target."""

    positions: torch.Tensor | None = None
    labels: torch.Tensor | None = None

    @classmethod
    def of(cls, layout: Layout, labels: torch.Tensor | None) -> Truth:
        """The batch's own positions (where its ``position_ids`` came with a mask, not with ``doc_lens``) and its
        ``labels``, at the real tokens of ``layout``.

        Args:
            layout: the batch's layout (:meth:`Layout.from_batch`).
            labels: the batch's ``[rows, width]`` labels, or None (none, or no target in the batch).

        Returns:
            The documents' truth.

        Example::

            >>> row, mask = torch.tensor([[0, 0, 6, 7, 8]]), torch.tensor([[0, 0, 1, 1, 1]])  # left-padded
            >>> labels = torch.tensor([[-100, -100, 7, 8, 9]])
            >>> Truth.of(Layout.from_batch({"input_ids": row, "attention_mask": mask}), labels).labels
            tensor([[7, 8, 9]])
        """
        flat = layout.real_indices(labels.device if labels is not None else "cpu")
        own = layout.own_positions
        return cls(
            None if own is None else own.reshape(-1)[flat.to(own.device)][None],
            None if labels is None else labels.reshape(-1)[flat][None],
        )

    def alone(self, span: tuple[int, int]) -> Truth:
        """The truth of the document at ``span`` of the flat row.

        Args:
            span: its ``(start, end)``.

        Returns:
            Its positions and labels (each None where the row's is).

        Example::

            >>> Truth(labels=torch.tensor([[5, 6, 7, 8]])).alone((1, 3)).labels
            tensor([[6, 7]])
        """
        s, e = span
        return Truth(*(None if t is None else t[:, s:e] for t in (self.positions, self.labels)))


def has_targets(batch: Mapping, labels: torch.Tensor) -> bool:
    """Whether any token has a target (host counts when the collator gave them: no device sync).

    Args:
        batch: the batch, read for the collator's ``loss_generating_tokens``.
        labels: its ``[rows, width]`` labels (on a GPU without counts: assumed True, no sync).

    Returns:
        True when some token is trained on.

    Example::

        >>> has_targets({"loss_generating_tokens": [6, 4]}, labels)
        True
    """
    counts = batch.get("loss_generating_tokens")
    if counts is not None:
        return sum(counts) > 0
    return labels.device.type != "cpu" or bool((labels[:, 1:] != IGNORE_INDEX).any())


def padding_side(mask: torch.Tensor) -> str | None:
    """Which side a 2-D mask pads its rows on (one host sync): ``"left"`` where any row with real tokens starts with
    padding, else ``"right"`` where any position is padding, else None (no padding: nothing to tell).

    Args:
        mask: a ``[rows, width]`` attention mask, 1 on real tokens.

    Returns:
        ``"left"``, ``"right"`` or None.

    Example::

        >>> padding_side(torch.tensor([[0, 1, 1], [1, 1, 1]])), padding_side(torch.tensor([[1, 1, 0]]))
        ('left', 'right')
    """
    real = mask.bool()
    left, padded = torch.stack([(~real[:, 0] & real.any(-1)).any(), (~real).any()]).tolist()
    return "left" if left else "right" if padded else None


def _runs(values: list[int]) -> list[int]:
    return [len(list(group)) for _, group in itertools.groupby(values)]


class DocumentRow(NamedTuple):
    """A row of a batch that holds two documents or more: where its first real token sits, and their lengths."""

    row: int
    start: int
    lengths: tuple[int, ...]


def packed_rows(batch: Mapping) -> list[DocumentRow]:
    """Every row the batch marks as holding two documents or more (one host sync).

    Read from ``doc_lens`` (foundry_attn's collator), else ``sequence_id`` (LLM-Foundry's packing: -1 on padding),
    else ``position_ids`` that restart inside a row (on real tokens when a 2-D ``attention_mask`` is given; a row's
    tail padding without a mask, :func:`padding_spans`, is no document).

    Args:
        batch: a batch with ``doc_lens``, ``sequence_id`` or ``position_ids`` (and ``attention_mask``).

    Returns:
        One :class:`DocumentRow` per such row; empty when the batch marks none.

    Example::

        >>> packed_rows({"position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3]])})   # one row, positions restarting
        [DocumentRow(row=0, start=0, lengths=(3, 4))]
    """
    if batch.get("doc_lens") is not None:
        rows = [DocumentRow(r, 0, tuple(int(n) for n in lens)) for r, lens in enumerate(batch["doc_lens"])]
        return [row for row in rows if len(row[2]) > 1]
    out: list[DocumentRow] = []
    seq = batch.get("sequence_id")
    if isinstance(seq, torch.Tensor) and seq.dim() == 2:
        for r, ids in enumerate(seq.tolist()):
            real = [i for i, v in enumerate(ids) if v >= 0]
            if real:
                out.append(DocumentRow(r, real[0], tuple(_runs([ids[i] for i in real]))))
        return [row for row in out if len(row[2]) > 1]
    pos = batch.get("position_ids")
    if not isinstance(pos, torch.Tensor) or pos.dim() != 2:
        return []
    mask = batch.get("attention_mask")
    real_mask = mask.bool().tolist() if isinstance(mask, torch.Tensor) and mask.shape == pos.shape else None
    ends = {r: s for r, s, e in padding_spans(batch) if e == pos.shape[1]}  # a row's tail padding, mask or none
    for r, p in enumerate(pos.tolist()):
        real = [i for i in range(ends.get(r, len(p))) if real_mask is None or real_mask[r][i]]
        if not real:
            continue
        starts = [k for k in range(len(real)) if k == 0 or p[real[k]] <= p[real[k - 1]]]
        lengths = tuple(b - a for a, b in itertools.pairwise([*starts, len(real)]))
        out.append(DocumentRow(r, real[0], lengths))
    return [row for row in out if len(row[2]) > 1]


def padding_spans(batch: Mapping) -> list[tuple[int, int, int]]:
    """The padding of packed rows that carry no mask (axolotl's, whose collator pads each row with a segment of its
    own, ``position_ids`` ``0..remainder``, and drops the mask): each segment between position restarts whose labels
    are all -100 and whose ids are one token repeated, of two tokens or more or at the end of its row (one host
    sync; a row's first token always starts a segment). Nothing is read without ``labels`` and ``position_ids``, or
    beside a 2-D ``attention_mask`` or ``doc_lens`` (they say what is padding).

    Args:
        batch: a batch, or a model call's keywords.

    Returns:
        ``(row, start, end)`` of each padding segment; empty where none, or none is read.

    Example::

        >>> ids, pos = torch.tensor([[5, 6, 7, 0, 0]]), torch.tensor([[0, 1, 2, 0, 1]])
        >>> padding_spans({"input_ids": ids, "position_ids": pos, "labels": torch.tensor([[5, 6, 7, -100, -100]])})
        [(0, 3, 5)]
    """
    ids, pos, labels = batch.get("input_ids"), batch.get("position_ids"), batch.get("labels")
    mask = batch.get("attention_mask")
    if batch.get("doc_lens") is not None or (isinstance(mask, torch.Tensor) and mask.dim() == 2):
        return []
    if not (isinstance(ids, torch.Tensor) and isinstance(pos, torch.Tensor) and isinstance(labels, torch.Tensor)):
        return []
    if ids.dim() != 2 or not ids.shape == pos.shape == labels.shape or not ids.numel():
        return []
    width = ids.shape[1]
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] <= pos[:, :-1]
    segment = starts.reshape(-1).cumsum(0) - 1
    n = int(starts.sum())
    flat_ids, zero = ids.reshape(-1), torch.zeros(n, dtype=ids.dtype, device=ids.device)
    targets = torch.zeros(n, dtype=torch.long, device=ids.device).index_add_(
        0, segment, (labels.reshape(-1) != IGNORE_INDEX).long()
    )
    low = zero.scatter_reduce(0, segment, flat_ids, "amin", include_self=False)
    high = zero.scatter_reduce(0, segment, flat_ids, "amax", include_self=False)
    first = starts.reshape(-1).nonzero().reshape(-1)
    ends = torch.cat([first[1:], first.new_tensor([ids.numel()])])
    padding = (targets == 0) & (low == high) & ((ends - first > 1) | (ends % width == 0))
    found = torch.stack([first, ends])[:, padding].tolist()
    return [(s // width, s % width, (e - 1) % width + 1) for s, e in zip(*found, strict=True)]


def flattened_lengths(batch: Mapping) -> list[int] | None:
    """The document lengths of one flat row as the ecosystem packs it (transformers' ``DataCollatorWithFlattening``,
    TRL's padding-free collator): ``cu_seq_lens_q``, else ``seq_idx``, else ``position_ids`` that restart, in a
    ``[1, tokens]`` batch without a mask or a cache; None for anything else (one host sync when it reads a tensor).

    Args:
        batch: a batch, or a model call's keywords.

    Returns:
        The document lengths, or None.

    Raises:
        ValueError: ``labels`` of another shape than ``input_ids``, or ``position_ids`` that mark other documents.

    Example::

        >>> row = torch.arange(7)[None]                               # one packed row: [1, 7]
        >>> flattened_lengths({"input_ids": row, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3]])})
        [3, 4]
    """
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
        return None
    if batch.get("attention_mask") is not None or batch.get("past_key_values") is not None:
        return None
    labels = batch.get("labels")
    pos = batch.get("position_ids")
    restarts = None
    if isinstance(pos, torch.Tensor) and pos.shape == ids.shape:
        p = pos[0].tolist()
        restarts = [k for k in range(len(p)) if k == 0 or p[k] <= p[k - 1]]
    lengths = None
    cu = batch.get("cu_seq_lens_q")
    seq = batch.get("seq_idx")
    if isinstance(cu, torch.Tensor) and cu.numel() > 1:
        bounds = [int(b) for b in cu.reshape(-1).tolist()]
        if bounds[-1] != ids.shape[1]:
            return None
        lengths, field = [b - a for a, b in itertools.pairwise(bounds) if b > a], "cu_seq_lens_q"
    elif isinstance(seq, torch.Tensor) and seq.shape == ids.shape:
        lengths, field = _runs(seq[0].tolist()), "seq_idx"
    elif restarts is not None and len(restarts) > 1:
        lengths, field = [b - a for a, b in itertools.pairwise([*restarts, ids.shape[1]])], "position_ids"
    if lengths is None:
        return None
    if isinstance(labels, torch.Tensor) and labels.shape != ids.shape:
        raise ValueError(
            f"packed batch: labels {list(labels.shape)} do not match input_ids {list(ids.shape)} (one label per "
            "token; an empty example in DataCollatorWithFlattening does this)"
        )
    starts = list(itertools.accumulate(lengths[:-1], initial=0))
    if restarts is not None and field != "position_ids" and restarts != starts:
        raise ValueError(
            f"packed batch: {field} puts documents at {short(starts)} but position_ids restart at "
            f"{short(restarts)}; both must mark the same documents (DataCollatorWithFlattening makes them together)"
        )
    return lengths
