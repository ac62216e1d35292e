"""The tiers of ``foundry-attn bench gpu``: what each runs, on which kernel here or why it is skipped
(:func:`make_tiers`), one step of a tier and its warm-up (:class:`Tier`, :func:`warm`).

A tier runs ``eager``, ``compiled`` or ``graphed``: the stock tiers through ``torch.compile(model)`` here (inductor;
``mode="reduce-overhead"`` for graphed), ours through the user's switch, ``attach(..., execution=)``
(:mod:`foundry_attn.path.execution`), which says what runs and why. The list of tiers is
:mod:`foundry_attn.bench.gpu`'s docstring. Core module: torch and transformers only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from foundry_attn.attention.fa2_reference import reference_flash_attn
from foundry_attn.attention.torch_varlen import torch_varlen_kernel
from foundry_attn.bench import sync
from foundry_attn.bench.gpu_report import BASELINE, REFERENCE
from foundry_attn.bench.gpu_workloads import ROWS, WIDTH, Workload
from foundry_attn.bench.reference_kernels import (
    flash_attn_func_via_sdpa,
    flash_varlen_from_torch,
    reference_varlen_attn,
)
from foundry_attn.bench.timing import PeakMemory
from foundry_attn.path.attach import attach
from foundry_attn.path.execution import AUTO_STEP, COMPILED, EAGER_STEP, GRAPHED
from foundry_attn.path.forward import forward_documents
from foundry_attn.path.state import path_of

#: warm-up steps before a tier's measured step, at the least: compiling takes the first, CUDA graphs record later
LEAST_WARMUP = {EAGER_STEP: 0, COMPILED: 2, GRAPHED: 3}
REFERENCE_LABEL = "reference kernel (not a GPU number)"
#: the CPU plumbing run compiles with Dynamo's capture alone (inductor's compile of even the tiny model: 20-30 s)
CPU_COMPILE_BACKEND = "eager"
CPU_COMPILED = f"torch.compile backend={CPU_COMPILE_BACKEND!r}: Dynamo's capture, no inductor (CPU plumbing)"
GRAPHED_NEEDS_CUDA = "CUDA graphs need a CUDA device: graphed tiers run on CUDA only in this bench"
GRAPHED_PEAK = "CUDA graphs: a replay allocates nothing, so the peak spans the warm-up steps that record the graphs"


@contextlib.contextmanager
def reference_torch_varlen() -> Iterator[None]:
    """Our ``torch_varlen`` adapter on :func:`reference_varlen_attn` instead of torch's CUDA kernel (CPU runs)."""
    from foundry_attn.attention import varlen_functions
    from foundry_attn.patching import patch_attribute

    patch = patch_attribute(varlen_functions, "torch_varlen_kernel", replace=lambda: reference_varlen_attn)
    try:
        yield
    finally:
        patch.remove()


@contextlib.contextmanager
def cpu_compiled_torch_varlen() -> Iterator[None]:
    """:func:`reference_torch_varlen`, and our compiled step on :data:`CPU_COMPILE_BACKEND` (CPU plumbing)."""
    from foundry_attn.patching import patch_attribute
    from foundry_attn.path import execution

    patch = patch_attribute(execution, "BACKEND", replace=CPU_COMPILE_BACKEND)
    try:
        with reference_torch_varlen():
            yield
    finally:
        patch.remove()


def flash_attn_version() -> str | None:
    from foundry_attn.selection.capability import probe_flash_attn

    return probe_flash_attn()[0]


