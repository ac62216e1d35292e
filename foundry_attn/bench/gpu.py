"""GPU benchmark: SmolLM2-135M training steps, padded dense attention against unpad-once varlen and the rest.

    foundry-attn bench gpu --json                        # CUDA, bf16, 30 layers, 20 rounds
    PYTHONPATH=. python -m foundry_attn.cli bench gpu --json # the same from a source tree (torch + transformers only)
    foundry-attn bench gpu --json --quick                # 3 rounds: a smoke run
    foundry-attn bench gpu --json --device cpu --quick   # the plumbing on a tiny model, fp32 (not a GPU number)

Without CUDA (and without ``--device cpu``) it prints one line, ``{"skipped": ...}`` under ``--json``, and
exits 0.

Model: ``LlamaForCausalLM`` with SmolLM2-135M's exact shapes (``foundry_attn.verify.llama_shapes``: hidden 576, 9 heads,
3 KV heads, MLP 1536, 30 layers, vocab 49152, tied embeddings), random init (seed 0), config built locally,
bf16, train mode, dropout 0. A step is forward + backward (no optimizer), grads set to None before it.

Batches, 6 rows of 2048 (real token ids random, padding id 0, labels -100 on padding):

- ``a_report``: the public report's rows, one document each, real lengths 220, 217, 295, 183, 130, 350
  (1395 real tokens of 12288, fill 11.4%: 1/fill = 8.8x is the most unpadding can win).
- ``b_no_padding``: 6 documents of 2048 tokens, one per row: nothing to unpad, unpadding's worst case.
- ``c_mix``: seeded lognormal lengths (median 15% of a row, clipped to 64..2048) packed into the rows in
  order, a row padded when the next document does not fit: a realistic packed fine-tuning batch.

Tiers, each in its own copy of the model (identical weights), timed round-robin per batch
(``bench.timing.round_robin``: order rotated every round, GC off inside a step, CUDA synced around it):

1. ``padded_dense``: transformers' stock ``sdpa``, rows padded to 2048, no attention mask (dense causal flash
   through SDPA), labels -100 on padding. The baseline of every ratio.
2. ``stock_unpad_per_layer``: transformers' stock FA2 code path with a 2-D ``attention_mask``: its
   ``_upad_input`` unpads q/k/v in every layer (and syncs the host) and ``pad_input`` pads the output back.
   On flash-attn when it imports; else on torch's ``varlen_attn`` (torch >= 2.10) behind flash-attn's
   signature (:func:`flash_varlen_from_torch`; dense ``flash_attn_func`` through SDPA:
   :func:`flash_attn_func_via_sdpa`), installed where transformers looks the kernels up
   (``fa2_reference.reference_flash_attn(varlen=, dense=)``); both wrappers live in
   :mod:`foundry_attn.bench.reference_kernels`, which the tests import too.
2b. ``stock_padding_free``: the same stock FA2 code path on transformers' ``DataCollatorWithFlattening`` row (every
   document in one row, ``position_ids`` restarting, no mask): transformers finds the bounds from the positions in
   every layer. What a GPU user picks for packing today.
3. ``ours_torch_varlen``: ``attach(model, "torch_varlen")`` + ``forward.forward_documents``: the batch is
   unpadded once, every layer calls torch's varlen kernel on the flat row with ``cu_seqlens``.
3b. ``ours_torch_varlen_capacity``: the same with ``attach(..., capacity=rows x width)``: the flat row padded to a
   few fixed shapes (:mod:`foundry_attn.flat.capacity`), ``max_seqlen`` pinned, no host sync in the step.
4. ``ours_flash_attn``: the same on flash-attn (``attach(model, "flash_attention_2")``), when it imports.
5. ``flex_document_mask``: ``attach(model, "flex_attention")``: one compiled flex call per layer with a
   document ``BlockMask``.
6. ``sdpa_per_document``: ``attach(model, "sdpa")``: each document causal alone, in at most 8 SDPA calls per layer
   (documents grouped by length, :mod:`foundry_attn.attention.length_groups`; the name is the tier's since the
   first GPU numbers).

On ``c_mix`` a row holds several documents: the stock tiers (1, 2) attend across documents in a row (what
a 2-D padding mask can express) with positions counted per row; ours restart both per document. Their loss
is reported there but not checked (``document_exact``: false). Every tier has the same targets: labels -100
on padding and on each document's first token (no document predicts the next one's first token).

Reported per batch and tier: real tokens/s (real tokens / median step time), step ms, peak memory MB
(``torch.cuda.max_memory_allocated`` above the resting state, on a warm step), ``ratio_vs_padded_dense`` (tokens/s
over padded_dense's; ``paired_ratio_vs_padded_dense``: the median of per-round ratios), the loss, and the loss
agreement against ``sdpa_per_document`` (relative; bf16 2e-2, fp32 1e-4). A tier that fails is reported with
its error and skipped; the others still run.

Targets: ours (the faster of ``ours_torch_varlen`` / ``ours_flash_attn`` that agrees) >= 3x padded_dense on
``a_report`` and >= 0.97x on ``b_no_padding``; ``stock_unpad_per_layer`` is shown next to it.

``--device cpu`` runs the same code paths on a tiny model (``llama_shapes.TINY_SHAPE``, 2 layers, vocab 512, rows
of 128 with every length scaled by 128/2048, fp32) with the CPU-capable tiers: padded_dense, sdpa_per_document,
and stock_unpad_per_layer and ours_torch_varlen on the pure-PyTorch reference kernel standing in for torch's
``varlen_attn`` (:func:`reference_varlen_attn`): labelled "reference kernel (not a GPU number)". For tests, not
for numbers.

The batches and the model live in :mod:`foundry_attn.bench.gpu_workloads`; the loss agreement, the targets and the
summary in :mod:`foundry_attn.bench.gpu_report`; the tiers and the timed run here.
Core module: torch and transformers only.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import platform
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from foundry_attn.attention.fa2_reference import reference_flash_attn
from foundry_attn.attention.torch_varlen import torch_varlen_kernel
from foundry_attn.bench import machine
from foundry_attn.bench.gpu_report import BASELINE, REFERENCE, agreement, targets
from foundry_attn.bench.gpu_report import OURS as OURS
from foundry_attn.bench.gpu_report import TARGETS as TARGETS
from foundry_attn.bench.gpu_report import summary as summary
from foundry_attn.bench.gpu_workloads import CPU_WIDTH as CPU_WIDTH
from foundry_attn.bench.gpu_workloads import MIX_MIN as MIX_MIN
from foundry_attn.bench.gpu_workloads import REPORT_LENGTHS as REPORT_LENGTHS
from foundry_attn.bench.gpu_workloads import ROWS as ROWS
from foundry_attn.bench.gpu_workloads import SEED, Settings, Workload, build_model, workloads
from foundry_attn.bench.gpu_workloads import WIDTH as WIDTH
from foundry_attn.bench.gpu_workloads import mix_lengths as mix_lengths
from foundry_attn.bench.gpu_workloads import scaled as scaled
from foundry_attn.bench.reference_kernels import (
    flash_attn_func_via_sdpa,
    flash_varlen_from_torch,
    reference_varlen_attn,
)
from foundry_attn.bench.timing import PeakMemory, median, paired_ratio_median, round_robin
from foundry_attn.path.attach import attach
from foundry_attn.path.forward import forward_documents

# the ``X as X`` imports: names of the batches and the report kept importable here, where they were before

COMMAND = "foundry-attn bench gpu --json"
REFERENCE_LABEL = "reference kernel (not a GPU number)"
NEEDS_CUDA = (
    "foundry-attn bench gpu needs a CUDA GPU (torch.cuda.is_available() is False here); "
    "--device cpu runs its plumbing on a tiny model"
)


# ---- the CPU stand-in for torch's varlen kernel under our torch_varlen function ---------------------------


@contextlib.contextmanager
def reference_torch_varlen() -> Iterator[None]:
    """Our ``torch_varlen`` adapter on :func:`reference_varlen_attn` instead of torch's CUDA kernel (CPU runs)."""
    from foundry_attn.attention import varlen_functions
    from foundry_attn.patching import patch_attribute

    patches = [
        patch_attribute(varlen_functions, "torch_varlen_kernel", replace=lambda: reference_varlen_attn),
    ]
    try:
        yield
    finally:
        for patch in reversed(patches):
            patch.remove()


