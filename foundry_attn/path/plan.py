"""What runs a batch: one frozen plan per batch, made before anything is built.

    plan = plan_batch(hf_model, batch, in_step=True)   # once per batch (foundry_attn.path.forward.prepare_documents)
    plan.path, plan.groups, plan.at                     # flat or rows, its forwards by width, the proof due (or None)
    plan = replan(hf_model, plan)                       # where a proof moved the run: the same batch, there

The plan reads the batch's layout (:mod:`foundry_attn.flat.layout`), how the flat step runs (its device and capacity,
settled on the first flat batch: :mod:`~foundry_attn.path.execution`), the cheapest proven layout and the ranks'
agreement on its forwards (:class:`~foundry_attn.flat.layout_cost.LayoutChoice`), and whether a proof is due
(:mod:`~foundry_attn.path.schedule`). It builds nothing: :mod:`foundry_attn.path.forward` builds the inputs once from
it, runs them, and a proof's outcome comes back as a new plan (:func:`replan`). Core module: torch and transformers
only.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping

import torch

from foundry_attn.attention.backends import BACKENDS
from foundry_attn.flat.capacity import capacity_for
from foundry_attn.flat.implementation import current
from foundry_attn.flat.layout import Layout, has_targets
from foundry_attn.flat.layout_cost import FLAT, ROWS
from foundry_attn.path.agreement import fewest, sharded, world
from foundry_attn.path.execution import EAGER_STEP
from foundry_attn.path.state import PathState, path_of
from foundry_attn.proof.step_proof import step_blocker

log = logging.getLogger(__name__)

Groups = tuple[tuple[int, ...], ...]
PAST_CAPACITY = "a batch past the capacity of"


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """What a batch runs (:func:`plan_batch`): its ``path`` on the batch's ``layout``, its tokens and targets
    (``labels`` None where it has none), how the flat row is laid out (``even`` rows, padded to ``sizes``, on stock's
    packed mask) or the rows (``groups`` of documents by width, ``left``-padded, ``first_targets`` kept), and the proof
    due on it, if any: why (``at``), with gradients or forward only, and whether it takes the batch's own forward
    (``in_step``). ``attached``: the model has a path (else rows, unproven)."""

    path: str
    layout: Layout
    ids: torch.Tensor
    labels: torch.Tensor | None = None
    no_targets: bool = False
    attached: bool = False
    groups: Groups = ()
    even: bool = False
    sizes: tuple[int, int] | None = None
    stock_mask: bool = False
    left: bool = False
    first_targets: bool = False
    at: str | None = None
    grads: bool = True
    in_step: bool = False

    @property
    def proof_first(self) -> bool:
        """Whether a proof is due before the batch runs (not in its own forward).

        Returns:
            ``at`` is set and ``in_step`` is not.

        Example::

            >>> plan_batch(hf_model, batch, in_step=True).proof_first     # the first training batch: in its forward
            False
        """
        return self.at is not None and not self.in_step


def plan_batch(hf: torch.nn.Module, batch: Mapping, in_step: bool = False, grouped: bool = False) -> Plan:
    """The plan of ``batch`` for ``hf``: flat where its path is flat and its implementation in place, else rows; the
    cheaper proven layout where two are; and for a training batch the proof due on it (counted here: called once per
    batch). ``in_step``: the caller runs the forward itself, uncompiled, so a flat proof may take that forward
    (:func:`~foundry_attn.proof.step_proof.step_blocker`) and even rows may replace a regrouping flat row;
    ``grouped``: rows may run in several forwards by width.

    Args:
        hf: the transformers model (:func:`~foundry_attn.flat.unwrap.unwrapped`).
        batch: ``input_ids`` with ``doc_lens`` or a 2-D ``attention_mask``; ``labels`` and ``position_ids`` optional.
        in_step: the caller runs the forward uncompiled.
        grouped: the caller joins rows run in several forwards (:func:`foundry_attn.path.forward.joined`).

    Returns:
        The batch's :class:`Plan`.

    Raises:
        ValueError: the batch has no real token.

    Example::

        >>> _ = hf_model.train()                                  # batch: doc_lens [[20, 30], [40]]
        >>> plan = plan_batch(hf_model, batch, in_step=True)
        >>> plan.path, plan.at, plan.in_step
        ('flat', 'batch 1 (the first training batch)', True)
    """
    ids, labels = batch["input_ids"], batch.get("labels")
    state = path_of(hf)
    if state is not None and state.path == FLAT and not state.execution.settled:
        state.settle_step(ids.device, ids.numel(), hf)  # the first flat batch: its device, auto's rows x width
    layout = Layout.from_batch(batch)
    if layout.real_tokens == 0:
        raise ValueError("empty batch: no real tokens (every row is padding)")
    no_targets = labels is not None and not has_targets(batch, labels)
    plan = Plan(ROWS, layout, ids, None if no_targets else labels, no_targets, attached=state is not None)
    if state is None:
        _say_unproven(type(hf).__name__)
        return plan
    if state.path == FLAT and current(hf) != state.flat_name:
        return replan(hf, plan, ROWS)  # someone set another implementation: stock runs it, one document per row
    training = hf.training and torch.is_grad_enabled()
    grouped = grouped and state.choice.splits(hf) and (world() == 1 or (training and not sharded(hf)))
    candidates = state.path == FLAT and state.stock_mask and state.rows_proven
    agree = functools.partial(fewest, hf=hf) if grouped and world() > 1 else None
    path, groups = state.choice.choose(hf, layout.lengths, state.path, candidates, grouped, agree)
    plan = _laid(state, hf, plan, path, in_step, groups)
    beside = path == ROWS and state.path == FLAT  # one document per row, a candidate beside the flat row
    due = state.schedule.due(hf, layout.real_tokens, layout.max_length, state.names, rows=beside) if training else None
    if due is None:
        return plan
    in_step = in_step and path == FLAT and not state.stock_mask and step_blocker(hf) is None
    return dataclasses.replace(plan, at=f"batch {state.schedule.batches} ({due[0]})", grads=due[1], in_step=in_step)


def replan(hf: torch.nn.Module, plan: Plan, path: str | None = None) -> Plan:
    """``plan``'s batch where the run is now (a proof moved it: to rows, or to stock's packed mask), no proof due.

    Args:
        hf: the transformers model.
        plan: the batch's plan before the proof.
        path: the path to run (None: the state's).

    Returns:
        The batch's new :class:`Plan`.

    Example::

        >>> plan = plan_batch(hf_model, batch)
        >>> replan(hf_model, plan, "rows").path
        'rows'
    """
    state = path_of(hf)
    if state is None:
        return plan
    return _laid(state, hf, plan, path or state.path, False)


def _laid(state: PathState, hf: torch.nn.Module, plan: Plan, path: str, in_step: bool, groups: Groups = ()) -> Plan:
    """``plan`` laid out on ``path``, no proof due yet: the flat row's shape (``in_step``: even rows where our function
    would regroup documents of one length in every layer, uncompiled; padded to the capacity, a row past it at its
    own length, said once), or the rows' ``groups``, side and targets. Every layout field is set, none kept from
    ``plan``'s other path."""
    rows = path == ROWS
    layout, capacity = plan.layout, state.capacity
    even = not rows and in_step and state.execution.runs == EAGER_STEP
    even = even and (state.stock_mask or BACKENDS[state.backend].regroups)
    sizes = None
    if not rows and capacity and not state.stock_mask:  # a few fixed shapes: the kernel reads the bounds on the device
        sizes = capacity_for(layout.real_tokens, len(layout.lengths), capacity)
        if sizes is None and not any(n.startswith(PAST_CAPACITY) for n in state.notes):
            note = f"{PAST_CAPACITY} {capacity} tokens (a row of {layout.real_tokens}): it runs at its own length"
            state.notes.append(note)
            log.warning("foundry_attn: %s: %s (said once)", type(hf).__name__, note)
    return dataclasses.replace(
        plan,
        path=path,
        groups=groups,
        even=even,
        sizes=sizes,
        stock_mask=not rows and state.stock_mask,
        left=rows and state.rows_left,
        first_targets=rows and state.first_targets,
        at=None,
        in_step=False,
    )


@functools.cache
def _say_unproven(class_name: str) -> None:
    log.warning(
        "foundry_attn: %s was never attached (foundry_attn.path.attach.attach), so its flat path is not proven: "
        "forward_documents runs it one document per row (rows path; under FA2 that is transformers' per-layer "
        "unpad). Call attach(model, backend) once for the flat path.",
        class_name,
    )
