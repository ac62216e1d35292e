"""The mixed pool for a core user: ``attach(model, "auto")`` walks the same chain as the LLM-Foundry builder, and a
backend that cannot run the model here is refused at attach, never at the first step. On both stacks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from foundry_attn import attach
from foundry_attn.flat.packing import PaddingCollator
from foundry_attn.path.attach import attach_decision
from foundry_attn.path.forward import forward_documents
from foundry_attn.selection.policy import AttentionUnavailableError
from tests.conftest import make_llama

LENGTHS = (13, 9, 17)


def _loss_alone(stock: torch.nn.Module, docs: list[torch.Tensor]) -> torch.Tensor:
    total = sum(F.cross_entropy(stock(input_ids=d[None]).logits[0, :-1], d[1:], reduction="sum") for d in docs)
    return total / sum(d.numel() - 1 for d in docs)


def test_auto_picks_a_backend_that_runs_here_says_why_not_fa2_and_trains_exactly() -> None:
    model = make_llama("sdpa").train()
    stock = copy.deepcopy(model)
    state = attach(model, "auto")
    decision = state.decision
    assert decision is not None and decision.requested == "auto" and decision.chosen == state.backend
    assert state.backend in ("sdpa", "eager") and state.path == "flat", state.reason
    first = decision.candidates[0]
    assert first.name == "flash_attention_2" and not first.available and first.reason in decision.reason
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 60, (n,), generator=gen) for n in LENGTHS]
    out = forward_documents(model, PaddingCollator(0, 2, 64, mode="pack")(docs))
    assert abs(out.loss.item() - _loss_alone(stock, docs).item()) < 1e-5


def test_a_backend_that_cannot_run_here_is_refused_at_attach_and_the_model_is_left_as_it_was() -> None:
    """flash_attention_2 without flash-attn (this CPU): the cause at attach (the install, the device), before any
    proof, not a state and a crash at the first forward; the model's implementation, forward and state as before."""
    model = make_llama("sdpa").train()
    with pytest.raises(AttentionUnavailableError, match="attach: flash_attention_2 cannot run on cpu") as raised:
        attach(model, "flash_attention_2")
    assert "check '" in str(raised.value) and 'Fix: call attach(model, "auto")' in str(raised.value)
    assert model.config._attn_implementation == "sdpa"
    assert not hasattr(model, "foundry_path") and "forward" not in vars(model) and "forward" not in vars(model.model)


def test_auto_moves_down_the_chain_past_a_backend_attach_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend attach refuses (neither path runs it here) moves the choice to the next of the chain, the refusal
    kept in the decision (here FA2 on the reference kernel, refused as attach refuses a backend whose training
    forward cannot run)."""
    from foundry_attn.attention.backends import FA2, SDPA
    from foundry_attn.path import attach as attach_module
    from foundry_attn.selection.capability import probe
    from foundry_attn.selection.policy import choose

    genuine = attach_module._attach_backend

    def refusing(model, backend, *args):
        if backend == FA2:
            raise AttentionUnavailableError("foundry_attn: neither path trains LlamaForCausalLM with FA2 here")
        return genuine(model, backend, *args)

    monkeypatch.setattr(attach_module, "_attach_backend", refusing)
    model = make_llama("sdpa").train()
    decision = choose("auto", (FA2, SDPA), probe(), fa2_reference=True, smoke_test=None)
    assert decision.chosen == FA2
    decision, state = attach_decision(model, decision, fa2_reference=True)
    assert state.backend == SDPA and decision.chosen == SDPA and state.decision is decision
    refused = decision.candidates[0]
    assert refused.name == FA2 and not refused.available and refused.check == "attach"
    assert "neither path trains LlamaForCausalLM" in refused.reason


def test_auto_with_an_unknown_fallback_lists_the_valid_names() -> None:
    with pytest.raises(ValueError, match="valid values"):
        attach(make_llama("sdpa"), "auto", fallback=("flash_attention_3",))


def test_doctor_gives_the_answer_attach_auto_gives(capsys: pytest.CaptureFixture) -> None:
    import json

    from foundry_attn.cli import main

    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    state = attach(make_llama("sdpa").train(), "auto")
    assert report["chosen"] == state.backend
    assert report["reason"] == state.decision.reason
