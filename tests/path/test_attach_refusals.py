"""``attach`` applies the policy's model checks before it points anything: a pair that neither path runs exactly
(a backend the class does not declare, a softcap under sdpa, ALiBi under FA2) is refused with the policy's words and
the backends that do run the model, as stock refuses it at load; the registered model's policy refuses the same."""

from __future__ import annotations

import pytest
import torch

from foundry_attn.path.attach import attach
from foundry_attn.selection.decision import decide
from foundry_attn.selection.policy import AttentionUnavailableError
from foundry_attn.verify import conformance, zoo

#: classes without sdpa on one stack or the other (stock refuses sdpa for them at load)
NO_SDPA = ("gptj", "bloom", "mpt", "xglm", "gpt_oss")


def _no_sdpa_type() -> str:
    for model_type in NO_SDPA:
        if model_type in zoo.model_types() and not zoo.tiny(model_type)[1]._supports_sdpa:
            return model_type
    pytest.skip(f"every one of {NO_SDPA} declares sdpa here")


def test_a_backend_the_class_does_not_declare_is_refused_with_those_that_run_it() -> None:
    model_type = _no_sdpa_type()
    config, model_class = zoo.tiny(model_type)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = model_class(config)
    with pytest.raises(
        AttentionUnavailableError, match=r"check 'model class' failed: \w+ has no sdpa support.*\"eager\""
    ):
        attach(model, "sdpa")
    assert model.config._attn_implementation == "eager" and not hasattr(model, "foundry_path")  # nothing pointed


def test_a_softcap_under_sdpa_is_refused_by_attach_as_by_the_policy() -> None:
    model = conformance.build("gemma2", "eager")
    with pytest.raises(AttentionUnavailableError) as caught:
        attach(model, "sdpa")
    assert "softcap" in str(caught.value) or "has no sdpa support" in str(caught.value)
    assert '"eager"' in str(caught.value)


def _falcon_alibi():
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        alibi=True,
        new_decoder_architecture=False,
    )
    config._attn_implementation = "eager"
    return FalconForCausalLM(config), config


def test_falcon_alibi_under_fa2_is_refused_by_attach_and_by_the_policy() -> None:
    model, config = _falcon_alibi()
    with pytest.raises(AttentionUnavailableError, match="ALiBi position bias"):
        attach(model, "flash_attention_2", fa2_reference=True)
    with pytest.raises(AttentionUnavailableError, match="ALiBi position bias"):
        decide(None, "flash_attention_2", ("flash_attention_2",), strict=True, config=config, fa2_reference=True)
    decision = decide(None, "auto", config=config, fa2_reference=True)  # auto: the chain moves on
    assert decision.chosen in ("sdpa", "eager") and "ALiBi" in decision.candidates[0].reason


def _config_refusing_flash() -> tuple[object, type]:
    """A Llama config whose ``_attn_implementation`` setter refuses flash attention, as 5.x HRM-text's does with
    ``prefix_lm`` (FlashAttention cannot represent its mask)."""
    config, model_class = zoo.tiny("llama")
    base = type(config)

    class PrefixConfig(base):  # type: ignore[valid-type,misc]
        @property
        def _attn_implementation(self) -> str | None:
            return base._attn_implementation.fget(self)

        @_attn_implementation.setter
        def _attn_implementation(self, value: str | None) -> None:
            if value is not None and "flash" in value:
                raise ValueError(f"attn_implementation={value!r} cannot represent this model's mask")
            base._attn_implementation.fset(self, value)

    return PrefixConfig(**config.to_dict()), model_class


def test_a_backend_the_config_refuses_is_refused_by_attach_and_the_policy() -> None:
    config, model_class = _config_refusing_flash()
    config._attn_implementation = "eager"  # type: ignore[attr-defined]
    torch.manual_seed(0)
    model = model_class(config)
    with pytest.raises(AttentionUnavailableError, match=r"check 'model config' failed: its config refuses flash"):
        attach(model, "flash_attention_2", fa2_reference=True)
    assert not hasattr(model, "foundry_path")
    decision = decide(
        None,
        "auto",
        ("flash_attention_2", "sdpa"),
        config=config,
        model_class=model_class,
        fa2_reference=True,
        compute_dtype="fp32",
    )
    assert decision.chosen == "sdpa" and "cannot represent this model's mask" in decision.candidates[0].reason
    assert attach(model, "sdpa").path == "flat"
