"""Equal memory for ``foundry-attn bench gpu``: each tier at the largest multiple of the seed's batch that fits a memory
budget, and its real tokens/s there.

For each tier of :data:`TIERS` that ran: ``k`` copies of ``a_report`` stacked (``k`` x 6 rows of 2048, the same
documents; :meth:`Workload.repeated`), the largest ``k`` up to a cap whose step's peak memory (above the resting state,
as in the main table) fits the budget (:func:`largest_fit`). ``k = 1`` is the main table's a_report step. The first
probe is the line through it (the gradients' bytes, constant, plus ``k`` x the rest) at the budget; then its neighbour,
then bisection. A probe predicted past :data:`MARGIN` x the budget (or the device's free memory) is not run and does
not fit; an out-of-memory error is caught, the memory freed, and does not fit either; past the run's time budget the
search stops at the largest fit so far (``stopped``). A capacity tier's capacity follows ``k``
(``set_capacity``: ``k`` x the batch's positions). Then every tier is timed at its ``k``, round-robin, a few rounds:
``tokens_per_s``, and its ratio to ``padded_dense`` at its own ``k``. Core module: torch and transformers only.
"""

from __future__ import annotations

import functools
import gc
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from foundry_attn.bench.gpu_report import BASELINE
from foundry_attn.bench.gpu_tiers import Tier, warm
from foundry_attn.bench.gpu_workloads import Workload
from foundry_attn.bench.timing import median, round_robin
from foundry_attn.path.state import path_of

TIERS = (
    BASELINE,
    "padded_dense_compiled",
    "padded_dense_graphed",
    "stock_padding_free",
    "ours_torch_varlen",
    "ours_torch_varlen_capacity",
    "ours_torch_varlen_compiled",
    "ours_torch_varlen_graphed",
)
GPU_BUDGET_GB, CPU_BUDGET_GB = 24.0, 24 / 1024  # GiB: the CPU plumbing's tiny model gets 24 MiB
GPU_CAP, CPU_CAP = 16, 8
GPU_ROUNDS, CPU_ROUNDS = 3, 2
#: a multiple predicted past this many times the budget is not run (it would not fit)
MARGIN = 1.25
GiB = 2**30


def largest_fit(fits: Callable[[int], bool | None], guess: int, cap: int) -> int:
    """The largest ``k`` in ``1..cap`` with ``fits(k)``, ``fits`` monotone and ``fits(1)`` true: ``guess`` first,
    then its neighbour, then bisection. ``fits`` returns None to stop: the largest fit so far."""
    lo, hi = 1, cap + 1  # lo fits, hi does not
    k, first = min(max(guess, 2), cap), True
    while hi - lo > 1:
        ok = fits(k)
        if ok is None:
            break
        lo, hi = (k, hi) if ok else (lo, k)
        k = (k + 1 if ok else k - 1) if first else (lo + hi) // 2
        k, first = min(max(k, lo + 1), hi - 1), False
    return lo


def release(device: torch.device) -> None:
    """What a step left behind collected, and CUDA's cache emptied (after an OOM, between tiers)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def set_capacity(model: torch.nn.Module, capacity: int) -> None:
    """The attached model's flat rows padded up to ``capacity`` tokens from its next batch on."""
    state = path_of(model)
    if state is None:
        raise ValueError("set_capacity: the model is not attached")
    state.run_with(capacity=capacity)  # a tier of a backend that reads its bounds on the device


