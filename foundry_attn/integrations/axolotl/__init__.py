"""axolotl: foundry_attn as an axolotl plugin, one line of YAML (docs/axolotl.md); axolotl is imported only when it
loads the plugin (:class:`~foundry_attn.integrations.axolotl.plugin.FoundryAttnPlugin`, keys: :mod:`.args`).
"""

from __future__ import annotations

import importlib
from typing import Any

#: each public name and the module that owns it (imported on first use: the plugin module imports axolotl)
_PUBLIC = {
    "FoundryAttnPlugin": "foundry_attn.integrations.axolotl.plugin",
    "FoundryAttnArgs": "foundry_attn.integrations.axolotl.args",
}
__all__ = ["FoundryAttnArgs", "FoundryAttnPlugin"]


def __getattr__(name: str) -> Any:
    """``FoundryAttnPlugin`` and ``FoundryAttnArgs``, imported on first use; any other name is an AttributeError that
    lists the valid ones (axolotl's ``plugins:`` entry then fails the run instead of being skipped)."""
    if name not in _PUBLIC:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"foundry_attn.integrations.axolotl has no {name!r}; the axolotl plugin is "
            "'foundry_attn.integrations.axolotl.FoundryAttnPlugin' (valid names: " + ", ".join(__all__) + ")"
        )
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
