"""The guarded flash-attn import: a broken flash-attn is tried once, kept for the record, and hidden, so the run
reaches the builder and falls back instead of dying inside ``import llmfoundry`` or ``import transformers``.

Installed with the package, ``foundry_attn_guard.pth`` calls :func:`arm` at interpreter start. That only puts
an import finder first on ``sys.meta_path`` (no torch, nothing heavy: about 0.1 ms). The first time anything
imports ``transformers``, ``llmfoundry`` or ``flash_attn``, the finder imports flash_attn once, before they look
for it. If that fails, it keeps the error and the installed version and sets ``sys.modules["flash_attn"] = None``:
``importlib.util.find_spec`` then answers None and ``import flash_attn`` raises ``ModuleNotFoundError``, so
LLM-Foundry and transformers treat flash-attn as absent, and our decision names the real cause and its fix.

    FOUNDRY_ATTN_GUARD=0 composer train.py yamls/tiny_cpu.yaml   # off: a broken flash-attn fails as it would stock

Core module: ``os``, ``sys`` and ``importlib.machinery`` at import (it runs at every interpreter start: keep it so).
"""

from __future__ import annotations

import importlib.machinery
import os
import sys

TYPE_CHECKING = False  # not typing's: importing typing costs every interpreter start
if TYPE_CHECKING:
    import types
    from collections.abc import Sequence

#: the environment variable that switches the guard off ("0")
SWITCH = "FOUNDRY_ATTN_GUARD"
#: the imports before which flash_attn is tried: each looks for flash_attn as it is imported
TRIGGERS = frozenset({"flash_attn", "transformers", "llmfoundry"})

ABI = "extension built for another torch"
NO_EXTENSION = "extension missing"
NO_DEPENDENCY = "dependency missing"
OTHER = "import error"


class FlashAttnImport:
    """What the one import of flash_attn gave: ``installed`` is the distribution's version (None: not installed),
    ``kind`` the cause when it did not import (one of ``ABI``, ``NO_EXTENSION``, ``NO_DEPENDENCY``, ``OTHER``),
    ``hidden`` whether the guard hid the broken package from this process. A plain class: ``dataclasses`` would
    cost every interpreter start 10 ms."""

    __slots__ = ("error", "hidden", "imported", "installed", "kind")

    def __init__(
        self,
        installed: str | None,
        imported: bool,
        kind: str | None = None,
        error: str | None = None,
        hidden: bool = False,
    ) -> None:
        self.installed, self.imported, self.kind, self.error, self.hidden = installed, imported, kind, error, hidden

    def as_dict(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in self.__slots__}

    def __repr__(self) -> str:
        return f"FlashAttnImport({', '.join(f'{k}={v!r}' for k, v in self.as_dict().items())})"

    @property
    def run(self) -> str:
        """What a run does with this install, in one line (doctor prints it)."""
        if self.imported or self.installed is None:
            return "nothing to guard"
        if self.hidden:
            return "a run hides it (foundry_attn_guard.pth) and falls back; attn_strict with flash_attention_2 stops"
        return (
            f"{SWITCH}=0: nothing hides it, so a run that imports LLM-Foundry (or, on a GPU, transformers' "
            "flash-attention code) fails at that import, as it does without foundry_attn"
        )

    @property
    def reason(self) -> str:
        """The cause, in one line, with its fix; empty when flash-attn imports."""
        if self.imported:
            return ""
        if self.installed is None:
            return "flash-attn is not installed (pip install flash-attn --no-build-isolation)"
        what = {
            ABI: "its CUDA extension was built for another torch",
            NO_EXTENSION: "its CUDA extension is missing (the build was skipped or failed)",
            NO_DEPENDENCY: "a package it imports is missing",
        }.get(self.kind or OTHER, "it does not import")
        error = self.error or ""
        if self.kind == ABI and "undefined symbol" in error:  # the symbol, not the path to the .so
            error = "undefined symbol" + error.split("undefined symbol", 1)[1]
        hidden = "; foundry_attn hid it so the run falls back" if self.hidden else ""
        return f"flash-attn {self.installed} is installed but {what} ({error}){hidden} (fix: {self.fix})"

    @property
    def fix(self) -> str:
        """The command that mends the cause, with the versions filled in."""
        if self.installed is None:
            return "pip install flash-attn --no-build-isolation"
        if self.kind == NO_DEPENDENCY and self.error and "'" in self.error:  # "No module named 'einops'"
            module = self.error.split("'")[1]
            return f"pip install {module.split('.')[0]}"
        torch = _version("torch") or "?"
        reinstall = (
            "pip install --force-reinstall --no-cache-dir --no-deps --no-build-isolation "
            f"'flash-attn=={self.installed}'"
        )
        if self.kind == ABI:
            return f"reinstall it built for this torch {torch}: {reinstall}"
        if self.kind == NO_EXTENSION:
            return f"build it for torch {torch} where the CUDA toolkit is: {reinstall}"
        return f"reinstall it for torch {torch}: {reinstall}"


