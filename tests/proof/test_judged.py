"""Judged on the batch that trains: CPM-Ant with its default config trains its own loss on real batches (its loss
reads each token's own label), Llama-4 with a short attention chunk trains as each document alone, a proof that
could not judge (stock cannot compute a document alone) never decides the run, and half-precision limits hold the
spread of stock's own kernels."""

from __future__ import annotations

import pytest
import torch

from foundry_attn.flat.implementation import running
from foundry_attn.path.attach import attach
from foundry_attn.path.forward import forward_documents
from foundry_attn.path.proven import keep_proof, subject_of
from foundry_attn.proof.result import Proof
from foundry_attn.proof.runs import alone_inputs, loss_shifts, run
from foundry_attn.proof.synthetic import synthetic_documents
from foundry_attn.proof.tolerance import stock_noise, undefined_values
from foundry_attn.verify import zoo

#: real batches of several lengths, a 1-token document and documents past Llama-4's chunk of 8 among them
BATCHES = ((28, 13), (13, 1, 22), (30, 17, 9), (40, 5), (13, 1, 22, 9, 17, 30))


def _model(model_type: str, impl: str, **config: object) -> torch.nn.Module:
    if model_type not in zoo.model_types():
        pytest.skip(f"transformers here has no {model_type}")
    cfg, model_class = zoo.tiny(model_type)
    for key, value in config.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    model = zoo.build(cfg, model_class, impl).train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def _rows(docs: list[torch.Tensor]) -> dict:
    width = max(d.numel() for d in docs)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    for i, d in enumerate(docs):
        ids[i, : d.numel()] = d
    labels = torch.full_like(ids, -100)
    for i, d in enumerate(docs):
        labels[i, : d.numel()] = d
    return {"input_ids": ids, "labels": labels, "doc_lens": [[d.numel()] for d in docs]}


def _own_truth(model: torch.nn.Module, docs: list[torch.Tensor], shifts: bool) -> torch.Tensor:
    """The model's own loss on each document alone (an all-ones mask), weighted by its targets."""
    total, targets = 0.0, 0
    with running(model, model.foundry_path.rows_name):
        for d in docs:
            n = d.numel() - 1 if shifts else d.numel()
            if n:
                out = model(**alone_inputs(d[None]), labels=d[None], use_cache=False)
                total, targets = total + out.loss * n, targets + n
    return total / targets


@pytest.mark.parametrize(
    ("model_type", "impl", "config"),
    [("cpmant", "eager", {"prompt_length": 32}), ("llama4_text", "sdpa", {"attention_chunk_size": 8})],
    ids=["cpmant-default", "llama4-chunk-8"],
)
def test_real_batches_train_as_each_document_alone(model_type: str, impl: str, config: dict) -> None:
    """Loss and every parameter's gradient of each real batch against the model's own loss on each document alone."""
    model = _model(model_type, impl, **config)
    try:
        state = attach(model, impl)
    except Exception as exc:  # refused: it must say why
        assert "neither path" in str(exc) or "cannot" in str(exc), exc
        return
    shifts = not state.first_targets
    assert shifts == (model_type != "cpmant"), state
    params = [p for p in model.parameters() if p.requires_grad]
    for lengths in BATCHES:
        docs = synthetic_documents(model.config, lengths, torch.device("cpu"))
        model.zero_grad(set_to_none=True)
        loss = forward_documents(model, _rows(docs)).loss
        got = torch.autograd.grad(loss, params, allow_unused=True)
        truth = _own_truth(model, docs, shifts)
        want = torch.autograd.grad(truth, params, allow_unused=True)
        assert abs(loss.item() - truth.item()) <= 1e-5 * max(1.0, abs(truth.item())), (lengths, loss, truth)
        for g, w in zip(got, want, strict=True):
            assert (g is None) == (w is None), lengths
            if g is not None:
                torch.testing.assert_close(g, w, atol=1e-5 * max(1.0, w.abs().max().item()), rtol=1e-3)


def test_cpmants_loss_reads_each_tokens_own_label_and_llamas_the_next() -> None:
    for model_type, impl, shifts in (("cpmant", "eager", False), ("llama", "sdpa", True)):
        model = _model(model_type, impl)
        doc = synthetic_documents(model.config, (9,), torch.device("cpu"))[0]
        assert loss_shifts(subject_of(model), doc, impl) is shifts, model_type


def test_a_proof_that_could_not_judge_keeps_the_last_decision() -> None:
    """A nan or an error on stock's side judges nothing: the path proven before stands, and the notes say why."""
    model = _model("llama", "sdpa")
    state = attach(model, "sdpa")
    assert state.path == "flat"
    unjudged = Proof(False, reason="stock sdpa cannot compute one document alone here: ...", ran=False, judged=False)
    keep_proof(state, model, {}, "batch 7 (a longer batch)", unjudged, True, None)
    assert state.path == "flat" and "judged nothing" in state.notes[-1], state.notes


def test_non_finite_values_are_named_by_side_and_tokens() -> None:
    from foundry_attn.proof.runs import Run

    logits = torch.zeros(5, 4)
    logits[3, 1] = float("nan")
    assert undefined_values([Run(logits)], [(0, 3), (3, 5)], packed=True) == (
        "document of 2 tokens: nan or inf logits at 1 of its 2 tokens"
    )
    assert undefined_values([Run(torch.zeros(3, 4))], [(0, 3)]) == ""


def test_half_precision_limits_hold_the_spread_of_stocks_own_kernels() -> None:
    """bf16 weights: eager against sdpa on one document alone is rounding, measured into the limits."""
    model = _model("llama", "sdpa").to(torch.bfloat16).eval()
    doc = synthetic_documents(model.config, (40,), torch.device("cpu"))[0]
    alone = alone_inputs(doc[None])
    subject = subject_of(model)
    with subject.running("sdpa"):
        mine = run(subject, alone, [(0, 40)], grads=True)
        shape_only = stock_noise(subject, alone, mine)
        both = stock_noise(subject, alone, mine, "sdpa")
    assert both[0] >= shape_only[0] and both[1] >= shape_only[1]
    assert both[0] > 0.0, both  # bf16 eager rounds its scores: two stock kernels differ
