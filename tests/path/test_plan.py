"""One way through for a batch: one frozen plan (``path/plan.py``), its inputs built once, a proof's outcome a new plan.
A batch whose proof moves the run is counted once and built once per plan; the plan of a model nobody attached is
rows; an evaluation batch counts nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from foundry_attn.flat import inputs
from foundry_attn.flat.packing import PaddingCollator
from foundry_attn.path import forward
from foundry_attn.path.attach import attach
from foundry_attn.path.forward import forward_documents
from foundry_attn.path.plan import plan_batch, replan
from foundry_attn.path.state import path_of
from tests.conftest import make_llama


def _batch() -> dict:
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 64, (n,), generator=gen) for n in (20, 30, 40)]
    return PaddingCollator(pad_id=0, eos_id=2, max_seq_len=64, mode="pack")(docs)


def _counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The path of every plan ``forward`` builds, in order."""
    built: list[str] = []
    original = inputs.build

    def counting(hf, plan):  # type: ignore[no-untyped-def]
        built.append(plan.path)
        return original(hf, plan)

    monkeypatch.setattr(forward, "build", counting)
    return built


def test_a_plan_is_frozen_and_says_what_runs() -> None:
    model = make_llama("sdpa").train()
    attach(model, "sdpa")
    plan = plan_batch(model, _batch(), in_step=True)
    assert (plan.path, plan.at, plan.in_step) == ("flat", "batch 1 (the first training batch)", True)
    assert plan.layout.lengths == [20, 30, 40] and plan.labels is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.path = "rows"  # type: ignore[misc]
    moved = replan(model, plan, "rows")
    assert (moved.path, moved.at, moved.in_step) == ("rows", None, False) and plan.path == "flat"


def test_an_unattached_model_plans_rows_and_an_evaluation_batch_counts_nothing() -> None:
    model = make_llama("sdpa")
    assert plan_batch(model, _batch()).path == "rows" and not plan_batch(model, _batch()).attached
    attach(model, "sdpa")
    model.eval()
    before = path_of(model).schedule.batches
    plan = plan_batch(model, _batch())
    assert plan.path == "flat" and plan.at is None and path_of(model).schedule.batches == before


def test_a_batch_built_once_and_built_again_only_where_its_proof_moved_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_llama("sdpa").train()
    state = attach(model, "sdpa")
    built = _counted(monkeypatch)
    forward_documents(model, _batch())  # the first training batch: its proof takes the batch's forward, and holds
    assert built == ["flat"] and state.schedule.batches == 1 and state.path == "flat"
    original = inputs.flat_inputs

    def planted(*args, **kwargs):  # type: ignore[no-untyped-def]
        made, placed = original(*args, **kwargs)  # a difference in the training row only: a real target dropped
        labels = made["labels"].clone()
        labels[0, 5] = -100
        return {**made, "labels": labels}, placed

    monkeypatch.setattr(inputs, "flat_inputs", planted)
    ids = torch.randint(3, 64, (2, 128), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.clone(), "doc_lens": [[100], [60]]}  # longer than proven: a proof is due
    built.clear()
    forward_documents(model, batch)
    assert built == ["flat", "rows"], built  # the flat row, then the rows the proof moved the batch to
    assert state.schedule.batches == 2 and state.path == "rows", (state.schedule.batches, state.reason)
    assert [c.batch for c in state.changes] == [2]
