"""The benchmarks' one timer and one peak-memory tracker. Core module: torch only.

:func:`round_robin` times named variants side by side: every round calls each variant once (a variant given fewer
``samples`` is spread evenly over the rounds), in an order rotated by one every round, so that load from other
processes falls on every variant alike. Around each timed call: the untimed ``before`` hook (grads to None, say),
a garbage collection, Python's GC disabled, and a device sync before the clock starts and before it stops. The
long-lived heap (torch, transformers, Composer: about half a million objects, a quarter of a second to collect)
is frozen for the whole run, so the collection before each call is cheap and no collection lands inside one.

:class:`PeakMemory` measures the bytes allocated above the resting state at a block's peak: CUDA's allocator
statistics (``max_memory_allocated`` after a reset) on a CUDA device, elsewhere :class:`PeakLiveBytes`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from foundry_attn.bench import sync


@dataclasses.dataclass
class Timings:
    """Per variant, one entry per timed call, in call order (entry ``i`` of every variant timed each round is
    round ``i``: the pairs that :func:`paired_ratio_median` compares)."""

    seconds: dict[str, list[float]]  # wall time of the call (or what a self-timed call returned)
    cpu_seconds: dict[str, list[float]]  # process CPU time of the call, all threads
    values: dict[str, list[Any]]  # what the call returned


def due(round_: int, samples: int, rounds: int) -> bool:
    """Whether a variant timed ``samples`` times over ``rounds`` rounds runs in this round (spread evenly)."""
    return (round_ + 1) * samples // rounds > round_ * samples // rounds


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Collect once, then keep everything alive now out of later collections (``gc.freeze``) until the end."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def round_robin(
    variants: Mapping[str, Callable[[], Any]],
    rounds: int,
    *,
    samples: Mapping[str, int] | None = None,
    device: torch.device | None = None,
    before: Callable[[str], None] | None = None,
    self_timed: bool = False,
) -> Timings:
    """Time each variant ``rounds`` times (``samples[name]`` for those named there), round-robin.

    The order is the mapping's, rotated by one every round. ``before(name)`` runs untimed before each call.
    ``device``: synced before the clock starts and before it stops (CUDA). ``self_timed``: each call returns its
    own seconds (measured inside it, e.g. by callbacks), which are recorded instead of the wall time around it.
    A call's return value is kept (``Timings.values``): return something small, or None.
    """
    samples = samples or {}
    names = list(variants)
    out = Timings({n: [] for n in names}, {n: [] for n in names}, {n: [] for n in names})
    with frozen_heap():
        for r in range(rounds):
            shift = r % len(names)
            for name in [*names[shift:], *names[:shift]]:
                if not due(r, min(samples.get(name, rounds), rounds), rounds):
                    continue
                if before is not None:
                    before(name)
                wall, cpu, value = _timed_call(variants[name], device)
                out.seconds[name].append(float(value) if self_timed else wall)
                out.cpu_seconds[name].append(cpu)
                out.values[name].append(value)
    return out


def _timed_call(fn: Callable[[], Any], device: torch.device | None) -> tuple[float, float, Any]:
    """(wall seconds, process CPU seconds, result) of one call, garbage collected first, GC off inside it."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        if device is not None:
            sync(device)
        cpu, start = time.process_time(), time.perf_counter()
        value = fn()
        if device is not None:
            sync(device)
        return time.perf_counter() - start, time.process_time() - cpu, value
    finally:
        if enabled:
            gc.enable()


def median(values: Sequence[float]) -> float:
    """The median: what a benchmark reports (robust to the odd step another process slowed)."""
    return statistics.median(values)


def paired_ratio_median(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """Median over rounds of ``numerator[i] / denominator[i]``: a ratio of two variants timed in the same rounds."""
    if len(numerator) != len(denominator):
        raise ValueError(
            f"paired ratio of {len(numerator)} and {len(denominator)} samples: not timed in the same rounds"
        )
    return statistics.median(n / d for n, d in zip(numerator, denominator, strict=True))


class PeakLiveBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages allocated while active and still alive (CPU's max_memory_allocated).

    Adds up the storage of every op output that is a new allocation (not a view or an in-place/out= result) while
    it is alive and keeps the peak: no scratch memory inside kernels. CPU has no allocator statistics, and RSS is
    monotonic, shared by the process and blurred by malloc's caching.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # torch's signature
        out = func(*args, **(kwargs or {}))
        results = out if isinstance(out, tuple) else (out,)
        for ret, value in zip(func._schema.returns, results, strict=False):
            if ret.alias_info is not None:  # a view or an in-place/out= result: no new storage
                continue
            for t in value if isinstance(value, list | tuple) else (value,):
                if isinstance(t, torch.Tensor):
                    self._track(t.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._refs:
            return
        size = storage.nbytes()

        def freed(_ref: weakref.ref, key: int = key, size: int = size) -> None:
            self.live -= size
            self._refs.pop(key, None)

        self._refs[key] = weakref.ref(storage, freed)
        self.live += size
        self.peak = max(self.peak, self.live)


class PeakMemory:
    """``with PeakMemory(device) as mem: ...`` then ``mem.peak``: bytes allocated above the state at entry at the
    block's peak (activations, gradients, temporaries). CUDA: ``torch.cuda.max_memory_allocated`` (reset at entry)
    minus the allocation at entry; elsewhere :class:`PeakLiveBytes`. Garbage is collected at entry."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0
        self._tracker: PeakLiveBytes | None = None
        self._before = 0

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.device.type == "cuda":
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._before = torch.cuda.memory_allocated(self.device)
        else:
            self._tracker = PeakLiveBytes()
            self._tracker.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._tracker is None:
            sync(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._before
        else:
            self._tracker.__exit__(*exc)
            self.peak = self._tracker.peak
            self._tracker = None
