"""The plugin beside stock axolotl sample packing, on the same data and seed: each run's first step against each
document alone (the loss and every parameter's gradient), real tokens/s over the later steps, peak memory.

    python -m tests.axolotl.bench OUT_DIR [--steps 24] [--width 512] [--documents 1000] [--rounds 3] [--threads 1]

Each variant (:data:`VARIANTS`) is one process (:func:`tests.axolotl.runs.run`: axolotl's own pipeline, CPU, fp32),
so each peak RSS is its own, on one torch thread by default, so its CPU time is its steps' own even on a busy machine;
the Markdown table is what README.md and docs/axolotl.md show.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

#: stock and ours, per attention (the sdpa_varlen patch and ``auto`` are in ``make test-axolotl``'s runs)
VARIANTS = ("stock-sdpa", "ours-sdpa", "stock-eager", "ours-eager")


def one(out: Path, name: str, steps: int, width: int, documents: int) -> None:
    """One variant in this process; its result to ``out/<name>.json`` (the data: ``out/../assets``, every round's).

    Args:
        out: the round's folder.
        name: a key of :data:`tests.axolotl.runs.VARIANTS`.
        steps: optimizer steps.
        width: ``sequence_len``.
        documents: documents in the jsonl.
    """
    from tests.axolotl.runs import run, write_assets

    assets = write_assets(out.parent / "assets", documents=documents)
    out.mkdir(parents=True, exist_ok=True)
    result = run(name, assets, out, steps=steps, width=width)
    if result["plugin"] and result["summary"] is None:  # axolotl skips a plugin that fails to import, with a log line
        raise SystemExit(f"{name}: foundry_attn's plugin did not load (see axolotl's error above)")
    (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))


def _spread(values: list[float]) -> str:
    low, high = min(values), max(values)
    return f"{low:.0f}" if len(values) == 1 else f"{statistics.median(values):.0f} ({low:.0f}-{high:.0f})"


def table(rounds: list[list[dict[str, Any]]]) -> str:
    """The Markdown table of the runs: each variant's distances (the same every round: same data, same seed), its
    real tokens per CPU-second and peak RSS as the median (and range) over the rounds, and its best wall-clock real
    tokens/s (a shared machine slows some rounds many times over; CPU time is what the step itself costs).

    Args:
        rounds: per round, one result per variant, in :data:`VARIANTS`' order.

    Returns:
        The table.
    """
    lines = [
        "| run | attention | loss vs each document alone | worst gradient vs alone (relative) | real tokens per "
        "CPU-second | real tokens/s (wall, best round) | peak RSS in training (MiB) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for runs in zip(*rounds, strict=True):
        r = runs[0]
        who = "**foundry_attn plugin**" if r["plugin"] else "stock axolotl sample packing"
        cpu = _spread([x["real_tokens_per_cpu_s"] for x in runs])
        wall = max(x["real_tokens_per_s"] for x in runs)
        memory = _spread([x["train_rss_mib"] for x in runs])
        lines.append(
            f"| {who} | {r['ran']} | {r['loss_diff']:.1e} | {r['grad_rel']:.1e} | {cpu} | {wall:.0f} | {memory} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """``python -m tests.axolotl.bench OUT_DIR [--steps N] [--width W] [--documents D] [--rounds R] [--threads T]``.

    Args:
        argv: the arguments.
    """
    parser = argparse.ArgumentParser(prog="python -m tests.axolotl.bench")
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--documents", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU time is the step's own)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    if args.one:
        one(args.out, args.one, args.steps, args.width, args.documents)
        return
    rounds = []
    for k in range(args.rounds):
        results = []
        for name in VARIANTS:  # stock and ours alternate, round after round
            command = [sys.executable, "-m", "tests.axolotl.bench", str(args.out / f"round{k}"), "--one", name]
            command += ["--steps", str(args.steps), "--width", str(args.width), "--documents", str(args.documents)]
            command += ["--threads", str(args.threads)]
            threads = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
            subprocess.run(command, check=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **threads})
            results.append(json.loads((args.out / f"round{k}" / f"{name}.json").read_text()))
        rounds.append(results)
    r = rounds[0][0]
    setup = (
        f"axolotl {version('axolotl')}, torch {torch.__version__}, transformers {version('transformers')}, "
        f"{platform.processor() or platform.machine()}, {args.threads} torch thread(s); tiny Llama, fp32, "
        f"sample_packing, 2 rows of {args.width}, {r['steps']} steps ({r['real_tokens']} real tokens of "
        f"{r['positions']} timed after the first)"
    )
    text = f"{setup}; median (range) of {args.rounds} rounds\n\n{table(rounds)}\n"
    (args.out / "bench.json").write_text(json.dumps(rounds, indent=1, default=str))
    (args.out / "bench.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
