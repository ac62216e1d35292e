"""End to end against stock LLM-Foundry: real tokens/s, peak memory, and the loss against each document alone.

    foundry-attn bench train --json                 # the README numbers: CPU, fp32, about 7-8 min on 2 quiet cores
    foundry-attn bench train --json --quick         # smoke run: a toy model, the blog mix only, about 1 min
    foundry-attn bench train --json --device cuda   # GPU: amp_bf16, flash_attention_2 where flash-attn imports

Workload. Real training runs through LLM-Foundry's own ``llmfoundry.command_utils.train`` (what
``train_from_yaml`` calls after reading the YAML) with an OmegaConf config, four variants:

- ``stock_padded``: ``hf_causal_lm`` + the stock ``finetuning`` loader: every row padded to ``max_seq_len``;
- ``stock_packing``: the same with ``packing_ratio: auto`` (LLM-Foundry's ``BinPackCollator``: its
  ``sequence_id`` never reaches the HF model, so packed documents attend to each other);
- ``ours_mask``: ``foundry_attn_causal_lm`` + ``foundry_attn_finetuning`` with ``padding: mask``;
- ``ours_pack``: the same with ``padding: pack``.

Ours run with ``attn_decision``, ``attention_inspector`` and ``upad_tracer`` at their default intervals (what the
README tells a user to enable); every variant has ``speed_monitor``. Same model for all: SmolLM2-135M's layer
shapes (hidden 576, 9 heads, 3 KV heads, head dim 64, MLP 1536, tied embeddings) cut to 4 layers, vocab 8192 (as in
``bench padding``: the stock padded step stays near 20 s), config written locally, ``pretrained: false``, seed 17,
fp32 on CPU. Stock gets its best attention: ``sdpa`` on CPU (``hf_causal_lm`` defaults to eager), FA2 on CUDA
where flash-attn imports; ours ``auto``. Same data: a prompt/response jsonl (word-level tokenizer, one token per
word; prompt a fifth of the document, masked; EOS ends the response) in a fixed order (``shuffle: false``), 6
examples per device batch, ``max_seq_len`` 2048, two mixes:

- ``blog``: documents of 220, 217, 295, 183, 130, 350 tokens, repeated: the public report's batch, fill 11.4%
  padded to 2048 (``bench.padding.LENGTHS``);
- ``long``: 2000, 1536, 1024, 700, 420, 180 tokens, repeated: fill 47.7% padded.

Per variant: ``warmup`` batches then ``timed`` batches; the same number for every variant.
Stock packing reads about ``packing_ratio`` times more examples per batch (its batch is rows, not examples);
tokens/s counts real tokens, so the batches need not hold the same documents.

Schedule, and why it is honest. Each variant runs in its own worker process (``multiprocessing`` forkserver,
LLM-Foundry preloaded): a variant that crashes or is killed for memory is reported with its error while the
others go on, and its peak memory is its own. The workers build one at a time (``train(cfg)`` with
``max_duration`` = the warm-up batches, which trains them and returns the Trainer), then the parent advances them
round-robin, one batch per variant per round, the order rotated each round, only one worker running at a time;
the other workers wait on a pipe and use no CPU. One batch is ``trainer.fit(duration="1ba")`` on a dataloader
iterator kept across calls (the worker keeps the Trainer's one train iterator, so batch k+1 follows batch k as
in one continuous ``fit``). Composer starts its batch clock after ``FIT_START``, so the time other workers spend
is never counted; load from other processes falls on every variant alike. Not all four in one process: their peak
memory would be one number, and one variant's crash or out-of-memory kill would end the others. Not one
``train_from_yaml`` run per variant after another: a busy minute on a shared machine would fall on one variant only.

Throughput: ``tokens_per_s`` is Composer's own ``SpeedMonitor`` (``throughput/tokens_per_sec``, window = the timed
batches: real tokens from the loader's ``DataSpec`` over Composer's batch wall clock, which runs from the batch's
dataloader ``next`` to the loss, and leaves out the ``BATCH_END`` callbacks and the scheduler step).
Cross-checks: ``tokens_per_s_wall`` = the same tokens over the wall time of the ``fit("1ba")`` calls (everything,
including ``fit``'s own start and end events) and ``composer_vs_wall``. ``parallelism`` = process CPU time / wall.

Memory: ``peak_rss_mb`` = the worker's ``ru_maxrss`` (whole process: weights, optimizer, the warm-up and truth
batches, LLM-Foundry and torch themselves) and ``rss_at_import_mb`` beside it; on CUDA ``peak_cuda_mb`` =
``torch.cuda.max_memory_allocated`` over the timed batches.

Loss against the truth (the leak), on every batch (warm-up and timed): the worker takes the batch's documents (rows
of the padded batch, ``sequence_id`` segments of the stock packed rows, ``doc_lens`` of ours) and runs each alone
through a stock ``LlamaForCausalLM`` (sdpa) holding the weights that batch trained with; truth = the mean token loss
over the batch's targets. Warm-up batches: computed in ``BEFORE_FORWARD``. Timed batches: the weights are copied
before the step and the batch kept by reference, and the truth is computed after the step, outside both clocks.
``loss`` and ``truth`` are the means over the batches, ``loss_diff_vs_truth`` the largest per-batch |loss - truth|.
For stock packing this is the leak, reported, not judged.

Host work (ours, per timed batch, as a fraction of the median timed step): the collator (the loader's
``collate_fn``: tokenized turns to a batch), ``prepare_documents`` (``foundry_attn.path.forward``, called by the model)
and every one of our callbacks (each ``run_event``), plus each callback's sampled first batch (warm-up) spread over
its interval (``attention_inspector``: 50): ``host_fraction`` <= 0.02 is the target.

Targets, printed with pass or fail (a failed variant fails its targets): ``ours_pack`` >= 3x ``stock_padded``
real tokens/s on CPU at the blog mix; ``ours_pack`` >= 0.95x ``stock_packing`` at each mix; ``ours_*`` loss within
1e-5 of the truth in fp32 (bf16: 2e-2); host work < 2% of a step.

The settings, the assets and each variant's config live in :mod:`foundry_attn.bench.train_config`; a worker in
:mod:`foundry_attn.bench.train_worker`; the schedule, the numbers and the targets here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from foundry_attn.bench.train_config import (
    MAX_SEQ_LEN,
    MIXES,
    ROWS,
    SEED,
    VARIANTS,
    Settings,
    stock_attention,
    variant_config,
    write_assets,
)
from foundry_attn.bench.train_worker import OUR_CALLBACKS, worker

COMMAND = "foundry-attn bench train --json"
TARGETS: dict[str, float] = {
    "pack_vs_stock_padded": 3.0,  # blog mix, CPU
    "pack_vs_stock_packing": 0.95,  # every mix
    "ours_loss_diff_vs_truth": 1e-5,  # fp32 (bf16: BF16_LOSS_TOL)
    "host_fraction": 0.02,
}
BF16_LOSS_TOL = 2e-2
PRELOAD = [
    "torch",
    "transformers",
    "composer",
    "llmfoundry",
    "llmfoundry.command_utils",
    "foundry_attn.integrations.llm_foundry",
]
SAMPLE_INTERVAL = {"attention_inspector": 50, "upad_tracer": 50, "attn_decision": 0}  # their defaults (0: once)


# ---- the parent: one mix, four workers, round-robin ---------------------------------------------------------------


class _Variant:
    """The parent's handle on one worker."""

    def __init__(self, name: str, ctx: Any, job: dict[str, Any]) -> None:
        self.name, self.job = name, job
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=worker, args=(child, job), name=f"bench-train-{name}", daemon=True)
        self.process.start()
        child.close()
        self.error: dict[str, Any] | None = None
        self.replies: dict[str, Any] = {}
        self.steps: list[dict[str, float]] = []

    @property
    def alive(self) -> bool:
        return self.error is None

    def call(self, command: str | None, timeout: float) -> Any:
        """Send ``command`` (None: only wait for the worker's first reply) and wait for the answer."""
        if not self.alive:
            return None
        try:
            if command is not None:
                self.conn.send(command)
            if not self.conn.poll(timeout):
                raise TimeoutError(f"no answer to {command or 'import'} in {timeout:.0f} s")
            status, payload = self.conn.recv()
        except (EOFError, OSError, TimeoutError, BrokenPipeError) as exc:
            self.process.join(5)
            code = self.process.exitcode
            why = f"worker exited with code {code}" if code is not None else f"{type(exc).__name__}: {exc}"
            if code is not None and code < 0:
                why += " (killed by a signal: out of memory?)"
            self.fail({"phase": command or "import", "error": why, "log_tail": self.log_tail()})
            return None
        if status != "ok":
            self.fail({**payload, "log_tail": self.log_tail()})
            return None
        return payload

    def fail(self, error: dict[str, Any]) -> None:
        self.error = error
        self.stop()

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()  # our own child, by its handle
            self.process.join(5)

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "".join(Path(self.job["log"]).read_text(errors="replace").splitlines(keepends=True)[-lines:])
        except OSError:
            return ""


