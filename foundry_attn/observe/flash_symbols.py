"""transformers' flash-attention utilities: which names this release uses, and where (their calls are counted by
:class:`foundry_attn.observe.flash_calls.FlashCallTracer`).

    from foundry_attn.observe.flash_symbols import discover

    print(discover().describe())            # which names this transformers uses; which are missing

``_flash_attention_forward`` looks its helpers up in its own module at call time, so wrapping the module
attributes reaches every caller. Which names it looks up changed across releases, so :func:`discover` reads
them from the function's code instead of assuming them:

============  =====================================  ==============================================
role          4.51                                   later releases (4.54 ... 5.x)
============  =====================================  ==============================================
``upad``      ``_upad_input``                        ``_upad_input`` (+ unpad fn), then
                                                     ``prepare_fa_kwargs_from_attn_mask``
``posids``    ``prepare_fa2_from_position_ids``      ``_prepare_from_posids``, then
                                                     ``prepare_fa_kwargs_from_position_ids``
``varlen``    ``flash_attn_varlen_func`` (global)    2nd kernel of ``lazy_import_flash_attention()``
``dense``     ``flash_attn_func`` (global)           1st kernel of ``lazy_import_flash_attention()``
``pad``       ``pad_input`` (global)                 ``_pad_input`` / next-to-last kernel of the lazy import
============  =====================================  ==============================================

LLM-Foundry MPT (``attn_impl: flash``) bypasses these utilities and calls flash-attn itself:
:func:`discover_mpt` finds what it looks up at call time (``flash_attn.flash_attn_interface.flash_attn_varlen_func``
/ ``flash_attn_func``, ``flash_attn.bert_padding.pad_input``), which the same tracer wraps.
Core module: transformers and the standard library only.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

from foundry_attn.attention import fa2_reference

FA_UTILS = "transformers.modeling_flash_attention_utils"
UPAD, POSIDS, VARLEN, DENSE, PAD = "upad", "posids", "varlen", "dense", "pad"
ROLES: tuple[str, ...] = (UPAD, POSIDS, VARLEN, DENSE, PAD)
KERNEL_ROLES: tuple[str, ...] = (VARLEN, DENSE)
#: per role, module-level names in order of preference (newest last)
CANDIDATES: dict[str, tuple[str, ...]] = {
    UPAD: ("_upad_input", "prepare_fa_kwargs_from_attn_mask"),
    POSIDS: ("prepare_fa2_from_position_ids", "_prepare_from_posids", "prepare_fa_kwargs_from_position_ids"),
    VARLEN: ("flash_attn_varlen_func",),
    DENSE: ("flash_attn_func",),
    PAD: ("pad_input", "_pad_input"),
}
#: globals that the module imports from flash-attn (absent until flash-attn or the reference provides them)
KERNEL_GLOBALS = frozenset({"flash_attn_varlen_func", "flash_attn_func", "pad_input"})
LAZY_IMPORT = "lazy_import_flash_attention"
#: position of each kernel in the first element returned by ``lazy_import_flash_attention``, by its length:
#: 4.54-4.57 ``(dense, varlen, pad, unpad)``, 5.x ``(dense, varlen, kvcache, pad, unpad)``
LAZY_LAYOUTS = {4: {DENSE: 0, VARLEN: 1, PAD: 2}, 5: {DENSE: 0, VARLEN: 1, PAD: 3}}
LAZY_INDEX = {DENSE: 0, VARLEN: 1, PAD: -2}  # for names; pad is next to last in both layouts

# ---- discovery ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FlashSymbols:
    """What the installed transformers calls, by role. ``found[role]`` is a module attribute name, or
    ``lazy_import_flash_attention()[i]`` for kernels handed out by the lazy importer."""

    transformers_version: str  # the version of ``library`` (historic name)
    module: str
    found: dict[str, str]
    missing: dict[str, tuple[str, ...]]
    lazy_import: str | None = None
    error: str | None = None
    #: what calls these symbols: ``transformers`` (its FA utilities) or ``flash-attn`` (MPT's direct calls)
    library: str = "transformers"
    #: role -> the module its symbol lives in, where not ``module``
    modules: dict[str, str] = dataclasses.field(default_factory=dict)

    def module_of(self, role: str) -> str:
        """The module ``role``'s symbol lives in: ``modules[role]``, else :attr:`module`.

        Args:
            role: ``upad``, ``posids``, ``varlen``, ``dense`` or ``pad``.

        Returns:
            The module's dotted name.

        Example::

            >>> discover().module_of("varlen")  # transformers' own helpers: one module
            'transformers.modeling_flash_attention_utils'
        """
        return self.modules.get(role, self.module)

    def describe_missing(self) -> list[str]:
        """One line per role the library does not expose (empty when all are traceable).

        Returns:
            The lines; one line with the error where the module could not be inspected.

        Example::

            >>> discover().describe_missing()  # transformers 4.51 and 5.x: every role found
            []
        """
        if self.error:
            return [f"{self.library} {self.transformers_version}: cannot inspect {self.module}: {self.error}"]
        return [
            f"{self.library} {self.transformers_version} has none of {', '.join(names)} in {self.module}: "
            f"{role} calls are not counted"
            for role, names in self.missing.items()
        ]

    def describe(self) -> str:
        """What the library calls, by role, in one line; then :meth:`describe_missing`'s lines.

        Returns:
            The lines, joined by newlines.

        Example::

            >>> print(discover().describe())  # posids: 4.51 prepare_fa2_from_position_ids, 5.x _prepare_from_posids
            transformers ... (transformers.modeling_flash_attention_utils): upad=_upad_input, posids=...
        """
        found = ", ".join(f"{role}={name}" for role, name in self.found.items()) or "nothing"
        lines = [f"{self.library} {self.transformers_version} ({self.module}): {found}", *self.describe_missing()]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """The symbols as plain data, for an event (``upad_trace_missing``'s ``symbols``).

        Returns:
            Every field by name (:func:`dataclasses.asdict`).

        Example::

            >>> discover().as_dict()["found"]["upad"]  # transformers 4.51 and 5.x
            '_upad_input'
        """
        return dataclasses.asdict(self)


def _transformers_version() -> str:
    try:
        import transformers

        return str(transformers.__version__)
    except Exception:  # a broken install is reported, not raised
        return "unknown"


def discover(module: ModuleType | None = None) -> FlashSymbols:
    """Which flash-attention helpers ``_flash_attention_forward`` really looks up, per role; never raises.

    Args:
        module: the flash-attention utilities to read; None: ``transformers.modeling_flash_attention_utils``.

    Returns:
        The :class:`FlashSymbols`: per role the name found, else the names looked for; ``error`` where the module
        does not import.

    Example::

        >>> sorted(discover().found)  # every role: under 4.51's names, or 5.x's
        ['dense', 'pad', 'posids', 'upad', 'varlen']
    """
    version = _transformers_version()
    try:
        mod = module if module is not None else importlib.import_module(FA_UTILS)
    except Exception as exc:
        return FlashSymbols(version, FA_UTILS, {}, dict(CANDIDATES), error=f"{type(exc).__name__}: {exc}")
    forward = getattr(mod, "_flash_attention_forward", None)
    code = getattr(forward, "__code__", None)
    referenced = set(code.co_names) if code is not None else None

    def usable(name: str) -> bool:
        if referenced is not None and name not in referenced:
            return False
        return name in mod.__dict__ or (referenced is not None and name in KERNEL_GLOBALS)

    lazy = LAZY_IMPORT if usable(LAZY_IMPORT) and callable(mod.__dict__.get(LAZY_IMPORT)) else None
    lazy_code = getattr(mod.__dict__.get(LAZY_IMPORT), "__code__", None) if lazy else None
    lazy_has_pad = lazy_code is not None and "_pad_fn" in lazy_code.co_names
    found: dict[str, str] = {}
    missing: dict[str, tuple[str, ...]] = {}
    for role, names in CANDIDATES.items():
        name = next((n for n in names if usable(n)), None)
        if name is None and lazy and role in LAZY_INDEX and (role != PAD or lazy_has_pad):
            name = f"{LAZY_IMPORT}()[{LAZY_INDEX[role]}]"
        if name is None:
            missing[role] = names + ((LAZY_IMPORT,) if role in LAZY_INDEX else ())
        else:
            found[role] = name
    return FlashSymbols(version, getattr(mod, "__name__", FA_UTILS), found, missing, lazy)


#: where LLM-Foundry MPT (``attn_impl: flash``) looks up flash-attn at call time:
#: ``from flash_attn import bert_padding, flash_attn_interface`` inside ``flash_attn_fn``, then
#: ``flash_attn_interface.flash_attn_varlen_func(...)`` and ``bert_padding.pad_input(...)`` per layer
MPT_INTERFACE, MPT_PADDING = "flash_attn.flash_attn_interface", "flash_attn.bert_padding"
MPT_CANDIDATES: dict[str, tuple[str, str]] = {
    VARLEN: (MPT_INTERFACE, "flash_attn_varlen_func"),
    DENSE: (MPT_INTERFACE, "flash_attn_func"),
    PAD: (MPT_PADDING, "pad_input"),
}


def discover_mpt() -> FlashSymbols:
    """What LLM-Foundry MPT's flash path calls, found on flash-attn's own modules; never raises.

    MPT unpads once per forward (``bert_padding.unpad_input`` before its blocks) and calls flash-attn's kernels
    directly, so the ``upad`` / ``posids`` roles (transformers' per-layer helpers) are neither found nor missing.

    Returns:
        The :class:`FlashSymbols` of library ``flash-attn``; ``error`` where flash-attn does not import.

    Example::

        >>> discover_mpt().error  # no flash-attn here; with flash-attn 2.x, found names varlen, dense and pad
        "ModuleNotFoundError: No module named 'flash_attn'"
    """
    try:
        import flash_attn

        version = str(getattr(flash_attn, "__version__", "unknown"))
    except Exception as exc:
        names: dict[str, tuple[str, ...]] = {role: (name,) for role, (_, name) in MPT_CANDIDATES.items()}
        error = f"{type(exc).__name__}: {exc}"
        return FlashSymbols("none", MPT_INTERFACE, {}, names, error=error, library="flash-attn")
    found: dict[str, str] = {}
    missing: dict[str, tuple[str, ...]] = {}
    modules: dict[str, str] = {}
    for role, (module_name, name) in MPT_CANDIDATES.items():
        try:
            mod = importlib.import_module(module_name)
        except Exception:
            mod = None
        if mod is not None and callable(mod.__dict__.get(name)):
            found[role] = name
            if module_name != MPT_INTERFACE:
                modules[role] = module_name
        else:
            missing[role] = (name,)
    return FlashSymbols(version, MPT_INTERFACE, found, missing, library="flash-attn", modules=modules)


def symbol_label(symbols: FlashSymbols, role: str) -> str:
    """A short human name for a role in this transformers, e.g. ``_upad_input``.

    Args:
        symbols: what :func:`discover` found.
        role: one of :data:`ROLES`.

    Returns:
        The name found, else the role's first candidate and ``(missing)``.

    Example::

        >>> symbol_label(discover(), "upad"), symbol_label(FlashSymbols("4.50", FA_UTILS, {}, {}), "upad")
        ('_upad_input', '_upad_input (missing)')
    """
    return symbols.found.get(role) or f"{CANDIDATES[role][0]} (missing)"


def is_flash(impl: str | None) -> bool:
    """Implementations that run transformers' flash-attention utilities (FA2, FA3, flash kernels).

    Args:
        impl: an implementation's name (:func:`~foundry_attn.observe.discovery.attn_implementation`), or None.

    Returns:
        True where the name says ``flash``.

    Example::

        >>> is_flash("flash_attention_2"), is_flash("sdpa"), is_flash(None)
        (True, False, False)
    """
    return impl is not None and "flash" in impl


def short_list(values: list[int] | None, keep: int = 8) -> str:
    """A list for a console line: whole when short, else its first entries, ``...``, the last and the count.

    Args:
        values: the list (``cu_seqlens``), or None.
        keep: the longest list shown whole.

    Returns:
        The text; ``-`` for None.

    Example::

        >>> short_list(list(range(0, 200, 10)))
        '[0, 10, 20, 30, 40, 50, ..., 190] (20 entries)'
    """
    if values is None:
        return "-"
    if len(values) <= keep:
        return str(values)
    head = ", ".join(map(str, values[: keep - 2]))
    return f"[{head}, ..., {values[-1]}] ({len(values)} entries)"


def from_reference(fn: Callable) -> bool:
    """Whether ``fn`` (under its wrappers and partials) is one of the pure-PyTorch reference kernels.

    Args:
        fn: a kernel, as a module holds it or hands it out.

    Returns:
        True for :mod:`foundry_attn.attention.fa2_reference`'s kernels.

    Example::

        >>> from_reference(fa2_reference.flash_attn_varlen_func)
        True
    """
    fn = inspect.unwrap(fn)
    return getattr(getattr(fn, "func", fn), "__module__", None) == fa2_reference.__name__


def is_reference(symbols: FlashSymbols) -> bool:
    """The varlen kernel that ``symbols`` names is the pure-PyTorch reference (installed in flash-attn's place).

    Args:
        symbols: what :func:`discover` found.

    Returns:
        True where the module's varlen kernel is the reference's; False for a kernel handed out lazily, or whose module
        is gone.

    Example::

        >>> is_reference(discover())  # flash-attn's kernel, or none installed: not the reference
        False
    """
    name = symbols.found.get(VARLEN)
    if name is None or name.startswith(LAZY_IMPORT):
        return False
    try:
        fn = vars(importlib.import_module(symbols.module_of(VARLEN))).get(name)
    except Exception:  # the kernel's module went away: not the reference
        return False
    return callable(fn) and from_reference(fn)
