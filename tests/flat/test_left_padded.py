"""Left-padded rows train as each document alone on every family, absolute positions included, and the proof judges
the forward that trains: a difference planted in the training row only (a position offset, a dropped or a crossing
target) fails it. The batch is what a tokenizer with ``padding_side="left"`` gives: a 2-D mask, labels -100 on
padding, no ``position_ids``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from foundry_attn.flat import inputs
from foundry_attn.path import forward
from foundry_attn.path.attach import attach
from foundry_attn.path.forward import forward_documents
from foundry_attn.proof.synthetic import synthetic_documents
from foundry_attn.verify import zoo
from tests.proof.test_judged import _model, _own_truth

#: absolute positions (GPT-2, GPT-Neo, OPT, BioGPT, GPT-BigCode; XGLM's sinusoidal) and rotary (Llama)
FAMILIES = [
    (family, impl)
    for family, impls in (
        ("gpt2", ("eager", "sdpa")),
        ("gpt_neo", ("eager",)),
        ("opt", ("eager", "sdpa")),
        ("biogpt", ("eager", "sdpa")),
        ("gpt_bigcode", ("eager", "sdpa")),
        ("xglm", ("eager",)),
        ("llama", ("eager", "sdpa")),
    )
    for impl in impls
]


def left_padded(docs: list[torch.Tensor], pad: int = 0) -> dict:
    """One document per row, padded on the left to the longest, as a tokenizer with ``padding_side="left"`` does."""
    width = max(d.numel() for d in docs)
    ids = torch.full((len(docs), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, d in enumerate(docs):
        ids[i, width - d.numel() :] = d
        mask[i, width - d.numel() :] = 1
        labels[i, width - d.numel() :] = d
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def assert_trains_alone(model: torch.nn.Module, loss: torch.Tensor, docs: list[torch.Tensor], shifts: bool) -> None:
    """The loss within 1e-5 and every parameter's gradient within 1e-4 (relative) of each document alone."""
    params = [p for p in model.parameters() if p.requires_grad]
    got = torch.autograd.grad(loss, params, allow_unused=True)
    truth = _own_truth(model, docs, shifts)
    want = torch.autograd.grad(truth, params, allow_unused=True)
    assert abs(loss.item() - truth.item()) <= 1e-5 * max(1.0, abs(truth.item())), (loss.item(), truth.item())
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, atol=1e-4 * max(1.0, w.abs().max().item()), rtol=1e-3)


@pytest.mark.parametrize(("family", "impl"), FAMILIES, ids=[f"{f}-{i}" for f, i in FAMILIES])
def test_left_padded_rows_train_as_each_document_alone(family: str, impl: str) -> None:
    model = _model(family, impl)
    try:
        state = attach(model, impl)
    except Exception as exc:  # transformers here has no such backend for the family (4.51: GPT-Neo sdpa)
        pytest.skip(f"{family} {impl}: {str(exc)[:120]}")
    for lengths in ((47, 17), (30, 9, 22)):
        docs = synthetic_documents(model.config, lengths, torch.device("cpu"))
        for _ in range(2):  # the first batch is proven; the second only trains
            out = forward_documents(model, left_padded(docs))
            assert state.proofs[-1][1].ok, state.proofs[-1][1].describe()
            assert_trains_alone(model, out.loss, docs, not state.first_targets)


def _planted(monkeypatch: pytest.MonkeyPatch, plant: str) -> None:
    """A difference in the training row only: the proof reads the batch, never this row, for its truth."""
    original_inputs = inputs.flat_inputs

    def planted(*args, **kwargs):  # type: ignore[no-untyped-def]
        made, placed = original_inputs(*args, **kwargs)
        if plant == "position offset":
            made["position_ids"] = made["position_ids"] + 3
            return made, placed
        labels = made["labels"]
        if labels is not None:
            labels = labels.clone()
            starts = list(made[inputs.DOCS_KEY].bounds[1:-1])
            if plant == "dropped target":
                labels[0, starts[0] - 2] = -100  # a real target of the first document dropped
            else:  # the last token of a document predicts the next one's first
                labels[0, starts[0]] = made["input_ids"][0, starts[0]]
            made["labels"] = labels
        return made, placed

    monkeypatch.setattr(inputs, "flat_inputs", planted)  # what build lays the training row out with


