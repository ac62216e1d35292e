"""The cheapest exact layout for every batch: the cost model's choice, its memory bound, and a model whose flat row is
stock's packed mask running one document per row where that is cheaper, exactly, with the choice logged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from foundry_attn.flat.inputs import stock_splits_packed_rows
from foundry_attn.flat.layout_cost import ModelShape, cheapest, layout_costs
from foundry_attn.path.attach import attach
from foundry_attn.path.forward import forward_documents
from foundry_attn.verify import zoo

SHAPE = ModelShape(layers=2, heads=4, head_dim=64, hidden=256, params=2_000_000, element=4)


def test_rows_for_documents_of_one_length_and_the_flat_row_for_one_long_among_short_ones() -> None:
    assert cheapest(SHAPE, [256] * 16, ("flat", "rows"), stock_mask=True).layout == "rows"
    assert cheapest(SHAPE, [32] * 64, ("flat", "rows"), stock_mask=True).layout == "rows"
    assert cheapest(SHAPE, [2048] + [32] * 64, ("flat", "rows"), stock_mask=True).layout == "flat"
    # rows in two forwards by width: no padding, and a 2048-token attention in place of the row's 4096
    split = cheapest(SHAPE, [2048] + [32] * 64, ("flat", "rows"), stock_mask=True, forwards=4)
    assert split.layout == "rows" and "in 2 forwards by width" in split.reason, split.reason
    assert split.costs["rows"].positions == 4096
    # our own flat row scores each document against itself: never more than one per row
    costs = layout_costs(SHAPE, [256] * 16, ("flat", "rows"), stock_mask=False)
    assert costs["flat"].flops <= costs["rows"].flops


def test_a_layout_that_does_not_fit_the_free_memory_is_not_chosen() -> None:
    lengths = [256] * 16
    costs = layout_costs(SHAPE, lengths, ("flat", "rows"), stock_mask=True)
    between = (costs["rows"].memory + costs["flat"].memory) / 2 / 0.8
    assert costs["rows"].memory < costs["flat"].memory
    assert cheapest(SHAPE, lengths, ("flat", "rows"), stock_mask=True, free=between).layout == "rows"
    tight = cheapest(SHAPE, lengths, ("flat", "rows"), stock_mask=True, free=costs["rows"].memory / 10)
    assert tight.layout == "rows" and "none fits" in tight.reason, tight.reason


def _batch(lengths: list[int], vocab: int) -> tuple[dict, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, vocab, (n,), generator=gen) for n in lengths]
    ids = torch.zeros(len(docs), max(lengths), dtype=torch.long)
    for i, d in enumerate(docs):
        ids[i, : d.numel()] = d
    return {"input_ids": ids, "labels": ids.masked_fill(ids == 0, -100), "doc_lens": [[n] for n in lengths]}, docs


@pytest.mark.skipif(not stock_splits_packed_rows(), reason="transformers 4.x has no stock packed mask to choose")
@pytest.mark.parametrize(("model_type", "impl"), [("gptj", "eager"), ("stablelm", "sdpa")])
def test_each_batch_runs_the_cheaper_exact_layout(model_type: str, impl: str) -> None:
    config, model_class = zoo.tiny(model_type)
    torch.manual_seed(0)
    model = zoo.build(config, model_class, impl).train()
    state = attach(model, impl)
    assert state.stock_mask and state.rows_proven, state.reason
    for lengths, layout, most in (([16] * 8, "rows", 4), ([100] + [4] * 24, "flat", 1), ([100] + [4] * 24, "rows", 4)):
        batch, docs = _batch(lengths, config.vocab_size)
        state.choice.most_forwards = most  # 1: rows padded to the longest, dearer than the packed mask; 4: two forwards
        loss = forward_documents(model, batch).loss
        assert state.choice.layout == layout, state.choice.reason
        assert state.decision_now().as_dict()["layout"] == layout
        with torch.no_grad():
            total = sum(F.cross_entropy(model(input_ids=d[None]).logits[0, :-1], d[1:], reduction="sum") for d in docs)
        truth = total.item() / sum(n - 1 for n in lengths)
        assert abs(loss.item() - truth) <= 1e-5 * max(1.0, truth), (lengths, loss.item(), truth)
    assert any(at.startswith("rows at batch 1") and proof.ok for at, proof in state.proofs), state.proofs
