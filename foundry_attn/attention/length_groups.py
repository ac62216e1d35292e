"""The documents of one flat row grouped by length, so sdpa and eager run a few padded batches, not one call each.

    groups = groups_for(lengths, query.device)   # Documents.groups(device): made once per layout and device
    pieces = groups.pad(query)                   # [B, H, T, D] -> one [B * n, H, L, D] batch per group (or view)
    out = groups.unpad([attend(p) for p in pieces])   # -> [B, T, H, D], row order

Each group is a batch of documents of about one length, right-padded to its longest: causal attention within a
padded document lets a real query see only its own document's real keys (every pad sits after them), so the plain
causal call (a window adds its own mask) is exact for the real rows, and the pad rows, which see real keys too, stay
finite and are dropped by :meth:`LengthGroups.unpad`. A pad position repeats its document's last token, so even a
pad's (zero) gradient stays inside its own document. The grouping (:func:`group_by_length`) pads the least attention
area (documents times padded length squared) in at most :data:`MAX_GROUPS` groups, each padded to at most
:data:`MAX_PADDING` times its real tokens where such a grouping exists; documents of one length are one group with no
padding and no gather at all (a reshape). A group of one document runs alone on every device, a view of the row with
no padding and no copy (one call either way: a gather and a scatter would buy it nothing; six documents of six lengths
are six views, as before grouping). On the CPU (:func:`groups_for`) a document of :data:`CPU_ALONE` tokens or more
runs alone too: there a call costs less than the padding and the copies would. Core module: torch only.
"""

from __future__ import annotations

import collections
import functools
import itertools
from typing import Any

import torch

#: the most padded batches (attention calls per layer, forward and backward each) a row's documents run in
MAX_GROUPS = 8
#: the most padded positions a group may hold per real token, where a grouping within :data:`MAX_GROUPS` allows it
MAX_PADDING = 2.0
#: over this many distinct lengths, groups are cut between bins of lengths (16 per octave), not between lengths
BINNED = 128
#: on the CPU, a document this long runs alone (one call, a view of the row, no padding): measured there (one thread,
#: sdpa forward and backward, mixes of 10-100, 50-250 and 220-350 tokens), grouped whole 1.02-1.09x the time of a call
#: per document, with those of 64 tokens or more alone 0.88-0.94x; shorter documents gain from grouping (256 of 8
#: tokens: 0.38x sdpa, 0.27x eager)
CPU_ALONE = 64