@pytest.mark.parametrize("plant", ["position offset", "dropped target", "crossing target"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_difference_planted_in_the_training_row_fails_the_proof(
    monkeypatch: pytest.MonkeyPatch, plant: str, family: str
) -> None:
    if family == "llama" and plant == "position offset":
        pytest.skip("rotary positions: an offset changes nothing a document computes")
    model = _model(family, "sdpa")
    state = attach(model, "sdpa")
    if state.path != "flat":
        pytest.skip(f"{family} is not on the flat path here: {state.reason[:160]}")
    _planted(monkeypatch, plant)
    docs = synthetic_documents(model.config, (30, 17), torch.device("cpu"))
    forward_documents(model, left_padded(docs))
    at, proof = next((at, p) for at, p in state.proofs if at.startswith("batch 1"))
    assert not proof.ok, (at, proof.describe())
    assert state.path != "flat" or state.stock_mask, state.reason


@pytest.mark.foundry
@pytest.mark.parametrize(("family", "impl"), FAMILIES, ids=[f"{f}-{i}" for f, i in FAMILIES])
def test_left_padded_rows_train_as_each_document_alone_through_the_llm_foundry_glue(
    tmp_path: Path, family: str, impl: str
) -> None:
    from foundry_attn.integrations.llm_foundry.model import FoundryAttnCausalLM

    config, _ = zoo.tiny(family)
    config.save_pretrained(tmp_path / family)
    try:
        model = FoundryAttnCausalLM(
            tokenizer=None,
            pretrained_model_name_or_path=str(tmp_path / family),
            pretrained=False,
            attn_implementation=impl,
            attn_strict=True,
            events_dir=str(tmp_path / "events"),
        )
    except Exception as exc:  # transformers here has no such backend for the family (4.51: GPT-Neo sdpa)
        pytest.skip(f"{family} {impl}: {str(exc)[:120]}")
    hf = model.model.train()
    for module in hf.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    for lengths in ((47, 17), (30, 9, 22)):
        docs = synthetic_documents(hf.config, lengths, torch.device("cpu"))
        batch = left_padded(docs)
        loss = model.loss(model(batch), batch)
        assert hf.foundry_path.proofs[-1][1].ok, hf.foundry_path.proofs[-1][1].describe()
        assert_trains_alone(hf, loss, docs, not hf.foundry_path.first_targets)


def test_plain_left_padded_rows_through_the_models_own_forward_are_said_once() -> None:
    """The Trainer route on a plain padded batch (not packed) trains as stock does: left-padded rows are said once,
    in the path's reason and as a path change; right-padded rows say nothing, and the side is read once."""
    model = _model("gpt2", "sdpa")
    state = attach(model, "sdpa")
    docs = synthetic_documents(model.config, (30, 17), torch.device("cpu"))
    batch = left_padded(docs)
    with torch.no_grad():
        model.eval()
        model(**batch)  # evaluation reads nothing
        assert not state.padding_read
        model.train()
        for _ in range(2):
            model(**batch)
    said = [change for change in state.changes if change.reason == forward.LEFT_PADDED]
    assert len(said) == 1 and forward.LEFT_PADDED in state.reason, state.changes

    rows = {k: v.flip(-1) for k, v in batch.items()}  # the same rows padded on the right
    with torch.no_grad():
        right_model = _model("gpt2", "sdpa")
        right = attach(right_model, "sdpa")
        right_model(**rows)
    assert right.padding_read and not any(c.reason == forward.LEFT_PADDED for c in right.changes), right.changes
    assert forward.LEFT_PADDED not in right.reason
