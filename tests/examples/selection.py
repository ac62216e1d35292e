"""What the examples of ``foundry_attn/selection/`` use: the probe, the backend names, two GPUs described by hand
(a Tesla T4 and an A100 with flash-attn 2.6.3, as ``tests/selection/test_policy.py`` builds them), a Llama's traits,
a decision that chose FA2 on that A100, and a saved Llama config to decide from.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from foundry_attn.attention.backends import EAGER, FA2, SDPA
from foundry_attn.selection.capability import Capability, probe
from foundry_attn.selection.policy import AUTO, Decision, choose
from foundry_attn.selection.traits import ModelTraits


def gpu(name: str, cc: tuple[int, int], host: str) -> Capability:
    """A CUDA device described by hand: torch 2.7, transformers 4.51.3, flash-attn 2.6.3 importable."""
    return Capability(
        cuda=True,
        device_name=name,
        compute_capability=cc,
        torch_version="2.7.0+cu126",
        transformers_version="4.51.3",
        flash_attn_version="2.6.3",
        flash_attn_error=None,
        transformer_engine_version=None,
        host=host,
    )


def t4_capability(tmp: Path) -> Capability:
    """A Tesla T4 (sm75) on ``node-3``."""
    return gpu("Tesla T4", (7, 5), "node-3")


def a100_capability(tmp: Path) -> Capability:
    """An A100 (sm80) on ``node-1``."""
    return gpu("NVIDIA A100-SXM4-80GB", (8, 0), "node-1")


def traits(tmp: Path) -> ModelTraits:
    """A ``LlamaForCausalLM`` of the default ``LlamaConfig`` (head dim 128, every backend)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return ModelTraits.from_model_class(LlamaForCausalLM, LlamaConfig())


def decision(tmp: Path) -> Decision:
    """``auto`` on the A100 in bf16, the smoke test skipped: FA2 chosen."""
    return choose(AUTO, cap=a100_capability(tmp), dtype=torch.bfloat16, smoke_test=None)


def llama_path(tmp: Path) -> str:
    """A local Llama checkpoint's directory: its ``config.json`` (the default ``LlamaConfig``), no weights."""
    from transformers import LlamaConfig

    path = tmp / "llama"
    LlamaConfig().save_pretrained(path)
    return str(path)


NAMES: dict[str, Callable[[Path], Any]] = {
    "probe": lambda tmp: probe,
    "FA2": lambda tmp: FA2,
    "SDPA": lambda tmp: SDPA,
    "EAGER": lambda tmp: EAGER,
    "t4_capability": t4_capability,
    "a100_capability": a100_capability,
    "traits": traits,
    "decision": decision,
    "llama_path": llama_path,
}
