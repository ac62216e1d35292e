"""axolotl: foundry_attn as an axolotl plugin, one line of YAML (docs/axolotl.md).

    plugins:
      - foundry_attn.integrations.axolotl.FoundryAttnPlugin
    foundry_attn_backend: auto        # or sdpa, eager, flash_attention_2, ...; default: axolotl's attn_implementation
    foundry_attn_strict: false        # true: a backend or a flat path that cannot be proven stops the run
    foundry_attn_proof_interval: 100  # re-prove every N training batches (0: first batch and changes only)
    foundry_attn_events_dir: null     # default <output_dir>/attn_events

The plugin (:class:`~foundry_attn.integrations.axolotl.plugin.FoundryAttnPlugin`) refuses at the start the settings
that cannot train each document as alone, attaches the model after axolotl loaded it (LoRA included), reads
axolotl's packed batches as they are (:mod:`.batches`) and gives the Trainer the callbacks
(:mod:`foundry_attn.integrations.hf_trainer`). Its YAML keys are :class:`~.args.FoundryAttnArgs`. axolotl is imported
only when axolotl loads the plugin: ``import foundry_attn`` works without it. A misspelled class name here fails the
run with the valid names (axolotl skips only plugins whose module does not import).
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
    lists the valid ones (axolotl's ``plugins:`` entry then fails the run instead of being skipped).

    Example::

        >>> from foundry_attn.integrations import axolotl
        >>> axolotl.FoundryAttnPlugin     # what the YAML's plugins: line loads
        <class 'foundry_attn.integrations.axolotl.plugin.FoundryAttnPlugin'>
    """
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
