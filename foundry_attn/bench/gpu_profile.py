"""One profiled step of a ``foundry-attn bench gpu`` tier: how busy it keeps the GPU, and how many launches it makes.

:func:`profile_step` runs one extra step (after the timed ones) under ``torch.profiler`` with CUDA activity, and
:func:`kernel_stats` reads the raw events:

- ``gpu_busy_ms``: the time the GPU runs anything of the step (kernels, memcpy, memset; the union of their
  intervals, so overlapping streams are not counted twice); ``gpu_busy_share``: that over the profiled step's wall
  time (synced before and after; the profiler's own cost lands on the host side, so the share is a lower bound).
- ``launches_per_step``: the host's launch calls, counted by name (:data:`LAUNCHES`: ``cudaLaunchKernel``,
  ``cudaLaunchKernelExC``, ``cuLaunchKernel``, ``cuLaunchKernelEx``, ``cudaGraphLaunch``; a ``_vNNNN`` suffix
  dropped); a replayed CUDA graph is one launch. ``gpu_kernels``: the kernels the GPU ran (graph kernels included).
- ``host_ops``: where the host's time goes, the :data:`HOST_OPS` events with the most self CPU time (aten ops, the
  autograd engine's nodes, CUDA runtime calls; ``name``, ``calls``, ``self_ms``), and ``host_ops_ms``, the self CPU
  time of every event: the profiled step's wall time less that is Python and the gaps between ops.

CUDA only: elsewhere every field is None and ``profile`` says why. Core module: torch only.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from foundry_attn.bench import sync

LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
#: GPU-side activities that are waits, not work
WAITS = ("Context Sync", "Stream Sync", "Event Sync", "Stream Wait")
NOT_CUDA = "CUDA only: kernel time and launches come from the CUDA profiler (CUPTI)"
FIELDS = (
    "gpu_busy_share", "gpu_busy_ms", "profiled_step_ms", "launches_per_step", "launches", "gpu_kernels", "host_ops",
    "host_ops_ms",
)  # fmt: skip
#: how many of the host's events, by self CPU time, ``host_ops`` lists
HOST_OPS = 15

#: one profiled event: (name, on the GPU, start ns, end ns)
Event = tuple[str, bool, int, int]


def launch_name(name: str) -> str | None:
    """The launch call ``name`` counts as (:data:`LAUNCHES`), or None."""
    base = re.sub(r"_v\d+$", "", name)
    return base if base in LAUNCHES else None


def busy_ns(intervals: Iterable[tuple[int, int]]) -> int:
    """The length of the union of ``[start, end)`` intervals."""
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def kernel_stats(events: Iterable[Event], wall_s: float) -> dict[str, Any]:
    """GPU busy time and share, launches by name, and kernels, from one step's events and its wall seconds."""
    launches: dict[str, int] = {}
    work: list[tuple[int, int]] = []
    kernels = 0
    for name, on_gpu, start, end in events:
        if on_gpu:
            if name.startswith(WAITS):
                continue
            work.append((start, end))
            kernels += not name.startswith(("Memcpy", "Memset"))
        elif (launch := launch_name(name)) is not None:
            launches[launch] = launches.get(launch, 0) + 1
    busy = busy_ns(work) / 1e9
    return {
        "gpu_busy_share": busy / wall_s if wall_s > 0 else None,
        "gpu_busy_ms": busy * 1e3,
        "profiled_step_ms": wall_s * 1e3,
        "launches_per_step": sum(launches.values()),
        "launches": launches,
        "gpu_kernels": kernels,
    }


def not_profiled(why: str) -> dict[str, Any]:
    return {**dict.fromkeys(FIELDS), "profile": why}


def profile_step(step: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """:func:`kernel_stats` of one ``step()`` under the profiler (CUDA); elsewhere None with the reason."""
    if device.type != "cuda":
        return not_profiled(NOT_CUDA)
    return profiled(step, device, cuda=True)


def profiled(step: Callable[[], Any], device: torch.device, cuda: bool) -> dict[str, Any]:
    """:func:`kernel_stats` of one ``step()`` under ``torch.profiler`` (host activity, and the GPU's if ``cuda``)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        wall = time.perf_counter() - start
    raw = prof.profiler.kineto_results.events() if prof.profiler is not None else []
    on_gpu = torch.autograd.DeviceType.CUDA
    events = ((e.name(), e.device_type() == on_gpu, e.start_ns(), e.end_ns()) for e in raw)
    host = [(e.key, e.count, e.self_cpu_time_total / 1e3) for e in prof.key_averages()]
    return {
        **kernel_stats(events, wall),
        **host_stats(host),
        "profile": "torch.profiler, one step after the timed ones",
    }


def host_stats(ops: Iterable[tuple[str, int, float]]) -> dict[str, Any]:
    """``host_ops`` and ``host_ops_ms`` from the host's events as ``(name, calls, self CPU ms)``."""
    rows = sorted(ops, key=lambda op: op[2], reverse=True)
    return {
        "host_ops": [{"name": n, "calls": c, "self_ms": round(ms, 3)} for n, c, ms in rows[:HOST_OPS]],
        "host_ops_ms": sum(ms for _, _, ms in rows),
    }
