"""The inspector's verdict on packed documents, against the leak measured independently, in real Composer runs.

Models: stock ``hf_causal_lm`` (sdpa), LLM-Foundry's MPT (torch attention, with and without
``attn_uses_sequence_id``) and ours; loaders: ours (``pack`` and ``mask``) and LLM-Foundry's text collation
(rows of concatenated text, no boundaries). The truth: the Composer model's own forward on the packed batch
against the same forward on each document alone, the documents read from the collator's ``doc_lens``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from foundry_attn.flat.packing import PaddingCollator
from foundry_attn.observe.verdict import ISOLATED, LEAKS, NOT_PACKED

pytestmark = pytest.mark.foundry

WIDTH = 48


def _docs(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 16, (n,), generator=gen).tolist()
    return [[*torch.randint(2, len(tokenizer), (k,), generator=gen).tolist(), tokenizer.eos_token_id] for k in lengths]


def _model(kind: str, assets: Path, tokenizer, tmp_path: Path):
    torch.manual_seed(0)
    if kind.startswith("hf_"):
        from llmfoundry.models.hf import ComposerHFCausalLM

        return ComposerHFCausalLM(
            tokenizer=tokenizer,
            pretrained_model_name_or_path=str(assets / "tiny-llama"),
            pretrained=False,
            attn_implementation=kind.removeprefix("hf_"),
        )
    if kind.startswith("mpt"):
        from llmfoundry.models.mpt import ComposerMPTCausalLM

        return ComposerMPTCausalLM(
            tokenizer=tokenizer,
            loss_fn="torch_crossentropy",
            d_model=32,
            n_heads=4,
            n_layers=2,
            expansion_ratio=2,
            max_seq_len=WIDTH,
            vocab_size=len(tokenizer),
            attn_config={"attn_impl": "torch", "attn_uses_sequence_id": kind == "mpt_sequence_id"},
        )
    from foundry_attn.integrations.llm_foundry.model import FoundryAttnCausalLM

    return FoundryAttnCausalLM(
        tokenizer=tokenizer,
        pretrained_model_name_or_path=str(assets / "tiny-llama"),
        pretrained=False,
        events_dir=str(tmp_path / "ev"),
    )


def _collate(loader: str, tokenizer):
    if loader == "stock_text":  # LLM-Foundry's text collation: fixed rows of concatenated documents, no boundaries
        from transformers import DataCollatorForLanguageModeling

        stock = DataCollatorForLanguageModeling(tokenizer, mlm=False)

        def concat(examples: list[list[int]]) -> dict:
            flat = [t for e in examples for t in e]
            rows = [flat[i : i + 32] for i in range(0, len(flat) - 31, 32)]
            return stock([{"input_ids": r} for r in rows])

        return concat
    return PaddingCollator(tokenizer.pad_token_id, tokenizer.eos_token_id, WIDTH, mode=loader)


def _logits(model, batch: dict) -> torch.Tensor:
    from foundry_attn.path.forward import repad_logits

    out = model(batch)
    logits = out["logits"] if isinstance(out, dict) else out.logits
    return logits if logits.shape[:2] == batch["input_ids"].shape[:2] else repad_logits(out)


def _packed(batch: dict) -> list[tuple[int, int, list[int]]]:
    """(row, start, lengths) of the rows that hold two documents or more, read from the collator's own ``doc_lens``
    (ours: documents from the start of each row; LLM-Foundry's text collation gives no boundaries), not with the
    code under test (``layout.packed_rows``)."""
    return [(r, 0, list(lengths)) for r, lengths in enumerate(batch.get("doc_lens") or []) if len(lengths) >= 2]


def _true_leak(model, batch: dict, tokenizer) -> bool | None:
    """The Composer model's forward on the packed rows against the same forward on each document alone (eval
    mode): True when a document's logits differ, None when no row holds two documents."""
    rows = _packed(batch)
    if not rows:
        return None
    one = PaddingCollator(tokenizer.pad_token_id, tokenizer.eos_token_id, WIDTH, mode="mask")
    model.eval()
    try:
        with torch.no_grad():
            packed = _logits(model, batch)
            worst = 0.0
            for r, start, lengths in rows:
                offset = start
                for n in lengths:
                    doc = batch["input_ids"][r, offset : offset + n]
                    alone_batch = one([doc])
                    alone_batch["sequence_id"] = torch.zeros_like(alone_batch["input_ids"])
                    alone = _logits(model, {k: v for k, v in alone_batch.items() if k != "labels"})[0, :n]
                    worst = max(worst, (packed[r, offset : offset + n] - alone).abs().max().item())
                    offset += n
    finally:
        model.train()
    return worst > 1e-4


