"""flash-attn across its releases: one way in (keywords, only what the installed version has) and a preflight
against combinations known to break.

    from foundry_attn.flash_compat import call, preflight
    out = call("flash_attn_func", q, k, v, causal=True, softcap=0.0)   # softcap dropped before 2.6.0 when 0
    for problem in preflight(probe()):                                    # also run by the policy and doctor
        print(problem.check, problem.reason, problem.fix)

Parameters were inserted mid-list across releases (``alibi_slopes`` 2.4.0, ``deterministic`` 2.4.1,
``softcap`` 2.6.0), so positional callers silently misbind: :func:`call` passes everything after q, k, v
(and the varlen lengths) by keyword, drops a newer keyword the installed version lacks when it is left at its
default, and raises when a feature is really asked for. :func:`preflight` reads the installed versions
(``importlib.metadata``) and names each known-bad combination with the pins that fix it.
Core module: torch, packaging and the standard library only.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import os
from typing import TYPE_CHECKING, Any

from packaging.version import Version

if TYPE_CHECKING:
    from foundry_attn.capability import Capability

#: keyword -> (first flash-attn release that has it, its default: passing the default is a no-op)
ADDED: dict[str, tuple[str, Any]] = {
    "window_size": ("2.3.0", (-1, -1)),
    "alibi_slopes": ("2.4.0", None),
    "deterministic": ("2.4.1", False),
    "softcap": ("2.6.0", 0.0),
}
#: the public entry points we call, and how many leading arguments are positional
POSITIONAL = {"flash_attn_func": 3, "flash_attn_varlen_func": 7}
#: transformers' own minimum flash-attn for flash_attention_2 (5.x raises below 2.3.3 at load)
TRANSFORMERS_MIN_FA2 = ((Version("5.0"), Version("2.3.3")), (Version("0"), Version("2.1.0")))
#: TransformerEngine release range -> the newest flash-attn it supports (its own setup pins)
TE_MAX_FLASH_ATTN = (
    ((Version("1.7"), Version("1.11")), Version("2.5.8")),
    ((Version("1.11"), Version("2.0")), Version("2.6.3")),
    ((Version("2.0"), Version("2.1")), Version("2.7.3")),
    ((Version("2.1"), Version("2.6")), Version("2.7.4.post1")),
    ((Version("2.6"), Version("2.10")), Version("2.8.1")),
    ((Version("2.10"), Version("999")), Version("2.8.3")),
)


class FlashAttnFeatureError(RuntimeError):
    """A feature was asked of a flash-attn release that does not have it."""


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def supported(keyword: str, flash_attn_version: str) -> bool:
    """Whether ``flash_attn_version`` takes ``keyword`` (keywords not in :data:`ADDED` are as old as 2.1)."""
    first = ADDED.get(keyword)
    return first is None or Version(flash_attn_version) >= Version(first[0])


def keywords(flash_attn_version: str, **kwargs: Any) -> dict[str, Any]:
    """``kwargs`` fit for this release: a newer keyword at its default is dropped; a real request raises."""
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        if supported(key, flash_attn_version):
            out[key] = value
        elif value != ADDED[key][1]:
            raise FlashAttnFeatureError(
                f"flash-attn {flash_attn_version} has no {key}= (added in {ADDED[key][0]}); "
                f"pip install 'flash-attn>={ADDED[key][0]}' --no-build-isolation"
            )
    return out


def call(name: str, *args: Any, **kwargs: Any) -> Any:
    """Call ``flash_attn.<name>`` with only its leading tensors positional and the rest as fitting keywords."""
    if name not in POSITIONAL:
        raise ValueError(f"flash_compat.call: unknown entry point {name!r}; valid: {', '.join(POSITIONAL)}")
    if len(args) > POSITIONAL[name]:
        raise TypeError(
            f"{name}: pass only the first {POSITIONAL[name]} arguments positionally (the rest moved "
            "between flash-attn releases); give the others by keyword"
        )
    module = importlib.import_module("flash_attn")
    version = getattr(module, "__version__", None) or _version("flash-attn") or "2.1.0"
    return getattr(module, name)(*args, **keywords(version, **kwargs))


# ---- preflight ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Problem:
    """A known-bad combination in this install. ``rejects`` is the implementation it rules out (or None)."""

    check: str
    reason: str
    fix: str
    rejects: str | None = "flash_attention_2"


def _te_problem(te: str, fa: str) -> Problem | None:
    te_v, fa_v = Version(te), Version(fa)
    check = "TransformerEngine x flash-attn"
    if Version("1.11") <= te_v < Version("2.0") and fa_v >= Version("2.6.0"):  # inside TE's own range, still broken
        return Problem(
            check,
            f"transformer-engine {te} calls flash-attn's private _flash_attn_varlen_backward "
            f"without softcap, which flash-attn {fa} (>= 2.6.0) requires: a TypeError in the "
            "context-parallel backward",
            "pip install 'flash-attn==2.5.8' --no-build-isolation, or 'transformer-engine>=2.0'",
        )
    for (low, high), newest in TE_MAX_FLASH_ATTN:
        if low <= te_v < high and fa_v > newest:
            return Problem(
                check,
                f"transformer-engine {te} supports flash-attn <= {newest}, found {fa}",
                f"pip install 'flash-attn=={newest}' --no-build-isolation, or a newer transformer-engine",
            )
    return None


def preflight(cap: Capability, env: dict[str, str] | None = None) -> list[Problem]:
    """Every known-bad combination among the installed distributions (read with ``importlib.metadata``) on the
    device ``cap`` describes; empty when none applies."""
    env = dict(os.environ) if env is None else env
    problems: list[Problem] = []
    fa = _version("flash-attn") or _version("flash_attn")
    te = _version("transformer-engine") or _version("transformer_engine")
    transformers = _version("transformers")
    if fa and te:
        mismatch = _te_problem(te, fa)
        if mismatch:
            problems.append(mismatch)
    if fa and transformers:
        minimum = next(m for since, m in TRANSFORMERS_MIN_FA2 if Version(transformers) >= since)
        if Version(fa) < minimum:
            problems.append(
                Problem(
                    "flash-attn version",
                    f"transformers {transformers} needs flash-attn >= {minimum} for flash_attention_2, found {fa}",
                    f"pip install 'flash-attn>={minimum}' --no-build-isolation",
                )
            )
    fa3 = _version("flash-attn-3") or _version("flash_attn_3")
    if fa3 and cap.compute_capability is not None and cap.compute_capability[0] != 9:
        problems.append(
            Problem(
                "FA3 on this GPU",
                f"flash-attn-3 {fa3} is installed but {cap.device_name} {cap.sm} is not Hopper (FA3 runs on sm90 only)",
                "pip uninstall flash-attn-3 (flash_attention_2 is unaffected)",
                rejects=None,
            )
        )
    offline = env.get("HF_HUB_OFFLINE", "0") not in ("0", "") or env.get("TRANSFORMERS_OFFLINE", "0") not in ("0", "")
    if cap.hub_kernel and not fa and offline:
        problems.append(
            Problem(
                "hub kernel offline",
                f"transformers would load {cap.hub_kernel} from the hub for "
                "flash_attention_2, and the hub is offline here (HF_HUB_OFFLINE)",
                "pip install flash-attn --no-build-isolation, or pip uninstall kernels",
            )
        )
    return problems