def _version(dist: str) -> str | None:
    import importlib.metadata  # here, not at the top: it costs an interpreter start 20 ms

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def classify(exc: BaseException) -> str:
    """The kind of a failed ``import flash_attn``."""
    text = str(exc)
    if isinstance(exc, ImportError) and ("undefined symbol" in text or "Symbol not found" in text):
        return ABI
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return NO_EXTENSION if exc.name.startswith("flash_attn") else NO_DEPENDENCY
    return OTHER


def enabled() -> bool:
    """Whether the guard may hide a broken flash-attn (``FOUNDRY_ATTN_GUARD=0`` switches it off)."""
    return os.environ.get(SWITCH) != "0"  # foundry_attn_guard.pth reads it the same way


_result: FlashAttnImport | None = None


def check() -> FlashAttnImport:
    """Import flash_attn once per process (later calls return the first answer); hide it if it is broken and the
    guard is on. Safe to call at any time; the finder calls it before transformers or LLM-Foundry load."""
    global _result
    if _result is not None:
        return _result
    installed = _version("flash-attn") or _version("flash_attn")
    if "flash_attn" in sys.modules and sys.modules["flash_attn"] is not None:  # imported before us, so it works
        _result = FlashAttnImport(installed, True)
        return _result
    _finder.busy = True
    try:
        __import__("flash_attn")
    except ModuleNotFoundError as exc:
        if exc.name != "flash_attn" or installed is not None:  # a piece of it, not the package, is missing
            _result = _failed(installed, exc)
        else:
            _result = FlashAttnImport(None, False)
    except Exception as exc:  # an ABI mismatch raises ImportError; a bad build OSError or RuntimeError
        _result = _failed(installed, exc)
    else:
        _result = FlashAttnImport(installed, True)
    finally:
        _finder.busy = False
    return _result


def _failed(installed: str | None, exc: BaseException) -> FlashAttnImport:
    hide = enabled()
    if hide:
        for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
            del sys.modules[name]
        sys.modules["flash_attn"] = None  # type: ignore[assignment]  # find_spec -> None, import -> not found
    first = str(exc).splitlines()[0] if str(exc) else ""
    return FlashAttnImport(installed or "?", False, classify(exc), f"{type(exc).__name__}: {first}", hide)


class _Loaded:  # an importlib.abc.Loader, without importing importlib.abc
    """Hands the import system a module the trial import already loaded, instead of running it twice."""

    def __init__(self, module: types.ModuleType) -> None:
        self.module, self.spec = module, module.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self.module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = self.spec  # the import system set ours; the module keeps its own


class _Hidden:  # an importlib.abc.Loader
    """Fails the import that found flash_attn broken as every later one fails: as if it were not installed.
    The text leaves the cause out: LLM-Foundry re-raises an import error that says "undefined symbol"."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        raise ModuleNotFoundError(
            "flash_attn is hidden by foundry_attn's guard: `foundry-attn doctor` says why", name=spec.name
        )

    def exec_module(self, module: types.ModuleType) -> None:  # never reached: create_module raises
        raise AssertionError


class _Finder:
    """First on ``sys.meta_path``: at the first import of a trigger, run :func:`check`, then step aside."""

    busy = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if self.busy or _result is not None or fullname not in TRIGGERS:
            return None
        check()
        module = sys.modules.get(fullname)
        if module is not None:  # the trial imported it
            return importlib.machinery.ModuleSpec(fullname, _Loaded(module))  # type: ignore[arg-type]
        if fullname in sys.modules:  # flash_attn itself, hidden just now
            return importlib.machinery.ModuleSpec(fullname, _Hidden())  # type: ignore[arg-type]
        return None  # not imported by the trial: the usual finders go on


_finder = _Finder()


def arm() -> None:
    """Put the finder first on ``sys.meta_path`` (once; nothing when switched off). Where a trigger is already
    imported, try flash_attn now instead."""
    if not enabled() or _finder in sys.meta_path or _result is not None:
        return
    if any(name in sys.modules for name in TRIGGERS):
        check()
        return
    sys.meta_path.insert(0, _finder)
