"""What the examples of ``foundry_attn/path/`` read: the tiny Llama attached on sdpa (one per block, so ``model``,
``hf_model`` and ``state`` are one model's), its flat row's inputs, a batch's layout, the model's compiled regions.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.examples import common

attached = common.attached  # one per block


def layout(tmp: Path) -> Any:
    """The :class:`~foundry_attn.flat.layout.Layout` of ``common.batch``: documents ``[[20, 30], [40]]``."""
    from foundry_attn.flat.layout import Layout

    return Layout.from_batch(common.batch(tmp))


def inputs(tmp: Path) -> dict[str, Any]:
    """The attached model's flat row for ``common.batch``: 90 real tokens, the documents under ``DOCS_KEY``."""
    from foundry_attn.flat.inputs import flat_inputs

    packed = common.batch(tmp)
    return flat_inputs(attached(tmp), packed["input_ids"], packed["labels"], layout(tmp))[0]


def regions(tmp: Path) -> Any:
    """The attached model's decoder layers, compiled by Dynamo's ``eager`` backend (traced, no code generated)."""
    from foundry_attn.path.regions import Regions

    return Regions.of(attached(tmp), "eager", None)


def docs_key(tmp: Path) -> str:
    """Where the flat row's inputs hold its documents."""
    from foundry_attn.attention.documents import DOCS_KEY

    return DOCS_KEY


NAMES: dict[str, Callable[[Path], Any]] = {
    "model": attached,
    "hf_model": attached,
    "llama_model": attached,
    "llama": lambda tmp: common.tiny_llama(),
    "layout": layout,
    "inputs": inputs,
    "regions": regions,
    "DOCS_KEY": docs_key,
}
