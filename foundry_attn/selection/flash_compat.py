"""flash-attn across its releases: one way in (keywords, only what the installed version has) and a preflight
against combinations known to break.

    from foundry_attn.selection.flash_compat import call, preflight
    out = call("flash_attn_func", q, k, v, causal=True, softcap=0.0)   # softcap dropped before 2.6.0 when 0
    for problem in preflight(probe()):                                    # also run by the policy and doctor
        print(problem.check, problem.reason, problem.fix)

Parameters were inserted mid-list across releases (``alibi_slopes`` 2.4.0, ``deterministic`` 2.4.1,
``softcap`` 2.6.0), so positional callers silently misbind: :func:`call` passes everything after q, k, v
(and the varlen lengths) by keyword, drops a newer keyword the installed version lacks when it is left at its
default, and raises when a feature is really asked for. :func:`preflight` reads the installed versions
(``importlib.metadata``) and names each known-bad combination with the pins that fix it; the TransformerEngine pairs
(:data:`TE_RULES`) come from the releases' own sources and refuse FA2 only where TE's attention is in the model.
Core module: torch, packaging and the standard library only.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

from packaging.version import Version

from foundry_attn.checks import check_choice

if TYPE_CHECKING:
    from foundry_attn.selection.capability import Capability

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
_TE_NEWER = "pip install 'transformer-engine>=2.1' (it passes what each flash-attn release takes)"
#: TransformerEngine x flash-attn, read from the releases' own sources (2026-11-25; TE 1.6 to 2.20.2, flash-attn 2.3
#: to 2.8.3.post2): (TE releases [from, below), the flash-attn releases [from, below) that meet it, whether the
#: call raises (else TE turns its flash-attn backend off with a warning and runs cuDNN or unfused attention), what
#: happens, the fix). Every row concerns TE's own attention modules (DotProductAttention and the layers on it):
#: transformers' flash_attention_2 calls flash-attn's public functions, which every pair here still takes.
TE_RULES: tuple[tuple[tuple[str, str], tuple[str, str], bool, str, str], ...] = (
    (
        ("0", "1.7"),
        ("2.5.7", "2.6.2"),
        True,
        "its context-parallel forward calls flash-attn's private _flash_attn_varlen_forward without block_table / "
        "softcap, which flash-attn {fa} requires: a TypeError at the first forward",
        "pip install 'flash-attn==2.4.2' --no-build-isolation (its own pin), or " + _TE_NEWER,
    ),
    (
        ("0", "1.7"),
        ("2.6.2", "2.7"),
        True,
        "its context-parallel backward calls flash-attn's private _flash_attn_varlen_backward without softcap, which "
        "flash-attn {fa} requires: TypeError: _flash_attn_varlen_backward() missing 1 required positional argument: "
        "'softcap', at the first backward",
        "pip install 'flash-attn==2.4.2' --no-build-isolation (its own pin), or " + _TE_NEWER,
    ),
    (
        ("0", "1.7"),
        ("2.7", "999"),
        True,
        "its context-parallel forward passes window_size= to flash-attn's private _flash_attn_varlen_forward, which "
        "flash-attn {fa} (a torch custom op since 2.7) does not take: RuntimeError: Unknown keyword argument "
        "'window_size', at the first forward",
        "pip install 'flash-attn==2.4.2' --no-build-isolation (its own pin), or " + _TE_NEWER,
    ),
    (
        ("1.7", "1.11"),
        ("2.5.8.post0", "999"),
        True,
        "it asserts flash-attn <= 2.5.8 when it builds its attention: AssertionError: FlashAttention maximum "
        "version 2.5.8 is supported.",
        "pip install 'flash-attn==2.5.8' --no-build-isolation, or " + _TE_NEWER,
    ),
    (
        ("1.7", "1.11"),
        ("2.5.7", "2.5.8.post0"),
        True,
        "its context-parallel forward calls flash-attn's private _flash_attn_varlen_forward without block_table, "
        "which flash-attn {fa} requires: a TypeError at the first forward",
        "pip install 'flash-attn==2.5.6' --no-build-isolation, or " + _TE_NEWER,
    ),
    (
        ("1.11", "1.12"),
        ("2.6.3.post0", "999"),
        True,
        "it asserts flash-attn <= 2.6.3 when it builds its attention: AssertionError: FlashAttention maximum "
        "version 2.6.3 is supported.",
        "pip install 'flash-attn==2.6.3' --no-build-isolation, then " + _TE_NEWER,
    ),
    (
        ("1.11", "1.14"),
        ("2.6", "2.6.3.post0"),
        True,
        "its context-parallel attention calls flash-attn's private _flash_attn_varlen_forward / "
        "_flash_attn_varlen_backward without softcap, which flash-attn {fa} requires: TypeError: ... missing 1 "
        "required positional argument: 'softcap' (the forward before 2.6.2, the backward after)",
        "pip install 'flash-attn==2.5.6' --no-build-isolation, or " + _TE_NEWER,
    ),
    (("1.12", "1.14"), ("2.6.3.post0", "999"), False, "it supports flash-attn 2.1.1 to 2.6.3", _TE_NEWER),
    (("2.0", "2.1"), ("2.7.3.post0", "999"), False, "it supports flash-attn up to 2.7.3", _TE_NEWER),
    (("2.1", "2.6"), ("2.7.4.post2", "999"), False, "it supports flash-attn up to 2.7.4.post1", _TE_NEWER),
    (("2.6", "2.10"), ("2.8.1.post0", "999"), False, "it supports flash-attn up to 2.8.1", _TE_NEWER),
    (
        ("2.10", "2.19"),
        ("2.8.3.post0", "999"),
        False,
        "it supports flash-attn up to 2.8.3, not its .post releases",
        "pip install 'transformer-engine>=2.19'",
    ),
    (("2.19", "999"), ("2.8.4", "999"), False, "it supports flash-attn before 2.8.4", "a transformer-engine newer"),
)


class FlashAttnFeatureError(RuntimeError):
    """A feature was asked of a flash-attn release that does not have it."""


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def supported(keyword: str, flash_attn_version: str) -> bool:
    """Whether ``flash_attn_version`` takes ``keyword`` (keywords not in :data:`ADDED` are as old as 2.1).

    Args:
        keyword: a keyword of ``flash_attn_func`` / ``flash_attn_varlen_func``.
        flash_attn_version: the installed flash-attn release.

    Returns:
        True where that release has the keyword.

    Example::

        >>> supported("softcap", "2.5.8"), supported("softcap", "2.6.3")
        (False, True)
    """
    first = ADDED.get(keyword)
    return first is None or Version(flash_attn_version) >= Version(first[0])


def keywords(flash_attn_version: str, **kwargs: Any) -> dict[str, Any]:
    """``kwargs`` fit for this release: a newer keyword at its default is dropped; a real request raises.

    Args:
        flash_attn_version: the installed flash-attn release.
        **kwargs: the keywords for the call.

    Returns:
        The keywords this release takes.

    Raises:
        FlashAttnFeatureError: a keyword this release lacks is set to something other than its default.

    Example::

        >>> keywords("2.5.9", causal=True, softcap=0.0)
        {'causal': True}
    """
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
    """Call ``flash_attn.<name>`` with only its leading tensors positional and the rest as fitting keywords.

    Args:
        name: ``flash_attn_func`` or ``flash_attn_varlen_func``.
        *args: the leading positional arguments (q, k, v; for varlen also the bounds and maximum lengths).
        **kwargs: everything else, fitted to the installed release by :func:`keywords`.

    Returns:
        What flash-attn's function returns.

    Raises:
        ValueError: ``name`` is not one of :data:`POSITIONAL`.
        TypeError: more arguments were passed positionally.

    The example is not run here: it calls flash-attn's kernel, which needs flash-attn installed and a CUDA GPU.

    Example::

        >>> out = call("flash_attn_func", q, k, v, causal=True, softcap=0.0)  # 2.5.8: softcap dropped  # doctest: +SKIP
    """
    check_choice("flash_compat.call", name, POSITIONAL)
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
    """A known-bad combination in this install. ``rejects`` is the implementation it rules out (or None);
    ``te_attention``: only where TransformerEngine's own attention runs in the model (elsewhere a warning)."""

    check: str
    reason: str
    fix: str
    rejects: str | None = "flash_attention_2"
    te_attention: bool = False


