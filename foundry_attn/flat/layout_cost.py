"""Which proven layout a batch runs, and in how many forwards: the cheapest, within the memory the device has free,
the same number of forwards on every rank. The one owner of that choice; the batch's plan
(:func:`foundry_attn.path.plan.plan_batch`) asks it once per batch, among the layouts proven exact.

    choice = state.choice                # a LayoutChoice, kept on the path's state
    layout, groups = choice.choose(hf_model, [256] * 16, "flat", candidates=True, grouped=False)
    choice.layout, choice.reason        # 'rows', "one document per row: 1.36 GFLOP, ... against the flat row ..."
    cheapest(ModelShape.of(hf_model), [256] * 16, ("flat", "rows"), stock_mask=True)   # the cost alone

The cost of a layout is the work of one training step (forward and backward, 3x the forward): the linear layers
grow with the positions a forward computes (real tokens and padding), attention with its score pairs. Our flat row
scores each document against itself (the sum of squared lengths); the flat row on stock's packed mask scores the
whole row (its length squared, the mask hides the rest but the kernel computes it); one document per row pads every
document to the longest (documents x longest, and documents x longest squared pairs). Memory: the activations a
backward keeps, and the attention weights a masked kernel stores (pairs x heads x layers). ``foundry-attn bench
layouts`` times the candidates side by side against this choice. Core module: torch only.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from foundry_attn.attention.config_values import config_value

log = logging.getLogger(__name__)

FLAT, ROWS = "flat", "rows"
#: activations a backward keeps per position, per layer, in units of the hidden size (attention and MLP inputs,
#: norms, the MLP's wider hidden: an order of magnitude, not a count)
ACTIVATIONS_PER_POSITION = 16
#: the share of free memory a layout may plan to take
MEMORY_SHARE = 0.8
#: the most forwards one batch's rows run in (documents grouped by length, one width per forward)
MOST_FORWARDS = 4
#: what one more forward costs per layer, in FLOPs of the device's work: a training step's host time per layer
#: (launches, Python) times the FLOP rate. Measured: this 2-core CPU, 1.3 ms a layer at 150 GFLOP/s (2- and 4-layer
#: Llama of 256 hidden, a 1-token step against 2048 tokens); an H200, 3.5 ms a layer (``bench gpu``'s padded step of
#: SmolLM2-135M, 107 ms for 30 layers) at about 200 TFLOP/s
FORWARD_OVERHEAD = {"cpu": 2e8, "cuda": 7e11}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What a layout's cost reads of a model: layers, heads, head size, hidden size, parameters, element size."""

    layers: int
    heads: int
    head_dim: int
    hidden: int
    params: int
    element: int  # bytes per activation
    forward_positions: int = 1  # the positions one more forward must save to pay for itself (:func:`row_groups`)

    @classmethod
    def of(cls, hf: Any) -> ModelShape:
        """The shape of ``hf`` from its config and parameters.

        Args:
            hf: a transformers model.

        Returns:
            Its :class:`ModelShape`.

        Example::

            >>> ModelShape.of(hf_model)
            ModelShape(layers=2, heads=4, head_dim=8, hidden=32, params=22688, element=4, forward_positions=2938)
        """
        config = hf.config
        layers = int(config_value(config, "num_hidden_layers", 0) or config_value(config, "n_layer", 1) or 1)
        heads = int(config_value(config, "num_attention_heads", 0) or config_value(config, "n_head", 1) or 1)
        hidden = int(config_value(config, "hidden_size", 0) or config_value(config, "n_embd", 1) or 1)
        head_dim = int(config_value(config, "head_dim", 0) or 0) or max(1, hidden // heads)
        first = next(hf.parameters())
        params = sum(p.numel() for p in hf.parameters())
        half = first.dtype in (torch.float16, torch.bfloat16) or torch.is_autocast_enabled(first.device.type)
        overhead = FORWARD_OVERHEAD.get(first.device.type, FORWARD_OVERHEAD["cuda"]) * layers
        forward = max(1, round(overhead / (6.0 * params)))  # a position's step: 3x the forward's 2 FLOPs a parameter
        return cls(layers, heads, head_dim, hidden, params, 2 if half else first.element_size(), forward)


@dataclasses.dataclass(frozen=True)
class Cost:
    """One layout's work (a training step's FLOPs) and the peak memory it plans, in bytes."""

    flops: float
    memory: float
    positions: int
    pairs: int


def cost(shape: ModelShape, positions: int, pairs: int) -> Cost:
    """The cost of a step that computes ``positions`` positions and ``pairs`` attention score pairs per head.

    Args:
        shape: the model's :class:`ModelShape`.
        positions: the positions the forward computes (real and padding).
        pairs: the score pairs its attention computes per head and layer.

    Returns:
        The :class:`Cost`: 3x the forward's FLOPs, and the activations and attention weights a backward keeps.

    Example::

        >>> step = cost(shape, positions=4096, pairs=4096 * 4096)   # the tiny Llama's shape: one 4096-token document
        >>> f"{step.flops / 1e9:.3g} GFLOP, {step.memory / 2**20:.0f} MB"
        '13.4 GFLOP, 528 MB'
    """
    forward = 2.0 * shape.params * positions + 4.0 * pairs * shape.heads * shape.head_dim * shape.layers
    kept = positions * shape.hidden * shape.layers * ACTIVATIONS_PER_POSITION + pairs * shape.heads * shape.layers
    return Cost(3.0 * forward, float(kept * shape.element), positions, pairs)


@functools.lru_cache(maxsize=256)
def row_groups(lengths: tuple[int, ...], most: int = MOST_FORWARDS, least: int = 1) -> tuple[tuple[int, ...], ...]:
    """One document per row in forwards of similar width: the documents (their indices, in batch order) of each
    forward, widest first, each forward's rows as wide as its longest document. The rows are split, between two
    lengths, where that saves the most padded positions, while a split saves at least ``least`` positions (what
    one more forward costs: :attr:`ModelShape.forward_positions`), up to ``most`` forwards.

    Args:
        lengths: every document's length in the batch, in batch order.
        most: the most forwards (1: every document in one forward, padded to the longest).
        least: the positions a split must save.

    Returns:
        The documents of each forward.

    Example::

        >>> row_groups((2048,) + (32,) * 64, least=950)   # one long document, 64 short ones: 2 forwards, no padding
        ((0,), (1, 2, ..., 64))
        >>> row_groups((28, 13, 1), least=950)            # 42 positions saved at most: one forward
        ((0, 1, 2),)
    """
    order = sorted(range(len(lengths)), key=lambda d: -lengths[d])
    groups = [order]
    while len(groups) < most:
        saving, where = 0, (0, 0)
        for index, group in enumerate(groups):
            widest = lengths[group[0]]
            for cut in range(1, len(group)):
                if lengths[group[cut]] < lengths[group[cut - 1]]:
                    saved = (len(group) - cut) * (widest - lengths[group[cut]])
                    if saved > saving:
                        saving, where = saved, (index, cut)
        if saving < max(1, least):
            break
        index, cut = where
        groups[index : index + 1] = [groups[index][:cut], groups[index][cut:]]
    return tuple(tuple(sorted(g)) for g in groups)


def layout_costs(
    shape: ModelShape, lengths: Sequence[int], layouts: Sequence[str], stock_mask: bool, forwards: int = 1
) -> dict:
    """The cost of each of ``layouts`` for a batch of documents of ``lengths``.

    Args:
        shape: the model's :class:`ModelShape`.
        lengths: every document's length in the batch.
        layouts: ``"flat"`` and/or ``"rows"``.
        stock_mask: the flat row runs stock's packed mask (the whole row scored), not our documents.
        forwards: the most forwards the rows may run in (:func:`row_groups`; 1: padded to the longest).

    Returns:
        ``{layout: Cost}``.

    Example::

        >>> layout_costs(shape, [256] * 16, ("flat", "rows"), stock_mask=True)["rows"].pairs
        1048576
    """
    tokens = sum(lengths)
    groups = row_groups(tuple(lengths), forwards, shape.forward_positions)
    widths = [(len(g), max(lengths[d] for d in g)) for g in groups]
    table = {
        FLAT: (tokens, tokens * tokens if stock_mask else sum(k * k for k in lengths)),
        ROWS: (sum(n * w for n, w in widths), sum(n * w * w for n, w in widths)),
    }
    return {name: cost(shape, *table[name]) for name in layouts}


def free_memory(device: torch.device) -> float:
    """What the device has free, in bytes: CUDA's free memory, or the host's available memory.

    Args:
        device: where the model's parameters are.

    Returns:
        The free bytes (inf where it cannot be read).

    Example::

        >>> free_memory(torch.device("cpu")) > 0
        True
    """
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return float("inf")


@dataclasses.dataclass(frozen=True)
class Choice:
    """The layout a batch runs and why, with every candidate's cost."""

    layout: str
    reason: str
    costs: dict


NAMES = {FLAT: "the flat row", ROWS: "one document per row"}


def cheapest(
    shape: ModelShape,
    lengths: Sequence[int],
    layouts: Sequence[str],
    stock_mask: bool,
    free: float = float("inf"),
    forwards: int = 1,
) -> Choice:
    """The cheapest of ``layouts`` (each proven exact) for a batch of documents of ``lengths`` whose planned memory
    fits ``free`` (x :data:`MEMORY_SHARE`); where none fits, the one that needs least, and the reason says so.

    Args:
        shape: the model's :class:`ModelShape`.
        lengths: every document's length in the batch.
        layouts: the candidates, in order of preference on a tie.
        stock_mask: the flat row runs stock's packed mask.
        free: the device's free memory in bytes (:func:`free_memory`).
        forwards: the most forwards the rows may run in (:func:`row_groups`).

    Returns:
        The :class:`Choice`.

    Example::

        >>> cheapest(shape, [256] * 16, ("flat", "rows"), stock_mask=True).reason
        "one document per row: 1.36 GFLOP, 48 MB against the flat row (stock's packed mask): 13.4 GFLOP, 528 MB ..."
    """
    costs = layout_costs(shape, lengths, layouts, stock_mask, forwards)
    fits = [name for name in layouts if costs[name].memory <= MEMORY_SHARE * free]
    if fits:
        chosen = min(fits, key=lambda name: costs[name].flops)
        note = ""
    else:
        chosen = min(layouts, key=lambda name: costs[name].memory)
        note = f"; none fits in {free / 2**20:.0f} MB free: the smallest runs"

    def said(name: str) -> str:
        mask = " (stock's packed mask)" if name == FLAT and stock_mask else ""
        if name == ROWS and (split := len(row_groups(tuple(lengths), forwards, shape.forward_positions))) > 1:
            mask = f" in {split} forwards by width"
        c = costs[name]
        return f"{NAMES[name]}{mask}: {c.flops / 1e9:.3g} GFLOP, {c.memory / 2**20:.0f} MB"

    others = ", ".join(said(name) for name in layouts if name != chosen)
    batch = f"{len(lengths)} documents, longest {max(lengths)}, {sum(lengths)} tokens"
    reason = said(chosen) + (f" against {others}" if others else "") + f" ({batch}){note}"
    return Choice(chosen, reason, costs)


#: the fewest forwards any rank would run a batch's rows in, given this rank's (`foundry_attn.path.agreement.fewest`)
Agree = Callable[[int], int]


@dataclasses.dataclass
class LayoutChoice:
    """The layout the last batch ran and why, and the most forwards a batch's rows may run in by width."""

    most_forwards: int = MOST_FORWARDS  # 1: padded to the longest, in one forward
    layout: str = ""  # "flat" or "rows"
    reason: str = ""
    _shape: ModelShape | None = None

    def shape(self, hf: Any) -> ModelShape:
        """What a layout's cost reads of the model, read once.

        Args:
            hf: the transformers model.

        Returns:
            Its :class:`ModelShape`.

        Example::

            >>> state.choice.shape(hf_model).layers
            2
        """
        if self._shape is None:
            self._shape = ModelShape.of(hf)
        return self._shape

    def splits(self, hf: Any) -> bool:
        """Whether the model lets a batch's rows run in several forwards: not where it adds a loss over all a
        forward's tokens (a router's), nor with ``most_forwards`` 1; the plan adds what the ranks allow.

        Args:
            hf: the transformers model.

        Returns:
            True where :meth:`choose` may split.

        Example::

            >>> state.choice.splits(hf_model)
            True
        """
        return self.most_forwards > 1 and not getattr(hf.config, "output_router_logits", False)

    def forwards(self, hf: Any, lengths: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        """The documents of each forward a batch's rows run in, where several by width cost less than one; empty
        for one forward (also where :meth:`splits` says no).

        Args:
            hf: the transformers model.
            lengths: every document's length in the batch.

        Returns:
            The documents (indices in batch order) of each forward, widest first; empty: one forward.

        Example::

            >>> state.choice.forwards(hf_model, [2048] + [32] * 64)
            ((0,), (1, 2, ..., 64))
        """
        return self._groups(hf, tuple(lengths), self.most_forwards) if self.splits(hf) else ()

    def _groups(self, hf: Any, lengths: tuple[int, ...], most: int) -> tuple[tuple[int, ...], ...]:
        """The documents of each of at most ``most`` forwards by width; empty where one forward runs them all."""
        groups = row_groups(lengths, most, self.shape(hf).forward_positions) if lengths else ()
        return groups if len(groups) > 1 else ()

    def choose(
        self,
        hf: Any,
        lengths: Sequence[int],
        path: str,
        candidates: bool,
        grouped: bool,
        agree: Agree | None = None,
    ) -> tuple[str, tuple[tuple[int, ...], ...]]:
        """The layout a batch of documents of ``lengths`` runs and, on rows, the documents of each forward: the
        run's ``path``, or where one document per row is proven beside the flat row on stock's packed mask
        (``candidates``), the cheaper of the two within the free memory; with several processes (``agree``), the
        fewest forwards any rank would run. Kept as ``layout``/``reason``.

        Args:
            hf: the transformers model.
            lengths: every document's length in the batch.
            path: the run's path, ``"flat"`` or ``"rows"``.
            candidates: one document per row is proven beside the flat row on stock's packed mask.
            grouped: the rows may run in several forwards by width (the plan said yes).
            agree: the fewest forwards over the ranks (one collective), None with one process.

        Returns:
            ``(layout, groups)``: ``"flat"`` or ``"rows"``, and the documents of each forward (empty: one).

        Example::

            >>> state.choice.choose(hf_model, [256] * 16, "flat", candidates=True, grouped=False)
            ('rows', ())
            >>> state.choice.reason
            "one document per row: 1.36 GFLOP, 48 MB against the flat row (stock's packed mask): 13.4 GFLOP, ..."
        """
        lengths = tuple(lengths)
        most = self.most_forwards if grouped else 1
        free = free_memory(next(hf.parameters()).device) if candidates and lengths else float("inf")

        def chosen(forwards: int) -> tuple[str, str]:
            if not (candidates and lengths):
                return path, ""
            best = cheapest(self.shape(hf), lengths, (FLAT, ROWS), stock_mask=True, free=free, forwards=forwards)
            return best.layout, best.reason

        layout, reason = chosen(most)
        groups = self._groups(hf, lengths, most) if grouped and layout == ROWS else ()
        if grouped and agree is not None:  # every rank runs as many forwards (DDP broadcasts its buffers in each)
            least = agree(max(1, len(groups)))
            if least == 1 < len(groups):  # one forward: the cheaper layout in one
                layout, reason = chosen(1)
                groups = ()
            elif least < len(groups):
                groups = self._groups(hf, lengths, least)
        if candidates and lengths and layout != self.layout:
            log.info("foundry_attn: %s runs %s", type(hf).__name__, reason)
        self.layout, self.reason = layout, reason
        return layout, groups
