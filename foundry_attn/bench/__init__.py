"""Side-by-side benchmarks behind ``foundry-attn bench WHICH``, the one entry point: numbers, not timed tests.

The protocol every benchmark module follows:

- ``run(quick: bool = False, device: str | None = None, **options) -> dict``: the whole measurement; ``quick`` is a
  smoke run, not for the docs. The result carries ``command``, and ``correct`` (the benchmark's own exactness
  checks: True, False, or None when it has none) and ``all_targets_met`` (its speed targets: None when not judged).
- ``summary(result) -> str`` where the module has its own report; else :func:`summary` below.
- ``foundry-attn bench WHICH [--json]`` prints the JSON or the summary and exits 1 when ``correct`` is False. A
  missed speed target is printed as FAIL, not an exit code: timings on a shared machine are evidence, not a test.
"""

from __future__ import annotations

import platform
from collections.abc import Mapping
from typing import Any

import torch

#: every benchmark module under this package, by its ``foundry-attn bench`` name
BENCHES = (
    "padding",
    "callbacks",
    "proof",
    "compile",
    "events",
    "gpu",
    "train",
    "trainer",
    "guard",
    "rows",
    "layouts",
    "step",
    "host",
)


def summary(result: dict[str, Any]) -> str:
    """The plain report of a benchmark without its own: its command, what it checked, and each target."""
    lines = [f"{result.get('command', 'foundry-attn bench')}"]
    correct = result.get("correct")
    lines.append(f"exactness checks: {'n/a' if correct is None else 'passed' if correct else 'FAILED'}")
    for name, target in (result.get("targets") or {}).items():
        if isinstance(target, dict):
            met = target.get("met")
            verdict = "n/a" if met is None else "PASS" if met else "FAIL"
            lines.append(f"{name}: {target.get('value')!r} (target {target.get('target')!r}): {verdict}")
        else:
            lines.append(f"{name}: {result.get(name)!r} (target {target!r})")
    met = result.get("all_targets_met")
    lines.append(f"targets: {'n/a' if met is None else 'all met' if met else 'NOT all met'}")
    return "\n".join(lines)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so a wall-clock time measures it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def on_device(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """``batch`` with its tensors on ``device`` (its lists as they are)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def machine() -> dict[str, Any]:
    """What a result was measured with: threads, torch, transformers, CPU."""
    import transformers

    return {
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": platform.processor() or platform.machine(),
    }
