"""When a proof is due on a training batch: the first, a longer one, a change of the attention code, the interval.

    schedule = state.schedule                      # kept on the path's state (foundry_attn.path.state.PathState)
    schedule.due(hf_model, 41, 28, state.names)    # ('the first training batch', True), or None

A proof is due on the first training batch; on any batch longer than every length proven so far (the flat row beyond
the next power of two of the longest proven, or a document beyond that of the longest proven document: the number of
such proofs grows with the log of the lengths); whenever a function behind the dispatch, a kernel the flat path calls
or a module's ``forward`` changes (an identity check per batch); and every ``interval`` batches, forward only. Core
module: torch and transformers only.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from itertools import repeat
from types import ModuleType
from typing import Any

import torch

from foundry_attn.attention.documents import Documents
from foundry_attn.attention.torch_varlen import torch_varlen_kernel
from foundry_attn.path.agreement import agreed_lengths
from foundry_attn.selection.options import PROOF_INTERVAL as PROOF_INTERVAL


def ceil2(n: int) -> int:
    """The next power of two of ``n`` (``n`` itself when it is one).

    Args:
        n: a length in tokens.

    Returns:
        The smallest power of two >= ``n`` (1 for ``n <= 1``).

    Example::

        >>> ceil2(41), ceil2(64)
        (64, 64)
    """
    return 1 << max(0, int(n) - 1).bit_length()


def kernels() -> tuple:
    """The kernels the flat path calls, by identity: transformers' ``_flash_attention_forward`` and the flash
    symbols it looks up at call time, torch's SDPA, varlen and flex functions. A patch on any of them is a change.

    Returns:
        The seven functions (None for a flash symbol, the varlen kernel or flex this install lacks).

    Example::

        >>> kernels()[0] is torch.nn.functional.scaled_dot_product_attention
        True
    """
    fa_utils, flex = _kernel_modules()
    return (
        torch.nn.functional.scaled_dot_product_attention,
        fa_utils._flash_attention_forward,
        *(getattr(fa_utils, n, None) for n in ("flash_attn_varlen_func", "flash_attn_func", "_flash_varlen_fn")),
        torch_varlen_kernel(),
        getattr(flex, "flex_attention", None),
    )


_FORWARD = operator.attrgetter("forward")


def _dispatch_table() -> dict[str, Any]:
    """transformers' table of attention functions by name (``AttentionInterface``)."""
    return _interface()._global_mapping


@functools.cache
def _interface() -> Any:
    from transformers.modeling_utils import AttentionInterface

    return AttentionInterface


@functools.cache
def _kernel_modules() -> tuple[ModuleType, ModuleType]:
    """The modules :func:`kernels` reads its functions off, imported once (an import per batch costs more than the
    check)."""
    from torch.nn.attention import flex_attention as flex
    from transformers import modeling_flash_attention_utils as fa_utils

    return fa_utils, flex


