"""The path a model runs, flat or rows, and why: the one owner of its changes.

    state = path_of(hf_model)                        # kept on the HF model by attach (foundry_attn.path.attach)
    state.path, state.reason                         # "flat" | "rows", and why
    state.to_rows("proof at batch 3 failed: ...")    # a transition: the only code that assigns the state's fields

**flat** (unpad once, the documents as an argument of every attention call) is used only while the proof
(:mod:`foundry_attn.proof`: the flat row that trains against stock on each document alone, logits and gradients)
holds. **rows** (the stock backend, one document per row, a 2-D mask) is used otherwise: a failed proof moves the run
there, from the batch it failed on, with one warning (or, binding, raises with the reason and the batch). The state
holds the path and what the plan of each batch reads (:mod:`foundry_attn.path.plan`): when a proof is due
(:mod:`~foundry_attn.path.schedule`), which proven layout runs (:class:`~foundry_attn.flat.layout_cost.LayoutChoice`),
how the flat step runs (:mod:`~foundry_attn.path.execution`); what a proof's outcome does to the path is
:mod:`~foundry_attn.path.proven`'s. Core module: torch and transformers only.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from foundry_attn.checks import check_choice
from foundry_attn.flat.capacity import bucket
from foundry_attn.flat.layout_cost import FLAT, ROWS, LayoutChoice
from foundry_attn.flat.unwrap import compiled, unwrapped
from foundry_attn.path.execution import EAGER_STEP, Execution
from foundry_attn.path.schedule import Schedule
from foundry_attn.proof.result import Proof
from foundry_attn.selection.options import AUTO_PATH as AUTO_PATH
from foundry_attn.selection.options import PATHS as PATHS
from foundry_attn.selection.policy import AttentionUnavailableError, Decision
from foundry_attn.selection.surfaces import Surface, spoken
from foundry_attn.selection.traits import ModelTraits

log = logging.getLogger(__name__)

PATH_ATTR = "foundry_path"  # the PathState :func:`foundry_attn.path.attach.attach` keeps on the HF model


class NoExactPath(AttentionUnavailableError):
    """Neither path trains the model as each document alone here (the flat row and one document per row, right- and
    left-padded, each failed its proof, or cannot run): refused at attach, or on the batch that shows it."""


class FlatPathError(AttentionUnavailableError):
    """``attn_path: flat`` with ``attn_strict: true`` on a model whose flat path is not proven."""


def check_path(path: str) -> str:
    """``path`` if it is one of :data:`PATHS`, else the ValueError that lists them.

    Args:
        path: ``attn_path`` as the user gave it.

    Returns:
        ``path``.

    Example::

        >>> check_path("flatt")
        Traceback (most recent call last):
            ...
        ValueError: attn_path: unknown value 'flatt'; valid values: auto, flat, rows
    """
    return check_choice("attn_path", path, PATHS)


@dataclasses.dataclass(frozen=True)
class PathChange:
    """The run moved to ``path`` on training batch ``batch`` (0: at attach), and why: an event of the
    :class:`PathState` (``state.changes``) that the glues read after a batch and log."""

    batch: int
    path: str
    reason: str


@dataclasses.dataclass
class PathState:
    """The path a model runs and why, kept on the HF model (``model.foundry_path``) by :func:`attach`."""

    backend: str
    path: str
    reason: str
    flat_name: str  # ours, in config._attn_implementation while flat
    rows_name: str  # stock, in config._attn_implementation while rows
    reference: bool = False  # FA2 on the pure-PyTorch reference kernel
    rows_left: bool = False  # the rows path pads on the left (a model that assumes it: CPM-Ant)
    first_targets: bool = False  # the model's loss does not shift its labels: each first token is a target (CPM-Ant)
    stock_mask: bool = False  # the flat row runs stock's own packed mask (rows_name), not our documents
    binding: bool = False  # attn_path: flat + strict: a failed proof raises
    proofs: list[tuple[str, Proof]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    decision: Decision | None = None  # what attach ran: the chain and why not each (auto, the builder), or the name
    changes: list[PathChange] = dataclasses.field(default_factory=list)  # every move to rows, in order: the glues read
    rows_proven: bool = False  # one document per row is proven too, a candidate while the flat row is stock's mask
    padding_read: bool = False  # a plain padded call's side was read (forward.plain_call: left-padded rows said once)
    capacity: int = 0  # each flat row padded to a few fixed shapes up to this many tokens (flat/capacity.py); 0: off
    schedule: Schedule = dataclasses.field(default_factory=Schedule)  # when a proof is due
    choice: LayoutChoice = dataclasses.field(default_factory=LayoutChoice)  # the layout each batch runs
    execution: Execution = dataclasses.field(default_factory=Execution)  # eager, compiled or graphed, and why
    traits: ModelTraits = dataclasses.field(default_factory=ModelTraits)  # what the model asks of attention (attach)
    surface: Surface = dataclasses.field(default_factory=spoken)  # whose keys its errors name: the caller's at attach

    def __deepcopy__(self, memo: dict) -> PathState:
        """A copied model (``copy.deepcopy``) keeps its path but proves again on its first batch."""
        return dataclasses.replace(
            self,
            proofs=list(self.proofs),
            notes=list(self.notes),
            changes=list(self.changes),
            schedule=self.schedule.fresh(),
            choice=dataclasses.replace(self.choice),
            execution=self.execution.fresh(),
        )

    @property
    def is_flat(self) -> bool:
        """Whether the run is on the flat path now.

        Returns:
            ``path == "flat"``.

        Example::

            >>> state.is_flat     # state = attach(model, "sdpa")
            True
        """
        return self.path == FLAT

    @property
    def names(self) -> tuple[str, str]:
        """The implementations the path runs: ours (or stock's packed mask) while flat, stock's while rows.

        Returns:
            ``(flat_name, rows_name)``.

        Example::

            >>> state.names     # state = attach(model, "sdpa")
            ('foundry_sdpa', 'sdpa')
        """
        return self.flat_name, self.rows_name

    def decision_now(self) -> Decision | None:
        """What attach decided, with the path, its reason and the last proof as they are now: the one source of the
        ``attn_impl`` fields (:meth:`~foundry_attn.selection.policy.Decision.as_dict`).

        Returns:
            The decision (None for a state made without one).

        Example::

            >>> path_of(model).decision_now().as_dict()["path"]
            'flat'
        """
        if self.decision is None:
            return None
        proof = self.proofs[-1][1].describe() if self.proofs else self.decision.proof
        layout, reason = self.choice.layout or self.path, self.choice.reason
        if self.capacity:  # the flat row's shapes: said with the layout (attn/layout_reason, the attn_impl event)
            padded = f"flat rows padded to {bucket(self.capacity)}-token buckets up to {self.capacity}"
            reason = f"{reason}; {padded}" if reason else padded
        return dataclasses.replace(
            self.decision,
            proof=proof,
            path=self.path,
            path_reason=self.reason,
            layout=layout,
            layout_reason=reason,
            execution=self.execution.runs,
            execution_reason=self.execution.reason,
        )

    # The transitions: the only code that assigns the state's fields (tests/path/test_state.py reads the source).

    def to_rows(self, reason: str, at_attach: bool = False) -> None:
        """Move the run to one document per row, with why: a change the glues log (none asked at attach).

        Args:
            reason: why.
            at_attach: the user asked for rows (``path="rows"``): no change to log.

        Example::

            >>> state.to_rows("proof at batch 3 failed: ...")
            >>> state.path, state.changes
            ('rows', [PathChange(batch=0, path='rows', reason='proof at batch 3 failed: ...')])
        """
        self.path, self.reason = ROWS, reason
        if not at_attach:
            self.changes.append(PathChange(self.schedule.batches, ROWS, reason))

    def to_stock_mask(self, reason: str) -> None:
        """Keep the flat row, on stock's own packed mask (``rows_name``), where it is proven and ours is not.

        Args:
            reason: why, with the proof.

        Example::

            >>> state.to_stock_mask("stock's packed mask (sdpa) proven at attach: ...")
            >>> state.names
            ('sdpa', 'sdpa')
        """
        self.stock_mask, self.flat_name, self.reason = True, self.rows_name, reason

    def keep(self, reason: str, change: str | None = None) -> None:
        """Keep the path, with its reason now (a proof passed, a fact said); ``change``: a change the glues log.

        Args:
            reason: the path's reason now.
            change: what changed, logged as a :class:`PathChange` on the current path (None: nothing to log).

        Example::

            >>> state.keep("proven at attach: passed ...")
            >>> state.reason
            'proven at attach: passed ...'
        """
        self.reason = reason
        if change is not None:
            self.changes.append(PathChange(self.schedule.batches, self.path, change))

    def learned(
        self,
        *,
        first_targets: bool | None = None,
        rows_left: bool | None = None,
        rows_proven: bool | None = None,
        padding_read: bool | None = None,
    ) -> None:
        """What a proof or a batch found out about the model (None: unchanged).

        Args:
            first_targets: its loss does not shift its labels (each document's first token is a target).
            rows_left: its rows pad on the left.
            rows_proven: one document per row is proven too (a candidate beside the flat row).
            padding_read: a plain padded call's side was read.

        Example::

            >>> state.learned(rows_left=True)
            >>> state.rows_left, state.first_targets
            (True, False)
        """
        if first_targets is not None:
            self.first_targets = first_targets
        if rows_left is not None:
            self.rows_left = rows_left
        if rows_proven is not None:
            self.rows_proven = rows_proven
        if padding_read is not None:
            self.padding_read = padding_read

    def run_with(self, capacity: int | None = None, execution: Execution | None = None) -> None:
        """How the flat step runs: its capacity and its execution (None: unchanged).

        Args:
            capacity: each flat row padded up to this many tokens (0: off).
            execution: eager, compiled or graphed, and why.

        Example::

            >>> state.run_with(capacity=4096)
            >>> state.capacity, state.execution.runs
            (4096, 'eager')
        """
        if capacity is not None:
            self.capacity = capacity
        if execution is not None:
            self.execution = execution

    def settle_step(self, device: torch.device, tokens: int, hf: Any) -> None:
        """The first flat batch settles how the flat step runs: its device decides ``auto``, and a graphed step
        without a capacity takes the batch's rows x width (:meth:`~foundry_attn.path.execution.Execution.settle`).

        Args:
            device: the batch's device.
            tokens: its rows x width.
            hf: the transformers model (its decoder layers are compiled where the step is).

        Example::

            >>> state.settle_step(torch.device("cpu"), 12288, hf_model)
            >>> state.capacity, state.execution.settled
            (0, True)
        """
        self.capacity = self.execution.settle(device, self.capacity, tokens, hf)


def compiled_by(model: Any) -> str | None:
    """What compiles ``model``'s step, or None: the caller's ``torch.compile`` (a compiled wrapper or forward), or the
    attached path's (``attn_execution: compiled`` or ``graphed``, with its reason); the observers' hooks and patches
    step aside then, and say which.

    Args:
        model: a transformers model, or a wrapper of one.

    Returns:
        ``"torch.compile"``, ``"attn_execution <runs> (<reason>)"``, or None where the step runs eagerly.

    Example::

        >>> compiled_by(torch.compile(hf_model))
        'torch.compile'
        >>> from foundry_attn import attach
        >>> state = attach(hf_model, "sdpa", execution="compiled")
        >>> compiled_by(hf_model)
        'attn_execution compiled (compiled: torch.compile of the decoder layers, one graph per kind (forward and ...))'
    """
    if compiled(model):
        return "torch.compile"
    state = path_of(model)
    if state is None or state.execution.runs == EAGER_STEP:
        return None
    return f"attn_execution {state.execution.runs} ({state.execution.reason})"


def path_of(model: Any) -> PathState | None:
    """The :class:`PathState` of ``model`` (or of the HF model inside a wrapper), or None if never attached.

    Args:
        model: a transformers model, or a wrapper of one (DDP, FSDP, ``torch.compile``, PEFT).

    Returns:
        The state :func:`~foundry_attn.path.attach.attach` kept on it, or None.

    Example::

        >>> path_of(model).path, path_of(model).reason
        ('flat', 'proven at attach: passed in ... ms (documents [28, 13] of a 42-token row, ...)')
    """
    return getattr(unwrapped(model), PATH_ATTR, None)
