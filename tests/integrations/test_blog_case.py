"""The public report that started it, reproduced on CPU with the FA2 reference kernel (``make blog-case``).

The report: a batch of 6 rows padded to max_seq_len 2048 with real lengths 220, 217, 295, 183, 130, 350.
Through transformers' stock FA2 path the 2-D padding mask makes every layer call ``_upad_input`` (a
``nonzero`` and an ``.item()`` host sync each) before ``flash_attn_varlen_func`` and ``pad_input`` after.
Through our unpad-once path (``foundry_attn.path.forward.forward_documents``) no layer unpads, and the same
cu_seqlens reach the varlen kernel directly.

    python tests/integrations/test_blog_case.py          # prints the comparison; exits non-zero if it does not hold
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from foundry_attn.attention.fa2_reference import reference_flash_attn
from foundry_attn.flat.packing import PaddingCollator
from foundry_attn.observe.console_table import format_table
from foundry_attn.observe.flash_calls import FlashCallTracer
from foundry_attn.observe.flash_symbols import DENSE, PAD, POSIDS, UPAD, VARLEN
from foundry_attn.observe.probe import BatchInfo, ModelInspector
from foundry_attn.path.attach import attach
from foundry_attn.path.forward import forward_documents, repad_logits
from foundry_attn.verify.llama_shapes import BLOG_LENGTHS

LENGTHS = BLOG_LENGTHS
MAX_SEQ_LEN = 2048
CU_SEQLENS = [0, 220, 437, 732, 915, 1045, 1395]
PAD_ID, VOCAB, LAYERS = 0, 64, 2


def tiny_fa2_llama(layers: int = LAYERS, seed: int = 0) -> torch.nn.Module:
    """A 2-layer, 32-wide random Llama whose config says flash_attention_2 (run it under the reference)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_SEQ_LEN,
        attention_dropout=0.0,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = "flash_attention_2"  # 4.51 switches by this attribute alone
    return model.eval()


