"""Layered patches of module attributes: undone exactly, in any order, even when several overlap.

    patch = patch_attribute(module, "name", replace=value)        # a kernel stand-in
    patch = patch_attribute(module, "name", wrap=lambda inner: f)  # a tracer around what is beneath
    patch.remove()

Replacements always sit beneath wrappers, and any layer can be removed in any order; the attribute is
re-rendered from the layers left and restored exactly when none is left. The FA2 reference kernel, the
``upad_tracer`` wrappers and eager flex all patch through here, so they nest without corrupting each other.
Core module: standard library only.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

_NO_ATTR = object()
_lock = threading.RLock()


@dataclasses.dataclass(eq=False)
class _Layer:
    replace: Any = _NO_ATTR  # a value that replaces what is beneath (kernels), or
    wrap: Callable[[Any], Any] | None = None  # a factory: callable beneath -> callable installed


@dataclasses.dataclass(eq=False)
class _Slot:
    module: ModuleType
    name: str
    base: Any
    layers: list[_Layer] = dataclasses.field(default_factory=list)


_slots: dict[tuple[int, str], _Slot] = {}


class Patch:
    """One layer on one module attribute; :meth:`remove` takes it out (idempotent)."""

    def __init__(self, slot: _Slot, layer: _Layer) -> None:
        self._slot, self._layer = slot, layer

    def remove(self) -> None:
        with _lock:
            slot = self._slot
            if self._layer not in slot.layers:
                return
            slot.layers.remove(self._layer)
            _render(slot)
            if not slot.layers:
                _slots.pop((id(slot.module), slot.name), None)


def _render(slot: _Slot) -> None:
    """Attribute = base, then every replacement (last wins), then every wrapper (last outermost)."""
    value = slot.base
    for layer in slot.layers:
        if layer.replace is not _NO_ATTR:
            value = layer.replace
    for layer in slot.layers:
        if layer.wrap is not None and value is not _NO_ATTR and callable(value):
            value = layer.wrap(value)
    if value is _NO_ATTR:
        if slot.name in slot.module.__dict__:
            delattr(slot.module, slot.name)
    else:
        setattr(slot.module, slot.name, value)


def patch_attribute(
    module: ModuleType, name: str, *, replace: Any = _NO_ATTR, wrap: Callable[[Any], Any] | None = None
) -> Patch:
    """Add a layer to ``module.name``: ``replace=value`` (beneath all wrappers) or ``wrap=factory``.

    A wrapper over an attribute that is absent or not callable is dormant until a replacement makes it
    callable. When the last layer goes, the attribute gets back the object (or absence) it had before the
    first layer came; a value written over a patched attribute by other code is discarded then.
    """
    if (replace is _NO_ATTR) == (wrap is None):
        raise ValueError("patch_attribute: give exactly one of replace= or wrap=")
    with _lock:
        key = (id(module), name)
        slot = _slots.get(key)
        if slot is None:
            slot = _slots[key] = _Slot(module, name, module.__dict__.get(name, _NO_ATTR))
        layer = _Layer(replace=replace, wrap=wrap)
        slot.layers.append(layer)
        try:
            _render(slot)
        except BaseException:
            Patch(slot, layer).remove()
            raise
        return Patch(slot, layer)


def original(module: ModuleType, name: str) -> Any:
    """What ``module.name`` is with every layer removed (``None`` if absent)."""
    with _lock:
        slot = _slots.get((id(module), name))
        value = slot.base if slot is not None else module.__dict__.get(name, _NO_ATTR)
    return None if value is _NO_ATTR else value
