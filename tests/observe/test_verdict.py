"""The isolation verdict's core (no Composer): where the documents are, the measurement, the structural reading.

On both stacks: transformers 4.51 (sdpa / eager ignore restarting position_ids) and 5.x (they split rows there
when the forward has no cache); the measurement and the structural reading must agree on each.
"""

from __future__ import annotations

import pytest
import torch

from foundry_attn.flat.layout import packed_rows
from foundry_attn.flat.packing import PaddingCollator
from foundry_attn.observe.verdict import ISOLATED, LEAKS, NOT_PACKED, Features, Verdict, measure, structural
from foundry_attn.path.attach import attach
from foundry_attn.path.forward import forward_documents
from foundry_attn.proof.forward_probe import ForwardProbe
from tests.conftest import make_llama


def test_packed_rows_read_doc_lens_sequence_id_and_position_ids() -> None:
    ids = torch.zeros(2, 6, dtype=torch.long)
    assert packed_rows({"input_ids": ids, "doc_lens": [[2, 3], [4]]}) == [(0, 0, (2, 3))]
    seq = torch.tensor([[0, 0, 1, 1, 1, -1], [-1, 0, 0, 0, 0, 0]])  # LLM-Foundry's packing: -1 on padding
    assert packed_rows({"input_ids": ids, "sequence_id": seq}) == [(0, 0, (2, 3))]
    pos = torch.tensor([[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1] * 6])
    assert packed_rows({"input_ids": ids, "position_ids": pos, "attention_mask": mask}) == [(0, 0, (2, 3))]
    assert packed_rows({"input_ids": ids}) == []


def test_our_collator_emits_sequence_id_with_the_pad_tail_as_its_own_segment() -> None:
    collate = PaddingCollator(0, 9, 8, mode="pack")
    batch = collate([torch.tensor([5, 6, 9]), torch.tensor([7, 9]), torch.tensor([3, 4, 5, 6, 7, 9])])
    assert batch["doc_lens"] == [[3, 2], [6]]
    assert batch["sequence_id"].tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 0, 0]]


def test_measured_leak_names_the_documents_and_a_clean_model_is_isolated() -> None:
    collate = PaddingCollator(0, 63, 64, mode="pack")
    gen = torch.Generator().manual_seed(0)
    batch = collate([torch.randint(1, 60, (n,), generator=gen) for n in (9, 6, 11, 4)])
    model = make_llama("sdpa").train()
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    rng = torch.get_rng_state()
    verdict = measure(model, batch, logits)
    assert verdict.state == LEAKS and verdict.leaking == (1,) and verdict.lengths == (9, 6), verdict
    assert "documents LEAK (measured" in verdict.line() and "document(s) [1]: its loss reaches" in verdict.line()
    assert model.training and torch.equal(torch.get_rng_state(), rng)  # still in training mode, RNG untouched
    # the same model attached: its flat path keeps the documents apart, and the training graph says so exactly
    attach(model, "sdpa")
    probe = ForwardProbe(model)
    out = forward_documents(model, batch)
    probe.remove()
    verdict = measure(model, batch, out.logits, embeds=probe.embeds)
    assert verdict.state == ISOLATED and verdict.worst is not None and verdict.worst < 1e-5, verdict.line()
    assert "exactly zero gradient" in verdict.line()
    out.loss.backward()  # the step's graph is kept for its own backward


def test_structural_reading_is_labelled_and_never_shown_as_measured() -> None:
    features = Features(packed=True, position_ids=True)
    reading = structural(make_llama("sdpa"), features)
    assert reading.state == LEAKS and reading.how == "structural"
    assert "structural reading, not measured" in reading.line()
    assert structural(make_llama("sdpa"), Features(packed=False)).state == NOT_PACKED
    assert Verdict(NOT_PACKED, reason="no row holds two documents").isolated is None


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_the_structural_reading_agrees_with_the_measurement(impl: str, use_cache: bool) -> None:
    collate = PaddingCollator(0, 63, 64, mode="pack")
    gen = torch.Generator().manual_seed(1)
    batch = collate([torch.randint(1, 60, (n,), generator=gen) for n in (7, 12, 5)])
    model = make_llama(impl)
    model.config.use_cache = use_cache
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    measured, read = measure(model, batch, logits), structural(model, Features.of(batch))
    assert measured.state == read.state, (measured.line(), read.line())
    assert (measured.how, read.how) == ("measured", "structural")
