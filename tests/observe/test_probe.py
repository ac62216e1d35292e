"""The core ModelInspector probe (foundry_attn.observe.probe): layers and attention found across architectures
and wrappers, what each level sees, hooks gone afterwards. No Composer needed."""

from __future__ import annotations

import pytest
import torch

from foundry_attn.path.attach import attach


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
    from foundry_attn.flat.unwrap import find_hf_model
    from foundry_attn.observe.discovery import discover_modules
    from foundry_attn.observe.probe import ModelInspector

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
    from foundry_attn.observe.probe import BatchInfo, ModelInspector
    from foundry_attn.path.forward import forward_documents

    model = llama(impl)
    attach(model)
    batch = {"input_ids": torch.randint(1, 64, (2, 8)), "doc_lens": [[3, 5], [4]], "total_tokens": [8, 4]}
    with torch.no_grad(), ModelInspector(model).capture(BatchInfo.from_batch(batch)) as records:
        forward_documents(model, batch)
    attn = [r for r in records if r["level"] == "attention"]
    assert attn and all(r["mask"] == "none" and r["attn_implementation"] == impl for r in attn)
    assert records[0]["packed_positions"] and records[0]["position_restarts"] == 2


# ---- 4-D masks read as the model aligns them: stock eager / sdpa masks, sliding windows, 4.51 and 5.x ----------


def _stock(model_type: str, impl: str) -> torch.nn.Module:
    from foundry_attn.verify.zoo import build, tiny

    config, model_class = tiny(model_type)
    return build(config, model_class, impl).eval()


def _captured(model: torch.nn.Module, **inputs: torch.Tensor) -> list[dict]:
    from foundry_attn.observe.probe import ModelInspector

    with torch.no_grad(), ModelInspector(model).capture() as records:
        model(**inputs)
    assert not any("error" in r for r in records), records
    return [r for r in records if r["level"] in ("layer", "attention")]


def _sliding(model_type: str, record: dict) -> bool:
    """Where the stock model applies its sliding window: Mistral everywhere; Gemma2 on even layers (4.51: its
    attention modules only, the decoder layer gets the full causal mask and slides it for its attention)."""
    if model_type == "mistral":
        return True
    if model_type == "gemma2":
        import transformers

        layer_slides = int(transformers.__version__.split(".")[0]) >= 5
        return record["index"] % 2 == 0 and (record["level"] == "attention" or layer_slides)
    return False


STOCK = [("llama", "eager"), ("llama", "sdpa"), ("mistral", "eager"), ("mistral", "sdpa"), ("gemma2", "eager")]


@pytest.mark.parametrize(("model_type", "impl"), STOCK)
@pytest.mark.parametrize("mask", ["absent", "all ones", "right padding"])
def test_stock_masks_hide_padding_only_where_there_is_padding(model_type: str, impl: str, mask: str) -> None:
    """No false alarm on an unpadded batch (4.51 eager builds ``q x (q+1)`` masks without a 2-D mask), padding
    where there is padding, and the model's own sliding window named as a window, not as padding."""
    from foundry_attn.verify.zoo import WINDOW

    model = _stock(model_type, impl)
    ids = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids}
    if mask != "absent":
        inputs["attention_mask"] = torch.ones_like(ids)
        if mask == "right padding":
            inputs["attention_mask"][0, 6:] = 0
    records = _captured(model, **inputs)
    assert records
    padded = mask == "right padding"
    for r in records:
        if r["mask"] == "none":  # sdpa without padding: is_causal, nothing to read
            assert not padded and r["has_zeros"] is None and r["window"] is None
            continue
        assert r["mask"] == "4-D", r
        window = WINDOW if _sliding(model_type, r) else None
        hides = ["padding"] if padded else []
        hides += [f"window {window}"] if window else []
        assert (r["has_zeros"], r["window"], r["mask_hides"]) == (padded, window, ", ".join(hides) or "nothing"), r


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_a_decoding_step_with_a_cache_is_read_bottom_right(model_type: str) -> None:
    """One new token after a cached prefix: a ``1 x 9`` mask; the query is the last key (4.51 passes
    ``cache_position``, 5.x sizes the mask to the keys and passes the cache)."""
    from foundry_attn.verify.zoo import WINDOW

    model = _stock(model_type, "eager")
    model.config.use_cache = True
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    for padded in (False, True):
        mask = torch.ones_like(ids)
        if padded:
            mask[0, 5:8] = 0  # holes in the prefix of row 0 (the new token is real)
        with torch.no_grad():
            past = model(input_ids=ids[:, :8], attention_mask=mask[:, :8], use_cache=True).past_key_values
        records = _captured(model, input_ids=ids[:, 8:], attention_mask=mask, past_key_values=past, use_cache=True)
        attn = [r for r in records if r["level"] == "attention"]
        assert attn and all(r["mask"] == "4-D" and r["mask_shape"][-2] == 1 for r in attn)
        # 5.x keeps only the window's last keys in Mistral's sliding cache (a 1 x 4 mask): no window left to see
        (width,) = {r["mask_shape"][-1] for r in attn}
        assert width == 9 or (model_type == "mistral" and width == WINDOW)
        hides = ["padding"] if padded else []  # the holes at 5..7, inside the window of the query at 8
        hides += [f"window {WINDOW}"] if model_type == "mistral" and width > WINDOW else []
        expected = ", ".join(hides) or "nothing"
        assert {r["mask_hides"] for r in attn} == {expected}, attn