class Search:
    """One tier's search for its largest ``k``: the probes it ran or ruled out, and why it stopped."""

    def __init__(self, tier: Tier, model: torch.nn.Module, workload: Workload, peak1: int, budget: int) -> None:
        self.tier, self.model, self.workload, self.budget = tier, model, workload, budget
        self.constant = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        self.per_batch = max(peak1 - self.constant, 1)
        self.peaks = {1: peak1}
        self.probes: list[dict[str, Any]] = []
        self.stopped: str | None = None

    def predicted(self, k: int) -> int:
        return self.constant + k * self.per_batch

    def guess(self, cap: int) -> int:
        return max(1, min(cap, (self.budget - self.constant) // self.per_batch))

    def at(self, k: int) -> Workload:
        """The stacked batch, the capacity tier's capacity at ``k`` x the batch's positions."""
        if self.tier.capacity:
            set_capacity(self.model, k * self.tier.capacity)
        return self.workload.repeated(k)

    def fits(self, k: int, device: torch.device, least: int, deadline: float | None) -> bool | None:
        predicted = self.predicted(k)
        free = None
        if device.type == "cuda":  # the driver's free memory and the allocator's cached blocks
            free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
            free -= torch.cuda.memory_allocated(device)
        if predicted > MARGIN * self.budget or (free is not None and predicted > free):
            self.probes.append({"k": k, "predicted_mb": predicted / 2**20, "run": False})
            return False
        if deadline is not None and time.perf_counter() > deadline:
            self.stopped = f"the run's time budget was spent before k={k}"
            return None
        batch = self.at(k).batches(device)[self.tier.batch]
        try:
            peak = warm(self.tier, self.model, batch, least, device).peak
        except torch.OutOfMemoryError as exc:
            self.model.zero_grad(set_to_none=True)
            del batch
            release(device)
            self.probes.append({"k": k, "oom": str(exc).splitlines()[0][:200], "fits": False})
            return False
        self.model.zero_grad(set_to_none=True)
        if peak is None:  # equal_memory searches only tiers whose peak is measured here
            raise RuntimeError(f"{self.tier.name}: its peak memory is not measured on {device.type}")
        self.peaks[k] = peak
        self.probes.append({"k": k, "peak_mem_mb": peak / 2**20, "fits": peak <= self.budget})
        return peak <= self.budget


def equal_memory(
    tiers: list[Tier],
    models: Mapping[str, torch.nn.Module],
    workload: Workload,
    main: Mapping[str, Any],
    device: torch.device,
    *,
    budget_gb: float,
    least: int = 1,
    deadline: float | None = None,
    cap: int | None = None,
    rounds: int | None = None,
) -> dict[str, Any]:
    """Each tier of :data:`TIERS` that ran at its largest ``k`` under the budget (GiB), timed there; ``main``: the
    main table's results on ``workload`` (``k = 1``)."""
    cuda = device.type == "cuda"
    budget = int(budget_gb * GiB)
    cap = cap or (GPU_CAP if cuda else CPU_CAP)
    rounds = rounds or (GPU_ROUNDS if cuda else CPU_ROUNDS)
    out: dict[str, Any] = {}
    chosen: dict[str, int] = {}
    searches: dict[str, Search] = {}
    for tier in (t for t in tiers if t.name in TIERS):
        ran = main.get(tier.name, {})
        if tier.skipped is not None or ran.get("peak_mem_mb") is None:
            unmeasured = "its peak memory is not measured here (a compiled step off CUDA)"
            why = tier.skipped or ran.get("skipped") or (unmeasured if "peak_mem_mb" in ran else "did not run")
            out[tier.name] = {"skipped": why}
            continue
        search = searches[tier.name] = Search(
            tier, models[tier.name], workload, round(ran["peak_mem_mb"] * 2**20), budget
        )
        if search.peaks[1] > budget:
            out[tier.name] = {"skipped": f"the seed's batch alone needs {ran['peak_mem_mb']:.0f} MB, over the budget"}
            continue
        try:
            chosen[tier.name] = largest_fit(
                functools.partial(search.fits, device=device, least=least, deadline=deadline), search.guess(cap), cap
            )
        except Exception as exc:  # one tier's failure must not cost the others their numbers
            _failed(out, tier.name, models[tier.name], exc, device)
    batches = {name: searches[name].at(k).batches(device)[searches[name].tier.batch] for name, k in chosen.items()}
    for name in list(chosen):  # untimed: back at its k (a compiled step's graph for it, a capacity's proof)
        try:
            for _ in range(2):
                models[name].zero_grad(set_to_none=True)
                searches[name].tier.step(models[name], batches[name])
        except Exception as exc:
            _failed(out, name, models[name], exc, device)
            del chosen[name]
    try:
        times = round_robin(
            {name: _stepper(searches[name], batches[name]) for name in chosen},
            rounds,
            device=device,
            before=lambda name: models[name].zero_grad(set_to_none=True),
        )
    except Exception as exc:
        for name in chosen:
            _failed(out, name, models[name], exc, device)
        chosen.clear()
    for name, k in chosen.items():
        models[name].zero_grad(set_to_none=True)
        step = median(times.seconds[name])
        search = searches[name]
        out[name] = {
            "k": k,
            "rows": k * len(workload.doc_lens),
            "real_tokens": k * workload.real_tokens,
            "peak_mem_mb": search.peaks[k] / 2**20,
            "tokens_per_s": k * workload.real_tokens / step,
            "step_ms": step * 1e3,
            "probes": search.probes,
            "stopped": search.stopped,
            "capped": k == cap,
        }
    for search in searches.values():
        if search.tier.capacity:
            set_capacity(search.model, search.tier.capacity)
    base = out.get(BASELINE, {}).get("tokens_per_s")
    for result in out.values():
        if "tokens_per_s" in result:
            result["ratio_vs_padded_dense"] = result["tokens_per_s"] / base if base else None
    release(device)
    return {
        "batch": workload.name,
        "budget_mb": budget / 2**20,
        "cap": cap,
        "rounds": rounds,
        "predicted_past": MARGIN,
        "tiers": {name: out[name] for name in TIERS if name in out},
    }


def _stepper(search: Search, batch: Mapping[str, Any]) -> Callable[[], Any]:
    return lambda: search.tier.step(search.model, batch)


def _failed(out: dict[str, Any], name: str, model: torch.nn.Module, exc: Exception, device: torch.device) -> None:
    """A tier's search or timing failed: reported, its memory freed (the plumbing run raises: it is a test)."""
    if device.type != "cuda":
        raise exc
    out[name] = {"skipped": f"failed: {type(exc).__name__}: {exc}"[:2000]}
    model.zero_grad(set_to_none=True)
    release(device)


def skipped(why: str) -> dict[str, Any]:
    """The section where it does not run: why."""
    return {"skipped": why, "tiers": {}}


def budget_of(memory_gb: float | None, device: torch.device) -> float:
    """The budget in GiB: ``memory_gb``, else 24 on CUDA and 24 MiB on the CPU."""
    if memory_gb is not None:
        if not (memory_gb > 0 and math.isfinite(memory_gb)):
            raise ValueError(f"foundry-attn bench gpu: --memory-gb must be a positive number, not {memory_gb!r}")
        return memory_gb
    return GPU_BUDGET_GB if device.type == "cuda" else CPU_BUDGET_GB
