"""How fast ``foundry-attn events --fell-back`` answers over a sweep: 100 runs x 10 ranks x 1,000 events.

    foundry-attn bench events --json                   # writes the tree to a temp folder (~1.4 GB), ~1-2 min
    python -c "from foundry_attn.bench import events; events.run(directory='/data/sweep', keep=True)"   # reuse a tree

The generator writes what real runs write: per rank one ``attn_impl`` event first (a fifth of the ranks on a
"Tesla T4" that fell back to sdpa, the rest on an "NVIDIA H100 80GB HBM3"), then ``attn_inspect`` and
``upad_trace`` events of realistic size (per-module records; ~1.4 KB a line). Then, with the files in the page
cache (one untimed read first), three ways to answer ``--fell-back`` are timed, best of 3:

- ``parse_every_line``: ``json.loads`` on every line, keep ``attn_impl`` (the plain way); also with orjson
  (``orjson_every_line``) when it is installed;
- ``filter_lines``: iterate lines, parse only those that contain ``"kind": "attn_impl"``;
- ``ours``: what the CLI runs: :func:`foundry_attn.observe.events.iter_events` with ``kind`` (parse only the lines that
  contain ``"attn_impl"``, still count broken ones), then the last decision per rank and the fell-back rows.

Target: ``ours`` <= 5 s on the 2-core CI machine. Core module: standard library only.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from foundry_attn.observe import fleet
from foundry_attn.observe.events import Skipped, event_files, iter_events

COMMAND = "foundry-attn bench events --json"
TARGET_S = 5.0
H100 = {"device_name": "NVIDIA H100 80GB HBM3", "capability": "sm90"}
T4 = {"device_name": "Tesla T4", "capability": "sm75"}
VERSIONS = {"torch": "2.7.0", "transformers": "4.51.3", "flash_attn": "2.7.4", "transformer_engine": None}


def _module(i: int) -> dict[str, Any]:
    return {
        "module": f"model.layers.{i}.self_attn",
        "level": "attention",
        "class": "LlamaAttention",
        "mask": "none",
        "mask_dtype": None,
        "mask_shape": None,
        "has_zeros": None,
        "real_tokens": 1395,
        "fill_ratio": 0.681,
        "positions": "restart",
    }


def generate(root: Path, runs: int = 100, ranks: int = 10, per_rank: int = 1000, seed: int = 0) -> int:
    """Write the sweep; returns the bytes written."""
    rng = random.Random(seed)
    written = 0
    for r in range(runs):
        folder = root / f"run-{r:03d}" / "attn_events"
        folder.mkdir(parents=True, exist_ok=True)
        launch = f"{rng.getrandbits(48):012x}"
        for rank in range(ranks):
            slow = rng.random() < 0.2
            stamp = {
                "rank": rank,
                "run": f"run-{r:03d}",
                "launch": launch,
                "host": f"node{rank // 8}",
                **(T4 if slow else H100),
                "versions": VERSIONS,
            }
            t = 1_795_000_000.0 + r * 3600
            lines = [
                json.dumps(
                    {
                        "kind": "attn_impl",
                        **stamp,
                        "time": t,
                        "requested": "flash_attention_2",
                        "chosen": "sdpa" if slow else "flash_attention_2",
                        "fell_back": slow,
                        "reason": "flash_attention_2 failed check 'compute capability': sm75 < sm80"
                        if slow
                        else "requested",
                        "strict": False,
                    }
                )
            ]
            for step in range(per_rank - 1):
                if step % 2:
                    body = {
                        "kind": "upad_trace",
                        "step": step,
                        "attn_implementation": "flash_attention_2",
                        "kernel": "flash-attn",
                        "counts": {"upad": 0, "posids": 0, "varlen": 30, "dense": 0, "pad": 0},
                        "cu_seqlens": [0, 220, 437, 732, 915, 1045, 1395],
                        "max_seqlen": 350,
                    }
                else:
                    body = {
                        "kind": "attn_inspect",
                        "step": step,
                        "metrics": {"attn/fill": 0.681},
                        "batch": {
                            "shape": [6, 2048],
                            "real_tokens": 1395 + step % 7,
                            "fill_ratio": (1395 + step % 7) / 2048,
                        },
                        "modules": [_module(i) for i in range(8)],
                    }
                lines.append(json.dumps({**body, **stamp, "time": t + step}))
            data = ("\n".join(lines) + "\n").encode()
            (folder / f"events-rank{rank}.jsonl").write_bytes(data)
            written += len(data)
    return written


def _scan(paths: list[Path], loads: Any, needle: bytes | None = None) -> int:
    """``attn_impl`` events in ``paths``, parsing every line with ``loads`` (or only lines with ``needle``)."""
    found = 0
    for path in paths:
        with open(path, "rb") as f:
            for line in f:
                if needle is None or needle in line:
                    found += loads(line).get("kind") == "attn_impl"
    return found


def _ours(root: Path) -> int:
    skipped = Skipped()
    rows = fleet.fell_back(fleet.decisions(fleet.events(fleet.files(root), "attn_impl", skipped=skipped)))
    return len(rows)


def _best(fn: Any, *args: Any, repeats: int = 3) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn(*args)
        best = min(best, time.perf_counter() - start)
    return best, result


def run(
    quick: bool = False,
    device: str | None = None,
    directory: str | None = None,
    keep: bool = False,
    ranks: int = 10,
    per_rank: int = 1000,
) -> dict[str, Any]:
    """Read a generated tree of ``runs`` x ``ranks`` event files (``quick``: 4 runs, else 100); ``directory``
    reuses (or keeps, with ``keep``) a tree."""
    runs = 4 if quick else 100
    root = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="foundry-attn-events-"))
    try:
        started = time.perf_counter()
        paths = event_files(root) if root.exists() else []
        if len(paths) != runs * ranks:
            generate(root, runs, ranks, per_rank)
            paths = event_files(root)
        generated_s = time.perf_counter() - started
        size = sum(p.stat().st_size for p in paths)
        sum(1 for _ in iter_events(paths[:1]))  # touch the code paths once
        for p in paths:  # into the page cache: the timings measure the reading, not the disk
            p.read_bytes()
        times = {}
        times["ours"], fell = _best(_ours, root)
        times["filter_lines"], decisions_a = _best(_scan, paths, json.loads, b'"kind": "attn_impl"')
        times["parse_every_line"], decisions_b = _best(_scan, paths, json.loads, repeats=1)
        try:  # a well-kept fast parser, when installed (not a dependency): does parsing everything become cheap?
            import orjson

            times["orjson_every_line"], _ = _best(_scan, paths, orjson.loads, repeats=1)
        except ImportError:
            pass
        return {
            "command": COMMAND,
            "runs": runs,
            "ranks": ranks,
            "events_per_rank": per_rank,
            "events": runs * ranks * per_rank,
            "bytes": size,
            "generate_s": generated_s,
            "fell_back_ranks": fell,
            "attn_impl_events": decisions_a,
            "agree": decisions_a == decisions_b,
            "seconds": times,
            "ours_vs_parse_every_line": times["parse_every_line"] / times["ours"],
            "target_s": TARGET_S,
            "met": times["ours"] <= TARGET_S,
            "correct": decisions_a == decisions_b,
            "all_targets_met": times["ours"] <= TARGET_S,
        }
    finally:
        if not keep and not directory:
            shutil.rmtree(root, ignore_errors=True)
