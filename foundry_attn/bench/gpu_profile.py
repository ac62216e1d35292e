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
  time of every event, summed over the host's threads (a CUDA backward runs on the autograd engine's own): what the
  ops cost the host, the rest of its time being Python and the gaps between ops.

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
    raw = list(prof.profiler.kineto_results.events()) if prof.profiler is not None else []
    on_gpu, on_cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = ((e.name(), e.device_type() == on_gpu, e.start_ns(), e.end_ns()) for e in raw)
    host = [(e.name(), e.start_thread_id(), e.start_ns(), e.end_ns()) for e in raw if e.device_type() == on_cpu]
    return {
        **kernel_stats(events, wall),
        **host_stats(host),
        "profile": "torch.profiler, one step after the timed ones",
    }


def host_stats(events: Iterable[tuple[str, int, int, int]]) -> dict[str, Any]:
    """``host_ops`` and ``host_ops_ms`` from the host's events ``(name, thread, start ns, end ns)``: an event's self
    time is its own less that of the events nested in it on its thread, and an event nested in one of its own name is
    that call: ``key_averages``' self times, without the second or two of Python it takes on a step's events."""
    self_ns: dict[str, int] = {}
    calls: dict[str, int] = {}
    enclosing: dict[int, list[list[Any]]] = {}  # per thread: the events still open, [name, end, self ns]
    for name, thread, start, end in sorted(events, key=lambda e: (e[1], e[2], -e[3])):
        stack = enclosing.setdefault(thread, [])
        while stack and stack[-1][1] <= start:
            done = stack.pop()
            self_ns[done[0]] = self_ns.get(done[0], 0) + done[2]
        if stack and stack[-1][0] == name:  # nested in one of its own name (aten::sum's overload): the same call
            continue
        if stack:
            stack[-1][2] -= end - start
        stack.append([name, end, end - start])
        calls[name] = calls.get(name, 0) + 1
    for stack in enclosing.values():
        for name, _, own in stack:
            self_ns[name] = self_ns.get(name, 0) + own
    busiest = sorted(self_ns, key=self_ns.__getitem__, reverse=True)[:HOST_OPS]
    return {
        "host_ops": [{"name": n, "calls": calls[n], "self_ms": round(self_ns[n] / 1e6, 3)} for n in busiest],
        "host_ops_ms": sum(self_ns.values()) / 1e6,
    }
