"""From a model folder to a decision: class traits, compute dtype and transformers' own load checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from foundry_attn.selection.capability import probe
from foundry_attn.selection.decision import decide, model_class_for, resolve_compute_dtype, transformers_load_check


def test_transformers_load_check_catches_its_own_errors() -> None:
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1)
    assert transformers_load_check(LlamaForCausalLM, config, "sdpa", torch.float32) is None
    assert transformers_load_check(LlamaForCausalLM, config, "eager", torch.float32) is None
    error = transformers_load_check(LlamaForCausalLM, config, "flash_attention_2", torch.bfloat16)
    assert error and "transformers refused it at load" in error  # 4.51 names flash_attn, 5.x FlashAttention2
    assert "flash_attn" in error or "FlashAttention2" in error

    class NoFlash(LlamaForCausalLM):
        _supports_flash_attn_2 = _supports_flash_attn = False  # the 4.51 name, and the 4.54+/5.x one

    assert "does not support Flash Attention" in transformers_load_check(
        NoFlash, config, "flash_attention_2", torch.bfloat16
    )


def test_compute_dtype_on_cpu_and_bad_names() -> None:
    cap = probe("cpu")  # the CPU, also on a CUDA box
    assert resolve_compute_dtype("auto", cap) == torch.float32
    if torch.cuda.is_available():  # the GPU itself computes attention in half precision
        half = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        assert resolve_compute_dtype("auto", probe()) == half
    assert resolve_compute_dtype("bf16", cap) == torch.bfloat16
    with pytest.raises(ValueError, match="valid values: auto, bf16, fp16, fp32"):
        resolve_compute_dtype("float8", cap)


def test_decide_reads_the_model_folder(assets: Path) -> None:
    decision = decide(str(assets / "tiny-llama"), config_overrides={"head_dim": 512})
    assert decision.chosen == "sdpa"
    assert model_class_for(LlamaConfig()) is LlamaForCausalLM
    smol = decide(str(assets / "smollm2-135m"), "flash_attention_2")
    cap = probe()
    if cap.flash_attn_version is None:  # this CPU box, or a GPU box without flash-attn: sdpa, and why
        assert (smol.requested, smol.chosen, smol.candidates[0].check) == (
            "flash_attention_2",
            "sdpa",
            "flash-attn installed",
        )
    elif cap.compute_capability >= (8, 0):  # a GPU box with flash-attn, Ampere or newer
        assert (smol.requested, smol.chosen) == ("flash_attention_2", "flash_attention_2"), smol.reason
    else:
        assert (smol.chosen, smol.candidates[0].check) == ("sdpa", "compute capability")


def test_reference_kernel_is_explicit_and_strict_accepts_it(assets: Path) -> None:
    decision = decide(str(assets / "tiny-llama"), "flash_attention_2", strict=True, fa2_reference=True)
    assert decision.chosen == "flash_attention_2" and "not flash-attn" in decision.reason
    cpu = probe("cpu")  # where FA2 could only run on the reference kernel (the CPU, also on a CUDA box)
    assert decide(str(assets / "tiny-llama"), cap=cpu).chosen == "sdpa"  # never chosen without the opt-in
