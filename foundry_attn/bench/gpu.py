"""GPU benchmark: SmolLM2-135M training steps, every contender at its best: padded dense attention and ours, each eager,
compiled and graphed, stock padding-free, and the rest; on three batches and at equal memory.

    foundry-attn bench gpu --json                        # CUDA, bf16, 30 layers, 10 rounds
    PYTHONPATH=. python -m foundry_attn.cli bench gpu --json # the same from a source tree (torch + transformers only)
    foundry-attn bench gpu --json --quick                # 3 rounds: a smoke run
    foundry-attn bench gpu --json --device cpu --quick   # the plumbing on a tiny model, fp32 (not a GPU number)

``run(tiers=..., memory_gb=..., budget_s=...)`` also takes a subset of tiers (the baseline and the reference always
run), the equal-memory budget (GiB, default 24) and the run's time budget (default 420 s on CUDA, the equal-memory
search stops past it). Without CUDA (and without ``--device cpu``) it prints one line, ``{"skipped": ...}`` under
``--json``, and exits 0. Progress (elapsed seconds per phase) goes to stderr.

Model: ``LlamaForCausalLM`` with SmolLM2-135M's exact shapes (``foundry_attn.verify.llama_shapes``: hidden 576, 9 heads,
3 KV heads, MLP 1536, 30 layers, vocab 49152, tied embeddings), random init (seed 0), config built locally,
bf16, train mode, dropout 0. A step is forward + backward (no optimizer), grads set to None before it.

Batches, 6 rows of 2048 (real token ids random, padding id 0, labels -100 on padding):

- ``a_report``: the public report's rows, one document each, real lengths 220, 217, 295, 183, 130, 350
  (1395 real tokens of 12288, fill 11.4%: 1/fill = 8.8x is the most unpadding can win). The seed's batch.
- ``b_no_padding``: 6 documents of 2048 tokens, one per row: nothing to unpad, unpadding's worst case.
- ``c_mix``: seeded lognormal lengths (median 15% of a row, clipped to 64..2048) packed into the rows in
  order, a row padded when the next document does not fit: a realistic packed fine-tuning batch.

Tiers (:mod:`foundry_attn.bench.gpu_tiers`), each in its own copy of the model (identical weights), timed round-robin
per batch (``bench.timing.round_robin``: order rotated every round, GC off inside a step, CUDA synced around it):

1. ``padded_dense``: transformers' stock ``sdpa``, rows padded to 2048, no attention mask (dense causal flash
   through SDPA), labels -100 on padding. The baseline of every ``ratio_vs_padded_dense``.
1b. ``padded_dense_compiled``: the same under ``torch.compile(model)`` (inductor, default mode).
1c. ``padded_dense_graphed``: under ``torch.compile(model, mode="reduce-overhead")``: CUDA graphs (CUDA only).
2. ``stock_unpad_per_layer``: transformers' stock FA2 code path with a 2-D ``attention_mask``: its
   ``_upad_input`` unpads q/k/v in every layer (and syncs the host) and ``pad_input`` pads the output back.
   On flash-attn when it imports; else on torch's ``varlen_attn`` (torch >= 2.10) behind flash-attn's
   signature (:mod:`foundry_attn.bench.reference_kernels`), installed where transformers looks the kernels up.
2b. ``stock_padding_free``: the same stock FA2 code path on transformers' ``DataCollatorWithFlattening`` row (every
   document in one row, ``position_ids`` restarting, no mask): transformers finds the bounds from the positions in
   every layer. What a GPU user picks for packing today.
3. ``ours_torch_varlen``: ``attach(model, "torch_varlen")`` + ``forward_documents``: the batch is
   unpadded once, every layer calls torch's varlen kernel on the flat row with ``cu_seqlens``.
3b. ``ours_torch_varlen_capacity``: the same with ``attach(..., capacity=rows x width)``: the flat row padded to a
   few fixed shapes (:mod:`foundry_attn.flat.capacity`), ``max_seqlen`` pinned, no host sync in the step.
3c. ``ours_torch_varlen_compiled``: 3b with the user's switch ``attach(..., execution="compiled")``
   (:mod:`foundry_attn.path.execution`): our path compiles the flat step itself; ``forward_documents`` unchanged.
3d. ``ours_torch_varlen_graphed``: 3b with ``execution="graphed"``: compiled and captured in CUDA graphs (CUDA only).
4. ``ours_flash_attn``: the same on flash-attn (``attach(model, "flash_attention_2")``), when it imports.
5. ``flex_document_mask``: ``attach(model, "flex_attention")``: one compiled flex call per layer with a
   document ``BlockMask``.
6. ``sdpa_per_document``: ``attach(model, "sdpa")``: each document causal alone, in at most 8 SDPA calls per layer
   (documents grouped by length, :mod:`foundry_attn.attention.length_groups`); the loss reference.

A compiled or graphed tier compiles (and records) in its warm-up steps before any timing: 2 warm-up steps at least
(3 graphed), their wall time reported apart (``compile_warmup_s``), never inside ``step_ms``. On ``c_mix`` a row holds
several documents: the stock row tiers (1, 2) attend across documents in a row with positions counted per row; ours
restart both per document. Their loss is reported there but not checked (``document_exact``: false). Every tier has
the same targets: labels -100 on padding and on each document's first token.

Reported per tier (``tiers``): kernel, the execution asked and the one that runs with its reason (ours: attach's
``state.execution``; a graphed step settles on its first batch), batches a compiled step ran eagerly (by reason).
Per batch and tier:

- ``tokens_per_s`` (real tokens / median step), ``step_ms``, ``min_step_ms``, ``samples_ms``;
- ``peak_mem_mb``: ``torch.cuda.max_memory_allocated`` above the resting state on a warm step (graphed: over the
  warm-up steps too, which record the graphs: a replay allocates nothing);
- ``ratio_vs_padded_dense`` (tokens/s over padded_dense's) and ``paired_ratio_vs_padded_dense`` (median of per-round
  ratios);
- ``compile_warmup_s`` and ``warmup_steps``; ``execution``: what ran on this batch;
- from one profiled step after the timed ones (:mod:`foundry_attn.bench.gpu_profile`, CUDA only, else None with the
  reason): ``gpu_busy_share`` (GPU busy time / that step's wall time), ``gpu_busy_ms``, ``profiled_step_ms``,
  ``launches_per_step`` (cudaLaunchKernel, cudaLaunchKernelExC, cuLaunchKernel, cuLaunchKernelEx, cudaGraphLaunch
  events; by name in ``launches``), ``gpu_kernels``, ``host_ops`` (the host's busiest ops, by self CPU time) and
  ``host_ops_ms``;
- the loss, and the loss agreement against ``sdpa_per_document`` (relative; bf16 2e-2, fp32 1e-4).

``equal_memory`` (:mod:`foundry_attn.bench.gpu_memory`): for padded_dense (all three), stock_padding_free and our four
torch varlen tiers, the largest multiple ``k`` (<= 16) of ``a_report`` whose step fits the budget (24 GiB), its
peak memory, real tokens/s at ``k`` (3 rounds) and the ratio to padded_dense at its ``k``. A tier that fails is
reported with its error and skipped; the others still run.

Targets (:data:`TARGETS`; ours at its best: the fastest of our tiers whose loss agrees; padded dense at its best: the
fastest of its three): on ``a_report`` >= 3x padded dense at its best and >= 1.0x ``stock_padding_free``; on
``b_no_padding`` >= 0.95x padded dense at its best; on ``a_report`` our best tier's ``gpu_busy_share`` >= 0.70.

``--device cpu`` runs the same code paths on a tiny model (``llama_shapes.TINY_SHAPE``, 2 layers, vocab 512, rows
of 128 with every length scaled by 128/2048, fp32): the varlen tiers on the pure-PyTorch reference kernel standing
in for torch's ``varlen_attn`` (:func:`reference_varlen_attn`, "reference kernel (not a GPU number)"), the compiled
tiers on Dynamo's ``eager`` backend (no inductor: its compile takes 20-30 s a graph on a small CPU), the graphed ones
skipped (CUDA graphs need CUDA), equal memory in a 24 MiB budget, k <= 8; no profile. For tests, not for numbers.

The batches and the model live in :mod:`foundry_attn.bench.gpu_workloads`; the tiers in
:mod:`foundry_attn.bench.gpu_tiers`; the loss agreement, the targets and the summary in
:mod:`foundry_attn.bench.gpu_report`; the timed run here. Core module: torch and transformers only.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from foundry_attn.attention.torch_varlen import torch_varlen_kernel
from foundry_attn.bench import machine
from foundry_attn.bench.gpu_memory import budget_of, equal_memory, release
from foundry_attn.bench.gpu_memory import skipped as memory_skipped
from foundry_attn.bench.gpu_profile import not_profiled, profile_step
from foundry_attn.bench.gpu_report import BASELINE, DEFAULT, OURS_EAGER, REFERENCE, agreement, targets
from foundry_attn.bench.gpu_report import OURS as OURS
from foundry_attn.bench.gpu_report import PADDED as PADDED
from foundry_attn.bench.gpu_report import TARGETS as TARGETS
from foundry_attn.bench.gpu_report import summary as summary
from foundry_attn.bench.gpu_tiers import REFERENCE_LABEL, Tier, Warm, flash_attn_version, make_tiers, megabytes, warm
from foundry_attn.bench.gpu_tiers import reference_torch_varlen as reference_torch_varlen
from foundry_attn.bench.gpu_workloads import CPU_WIDTH as CPU_WIDTH
from foundry_attn.bench.gpu_workloads import MIX_MIN as MIX_MIN
from foundry_attn.bench.gpu_workloads import REPORT_LENGTHS as REPORT_LENGTHS
from foundry_attn.bench.gpu_workloads import ROWS as ROWS
from foundry_attn.bench.gpu_workloads import SEED, Settings, Workload, build_model, workloads
from foundry_attn.bench.gpu_workloads import WIDTH as WIDTH
from foundry_attn.bench.gpu_workloads import mix_lengths as mix_lengths
from foundry_attn.bench.gpu_workloads import scaled as scaled
from foundry_attn.bench.timing import Timings, median, paired_ratio_median, round_robin

# the ``X as X`` imports: names of the batches, the tiers and the report kept importable here, where they were before

COMMAND = "foundry-attn bench gpu --json"
NEEDS_CUDA = (
    "foundry-attn bench gpu needs a CUDA GPU (torch.cuda.is_available() is False here); "
    "--device cpu runs its plumbing on a tiny model"
)
#: seconds on CUDA after which the equal-memory search stops (the whole command within 8 minutes on an H100/H200)
GPU_BUDGET_S = 420.0
NOT_SELECTED = "not selected (--tiers)"
#: ``--quick``: the short GPU run (within 4 minutes on an H200, its compiles included): padded dense eager and at its
#: best (graphed), ours eager and as a user gets it (``ours_default``), the reference; batches (a) and (b); no equal
#: memory
QUICK_TIERS = (BASELINE, "padded_dense_graphed", OURS_EAGER, DEFAULT, REFERENCE)
QUICK_BATCHES = ("a_report", "b_no_padding")
NOT_QUICK = "not in --quick (the short run: padded dense eager and graphed, ours eager and default, the reference)"


class Lines:
    """``--jsonl PATH``: one JSON line per result as soon as it is measured (appended and flushed), so a run stopped
    part way keeps what it measured; nothing without a path."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)

    def write(self, kind: str, **fields: Any) -> None:
        if not self.path:
            return
        with open(self.path, "a", encoding="utf-8") as out:
            out.write(json.dumps({"kind": kind, **fields}, default=str) + "\n")
            out.flush()


