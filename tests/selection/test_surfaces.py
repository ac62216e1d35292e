"""Every "Fix:" names the key of the surface the user is on: ``attach``'s keywords, LLM-Foundry's YAML, axolotl's
YAML (:mod:`foundry_attn.selection.surfaces`); the path's state keeps the surface of its attach for the errors of
later proofs."""

from __future__ import annotations

import re

import pytest

from foundry_attn.selection.surfaces import ATTACH, AXOLOTL, LLM_FOUNDRY, Surface, speaking, spoken
from tests.conftest import make_llama

#: what each surface says for the fixes the messages give
FIXES = {
    ATTACH: (
        'path="flat"',
        'pass path="auto" to attach',
        "pass strict=False to attach",
        'call attach(model, "auto")',
        'call attach(model, backend) with one of "sdpa", "eager"',
    ),
    LLM_FOUNDRY: (
        "attn_path: flat",
        "set attn_path: auto",
        "set attn_strict: false",
        "set attn_implementation: auto",
        "set attn_implementation to one of sdpa, eager",
    ),
    AXOLOTL: (
        "foundry_attn_strict: true",
        "set foundry_attn_strict: false",
        "set foundry_attn_strict: false",
        "set foundry_attn_backend: auto",
        "set foundry_attn_backend to one of sdpa, eager",
    ),
}
#: a key of another surface, never named under this one
FOREIGN = {
    ATTACH: r"attn_path|attn_strict|attn_implementation|foundry_attn_",
    LLM_FOUNDRY: r"foundry_attn_|attach\(",
    AXOLOTL: r"(?<!foundry_)attn_(path|strict|implementation)|attach\(",
}


@pytest.mark.parametrize("surface", list(FIXES), ids=lambda s: s.name)
def test_each_surface_spells_the_fixes_in_its_own_keys(surface: Surface) -> None:
    got = (
        surface.setting("path", "flat"),
        surface.fix("path", "auto"),
        surface.fix("strict", False),
        surface.fix("backend", "auto"),
        surface.fix_choice("backend", ["sdpa", "eager"]),
    )
    assert got == FIXES[surface]
    assert spoken() is ATTACH  # the default: attach's keywords
    with speaking(surface):
        assert spoken() is surface
    assert spoken() is ATTACH


@pytest.mark.parametrize("surface", list(FIXES), ids=lambda s: s.name)
def test_a_binding_flat_path_refused_later_names_the_keys_of_its_attach(surface: Surface) -> None:
    """The refusal of a proof on a later batch (outside the caller's block) names the keys the model was attached
    with: the state keeps them."""
    from foundry_attn import attach
    from foundry_attn.path.proven import refuse
    from foundry_attn.path.state import FlatPathError

    model = make_llama("sdpa")
    with speaking(surface):
        state = attach(model, "sdpa", path="flat", strict=True)
    assert state.binding and state.surface is surface
    with pytest.raises(FlatPathError) as raised:
        refuse(state, model, "a reason")
    message = str(raised.value)
    path, fix = FIXES[surface][:2]
    assert f"the flat path ({path}) cannot run LlamaForCausalLM with sdpa: check 'proof' failed: a reason" in message
    assert f"Fix: {fix} (one document per row where flat is not exact)" in message
    assert not re.search(FOREIGN[surface], message.replace(path, "").replace(fix, "")), message


@pytest.mark.parametrize("surface", list(FIXES), ids=lambda s: s.name)
def test_a_backend_that_cannot_run_the_model_names_the_backend_key(surface: Surface) -> None:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from foundry_attn.selection.backend_checks import model_refusal
    from foundry_attn.selection.traits import ModelTraits

    traits = ModelTraits.from_model_class(Gemma2ForCausalLM, Gemma2Config())
    with speaking(surface):
        message = model_refusal(traits, "sdpa")
    # 4.51: Gemma2's softcap under sdpa; 5.x: Gemma2 declares no sdpa support at all
    assert message is not None and re.search("check '(exactness|model class)' failed", message), message
    key = {ATTACH: "attach", LLM_FOUNDRY: "attn_implementation", AXOLOTL: "foundry_attn_backend"}[surface]
    assert message.startswith(f"{key}: sdpa cannot run Gemma2ForCausalLM exactly"), message
    fix = message.split("Fix: ", 1)[1]
    assert fix.startswith(FIXES[surface][4].split(" one of")[0]), fix
