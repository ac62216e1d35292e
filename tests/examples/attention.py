"""What the examples of ``foundry_attn/attention/`` use: one attention layer of the tiny Llama and the ``q``, ``k``,
``v`` of a flat row of 40 tokens as that layer hands them to its attention function (4 query heads over 2 KV heads).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.examples.common import tiny_llama

#: the flat row: one row, 40 tokens, head dim 16
ROW, HEAD_DIM = 40, 16


@functools.cache
def _layer() -> torch.nn.Module:
    """The tiny Llama's first attention layer (read only by the examples: its class name, ``is_causal``,
    ``training``, its parameters' dtype)."""
    return tiny_llama().model.layers[0].self_attn


def layer(tmp: Path) -> torch.nn.Module:
    """The first ``LlamaAttention`` of the tiny Llama (fp32, eval mode)."""
    return _layer()


def _heads(count: int, seed: int) -> torch.Tensor:
    return torch.randn(1, count, ROW, HEAD_DIM, generator=torch.Generator().manual_seed(seed))


NAMES: dict[str, Callable[[Path], Any]] = {
    "layer": layer,
    "q": lambda tmp: _heads(4, 1),  # [1, 4, 40, 16]
    "k": lambda tmp: _heads(2, 2),  # [1, 2, 40, 16]
    "v": lambda tmp: _heads(2, 3),  # [1, 2, 40, 16]
}