class Clock:
    """The run's elapsed time, each phase's seconds, and a progress line per phase on stderr."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.mark = self.started
        self.phases: dict[str, float] = {}

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = now - self.mark
        self.mark = now
        print(f"foundry-attn bench gpu: {self.elapsed:6.1f} s: {phase} done", file=sys.stderr, flush=True)


def select(tiers: list[Tier], names: str | Sequence[str] | None, quick: bool = False) -> None:
    """Skip the tiers not in ``names`` (comma-separated or a list; None: all, or :data:`QUICK_TIERS` under
    ``quick``); the baseline and the reference always run."""
    if names is None and quick:
        for tier in tiers:
            if tier.skipped is None and tier.name not in QUICK_TIERS:
                tier.skipped = NOT_QUICK
    if names is None:
        return
    wanted = {n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()}
    unknown = wanted - {t.name for t in tiers}
    if unknown:
        raise ValueError(
            f"foundry-attn bench gpu: unknown tiers {', '.join(sorted(unknown))}; valid: "
            + ", ".join(t.name for t in tiers)
        )
    for tier in tiers:
        if tier.skipped is None and tier.name not in wanted | {BASELINE, REFERENCE}:
            tier.skipped = NOT_SELECTED


def bench_workload(
    workload: Workload,
    tiers: list[Tier],
    models: Mapping[str, torch.nn.Module],
    settings: Settings,
    device: torch.device,
    lines: Lines | None = None,
) -> dict[str, Any]:
    """Every running tier on one batch: warmed (compiled, recorded), timed round-robin, then profiled once; each
    warm-up and each tier's result written to ``lines`` as measured."""
    lines = lines or Lines(None)
    batches = workload.batches(device)
    warmed: dict[str, Warm] = {}
    failed: dict[str, str] = {}
    running = [t for t in tiers if t.skipped is None]
    for tier in running:
        try:
            warmed[tier.name] = w = warm(tier, models[tier.name], batches[tier.batch], settings.warmup, device)
            lines.write(
                "warm_up",
                batch=workload.name,
                tier=tier.name,
                execution=tier.runs,
                compile_warmup_s=w.warmup_s,
                warmup_steps=w.steps,
                peak_mem_mb=megabytes(w.peak),
                loss=w.loss,
            )
        except Exception as exc:  # one failing tier (a kernel, an OOM) must not cost the others their numbers
            if device.type == "cpu":
                raise  # the plumbing run is a test: fail loudly
            failed[tier.name] = f"{type(exc).__name__}: {exc}"[:2000]
            lines.write("failed", batch=workload.name, tier=tier.name, error=failed[tier.name])
            models[tier.name].zero_grad(set_to_none=True)
            release(device)
    timed = [t for t in running if t.name not in failed]

    def timed_step(tier: Tier) -> Callable[[], torch.Tensor]:
        return lambda: tier.step(models[tier.name], batches[tier.batch])

    def timings() -> Timings:
        return round_robin(
            {t.name: timed_step(t) for t in timed},
            settings.rounds,
            device=device,
            before=lambda name: models[name].zero_grad(set_to_none=True),
        )

    try:
        times = timings()
    except Exception:  # a step that fails only among the others' (CUDA graphs): find it, time the rest
        if device.type == "cpu":
            raise
        for tier in list(timed):
            try:
                models[tier.name].zero_grad(set_to_none=True)
                timed_step(tier)()
            except Exception as exc:
                failed[tier.name] = f"timed round-robin: {type(exc).__name__}: {exc}"[:2000]
                timed.remove(tier)
            models[tier.name].zero_grad(set_to_none=True)
        release(device)
        times = timings()
    profiles = {}
    for tier in timed:
        models[tier.name].zero_grad(set_to_none=True)
        try:
            profiles[tier.name] = profile_step(timed_step(tier), device)
        except Exception as exc:  # the profile is extra: its failure costs the tier nothing else
            profiles[tier.name] = not_profiled(f"failed: {type(exc).__name__}: {exc}"[:500])
    for model in models.values():
        model.zero_grad(set_to_none=True)
    real = workload.real_tokens
    base = times.seconds.get(BASELINE)
    result: dict[str, Any] = {}
    for tier in tiers:
        if tier.skipped is not None or tier.name in failed:
            result[tier.name] = {"skipped": tier.skipped or f"failed: {failed[tier.name]}"}
            continue
        wall = times.seconds[tier.name]
        step = median(wall)
        w = warmed[tier.name]
        result[tier.name] = {
            "tokens_per_s": real / step,
            "step_ms": step * 1e3,
            "min_step_ms": min(wall) * 1e3,
            "peak_mem_mb": megabytes(w.peak),
            "ratio_vs_padded_dense": (median(base) / step) if base else None,
            "paired_ratio_vs_padded_dense": paired_ratio_median(base, wall) if base else None,
            "execution": tier.runs,
            "compile_warmup_s": w.warmup_s,
            "warmup_steps": w.steps,
            **profiles[tier.name],
            "loss": w.loss,
            "document_exact": tier.document_exact(workload),
            "samples_ms": [round(x * 1e3, 2) for x in wall],
        }
    exact = {n: r["document_exact"] for n, r in result.items() if "loss" in r}
    ran = {n: r["loss"] for n, r in result.items() if "loss" in r}
    release(device)
    agree = agreement(ran, exact, settings.dtype)
    for name, stats in result.items():
        if "loss" in stats:
            lines.write("result", batch=workload.name, tier=name, **{k: v for k, v in stats.items() if k != "launches"})
    lines.write("loss_agreement", batch=workload.name, **agree)
    return {**workload.describe(), "tiers": result, "loss_agreement": agree}


