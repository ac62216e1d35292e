"""Side-by-side benchmarks behind ``foundry-attn bench``: scripts that print numbers, not timed tests."""

from __future__ import annotations

import platform
from typing import Any

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so a wall-clock time measures it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def machine() -> dict[str, Any]:
    """What a result was measured with: threads, torch, transformers, CPU."""
    import transformers

    return {
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": platform.processor() or platform.machine(),
    }