def blog_rows(seed: int = 0) -> torch.Tensor:
    """The report's input: 6 rows of max_seq_len 2048, real tokens first, pad after (no mask: LLM-Foundry)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.full((len(LENGTHS), MAX_SEQ_LEN), PAD_ID, dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        rows[i, :n] = torch.randint(1, VOCAB, (n,), generator=gen)
    return rows


def blog_batch(seed: int = 0) -> dict[str, Any]:
    """Our collator in mask mode makes the padding real (``attention_mask`` from true lengths)."""
    return PaddingCollator(PAD_ID, None, MAX_SEQ_LEN, mode="mask")(list(blog_rows(seed)))


def stock_inputs(batch: dict[str, Any], width: int = MAX_SEQ_LEN) -> dict[str, torch.Tensor]:
    """The stock HF call as in the report: rows padded to max_seq_len, the 2-D mask, no position_ids.

    Our collator trims a batch to its longest row (350); the report's batch was padded to 2048, so the
    stock run pads back to 2048. cu_seqlens and max length do not depend on the width.
    """
    extra = width - batch["input_ids"].shape[1]
    return {
        "input_ids": torch.nn.functional.pad(batch["input_ids"], (0, extra), value=PAD_ID),
        "attention_mask": torch.nn.functional.pad(batch["attention_mask"], (0, extra), value=0),
    }


def run_stock(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[dict, list[dict], torch.Tensor]:
    inputs = stock_inputs(batch)
    inspector = ModelInspector(model)
    # tracer first, reference kernel inside: the layers compose in either order
    with (
        FlashCallTracer() as tracer,
        reference_flash_attn(),
        torch.no_grad(),
        inspector.capture(BatchInfo.from_batch(inputs)) as records,
    ):
        logits = model(**inputs, use_cache=False).logits
    return tracer.summary(), list(records), logits


def run_unpad_once(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[dict, list[dict], torch.Tensor]:
    inspector = ModelInspector(model)
    stock = model.config._attn_implementation
    attach(model, "flash_attention_2", fa2_reference=True)  # FA2 code paths, reference kernel per call
    try:
        with FlashCallTracer() as tracer, torch.no_grad(), inspector.capture(BatchInfo.from_batch(batch)) as records:
            out = forward_documents(model, {k: v for k, v in batch.items() if k != "labels"})
    finally:
        model.config._attn_implementation = stock
    return tracer.summary(), list(records), repad_logits(out)


# ---- tests -------------------------------------------------------------------------------------------------


def test_collator_makes_the_reports_padding_real() -> None:
    batch = blog_batch()
    assert batch["attention_mask"].sum(1).tolist() == list(LENGTHS)
    assert batch["doc_lens"] == [[n] for n in LENGTHS]
    assert stock_inputs(batch)["input_ids"].shape == (6, MAX_SEQ_LEN)


def test_blog_case_stock_unpads_every_layer_ours_never() -> None:
    model, batch = tiny_fa2_llama(), blog_batch()
    stock, stock_records, stock_logits = run_stock(model, batch)
    ours, our_records, our_logits = run_unpad_once(model, batch)

    # stock HF FA2: _upad_input once per layer per forward, then varlen, then pad_input
    assert stock["counts"] == {UPAD: LAYERS, POSIDS: 0, VARLEN: LAYERS, DENSE: 0, PAD: LAYERS}
    assert stock["entry"] == VARLEN
    assert stock["first"][UPAD]["cu_seqlens_q"] == CU_SEQLENS and stock["first"][UPAD]["max_seqlen_q"] == 350
    assert stock["first"][VARLEN]["cu_seqlens_q"] == CU_SEQLENS == stock["first"][VARLEN]["cu_seqlens_k"]
    assert stock["max_seqlen"] == 350

    # unpad once: no _upad_input, no position-id unpacking, no re-pad; the same cu_seqlens reach the kernel
    assert ours["counts"] == {UPAD: 0, POSIDS: 0, VARLEN: LAYERS, DENSE: 0, PAD: 0}
    assert ours["entry"] == VARLEN
    assert ours["cu_seqlens"] == CU_SEQLENS == ours["first"][VARLEN]["cu_seqlens_k"]
    assert ours["max_seqlen"] == 350 == ours["first"][VARLEN]["max_seqlen_k"]

    # the inspector sees it: a 2-D mask with zeros in every attention module of the stock run; none in ours
    stock_attn = [r for r in stock_records if r["level"] == "attention"]
    assert len(stock_attn) == LAYERS and all(r["mask"] == "2-D" and r["has_zeros"] for r in stock_attn)
    assert stock_attn[0]["fill_ratio"] == sum(LENGTHS) / (6 * MAX_SEQ_LEN)
    our_attn = [r for r in our_records if r["level"] == "attention"]
    assert len(our_attn) == LAYERS and all(r["mask"] == "none" and r["fill_ratio"] == 1.0 for r in our_attn)
    assert our_attn[0]["packed_positions"] and our_attn[0]["position_restarts"] == 5

    # and both compute the same thing on the real tokens
    for row, n in enumerate(LENGTHS):
        torch.testing.assert_close(our_logits[row, :n], stock_logits[row, :n], atol=1e-5, rtol=1e-5)


def test_inspector_mask_none_under_fa2_for_all_ones_present_with_padding() -> None:
    """transformers' _update_causal_mask drops an all-ones 2-D mask under FA2 and keeps one with zeros."""
    model = tiny_fa2_llama()
    ids = torch.randint(1, VOCAB, (2, 16))
    inspector = ModelInspector(model)
    with reference_flash_attn(), torch.no_grad():
        with inspector.capture() as full:
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
        padded_mask = torch.ones_like(ids)
        padded_mask[1, 10:] = 0
        with inspector.capture() as padded:
            model(input_ids=ids, attention_mask=padded_mask)
    levels = {r["level"] for r in full}
    assert levels == {"model", "layer", "attention"}
    model_rec = next(r for r in full if r["level"] == "model")
    assert model_rec["mask"] == "2-D" and model_rec["has_zeros"] is False
    assert model_rec["attn_implementation"] == "flash_attention_2"
    assert all(r["mask"] == "none" for r in full if r["level"] != "model")
    assert all(r["mask"] == "2-D" and r["has_zeros"] for r in padded)
    assert all(r["real_tokens"] == 26 and r["positions"] == 32 for r in padded)
    assert not inspector.armed and not model._forward_pre_hooks  # hooks gone after the capture


# ---- make blog-case ----------------------------------------------------------------------------------------


def main() -> int:
    model, batch = tiny_fa2_llama(), blog_batch()
    stock, stock_records, _ = run_stock(model, batch)
    ours, our_records, _ = run_unpad_once(model, batch)
    print(
        f"The report's batch: {len(LENGTHS)} rows x max_seq_len {MAX_SEQ_LEN}, real lengths {list(LENGTHS)}; "
        f"a {LAYERS}-layer Llama on the FA2 *reference* kernel (pure PyTorch, not flash-attn), CPU.\n"
    )
    for title, summary, records in (
        ("stock transformers FA2 path (2-D padding mask)", stock, stock_records),
        ("foundry_attn unpad-once path (forward_documents)", ours, our_records),
    ):
        c = summary["counts"]
        print(f"== {title}")
        print(
            f"   per forward: _upad_input {c[UPAD]}, prepare_fa2_from_position_ids {c[POSIDS]}, "
            f"flash_attn_varlen_func {c[VARLEN]}, flash_attn_func {c[DENSE]}, pad_input {c[PAD]}"
        )
        print(
            f"   cu_seqlens at the varlen kernel: {summary['first'].get(VARLEN, {}).get('cu_seqlens_q')}, "
            f"max_seqlen {summary['max_seqlen']}"
        )
        print("   " + format_table(records, "attention_inspector:").replace("\n", "\n   ") + "\n")
    ok = (
        stock["counts"][UPAD] == LAYERS
        and ours["counts"][UPAD] == 0
        and stock["cu_seqlens"] == ours["cu_seqlens"] == CU_SEQLENS
        and ours["max_seqlen"] == 350
    )
    print("REPRODUCED: stock unpads in every layer; unpad-once never does; same cu_seqlens" if ok else "NOT REPRODUCED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