def environment(device: torch.device) -> dict[str, Any]:
    info = {
        **machine(),
        "python": platform.python_version(),
        "device": str(device),
        "flash_attn": flash_attn_version() if device.type == "cuda" else None,
        "torch_varlen_attn": torch_varlen_kernel() is not None,
    }
    if device.type == "cuda":
        info.update(
            device_name=torch.cuda.get_device_name(device),
            cuda=torch.version.cuda,
            compute_capability=".".join(map(str, torch.cuda.get_device_capability(device))),
        )
    else:
        info["device_name"] = "cpu"
    return info


def command(
    device: str | None,
    quick: bool,
    layers: int | None,
    rounds: int | None,
    tiers: str | Sequence[str] | None = None,
    memory_gb: float | None = None,
    shape: str | None = None,
    jsonl: str | None = None,
) -> str:
    parts = [COMMAND]
    if device and device != "cuda":
        parts.append(f"--device {device}")
    if quick:
        parts.append("--quick")
    if layers:
        parts.append(f"--layers {layers}")
    if rounds:
        parts.append(f"--rounds {rounds}")
    if tiers:
        parts.append(f"--tiers {tiers if isinstance(tiers, str) else ','.join(tiers)}")
    if memory_gb is not None:
        parts.append(f"--memory-gb {memory_gb:g}")
    if shape:
        parts.append(f"--shape {shape}")
    if jsonl:
        parts.append(f"--jsonl {jsonl}")
    return " ".join(parts)


