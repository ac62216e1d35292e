"""Padding benchmark: what padding costs a training step, and what masking and packing win back.

    foundry-attn bench padding --json            # the README numbers: CPU, SDPA, about 80 s on 2 quiet cores
    foundry-attn bench padding --json --quick    # smoke run: a toy model, 1 timed step per mode
    foundry-attn bench padding --json --device cuda   # GPU: bf16, plus FA2 when flash-attn imports
    foundry-attn bench padding --json --threads 1     # a shared box: see ``parallelism`` below

Workload (the public report's batch): six documents of 220, 217, 295, 183, 130 and 350 tokens (1395 real
tokens) at ``max_seq_len`` 2048. Tokens are seeded random ids; every document ends with EOS and pad == EOS,
so the collator's true lengths are exactly these six. Model: ``LlamaForCausalLM`` with SmolLM2-135M's layer
shapes (hidden 576, 9 heads, 3 KV heads, head dim 64, MLP 1536, tied embeddings), 2 layers and vocab 8192 so
a run stays short; fp32 on CPU, bf16 on CUDA (FA2 needs half precision); train mode, dropout 0, seeded.

Modes (one model, the same weights; SDPA unless named):

- ``pad_max``: stock LLM-Foundry text collation: rows padded to 2048, no attention mask, labels = ids with
  padding -100, ``model(input_ids=, labels=)``.
- ``pad_longest``: rows padded to the longest (350) with a 2-D ``attention_mask`` (a tokenizer's
  ``padding='longest'``), ``model(input_ids=, attention_mask=, labels=)``: transformers builds the 4-D mask.
- ``mask``: ``PaddingCollator(mode='mask')`` on LLM-Foundry's 2048-token rows, then ``forward_documents``.
- ``pack``: ``PaddingCollator(mode='pack')`` on the same rows (one row of 1395), then ``forward_documents``.
- ``mask_shaped``, ``pack_shaped``: ``mask`` and ``pack`` with the logits re-padded to the batch's shape, as the
  registered model's forward returns them (``finish_documents(..., shaped=True)``): what restoring the shape costs.
- ``padded_full_batch`` ("a batch with no padding at all"): the same 1395 tokens in one row as one
  document, plain causal attention and no mask (stock concatenated pretraining): dense SDPA's best case.
- ``pack_fa2`` (CUDA with flash-attn only): ``pack`` under ``flash_attention_2`` (unpad once, varlen).
  Skipped on CPU, where only the pure-PyTorch reference kernel exists.

A step is forward + backward (no optimizer); grads are set to None between steps. Throughput = real tokens
(1395 in every mode) / median step time. Every mode first runs untimed warm-up steps; then the modes are timed
round-robin with the order rotated each round and Python's GC off inside a step (``bench.timing.round_robin``),
so load from other processes falls on all modes alike (``pad_max``, nine times the work, is timed in fewer
rounds, spread evenly).
Ratios are throughput ratios from the same run: ``pack_vs_X`` = pack tokens/s / X tokens/s; ``X_shaped_vs_X``
is the median over rounds of X's step time / X_shaped's (paired: both timed in the same round). Per mode the
report also gives ``min_step_ms`` and ``parallelism`` (process CPU time / wall time): on a quiet machine it is
close to the thread count; near 1 with 2 threads, other processes held the cores and the step times measure
the scheduler rather than the work (rerun when quiet, or with ``--threads 1``, whose ratios stay meaningful).

Peak memory (``peak_mem_mb``): bytes allocated above the resting state (weights, batch) at the step's peak:
activations, gradients, temporaries. CUDA: ``torch.cuda.max_memory_allocated()`` minus the allocation before
the step. CPU has no allocator statistics, and RSS is monotonic, shared by the process and blurred by
malloc's caching, so a ``TorchDispatchMode`` adds up the storage of every op output that is a new allocation
(not a view or in-place result) while it is alive and keeps the peak: the same quantity, without scratch
memory inside kernels (``bench.timing.PeakMemory``). Measured on the first warm-up step.

Correctness guard, so that a fast but wrong path cannot pass: the ``pad_max``, ``pad_longest`` and ``pack``
losses must equal ``mask``'s and the pack gradients must equal the mask gradients (fp32: 1e-4 absolute on the
loss, 1e-4 relative L2 on the gradients), and the packed batch must match the flattening collator's token for
token; otherwise no target counts as met.

Collator: ``PaddingCollator`` (pack, mask) against ``transformers.DataCollatorWithFlattening`` on the same six
examples, ``{"input_ids": [ids, ...]}`` each (the form both accept), timed round-robin per call, medians.
``collator_pack_vs_flattening`` = flattening time / pack time (>= 1: ours is at least as fast). Ours is also
timed on LLM-Foundry's rows (tensors padded to 2048), its input in training, for information.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from foundry_attn.attention.backends import FA2, SDPA
from foundry_attn.bench import machine, on_device
from foundry_attn.bench.timing import PeakMemory, median, paired_ratio_median, round_robin
from foundry_attn.flat.packing import IGNORE_INDEX, PaddingCollator
from foundry_attn.path.attach import attach
from foundry_attn.path.forward import forward_documents, repad_logits
from foundry_attn.path.state import path_of
from foundry_attn.verify.llama_shapes import BLOG_LENGTHS, SMOLLM2_135M_SHAPE

if TYPE_CHECKING:
    from transformers import PretrainedConfig

LENGTHS = BLOG_LENGTHS
MAX_SEQ_LEN = 2048
PAD_ID = EOS_ID = 0
SEED = 0
COMMAND = "foundry-attn bench padding --json"
TARGETS: dict[str, float] = {
    "pack_vs_pad_max": 4.0,
    "pack_vs_pad_longest": 1.2,
    "pack_vs_padded_full_batch": 0.95,
    "collator_pack_vs_flattening": 1.0,
}
MODES = ("pad_max", "pad_longest", "mask", "pack", "mask_shaped", "pack_shaped", "padded_full_batch")
SLOW_MODE = "pad_max"


@dataclasses.dataclass(frozen=True)
class Settings:
    """How big and how long one run is."""

    hidden_size: int = SMOLLM2_135M_SHAPE["hidden_size"]  # SmolLM2-135M's layer shapes ...
    intermediate_size: int = SMOLLM2_135M_SHAPE["intermediate_size"]
    num_attention_heads: int = SMOLLM2_135M_SHAPE["num_attention_heads"]
    num_key_value_heads: int = SMOLLM2_135M_SHAPE["num_key_value_heads"]
    head_dim: int = SMOLLM2_135M_SHAPE["hidden_size"] // SMOLLM2_135M_SHAPE["num_attention_heads"]
    layers: int = 2  # ... fewer layers (SmolLM2: 30) and a smaller vocab (SmolLM2: 49152)
    vocab: int = 8192
    warmup: int = 1
    rounds: int = 5  # timed steps per mode ...
    slow_rounds: int = 3  # ... except pad_max
    collator_reps: int = 2000
    device: str = "cpu"
    dtype: str = "float32"

    @classmethod
    def make(cls, quick: bool, device: str | None = None) -> Settings:
        dev = torch.device(device or "cpu")
        dtype = "float32" if dev.type == "cpu" else "bfloat16"
        if quick:  # a toy model: the smoke test checks the plumbing, not the numbers
            return cls(
                hidden_size=32,
                intermediate_size=64,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=16,
                layers=1,
                vocab=512,
                warmup=1,
                rounds=1,
                slow_rounds=1,
                collator_reps=50,
                device=str(dev),
                dtype=dtype,
            )
        return cls(device=str(dev), dtype=dtype)


@dataclasses.dataclass
class Mode:
    """One way to run the batch: its attention implementation, its batch, and our path or the plain HF call."""

    name: str
    impl: str
    batch: dict[str, Any]
    ours: bool
    shaped: bool = False  # ours: logits re-padded to the batch's [rows, width, vocab], as the Composer forward does

    @property
    def positions(self) -> int:
        return self.batch["input_ids"].numel()

    def step(self, model: torch.nn.Module) -> torch.Tensor:
        """Forward + backward; returns the detached loss."""
        if self.ours:  # our function for the backend, documents as call arguments; proven once per model
            state = path_of(model)
            if state is None or state.backend != self.impl:
                state = attach(model, self.impl)
            config = cast("PretrainedConfig", model.config)
            config._attn_implementation = state.flat_name if state.path == "flat" else state.rows_name
            out = forward_documents(model, self.batch)
            if self.shaped:
                repad_logits(out)
        else:
            cast("PretrainedConfig", model.config)._attn_implementation = self.impl
            out = model(**self.batch, use_cache=False)
        out.loss.backward()
        return out.loss.detach()


def documents(vocab: int, seed: int = SEED) -> list[torch.Tensor]:
    """The six documents: seeded random ids other than EOS, each ending with EOS."""
    gen = torch.Generator().manual_seed(seed)
    docs = []
    for n in LENGTHS:
        doc = torch.randint(1, vocab, (n,), generator=gen)
        doc[-1] = EOS_ID
        docs.append(doc)
    return docs


def text_rows(docs: Sequence[torch.Tensor], width: int = MAX_SEQ_LEN) -> list[torch.Tensor]:
    """LLM-Foundry's text rows: each document padded with pad (== EOS) to ``width``."""
    rows = []
    for doc in docs:
        row = torch.full((width,), PAD_ID, dtype=torch.long)
        row[: doc.numel()] = doc
        rows.append(row)
    return rows