def _context() -> Any:
    """Forkserver with LLM-Foundry preloaded: a worker starts in about a second instead of ~15 s of imports."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_mix(mix: str, paths: Mapping[str, Path], settings: Settings, root: Path, threads: int | None) -> dict:
    """The four variants of one mix, interleaved; their reports by name."""
    ctx = _context()
    variants: dict[str, _Variant] = {}
    for name in VARIANTS:
        job = {
            "config": variant_config(name, mix, paths, settings, root),
            "device": settings.device,
            "warmup": settings.warmup,
            "log": str(root / f"{mix}-{name}.log"),
            "threads": threads,
        }
        variants[name] = _Variant(name, ctx, job)
    for v in variants.values():
        v.replies["import"] = v.call(None, timeout=600)
    for v in variants.values():  # one at a time: the warm-up is not timed, but it is not shared either
        v.replies["build"] = v.call("build", timeout=1800)
    for r in range(settings.timed):
        names = list(VARIANTS)
        shift = r % len(names)
        for name in [*names[shift:], *names[:shift]]:
            v = variants[name]
            step = v.call("step", timeout=1800)
            if step is not None:
                v.steps.append(step)
    out = {}
    for name, v in variants.items():
        final = v.call("finish", timeout=600)
        v.stop()
        out[name] = _summarize(v, final, settings) if final is not None else {"error": v.error}
    return out


def _summarize(v: _Variant, final: dict[str, Any], settings: Settings) -> dict[str, Any]:
    batches = final["batches"]
    warm, timed = batches[: settings.warmup], batches[settings.warmup :]
    steps = final["steps"]
    tokens = sum(b["tokens"] for b in timed)
    wall = sum(s["wall_s"] for s in steps)
    composer_wct = sum(b["batch_wct_s"] for b in timed)
    speed = final["metrics"].get("throughput/tokens_per_sec")
    truths = [(b["loss"], b["truth"]) for b in batches if "truth" in b]
    step_s = statistics.median(s["wall_s"] for s in steps) if steps else float("nan")
    result: dict[str, Any] = {
        "tokens_per_s": speed,
        "tokens_per_s_composer": tokens / composer_wct if composer_wct else None,
        "tokens_per_s_wall": tokens / wall if wall else None,
        "composer_vs_wall": (tokens / composer_wct) / (tokens / wall) if wall and composer_wct else None,
        "step_s": step_s,
        "steps_ms": [round(s["wall_s"] * 1e3) for s in steps],
        "parallelism": sum(s["cpu_s"] for s in steps) / wall if wall else None,
        "steps": batches[-1]["batch"] if batches else 0,
        "warmup_batches": len(warm),
        "timed_batches": len(timed),
        "real_tokens_per_batch": statistics.mean(b["tokens"] for b in timed) if timed else None,
        "documents_per_batch": statistics.mean(b["documents"] for b in timed) if timed else None,
        "rows_per_batch": statistics.mean(b["rows"] for b in timed) if timed else None,
        "fill": sum(b["tokens"] for b in timed) / sum(b["positions"] for b in timed) if timed else None,
        "peak_rss_mb": final["peak_rss_mb"],
        "rss_at_import_mb": final["rss_at_import_mb"],
        "peak_cuda_mb": final["peak_cuda_mb"],
        "attn_implementation": final["attn_implementation"],
        "build_and_warmup_s": (v.replies.get("build") or {}).get("build_and_warmup_s"),
        "loss": statistics.mean(lo for lo, _ in truths) if truths else None,
        "truth": statistics.mean(t for _, t in truths) if truths else None,
        "loss_diff_vs_truth": max(abs(lo - t) for lo, t in truths) if truths else None,
        "loss_per_batch": [[lo, t] for lo, t in truths],
    }
    if v.name.startswith("ours") and timed and steps:
        result["host"] = _host_work(final, timed, steps, step_s, settings)
    else:
        collate = [s["collate_s"] for s in steps]
        result["collate_ms"] = statistics.median(collate) * 1e3 if collate else None
    return result


def _host_work(final: dict, timed: list[dict], steps: list[dict], step_s: float, settings: Settings) -> dict:
    """Our host work per timed batch (medians) and as a fraction of the median step."""
    per_batch: dict[str, float] = {
        "collate_ms": statistics.median(s["collate_s"] for s in steps) * 1e3,
        "prepare_documents_ms": statistics.median(s["prepare_documents_s"] for s in steps) * 1e3,
    }
    first = final["batches"][0]["callbacks_s"] if final["batches"] else {}
    for name in OUR_CALLBACKS:
        every = statistics.median(b["callbacks_s"].get(name, 0.0) for b in timed)
        interval = SAMPLE_INTERVAL[name]
        # the sampled first batch, beyond an ordinary one, spread over the interval (attn_decision: once a run)
        extra = (first.get(name, 0.0) - every) / interval if interval else 0.0
        per_batch[f"{name}_ms"] = every * 1e3
        per_batch[f"{name}_sampled_amortized_ms"] = max(extra, 0.0) * 1e3
    total_ms = sum(per_batch.values())
    return {
        **per_batch,
        "total_ms": total_ms,
        "step_ms": step_s * 1e3,
        "host_fraction": total_ms / (step_s * 1e3),
        "note": "medians over the timed batches; callbacks at their default intervals, the first (sampled) "
        "batch's extra spread over the interval",
    }


# ---- the whole benchmark -----------------------------------------------------------------------------------------


def _ratio(a: Mapping, b: Mapping, key: str = "tokens_per_s") -> float | None:
    x, y = a.get(key), b.get(key)
    return x / y if isinstance(x, int | float) and isinstance(y, int | float) and y else None


def _targets(mixes: Mapping[str, Mapping[str, Any]], settings: Settings) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    loss_tol = TARGETS["ours_loss_diff_vs_truth"] if settings.precision == "fp32" else BF16_LOSS_TOL
    for mix, v in mixes.items():
        pack = v["ours_pack"]
        if mix == "blog" and settings.device == "cpu":
            value = _ratio(pack, v["stock_padded"])
            out["blog: ours_pack vs stock_padded tokens/s"] = _met(value, TARGETS["pack_vs_stock_padded"], ">=")
        value = _ratio(pack, v["stock_packing"])
        out[f"{mix}: ours_pack vs stock_packing tokens/s"] = _met(value, TARGETS["pack_vs_stock_packing"], ">=")
        for name in ("ours_mask", "ours_pack"):
            out[f"{mix}: {name} loss vs truth"] = _met(v[name].get("loss_diff_vs_truth"), loss_tol, "<=")
            host = (v[name].get("host") or {}).get("host_fraction")
            out[f"{mix}: {name} host work / step"] = _met(host, TARGETS["host_fraction"], "<")
    return out


def _met(value: float | None, target: float, op: str) -> dict[str, Any]:
    if value is None:
        return {"target": f"{op} {target}", "value": None, "met": False}
    ok = value >= target if op == ">=" else value <= target if op == "<=" else value < target
    return {"target": f"{op} {target}", "value": value, "met": ok}


def run(quick: bool = False, device: str | None = None) -> dict[str, Any]:
    """The whole benchmark (see the module docstring); ``quick`` is a smoke run, not for the README."""
    import importlib.util

    if importlib.util.find_spec("llmfoundry") is None:  # the core alone (a bare GPU box): nothing to compare with
        return {"command": COMMAND, "skipped": "bench train runs LLM-Foundry: pip install 'foundry-attn[foundry]'"}
    import platform

    import torch

    from foundry_attn.bench import machine

    started = time.perf_counter()
    load = _loadavg()
    settings = Settings.make(quick, device)
    mixes: dict[str, Any] = {}
    mix_seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        root = Path(tmp)
        paths = write_assets(root, settings)
        for mix in settings.mixes:
            t0 = time.perf_counter()
            mixes[mix] = run_mix(mix, paths, settings, root, torch.get_num_threads())
            mix_seconds[mix] = time.perf_counter() - t0
    for v in mixes.values():
        for name in ("stock_padded", "stock_packing", "ours_mask"):
            if "error" not in v[name] and "error" not in v["ours_pack"]:
                v[name]["ours_pack_vs_this"] = _ratio(v["ours_pack"], v[name])
    targets = _targets(mixes, settings)
    loss_checks = [t["met"] for name, t in targets.items() if "loss vs truth" in name]
    return {
        "command": COMMAND + (" --quick" if quick else ""),
        "settings": {
            **dataclasses.asdict(settings),
            "quick": quick,
            "max_seq_len": MAX_SEQ_LEN,
            "examples_per_device_batch": ROWS,
            "lengths": {m: list(MIXES[m]) for m in settings.mixes},
            "padded_fill": {m: sum(MIXES[m]) / (len(MIXES[m]) * MAX_SEQ_LEN) for m in settings.mixes},
            "seed": SEED,
            "stock_attn_implementation": stock_attention(settings.device),
            "schedule": "one worker process per variant; built one at a time; then round-robin, one batch "
            "(trainer.fit(duration='1ba')) per variant per round, order rotated, one worker running at a time",
            **machine(),
            "torch_threads_in_workers": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
        },
        "mixes": mixes,
        "targets": targets,
        # exactness: ours trains each document as if alone (a failed ours variant fails it too)
        "correct": all(loss_checks),
        "all_targets_met": all(t["met"] for t in targets.values()),
        "mix_seconds": mix_seconds,
        "elapsed_s": time.perf_counter() - started,
        "load_average_1min": {"start": load, "end": _loadavg()},
    }


def summary(result: Mapping[str, Any]) -> str:
    """The table and the targets as text (what ``--json`` leaves out)."""
    if "skipped" in result:
        return str(result["skipped"])
    lines = []
    for mix, variants in result["mixes"].items():
        lines.append(f"== {mix} mix ==")
        lines.append(f"{'variant':15} {'tokens/s':>9} {'wall':>9} {'step s':>7} {'rss MB':>7} {'loss-truth':>10}")
        for name, v in variants.items():
            if "error" in v:
                lines.append(f"{name:15} FAILED: {v['error'].get('phase')}: {v['error'].get('error')}")
                continue
            diff = v.get("loss_diff_vs_truth")
            lines.append(
                f"{name:15} {v['tokens_per_s'] or 0:9.0f} {v['tokens_per_s_wall'] or 0:9.0f} {v['step_s']:7.2f} "
                f"{v['peak_rss_mb']:7.0f} {diff if diff is not None else float('nan'):10.2e}"
            )
    for name, t in result["targets"].items():
        value = t["value"]
        shown = "n/a" if value is None else f"{value:.3g}"
        lines.append(f"{'PASS' if t['met'] else 'FAIL'}  {name}: {shown} (target {t['target']})")
    return "\n".join(lines)


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None
