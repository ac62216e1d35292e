"""How the flat step runs, the user's switch: ``eager``, ``compiled`` (``torch.compile`` of the step, forward and
backward) or ``graphed`` (compiled and captured in CUDA graphs, ``mode="reduce-overhead"``), with the reason.

    state = attach(hf_model, "flash_attention_2", capacity=4096, execution="graphed")
    state.execution.runs, state.execution.reason     # ("graphed", "...") on a GPU; ("compiled", "...") on a CPU

    model:
      name: foundry_attn_causal_lm
      attn_capacity: 4096
      attn_execution: graphed         # eager | compiled | graphed

``graphed`` needs a CUDA device and a flat row of a few fixed shapes (a capacity, on a backend that reads the
documents' bounds on the device); where it cannot apply, the step runs compiled and says why. ``compiled`` applies
on every device and backend, except under the caller's own ``torch.compile``. A batch the compiled step cannot take
runs eagerly, each reason said once and counted (``state.execution.eager``): a proof due on it (the proof takes its
forward), rows (one document per row), a batch past the capacity under ``graphed``. The layout stays an argument of
the call: the compiled step is the model's own forward on the flat row. Core module: torch only.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

from foundry_attn.attention.documents import DOCS_KEY, Documents
from foundry_attn.checks import check_choice

log = logging.getLogger(__name__)

EAGER_STEP, COMPILED, GRAPHED = "eager", "compiled", "graphed"
EXECUTIONS = (EAGER_STEP, COMPILED, GRAPHED)
#: what ``torch.compile`` compiles the step with (tests use a cheaper backend for the same traced graph)
BACKEND: str | Callable[..., Any] = "inductor"

#: why a batch runs eagerly under a compiled execution (said once each, counted in ``Execution.eager``)
PROOF_DUE = "a batch with a proof due (the proof takes its forward)"
ROWS_BATCH = "rows (one document per row, a 2-D mask: a shape per batch)"
PAST_CAPACITY_BATCH = "a batch past the capacity (a CUDA graph per shape)"


def check_execution(execution: str) -> str:
    """``execution`` if it is one of :data:`EXECUTIONS`, else the ValueError that lists them.

    Args:
        execution: ``attn_execution`` / ``attach(..., execution=)`` as the user gave it.

    Returns:
        ``execution``.

    Example::

        >>> check_execution("graph")
        ValueError: attn_execution: unknown value 'graph'; valid values: eager, compiled, graphed
    """
    return check_choice("attn_execution", execution, EXECUTIONS)


_COMPILED_REASON = "compiled: torch.compile of the flat step (forward and backward; the row's length dynamic)"


def _not_graphed(why: str) -> str:
    """The reason of a graphed execution that runs compiled instead."""
    return f"{_COMPILED_REASON}; graphed not applied: {why}"


def _step(forward: Callable[[dict[str, Any]], Any], inputs: dict[str, Any]) -> Any:
    """The compiled step: the model's forward on the flat row (its backward compiled with it)."""
    return forward(inputs)


