"""The core ModelInspector probe (foundry_attn.inspection): layers and attention found across architectures
and wrappers, what each level sees, hooks gone afterwards. No Composer needed."""

from __future__ import annotations

import pytest
import torch

from foundry_attn.paths import attach


def _tiny(arch: str) -> torch.nn.Module:
    import transformers as tf

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    cfg = {
        "llama": lambda: tf.LlamaConfig(**common, num_key_value_heads=2),
        "mistral": lambda: tf.MistralConfig(**common, num_key_value_heads=2, sliding_window=None),
        "qwen2": lambda: tf.Qwen2Config(**common, num_key_value_heads=2),
        "gpt_neox": lambda: tf.GPTNeoXConfig(**common),
    }[arch]()
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg).eval()


class _DDPLike(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "gpt_neox"])
def test_inspector_finds_layers_and_attention_generically(arch: str) -> None:
    from foundry_attn.inspection import ModelInspector, discover_modules, find_hf_model

    model = _tiny(arch)
    name, hf = find_hf_model(_DDPLike(model))
    assert hf is model and name == ""
    mods = discover_modules(model)
    assert len(mods.layers) == 2 and len(mods.attention) == 2
    assert all(not n.startswith("module.") for n, _ in mods.layers + mods.attention)
    assert all("Attention" in type(m).__name__ for _, m in mods.attention)
    ids = torch.randint(1, 64, (2, 8))
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    with torch.no_grad(), ModelInspector(model).capture() as records:
        model(input_ids=ids, attention_mask=mask)
    assert [r["level"] for r in records].count("attention") == 2
    attn = [r for r in records if r["level"] == "attention"]
    assert all(r["mask"] == "4-D" and r["has_zeros"] and r["attn_implementation"] == "eager" for r in attn)
    model_rec = records[0]
    assert model_rec["level"] == "model" and model_rec["real_tokens"] == 14 and model_rec["fill_ratio"] == 14 / 16
    assert not model._forward_pre_hooks and not model._forward_hooks


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_inspector_sees_the_flat_row(llama, impl: str) -> None:
    """Unpadded once: one flat row of real tokens, no mask, one restart per document boundary."""
    from foundry_attn.forward import forward_documents
    from foundry_attn.inspection import BatchInfo, ModelInspector

    model = llama(impl)
    attach(model)
    batch = {"input_ids": torch.randint(1, 64, (2, 8)), "doc_lens": [[3, 5], [4]], "total_tokens": [8, 4]}
    with torch.no_grad(), ModelInspector(model).capture(BatchInfo.from_batch(batch)) as records:
        forward_documents(model, batch)
    attn = [r for r in records if r["level"] == "attention"]
    assert attn and all(r["mask"] == "none" and r["attn_implementation"] == impl for r in attn)
    assert records[0]["packed_positions"] and records[0]["position_restarts"] == 2
