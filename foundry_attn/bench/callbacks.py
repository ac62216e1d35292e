"""Callback overhead: a training step with ``attention_inspector`` + ``upad_tracer`` against one with neither.

    foundry-attn bench callbacks --json            # about 30-60 s on 2 CPU cores
    foundry-attn bench callbacks --json --quick    # smoke run: fewer rounds, not for the README

Workload: the tiny demo model (``tiny-llama``: hidden 64, 2 layers, 4 heads, 2 KV heads; the demo tokenizer),
``foundry_attn_causal_lm`` on CPU in fp32 with one torch thread, one batch of 8 seeded random documents
(10-60 tokens, EOS-terminated) packed into rows of at most 128 tokens as ``yamls/tiny_cpu.yaml`` does, trained on
again every step (the same work in every variant), SGD. Two implementations:

- ``sdpa``: what ``auto`` picks on CPU (the demo). The inspector works; the tracer has nothing to trace.
- ``flash_attention_2`` on the pure-PyTorch reference kernel: both callbacks fully active.

Variants per implementation: ``none`` (no callback), ``interval_1`` (both callbacks, ``log_interval: 1``),
``interval_100`` (``log_interval: 100``), and ``noop`` (two empty Composer callbacks: what Composer's event
dispatch alone costs any two callbacks, about 0.1 ms a step here, for reference): four Composer Trainers with
identical weights, advanced round-robin one step at a time (``trainer.fit(duration="1ba")``, no dataloader
spinning) with the order rotated every round and Python's GC off inside a step (the long-lived heap frozen;
``bench.timing.round_robin``), so load from other processes falls on all variants alike. A step's time runs from
``BATCH_START`` (first callback) to ``BATCH_END`` (last callback): forward, backward, optimizer and the
callbacks' own work (hooks, host reads, metrics, JSONL events); ``fit()`` setup is not a step. A few warm-up
steps per trainer (the always-sampled first batch among them) are not timed; 150 rounds let the interval-100
variant sample once (batch 100) inside the timed steps.
``overhead_interval_N`` = median step time with / median without - 1, per implementation; the headline is the
worse of the two (``*_paired``: the median of per-round ratios, a cross-check). Targets:
``overhead_interval_1 <= 0.10``, ``overhead_interval_100 <= 0.01``. The callbacks' console output (the table,
per-step lines) goes to /dev/null during the run so that the JSON stays clean.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from foundry_attn.bench.timing import median, paired_ratio_median, round_robin

COMMAND = "foundry-attn bench callbacks --json"
TARGETS = {"overhead_interval_1": 0.10, "overhead_interval_100": 0.01}
VARIANTS = ("none", "noop", "interval_1", "interval_100")
ROWS, MAX_SEQ_LEN, SEED = 8, 128, 0


def _step_timer() -> tuple[Any, Any, list[float]]:
    """Two callbacks: the first starts the clock at BATCH_START, the last stops it at BATCH_END."""
    from composer.core import Callback

    times: list[float] = []

    class Start(Callback):
        def batch_start(self, state: Any, logger: Any) -> None:
            self.t0 = time.perf_counter()

    start = Start()

    class Stop(Callback):
        def batch_end(self, state: Any, logger: Any) -> None:
            times.append(time.perf_counter() - start.t0)

    return start, Stop(), times


def _assets(root: Path) -> tuple[Any, Path]:
    from foundry_attn.integrations.llm_foundry.assets import build_tokenizer
    from foundry_attn.verify.llama_shapes import TINY_SHAPE, llama_config

    tok = build_tokenizer(root / "tokenizer")
    llama_config(len(tok), **TINY_SHAPE).save_pretrained(root / "tiny-llama")
    return tok, root / "tiny-llama"


def _docs(tokenizer: Any, n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(SEED)
    lengths = torch.randint(10, 61, (n,), generator=gen).tolist()
    return [[*torch.randint(2, len(tokenizer), (k,), generator=gen).tolist(), tokenizer.eos_token_id] for k in lengths]


def _trainers(impl: str, root: Path, tokenizer: Any, config: Path, docs: list[list[int]]) -> dict[str, Any]:
    from composer import Trainer
    from composer.core import Callback
    from torch.utils.data import DataLoader

    from foundry_attn.flat.packing import PaddingCollator
    from foundry_attn.integrations.composer.attention_inspector import AttentionInspector
    from foundry_attn.integrations.composer.upad_tracer import UpadTracer
    from foundry_attn.integrations.llm_foundry.model import FoundryAttnCausalLM

    collate = PaddingCollator(tokenizer.pad_token_id, tokenizer.eos_token_id, MAX_SEQ_LEN, mode="pack")
    out: dict[str, Any] = {}
    weights = None
    for variant in VARIANTS:
        torch.manual_seed(SEED)
        model = FoundryAttnCausalLM(
            tokenizer=tokenizer,
            pretrained_model_name_or_path=str(config),
            pretrained=False,
            attn_implementation=impl,
            events_dir=str(root / "model-events"),
            fa2_reference_kernel=impl == "flash_attention_2",
        )
        if model.attn_implementation != impl:
            raise RuntimeError(f"bench callbacks: wanted {impl}, the model chose {model.attn_implementation}")
        if weights is None:
            weights = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(weights)
        start, stop, times = _step_timer()
        callbacks: list[Any] = [start]
        if variant == "noop":
            callbacks += [Callback(), Callback()]  # what any two Composer callbacks cost: event dispatch
        elif variant != "none":
            interval = int(variant.split("_")[1])
            events = str(root / f"events-{impl}-{variant}")
            callbacks += [
                AttentionInspector(log_interval=interval, events_dir=events),
                UpadTracer(log_interval=interval, events_dir=events),
            ]
        callbacks.append(stop)
        # a list is a map-style dataset (__getitem__, __len__); DataLoader's annotation asks for a Dataset
        loader: DataLoader[list[int]] = DataLoader(
            docs,  # type: ignore[arg-type]
            batch_size=ROWS,
            shuffle=False,
            collate_fn=lambda ex: collate([torch.tensor(e) for e in ex]),
        )
        trainer = Trainer(
            model=model,
            train_dataloader=loader,
            callbacks=callbacks,
            loggers=[],
            device="cpu",
            precision="fp32",
            progress_bar=False,
            log_to_console=False,
            seed=SEED,
            optimizers=torch.optim.SGD(model.parameters(), lr=1e-3),
            run_name=f"bench-callbacks-{impl}-{variant}",
            save_folder=None,
            spin_dataloaders=False,
        )  # each fit() starts the one-batch loader afresh
        out[variant] = (trainer, times)
    return out


def _stats(times: list[float]) -> dict[str, float]:
    return {
        "median_ms": 1e3 * median(times),
        "mean_ms": 1e3 * statistics.fmean(times),
        "min_ms": 1e3 * min(times),
        "n": len(times),
    }


def _bench_impl(
    impl: str, root: Path, tokenizer: Any, config: Path, docs: list[list[int]], rounds: int, warmup: int
) -> dict[str, Any]:
    trainers = _trainers(impl, root, tokenizer, config, docs)
    for variant in VARIANTS:  # warm-up (the always-sampled first batch included), not timed
        trainers[variant][0].fit(duration=f"{warmup}ba")
        trainers[variant][1].clear()

    def step(variant: str) -> Any:
        trainer, times = trainers[variant]

        def fit() -> float:  # one step; its time runs from BATCH_START to BATCH_END (the timer callbacks)
            trainer.fit(duration="1ba")
            return times[-1]

        return fit

    timings = round_robin({v: step(v) for v in VARIANTS}, rounds, self_timed=True)
    stats = {v: _stats(timings.seconds[v]) for v in VARIANTS}
    result: dict[str, Any] = {"step_time": stats}
    for variant in VARIANTS[1:]:
        key = "overhead_" + variant
        result[key] = stats[variant]["median_ms"] / stats["none"]["median_ms"] - 1
        result[key + "_paired"] = paired_ratio_median(timings.seconds[variant], timings.seconds["none"]) - 1
    for trainer, _ in trainers.values():
        trainer.close()
    return result


def run(quick: bool = False, device: str | None = None) -> dict[str, Any]:
    """Measure and return the JSON-able report (see the module docstring); CPU only."""
    if device not in (None, "cpu"):
        raise ValueError(f"bench callbacks runs on the CPU (the demo's workload); got --device {device}")
    rounds, warmup = (20, 3) if quick else (150, 5)
    impls = ("sdpa", "flash_attention_2")
    logging.getLogger("foundry_attn").setLevel(logging.ERROR)
    logging.getLogger("composer").setLevel(logging.ERROR)
    results: dict[str, Any] = {}
    started = time.perf_counter()
    load_at_start = list(os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        root = Path(tmp)
        tokenizer, config = _assets(root)
        docs = _docs(tokenizer, ROWS)  # one batch, every step: the same work in every variant and round
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for impl in impls:
                results[impl] = _bench_impl(impl, root, tokenizer, config, docs, rounds, warmup)
        finally:
            torch.set_num_threads(threads)
    headline = {key: max(results[i][key] for i in impls) for key in TARGETS}
    labels = {
        "sdpa": "sdpa (tracer idle: nothing to trace)",
        "flash_attention_2": "flash_attention_2 on the fa2-reference kernel (pure PyTorch, not flash-attn)",
    }
    return {
        "command": COMMAND + (" --quick" if quick else ""),
        **headline,
        "targets": dict(TARGETS),
        "met": {key: headline[key] <= TARGETS[key] for key in TARGETS},
        "correct": None,  # timings only
        "all_targets_met": all(headline[key] <= TARGETS[key] for key in TARGETS),
        "implementations": {impl: {"label": labels[impl], **results[impl]} for impl in impls},
        "settings": {
            "model": "tiny-llama (hidden 64, 2 layers, 4 heads, 2 KV heads), fp32, CPU, SGD",
            "batch": f"{ROWS} documents of 10-60 tokens packed into rows of <= {MAX_SEQ_LEN} (padding: pack), "
            "the same batch every step",
            "variants": {
                "none": "no callback",
                "noop": "two empty Composer callbacks (the dispatch floor)",
                "interval_1": "both callbacks, log_interval 1",
                "interval_100": "both callbacks, log_interval 100",
            },
            "rounds": rounds,
            "warmup_steps": warmup,
            "timed_steps_per_variant": rounds,
            "schedule": "round-robin, one step per variant per round (trainer.fit(duration='1ba')), order rotated "
            "each round, GC off inside a step; medians of per-step times",
            "torch_threads": 1,
            "quick": quick,
        },
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpu_count": os.cpu_count(),
            "load_average_at_end": list(os.getloadavg()),
            "note": "CPU timings on a possibly shared machine: compare ratios from one run, not across runs",
        },
        "wall_s": round(time.perf_counter() - started, 1),
        "load_average_at_start": load_at_start,
    }
