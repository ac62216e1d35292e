"""Tail padding in axolotl's packed rows is padding: in every fill and real-token count, in the rows the verdict
judges, and never one of the proof's documents.

axolotl's ``V2BatchSamplerDataCollatorForSeq2Seq`` pads each packed row with a segment of its own (``position_ids``
``0..remainder``, the pad id, labels -100, ``attention_mask`` 0) and axolotl drops the mask before an sdpa or eager
model. The rows here are that collator's own output where axolotl is installed, and a hand-built row in its exact
format otherwise.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from foundry_attn.flat.layout import packed_rows, padding_spans
from foundry_attn.observe.probe import BatchInfo

PAD = 0
LENGTHS = [[20, 9, 30], [41, 7]]  # two packed rows; the collator pads each to 64


def axolotl_row() -> dict[str, torch.Tensor]:
    """One row of 16 as axolotl packs it once the mask is dropped: documents of 5 and 4 tokens, then 7 of padding
    (positions 0..6, the pad id, labels -100)."""
    ids = [3, 4, 5, 6, 7, 8, 9, 10, 11] + [PAD] * 7
    return {
        "input_ids": torch.tensor([ids]),
        "labels": torch.tensor([ids[:9] + [-100] * 7]),
        "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6]]),
    }


def test_a_known_row_counts_its_padding_as_padding() -> None:
    row = axolotl_row()
    assert padding_spans(row) == [(0, 9, 16)]
    info = BatchInfo.from_batch(row)
    assert (info.real_tokens, info.positions, info.fill_ratio) == (9, 16, 9 / 16)
    assert packed_rows(row)[0].lengths == (5, 4)  # the verdict's documents: the padding is none of them
    alone = {k: v[:, :5] for k, v in row.items()}  # one document, then the padding: not a packed row
    alone = {k: torch.cat([v, row[k][:, 9:]], dim=1) for k, v in alone.items()}
    assert packed_rows(alone) == [] and BatchInfo.from_batch(alone).real_tokens == 5
    # a document with targets, or one of several ids, is never padding, nor is a 1-token segment inside a row
    real = {**row, "labels": row["input_ids"].clone()}
    assert padding_spans(real) == [] and BatchInfo.from_batch(real).real_tokens == 16
    one = {k: v[:, :10] for k, v in row.items()}  # the padding cut to one token at the row's end: still padding
    assert padding_spans(one) == [(0, 9, 10)]
    assert padding_spans({k: torch.cat([v[:, :6], v[:, 9:10], v[:, 5:9]], 1) for k, v in row.items()}) == []


def _features(tokenizer: Any) -> list[list[dict]]:
    torch.manual_seed(0)
    rows = []
    for row in LENGTHS:
        feats = []
        for n in row:
            ids = torch.randint(2, len(tokenizer), (n,)).tolist()
            feats.append({"input_ids": ids, "labels": ids, "attention_mask": [1] * n, "position_ids": list(range(n))})
        rows.append(feats)
    return rows


@pytest.fixture(scope="module")
def collated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """axolotl's own V2 collator on two packed rows of documents (20, 9, 30 | 41, 7), padded to 64."""
    pytest.importorskip("axolotl", reason="needs axolotl (make test-axolotl installs it in .venv-axolotl)")
    from axolotl.utils.collators.batching import V2BatchSamplerDataCollatorForSeq2Seq

    from foundry_attn.integrations.llm_foundry.assets import build_tokenizer

    tokenizer = build_tokenizer(tmp_path_factory.mktemp("tokenizer") / "tokenizer")
    collator = V2BatchSamplerDataCollatorForSeq2Seq(tokenizer, padding=True, pad_to_multiple_of=64, return_tensors="pt")
    return dict(collator(copy.deepcopy(_features(tokenizer))))


def test_axolotls_collated_rows_count_their_padding_with_the_mask_or_without(collated: dict) -> None:
    real = sum(map(sum, LENGTHS))  # 107 of 128
    dropped = {k: v for k, v in collated.items() if k != "attention_mask"}  # what an sdpa or eager model is given
    assert padding_spans(dropped) == [(0, 59, 64), (1, 48, 64)]
    for batch in (collated, dropped):
        info = BatchInfo.from_batch(batch)
        assert (info.real_tokens, info.positions) == (real, 128), batch.keys()
        assert [r.lengths for r in packed_rows(batch)] == [tuple(n) for n in LENGTHS]


def test_the_proof_never_picks_padding(collated: dict) -> None:
    """The proof of the first training batch runs two documents alone: real ones, never the padding segments (the
    flat row's documents are 20, 9, 30, 5 of padding, 41, 7, 16 of padding: the last of two tokens or more was a
    padding segment)."""
    from foundry_attn import attach
    from foundry_attn.integrations.axolotl.batches import read_packed
    from foundry_attn.proof.prove import pick, real_documents
    from tests.conftest import make_llama

    model = make_llama("sdpa", vocab_size=max(64, int(collated["input_ids"].max()) + 1))
    state = attach(model, "sdpa")
    flat, shape = read_packed({k: v for k, v in collated.items() if k != "attention_mask"})
    assert shape == (2, 64)
    model.train()
    model(**flat).loss.backward()
    proof = state.proofs[-1][1]
    assert proof.ok and proof.ran, proof.describe()
    assert sorted(proof.lengths) == [7, 41], proof.describe()  # the longest and the last real one

    from foundry_attn.attention.documents import Documents

    docs = Documents((0, 20, 29, 59, 64, 105, 112, 128))
    labels = flat["labels"]
    assert real_documents(docs, labels) == [0, 1, 2, 4, 5]
    assert pick(docs) == (4, 6) and pick(docs, real_documents(docs, labels)) == (4, 5)


def test_the_plugin_logs_true_numbers(tmp_path: Path) -> None:
    """The inspector's fill, real tokens and console table on a packed batch with tail padding (the HF Trainer
    callbacks the plugin installs read it the same way)."""
    from foundry_attn.observe.probe import ModelInspector, summarize
    from tests.conftest import make_llama

    row = axolotl_row()
    model = make_llama("sdpa")
    info = BatchInfo.from_batch(row)
    with ModelInspector(model).capture(info) as records:
        model(**row)
    metrics = summarize(records, info)
    assert metrics["attn/real_tokens"] == 9 and metrics["attn/fill_ratio"] == 9 / 16
    assert metrics["attn/compute_fill_ratio"] == 9 / 16
