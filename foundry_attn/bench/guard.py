"""What the guarded flash-attn import costs at interpreter start: ``python -c pass`` with the guard on and off.

    foundry-attn bench guard --json          # 60 starts each, interleaved; about 10 s

``foundry_attn_guard.pth`` runs at every start of this environment's interpreter (pip included), so its cost is
paid everywhere: it must stay small. Both variants start the same interpreter with the same environment except
``FOUNDRY_ATTN_GUARD`` (``0``: the ``.pth`` returns before importing anything), alternating so that load on the
machine falls on both alike; the medians and minima are reported, and the target is a median cost under 5 ms.
Core module: standard library only.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from typing import Any

from foundry_attn.guard import SWITCH

COMMAND = "foundry-attn bench guard --json"
TARGET_MS = 5.0


def _start(env: dict[str, str]) -> float:
    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
    return (time.perf_counter() - began) * 1e3


def run(quick: bool = False, device: str | None = None, **_: Any) -> dict[str, Any]:
    """Interleaved interpreter starts with the guard on and off; ``device`` is ignored (no kernels here)."""
    rounds = 10 if quick else 60
    on = {k: v for k, v in os.environ.items() if k != SWITCH}
    off = {**on, SWITCH: "0"}
    times: dict[str, list[float]] = {"on": [], "off": []}
    for _round in range(rounds):
        times["on"].append(_start(on))
        times["off"].append(_start(off))
    median = {k: statistics.median(v) for k, v in times.items()}
    cost = median["on"] - median["off"]
    return {
        "command": COMMAND,
        "rounds": rounds,
        "python": sys.version.split()[0],
        "median_ms": median,
        "min_ms": {k: min(v) for k, v in times.items()},
        "cost_median_ms": cost,
        "cost_min_ms": min(times["on"]) - min(times["off"]),
        "correct": None,
        "targets": {"cost_median_ms": {"value": round(cost, 2), "target": f"< {TARGET_MS}", "met": cost < TARGET_MS}},
        "all_targets_met": cost < TARGET_MS,
    }
