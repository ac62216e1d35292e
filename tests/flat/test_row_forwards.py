"""Rows in several forwards by width: one long document among short ones is not padded to the longest. The grouping
(:func:`row_groups`), and real batches that train as each document alone in several forwards (loss, logits, every
parameter's gradient), proven at each forward's width, on rows right- and left-padded and beside stock's packed mask."""

from __future__ import annotations

import pytest
import torch

from foundry_attn.flat import layout_cost
from foundry_attn.flat.layout_cost import row_groups
from foundry_attn.path.attach import attach
from foundry_attn.path.forward import forward_documents, joined, prepare_documents, repad_logits
from foundry_attn.proof.synthetic import synthetic_documents
from tests.proof.test_judged import _model, _own_truth, _rows


def test_one_long_document_among_short_ones_runs_in_its_own_forward() -> None:
    groups = row_groups((32,) * 30 + (2048,) + (32,) * 34, least=950)
    assert groups == ((30,), tuple(d for d in range(65) if d != 30))
    assert row_groups((256,) * 16) == (tuple(range(16)),)  # one length: one forward
    assert row_groups((2048,) + (32,) * 64, most=1) == (tuple(range(65)),)
    assert row_groups((28, 13, 1), least=950) == ((0, 1, 2),)  # 42 positions saved at most: not worth a forward
    assert row_groups((60, 3, 3, 3, 30)) == ((0,), (4,), (1, 2, 3))


def test_a_forward_costs_more_positions_on_a_gpu_than_on_the_cpu() -> None:
    cpu = layout_cost.FORWARD_OVERHEAD["cpu"]
    assert layout_cost.FORWARD_OVERHEAD["cuda"] > 100 * cpu


def _grouped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every position saved pays for a forward: the tiny models here group as a large one would."""
    monkeypatch.setitem(layout_cost.FORWARD_OVERHEAD, "cpu", 0.0)


@pytest.mark.parametrize(
    ("model_type", "impl", "path"),
    [("llama", "sdpa", "rows"), ("cpmant", "eager", "auto"), ("gptj", "eager", "auto")],
    ids=["llama-rows", "cpmant-left-padded", "gptj"],
)
def test_rows_in_several_forwards_train_as_each_document_alone(
    monkeypatch: pytest.MonkeyPatch, model_type: str, impl: str, path: str
) -> None:
    _grouped(monkeypatch)
    model = _model(model_type, impl)
    state = attach(model, impl, path=path)
    params = [p for p in model.parameters() if p.requires_grad]
    forwards: list[int] = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    for lengths in ((40, 5), (60, 3, 3, 3, 30)):
        docs = synthetic_documents(model.config, lengths, torch.device("cpu"))
        batch = _rows(docs)
        for again in (False, True):  # the first run proves rows at each forward's width; the second only trains
            forwards.clear()
            out = forward_documents(model, batch)
            if again:
                assert len(forwards) == len(row_groups(lengths)), forwards
            assert state.choice.layout == "rows" and state.proofs[-1][0].startswith("rows at batch"), state.proofs[-1]
            assert state.proofs[-1][1].ok, state.proofs[-1][1].describe()
            got = torch.autograd.grad(out.loss, params, allow_unused=True)
            truth = _own_truth(model, docs, not state.first_targets)
            want = torch.autograd.grad(truth, params, allow_unused=True)
            assert abs(out.loss.item() - truth.item()) <= 1e-5 * max(1.0, abs(truth.item())), (lengths, out.loss)
            for g, w in zip(got, want, strict=True):
                assert (g is None) == (w is None), lengths
                if g is not None:
                    torch.testing.assert_close(g, w, atol=1e-5 * max(1.0, w.abs().max().item()), rtol=1e-3)
        state.choice.most_forwards = 1  # the same batch in one forward, padded to the longest: the same logits
        with torch.no_grad():
            one = repad_logits(forward_documents(model, batch))
            state.choice.most_forwards = 4
            several = repad_logits(forward_documents(model, batch))
        assert several.shape == one.shape == (len(lengths), max(lengths), one.shape[-1])
        torch.testing.assert_close(several, one, atol=1e-4, rtol=1e-4)


def test_a_loss_summed_over_the_batch_adds_the_forwards_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``num_items_in_batch`` (transformers' Trainer) each forward's loss is its share of the batch's sum."""
    _grouped(monkeypatch)
    model = _model("llama", "sdpa")
    attach(model, "sdpa", path="rows")
    docs = synthetic_documents(model.config, (60, 3, 3, 3, 30), torch.device("cpu"))
    batch = _rows(docs)
    mean = forward_documents(model, batch).loss
    prepared = prepare_documents(model, batch, in_step=True)
    assert len(prepared.forwards) == 3
    items = sum(f.targets for f in prepared.forwards)
    outs = [model(**f.inputs, use_cache=False, num_items_in_batch=items) for f in prepared.forwards]
    torch.testing.assert_close(joined(outs, prepared.forwards, summed=True).loss, mean)


def test_a_model_with_a_router_loss_runs_one_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    _grouped(monkeypatch)
    model = _model("mixtral", "sdpa")
    model.config.output_router_logits = True
    state = attach(model, "sdpa", path="rows")
    assert state.choice.forwards(model, (60, 3, 3, 3, 30)) == ()
    model.config.output_router_logits = False
    assert len(state.choice.forwards(model, (60, 3, 3, 3, 30))) == 3
