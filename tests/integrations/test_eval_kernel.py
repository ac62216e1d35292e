"""Eval and generation run on the chosen kernel: under FA2 (here the pure-PyTorch reference kernel, through
transformers' real FA2 code path), an ICL eval and ``generate`` call the FA2 kernel (varlen or dense), counted by
the flash-symbol tracer, and give stock's results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from foundry_attn.observe.flash_calls import FlashCallTracer
from foundry_attn.observe.flash_symbols import DENSE, VARLEN
from tests.integrations.test_dropin_matrix import OURS, STOCK, icl_tasks, metrics_of, save_pretrained_llama, write_icl

pytestmark = [pytest.mark.foundry, pytest.mark.slow]

FA2_REFERENCE = {"attn_implementation": "flash_attention_2", "fa2_reference_kernel": True}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("eval_kernel")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(path)  # LLM-Foundry copies ICL datasets into the cwd
        yield path


@pytest.fixture(scope="module")
def pretrained(assets: Path, work: Path) -> Path:
    return save_pretrained_llama(assets, work / "tiny-llama-pretrained")


def build(name: str, tokenizer: Any, pretrained: Path, events: Path, **extra: Any) -> Any:
    from llmfoundry.utils.builders import build_composer_model

    cfg = {"pretrained_model_name_or_path": str(pretrained), "pretrained": True, **extra}
    if name == OURS:
        cfg["events_dir"] = str(events)
    return build_composer_model(name=name, cfg=cfg, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def fa2(tokenizer: Any, pretrained: Path, work: Path) -> Any:
    model = build(OURS, tokenizer, pretrained, work / "events", **FA2_REFERENCE)
    assert model.attn_decision.chosen == "flash_attention_2" and model.attn_implementation == "flash_attention_2"
    return model.eval()


@pytest.fixture(scope="module")
def stock(tokenizer: Any, pretrained: Path, work: Path) -> Any:
    return build(STOCK, tokenizer, pretrained, work / "events", attn_implementation="sdpa").eval()


def icl_eval(model: Any, tokenizer: Any, work: Path) -> tuple[dict[str, float], dict[str, int]]:
    """LLM-Foundry's ICL evaluators (language modeling, multiple choice) run by Composer; metrics, FA2 calls."""
    from composer import Trainer
    from llmfoundry.utils.builders import build_icl_evaluators

    (work / "icl").mkdir(exist_ok=True)
    evaluators, _ = build_icl_evaluators(
        icl_tasks(write_icl(work / "icl")), tokenizer, 128, 4, destination_dir=str(work)
    )
    trainer = Trainer(model=model, eval_dataloader=evaluators, device="cpu", precision="fp32", progress_bar=False)
    with FlashCallTracer(record=False) as tracer:
        trainer.eval()
    metrics = metrics_of(trainer)
    trainer.close()
    return metrics, dict(tracer.counts)


def test_icl_eval_calls_the_fa2_kernel(fa2: Any, stock: Any, tokenizer: Any, work: Path) -> None:
    metrics, counts = icl_eval(fa2, tokenizer, work)
    assert counts[VARLEN] + counts[DENSE] > 0, counts
    want, stock_counts = icl_eval(stock, tokenizer, work)
    assert stock_counts[VARLEN] + stock_counts[DENSE] == 0  # (sdpa: the tracer sees nothing)
    assert metrics.keys() == want.keys()
    for key, value in want.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_generate_calls_the_fa2_kernel(fa2: Any, stock: Any, tokenizer: Any) -> None:
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(["the red cat sees a", "the big old dog chases a small fox"], return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = "right"
    kwargs = dict(
        attention_mask=enc["attention_mask"],
        max_new_tokens=6,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
    )
    with torch.no_grad(), FlashCallTracer(record=False) as tracer:
        got = fa2.generate(enc["input_ids"], **kwargs)
    counts = dict(tracer.counts)
    # a prefill and 5 one-token steps with the cache, 2 layers each: every attention call reaches the kernel
    assert counts[VARLEN] + counts[DENSE] >= 6 * 2, counts
    with torch.no_grad():
        want = stock.generate(enc["input_ids"], **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), atol=1e-5, rtol=1e-5)