@dataclasses.dataclass
class Tier:
    """One way to run a batch; ``skipped`` says why it does not run here."""

    name: str
    description: str
    kernel: str
    skipped: str | None = None
    batch: str = "documents"  # which of Workload.batches it takes
    backend: str | None = None  # ours: attach(model, backend) + forward_documents; else the stock impl below
    stock_impl: str | None = None
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    stock_row_layout: bool = False  # attends across documents in a row (stock masks): exact with one per row
    capacity: int = 0  # ours: each flat row padded to a few fixed shapes up to this many tokens (0: its own length)
    execution: str = EAGER_STEP  # asked: stock compiles the model here, ours asks attach(..., execution=)
    default: bool = False  # ours as a user gets it: attach(model, backend) with no capacity or execution given
    compile_backend: str = "inductor"  # stock compiled and graphed tiers
    runs: str = EAGER_STEP  # the execution that runs (ours: attach's choice, settled on the first flat batch)
    execution_reason: str = "eager"
    cudagraph_skips: int = 0  # inductor's "skipping cudagraphs" during this tier's warm-ups (graphed only)

    @property
    def graphed(self) -> bool:
        return GRAPHED in (self.execution, self.runs)

    def warmup(self, least: int) -> int:
        """Warm-up steps before the measured one: ``least``, more where the step compiles or records graphs."""
        return max(least, LEAST_WARMUP[self.execution], LEAST_WARMUP.get(self.runs, 0))

    def setup(self, model: Any) -> None:
        if self.backend is not None:
            with self.context():  # the proof runs the tier's kernel (a CPU stand-in where there is no GPU)
                if self.default:
                    state = attach(model, self.backend)
                else:
                    state = attach(model, self.backend, capacity=self.capacity, execution=self.execution)
            if state.path != "flat":
                raise RuntimeError(f"{self.name}: the flat path is not proven for this model: {state.reason}")
        else:
            model.config._attn_implementation = self.stock_impl
            if self.execution != EAGER_STEP:
                model.compile(backend=self.compile_backend, mode="reduce-overhead" if self.graphed else None)
        self.settle(model)

    def settle(self, model: Any) -> None:
        """Read the execution that runs, and why (ours: attach's; graphed settles on the first flat batch)."""
        if self.backend is not None:
            state = path_of(model)
            assert state is not None  # setup attached it
            self.runs, self.execution_reason = state.execution.runs, state.execution.reason
            if self.default:
                self.kernel = f"{state.backend} (attach's choice; capacity {state.capacity or 'none'})"
        elif self.execution != EAGER_STEP:
            self.runs = self.execution
            mode = ', mode="reduce-overhead" (CUDA graphs)' if self.graphed else ""
            self.execution_reason = f"torch.compile(model) here, backend {self.compile_backend!r}{mode}"

    def step(self, model: torch.nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
        """Forward + backward; the detached loss (a copy under CUDA graphs, whose outputs the next replay reuses)."""
        with self.context():
            if self.backend is None and self.runs == GRAPHED:
                torch.compiler.cudagraph_mark_step_begin()  # a new step: torch.compile's training-loop rule
            out = forward_documents(model, batch) if self.backend is not None else model(**batch, use_cache=False)
            out.loss.backward()
        loss = out.loss.detach()
        return loss.clone() if self.graphed else loss

    def document_exact(self, workload: Workload) -> bool:
        return not self.stock_row_layout or workload.one_document_per_row

    def describe(self, models: Mapping[str, Any] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "description": self.description,
            "kernel": self.kernel,
            "runs": self.skipped is None,
            "skipped": self.skipped,
            "execution_asked": "auto" if self.default else self.execution,
            "execution": self.runs if self.skipped is None else None,
            "execution_reason": self.execution_reason if self.skipped is None else None,
        }
        state = path_of(models[self.name]) if models and self.name in models and self.backend else None
        if state is not None and state.execution.eager:
            out["eager_batches"] = dict(state.execution.eager)  # batches the compiled step did not take, by reason
        if self.graphed and self.skipped is None:
            out["peak_mem"] = GRAPHED_PEAK
            out["cudagraph_skips"] = self.cudagraph_skips  # > 0: some graph ran compiled without CUDA graphs
        return out


@dataclasses.dataclass
class Warm:
    """A tier warmed on a batch: the measured step's loss and peak bytes, the warm-up's wall seconds."""

    loss: float
    peak: int | None  # None: not measured (a compiled step off CUDA)
    warmup_s: float
    steps: int


def megabytes(peak: int | None) -> float | None:
    """A :class:`Warm` peak in MB (None: not measured)."""
    return None if peak is None else peak / 2**20


def warm(tier: Tier, model: torch.nn.Module, batch: Mapping[str, Any], least: int, device: torch.device) -> Warm:
    """``tier.warmup(least)`` untimed steps (compiling and recording included), then one measured step: its peak
    memory above the resting state (graphed: over the warm-up too, :data:`GRAPHED_PEAK`)."""
    steps = tier.warmup(least)

    def warm_up() -> float:
        sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            tier.step(model, batch)
        sync(device)
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    if tier.graphed:
        skips = _cudagraph_skips()
        with _peak_memory(tier, device) as memory:
            seconds = warm_up()
            loss = tier.step(model, batch)
        tier.cudagraph_skips += _cudagraph_skips() - skips
        tier.settle(model)
    else:
        seconds = warm_up()
        tier.settle(model)  # ours settles on its first flat batch (auto: eager on a CPU), before its peak is read
        with _peak_memory(tier, device) as memory:
            loss = tier.step(model, batch)
    return Warm(float(loss), memory.peak if memory else None, seconds, steps)


def _peak_memory(tier: Tier, device: torch.device) -> contextlib.AbstractContextManager[PeakMemory | None]:
    """The step's :class:`PeakMemory`; none for a compiled step off CUDA: there it is a dispatch mode, under which
    Dynamo skips the frames it meets, and torch 2.7 keeps skipping those code objects for the rest of the process
    (even after ``torch._dynamo.reset()``), so every later compile of them would run eagerly."""
    compiled = tier.execution != EAGER_STEP or tier.runs not in (EAGER_STEP, AUTO_STEP)
    if compiled and device.type != "cuda":
        return contextlib.nullcontext()
    return PeakMemory(device)


def _cudagraph_skips() -> int:
    """How many times inductor has skipped CUDA graphs in this process (its counter)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def make_tiers(device: torch.device, capacity: int = ROWS * WIDTH) -> list[Tier]:
    """Every tier, with what it runs on here or why it is skipped; ``capacity``: the capacity tiers' (a batch's
    positions)."""
    cuda = device.type == "cuda"
    fa_version = flash_attn_version() if cuda else None
    varlen = torch_varlen_kernel() if cuda else None
    padded = Tier(
        BASELINE,
        "stock sdpa, rows padded to the full width, no attention mask (dense causal)",
        "SDPA (flash on CUDA)",
        batch="padded",
        stock_impl="sdpa",
        stock_row_layout=True,
    )
    compiled = dataclasses.replace(
        padded,
        name="padded_dense_compiled",
        description="padded_dense under torch.compile(model) (inductor, default mode)",
        execution=COMPILED,
    )
    if not cuda:
        compiled.compile_backend, compiled.kernel = CPU_COMPILE_BACKEND, f"SDPA, {CPU_COMPILED}"
    tiers = [
        padded,
        compiled,
        dataclasses.replace(
            padded,
            name="padded_dense_graphed",
            description='padded_dense under torch.compile(model, mode="reduce-overhead"): CUDA graphs',
            execution=GRAPHED,
            skipped=None if cuda else GRAPHED_NEEDS_CUDA,
        ),
    ]
    stock = Tier(
        "stock_unpad_per_layer",
        "stock flash_attention_2 code path with a 2-D mask: _upad_input in every layer",
        "",
        batch="masked",
        stock_impl="flash_attention_2",
        stock_row_layout=True,
    )
    if fa_version:
        stock.kernel = f"flash-attn {fa_version}"
    elif varlen is not None:
        wrapped, stock.kernel = (
            flash_varlen_from_torch(varlen),
            "torch varlen_attn behind flash-attn's signature (dense: flash_attn_func via SDPA)",
        )
        stock.context = lambda: reference_flash_attn(varlen=wrapped, dense=flash_attn_func_via_sdpa)
    elif not cuda:
        wrapped, stock.kernel = flash_varlen_from_torch(reference_varlen_attn), REFERENCE_LABEL
        stock.context = lambda: reference_flash_attn(varlen=wrapped, dense=flash_attn_func_via_sdpa)
    else:
        stock.skipped = (
            f"neither flash-attn nor torch.nn.attention.varlen (torch >= 2.10) is available (torch {torch.__version__})"
        )
    tiers.append(stock)
    tiers.append(
        dataclasses.replace(
            stock,
            name="stock_padding_free",
            description="stock flash_attention_2 code path on DataCollatorWithFlattening's row: bounds from "
            "position_ids",
            batch="flattened",
            stock_row_layout=False,
        )
    )
    tiers.extend(_ours(cuda, varlen is not None, capacity))
    tiers.append(
        Tier(
            "ours_default",
            "attach(model, 'auto') + forward_documents, nothing else given: the chain's backend, execution 'auto' "
            "(CUDA: graphed at the first batch's rows x width where the backend reads its bounds on the device)",
            "the chain's choice (attach's decision)",
            backend="auto",
            default=True,
            context=reference_torch_varlen if not cuda else contextlib.nullcontext,
        )
    )
    tiers.append(
        Tier(
            "ours_flash_attn",
            "attach(model, 'flash_attention_2') + forward_documents: unpad once, flash-attn varlen per layer",
            f"flash-attn {fa_version}" if fa_version else "flash-attn",
            backend="flash_attention_2",
            skipped=None
            if fa_version
            else ("flash-attn needs CUDA" if not cuda else "flash-attn does not import here"),
        )
    )
    tiers.append(
        Tier(
            "flex_document_mask",
            "attach(model, 'flex_attention') + forward_documents: one flex call per layer with a document BlockMask",
            "flex_attention (compiled)",
            backend="flex_attention",
            skipped=None if cuda else "compiled flex runs on CUDA only in this bench",
        )
    )
    tiers.append(
        Tier(
            REFERENCE,
            "attach(model, 'sdpa') + forward_documents: one causal SDPA call per document",
            "SDPA",
            backend="sdpa",
        )
    )
    return tiers


def _ours(cuda: bool, varlen: bool, capacity: int) -> list[Tier]:
    """Our torch varlen tiers: eager, with a capacity, and compiled and graphed by attach's switch (capacity too)."""
    ours = Tier(
        "ours_torch_varlen",
        "attach(model, 'torch_varlen') + forward_documents: unpad once, varlen per layer",
        "torch varlen_attn",
        backend="torch_varlen",
    )
    if not cuda:
        ours.kernel, ours.context = REFERENCE_LABEL, reference_torch_varlen
    elif not varlen:
        ours.skipped = f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn (torch >= 2.10)"
    at_capacity = dataclasses.replace(
        ours,
        name="ours_torch_varlen_capacity",
        description=f"ours_torch_varlen, each flat row padded to a few fixed shapes up to {capacity} tokens",
        capacity=capacity,
    )
    compiled = dataclasses.replace(
        at_capacity,
        name="ours_torch_varlen_compiled",
        description=f"ours_torch_varlen_capacity with attach(..., capacity={capacity}, execution='compiled'): "
        "the flat step under torch.compile",
        execution=COMPILED,
        skipped=ours.skipped,
    )
    if not cuda:
        compiled.kernel, compiled.context = f"{REFERENCE_LABEL}, {CPU_COMPILED}", cpu_compiled_torch_varlen
    graphed = dataclasses.replace(
        compiled,
        name="ours_torch_varlen_graphed",
        description=f"ours_torch_varlen_capacity with attach(..., capacity={capacity}, execution='graphed'): "
        "compiled and captured in CUDA graphs",
        kernel=ours.kernel,
        context=ours.context,
        execution=GRAPHED,
        skipped=ours.skipped or (None if cuda else GRAPHED_NEEDS_CUDA),
    )
    return [ours, at_capacity, compiled, graphed]
