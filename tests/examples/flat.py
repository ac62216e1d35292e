"""The names the examples of ``foundry_attn/flat/`` use: the batch's labels and layout, a flat row's inputs, a
document, a model's shape, and a tiny Llama that nothing attached."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.examples.common import attached, tiny_llama


@functools.cache
def _read_only_llama() -> torch.nn.Module:
    """A tiny Llama that examples only read (its config, dtype and parameters), made once."""
    return tiny_llama()


def labels(tmp: Path) -> torch.Tensor:
    """``[2, 8]`` labels: the tokens of ``ids``."""
    return torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def layout(tmp: Path) -> Any:
    """The layout of a ``[2, 8]`` batch of documents ``[[3, 4], [5]]``."""
    from foundry_attn.flat.layout import Layout

    return Layout(((3, 4), (5,)), 8)


def inputs(tmp: Path) -> dict[str, Any]:
    """A flat row's keywords (:func:`~foundry_attn.flat.inputs.flat_inputs`) with labels: 41 tokens, two documents
    of 28 and 13."""
    from foundry_attn.flat.inputs import flat_inputs
    from foundry_attn.flat.layout import Layout

    ids = torch.randint(3, 64, (1, 41), generator=torch.Generator().manual_seed(0))
    return flat_inputs(_read_only_llama(), ids, ids.clone(), Layout(((28, 13),), 41))[0]


def doc(tmp: Path) -> torch.Tensor:
    """One document's ``[23]`` token ids."""
    return torch.randint(3, 64, (23,), generator=torch.Generator().manual_seed(1))


@functools.cache
def _shape() -> Any:
    """The tiny Llama's :class:`~foundry_attn.flat.layout_cost.ModelShape` (frozen: one for every block)."""
    from foundry_attn.flat.layout_cost import ModelShape

    return ModelShape.of(_read_only_llama())


NAMES: dict[str, Callable[[Path], Any]] = {
    "hf": attached,  # the same factory as hf_model: one model where a block names both
    "stock_model": lambda tmp: tiny_llama(),
    "labels": labels,
    "layout": layout,
    "inputs": inputs,
    "doc": doc,
    "shape": lambda tmp: _shape(),
}