def te_problem(te: str, fa: str) -> Problem | None:
    """What TransformerEngine ``te`` does with flash-attn ``fa`` where its own attention runs (:data:`TE_RULES`), as a
    :class:`Problem` that rejects FA2 only where the call raises and TE's attention is in the model; None when
    the pair works.

    Args:
        te: the installed transformer-engine release.
        fa: the installed flash-attn release.

    Returns:
        The :class:`Problem`, or None when the pair works.

    Example::

        >>> te_problem("1.13.0", "2.6.3").fix
        "pip install 'flash-attn==2.5.6' --no-build-isolation, or pip install 'transformer-engine>=2.1' (...)"
    """
    te_v, fa_v = Version(te), Version(fa)
    for (te_from, te_below), (fa_from, fa_below), raises, what, fix in TE_RULES:
        if Version(te_from) <= te_v < Version(te_below) and Version(fa_from) <= fa_v < Version(fa_below):
            if not raises:
                what = f"{what}, so it turns its flash-attn backend off and runs cuDNN or unfused attention"
            return Problem(
                "TransformerEngine x flash-attn",
                f"transformer-engine {te} with flash-attn {fa}: {what.format(fa=fa)}",
                fix,
                rejects="flash_attention_2" if raises else None,
                te_attention=True,
            )
    return None


def preflight(cap: Capability) -> list[Problem]:
    """Every known-bad combination among the installed distributions (read with ``importlib.metadata``) on the
    device ``cap`` describes; empty when none applies.

    Args:
        cap: the device and install, from :func:`~foundry_attn.selection.capability.probe`.

    Returns:
        Every :class:`Problem` found.

    Example::

        >>> [p.check for p in preflight(probe())]  # none here; flash-attn 2.3.0 under 5.x: ['flash-attn version']
        []
    """
    problems: list[Problem] = []
    fa = _version("flash-attn") or _version("flash_attn")
    te = _version("transformer-engine") or _version("transformer_engine")
    transformers = _version("transformers")
    if fa and te:
        mismatch = te_problem(te, fa)
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
    return problems
