"""sdpa and eager on the flat path: the documents grouped by length into a few right-padded batches
(:mod:`foundry_attn.attention.length_groups`). At most 8 attention calls per layer, forward and backward, whatever the
document count, and each document exactly as alone: outputs and gradients against per-document SDPA (and per-document
eager math with a softcap), with windows, GQA, a one-token document and lengths that must be padded."""

from __future__ import annotations

import collections
import itertools
import random
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from foundry_attn.attention.compiled_op import document_attention, eager_document
from foundry_attn.attention.dense_functions import SHORT_ROW
from foundry_attn.attention.documents import Documents
from foundry_attn.attention.functions import FUNCTIONS
from foundry_attn.attention.length_groups import CPU_ALONE, MAX_GROUPS, MAX_PADDING, group_by_length, groups_for

#: 15 documents of 12 distinct lengths (more than MAX_GROUPS: some are padded), a one-token document among them
MIXED = [5, 1, 8, 2, 13, 3, 21, 7, 1, 11, 4, 17, 6, 9, 8]
#: the same mix, each document 40 tokens longer: a row past SHORT_ROW (its documents grouped by length, not one call)
LONG_MIXED = [n + 40 for n in MIXED]
#: 30 documents of 10 lengths, 303 tokens: on the CPU too, 8 padded groups (two of two lengths each)
GROUPED = [3, 7, 13, 11, 3, 2, 5, 17, 19, 9, 13, 17, 15, 2, 13, 3, 15, 5, 7, 15, 7, 19, 11, 11, 5, 2, 9, 17, 9, 19]
#: the kernels each backend runs once per call of its attention math, forward and backward (CPU)
KERNELS = {
    "sdpa": ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu_backward"),
    "eager": ("aten::_softmax", "aten::_softmax_backward_data"),
}


def _bounds(lengths: list[int]) -> list[int]:
    return [sum(lengths[:i]) for i in range(len(lengths) + 1)]


def _qkv(tokens: int, heads: int = 4, kv_heads: int = 2, dim: int = 8, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = ((1, heads, tokens, dim), (1, kv_heads, tokens, dim), (1, kv_heads, tokens, dim))
    return [torch.randn(*s, generator=gen, dtype=torch.float64).float().requires_grad_() for s in shapes]


def _allowed(n: int, window: int | None) -> torch.Tensor:
    i = torch.arange(n)
    return (i[:, None] >= i[None, :]) & ((i[:, None] - i[None, :] < window) if window else True)


def sdpa_alone(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, softcap: None) -> torch.Tensor:
    """One document by itself: plain SDPA with an explicit causal (+ window) mask, GQA repeated. -> [B, n, H, D]."""
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_allowed(q.shape[2], window)).transpose(1, 2)


def eager_alone(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, softcap: float) -> torch.Tensor:
    """One document by itself through transformers' eager math (softcap, fp32 softmax). -> [B, n, H, D]."""
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    return eager_document(q, k, v, window, q.shape[-1] ** -0.5, softcap).transpose(1, 2)


def _each_alone(
    alone: Callable[..., torch.Tensor], lengths: list[int], qkv: list[torch.Tensor], window: int | None, softcap: float
) -> torch.Tensor:
    """Every document through ``alone``, by itself, concatenated: the truth. -> [B, T, H, D]."""
    spans = itertools.pairwise(_bounds(lengths))
    return torch.cat([alone(*(t[:, :, s:e] for t in qkv), window, softcap) for s, e in spans], dim=1)


def _grads(out: torch.Tensor, qkv: list[torch.Tensor], weight: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad((out * weight).sum(), qkv))


