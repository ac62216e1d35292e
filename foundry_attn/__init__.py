"""foundry_attn: attention fallback, padding-aware packing and attention inspection for LLM-Foundry and transformers.

The public API, for a transformers user (LLM-Foundry users name our registered components in YAML instead)::

    from foundry_attn import PaddingCollator, attach, forward_documents, install

    attach(model, "sdpa")                                  # prove the flat path: packed documents never mix
    batch = PaddingCollator(pad_id=0, eos_id=2, max_seq_len=2048, mode="pack")(examples)
    out = forward_documents(model, batch)                  # out.loss: each document as if alone
    install(trainer)                                       # transformers' Trainer / TRL: what attention did

The folders, by job, each importing only the ones before it (``tests/test_layers.py`` holds the rule): ``attention``
(our attention functions and the documents they take), ``selection`` (which backend runs here), ``flat`` (the flat row:
a batch read and laid out), ``proof`` (does a layout train each document as alone), ``path`` (flat or rows: attach, the
plan per batch, the forward), ``observe`` (what attention did: probe, verdict, events), ``verify`` (conformance matrix,
zoo, sweeps), ``integrations`` (LLM-Foundry, Composer, the Trainer: the only code importing them); ``bench`` and ``cli``
are the tools, ``patching`` and ``checks`` the helpers all share. ``guard`` runs at every interpreter start
(``foundry_attn_guard.pth``), so this file imports nothing until a name is asked for (PEP 562).
"""

TYPE_CHECKING = False  # typing is not imported at interpreter start (the guard's cost: bench guard)
if TYPE_CHECKING:
    from typing import Any

__version__ = "0.1.0"

#: each public name and the module that owns it
_PUBLIC = {
    "attach": "foundry_attn.path.attach",
    "forward_documents": "foundry_attn.path.forward",
    "PaddingCollator": "foundry_attn.flat.packing",
    "install": "foundry_attn.integrations.hf_trainer",
}
__all__ = ["PaddingCollator", "__version__", "attach", "forward_documents", "install"]


def __getattr__(name: str) -> "Any":
    """Import a public name's module on first use: ``import foundry_attn`` stays free."""
    if name not in _PUBLIC:
        raise AttributeError(f"module 'foundry_attn' has no attribute {name!r}; public names: {', '.join(__all__)}")
    import importlib

    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
