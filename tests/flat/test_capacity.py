"""A flat row padded to a capacity (a few fixed shapes, the bounds read on the device): exact against each document
alone (loss, every parameter's gradient), proven on the padded row that trains, no host sync from the batch to the
optimizer step, a batch past the capacity at its own length (said once), and backends that read lengths on the host
say why they keep their own."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from foundry_attn.attention.documents import DOCS_KEY, Documents
from foundry_attn.attention.fa2_reference import flash_attn_varlen_func
from foundry_attn.flat.capacity import BUCKETS, at_capacity, capacity_for
from foundry_attn.path.attach import attach
from foundry_attn.path.forward import PAST_CAPACITY, forward_documents, prepare_documents, repad_logits
from foundry_attn.proof.synthetic import synthetic_documents
from foundry_attn.selection.policy import AttentionUnavailableError
from tests.flat.test_left_padded import assert_trains_alone
from tests.flat.test_wrappers import compiled_steps
from tests.proof.test_judged import _model

CAPACITY = 256


class HostSyncs(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense`` (a tensor read on the host: ``.item()``, ``int()``, ``bool()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # torch's signature
        self.count += "_local_scalar_dense" in str(func)
        return func(*args, **(kwargs or {}))


def _packed(docs: list[torch.Tensor]) -> dict:
    ids = torch.cat(docs)[None]
    targets = sum(d.numel() - 1 for d in docs)  # the collator's count: has_targets reads it, not the labels
    return {"input_ids": ids, "labels": ids.clone(), "doc_lens": [[d.numel() for d in docs]],
            "loss_generating_tokens": [targets]}  # fmt: skip


def test_a_run_meets_a_few_shapes() -> None:
    rng = random.Random(0)
    shapes = set()
    for _ in range(50):
        lengths = [rng.randint(1, 60) for _ in range(rng.randint(1, 9))]
        total = sum(lengths)
        sizes = capacity_for(total, len(lengths), 4 * CAPACITY)
        assert sizes is not None and sizes[0] >= total and sizes[1] > len(lengths)
        shapes.add(sizes)
    assert len({s[0] for s in shapes}) <= BUCKETS and len({s[1] for s in shapes}) == 1, shapes
    assert capacity_for(CAPACITY + 1, 2, CAPACITY) is None


def test_the_reference_kernel_skips_zero_length_documents() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(7, 4, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    plain = torch.tensor([0, 3, 7], dtype=torch.int32)
    padded = torch.tensor([0, 3, 3, 7, 7, 7], dtype=torch.int32)
    want = flash_attn_varlen_func(q, k, v, plain, plain, 4, 4, causal=True)
    torch.testing.assert_close(flash_attn_varlen_func(q, k, v, padded, padded, 7, 7, causal=True), want)


def test_at_capacity_pads_the_row_and_its_documents() -> None:
    ids = torch.arange(1, 42)[None]
    inputs = {"input_ids": ids, "position_ids": ids - 1, "labels": ids.clone(), DOCS_KEY: Documents.of([0, 28, 41])}
    padded = at_capacity(inputs, (64, 16))
    docs = padded[DOCS_KEY]
    assert padded["input_ids"].shape == padded["labels"].shape == padded["position_ids"].shape == (1, 64)
    assert bool((padded["labels"][0, 41:] == -100).all()) and bool((padded["position_ids"][0, 41:] == 0).all())
    assert docs.bounds == (0, 28, 41, *[64] * 14) and docs.real == 2 and docs.pinned == 64
    assert docs.spans == [(0, 28), (28, 41)] and docs.max_length == 28


@pytest.mark.parametrize("family", ["llama", "opt", "qwen2"])  # rotary; learned positions from an offset
def test_a_padded_row_trains_as_each_document_alone(family: str) -> None:
    model = _model(family, "sdpa")
    try:
        state = attach(model, "flash_attention_2", fa2_reference=True, capacity=CAPACITY)
    except AttentionUnavailableError as exc:  # 4.51's OPT builds a class that calls flash-attn itself
        pytest.skip(str(exc)[:160])
    assert state.capacity == CAPACITY and state.path == "flat", state.reason
    assert state.decision_now().layout_reason == "flat rows padded to 32-token buckets up to 256"
    for lengths in ((47, 17), (30, 9, 22)):
        docs = synthetic_documents(model.config, lengths, torch.device("cpu"))
        batch = _packed(docs)
        for _ in range(2):  # the first batch is proven on the padded row; the second only trains
            out = forward_documents(model, batch)
            at, proof = state.proofs[-1]
            assert at.startswith("batch") and proof.ok and proof.tokens == 64, (at, proof.describe())
            assert_trains_alone(model, out.loss, docs, not state.first_targets)
        with torch.no_grad():
            inputs = prepare_documents(model, batch).inputs
            assert inputs["input_ids"].shape == (1, 64) and inputs[DOCS_KEY].pinned == 64
            assert repad_logits(forward_documents(model, batch)).shape == (1, sum(lengths), model.config.vocab_size)


def test_the_padded_step_makes_no_host_sync() -> None:
    """From the batch (on its device) to the optimizer step: the layout is read on the host from ``doc_lens``, the
    kernel reads the bounds on the device, and the loss is a mean over the real targets in the graph."""
    model = _model("llama", "sdpa")
    attach(model, "flash_attention_2", fa2_reference=True, capacity=CAPACITY)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = _packed(synthetic_documents(model.config, (30, 9, 22), torch.device("cpu")))
    for step in range(3):  # the first is proven (its own forwards read values); the next two are the steady step
        syncs = HostSyncs()
        with syncs:
            forward_documents(model, batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        assert (syncs.count == 0) == bool(step), (step, syncs.count)  # the proof's own reads show the count works


def test_a_batch_past_the_capacity_runs_at_its_own_length_said_once() -> None:
    model = _model("llama", "sdpa")
    state = attach(model, "flash_attention_2", fa2_reference=True, capacity=64)
    docs = synthetic_documents(model.config, (47, 30), torch.device("cpu"))
    for _ in range(2):
        out = forward_documents(model, _packed(docs))
        assert_trains_alone(model, out.loss, docs, True)
    assert [n for n in state.notes if n.startswith(PAST_CAPACITY)] == [
        f"{PAST_CAPACITY} 64 tokens (a row of 77): it runs at its own length"
    ]
    with torch.no_grad():
        assert prepare_documents(model, _packed(docs)).inputs["input_ids"].shape == (1, 77)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_a_backend_that_reads_lengths_on_the_host_says_why_it_keeps_its_own(impl: str) -> None:
    model = _model("llama", impl)
    state = attach(model, impl, capacity=CAPACITY)
    assert state.capacity == 0 and any(n.startswith(f"capacity {CAPACITY} not applied: {impl}") for n in state.notes)
    with pytest.raises(ValueError, match="capacity"):
        attach(model, impl, capacity=-1)


@pytest.mark.slow
def test_a_compiled_padded_step_is_exact_and_compiles_no_new_graph_per_layout() -> None:
    """``torch.compile`` (aot_eager) over changing layouts, each padded to its bucket: every step equal to the
    uncompiled one, all in one graph with no graph break. On torch_varlen's reference kernel, installed around the run
    as a real kernel is (the FA2 reference installs itself per call, a graph break each: ``test_wrappers``)."""
    from foundry_attn.bench.gpu import reference_torch_varlen

    torch._dynamo.reset()
    with reference_torch_varlen():
        by_step, breaks = compiled_steps("llama", "torch_varlen", steps=8, capacity=128)
    assert by_step[0] == by_step[-1] == 1 and not breaks, (by_step, breaks)