def test_packed_position_ids_are_documents_only_where_the_mask_keeps_them_apart() -> None:
    """Packed rows with no mask: 5.x eager builds a block-diagonal mask (documents), 4.51 a causal one (nothing
    hidden: the documents see each other)."""
    import importlib
    import importlib.util

    model = _stock("llama", "eager")
    ids = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7]])
    records = _captured(model, input_ids=ids, position_ids=positions)
    attn = [r for r in records if r["level"] == "attention"]
    masking = "transformers.masking_utils"  # 4.54+: find_packed_sequence_indices splits packed rows
    splits = importlib.util.find_spec(masking) is not None and hasattr(
        importlib.import_module(masking), "find_packed_sequence_indices"
    )
    assert {r["mask_hides"] for r in attn} == {"documents" if splits else "nothing"}
    assert all(r["has_zeros"] is splits and r["window"] is None and r["packed_positions"] for r in attn)


def test_describe_mask_reads_windows_documents_and_other_holes() -> None:
    """Hand-made 4-D masks (bool and additive float) cover what no stock tiny model builds here."""
    from foundry_attn.observe.probe import describe_mask

    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    docs = causal.clone()
    docs[3:, :3] = False  # two documents of 3
    window = causal & ~torch.ones(6, 6, dtype=torch.bool).tril(-3)  # each query sees its last 3
    hole = causal.clone()
    hole[5, 1] = False
    for allowed, hides, zeros, w in (
        (causal, "nothing", False, None),
        (docs, "documents", True, None),
        (window, "window 3", False, 3),
        (hole, "other keys", True, None),
    ):
        for mask in (allowed[None, None], torch.zeros(1, 1, 6, 6).masked_fill(~allowed, torch.finfo(torch.float).min)):
            info = describe_mask(mask)
            assert (info["mask_hides"], info["has_zeros"], info["window"]) == (hides, zeros, w)
    # a static cache (4.51): the mask is wider than the keys used; cache_position places the queries
    wide = torch.zeros(1, 1, 2, 16, dtype=torch.bool)
    wide[..., :5] = True
    wide[0, 0, 0, 4] = False
    assert describe_mask(wide, cache_position=torch.tensor([3, 4]))["mask_hides"] == "nothing"


# ---- the implementation that runs --------------------------------------------------------------------------


def test_attn_implementation_names_what_runs(llama) -> None:
    from foundry_attn.observe.discovery import attn_implementation, mpt_attn_impl

    assert attn_implementation(llama("sdpa")) == "sdpa" and attn_implementation(None) is None
    assert attn_implementation(torch.nn.Linear(2, 2)) == "unknown (class Linear)"
    dbrx = _stock("dbrx", "sdpa")  # its config has an attn_config too (an object, not MPT's dict)
    assert mpt_attn_impl(dbrx) is None and attn_implementation(dbrx) == "sdpa"