@dataclasses.dataclass
class Execution:
    """What the flat step runs as (``runs``) for what was asked (``asked``), and why (``reason``); the batches that
    ran eagerly, by reason (``eager``)."""

    asked: str = EAGER_STEP
    runs: str = EAGER_STEP
    reason: str = "eager (attach's default; attn_execution: compiled or graphed to compile the step)"
    eager: dict[str, int] = dataclasses.field(default_factory=dict)
    settled: bool = False  # the device was read on the first flat batch
    compiled: Callable[..., Any] | None = dataclasses.field(default=None, repr=False, compare=False)

    def fresh(self) -> Execution:
        """The same choice for a copied model, compiled again on its first batch.

        Returns:
            A new :class:`Execution` with ``asked``, ``runs`` and ``reason`` kept.

        Example::

            >>> copy.deepcopy(model).foundry_path.execution.compiled is None
            True
        """
        return Execution(self.asked, self.runs, self.reason, settled=self.settled)

    def run(self, forward: Callable[[dict[str, Any]], Any], inputs: dict[str, Any]) -> Any:
        """``forward(inputs)`` on a flat row, compiled (and graphed) where the execution says and the row allows;
        else eagerly, the reason said once.

        Args:
            forward: runs the model on a layout's inputs.
            inputs: the flat row's inputs (its ``Documents`` under ``DOCS_KEY``).

        Returns:
            The model's output.

        Example::

            >>> out = state.execution.run(lambda inputs: model(**inputs, use_cache=False), prepared.inputs)
        """
        if self.runs == EAGER_STEP or torch.compiler.is_compiling():
            return forward(inputs)
        if not self.settled:
            self._settle(inputs["input_ids"].device)
        docs: Documents | None = inputs.get(DOCS_KEY)  # None: stock's packed mask, no capacity (not graphed)
        if self.runs == GRAPHED and docs is not None and docs.pinned is None:
            self.ran_eagerly(PAST_CAPACITY_BATCH)
            return forward(inputs)
        if self.compiled is None:
            mode = "reduce-overhead" if self.runs == GRAPHED else None
            self.compiled = torch.compile(_step, backend=BACKEND, mode=mode)
        if self.runs == GRAPHED:
            torch.compiler.cudagraph_mark_step_begin()  # a new step: the last one's graph outputs may be reused
        return self.compiled(forward, inputs)

    def _settle(self, device: torch.device) -> None:
        """The first flat batch: CUDA graphs need its device on CUDA."""
        self.settled = True
        if self.runs == GRAPHED and device.type != "cuda":
            self.runs = COMPILED
            self.reason = _not_graphed(f"CUDA graphs need a CUDA device (the batch is on {device})")
            log.warning("foundry_attn: attn_execution %s", self.reason)

    def ran_eagerly(self, why: str) -> None:
        """A batch the compiled step does not take ran eagerly: counted, its reason said once (nothing under eager).

        Args:
            why: the reason (:data:`PROOF_DUE`, :data:`ROWS_BATCH`, :data:`PAST_CAPACITY_BATCH`).

        Example::

            >>> state.execution.ran_eagerly(PROOF_DUE)
            >>> state.execution.eager
            {'a batch with a proof due (the proof takes its forward)': 1}
        """
        if self.runs == EAGER_STEP or torch.compiler.is_compiling():
            return
        if why not in self.eager:
            log.info("foundry_attn: attn_execution %s: %s runs eagerly (said once)", self.runs, why)
        self.eager[why] = self.eager.get(why, 0) + 1


def execution_for(
    asked: str, caller_compiles: bool, backend: str, capacity: int, stock_mask: bool, rows: bool
) -> Execution:
    """What the flat step runs as for ``asked``: ``graphed`` where the row has a few fixed shapes and the kernel
    reads its bounds on the device, else ``compiled``; eager under the caller's own ``torch.compile``. The device
    is read on the first flat batch (a model is often built on the CPU and moved).

    Args:
        asked: ``eager``, ``compiled`` or ``graphed``.
        caller_compiles: ``attach`` was given a compiled model (the caller's ``torch.compile`` runs the step).
        backend: the attached backend.
        capacity: the flat row's capacity as applied (0: each row at its own length).
        stock_mask: the flat row runs stock's packed mask (its bounds read from the positions on the host).
        rows: the run is on rows at attach (``attn_path: rows``, or the flat path refused).

    Returns:
        The :class:`Execution`, its reason said.

    Example::

        >>> execution_for("graphed", False, "sdpa", 0, False, False).reason
        'compiled: graphed not applied: sdpa has no capacity (attach(..., capacity=N) on flash_attention_2 or ...'
    """
    check_execution(asked)
    if asked == EAGER_STEP:
        return Execution(asked, EAGER_STEP, "eager (as asked)")
    if caller_compiles:
        return Execution(asked, EAGER_STEP, "eager: the model is compiled already (the caller's torch.compile runs it)")
    if rows:
        return Execution(asked, EAGER_STEP, f"eager: the run is on {ROWS_BATCH}")
    if asked == COMPILED:
        return Execution(asked, COMPILED, _COMPILED_REASON)
    why = ""
    if stock_mask:
        why = "the flat row runs stock's packed mask, whose bounds are read on the host"
    elif not capacity:
        why = (
            f"{backend} has no capacity (attach(..., capacity=N) / attn_capacity on flash_attention_2 or "
            "torch_varlen: a few fixed shapes, bounds read on the device)"
        )
    if why:
        return Execution(asked, COMPILED, _not_graphed(why))
    return Execution(asked, GRAPHED, f"graphed: compiled and captured in CUDA graphs, one per bucket of {capacity}")
