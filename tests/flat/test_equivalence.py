"""The correctness bar: a batch gives every document the logits and per-token loss it gets alone.

Under reference-FA2 (transformers' real FA2 code path with our varlen metadata), SDPA, eager and flex
(eager on CPU), for both ``mask`` and ``pack`` collation, within 1e-5 in fp32.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from foundry_attn.flat.layout import Layout
from foundry_attn.flat.packing import PaddingCollator
from foundry_attn.path.attach import attach
from foundry_attn.path.forward import forward_documents, repad_logits
from tests.conftest import make_llama, skip_unless_flex_trains

EOS = 0
PAD = 63  # pad != EOS so a document may be a lone EOS; pad == EOS has its own case below
MAX_SEQ_LEN = 24
BACKENDS = ("flash_attention_2", "sdpa", "eager", "flex_attention")


@functools.cache
def batched(impl: str) -> torch.nn.Module:
    """The model that runs the batches under ``impl`` (attached; FA2 on the reference kernel), built on first use."""
    model = make_llama(impl)
    attach(model, impl, fa2_reference=True)
    return model


@functools.cache
def alone_model() -> torch.nn.Module:
    """Stock SDPA, the same weights: each document by itself, built on first use."""
    return make_llama("sdpa")


def _docs(lengths: list[int], seed: int) -> list[torch.Tensor]:
    """Documents of random non-EOS tokens, each ending in EOS (so pack mode splits them back apart)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.cat([torch.randint(1, 63, (n - 1,), generator=gen), torch.tensor([EOS])]) for n in lengths]


def _rows(docs: list[torch.Tensor], empty_rows: int, pad: int = PAD) -> list[torch.Tensor]:
    """Text rows as LLM-Foundry stores them: one document each, padded to max_seq_len."""
    rows = [F.pad(d, (0, MAX_SEQ_LEN - d.numel()), value=pad) for d in docs]
    return rows + [torch.full((MAX_SEQ_LEN,), pad)] * empty_rows


def _alone(doc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and per-token loss of one document run by itself (no mask, no padding)."""
    with torch.no_grad():
        logits = alone_model()(input_ids=doc[None]).logits[0]
    return logits, F.cross_entropy(logits[:-1], doc[1:], reduction="none")


def check_equivalent(
    impl: str, mode: str, lengths: list[int], empty_rows: int = 0, seed: int = 0, pad: int = PAD
) -> None:
    docs = _docs(lengths, seed)
    batch = PaddingCollator(pad, EOS, MAX_SEQ_LEN, mode)(_rows(docs, empty_rows, pad))
    model = batched(impl)
    with torch.no_grad():
        out = forward_documents(model, batch)
    logits = repad_logits(out)
    layout = Layout.from_batch(batch)
    token_losses = []
    seen = 0
    for r, row in enumerate(layout.doc_lens):
        start = 0
        for n in row:
            doc = batch["input_ids"][r, start : start + n]
            want_logits, want_loss = _alone(doc)
            torch.testing.assert_close(logits[r, start : start + n], want_logits, atol=1e-5, rtol=1e-5)
            got_loss = F.cross_entropy(logits[r, start : start + n - 1], doc[1:], reduction="none")
            torch.testing.assert_close(got_loss, want_loss, atol=1e-5, rtol=1e-5)
            token_losses.append(want_loss)
            start += n
            seen += 1
    assert seen == len(lengths)
    # the training loss itself: the mean over every document's own targets, nothing across documents (none: 0)
    targets = torch.cat(token_losses)
    torch.testing.assert_close(out.loss, targets.mean() if targets.numel() else torch.tensor(0.0), atol=1e-5, rtol=1e-5)


CASES = {  # name: (lengths, rows entirely padding, pad id)
    "mixed": ([5, 24, 1, 13, 7], 1, PAD),
    "single_full_length": ([24], 0, PAD),
    "many_length_1": ([1, 1, 1, 1, 1, 1, 2], 0, PAD),
    "pad_is_eos": ([2, 9, 24, 3], 1, EOS),
}


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("mode", ["mask", "pack"])
@pytest.mark.parametrize("case", list(CASES))
def test_documents_match_running_alone(impl: str, mode: str, case: str) -> None:
    lengths, empty_rows, pad = CASES[case]
    check_equivalent(impl, mode, lengths, empty_rows, pad=pad)


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("mode", ["mask", "pack"])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(1, MAX_SEQ_LEN), min_size=1, max_size=6),
    empty=st.integers(0, 1),
    seed=st.integers(0, 1000),
)
def test_random_batches_match_running_alone(impl: str, mode: str, lengths: list[int], empty: int, seed: int) -> None:
    check_equivalent(impl, mode, lengths, empty, seed)


def test_length_one_documents_have_no_targets() -> None:
    """A 1-token document has nothing to predict; a batch of only those has no loss to compare."""
    batch = PaddingCollator(PAD, EOS, MAX_SEQ_LEN, "pack")(_rows(_docs([1, 1, 3], 0), 0))
    assert batch["doc_lens"] == [[1, 1, 3]]
    assert batch["loss_generating_tokens"] == [2]


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("mode", ["mask", "pack"])
def test_a_microbatch_without_targets_adds_zero_loss(impl: str, mode: str) -> None:
    """Only 1-token documents: HF's mean over no targets is nan; ours is 0, with zero gradients."""
    skip_unless_flex_trains(impl)
    model = make_llama(impl)
    attach(model, impl, fa2_reference=True)
    batch = PaddingCollator(PAD, EOS, MAX_SEQ_LEN, mode)(_rows(_docs([1, 1, 1], 0), 0))
    assert batch["loss_generating_tokens"] in ([0], [0, 0, 0])
    out = forward_documents(model.train(), batch)
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_stock_sdpa_contaminates_packed_documents() -> None:
    """Why the masks exist: transformers 4.51 SDPA ignores packed position_ids and mixes documents (a model nobody
    attached: an attached one takes such a row on its proven path, tests/flat/test_flattened.py)."""
    docs = _docs([6, 9], 1)
    batch = PaddingCollator(PAD, EOS, MAX_SEQ_LEN, "pack")(_rows(docs, 0))
    with torch.no_grad():
        stock = make_llama("sdpa")(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    want, _ = _alone(docs[1])
    assert (stock[0, 6:15] - want).abs().max() > 1e-3


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("side", ["left", "right", "both"])
def test_a_users_2d_mask_gives_the_stock_result(impl: str, side: str) -> None:
    """No doc_lens: a right-, left- or both-sides-padded 2-D mask gives stock HF's logits on the real tokens."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 63, (3, 10), generator=gen)
    lengths = [10, 6, 3]
    offsets = {"left": [0, 4, 7], "right": [0, 0, 0], "both": [0, 2, 5]}[side]
    mask = torch.zeros(3, 10, dtype=torch.long)
    for r, (n, o) in enumerate(zip(lengths, offsets, strict=True)):
        mask[r, o : o + n] = 1
    stock = make_llama(impl)
    with torch.no_grad():
        want = stock(input_ids=ids, attention_mask=mask).logits
        got = repad_logits(forward_documents(batched(impl), {"input_ids": ids, "attention_mask": mask}))
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