@pytest.mark.parametrize(("backend", "alone", "softcap"), [("sdpa", sdpa_alone, 0.0), ("eager", eager_alone, 5.0)])
@pytest.mark.parametrize("window", [None, 3, 6])
@pytest.mark.parametrize(
    "lengths", [MIXED, GROUPED, [4, 6, 1, 9], [7], [8] * 4], ids=["mixed", "grouped", "few", "one", "equal"]
)
def test_each_document_as_alone_forward_and_backward(
    backend: str, alone: Callable[..., torch.Tensor], softcap: float, window: int | None, lengths: list[int]
) -> None:
    """fp32, GQA (4 query heads on 2 KV heads), windows shorter and longer than documents; gradients of q, k, v."""
    qkv = _qkv(sum(lengths))
    docs = Documents.of(_bounds(lengths))
    module = torch.nn.Module()
    out, _ = FUNCTIONS[backend](
        module, *qkv, None, sliding_window=window, softcap=softcap or None, foundry_documents=docs
    )
    want = _each_alone(alone, lengths, qkv, window, softcap)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    for got, truth in zip(_grads(out, qkv, weight), _grads(want, qkv, weight), strict=True):
        torch.testing.assert_close(got, truth, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["sdpa", "eager"])
@pytest.mark.parametrize("window", [0, 3])
def test_compiled_op_groups_documents_and_stays_exact(kind: str, window: int) -> None:
    """The op ``torch.compile`` sees, called directly: the same batches, its own backward (sdpa on the CPU: torch's
    flash kernels with the saved logsumexp; eager: the fp32 recompute), against each document alone."""
    q, k, v = (t.detach().repeat_interleave(2, dim=1) if i else t.detach() for i, t in enumerate(_qkv(sum(MIXED))))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    softcap = 5.0 if kind == "eager" else 0.0
    bounds = Documents.of(_bounds(MIXED)).bounds_on("cpu")
    out = document_attention(q, k, v, bounds, kind, window, q.shape[-1] ** -0.5, softcap)[0].transpose(1, 2)
    alone = sdpa_alone if kind == "sdpa" else eager_alone
    want = _each_alone(alone, MIXED, [q, k, v], window or None, softcap)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    for got, truth in zip(_grads(out, [q, k, v], weight), _grads(want, [q, k, v], weight), strict=True):
        torch.testing.assert_close(got, truth, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("lengths", [MIXED, GROUPED], ids=["one call", "grouped"])
def test_no_document_reaches_another_not_even_through_a_pad(backend: str, lengths: list[int]) -> None:
    """A document's output has exactly zero gradient on every other document's queries, keys and values (a pad
    repeats its own document's last token; pads' gradients are exact zeros; one call's block mask is exact zeros
    too), with dropout on too."""
    q, k, v = _qkv(sum(lengths))
    docs = Documents.of(_bounds(lengths))
    module = torch.nn.Module().train()
    for dropout in (0.0, 0.3):
        out, _ = FUNCTIONS[backend](module, q, k, v, None, dropout=dropout, sliding_window=4, foundry_documents=docs)
        for s, e in docs.spans:
            for grad in torch.autograd.grad(out[:, s:e].sum(), (q, k, v), retain_graph=True):
                outside = torch.cat([grad[:, :, :s], grad[:, :, e:]], dim=2)
                assert torch.count_nonzero(outside) == 0, (backend, s, e, dropout)


def _calls_per_layer(backend: str, lengths: list[int], window: int | None = None) -> tuple[int, int]:
    """How often one attention call (one layer) runs the backend's attention kernel, forward and backward."""
    q, k, v = _qkv(sum(lengths), dim=4)
    docs = Documents.of(_bounds(lengths))
    forward, backward = KERNELS[backend]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out, _ = FUNCTIONS[backend](torch.nn.Module(), q, k, v, None, sliding_window=window, foundry_documents=docs)
        out.sum().backward()
    names = collections.Counter(event.name for event in prof.events())
    return names[forward], names[backward]


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("count", [1, 4, 16, 64, 256])
def test_equal_documents_take_one_call_per_layer(backend: str, count: int) -> None:
    assert _calls_per_layer(backend, [8] * count) == (1, 1)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("window", [None, 4])
def test_mixed_lengths_take_at_most_eight_calls_per_layer(backend: str, window: int | None) -> None:
    """On an accelerator at most MAX_GROUPS calls; on the CPU too, or, where groups would not halve the calls (15
    documents in 8 groups), a call per document: fewer than 2 * MAX_GROUPS. Eager on a row of at most SHORT_ROW
    tokens: one call, under a block-diagonal mask (sdpa: torch's SDPA one document at a time, never a mask)."""
    rng = random.Random(0)
    many = [rng.randint(1, 40) for _ in range(150)]  # ~40 distinct lengths
    assert sum(MIXED) <= SHORT_ROW < sum(LONG_MIXED)
    short = (1, 1) if backend == "eager" else (len(MIXED), len(MIXED))
    assert _calls_per_layer(backend, MIXED, window) == short
    for lengths, cpu_calls in ((LONG_MIXED, len(LONG_MIXED)), (many, len(group_by_length(tuple(many)).shapes))):
        assert len(group_by_length(tuple(lengths)).shapes) <= MAX_GROUPS
        calls = _calls_per_layer(backend, lengths, window)
        assert calls[0] == len(groups_for(tuple(lengths), torch.device("cpu")).shapes) == cpu_calls, calls
        assert cpu_calls <= MAX_GROUPS or cpu_calls < 2 * MAX_GROUPS, calls
        assert calls[1] == calls[0], calls


def test_grouping_pads_little_and_equal_documents_not_at_all() -> None:
    """Few lengths: one group each, nothing padded, a group of one document alone (a view); equal documents: one
    batch, a reshape; many lengths: at most 8 calls, each group of two or more padding at most MAX_PADDING times its
    tokens; pads read their own document's last token."""
    assert group_by_length((8,) * 256).reshape_only and group_by_length((8,) * 256).shapes == ((256, 8),)
    few = group_by_length((5, 1, 8, 2, 7, 1))
    assert few.padded == few.tokens and few.members == ((1, 5),) and few.alone == (0, 2, 3, 4)
    assert few.shapes == ((2, 1), (1, 5), (1, 8), (1, 2), (1, 7))
    rng = random.Random(1)
    mixes = {
        "blog": [rng.randint(220, 350) for _ in range(48)],
        "lognormal": [max(1, min(2048, int(rng.lognormvariate(5, 1.2)))) for _ in range(300)],
        "ones and a long one": [1] * 200 + [2048],
        "every length to 1000": list(range(1, 1001)),
    }
    for name, lengths in mixes.items():
        groups = group_by_length(tuple(lengths))
        grouped = len(groups.members)
        assert len(groups.shapes) <= MAX_GROUPS and all(len(m) > 1 for m in groups.members), name
        assert list(groups.alone) == sorted(groups.alone), name  # row order
        assert sorted([*groups.alone, *(d for m in groups.members for d in m)]) == list(range(len(lengths))), name
        assert groups.shapes[grouped:] == tuple((1, lengths[d]) for d in groups.alone), name
        for members, (n, width) in zip(groups.members, groups.shapes[:grouped], strict=True):
            assert n * width <= MAX_PADDING * sum(lengths[d] for d in members), (name, n, width)
        take, slot, real = groups.indices("cpu")
        tokens = _bounds(lengths)[-1]
        owner = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        shapes = zip(groups.members, groups.shapes[:grouped], strict=True)
        slots = torch.cat(
            [torch.zeros(0, dtype=torch.long)] + [torch.tensor(m).repeat_interleave(w) for m, (_, w) in shapes]
        )
        assert torch.equal(owner[take], slots), name  # every position, pads included, reads its own document
        rows = torch.arange(tokens)[~torch.isin(owner, torch.tensor(groups.alone, dtype=torch.long))]
        pads = torch.arange(tokens, groups.padded)
        assert torch.equal(slot.sort().values, torch.cat([rows, pads])), name  # a permutation, the alone left out
        assert torch.equal(slot[real], take[real]) and torch.equal(slot[real].sort().values, rows), name
    assert group_by_length((256,) * 3 + (1,) * 100).padded == 868  # two lengths: no padding, two calls


def test_pad_and_unpad_are_inverse_and_so_are_their_gradients() -> None:
    """pad (grouped KV heads repeated in the gather) then unpad gives the row back, token-major; gradients as
    through ``repeat_kv`` and a transpose; ``zero_pads`` zeroes exactly the pads."""
    from transformers.integrations.sdpa_attention import repeat_kv

    heads = torch.randn(2, 3, sum(MIXED), 5, requires_grad=True)  # [B, H, T, D]
    # MIXED with alone=9: eight short lengths, no padding, 13, 21, 11, 17, 9 and each short length's only document
    # alone; without: padded groups and views of the groups of one document side by side
    for lengths, alone in ((MIXED, 9), (MIXED, None), ([4] * 6, 9), ([9], 9)):
        row = heads[:, :, : sum(lengths)]
        groups = group_by_length(tuple(lengths), alone=alone)
        assert alone or (groups.padded > groups.tokens and groups.members and groups.alone)
        assert torch.equal(groups.unpad(groups.pad(row)), row.transpose(1, 2))
        zeroed = groups.pad(row.detach(), zero_pads=True)
        assert sum(int((p == 0).all(dim=1).all(dim=-1).sum()) for p in zeroed) == 2 * (groups.padded - groups.tokens)
        weight = torch.randn(2, sum(lengths), 6, 5)
        got = torch.autograd.grad((groups.unpad(groups.pad(row, repeat=2)) * weight).sum(), heads)[0]
        want = torch.autograd.grad((repeat_kv(row, 2).transpose(1, 2) * weight).sum(), heads)[0]
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize(
    "lengths", [[2] * 64, [3] * 256, MIXED, LONG_MIXED], ids=["64 equal", "256 equal", "mixed", "long mixed"]
)
def test_a_model_runs_at_most_eight_calls_per_layer(backend: str, lengths: list[int]) -> None:
    """A tiny Llama pointed at our function, given the flat row as the flat path builds it: per layer one call per
    group (one for equal documents; under eager, one for a row of at most SHORT_ROW tokens), forward and backward; the
    logits as each document's alone."""
    from foundry_attn.flat.implementation import point
    from tests.conftest import make_llama

    model = make_llama("sdpa", num_hidden_layers=2)
    alone = {n: model(input_ids=torch.arange(n)[None] % 60).logits for n in set(lengths)}  # stock sdpa
    point(model, backend)
    bounds = _bounds(lengths)
    ids = torch.cat([torch.arange(n) % 60 for n in lengths])[None]
    inputs = dict(
        input_ids=ids,
        position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
        attention_mask=torch.zeros(1, 1, 1, 1),
        foundry_documents=Documents.of(bounds),
    )
    forward, backward = KERNELS[backend]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        logits = model(**inputs).logits
        logits.sum().backward()
    names = collections.Counter(event.name for event in prof.events())
    groups = len(groups_for(tuple(lengths), torch.device("cpu")).shapes)  # LONG_MIXED: one call per document, 15
    groups = 1 if backend == "eager" and sum(lengths) <= SHORT_ROW else groups
    assert (names[forward], names[backward]) == (2 * groups, 2 * groups) and groups < 2 * MAX_GROUPS
    torch.testing.assert_close(logits, torch.cat([alone[n] for n in lengths], dim=1), atol=1e-5, rtol=1e-5)


def test_eager_on_the_cpu_splits_a_batch_past_its_score_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU's eager math takes at most CPU_SCORES scores a call (bigger buffers cost more there than the calls they
    save): a batch of equal documents runs in calls of as many as fit, never a document split; still each alone."""
    from foundry_attn.attention import compiled_op

    lengths = [8] * 9
    monkeypatch.setattr(compiled_op, "CPU_SCORES", 2 * 4 * 8 * 8)  # two documents of 4 heads x 8 x 8 scores a call
    assert compiled_op.per_call(torch.zeros(9, 4, 8, 2)) == 2 and compiled_op.per_call(torch.zeros(1, 4, 64, 2)) == 1
    assert _calls_per_layer("eager", lengths) == (5, 5)
    qkv = _qkv(sum(lengths))
    out, _ = FUNCTIONS["eager"](torch.nn.Module(), *qkv, None, foundry_documents=Documents.of(_bounds(lengths)))
    torch.testing.assert_close(out, _each_alone(eager_alone, lengths, qkv, None, 0.0), atol=1e-5, rtol=1e-5)
    q, k, v = (t.detach().repeat_interleave(2, dim=1) if i else t.detach() for i, t in enumerate(qkv))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = document_attention(q, k, v, Documents.of(_bounds(lengths)).bounds_on("cpu"), "eager", 0, 8**-0.5, 0.0)[0]
    want = _each_alone(eager_alone, lengths, [q, k, v], None, 0.0)
    torch.testing.assert_close(out.transpose(1, 2), want, atol=1e-5, rtol=1e-5)
    weight = want.detach()
    for got, truth in zip(_grads(out.transpose(1, 2), [q, k, v], weight), _grads(want, [q, k, v], weight), strict=True):
        torch.testing.assert_close(got, truth, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_on_the_cpu_long_documents_run_alone(backend: str) -> None:
    """On the CPU a document of CPU_ALONE tokens or more is its own call, a view of the row (there its padding and
    copies would cost more than the call); the short ones of a length shared are grouped, a group of one document
    alone. Exact either way; on an accelerator the long ones of one length are one group."""
    lengths = [CPU_ALONE + 40, 5, 1, CPU_ALONE, 5, 5, 5, CPU_ALONE + 40, 5, 5]
    cpu = groups_for(tuple(lengths), torch.device("cpu"))
    assert cpu.members == ((1, 4, 5, 6, 8, 9),) and cpu.alone == (0, 2, 3, 7)
    assert cpu.shapes == ((6, 5), *((1, lengths[d]) for d in cpu.alone))
    cuda = groups_for(tuple(lengths), torch.device("cuda"))  # the two of CPU_ALONE + 40 a group: four calls
    assert cuda.members == ((1, 4, 5, 6, 8, 9), (0, 7)) and cuda.alone == (2, 3) and len(cuda.shapes) == 4
    assert groups_for((CPU_ALONE,) * 4, torch.device("cpu")).reshape_only  # one length: one batch, a reshape
    assert _calls_per_layer(backend, lengths) == (5, 5)
    qkv = _qkv(sum(lengths))
    out, _ = FUNCTIONS[backend](
        torch.nn.Module(), *qkv, None, sliding_window=50, foundry_documents=Documents.of(_bounds(lengths))
    )
    alone = sdpa_alone if backend == "sdpa" else eager_alone
    want = _each_alone(alone, lengths, qkv, 50, 0.0)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    for got, truth in zip(_grads(out, qkv, weight), _grads(want, qkv, weight), strict=True):
        torch.testing.assert_close(got, truth, atol=1e-5, rtol=1e-5)


#: bench gpu's a_report row: six documents of six lengths
REPORT = (220, 217, 295, 183, 130, 350)


@pytest.mark.parametrize("kind", ["cpu", "cuda", "xpu"])
def test_six_documents_of_six_lengths_run_as_views_on_every_device(kind: str) -> None:
    """A group of one document gains nothing from padding, a gather and a scatter: on every kind of device six
    documents of six lengths are six calls on views of the row (as before grouping), no index kernel forward or
    backward, and still each document exactly as alone."""
    groups = groups_for(REPORT, torch.device(kind))
    assert groups.members == () and groups.alone == tuple(range(6)) and not groups.reshape_only
    assert groups.shapes == tuple((1, n) for n in REPORT) and groups.padded == groups.tokens == sum(REPORT)
    q, k, v = _qkv(sum(REPORT), dim=4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        pieces = groups.pad(q), groups.pad(k, repeat=2), groups.pad(v, repeat=2)
        assert all(p.untyped_storage().data_ptr() == q.untyped_storage().data_ptr() for p in pieces[0])  # views
        out = groups.unpad(
            [F.scaled_dot_product_attention(*batch, is_causal=True) for batch in zip(*pieces, strict=True)]
        )
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        got = _grads(out, [q, k, v], weight)
    names = collections.Counter(event.name for event in prof.events())
    assert not {"aten::index_select", "aten::index_copy_", "aten::index_copy"} & set(names), names
    assert names["aten::scaled_dot_product_attention"] == 6
    want = _each_alone(sdpa_alone, list(REPORT), [q, k, v], None, 0.0)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    for grad, truth in zip(got, _grads(want, [q, k, v], weight), strict=True):
        torch.testing.assert_close(grad, truth, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_repeated_lengths_are_still_grouped_beside_the_views(kind: str) -> None:
    """Documents of a length shared are one padded batch (shortest first); only a length's only document runs
    alone, in row order after the groups; exact, and at most MAX_GROUPS calls."""
    lengths = (13, 35, 13, 22, 35, 13, 7)  # on the CPU: 4 calls grouped for 7 documents, so each alone
    groups = groups_for(lengths, torch.device(kind))
    assert groups.members == ((0, 2, 5), (1, 4)) and groups.alone == (3, 6)
    assert groups.shapes == ((3, 13), (2, 35), (1, 22), (1, 7)) and groups.padded == groups.tokens
    mixed = groups_for(tuple(MIXED), torch.device(kind))  # 12 lengths: some padded together, in at most 8 calls
    assert len(mixed.shapes) <= MAX_GROUPS and all(len(m) > 1 for m in mixed.members)
    assert any({1, 8} <= set(m) for m in mixed.members)  # the two one-token documents share a batch
    assert any({2, 14} <= set(m) for m in mixed.members)  # and so do the two of 8 tokens
    assert list(mixed.alone) == sorted(mixed.alone) and mixed.padded > mixed.tokens
    q, k, v = _qkv(sum(lengths), dim=4)
    pieces = groups.pad(q), groups.pad(k, repeat=2), groups.pad(v, repeat=2)
    assert [p.shape[0] for p in pieces[0]] == [3, 2, 1, 1]
    out = groups.unpad([F.scaled_dot_product_attention(*batch, is_causal=True) for batch in zip(*pieces, strict=True)])
    want = _each_alone(sdpa_alone, list(lengths), [q, k, v], None, 0.0)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    for grad, truth in zip(_grads(out, [q, k, v], weight), _grads(want, [q, k, v], weight), strict=True):
        torch.testing.assert_close(grad, truth, atol=1e-5, rtol=1e-5)


def test_on_the_cpu_groups_that_do_not_halve_the_calls_give_way_to_a_split() -> None:
    """A few calls saved do not pay for a gather and a scatter on the CPU: every document alone, one split of the
    row (make demo's rows: a pair of one length among a dozen documents); groups that halve the calls stay."""
    cpu = torch.device("cpu")
    assert groups_for((13, 35, 13, 22, 35, 13, 7), cpu).members == ()
    assert groups_for((13, 35, 13, 22, 35, 13, 7), cpu).alone == tuple(range(7))
    assert groups_for(tuple(MIXED), cpu).shapes == tuple((1, n) for n in MIXED)
    assert groups_for((8,) * 6 + (3, 5), cpu).shapes == ((6, 8), (1, 3), (1, 5))  # 3 calls for 8 documents
    lengths = [13, 35, 13, 22, 35, 13, 7]
    for backend in ("sdpa", "eager"):
        assert _calls_per_layer(backend, lengths) == (7, 7)
        qkv = _qkv(sum(lengths))
        out, _ = FUNCTIONS[backend](torch.nn.Module(), *qkv, None, foundry_documents=Documents.of(_bounds(lengths)))
        want = _each_alone(sdpa_alone if backend == "sdpa" else eager_alone, lengths, qkv, None, 0.0)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