def build_model(settings: Settings, impl: str = SDPA) -> torch.nn.Module:
    """SmolLM2-135M's layer shapes, fewer layers, smaller vocab; seeded, train mode, dropout 0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    s = settings
    config = LlamaConfig(
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads,
        head_dim=s.head_dim,
        num_hidden_layers=s.layers,
        vocab_size=s.vocab,
        max_position_embeddings=MAX_SEQ_LEN,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        use_cache=False,
        attn_implementation=impl,
    )
    torch.manual_seed(SEED)
    model = cast(torch.nn.Module, LlamaForCausalLM(config))  # to mypy, transformers' top-level classes are dummies
    return model.to(device=settings.device, dtype=getattr(torch, settings.dtype)).train()


def make_modes(docs: Sequence[torch.Tensor], device: torch.device, fa2: bool) -> list[Mode]:
    """The batches of every mode, collated once, on ``device``."""
    rows = text_rows(docs)
    lengths = torch.tensor([d.numel() for d in docs])
    ids = torch.stack(rows)
    labels = ids.masked_fill(torch.arange(MAX_SEQ_LEN)[None, :] >= lengths[:, None], IGNORE_INDEX)
    longest = int(lengths.max())
    attention_mask = (torch.arange(longest)[None, :] < lengths[:, None]).long()
    flat = torch.cat(list(docs))[None]
    pack = PaddingCollator(PAD_ID, EOS_ID, MAX_SEQ_LEN, mode="pack")(rows)
    batches = {
        "pad_max": ("plain", {"input_ids": ids, "labels": labels}),
        "pad_longest": (
            "plain",
            {
                "input_ids": ids[:, :longest].clone(),
                "attention_mask": attention_mask,
                "labels": labels[:, :longest].clone(),
            },
        ),
        "mask": ("ours", PaddingCollator(PAD_ID, EOS_ID, MAX_SEQ_LEN, mode="mask")(rows)),
        "pack": ("ours", pack),
        "padded_full_batch": ("plain", {"input_ids": flat, "labels": flat.clone()}),
    }
    modes = [Mode(name, SDPA, on_device(batch, device), kind == "ours") for name, (kind, batch) in batches.items()]
    modes += [Mode(f"{m.name}_shaped", SDPA, m.batch, True, shaped=True) for m in modes if m.name in ("mask", "pack")]
    if fa2:
        modes.append(Mode("pack_fa2", FA2, on_device(pack, device), True))
    return modes


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().float().flatten() for p in model.parameters() if p.grad is not None])


def measured_step(model: torch.nn.Module, mode: Mode, device: torch.device) -> tuple[float, torch.Tensor, int]:
    """A warm-up step that also measures peak memory: (loss, grads, peak bytes); grads left in place."""
    model.zero_grad(set_to_none=True)
    with PeakMemory(device) as memory:
        loss = mode.step(model)
    return float(loss), _grads(model), memory.peak


def _agree(losses: Mapping[str, float], grads: Mapping[str, torch.Tensor], dtype: str) -> dict[str, Any]:
    """Losses of every padded/our mode against ``mask``; pack gradients against mask gradients."""
    loss_tol, grad_tol = (1e-4, 1e-4) if dtype == "float32" else (2e-2, 5e-2)
    ref = losses["mask"]
    loss_diff = {name: abs(loss - ref) for name, loss in losses.items() if name not in ("mask", "padded_full_batch")}
    grad_diff = {
        name: float((grads[name] - grads["mask"]).norm() / grads["mask"].norm()) for name in grads if name != "mask"
    }
    ok = all(d <= loss_tol for d in loss_diff.values()) and all(d <= grad_tol for d in grad_diff.values())
    return {
        "ok": ok,
        "loss_abs_diff_vs_mask": loss_diff,
        "grad_rel_diff_vs_mask": grad_diff,
        "loss_tolerance": loss_tol,
        "grad_tolerance": grad_tol,
    }


def bench_steps(settings: Settings) -> dict[str, Any]:
    """Time every mode's training step; peak memory and the correctness guard from the warm-up."""
    device = torch.device(settings.device)
    fa2 = device.type == "cuda" and _flash_attn_importable()
    model = build_model(settings)
    modes = make_modes(documents(settings.vocab), device, fa2)
    real = sum(LENGTHS)
    losses, grads, peaks = {}, {}, {}
    for mode in modes:
        losses[mode.name], g, peaks[mode.name] = measured_step(model, mode, device)
        if mode.name in ("mask", "pack", "pack_fa2"):
            grads[mode.name] = g
        for _ in range(settings.warmup - 1):
            model.zero_grad(set_to_none=True)
            mode.step(model)
    correctness = _agree(losses, grads, settings.dtype)
    del grads
    times = round_robin(
        {m.name: functools.partial(m.step, model) for m in modes},
        settings.rounds,
        samples={SLOW_MODE: settings.slow_rounds},
        device=device,
        before=lambda _: model.zero_grad(set_to_none=True),
    )
    model.zero_grad(set_to_none=True)
    result: dict[str, dict[str, Any]] = {}
    for mode in modes:
        wall = times.seconds[mode.name]
        step = median(wall)
        result[mode.name] = {
            "tokens_per_s": real / step,
            "step_ms": step * 1e3,
            "min_step_ms": min(wall) * 1e3,  # for reading noise; throughput uses the median
            "peak_mem_mb": peaks[mode.name] / 2**20,
            "positions": mode.positions,
            "fill": real / mode.positions,
            "loss": losses[mode.name],
            "samples_ms": [round(w * 1e3, 1) for w in wall],
            "cpu_ms": median(times.cpu_seconds[mode.name]) * 1e3,  # process CPU time, all threads
        }
        # CPU seconds per wall second: near the thread count on a quiet machine; near 1 or below with 2 threads
        # means other processes held the cores and the step times measure the scheduler, not the work.
        result[mode.name]["parallelism"] = result[mode.name]["cpu_ms"] / result[mode.name]["step_ms"]
    return {"modes": result, "correctness": correctness, "fa2": fa2}


