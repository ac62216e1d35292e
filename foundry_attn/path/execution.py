"""How the flat step runs: ``auto`` (the default), ``eager``, ``compiled`` (the model's repeated blocks compiled
once per kind, forward and backward) or ``graphed`` (compiled and captured in CUDA graphs, ``mode="reduce-overhead"``),
with the reason.

    state = attach(hf_model, "flash_attention_2")    # execution="auto": graphed on CUDA, eager on a CPU
    state.execution.runs, state.execution.reason     # ("eager", "auto: eager on cpu (...)") on a CPU

    model:
      name: foundry_attn_causal_lm
      attn_execution: auto            # auto | eager | compiled | graphed

``auto`` reads the first flat batch's device: on CUDA, graphed where the kernel reads the documents' bounds on the
device (flash_attention_2, torch_varlen), at the capacity given or else the first flat batch's rows x width; else
compiled; on a CPU, eager. A compile that fails under ``auto`` leaves the step eager, with the reason. ``graphed``
needs a CUDA device and a flat row of a few fixed shapes (a capacity, on a backend that reads the documents' bounds on
the device); where it cannot apply, the step runs compiled and says why. ``compiled`` applies on every device and
backend, except under the caller's own ``torch.compile``. Only the decoder layers are compiled (one graph per kind of
layer, :mod:`foundry_attn.path.regions`); the compile's seconds are said once, when spent. A batch the compiled step
cannot take runs eagerly, each reason said once and counted (``state.execution.eager``): a proof due on it (the proof
takes its forward), rows (one document per row), a batch past the capacity under ``graphed``. The layout stays an
argument of the call. Core module: torch only.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from foundry_attn.attention.documents import DOCS_KEY, Documents
from foundry_attn.checks import check_choice
from foundry_attn.path.agreement import sharded
from foundry_attn.path.regions import Regions
from foundry_attn.selection.options import AUTO_STEP, COMPILED, EAGER_STEP, EXECUTIONS, GRAPHED

log = logging.getLogger(__name__)

#: what ``torch.compile`` compiles the step with (tests use a cheaper backend for the same traced graph)
BACKEND: str | Callable[..., Any] = "inductor"

#: why a batch runs eagerly under a compiled execution (said once each, counted in ``Execution.eager``)
PROOF_DUE = "a batch with a proof due (the proof takes its forward)"
ROWS_BATCH = "rows (one document per row, a 2-D mask: a shape per batch)"
PAST_CAPACITY_BATCH = "a batch past the capacity (a CUDA graph per shape)"
#: why ``auto`` does not graph a sharded model
SHARDED = "the parameters are sharded (FSDP): their gathered storage moves from step to step, CUDA graphs would not"


def check_execution(execution: str) -> str:
    """``execution`` if it is one of :data:`EXECUTIONS`, else the ValueError that lists them.

    Args:
        execution: ``attn_execution`` / ``attach(..., execution=)`` as the user gave it.

    Returns:
        ``execution``.

    Example::

        >>> check_execution("graph")
        Traceback (most recent call last):
            ...
        ValueError: attn_execution: unknown value 'graph'; valid values: auto, eager, compiled, graphed
    """
    return check_choice("attn_execution", execution, EXECUTIONS)


_COMPILED_REASON = "compiled: torch.compile of the decoder layers, one graph per kind (forward and backward)"


def _not_graphed(why: str) -> str:
    """The reason of a graphed execution that runs compiled instead."""
    return f"{_COMPILED_REASON}; graphed not applied: {why}"


def _auto_on(device: torch.device, graphable: str, capacity: int) -> tuple[str, str]:
    """``auto``'s choice on ``device``: (runs, reason). ``graphable``: why not graphed ("" where it can be)."""
    if device.type != "cuda":
        return EAGER_STEP, (
            f"auto: eager on {device.type} (compiled and graphed steps pay on a CUDA device; attn_execution: compiled "
            "compiles here)"
        )
    if graphable:
        return COMPILED, f"auto: {_not_graphed(graphable)}"
    return GRAPHED, f"auto: graphed: the decoder layers compiled and captured in CUDA graphs, at capacity {capacity}"


