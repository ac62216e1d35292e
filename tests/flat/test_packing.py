"""PaddingCollator: real lengths when pad == EOS, packed documents, overflow, finetuning examples."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from foundry_attn.flat.layout import Layout
from foundry_attn.flat.packing import IGNORE_INDEX, PaddingCollator, true_lengths

EOS = PAD = 0  # the test tokenizer's choice: pad == EOS


def rows(*r: list[int]) -> torch.Tensor:
    return torch.tensor(r)


def check_invariants(batch: dict, max_seq_len: int) -> None:
    """What every collated batch promises, whatever went in."""
    ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
    n, width = ids.shape
    assert labels.shape == pos.shape == (n, width) and width <= max(1, max_seq_len)
    assert len(batch["doc_lens"]) == n
    assert batch["total_tokens"] == [sum(lens) for lens in batch["doc_lens"]]
    assert batch["loss_generating_tokens"] == (labels[:, 1:] != IGNORE_INDEX).sum(1).tolist()
    for r, lens in enumerate(batch["doc_lens"]):
        assert all(n > 0 for n in lens) and sum(lens) <= max_seq_len
        start = 0
        for n_doc in lens:
            assert pos[r, start : start + n_doc].tolist() == list(range(n_doc))  # restarts at every document
            assert labels[r, start] == IGNORE_INDEX  # never predicts across a document boundary
            start += n_doc
        assert (labels[r, start:] == IGNORE_INDEX).all() and (ids[r, start:] == PAD).all()
    if "attention_mask" in batch:
        assert batch["attention_mask"].sum(1).tolist() == batch["total_tokens"]


# ---- true_lengths ------------------------------------------------------------------------------------------


def test_true_lengths_pad_is_eos() -> None:
    ids = rows([5, 6, 0, 0, 0], [5, 6, 7, 8, 9], [0, 0, 0, 0, 0], [5, 0, 6, 0, 0], [5, 6, 7, 8, 0])
    assert true_lengths(ids, PAD, EOS).tolist() == [3, 5, 0, 4, 5]


def test_true_lengths_pad_differs_from_eos() -> None:
    pad, eos = 1, 2
    ids = rows([5, 2, 1, 1], [5, 6, 1, 1], [1, 1, 1, 1], [5, 6, 7, 2])
    assert true_lengths(ids, pad, eos).tolist() == [2, 2, 0, 4]
    assert true_lengths(ids, pad, None).tolist() == [2, 2, 0, 4]


def test_mask_mode_with_tokenizer_pad_eq_eos(tokenizer) -> None:
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == EOS
    docs = [tokenizer(t, add_special_tokens=False)["input_ids"] + [EOS] for t in ("the cat sees a dog .", "a fox")]
    width = 10
    examples = [torch.tensor(d + [PAD] * (width - len(d))) for d in docs] + [torch.full((width,), PAD)]
    batch = PaddingCollator(PAD, EOS, width)(examples)
    check_invariants(batch, width)
    assert batch["doc_lens"] == [[7], [3], []]
    assert batch["input_ids"].shape == (3, 7)  # trimmed to the longest row
    assert batch["attention_mask"].tolist() == [[1] * 7, [1, 1, 1, 0, 0, 0, 0], [0] * 7]
    assert batch["labels"][0].tolist() == [IGNORE_INDEX, *docs[0][1:]]  # the first EOS is a real target
    assert batch["labels"][0, 6] == EOS
    assert batch["labels"][1].tolist() == [IGNORE_INDEX, docs[1][1], EOS] + [IGNORE_INDEX] * 4
    assert (batch["labels"][2] == IGNORE_INDEX).all()
    assert batch["total_tokens"] == [7, 3, 0] and batch["loss_generating_tokens"] == [6, 2, 0]
    layout = Layout.from_batch(batch)
    assert layout.real_tokens / (layout.rows * layout.width) == pytest.approx(10 / 21)


def test_mask_mode_pad_differs_from_eos() -> None:
    pad, eos = 1, 2
    batch = PaddingCollator(pad, eos, 8)([torch.tensor([5, 6, 2, 1, 1]), torch.tensor([7, 8, 9, 1, 1])])
    assert batch["doc_lens"] == [[3], [3]]
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 6, 2], [IGNORE_INDEX, 8, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 1]]


def test_all_padding_batch() -> None:
    batch = PaddingCollator(PAD, EOS, 4)([torch.zeros(4, dtype=torch.long)])
    assert batch["doc_lens"] == [[]] and batch["total_tokens"] == [0] and batch["loss_generating_tokens"] == [0]
    assert batch["input_ids"].shape == (1, 1) and batch["attention_mask"].tolist() == [[0]]
    packed = PaddingCollator(PAD, EOS, 4, mode="pack")([torch.zeros(4, dtype=torch.long)])
    assert packed["doc_lens"] == [[]] and packed["input_ids"].shape == (1, 1)


def test_mask_mode_explicit_lengths() -> None:
    examples = [{"input_ids": [5, 0, 0, 0], "attention_mask": [1, 1, 1, 0]}, {"input_ids": [5, 6, 7, 8], "length": 2}]
    batch = PaddingCollator(PAD, EOS, 8)(examples)
    assert batch["doc_lens"] == [[3], [2]]  # the mask says an EOS-like token is real; trust it
    assert batch["input_ids"].tolist() == [[5, 0, 0], [5, 6, 0]]


# ---- pack mode --------------------------------------------------------------------------------------------------


def test_pack_mode_documents_and_positions() -> None:
    examples = [rows([5, 6, 0, 7, 8, 9, 0, 0])[0], rows([3, 0, 0, 0, 0, 0, 0, 0])[0]]
    batch = PaddingCollator(PAD, EOS, 6, mode="pack")(examples)
    check_invariants(batch, 6)
    assert "attention_mask" not in batch
    # docs [5 6 0] [7 8 9 0] [3 0]: first fit puts [3 0] next to [5 6 0]
    assert batch["doc_lens"] == [[3, 2], [4]]
    assert batch["input_ids"].tolist() == [[5, 6, 0, 3, 0], [7, 8, 9, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 6, 0, IGNORE_INDEX, 0], [IGNORE_INDEX, 8, 9, 0, IGNORE_INDEX]]
    assert batch["total_tokens"] == [5, 4] and batch["loss_generating_tokens"] == [3, 3]


def first_fit(lengths: list[int], cap: int) -> list[list[int]]:
    """An independent first-fit: each length goes to the first row with room, in order."""
    out: list[list[int]] = []
    for n in lengths:
        row = next((r for r in out if sum(r) + n <= cap), None)
        if row is None:
            out.append(row := [])
        row.append(n)
    return out


def expected_pieces(doc_lens: list[int], cap: int, overflow: str) -> list[int]:
    out = []
    for n in doc_lens:
        if overflow == "truncate":
            out.append(min(n, cap))
        else:
            out.extend([cap] * (n // cap) + ([n % cap] if n % cap else []))
    return out


@settings(max_examples=25, deadline=None)
@given(
    examples=st.lists(st.lists(st.integers(2, 14), min_size=0, max_size=4), min_size=1, max_size=4),
    max_seq_len=st.integers(3, 12),
    overflow=st.sampled_from(["split", "truncate"]),
    seed=st.integers(0, 1000),
)
def test_pack_mode_random_documents(examples: list[list[int]], max_seq_len: int, overflow: str, seed: int) -> None:
    """Rows of documents (content then EOS), padded with EOS; pack and check every promise.

    Documents have at least one content token: with pad == EOS a lone EOS is indistinguishable from padding.
    """
    gen = torch.Generator().manual_seed(seed)
    width = max(1, max(sum(doc_lens) for doc_lens in examples))
    tensors, docs = [], []
    for doc_lens in examples:
        row = []
        for n in doc_lens:
            doc = [*torch.randint(1, 50, (n - 1,), generator=gen).tolist(), EOS]
            docs.append(doc)
            row += doc
        tensors.append(torch.tensor(row + [PAD] * (width - len(row)), dtype=torch.long))
    batch = PaddingCollator(PAD, EOS, max_seq_len, mode="pack", overflow=overflow)(tensors)
    check_invariants(batch, max_seq_len)
    pieces = expected_pieces([len(d) for d in docs], max_seq_len, overflow)
    assert batch["doc_lens"] == (first_fit(pieces, max_seq_len) or [[]])
    real = sum(len(d) for d in docs)
    assert sum(batch["total_tokens"]) == (real if overflow == "split" else sum(pieces))
    # every document's tokens arrive intact and in order
    flat = [t for r, lens in enumerate(batch["doc_lens"]) for t in batch["input_ids"][r, : sum(lens)].tolist()]
    got_pieces, start = [], 0
    for n in [n for lens in batch["doc_lens"] for n in lens]:
        got_pieces.append(flat[start : start + n])
        start += n
    want = []
    for d in docs:
        want += (
            [d[i : i + max_seq_len] for i in range(0, len(d), max_seq_len)]
            if overflow == "split"
            else [d[:max_seq_len]]
        )
    assert sorted(got_pieces) == sorted(want)


def test_overflow_split_vs_truncate() -> None:
    long_doc = [*range(1, 10), EOS]  # 10 tokens
    example = torch.tensor([*long_doc, 7, EOS, PAD, PAD])
    split = PaddingCollator(PAD, EOS, 4, mode="pack", overflow="split")([example])
    check_invariants(split, 4)
    assert split["doc_lens"] == [[4], [4], [2, 2]]  # the tail is its own document, never merged into [7, EOS]
    assert split["input_ids"][2].tolist() == [9, EOS, 7, EOS]
    assert split["position_ids"][2].tolist() == [0, 1, 0, 1]
    assert split["labels"][2].tolist() == [IGNORE_INDEX, EOS, IGNORE_INDEX, EOS]
    trunc = PaddingCollator(PAD, EOS, 4, mode="pack", overflow="truncate")([example])
    check_invariants(trunc, 4)
    assert trunc["doc_lens"] == [[4], [2]]
    assert trunc["input_ids"].tolist() == [[1, 2, 3, 4], [7, EOS, PAD, PAD]]
    masked = PaddingCollator(PAD, EOS, 4, overflow="truncate")([torch.tensor(long_doc)])
    assert masked["doc_lens"] == [[4]]
    masked_split = PaddingCollator(PAD, EOS, 4, overflow="split")([torch.tensor(long_doc)])
    assert masked_split["doc_lens"] == [[4], [4], [2]]
    check_invariants(masked_split, 4)


def test_finetuning_examples_keep_prompt_labels() -> None:
    examples = [
        {"input_ids": [5, 6, 7, 8, EOS], "labels": [IGNORE_INDEX, IGNORE_INDEX, 7, 8, EOS]},
        {"input_ids": [9, EOS, 3, EOS], "labels": [IGNORE_INDEX, IGNORE_INDEX, 3, EOS]},  # EOS inside: not split
    ]
    packed = PaddingCollator(PAD, EOS, 16, mode="pack")(examples)
    check_invariants(packed, 16)
    assert packed["doc_lens"] == [[5, 4]]
    assert packed["labels"][0].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 7, 8, EOS, IGNORE_INDEX, IGNORE_INDEX, 3, EOS]
    assert packed["total_tokens"] == [9] and packed["loss_generating_tokens"] == [5]
    masked = PaddingCollator(PAD, EOS, 16)(examples)
    check_invariants(masked, 16)
    assert masked["doc_lens"] == [[5], [4]]
    assert masked["labels"].tolist() == [
        [IGNORE_INDEX, IGNORE_INDEX, 7, 8, EOS],
        [IGNORE_INDEX, IGNORE_INDEX, 3, EOS, IGNORE_INDEX],
    ]
    assert masked["loss_generating_tokens"] == [3, 2]


def test_text_not_split_when_disabled() -> None:
    batch = PaddingCollator(PAD, EOS, 8, mode="pack", split_text_at_eos=False)([torch.tensor([5, 0, 6, 0, 0])])
    assert batch["doc_lens"] == [[4]]


def test_pack_mode_mixed_text_and_finetuning() -> None:
    """Text examples are split at EOS together; a finetuning example between them keeps its place and labels."""
    examples = [
        torch.tensor([5, 6, 0, 7, 0, 0, 0]),  # padded text row: [5 6 0] [7 0]
        {"input_ids": [9, 0, 3, 0], "labels": [IGNORE_INDEX, IGNORE_INDEX, 3, 0]},  # one document, EOS inside
        {"input_ids": [4, 0, 8, 8, 0, 0]},  # text: [4 0] [8 8 0]
    ]
    batch = PaddingCollator(PAD, EOS, 16, mode="pack")(examples)
    check_invariants(batch, 16)
    assert batch["doc_lens"] == [[3, 2, 4, 2, 3]]
    assert batch["input_ids"].tolist() == [[5, 6, 0, 7, 0, 9, 0, 3, 0, 4, 0, 8, 8, 0]]
    i = IGNORE_INDEX
    assert batch["labels"].tolist() == [[i, 6, 0, i, 0, i, i, 3, 0, i, 0, i, 8, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 0, 1, 2]]


@pytest.mark.parametrize("mode", ["mask", "pack"])
def test_input_kinds_give_identical_batches(mode: str) -> None:
    """Lists, tuples, numpy arrays and tensors of any int dtype collate to the same batch."""
    np = pytest.importorskip("numpy")
    text = [[5, 6, 0, 7, 0, 0], [3, 0, 0, 0, 0, 0], [8, 8, 8, 8, 8, 0]]
    finetune = {"input_ids": [9, 0, 3, 0], "labels": [IGNORE_INDEX, IGNORE_INDEX, 3, 0], "attention_mask": [1] * 4}
    kinds = [
        lambda x: x,
        tuple,
        np.array,
        torch.tensor,
        lambda x: torch.tensor(x, dtype=torch.int32),
    ]
    collate = PaddingCollator(PAD, EOS, 8, mode=mode)
    batches = []
    for kind in kinds:
        examples = [{"input_ids": kind(r)} for r in text]
        examples.append({k: kind(v) for k, v in finetune.items()})
        examples.append({"input_ids": kind([4, 4, 0, 0]), "attention_mask": kind([1, 1, 1, 0])})
        batches.append(collate(examples))
    for batch in batches[1:]:
        assert batch.keys() == batches[0].keys()
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == torch.long and torch.equal(value, batches[0][key]), key
            else:
                assert value == batches[0][key], key
    check_invariants(batches[0], 8)


def test_non_int_and_empty_lists_fall_back_to_torch() -> None:
    examples = [{"input_ids": [5, 6, 0], "labels": [IGNORE_INDEX, 6.0, 0.0]}, {"input_ids": [], "labels": []}]
    batch = PaddingCollator(PAD, EOS, 8)(examples)
    assert batch["doc_lens"] == [[3], []]
    assert batch["labels"].dtype == torch.long
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 6, 0], [IGNORE_INDEX] * 3]


# ---- errors -----------------------------------------------------------------------------------------------------


def test_empty_batch_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"empty batch.*no examples"):
        PaddingCollator(PAD, EOS, 8)([])


def test_missing_pad_id_names_the_fix() -> None:
    with pytest.raises(ValueError, match="pad token") as info:
        PaddingCollator(None, EOS, 8)
    assert "pad_token" in str(info.value)


@pytest.mark.parametrize(
    ("kw", "key", "choices"),
    [({"mode": "packed"}, "padding", "mask, pack"), ({"overflow": "drop"}, "overflow", "split, truncate")],
)
def test_unknown_choices_list_valid_values(kw: dict, key: str, choices: str) -> None:
    with pytest.raises(ValueError) as info:
        PaddingCollator(PAD, EOS, 8, **kw)
    assert key in str(info.value) and choices in str(info.value)


def python_true_length(row: list[int], pad: int, eos: int | None) -> int:
    """Reference: strip the trailing pad run; with pad == EOS, give the first EOS of that run back."""
    n = len(row)
    while n and row[n - 1] == pad:
        n -= 1
    if pad == eos and n and n < len(row):
        n += 1
    return n


@settings(max_examples=25, deadline=None)
@given(
    data=st.lists(st.lists(st.integers(0, 3), min_size=6, max_size=6), min_size=1, max_size=5),
    pad_is_eos=st.booleans(),
)
def test_true_lengths_matches_python_reference(data: list[list[int]], pad_is_eos: bool) -> None:
    pad, eos = (0, 0) if pad_is_eos else (0, 1)
    got = true_lengths(torch.tensor(data), pad, eos).tolist()
    assert got == [python_true_length(r, pad, eos) for r in data]
    batch = PaddingCollator(pad, eos, 6)([torch.tensor(r) for r in data])
    check_invariants(batch, 6)
    assert batch["total_tokens"] == got


@pytest.mark.parametrize("mode", ["mask", "pack"])
def test_batch_counts_examples_not_rows(mode: str) -> None:
    """The sample clock: 4 examples (one empty), however many rows packing or splitting makes of them."""
    rows = [
        torch.tensor([5, 6, EOS, 7, EOS]),
        torch.tensor([PAD, PAD]),
        torch.tensor([8, EOS, PAD]),
        torch.arange(1, 12),
    ]
    batch = PaddingCollator(PAD, EOS, 4, mode=mode)(rows)
    assert sum(batch["examples"]) == 4 and len(batch["examples"]) == batch["input_ids"].shape[0] != 4