def flash_attn_version() -> str | None:
    from foundry_attn.selection.capability import probe_flash_attn

    return probe_flash_attn()[0]


# ---- tiers --------------------------------------------------------------------------------------------------


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

    def setup(self, model: Any) -> None:
        if self.backend is not None:
            with self.context():  # the proof runs the tier's kernel (a CPU stand-in where there is no GPU)
                state = attach(model, self.backend, capacity=self.capacity)
            if state.path != "flat":
                raise RuntimeError(f"{self.name}: the flat path is not proven for this model: {state.reason}")
        else:
            model.config._attn_implementation = self.stock_impl

    def step(self, model: torch.nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
        """Forward + backward; the detached loss."""
        with self.context():
            out = forward_documents(model, batch) if self.backend is not None else model(**batch, use_cache=False)
            out.loss.backward()
        return out.loss.detach()

    def document_exact(self, workload: Workload) -> bool:
        return not self.stock_row_layout or workload.one_document_per_row

    def describe(self) -> dict[str, Any]:
        return {
            "description": self.description,
            "kernel": self.kernel,
            "runs": self.skipped is None,
            "skipped": self.skipped,
        }


def make_tiers(device: torch.device, capacity: int = ROWS * WIDTH) -> list[Tier]:
    """Every tier, with what it runs on here or why it is skipped; ``capacity``: the padded tier's (a batch's
    positions)."""
    cuda = device.type == "cuda"
    fa_version = flash_attn_version() if cuda else None
    varlen = torch_varlen_kernel() if cuda else None
    tiers = [
        Tier(
            BASELINE,
            "stock sdpa, rows padded to the full width, no attention mask (dense causal)",
            "SDPA (flash on CUDA)",
            batch="padded",
            stock_impl="sdpa",
            stock_row_layout=True,
        )
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
            ("torch varlen_attn behind flash-attn's signature (dense: flash_attn_func via SDPA)"),
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
    flattened = dataclasses.replace(
        stock,
        name="stock_padding_free",
        description="stock flash_attention_2 code path on DataCollatorWithFlattening's row: bounds from position_ids",
        batch="flattened",
        stock_row_layout=False,
    )
    tiers.append(flattened)
    ours = Tier(
        "ours_torch_varlen",
        "attach(model, 'torch_varlen') + forward_documents: unpad once, varlen per layer",
        "torch varlen_attn",
        backend="torch_varlen",
    )
    if not cuda:
        ours.kernel, ours.context = REFERENCE_LABEL, reference_torch_varlen
    elif varlen is None:
        ours.skipped = f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn (torch >= 2.10)"
    tiers.append(ours)
    tiers.append(
        dataclasses.replace(
            ours,
            name="ours_torch_varlen_capacity",
            description=f"ours_torch_varlen, each flat row padded to a few fixed shapes up to {capacity} tokens",
            capacity=capacity,
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


# ---- the run ------------------------------------------------------------------------------------------------


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _warm(
    tier: Tier, model: torch.nn.Module, batch: Mapping[str, Any], settings: Settings, device: torch.device
) -> tuple[float, int]:
    """Warm-up steps, then one measured step: (loss, peak bytes above the resting state)."""
    for _ in range(settings.warmup):
        model.zero_grad(set_to_none=True)
        tier.step(model, batch)
    model.zero_grad(set_to_none=True)
    with PeakMemory(device) as memory:
        loss = tier.step(model, batch)
    return float(loss), memory.peak


def bench_workload(
    workload: Workload,
    tiers: list[Tier],
    models: Mapping[str, torch.nn.Module],
    settings: Settings,
    device: torch.device,
) -> dict[str, Any]:
    batches = workload.batches(device)
    losses, peaks, failed = {}, {}, {}
    running = [t for t in tiers if t.skipped is None]
    for tier in running:
        try:
            losses[tier.name], peaks[tier.name] = _warm(tier, models[tier.name], batches[tier.batch], settings, device)
        except Exception as exc:  # one failing tier (a kernel, an OOM) must not cost the others their numbers
            if device.type == "cpu":
                raise  # the plumbing run is a test: fail loudly
            failed[tier.name] = f"{type(exc).__name__}: {exc}"[:2000]
            models[tier.name].zero_grad(set_to_none=True)
            _free(device)

    def timed_step(tier: Tier) -> Callable[[], torch.Tensor]:
        return lambda: tier.step(models[tier.name], batches[tier.batch])

    times = round_robin(
        {t.name: timed_step(t) for t in running if t.name not in failed},
        settings.rounds,
        device=device,
        before=lambda name: models[name].zero_grad(set_to_none=True),
    )
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
        result[tier.name] = {
            "tokens_per_s": real / step,
            "step_ms": step * 1e3,
            "min_step_ms": min(wall) * 1e3,
            "peak_mem_mb": peaks[tier.name] / 2**20,
            "ratio_vs_padded_dense": (median(base) / step) if base else None,
            "paired_ratio_vs_padded_dense": paired_ratio_median(base, wall) if base else None,
            "loss": losses[tier.name],
            "document_exact": tier.document_exact(workload),
            "samples_ms": [round(w * 1e3, 2) for w in wall],
        }
    exact = {n: r["document_exact"] for n, r in result.items() if "loss" in r}
    ran = {n: r["loss"] for n, r in result.items() if "loss" in r}
    _free(device)
    return {**workload.describe(), "tiers": result, "loss_agreement": agreement(ran, exact, settings.dtype)}


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


def command(device: str | None, quick: bool, layers: int | None, rounds: int | None) -> str:
    parts = [COMMAND]
    if device and device != "cuda":
        parts.append(f"--device {device}")
    if quick:
        parts.append("--quick")
    if layers:
        parts.append(f"--layers {layers}")
    if rounds:
        parts.append(f"--rounds {rounds}")
    return " ".join(parts)


def run(
    quick: bool = False, device: str | None = None, layers: int | None = None, rounds: int | None = None
) -> dict[str, Any]:
    """The benchmark; ``{"skipped": why}`` where CUDA is asked for (the default) and absent."""
    dev = torch.device(device or "cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        return {"skipped": NEEDS_CUDA}
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"foundry-attn bench gpu: --device cuda[:N] or cpu, not {device!r}")
    import transformers

    started = time.perf_counter()
    gpu = dev.type == "cuda"
    if gpu and dev.index is not None:
        torch.cuda.set_device(dev)
    settings = Settings.make(dev, quick, layers, rounds)
    tiers = make_tiers(dev, ROWS * settings.width)
    base = build_model(settings)
    models = {}
    for tier in tiers:
        if tier.skipped is None:
            models[tier.name] = copy.deepcopy(base)
            tier.setup(models[tier.name])
    del base
    batches = {
        w.name: bench_workload(w, tiers, models, settings, dev) for w in workloads(settings.width, settings.vocab)
    }
    goals = targets(batches, gpu)
    met = [t["met"] for t in goals.values()]
    return {
        "command": command(device, quick, layers, rounds),
        "gpu_number": gpu,
        "note": None if gpu else f"CPU plumbing run, tiny model, fp32: {REFERENCE_LABEL}; targets not judged",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": environment(dev),
        "settings": {
            **dataclasses.asdict(settings),
            "model": "LlamaForCausalLM, random init (seed 0), "
            + ("SmolLM2-135M shapes" if gpu else "shapes.TINY_SHAPE"),
            "shape": settings.shape,
            "step": "forward + backward, grads set to None before",
            "seed": SEED,
            "peak_mem": "cuda max_memory_allocated delta"
            if gpu
            else "peak live bytes of newly allocated tensor storages (TorchDispatchMode)",
        },
        "tiers": {t.name: t.describe() for t in tiers},
        "batches": batches,
        "targets": goals,
        "correct": all(b["loss_agreement"]["ok"] for b in batches.values()),
        "all_targets_met": all(met) if gpu else None,
        "elapsed_s": time.perf_counter() - started,
    }