def _setup(tiers: list[Tier], settings: Settings, device: torch.device) -> dict[str, torch.nn.Module]:
    """A copy of the model per running tier, set up (attached, compiled); a tier whose setup fails is skipped."""
    base = build_model(settings)
    models = {}
    for tier in tiers:
        if tier.skipped is not None:
            continue
        model = copy.deepcopy(base)
        try:
            tier.setup(model)
        except Exception as exc:
            if device.type == "cpu":
                raise
            tier.skipped = f"setup failed: {type(exc).__name__}: {exc}"[:2000]
            continue
        models[tier.name] = model
    return models


def run(
    quick: bool = False,
    device: str | None = None,
    layers: int | None = None,
    rounds: int | None = None,
    tiers: str | Sequence[str] | None = None,
    memory_gb: float | None = None,
    budget_s: float | None = None,
    shape: str | None = None,
    jsonl: str | None = None,
) -> dict[str, Any]:
    """The benchmark; ``{"skipped": why}`` where CUDA is asked for (the default) and absent. ``quick``: the short run
    (:data:`QUICK_TIERS` on :data:`QUICK_BATCHES`, 3 rounds, no equal memory); ``tiers``: a subset
    (comma-separated); ``memory_gb``: the equal-memory budget; ``budget_s``: seconds after which the equal-memory
    search stops (default :data:`GPU_BUDGET_S` on CUDA, none on the CPU); ``shape``: a name of
    ``llama_shapes.SHAPES`` (CUDA); ``jsonl``: a file that gets each result as a JSON line as soon as it is measured."""
    dev = torch.device(device or "cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        return {"skipped": NEEDS_CUDA}
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"foundry-attn bench gpu: --device cuda[:N] or cpu, not {device!r}")
    import transformers

    clock = Clock()
    gpu = dev.type == "cuda"
    if gpu and dev.index is not None:
        torch.cuda.set_device(dev)
    settings = Settings.make(dev, quick, layers, rounds, shape)
    lines = Lines(jsonl)
    said = command(device, quick, layers, rounds, tiers, memory_gb, shape, jsonl)
    lines.write("start", command=said, settings=dataclasses.asdict(settings), machine=environment(dev))
    budget_gb = budget_of(memory_gb, dev)
    all_tiers = make_tiers(dev, ROWS * settings.width)
    select(all_tiers, tiers, quick)
    models = _setup(all_tiers, settings, dev)
    lines.write("tiers", tiers={t.name: t.describe(models) for t in all_tiers})
    clock.done("setup")
    batches: dict[str, Any] = {}
    goals: dict[str, Any] = {}
    loads = [w for w in workloads(settings.width, settings.vocab) if not quick or w.name in QUICK_BATCHES]
    for workload in loads:
        batches[workload.name] = bench_workload(workload, all_tiers, models, settings, dev, lines)
        clock.done(workload.name)
        # judged on the batches measured so far: a run stopped later keeps these verdicts (the last is the run's)
        goals = targets(batches, gpu, settings.model)
        lines.write("targets", after=workload.name, targets=goals, elapsed_s=clock.elapsed)
    limit = budget_s if budget_s is not None else (GPU_BUDGET_S if gpu else None)
    deadline = clock.started + limit if limit is not None else None
    if quick:
        memory = memory_skipped("not in --quick")
    elif deadline is not None and time.perf_counter() > deadline:
        memory = memory_skipped(f"the run's time budget ({limit:.0f} s) was spent")
    else:
        memory = equal_memory(
            all_tiers, models, loads[0], batches[loads[0].name]["tiers"], dev, budget_gb=budget_gb, deadline=deadline
        )
        lines.write("equal_memory", **memory)
    clock.done("equal_memory")
    met = [t["met"] for t in goals.values() if t["met"] is not None]
    return {
        "command": said,
        "gpu_number": gpu,
        "note": None if gpu else f"CPU plumbing run, tiny model, fp32: {REFERENCE_LABEL}; targets not judged",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": environment(dev),
        "settings": {
            **dataclasses.asdict(settings),
            "model": "LlamaForCausalLM, random init (seed 0), "
            + (f"{settings.model} shapes" if gpu else "shapes.TINY_SHAPE"),
            "shape": settings.shape,
            "step": "forward + backward, grads set to None before",
            "seed": SEED,
            "peak_mem": "cuda max_memory_allocated delta"
            if gpu
            else "peak live bytes of newly allocated tensor storages (TorchDispatchMode); none for a compiled step",
            "time_budget_s": limit,
        },
        "tiers": {t.name: t.describe(models) for t in all_tiers},
        "batches": batches,
        "equal_memory": memory,
        "targets": goals,
        "correct": all(b["loss_agreement"]["ok"] for b in batches.values()),
        "all_targets_met": all(met) if gpu and met else None,
        "phases_s": clock.phases,
        "elapsed_s": clock.elapsed,
    }
