"""What every folder's examples may use: torch, a tiny attached Llama and a packed batch of two rows."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def tiny_llama(impl: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    """A tiny random Llama in fp32, eval mode: 2 layers, hidden 32, 4 heads (2 KV heads), a vocabulary of 64."""
    from tests.conftest import make_llama

    return make_llama(impl, seed)


@functools.lru_cache(maxsize=1)
def attached(tmp: Path) -> torch.nn.Module:
    """The tiny Llama attached on sdpa: its flat path proven; one per block (``tmp``), so every name and factory of
    a block that reads it reads the same model."""
    from foundry_attn.path.attach import attach

    hf = tiny_llama()
    attach(hf, "sdpa")
    return hf


def state(tmp: Path) -> Any:
    """The :class:`~foundry_attn.path.state.PathState` of the block's attached model."""
    from foundry_attn.path.state import path_of

    return path_of(attached(tmp))


def ids(tmp: Path) -> torch.Tensor:
    """``[2, 8]`` token ids."""
    return torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def batch(tmp: Path) -> dict[str, Any]:
    """Packed rows of documents ``[[20, 30], [40]]``, width 64, with labels."""
    packed = torch.randint(3, 64, (2, 64), generator=torch.Generator().manual_seed(0))
    return {"input_ids": packed, "labels": packed.clone(), "doc_lens": [[20, 30], [40]]}


NAMES: dict[str, Callable[[Path], Any]] = {
    "torch": lambda tmp: torch,
    "hf_model": attached,
    "model": attached,
    "llama_model": attached,
    "state": state,
    "ids": ids,
    "batch": batch,
}
