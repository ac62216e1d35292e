"""The registered model builds and trains, exactly, every family stock ``hf_causal_lm`` trains: flat where the proof
holds, one document per row where it does not (layers that drop ``**kwargs``, attention that rejects our argument,
MoE router losses, state outside attention)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from foundry_attn.path.state import FlatPathError
from foundry_attn.verify import conformance, zoo
from tests.conftest import leaky_attention

pytestmark = pytest.mark.foundry


def _model_dir(tmp_path: Path, model_type: str, **overrides: object) -> str:
    config, _ = zoo.tiny(model_type)
    for key, value in overrides.items():
        setattr(config, key, value)
    folder = tmp_path / model_type
    config.save_pretrained(folder)
    return str(folder)


def _build(path: str, tmp_path: Path, **kwargs: object):
    from foundry_attn.integrations.llm_foundry.model import FoundryAttnCausalLM

    return FoundryAttnCausalLM(
        tokenizer=None, pretrained_model_name_or_path=path, pretrained=False, events_dir=str(tmp_path / "ev"), **kwargs
    )


def _stock_rows_loss(hf: torch.nn.Module, rows_name: str, docs: list[torch.Tensor]) -> float:
    """Stock, one document per row, right-padded, a 2-D mask: the truth (router statistics over real tokens)."""
    stock = copy.deepcopy(hf)
    del stock.foundry_path
    stock.config._attn_implementation = rows_name
    with torch.no_grad():
        return stock(**conformance.rows_inputs(docs), use_cache=False).loss.item()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model_type", "overrides", "path"),
    [
        ("llama", {}, "flat"),
        ("qwen3_moe", {"output_router_logits": True}, "rows"),  # its layers call attention without **kwargs
        ("bamba", {}, "rows"),  # the same, and a Mamba mixer carries state along the row
        ("bloom", {}, "rows"),  # eager-only, rejects an unknown keyword
        ("mixtral", {"output_router_logits": True}, "flat"),  # the router loss reads a [batch, seq] mask
        ("olmoe", {"output_router_logits": True}, None),
    ],
)
def test_auto_trains_what_stock_trains(tmp_path: Path, model_type: str, overrides: dict, path: str | None) -> None:
    model = _build(_model_dir(tmp_path, model_type, **overrides), tmp_path)
    decision = model.attn_decision
    assert decision.path in ("flat", "rows") and decision.path_reason
    if path is not None:
        assert decision.path == path, decision.path_reason
    docs = conformance.sample_documents()
    batch = conformance.collated(docs, "pack")
    want = _stock_rows_loss(model.model, model.model.foundry_path.rows_name, docs)
    loss = model.loss(model(batch), batch)
    loss.backward()
    assert abs(loss.item() - want) <= conformance.LOSS_TOL, (model_type, decision.path, decision.path_reason)
    assert model.attn_decision.as_dict()["path"] == model.model.foundry_path.path


@pytest.mark.slow
def test_flat_insisted_on_names_the_layer_that_dropped_the_documents(tmp_path: Path) -> None:
    match = r"check 'proof' failed: .*did not reach Qwen3MoeAttention.*the caller is Qwen3MoeDecoderLayer"
    match = r"^the flat path \(attn_path: flat\) cannot run .*" + match + r".*Fix: set attn_path: auto"  # YAML keys
    with pytest.raises(FlatPathError, match=match):
        _build(_model_dir(tmp_path, "qwen3_moe"), tmp_path, attn_path="flat", attn_strict=True)


def test_an_unknown_path_lists_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="attn_path: unknown value 'flatt'; valid values: auto, flat, rows"):
        _build(_model_dir(tmp_path, "llama"), tmp_path, attn_path="flatt")


def test_a_leak_after_the_build_moves_the_registered_model_to_rows(tmp_path: Path) -> None:
    """A library that patches attention after the build (here: our dispatch entry) is caught by the proof on the
    first training batch, before that batch trains: the decision, its event and the path say rows, and why."""
    from transformers.modeling_utils import AttentionInterface

    from tests.conftest import read_events

    model = _build(_model_dir(tmp_path, "llama"), tmp_path, attn_implementation="sdpa")
    assert model.attn_decision.path == "flat"

    leaky = leaky_attention()  # takes the documents, ignores them: plain causal attention over the whole row
    genuine = AttentionInterface._global_mapping["foundry_sdpa"]
    AttentionInterface._global_mapping["foundry_sdpa"] = leaky
    try:
        docs = conformance.sample_documents()
        batch = conformance.collated(docs, "pack")
        want = _stock_rows_loss(model.model, "sdpa", docs)
        loss = model.loss(model(batch), batch)
    finally:
        AttentionInterface._global_mapping["foundry_sdpa"] = genuine
    assert abs(loss.item() - want) <= conformance.LOSS_TOL
    decision = model.attn_decision
    assert decision.path == "rows" and "proof at batch 1 (the first training batch) failed" in decision.path_reason
    model.attn_events.bind(str(tmp_path / "ev"))
    events = read_events(tmp_path / "ev", "attn_impl")
    assert events[-1]["at"] == "path" and events[-1]["path"] == "rows", events


def test_fa2_on_the_reference_kernel_is_refused_where_the_class_calls_flash_attn_itself(tmp_path: Path) -> None:
    """GPT-J (4.51) builds its FA2 attention class at construction and that class calls flash-attn itself: the
    reference kernel cannot stand in, so strict FA2 is refused in the standard format (not transformers' raw load
    error); a class without sdpa loads our backends transformers does not know under eager."""
    from foundry_attn.attention.backends import load_name
    from foundry_attn.selection.policy import AttentionUnavailableError

    _, model_class = zoo.tiny("gptj")
    if getattr(model_class, "_supports_sdpa", False):
        pytest.skip("GPT-J declares sdpa on this stack")
    assert load_name("torch_varlen", model_class=model_class) == "eager"
    assert load_name("flash_attention_2", True, model_class) == "eager"
    with pytest.raises(
        AttentionUnavailableError,
        match=r"check 'model class' failed: GPTJForCausalLM builds its flash-attention class at construction.*Fix: ",
    ):
        _build(
            _model_dir(tmp_path, "gptj"),
            tmp_path,
            attn_implementation="flash_attention_2",
            attn_strict=True,
            fa2_reference_kernel=True,
        )