MATRIX = [
    ("hf_sdpa", "pack", LEAKS),
    ("hf_sdpa", "mask", NOT_PACKED),
    ("hf_sdpa", "stock_text", NOT_PACKED),
    ("hf_eager", "stock_text", NOT_PACKED),  # 4.51's q x (q+1) eager masks: no false "hides" either
    ("mpt", "pack", LEAKS),
    ("mpt_sequence_id", "pack", ISOLATED),
    ("mpt_sequence_id", "mask", NOT_PACKED),
    ("mpt", "stock_text", NOT_PACKED),
    ("ours", "pack", ISOLATED),
    ("ours", "mask", NOT_PACKED),
    ("ours", "stock_text", NOT_PACKED),
]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "loader", "expected"), MATRIX, ids=[f"{m}-{lo}" for m, lo, _ in MATRIX])
def test_verdict_matches_the_leak_measured_independently(
    kind: str, loader: str, expected: str, assets: Path, tokenizer, tmp_path: Path, caplog
) -> None:
    from composer import Trainer
    from composer.loggers import InMemoryLogger
    from torch.utils.data import DataLoader

    from foundry_attn.integrations.composer.attention_inspector import AttentionInspector
    from foundry_attn.integrations.composer.upad_tracer import UpadTracer

    model = _model(kind, assets, tokenizer, tmp_path)
    collate = _collate(loader, tokenizer)
    docs = _docs(tokenizer, 24)
    inspector = AttentionInspector(
        log_interval=1, verdict_interval=2, print_table=False, events_dir=str(tmp_path / "ev")
    )
    memory = InMemoryLogger()
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(docs, batch_size=8, collate_fn=collate),
        max_duration="3ba",
        callbacks=[inspector, UpadTracer(log_interval=1, events_dir=str(tmp_path / "ev"))],
        loggers=[memory],
        device="cpu",
        precision="fp32",
        progress_bar=False,
        log_to_console=False,
        optimizers=torch.optim.SGD(model.parameters(), lr=1e-3),
        run_name="leak",
        seed=0,
    )
    with caplog.at_level(logging.INFO, logger="foundry_attn"):
        trainer.fit()
    verdict = inspector.last_verdict
    assert verdict is not None and verdict.state == expected, verdict
    if loader == "stock_text":  # no padding, no documents: the mask hides nothing at any level
        assert inspector.last_records and not any(r.get("has_zeros") for r in inspector.last_records)
    truth = _true_leak(model, collate(docs[16:24]), tokenizer)
    assert {None: NOT_PACKED, True: LEAKS, False: ISOLATED}[truth] == expected
    series = [v for _, v in memory.data.get("attn/documents_isolated", [])]
    if expected == NOT_PACKED:
        assert series == []
        return
    assert series == [float(expected == ISOLATED)] * 2  # batches 0 and 2 (verdict_interval 2), reported once each
    assert verdict.how == "measured" and verdict.row is not None and len(verdict.lengths) >= 2
    lines = [r.getMessage() for r in caplog.records if "documents" in r.getMessage()]
    assert any(
        "batch 0:" in line and ("isolated" in line if expected == ISOLATED else "LEAK" in line) for line in lines
    )
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "fix:" in r.getMessage()]
    if expected == LEAKS:
        fix = "attn_uses_sequence_id: true" if kind.startswith("mpt") else "foundry_attn_causal_lm"
        assert any(fix in w for w in warnings), warnings
        assert len([w for w in warnings if "packed documents attend" in w]) == 1  # once, not per batch
        assert any("at fit start" in w or "train loader packs" in w for w in warnings)  # said before training
    else:
        assert warnings == []


@pytest.mark.parametrize("padding", ["pack", "mask"])
def test_mpt_with_sequence_id_trains_our_packed_batches_exactly(
    padding: str, assets: Path, tokenizer, tmp_path: Path
) -> None:
    """MPT (``attn_uses_sequence_id: true``, torch attention, learned positions) on our batches: loss and gradients
    equal MPT's on each document alone (one document per row, padded)."""
    model = _model("mpt_sequence_id", assets, tokenizer, tmp_path)
    docs = [torch.tensor(d) for d in _docs(tokenizer, 10, seed=1)]
    batch = PaddingCollator(tokenizer.pad_token_id, tokenizer.eos_token_id, WIDTH, mode=padding)(docs)
    alone = PaddingCollator(tokenizer.pad_token_id, tokenizer.eos_token_id, WIDTH, mode="mask")(docs)
    alone["sequence_id"] = torch.zeros_like(alone["input_ids"])  # one document per row: the mask alone separates
    if padding == "pack":
        assert any(len(row) > 1 for row in batch["doc_lens"])

    def loss_and_grads(b: dict) -> tuple[float, list[torch.Tensor]]:
        model.zero_grad()
        loss = model.loss(model(b), b)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    got, got_grads = loss_and_grads(batch)
    want, want_grads = loss_and_grads(alone)
    assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (got, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert (g - w).norm() <= 1e-4 * w.norm().clamp_min(1e-12)