@dataclasses.dataclass
class Schedule:
    """When a proof is due: the training batches counted, the lengths proven (each up to its next power of two), the
    code the proofs ran on, for the flat row and for one document per row as a candidate beside it."""

    interval: int = PROOF_INTERVAL
    batches: int = 0
    proven_on_batch: bool = False
    rows_on_batch: bool = False  # one document per row has been proven on a training batch
    covered: tuple[int, int] = (0, 0)  # (flat row, document) lengths proven, each up to its next power of two
    rows_covered: tuple[int, int] = (0, 0)  # as ``covered``, for one document per row as a candidate
    _fingerprint: tuple = ()
    _modules: tuple = ()
    _dicts: tuple = ()  # each watched module's ``__dict__``, read by C-level maps each batch (no Python loop)
    _flagged: tuple = ()  # those of modules with HF's ``gradient_checkpointing`` flag (the ones HF switches)

    def fresh(self) -> Schedule:
        """This schedule for a copied model (``copy.deepcopy``): it proves again on its first batch.

        Returns:
            A copy with no batch proven and no modules watched.

        Example::

            >>> state.schedule.fresh().proven_on_batch
            False
        """
        return dataclasses.replace(
            self, proven_on_batch=False, rows_on_batch=False, _modules=(), _dicts=(), _flagged=()
        )

    def watch(self, hf: Any, names: tuple[str, str]) -> None:
        """The code a proof just ran on, kept: a change of it makes the next proof due.

        Args:
            hf: the transformers model (its modules are watched).
            names: our implementation's name and the stock one (their dispatch entries are watched).

        Example::

            >>> state.schedule.watch(hf_model, state.names)
        """
        self._modules = tuple(hf.modules())
        self._dicts = tuple(m.__dict__ for m in self._modules)
        self._flagged = tuple(m.__dict__ for m in self._modules if hasattr(m, "gradient_checkpointing"))
        self._fingerprint = self.fingerprint(names)

    def fingerprint(self, names: tuple[str, str]) -> tuple:
        """What the flat path's exactness rests on, by identity: the dispatch entries of ``names``, the kernels the
        flat path calls (:func:`kernels`), every watched module's ``forward`` (class and instance) and HF
        checkpointing. Costs microseconds (measured in ``bench proof``).

        Args:
            names: our implementation's name and the stock one.

        Returns:
            A tuple of the functions and flags above, compared by ``==`` per batch.

        Example::

            >>> before = state.schedule.fingerprint(state.names)
            >>> before == state.schedule.fingerprint(state.names)      # False once sdpa or a forward is patched
            True
        """
        table = _dispatch_table()
        classes = tuple(map(type, self._modules))
        return (
            *map(table.get, names),
            *kernels(),
            # each module's class and its forward, a forward set on the instance, HF gradient checkpointing on or off
            classes,
            tuple(map(_FORWARD, dict.fromkeys(classes))),
            tuple(map(dict.get, self._dicts, repeat("forward"))),
            tuple(map(dict.get, self._flagged, repeat("gradient_checkpointing"))),
        )

    def cover(self, docs: Documents, rows: bool = False) -> None:
        """Lengths up to the next power of two of this row's and its longest document's are proven.

        Args:
            docs: the documents a proof passed on.
            rows: for one document per row as a candidate beside the flat row.

        Example::

            >>> state.schedule.covered                      # attach's documents [28, 13, 1]
            (64, 32)
            >>> state.schedule.cover(inputs[DOCS_KEY])      # a 90-token row, documents up to 40
            >>> state.schedule.covered
            (128, 64)
        """
        before = self.rows_covered if rows else self.covered
        after = max(before[0], ceil2(docs.bounds[docs.real])), max(before[1], ceil2(docs.max_length))  # real tokens
        if rows:
            self.rows_covered = after
        else:
            self.covered = after

    def due(
        self, hf: Any, tokens: int, longest: int, names: tuple[str, str], rows: bool = False
    ) -> tuple[str, bool] | None:
        """Why a proof is due on a training batch of ``tokens`` real tokens whose longest document is ``longest``,
        and whether it compares gradients; counts the batch.

        Args:
            hf: the transformers model (its parameters tell a sharded run, whose ranks agree on the lengths).
            tokens: the batch's real tokens (the flat row's length).
            longest: its longest document.
            names: our implementation's name and the stock one, as the path runs them now.
            rows: the batch runs one document per row while the run is flat.

        Returns:
            ``(why, grads)``, or None when no proof is due.

        Example::

            >>> state.schedule.due(hf_model, 41, 28, state.names)
            ('the first training batch', True)
        """
        self.batches += 1
        if not (self.rows_on_batch if rows else self.proven_on_batch):
            if rows:
                self.rows_on_batch = True
            else:
                self.proven_on_batch = True
            return "the first training batch" + (" on one document per row" if rows else ""), True
        if self.fingerprint(names) != self._fingerprint:
            return "a change of the attention code", True
        tokens, longest = agreed_lengths((tokens, longest), hf)
        covered = self.rows_covered if rows else self.covered
        if tokens > covered[0] or longest > covered[1]:
            return f"a longer batch: {tokens} tokens, documents up to {longest}; proven up to {covered}", True
        if self.interval and self.batches % self.interval == 0:
            return f"the {self.interval}-batch interval", False
        return None