def _flash_attn_importable() -> bool:
    try:
        import flash_attn  # noqa: F401
    except Exception:  # any failure means no FA2 mode
        return False
    return True


def _same_packing(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> bool:
    return all(torch.equal(ours[k].reshape(-1), theirs[k].reshape(-1)) for k in ("input_ids", "labels", "position_ids"))


def bench_collators(settings: Settings) -> dict[str, Any]:
    """Median microseconds per call: our collator (pack, mask) vs DataCollatorWithFlattening, same examples."""
    from transformers import DataCollatorWithFlattening

    docs = documents(settings.vocab)
    features = [{"input_ids": d.tolist()} for d in docs]
    rows = text_rows(docs)
    flattening = DataCollatorWithFlattening(return_tensors="pt")
    pack = PaddingCollator(PAD_ID, EOS_ID, MAX_SEQ_LEN, mode="pack")
    mask = PaddingCollator(PAD_ID, EOS_ID, MAX_SEQ_LEN, mode="mask")
    same = _same_packing(pack(features), flattening(features))

    def call(fn: Callable[[Any], Any], examples: Any) -> Callable[[], None]:
        def collate() -> None:  # the batch is dropped inside the timed call, not kept
            fn(examples)

        return collate

    variants = {
        "flattening": call(flattening, features),
        "pack": call(pack, features),
        "mask": call(mask, features),
        "pack_rows": call(pack, rows),
        "mask_rows": call(mask, rows),
    }
    for fn in variants.values():  # warm-up
        fn()
    times = round_robin(variants, settings.collator_reps)
    us = {f"{name}_us": median(t) * 1e6 for name, t in times.seconds.items()}
    return {**us, "matches_flattening": same, "examples": "six {'input_ids': list[int]} (rows: tensors padded to 2048)"}


def run(quick: bool = False, device: str | None = None) -> dict[str, Any]:
    """The whole benchmark; ``quick`` is a smoke run (tiny model, one timed step), not for the README."""
    started, load = time.perf_counter(), _loadavg()
    settings = Settings.make(quick, device)
    steps = bench_steps(settings)
    collator = bench_collators(settings)
    modes = steps["modes"]
    pack = modes["pack"]["tokens_per_s"]
    ratios = {
        "pack_vs_pad_max": pack / modes["pad_max"]["tokens_per_s"],
        "pack_vs_pad_longest": pack / modes["pad_longest"]["tokens_per_s"],
        "pack_vs_padded_full_batch": pack / modes["padded_full_batch"]["tokens_per_s"],
        "mask_vs_pad_max": modes["mask"]["tokens_per_s"] / modes["pad_max"]["tokens_per_s"],
        "mask_vs_pad_longest": modes["mask"]["tokens_per_s"] / modes["pad_longest"]["tokens_per_s"],
        # a small difference: paired per round (the same load on both), not a ratio of medians
        "mask_shaped_vs_mask": paired_ratio_median(modes["mask"]["samples_ms"], modes["mask_shaped"]["samples_ms"]),
        "pack_shaped_vs_pack": paired_ratio_median(modes["pack"]["samples_ms"], modes["pack_shaped"]["samples_ms"]),
        "collator_pack_vs_flattening": collator["flattening_us"] / collator["pack_us"],
        "collator_mask_vs_flattening": collator["flattening_us"] / collator["mask_us"],
    }
    if "pack_fa2" in modes:
        ratios["pack_fa2_vs_pad_max"] = modes["pack_fa2"]["tokens_per_s"] / modes["pad_max"]["tokens_per_s"]
        ratios["pack_fa2_vs_pack"] = modes["pack_fa2"]["tokens_per_s"] / pack
    correct = steps["correctness"]["ok"] and collator["matches_flattening"]
    targets = {
        name: {"target": target, "value": ratios[name], "met": correct and ratios[name] >= target}
        for name, target in TARGETS.items()
    }

    return {
        "command": COMMAND + (" --quick" if quick else ""),
        "settings": {
            **dataclasses.asdict(settings),
            "quick": quick,
            "attn_implementation": SDPA,
            "fa2_mode": steps["fa2"],
            "lengths": list(LENGTHS),
            "real_tokens": sum(LENGTHS),
            "max_seq_len": MAX_SEQ_LEN,
            "pad_id": PAD_ID,
            "eos_id": EOS_ID,
            "seed": SEED,
            **machine(),
            "peak_mem": "cuda max_memory_allocated delta"
            if settings.device.startswith("cuda")
            else "peak live bytes of newly allocated tensor storages (TorchDispatchMode)",
        },
        "modes": modes,
        "ratios": ratios,
        "collator": collator,
        "correctness": {**steps["correctness"], "collator_matches_flattening": collator["matches_flattening"]},
        "targets": targets,
        "correct": correct,
        "all_targets_met": all(t["met"] for t in targets.values()),
        "elapsed_s": time.perf_counter() - started,
        "load_average_1min": {"start": load, "end": _loadavg()},  # other processes: read the numbers with it
    }


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None
