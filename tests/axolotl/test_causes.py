"""Under axolotl, causes come first and in axolotl's keys: a backend named in ``foundry_attn_backend`` that cannot run
here is named as such (flash-attn is not installed) before any proof runs, strict or not, and every "Fix:" names
``foundry_attn_backend`` or ``foundry_attn_strict``, never LLM-Foundry's ``attn_path``/``attn_strict``. The plugin's
own hook on a real model, as axolotl calls it after loading."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

pytest.importorskip("axolotl", reason="needs axolotl (make test-axolotl installs it in .venv-axolotl)")

from tests.conftest import make_llama

#: LLM-Foundry's or attach's spelling, never axolotl's
FOREIGN = r"(?<!foundry_)attn_(path|strict|implementation):|attach\("
NO_FLASH = importlib.util.find_spec("flash_attn") is None or not torch.cuda.is_available()


def _load(strict: bool, backend: str = "flash_attention_2", model: torch.nn.Module | None = None) -> tuple:
    from axolotl.utils.dict import DictDefault

    from foundry_attn.integrations.axolotl.plugin import FoundryAttnPlugin

    model = make_llama("sdpa") if model is None else model
    plugin = FoundryAttnPlugin()
    cfg = DictDefault(attn_implementation="sdpa", foundry_attn_backend=backend, foundry_attn_strict=strict)
    plugin.post_model_load(cfg, model)
    return plugin, model


@pytest.mark.skipif(not NO_FLASH, reason="flash-attn runs here")
def test_strict_flash_attention_without_flash_attn_names_the_install_before_any_proof() -> None:
    from foundry_attn.path.state import path_of
    from foundry_attn.selection.policy import AttentionUnavailableError

    model = make_llama("sdpa")
    with pytest.raises(AttentionUnavailableError) as raised:
        _load(True, model=model)
    message = str(raised.value)
    assert message.startswith("foundry_attn_strict: flash_attention_2 cannot run on "), message
    assert re.search(r"check 'flash-attn (installed|import)' failed: flash-attn", message), message
    assert "Fix: pip install" in message and "; or set foundry_attn_strict: false to fall back along" in message
    assert "check 'proof'" not in message and not re.search(FOREIGN, message), message
    assert path_of(model) is None and model.config._attn_implementation == "sdpa"  # nothing attached, nothing proven


@pytest.mark.skipif(not NO_FLASH, reason="flash-attn runs here")
def test_without_strict_the_chain_from_the_named_backend_runs_and_says_why() -> None:
    from foundry_attn.selection.surfaces import AXOLOTL

    plugin, _ = _load(False)
    state = plugin.state
    assert state.backend == "sdpa" and state.path == "flat", state.reason
    assert state.decision.requested == "auto" and state.decision.candidates[0].name == "flash_attention_2"
    assert state.decision.reason.startswith("flash_attention_2: flash-attn"), state.decision.reason
    assert state.surface is AXOLOTL  # a later proof's refusal names axolotl's keys too


def test_a_backend_that_cannot_run_the_model_exactly_is_named_with_the_fix_in_axolotls_keys() -> None:
    """Gemma2's attention softcap under sdpa: strict, refused before any proof with the fix in axolotl's keys; not
    strict, the chain from sdpa on runs eager and says why."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from foundry_attn.selection.policy import AttentionUnavailableError

    def gemma2() -> torch.nn.Module:
        torch.manual_seed(0)
        shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=8)
        return Gemma2ForCausalLM(
            Gemma2Config(vocab_size=64, num_key_value_heads=2, attn_implementation="sdpa", **shape)
        )

    with pytest.raises(AttentionUnavailableError) as raised:
        _load(True, "sdpa", gemma2())
    message = str(raised.value)
    assert message.startswith("foundry_attn_strict: sdpa cannot run on "), message
    assert "check 'exactness' failed: sdpa cannot apply Gemma2ForCausalLM's attention logit softcap" in message
    assert "or set foundry_attn_strict: false" in message and not re.search(FOREIGN, message), message
    plugin, _ = _load(False, "sdpa", gemma2())
    assert plugin.state.backend == "eager" and plugin.state.decision.reason.startswith("sdpa: sdpa cannot apply")


def test_a_binding_flat_path_refused_later_says_foundry_attn_strict() -> None:
    from foundry_attn.path.proven import refuse
    from foundry_attn.path.state import FlatPathError

    plugin, model = _load(True, "sdpa")
    assert plugin.state.binding
    with pytest.raises(FlatPathError) as raised:
        refuse(plugin.state, model, "proof at batch 1 failed: documents differ")
    message = str(raised.value)
    assert message.startswith("the flat path (foundry_attn_strict: true) cannot run LlamaForCausalLM with sdpa")
    assert "Fix: set foundry_attn_strict: false (one document per row" in message and not re.search(FOREIGN, message)