@dataclasses.dataclass
class Execution:
    """What the flat step runs as (``runs``) for what was asked (``asked``), and why (``reason``); the batches that
    ran eagerly, by reason (``eager``); the seconds the first compiled step took (``compile_s``)."""

    asked: str = EAGER_STEP
    runs: str = EAGER_STEP
    reason: str = "eager (as asked)"
    eager: dict[str, int] = dataclasses.field(default_factory=dict)
    settled: bool = False  # the device was read on the first flat batch
    by_device: bool = False  # auto: the first flat batch's device decides
    graphable: str = ""  # auto: why the step cannot be graphed here ("" where it can)
    compile_s: float | None = None
    compiled: Regions | None = dataclasses.field(default=None, repr=False, compare=False)

    def fresh(self) -> Execution:
        """The same choice for a copied model, compiled again on its first batch; under ``auto`` that batch's device
        decides again (a copy may train elsewhere).

        Returns:
            A new :class:`Execution` with ``asked``, ``runs`` and ``reason`` kept.

        Example::

            >>> import copy
            >>> copy.deepcopy(model).foundry_path.execution.compiled is None
            True
        """
        settled = self.settled and not self.by_device
        return dataclasses.replace(self, eager={}, compile_s=None, compiled=None, settled=settled)

    def settle(self, device: torch.device, capacity: int, tokens: int, hf: torch.nn.Module | None = None) -> int:
        """The first flat batch: its device decides ``auto``, and CUDA graphs need CUDA. Said in the log. A compiled
        step's decoder layers are set up here, before the batch's proof watches the model's code.

        Args:
            device: the batch's device.
            capacity: the capacity applied (0: none).
            tokens: the first flat batch's rows x width (``auto``'s capacity where none is given).
            hf: the transformers model (its decoder layers are compiled where the step is).

        Returns:
            The capacity the flat rows pad to from now on.

        Example::

            >>> state.execution.settle(torch.device("cpu"), 0, 12288, hf_model), state.execution.runs
            (0, 'eager')
        """
        self.settled = True
        if self.by_device:
            if not self.graphable and hf is not None and sharded(hf):
                self.graphable = SHARDED
            runs, reason = _auto_on(device, self.graphable, capacity or tokens)
            if runs == GRAPHED and not capacity:
                capacity, reason = tokens, f"{reason} (the first flat batch's rows x width)"
            if runs != self.runs:
                log.info("foundry_attn: attn_execution %s", reason)
            self.runs, self.reason = runs, reason
        elif self.runs == GRAPHED and device.type != "cuda":
            self.runs = COMPILED
            self.reason = _not_graphed(f"CUDA graphs need a CUDA device (the batch is on {device})")
            log.warning("foundry_attn: attn_execution %s", self.reason)
        if hf is not None and self.runs != EAGER_STEP:
            self._regions(hf)
        return capacity

    def _regions(self, hf: torch.nn.Module) -> Regions:
        """The model's decoder layers compiled for this execution (graphed: ``mode="reduce-overhead"``), made once."""
        if self.compiled is None:
            self.compiled = Regions.of(hf, BACKEND, "reduce-overhead" if self.runs == GRAPHED else None)
        return self.compiled

    def run(self, forward: Callable[[dict[str, Any]], Any], inputs: dict[str, Any], hf: torch.nn.Module) -> Any:
        """``forward(inputs)`` on a flat row, its decoder layers compiled (and graphed) where the execution says and
        the row allows; else eagerly, the reason said once.

        Args:
            forward: runs the model on a layout's inputs.
            inputs: the flat row's inputs (its ``Documents`` under ``DOCS_KEY``).
            hf: the transformers model (its decoder layers are compiled).

        Returns:
            The model's output.

        Example::

            >>> from foundry_attn.path.forward import prepare_documents
            >>> prepared = prepare_documents(model, batch)       # one flat row of 90 tokens: doc_lens [[20, 30], [40]]
            >>> out = state.execution.run(lambda inputs: model(**inputs, use_cache=False), prepared.inputs, model)
            >>> out.logits.shape
            torch.Size([1, 90, 64])
        """
        if self.runs == EAGER_STEP or torch.compiler.is_compiling():
            return forward(inputs)
        docs: Documents | None = inputs.get(DOCS_KEY)  # None: stock's packed mask, no capacity (not graphed)
        if self.runs == GRAPHED and docs is not None and docs.pinned is None:
            self.ran_eagerly(PAST_CAPACITY_BATCH)
            return forward(inputs)
        if self.runs == GRAPHED:
            torch.compiler.cudagraph_mark_step_begin()  # a new step: the last one's graph outputs may be reused
        regions = self._regions(hf)
        if self.compile_s is not None:
            with regions.active():
                return forward(inputs)
        start = time.perf_counter()
        try:
            with regions.active():
                out = forward(inputs)
        except Exception as exc:  # auto never runs worse than eager: a compile that fails leaves the step eager
            if self.asked != AUTO_STEP:
                raise
            regions.remove()
            self.runs, self.compiled = EAGER_STEP, None
            self.reason = f"auto: eager: the compiled step failed here ({type(exc).__name__}: {exc})"[:500]
            log.warning("foundry_attn: attn_execution %s", self.reason)
            return forward(inputs)
        self.compile_s = time.perf_counter() - start
        log.info(
            "foundry_attn: attn_execution %s: %s compiled in %.1f s (forward; said once)",
            self.runs,
            ", ".join(f"{n} x {k}" for k, n in regions.kinds.items()),
            self.compile_s,
        )
        return out

    def ran_eagerly(self, why: str) -> None:
        """A batch the compiled step does not take ran eagerly: counted, its reason said once (nothing under eager).

        Args:
            why: the reason (:data:`PROOF_DUE`, :data:`ROWS_BATCH`, :data:`PAST_CAPACITY_BATCH`).

        Example::

            >>> from foundry_attn import attach
            >>> state = attach(model, "sdpa", execution="compiled")
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
    asked: str,
    caller_compiles: bool,
    backend: str,
    capacity: int,
    stock_mask: bool,
    rows: bool,
    device: torch.device | None = None,
    graphable: str = "",
) -> Execution:
    """What the flat step runs as for ``asked``: ``graphed`` where the row has a few fixed shapes and the kernel
    reads its bounds on the device, else ``compiled``; eager under the caller's own ``torch.compile``; ``auto`` by the
    device (CUDA: graphed where it can be, else compiled; a CPU: eager). The device is read again on the first flat
    batch (a model is often built on the CPU and moved).

    Args:
        asked: ``auto``, ``eager``, ``compiled`` or ``graphed``.
        caller_compiles: ``attach`` was given a compiled model (the caller's ``torch.compile`` runs the step).
        backend: the attached backend.
        capacity: the flat row's capacity as applied (0: each row at its own length).
        stock_mask: the flat row runs stock's packed mask (its bounds read from the positions on the host).
        rows: the run is on rows at attach (``attn_path: rows``, or the flat path refused).
        device: where the weights are now (``auto``'s first answer; None: the CPU).
        graphable: ``auto``: why a capacity cannot apply to this model and backend ("" where it can).

    Returns:
        The :class:`Execution`, its reason said.

    Example::

        >>> execution_for("graphed", False, "sdpa", 0, False, False).reason
        'compiled: ...; graphed not applied: sdpa has no capacity (attach(..., capacity=N) / attn_capacity on ...)'
        >>> execution_for("auto", False, "sdpa", 0, False, False).runs
        'eager'
    """
    check_execution(asked)
    if asked == EAGER_STEP:
        return Execution(asked, EAGER_STEP, "eager (as asked)")
    if caller_compiles:
        return Execution(asked, EAGER_STEP, "eager: the model is compiled already (the caller's torch.compile runs it)")
    if rows:
        return Execution(asked, EAGER_STEP, f"eager: the run is on {ROWS_BATCH}")
    if asked == AUTO_STEP:
        why = "the flat row runs stock's packed mask, whose bounds are read on the host" if stock_mask else graphable
        runs, reason = _auto_on(device or torch.device("cpu"), why, capacity)
        return Execution(asked, runs, reason, by_device=True, graphable=why)
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
