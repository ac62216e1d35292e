"""What this machine and this install can run: a plain, serialisable snapshot.

    >>> from foundry_attn.selection.capability import probe
    >>> probe().as_dict()["device_name"]
    'cpu'

Core module: torch, transformers and the standard library only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import os
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from foundry_attn import guard


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclasses.dataclass(frozen=True)
class Capability:
    """Facts the attention policy decides on. Tests build these by hand to inject hardware."""

    cuda: bool
    device_name: str
    compute_capability: tuple[int, int] | None
    torch_version: str
    transformers_version: str | None
    flash_attn_version: str | None  # the version that imports here, else None
    flash_attn_error: str | None  # why it does not, by kind (foundry_attn.guard), else None
    transformer_engine_version: str | None
    host: str = dataclasses.field(default_factory=socket.gethostname)
    #: the installed flash-attn distribution's version, whether it imports or not (events group nodes by it)
    flash_attn_installed: str | None = None
    #: the command that mends ``flash_attn_error`` (versions filled in), else None
    flash_attn_fix: str | None = None
    #: why FlexAttention cannot train (backward) on this device with this torch, or None when it can
    flex_backward_error: str | None = None
    #: the hub kernel transformers 5.x loads for ``flash_attention_2`` when flash-attn is missing (through the
    #: ``kernels`` package, silently), else None (4.51 has no such fallback)
    hub_kernel: str | None = None
    #: what that hub kernel lacks to run here (the ``kernels`` release transformers wants, CUDA, a cached copy for
    #: offline use), or None when it is usable: the policy then takes it for ``flash_attention_2``
    hub_kernel_missing: str | None = None

    @property
    def sm(self) -> str:
        """``sm80``-style name of the compute capability, or ``cpu``.

        Returns:
            ``sm`` and the capability's two digits, or ``cpu`` without one.

        Example::

            >>> a100_capability.sm, probe("cpu").sm
            ('sm80', 'cpu')
        """
        if self.compute_capability is None:
            return "cpu"
        return f"sm{self.compute_capability[0]}{self.compute_capability[1]}"

    def as_dict(self) -> dict:
        """The fields as a JSON-ready dict (the doctor's ``environment``), with ``sm`` added.

        Returns:
            Every field by name, ``compute_capability`` as a list (or None), and ``sm``.

        Example::

            >>> info = a100_capability.as_dict()
            >>> info["compute_capability"], info["sm"]
            ([8, 0], 'sm80')
        """
        out = dataclasses.asdict(self)
        out["compute_capability"] = list(self.compute_capability) if self.compute_capability else None
        out["sm"] = self.sm
        return out


def probe_flash_attn() -> tuple[str | None, str | None]:
    """Version of flash-attn if it really imports, else why not, by kind (the guard's one import of it).

    Returns:
        ``(version, None)`` where flash-attn imports, else ``(None, reason)``.

    Example::

        >>> probe_flash_attn()
        (None, 'flash-attn is not installed (pip install flash-attn --no-build-isolation)')
    """
    tried = guard.check()
    if not tried.imported:
        return None, tried.reason
    return getattr(sys.modules["flash_attn"], "__version__", None) or tried.installed, None


def _hub_kernel() -> str | None:
    """The hub kernel transformers would load for ``flash_attention_2`` without flash-attn (5.x), else None."""
    try:
        from transformers.modeling_flash_attention_utils import (  # type: ignore[attr-defined,unused-ignore]
            FLASH_ATTN_KERNEL_FALLBACK,
        )
    except ImportError:  # 4.51: no hub fallback
        return None
    return FLASH_ATTN_KERNEL_FALLBACK.get("flash_attention_2")


def hub_kernel_missing(repo: str, cuda: bool, env: Mapping[str, str] | None = None) -> str | None:
    """What the hub kernel ``repo`` lacks to run here, or None when it is usable: the ``kernels`` release transformers
    wants (its own bounds), CUDA (hub kernels are CUDA builds), and a copy in the Hugging Face cache (nothing is
    fetched at run time, and offline nodes cannot).

    Args:
        repo: the hub kernel's repository, e.g. ``kernels-community/flash-attn2``.
        cuda: whether the device is a CUDA device.
        env: the environment ``USE_HUB_KERNELS`` is read from (None: ``os.environ``).

    Returns:
        What is missing, with the fix, or None when the hub kernel is usable.

    Example::

        >>> hub_kernel_missing("kernels-community/flash-attn2", cuda=True, env={"USE_HUB_KERNELS": "0"})
        'USE_HUB_KERNELS is off'
    """
    from packaging.version import Version
    from transformers.utils import import_utils

    env = os.environ if env is None else env
    if env.get("USE_HUB_KERNELS", "YES").upper() not in ("1", "ON", "YES", "TRUE"):
        return "USE_HUB_KERNELS is off"
    low = getattr(import_utils, "KERNELS_MIN_VERSION", None)
    high = getattr(import_utils, "KERNELS_MAX_VERSION", None)
    wants = f"transformers {_dist_version('transformers')} wants {low} <= kernels < {high}" if low and high else ""
    installed = _dist_version("kernels")
    if installed is None:
        return f"the kernels package is not installed ({wants}; pip install 'kernels=={low}')"
    if low and high and not Version(low) <= Version(installed) < Version(high):
        return f"kernels {installed} is installed, and {wants} (pip install 'kernels=={low}')"
    if not cuda:
        return "hub kernels are CUDA builds, and this device has no CUDA"
    from huggingface_hub import constants

    snapshots = Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}" / "snapshots"
    if not snapshots.is_dir() or not any(snapshots.iterdir()):
        return (
            f"{repo} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}); transformers would download it at "
            "the first forward: fetch it once where the hub is reachable (kernels download, or one run online)"
        )
    return None


def rng_untouched(device: torch.device | str) -> contextlib.AbstractContextManager:
    """A block that leaves the global RNG as it found it: the CPU's, and ``device``'s when it is CUDA (probes and
    smoke calls draw their inputs inside, so a seeded model build starts from the weights stock gives).

    Args:
        device: the device whose RNG is kept as well, where it is CUDA.

    Returns:
        A context manager that restores the RNG state on exit.

    Example::

        >>> before = torch.random.get_rng_state()
        >>> with rng_untouched("cpu"):
        ...     q = torch.randn(1, 8, 2, 64)
        >>> torch.equal(torch.random.get_rng_state(), before)  # the global RNG is as before
        True
    """
    device = torch.device(device)
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


@functools.cache
def flex_backward_error(device_type: str) -> str | None:
    """One tiny FlexAttention forward + backward on ``device_type``: None when it trains, else why not.

    torch 2.7 runs eager flex backward on the CPU; later releases raise ``NotImplementedError`` there.

    Args:
        device_type: ``cpu`` or ``cuda``; the answer is cached per device type.

    Returns:
        None when flex trains here, else the reason.

    Example::

        >>> why = flex_backward_error("cpu")  # torch 2.7: None (eager flex trains on the CPU); later: why not
        >>> why is None or why.endswith("(NotImplementedError: FlexAttention does not support backward on CPU)")
        True
    """
    try:
        from torch.nn.attention.flex_attention import flex_attention

        with rng_untouched(device_type):
            q = torch.randn(1, 1, 8, 8, device=device_type, requires_grad=True)
            out = flex_attention(q, q, q)
            assert isinstance(out, torch.Tensor)
            out.sum().backward()
    except Exception as exc:  # the reason is reported, the policy rejects flex
        first = str(exc).split(". ")[0]
        return (
            f"torch {torch.__version__} FlexAttention has no backward on {device_type} ({type(exc).__name__}: {first})"
        )
    return None


def probe(device: torch.device | str | None = None) -> Capability:
    """Collect the capability of ``device`` (default: the current CUDA device, else CPU).

    Args:
        device: the device to describe (None: ``cuda`` where there is one, else ``cpu``).

    Returns:
        The :class:`Capability` snapshot.

    Example::

        >>> cap = probe()  # on a CPU-only machine
        >>> cap.device_name, cap.sm, cap.flash_attn_version
        ('cpu', 'cpu', None)
    """
    cuda = torch.cuda.is_available()
    device = torch.device(device) if device is not None else torch.device("cuda" if cuda else "cpu")
    if device.type == "cuda" and cuda:
        name = torch.cuda.get_device_name(device)
        cc: tuple[int, int] | None = tuple(torch.cuda.get_device_capability(device))  # type: ignore[assignment]
    else:
        name, cc = "cpu", None
    tried = guard.check()  # the one import of flash_attn in this process
    fa_version, fa_error = probe_flash_attn()
    return Capability(
        cuda=cuda and device.type == "cuda",
        device_name=name,
        compute_capability=cc,
        torch_version=torch.__version__,
        transformers_version=_dist_version("transformers"),
        flash_attn_version=fa_version,
        flash_attn_error=fa_error,
        flash_attn_installed=tried.installed,
        flash_attn_fix=None if tried.imported else tried.fix,
        transformer_engine_version=_dist_version("transformer-engine") or _dist_version("transformer_engine"),
        hub_kernel=(hub := _hub_kernel() if fa_version is None else None),
        hub_kernel_missing=None if hub is None else hub_kernel_missing(hub, cuda and device.type == "cuda"),
        flex_backward_error=flex_backward_error(device.type if device.type == "cuda" and cuda else "cpu"),
    )