class LengthGroups:
    """The documents of one row in padded batches of about one length, and the indices that move tokens there.

    ``members[g]``: the documents (their indices, in row order) of padded group ``g``, two or more; ``alone``: the
    documents that run by themselves, views of the row, in row order (a group's only document; on the CPU the long
    ones too). ``shapes``: each batch's ``(documents, padded length)``, the groups shortest first, then the documents
    alone in row order; one attention call each. ``reshape_only``: one group of equal documents that fill the row in
    order, so padding is a reshape (no gather, no copy). The index tensors are made once per device (:meth:`indices`).
    """

    def __init__(
        self, lengths: tuple[int, ...], members: tuple[tuple[int, ...], ...], alone: tuple[int, ...] = ()
    ) -> None:
        self.lengths, self.members, self.alone = lengths, members, alone
        self.shapes = tuple((len(m), max(lengths[d] for d in m)) for m in members) + tuple(
            (1, lengths[d]) for d in alone
        )
        self.starts = (0, *itertools.accumulate(lengths))
        self.tokens = self.starts[-1]
        self.reshape_only = not alone and len(members) == 1 and len(set(lengths)) == 1
        self._indices: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def __repr__(self) -> str:
        return f"LengthGroups(shapes={self.shapes})"

    @property
    def padded(self) -> int:
        """How many positions the batches hold together.

        Returns:
            The sum over the batches of documents times padded length (the row's tokens when nothing is padded).

        Example::

            >>> group_by_length((3, 4, 8)).padded      # three lengths: three documents alone, no padding
            15
            >>> group_by_length((3, 4, 3), groups=1).padded   # one batch of three padded to 4: two pads
            12
        """
        return sum(n * length for n, length in self.shapes)

    def indices(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The gather and scatter indices of the padded groups on ``device``, made once per device (host work, no
        device sync).

        Args:
            device: where the row's tensors are.

        Returns:
            ``(take, slot, real)``, one entry per position of the padded groups: the row token it reads (int64; a pad
            reads its document's last token); where it goes back to (int64: a real token to its row position, each pad
            to one of its own past the row's end); whether it is real (bool).

        Example::

            >>> take, slot, real = group_by_length((2, 1), groups=1).indices("cpu")   # one batch: [0, 1], [2, pad]
            >>> take.tolist(), slot.tolist(), real.tolist()
            ([0, 1, 2, 2], [0, 1, 2, 3], [True, True, True, False])
        """
        key = str(device)
        if key not in self._indices:
            takes, reals = [torch.zeros(0, dtype=torch.long)], [torch.zeros(0, dtype=torch.bool)]
            for members, (_, width) in zip(self.members, self.shapes, strict=False):
                begin = torch.tensor([self.starts[d] for d in members])[:, None]
                length = torch.tensor([self.lengths[d] for d in members])[:, None]
                column = torch.arange(width)[None]
                takes.append((begin + torch.minimum(column, length - 1)).flatten())
                reals.append((column < length).flatten())
            take, real = torch.cat(takes), torch.cat(reals)
            slot = take.clone()
            slot[~real] = torch.arange(self.tokens, self.tokens + int((~real).sum()))
            made = tuple(t.to(device, non_blocking=True) for t in (take, slot, real))
            self._indices[key] = made  # type: ignore[assignment]
        return self._indices[key]

    def pad(self, heads: torch.Tensor, repeat: int = 1, zero_pads: bool = False) -> list[torch.Tensor]:
        """The row's tokens as one batch per group (padded) or document alone (a view), grouped KV heads repeated.
        Differentiable: the backward puts each real position's gradient back at its token and leaves the pads' out
        (what reads these batches is causal attention over right-padded documents, where a pad's gradient is exactly
        zero: no real query sees it, and its own output is dropped).

        Args:
            heads: ``[B, H, T, ...]`` (a query, key or value; a logsumexp), the tokens along dim 2.
            repeat: each head repeated this many times (``repeat_kv``: a key's or value's KV groups).
            zero_pads: pad positions hold zeros (a gradient), not their document's last token.

        Returns:
            Per batch of :attr:`shapes` a ``[B * documents, H * repeat, padded length, ...]`` tensor (views of
            ``heads`` for the documents alone without ``repeat``, and for all when :attr:`reshape_only`).

        Example::

            >>> [p.shape for p in group_by_length((2, 1, 5)).pad(torch.randn(1, 4, 8, 16))]   # each one alone
            [torch.Size([1, 4, 2, 16]), torch.Size([1, 4, 1, 16]), torch.Size([1, 4, 5, 16])]
            >>> [p.shape for p in group_by_length((2, 1, 2)).pad(torch.randn(1, 4, 5, 16))]   # a group, then a view
            [torch.Size([2, 4, 2, 16]), torch.Size([1, 4, 1, 16])]
        """
        if not self.members:  # every document alone: one split of the row (its backward one cat)
            split = [length for _, length in self.shapes]
            return list(_repeated(heads.transpose(1, 2), repeat).transpose(1, 2).split(split, dim=2))
        if not self.reshape_only:
            return list(_Pad.apply(heads, self, repeat, zero_pads))
        rows, (n, length) = heads.shape[0], self.shapes[0]
        tokens = _repeated(heads.transpose(1, 2), repeat)  # [B, T, H * repeat, ...]
        return [tokens.reshape(rows * n, length, *tokens.shape[2:]).transpose(1, 2)]

    def unpad(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The real tokens of the batches back in row order, token-major (what :meth:`pad` undoes, less the
        head-major layout); differentiable (a pad gets a zero gradient).

        Args:
            pieces: per batch of :attr:`shapes` a ``[B * documents, H, padded length, ...]`` tensor, in :meth:`pad`'s
                order.

        Returns:
            ``[B, T, H, ...]``, contiguous: each row token from its padded position.

        Example::

            >>> groups = group_by_length((2, 1, 5))
            >>> heads = torch.randn(1, 4, 8, 16)
            >>> torch.equal(groups.unpad(groups.pad(heads)), heads.transpose(1, 2))
            True
        """
        if not self.members:  # every document alone: one cat (its backward one split)
            return torch.cat(pieces, dim=2).transpose(1, 2).contiguous()
        if not self.reshape_only:
            return _Unpad.apply(self, *pieces)
        rows = pieces[0].shape[0] // self.shapes[0][0]
        tokens = pieces[0].transpose(1, 2)
        return tokens.reshape(rows, self.tokens, *tokens.shape[2:]).contiguous()


def _repeated(tokens: torch.Tensor, repeat: int) -> torch.Tensor:
    """``[B, T, H, ...]`` with each head repeated ``repeat`` times, side by side (``repeat_kv``'s order)."""
    if repeat == 1:
        return tokens
    b, t, h, *rest = tokens.shape
    return tokens.unsqueeze(3).expand(b, t, h, repeat, *rest).reshape(b, t, h * repeat, *rest)


def _summed(tokens: torch.Tensor, repeat: int) -> torch.Tensor:
    """:func:`_repeated`'s backward: ``[B, T, H * repeat, ...]`` -> ``[B, T, H, ...]``, the repeats summed."""
    if repeat == 1:
        return tokens
    b, t, h, *rest = tokens.shape
    return tokens.reshape(b, t, h // repeat, repeat, *rest).sum(3)


def _slots(groups: LengthGroups, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Each padded group's part of :meth:`LengthGroups.indices`' ``slot``."""
    return groups.indices(device)[1].split([n * length for n, length in groups.shapes[: len(groups.members)]])


def _spans(groups: LengthGroups) -> list[tuple[int, int]]:
    """Each document alone's ``(start, length)`` in the row."""
    return [(groups.starts[d], groups.lengths[d]) for d in groups.alone]


def _batched(tokens: torch.Tensor, documents: int) -> torch.Tensor:
    """``[B, n * L, H, ...]`` (a group's run of the padded buffer) -> ``[B * n, H, L, ...]``."""
    rows, positions = tokens.shape[:2]
    return tokens.reshape(rows * documents, positions // documents, *tokens.shape[2:]).transpose(1, 2)


def _run(piece: torch.Tensor, rows: int) -> torch.Tensor:
    """:func:`_batched` undone: ``[B * n, H, L, ...]`` -> ``[B, n * L, H, ...]``."""
    tokens = piece.transpose(1, 2)
    return tokens.reshape(rows, -1, *tokens.shape[2:])


class _Pad(torch.autograd.Function):
    """:meth:`LengthGroups.pad`: one gather forward, through the repeated heads' stride-0 view (the documents alone:
    views, or one repeat each); backward, one scatter through the permutation ``slot`` into an uninitialised buffer
    (no zeros, no ``index_add``), whose first ``tokens`` positions are the row's gradient. Layout changes happen
    inside, so a batch adds no autograd node of its own."""

    @staticmethod
    def forward(
        ctx: Any, heads: torch.Tensor, groups: LengthGroups, repeat: int, zero_pads: bool
    ) -> tuple[torch.Tensor, ...]:
        tokens = heads.transpose(1, 2)  # [B, T, H, ...]
        pieces: list[torch.Tensor] = []
        if groups.members:
            take, _, real = groups.indices(heads.device)
            b, t, h, *rest = tokens.shape
            source = tokens.unsqueeze(3).expand(b, t, h, repeat, *rest) if repeat > 1 else tokens
            padded = source.index_select(1, take).view(b, take.numel(), h * repeat, *rest)
            if zero_pads:
                padded.masked_fill_(~real.view(1, -1, *(1,) * (padded.dim() - 2)), 0)
            runs = padded.split([n * length for n, length in groups.shapes[: len(groups.members)]], dim=1)
            pieces += [_batched(run, n) for run, (n, _) in zip(runs, groups.shapes, strict=False)]
        for start, length in _spans(groups):
            pieces.append(_repeated(tokens.narrow(1, start, length), repeat).transpose(1, 2))
        ctx.groups, ctx.repeat = groups, repeat
        return tuple(pieces)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        groups: LengthGroups = ctx.groups
        rows = grads[0].shape[0] // groups.shapes[0][0]
        runs = [_summed(_run(grad, rows), ctx.repeat) for grad in grads]
        back = runs[0].new_empty((rows, groups.padded, *runs[0].shape[2:]))
        for slot, run in zip(_slots(groups, grads[0].device), runs, strict=False):
            back.index_copy_(1, slot, run)
        for (start, length), run in zip(_spans(groups), runs[len(groups.members) :], strict=True):
            back.narrow(1, start, length).copy_(run)
        return back[:, : groups.tokens].transpose(1, 2), None, None, None


class _Unpad(torch.autograd.Function):
    """:meth:`LengthGroups.unpad`: one scatter through the permutation ``slot`` forward (the documents alone: a
    copy each); one gather backward, the pads' gradient zero (the documents alone: views)."""

    @staticmethod
    def forward(ctx: Any, groups: LengthGroups, *pieces: torch.Tensor) -> torch.Tensor:
        rows = pieces[0].shape[0] // groups.shapes[0][0]
        runs = [_run(piece, rows) for piece in pieces]
        out = runs[0].new_empty((rows, groups.padded, *runs[0].shape[2:]))
        for slot, run in zip(_slots(groups, pieces[0].device), runs, strict=False):
            out.index_copy_(1, slot, run)
        for (start, length), run in zip(_spans(groups), runs[len(groups.members) :], strict=True):
            out.narrow(1, start, length).copy_(run)
        ctx.groups = groups
        return out[:, : groups.tokens]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        groups: LengthGroups = ctx.groups
        pieces: list[torch.Tensor] = []
        if groups.members:
            pads = grad.new_zeros((grad.shape[0], groups.padded - groups.tokens, *grad.shape[2:]))
            padded = torch.cat([grad, pads], dim=1)
            for slot, (n, _) in zip(_slots(groups, grad.device), groups.shapes, strict=False):
                pieces.append(_batched(padded.index_select(1, slot), n))
        pieces += [grad.narrow(1, start, length).transpose(1, 2) for start, length in _spans(groups)]
        return None, *pieces


def _ranges(
    widths: list[int], counts: list[int], tokens: list[int], groups: int, limit: float | None
) -> list[int] | None:
    """Where to cut ascending bins of documents (each: its longest, how many, their tokens) into at most ``groups``
    runs: the least attention area (documents times longest squared), each run padding at most ``limit`` times its
    tokens (None: any). The runs' ends, or None where no such cut exists."""
    m = len(widths)
    width = torch.tensor([0, *widths], dtype=torch.float64)
    count = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.float64)
    token = torch.tensor([0, *itertools.accumulate(tokens)], dtype=torch.float64)
    docs = count[None, :] - count[:, None]  # [i, j]: bins i..j-1 as one run, padded to width[j]
    area = torch.where(docs > 0, docs * width[None, :] ** 2, torch.inf)
    if limit is not None:
        area = area.masked_fill(docs * width[None, :] > limit * (token[None, :] - token[:, None]), torch.inf)
    best = torch.full((m + 1,), torch.inf, dtype=torch.float64)
    best[0] = 0.0
    cuts, totals = [], []
    for _ in range(groups):
        best, cut = (best[:, None] + area).min(dim=0)
        cuts.append(cut)
        totals.append(float(best[m]))
    runs = min(range(groups), key=lambda k: (totals[k], k))
    if totals[runs] == float("inf"):
        return None
    ends, end = [], m
    for k in range(runs, -1, -1):
        ends.append(end)
        end = int(cuts[k][end])
    return ends[::-1]


def _bin(length: int) -> int:
    """The bin of a length where there are many: exact below 32, else rounded up to 16 steps per octave."""
    step = 1 << max(0, length.bit_length() - 5)
    return -(-length // step) * step


@functools.lru_cache(maxsize=64)
def group_by_length(lengths: tuple[int, ...], groups: int = MAX_GROUPS, alone: int | None = None) -> LengthGroups:
    """The documents grouped by length into at most ``groups`` padded batches: each distinct length its own group
    where there are few enough, else the grouping of the sorted lengths with the least attention area (documents
    times padded length squared), each group padding at most :data:`MAX_PADDING` times its tokens where possible
    (over :data:`BINNED` distinct lengths, cut only between bins of 16 per octave). A group of one document runs
    alone instead, a view of the row (one call either way), unless every document has one length (one group, a
    reshape). Cached per layout, so a layout's indices are made once.

    Args:
        lengths: each document's length, in row order (documents of no tokens belong to no group).
        groups: the most groups.
        alone: documents this long or longer run alone, unpadded (None: only a group's only document), unless every
            document has one length.

    Returns:
        The :class:`LengthGroups`.

    Example::

        >>> group_by_length((8,) * 256).shapes                  # equal documents: one batch, a reshape
        ((256, 8),)
        >>> group_by_length((5, 1, 8, 2, 7)).shapes              # five lengths: five views, in row order
        ((1, 5), (1, 1), (1, 8), (1, 2), (1, 7))
        >>> group_by_length((5, 1, 5, 2, 1)).shapes              # repeated lengths grouped, the one 2 alone
        ((2, 1), (2, 5), (1, 2))
        >>> group_by_length(tuple(range(1, 101))).shapes[-1]     # 100 lengths in 8 groups
        (9, 100)
        >>> group_by_length((5, 300, 1, 5, 300), alone=64).shapes   # the long ones alone, and the one 1
        ((2, 5), (1, 300), (1, 1), (1, 300))
    """
    if alone is not None and len(set(lengths)) > 1:
        long = {d for d, n in enumerate(lengths) if n >= alone}
        rest = group_by_length(tuple(0 if n >= alone else n for n in lengths), groups)
        return LengthGroups(tuple(lengths), rest.members, tuple(sorted(long.union(rest.alone))))
    counted = collections.Counter(n for n in lengths if n > 0)
    if len(counted) <= groups:
        bins = {n: n for n in counted}
        ends = list(range(1, len(counted) + 1))
    else:
        bins = {n: _bin(n) if len(counted) > BINNED else n for n in counted}
        widths, counts, tokens = {}, collections.Counter[int](), collections.Counter[int]()
        for n, c in sorted(counted.items()):
            widths[bins[n]] = n  # ascending: the bin's longest
            counts[bins[n]] += c
            tokens[bins[n]] += c * n
        keys = sorted(widths)
        columns = [widths[k] for k in keys], [counts[k] for k in keys], [tokens[k] for k in keys]
        ends = _ranges(*columns, groups, MAX_PADDING) or _ranges(*columns, groups, None) or []
    keys = sorted(set(bins.values()))
    group_of = {key: g for g, (lo, hi) in enumerate(itertools.pairwise([0, *ends])) for key in keys[lo:hi]}
    members: list[list[int]] = [[] for _ in ends]
    for d, n in enumerate(lengths):
        if n > 0:
            members[group_of[bins[n]]].append(d)
    if len(set(lengths)) == 1:  # one length: one group, a reshape (one document: the row as it is)
        return LengthGroups(tuple(lengths), tuple(tuple(m) for m in members))
    # a group of one document gains nothing from a gather and a scatter: it runs alone, a view of the row (one call
    # either way, so still at most ``groups`` calls)
    solo = tuple(sorted(m[0] for m in members if len(m) == 1))
    return LengthGroups(tuple(lengths), tuple(tuple(m) for m in members if len(m) > 1), solo)


def _worth_it(groups: LengthGroups) -> LengthGroups:
    """``groups`` where they at least halve the calls; else every document alone (a split of the row, one call each):
    on the CPU a few calls saved do not pay for the gather and the scatter (measured: ``make demo``'s model, rows of
    14 documents of 8-120 tokens, a pair of one length in about half of them, 5-8% slower grouped)."""
    documents = sum(1 for n in groups.lengths if n > 0)
    if groups.members and 2 * len(groups.shapes) > documents:
        return LengthGroups(groups.lengths, (), tuple(d for d, n in enumerate(groups.lengths) if n > 0))
    return groups


def groups_for(lengths: tuple[int, ...], device: torch.device) -> LengthGroups:
    """:func:`group_by_length` as ``device`` wants it: on an accelerator every document in at most
    :data:`MAX_GROUPS` batches; on the CPU the documents of :data:`CPU_ALONE` tokens or more alone, and every
    document alone where the groups would not halve the calls (then at most ``2 * MAX_GROUPS - 1`` calls for the
    short ones). On either, a group of one document runs alone, a view of the row.

    Args:
        lengths: each document's length, in row order.
        device: where the attention runs.

    Returns:
        The :class:`LengthGroups` (cached per layout and kind of device).

    Example::

        >>> groups_for((5, 300, 1, 5, 300), torch.device("cpu")).shapes    # 4 calls grouped: 5 alone, a split
        ((1, 5), (1, 300), (1, 1), (1, 5), (1, 300))
        >>> groups_for((5,) * 8 + (300, 1), torch.device("cpu")).shapes    # the 5s grouped, the others alone
        ((8, 5), (1, 300), (1, 1))
        >>> groups_for((5, 300, 1, 5, 300), torch.device("cuda")).shapes   # the 300s grouped; the 1 alone
        ((2, 5), (2, 300), (1, 1))
        >>> groups_for((130, 350, 220, 217, 295, 183), torch.device("cuda")).alone   # six lengths: six views
        (0, 1, 2, 3, 4, 5)
    """
    if device.type == "cpu":
        return _worth_it(group_by_length(lengths, MAX_GROUPS, CPU_ALONE))
    return group_by_length(lengths, MAX_GROUPS)
