"""Which proven layout a batch runs, and in how many forwards: the cheapest within the free memory, the same number
of forwards on every rank.

    choice = state.choice                          # kept on the path's state (foundry_attn.path.state.PathState)
    layout, groups = choice.choose(hf_model, lengths, "flat", candidates=True, grouped=True)
    choice.layout, choice.reason                   # what the last batch ran, and why

Where the flat row runs stock's packed mask and one document per row is proven beside it, the cheaper of the two
runs each batch (:func:`~foundry_attn.flat.layout_cost.cheapest`); rows may run in several forwards by width
(:func:`~foundry_attn.flat.layout_cost.row_groups`). Core module: torch and transformers only.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from foundry_attn.flat.layout_cost import FLAT, MOST_FORWARDS, ROWS, ModelShape, cheapest, free_memory, row_groups
from foundry_attn.path.ranks import fewest, sharded, world

log = logging.getLogger(__name__)


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
            Its :class:`~foundry_attn.flat.layout_cost.ModelShape`.

        Example::

            >>> state.choice.shape(hf_model).layers
            2
        """
        if self._shape is None:
            self._shape = ModelShape.of(hf)
        return self._shape

    def splits(self, hf: Any, training: bool = True) -> bool:
        """Whether a batch's rows may run in several forwards: not where the model adds a loss over all a forward's
        tokens (a router's), nor with ``most_forwards`` 1; with several processes, only for a training batch of a
        model whose parameters are not sharded (DDP: the ranks agree on the number, :meth:`choose`; FSDP's
        all-gathers are left to one forward). The same answer on every rank.

        Args:
            hf: the transformers model.
            training: the batch trains (gradients on).

        Returns:
            True where :meth:`forwards` may split.

        Example::

            >>> state.choice.splits(hf_model)
            True
        """
        if self.most_forwards < 2 or getattr(hf.config, "output_router_logits", False):
            return False
        return world() == 1 or (training and not sharded(hf))

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
        return self._groups(hf, lengths) if self.splits(hf) else ()

    def _groups(self, hf: Any, lengths: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        if not lengths:
            return ()
        groups = row_groups(tuple(lengths), self.most_forwards, self.shape(hf).forward_positions)
        return groups if len(groups) > 1 else ()

    def _cheapest(self, hf: Any, lengths: Sequence[int], path: str, candidates: bool, grouped: bool) -> str:
        """The path, or where one document per row is a candidate beside the flat row, the cheaper of the two."""
        if not (candidates and lengths):
            self.layout, self.reason = path, ""
            return path
        free = free_memory(next(hf.parameters()).device)
        most = self.most_forwards if grouped else 1
        choice = cheapest(self.shape(hf), lengths, (FLAT, ROWS), stock_mask=True, free=free, forwards=most)
        if choice.layout != self.layout:
            log.info("foundry_attn: %s runs %s", type(hf).__name__, choice.reason)
        self.layout, self.reason = choice.layout, choice.reason
        return choice.layout

    def choose(
        self, hf: Any, lengths: Sequence[int], path: str, candidates: bool, grouped: bool
    ) -> tuple[str, tuple[tuple[int, ...], ...]]:
        """The layout a batch of documents of ``lengths`` runs and, on rows, the documents of each forward: the
        run's ``path``, or where one document per row is proven beside the flat row on stock's packed mask
        (``candidates``), the cheaper of the two within the free memory; with several processes, the fewest forwards
        any rank would run (one all-reduce per training batch), kept as ``layout``/``reason``.

        Args:
            hf: the transformers model.
            lengths: every document's length in the batch (empty: the path).
            path: the run's path, ``"flat"`` or ``"rows"``.
            candidates: one document per row is proven beside the flat row on stock's packed mask.
            grouped: the rows may run in several forwards by width (:meth:`splits` said yes).

        Returns:
            ``(layout, groups)``: ``"flat"`` or ``"rows"``, and the documents of each forward (empty: one).

        Example::

            >>> state.choice.choose(hf_model, [256] * 16, "flat", candidates=True, grouped=False)
            ('rows', ())
            >>> state.choice.reason
            "one document per row: 1.36 GFLOP, 48 MB against the flat row (stock's packed mask): 13.4 GFLOP, ..."
        """
        layout = self._cheapest(hf, lengths, path, candidates, grouped)
        groups = self._groups(hf, lengths) if grouped and layout == ROWS else ()
        if not grouped or world() == 1:
            return layout, groups
        # every rank runs as many forwards (DDP broadcasts its buffers in each)
        least = fewest(max(1, len(groups)), hf)
        if least >= max(1, len(groups)):
            return layout, groups
        if least == 1:
            return self._cheapest(hf, lengths, path, candidates, False), ()
        return layout, row_groups(tuple(lengths), least, self.shape(hf).forward_positions)
