"""Exact or refused: family x backend x {pack, mask} x checkpointing against stock transformers, doc by doc."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers

from foundry_attn.attention.backends import NAMES
from foundry_attn.path.attach import attach
from foundry_attn.selection.capability import probe
from foundry_attn.verify import conformance
from tests.conftest import leaky_attention

#: (family, backend) -> a phrase the refusal must contain; every other cell must be exact
REFUSED = {
    # transformers 5.x drops sdpa from Gemma2's class flags, so the refusal names that first
    ("gemma2", "sdpa"): ("cannot apply Gemma2ForCausalLM's attention logit softcap", "Gemma2ForCausalLM has no sdpa"),
    ("gemma2", "flex_attention"): ("cannot apply Gemma2ForCausalLM's attention logit softcap", "no backward"),
    ("gpt2", "flex_attention"): ("has no flex_attention support", "no backward"),
}
#: 4.51's GPT-2 passes no **kwargs to attention (5.x does): one document per row, exact; and stock FA2 cannot run
#: GPT-2 in fp32 on either stack (it looks for an nn.Linear; GPT-2's are Conv1D), so there is nothing to prove the
#: flat path against: rows (exact) in the FA2 column on both
ROWS = {("gpt2", b) for b in ("sdpa", "eager")} if transformers.__version__.startswith("4.") else set()
ROWS.add(("gpt2", "flash_attention_2"))
#: torch after 2.7 has no FlexAttention backward on the CPU: the policy refuses flex for training there
NO_FLEX_BACKWARD = probe().flex_backward_error is not None
#: GPT-NeoX's HF gradient checkpointing drops **kwargs in 4.51: rows from the first forward on (5.x: flat)
DROPS_KWARGS = {("gpt_neox", kind) for kind in ("hf_reentrant", "hf_non_reentrant")}
#: every cell the test below computed, for the docs check after it
CELLS: list[conformance.Cell] = []


@pytest.mark.slow
@pytest.mark.parametrize("family", list(conformance.FAMILIES))
def test_every_cell_is_exact_or_refused(family: str) -> None:
    for backend in NAMES:
        for mode in conformance.MODES:
            for kind in conformance.CHECKPOINTING if mode == "pack" else ("plain",):
                c = conformance.cell(family, backend, mode, kind)
                CELLS.append(c)
                where = f"{family}/{backend}/{mode}/{kind}: {c}"
                if backend == "torch_varlen" and not torch.cuda.is_available():  # tests/attention/test_torch_varlen.py
                    assert c.status == "refused" and ("CUDA" in c.detail or "varlen" in c.detail), where
                elif backend == "flex_attention" and NO_FLEX_BACKWARD and (family, backend) not in REFUSED:
                    assert c.status == "refused" and "no backward" in c.detail, where
                elif (family, backend) in REFUSED:
                    phrases = REFUSED[family, backend]
                    phrases = (phrases,) if isinstance(phrases, str) else phrases
                    assert c.status == "refused" and any(p in c.detail for p in phrases), where
                elif (family, kind) in DROPS_KWARGS and transformers.__version__.startswith("4."):
                    assert c.status == "exact" and c.path == "rows" and "did not reach" in c.detail, where
                    assert "gradient checkpointing" in c.detail, where
                else:
                    assert c.status == "exact", where
                    assert c.path == ("rows" if (family, backend) in ROWS else "flat"), where


@pytest.mark.slow
def test_the_docs_table_is_the_one_the_code_computes() -> None:
    """docs/conformance.md holds ``foundry-attn conformance --markdown`` for this stack (torch versions aside)."""
    if {c.family for c in CELLS} != set(conformance.FAMILIES):
        pytest.skip("runs after test_every_cell_is_exact_or_refused over every family")
    table = conformance.table(CELLS)  # what `foundry-attn conformance --markdown` prints
    docs = (Path(__file__).resolve().parents[2] / "docs" / "conformance.md").read_text()

    def same(text: str) -> str:
        return re.sub(r"torch \d[\w.+]*", "torch <version>", text)

    assert same(table) in same(docs), f"regenerate docs/conformance.md's table for this stack:\n{table}"


def test_the_proof_catches_a_broken_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flat function that ignores the documents fails the proof against stock: the model moves to rows."""
    from transformers.modeling_utils import AttentionInterface

    model = conformance.build("llama", "sdpa")
    assert attach(model, "sdpa").path == "flat"

    leaky = leaky_attention()  # takes the documents, ignores them: plain causal attention over the whole row
    monkeypatch.setitem(AttentionInterface._global_mapping, "foundry_sdpa", leaky)
    state = attach(model, "sdpa")
    assert state.path == "rows" and "differ from stock sdpa" in state.reason, state.reason
    assert model.config._attn_implementation == "sdpa" and model.training  # stock name, mode restored


def test_table_lists_every_family() -> None:
    cells = [conformance.Cell("llama", b, "pack", "plain", "exact") for b in NAMES]
    cells.append(conformance.Cell("gpt2", "flex_attention", "pack", "plain", "refused", "no flex"))
    table = conformance.table(cells)
    assert table.count("\n") == len(conformance.FAMILIES) + 1 and "refused: no flex" in table


def test_strict_with_reference_is_recorded(tmp_path) -> None:
    from foundry_attn.selection.decision import decide

    config, _ = conformance.FAMILIES["llama"]()
    d = decide(None, "flash_attention_2", ("flash_attention_2", "sdpa"), strict=True, fa2_reference=True, config=config)
    assert d.strict and d.as_dict()["strict"] is True and d.chosen == "flash_attention_2"


def test_a_bad_config_override_is_not_blamed_on_attention(assets, tmp_path, caplog) -> None:
    from foundry_attn.integrations.llm_foundry.model import FoundryAttnCausalLM

    with pytest.raises(ValueError, match="config does not have attribute"):
        FoundryAttnCausalLM(
            tokenizer=None,
            pretrained_model_name_or_path=str(assets / "tiny-llama"),
            pretrained=False,
            events_dir=str(tmp_path),
            config_overrides={"no_such_key": 1},
        )
    assert "building with" not in caplog.text


def test_model_records_the_proof(assets, tmp_path) -> None:
    from foundry_attn.integrations.llm_foundry.model import FoundryAttnCausalLM

    model = FoundryAttnCausalLM(
        tokenizer=None,
        pretrained_model_name_or_path=str(assets / "tiny-llama"),
        pretrained=False,
        events_dir=str(tmp_path),
        attn_implementation="eager",
    )
    assert model.attn_decision.proof.startswith("passed in") and model.attn_decision.path == "flat"
    assert model.model.config._attn_implementation == "foundry_eager" and model.attn_implementation == "eager"
    assert next(model.parameters()).dtype == torch.float32


def test_the_proof_at_build_can_be_left_to_the_first_batch(assets, tmp_path) -> None:
    from foundry_attn.integrations.llm_foundry.model import FoundryAttnCausalLM

    keys = dict(tokenizer=None, pretrained_model_name_or_path=str(assets / "tiny-llama"), pretrained=False)
    model = FoundryAttnCausalLM(**keys, events_dir=str(tmp_path), attn_prove_at_build=False)
    assert model.attn_decision.proof == "off"  # attn_prove_at_build: false; the first training batch proves
