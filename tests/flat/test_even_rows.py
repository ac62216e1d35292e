"""Documents of one length run as even rows (one per row, no padding) where sdpa and eager would regroup them in every
layer: the same tokens, exact against each document alone (loss, every parameter's gradient), proven on the batch
that trains, and the attention calls take the rows as they are."""

from __future__ import annotations

import pytest
import torch

from foundry_attn.path.attach import attach
from foundry_attn.path.forward import forward_documents, prepare_documents, repad_logits
from foundry_attn.proof.synthetic import synthetic_documents
from tests.flat.test_left_padded import assert_trains_alone
from tests.proof.test_judged import _model


def _packed(docs: list[torch.Tensor], per_row: int) -> dict:
    """``per_row`` documents of one length side by side in each row (doc_lens), as the packing collator gives them."""
    rows = [torch.cat(docs[i : i + per_row]) for i in range(0, len(docs), per_row)]
    ids = torch.stack(rows)
    return {"input_ids": ids, "labels": ids.clone(), "doc_lens": [[d.numel() for d in docs[i : i + per_row]]
                                                                  for i in range(0, len(docs), per_row)]}  # fmt: skip


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_documents_of_one_length_train_as_even_rows(family: str, impl: str) -> None:
    model = _model(family, impl)
    state = attach(model, impl)
    docs = synthetic_documents(model.config, (8,) * 6, torch.device("cpu"))
    for per_row in (1, 3):
        batch = _packed(docs, per_row)
        for _ in range(2):  # the first batch is proven on its own forward; the second only trains
            out = forward_documents(model, batch)
            assert "batch" in state.proofs[-1][0] and state.proofs[-1][1].ok, state.proofs[-1]
            assert_trains_alone(model, out.loss, docs, not state.first_targets)
        with torch.no_grad():  # no grad: not a training batch, nothing planned or proven
            if state.path == "flat":
                assert prepare_documents(model, batch, in_step=True).inputs["input_ids"].shape == (6, 8)
            logits = repad_logits(forward_documents(model, batch))
        assert logits.shape == (*batch["input_ids"].shape, model.config.vocab_size)


def test_documents_of_several_lengths_keep_the_flat_row() -> None:
    model = _model("llama", "sdpa")
    attach(model, "sdpa")
    docs = synthetic_documents(model.config, (8, 8, 5), torch.device("cpu"))
    batch = {"input_ids": torch.cat(docs)[None], "doc_lens": [[8, 8, 5]]}
    assert prepare_documents(model, batch, in_step=True).inputs["input_ids"].shape == (1, 21)
    assert prepare_documents(model, _packed(docs[:2], 2), in_step=False).inputs["input_ids"].shape == (1, 16)


@pytest.mark.parametrize("checkpointing", ["hf_non_reentrant", "checkpoint_wrapper"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_even_rows_are_exact_under_activation_checkpointing(checkpointing: str, impl: str) -> None:
    """The recompute runs the same call: even rows, their documents as the argument, each row alone."""
    from foundry_attn.verify.conformance import enable_checkpointing

    model = _model("llama", impl)
    state = attach(model, impl)
    enable_checkpointing(model, checkpointing)
    docs = synthetic_documents(model.config, (8,) * 6, torch.device("cpu"))
    batch = _packed(docs, 2)
    out = forward_documents(model, batch)
    at, proof = state.proofs[-1]
    assert state.path == "flat" and at.startswith("batch 1") and proof.ok, (at, proof.describe())
    with torch.no_grad():  # not a training batch: nothing planned
        assert prepare_documents(model, batch, in_step=True).inputs["input_ids"].shape == (6, 8)
    assert_trains_alone(model, out.loss, docs, True)
