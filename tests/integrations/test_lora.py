"""LoRA through LLM-Foundry's ``peft_config``: ours trains exactly as stock ``hf_causal_lm``, and exports like it.

The same LoRA config on both (``peft_type: LORA, task_type: CAUSAL_LM, r: 4, lora_alpha: 8, lora_dropout: 0.0,
target_modules: [q_proj, v_proj]``), the same pretrained tiny Llama, the same batches of our loader: ours gets
them as the loader made them (``padding: pack``: documents end to end in a row; ``padding: mask``: one document
per row with a 2-D mask), stock gets one document per row, right-padded with a 2-D mask, the per-document truth
(``tests/flat/test_equivalence.py``). Three SGD steps: the loss and every LoRA gradient at each step (fp32: loss 1e-5,
gradients 1e-4 relative to the tensor's largest). Then the ``hf_checkpointer`` export of ours' adapter loads with
``PeftModel.from_pretrained`` on the base and gives the trained model's logits.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("peft", reason="needs peft (the [foundry] extra)")

from foundry_attn.flat.packing import IGNORE_INDEX
from tests.integrations.test_dropin_matrix import OURS, STOCK, save_pretrained_llama

pytestmark = pytest.mark.foundry

PEFT_CONFIG = {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "r": 4,
    "lora_alpha": 8,
    "lora_dropout": 0.0,
    "target_modules": ["q_proj", "v_proj"],
}
MAX_SEQ_LEN = 128
STEPS = 3
LR = 0.5  # SGD: exact to follow (Adam would turn float noise in a ~0 gradient into a full step)


@pytest.fixture(scope="module")
def pretrained(assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_pretrained_llama(assets, tmp_path_factory.mktemp("lora") / "tiny-llama-pretrained")


def build(name: str, tokenizer: Any, pretrained: Path, events: Path, attn: str = "auto") -> Any:
    """``name`` with the LoRA config through LLM-Foundry's registry, as a YAML builds it, seeded."""
    from composer.utils import reproducibility
    from llmfoundry.utils.builders import build_composer_model

    cfg: dict[str, Any] = {
        "pretrained_model_name_or_path": str(pretrained),
        "pretrained": True,
        "peft_config": dict(PEFT_CONFIG),
    }
    if attn != "auto":
        cfg["attn_implementation"] = attn
    if name == OURS:
        cfg["events_dir"] = str(events)
    reproducibility.seed_all(17)
    return build_composer_model(name=name, cfg=cfg, tokenizer=tokenizer)


def assert_same_start(stock: Any, ours: Any) -> None:
    """One seed, the same model: the base loads identically and LoRA initialises identically (our build's
    probes draw nothing from the global RNG; issue 22, item 1)."""
    want, got = stock.model.state_dict(), ours.model.state_dict()
    assert want.keys() == got.keys() and any("lora_A" in k for k in want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def per_document(batch: dict) -> dict:
    """Stock's view of a batch: each document in its own row (its labels as the loader made them, so prompt
    masking and the per-document first target stay), right-padded, with a 2-D mask."""
    docs = []
    for r, lens in enumerate(batch["doc_lens"]):
        start = 0
        for n in lens:
            docs.append((batch["input_ids"][r, start : start + n], batch["labels"][r, start : start + n]))
            start += n
    width = max(len(ids) for ids, _ in docs)
    input_ids = torch.zeros(len(docs), width, dtype=torch.long)  # the pad (masked, no target)
    labels = torch.full((len(docs), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros(len(docs), width, dtype=torch.long)
    for i, (ids, lab) in enumerate(docs):
        input_ids[i, : len(ids)], labels[i, : len(ids)], mask[i, : len(ids)] = ids, lab, 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


def batches(tokenizer: Any, assets: Path, padding: str, n: int) -> list[dict]:
    from foundry_attn.integrations.llm_foundry.dataloaders import build_text_dataloader

    spec = build_text_dataloader(
        tokenizer,
        8,
        {"local": str(assets / "text"), "split": "train", "max_seq_len": MAX_SEQ_LEN, "shuffle": False},
        padding=padding,
        num_workers=0,
        prefetch_factor=None,
        persistent_workers=False,
        pin_memory=False,
    )
    return list(itertools.islice(spec.dataloader, n))


def lora_grads(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def step(model: Any, optimizer: torch.optim.Optimizer, batch: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """One Composer-style step: ``model.forward``, ``model.loss``, backward; the loss and the LoRA gradients."""
    optimizer.zero_grad(set_to_none=True)
    loss = model.loss(model(batch), batch)
    loss.backward()
    grads = lora_grads(model)
    optimizer.step()
    return float(loss), grads


@pytest.mark.parametrize("padding", ["pack", "mask"])
@pytest.mark.parametrize("attn", ["auto", "sdpa"])
def test_lora_trains_as_stock(
    tokenizer: Any, assets: Path, pretrained: Path, tmp_path: Path, padding: str, attn: str
) -> None:
    from foundry_attn.path.state import FLAT, path_of

    stock = build(STOCK, tokenizer, pretrained, tmp_path, attn)
    ours = build(OURS, tokenizer, pretrained, tmp_path, attn)
    assert type(ours.model).__name__ == type(stock.model).__name__ == "PeftModelForCausalLM"
    assert_same_start(stock, ours)
    trainable = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert trainable == [n for n, p in stock.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    stock.train(), ours.train()
    opt_stock = torch.optim.SGD([p for p in stock.parameters() if p.requires_grad], lr=LR)
    opt_ours = torch.optim.SGD([p for p in ours.parameters() if p.requires_grad], lr=LR)
    losses = []
    for batch in batches(tokenizer, assets, padding, STEPS):
        if padding == "pack":
            assert len(batch["doc_lens"]) < sum(map(len, batch["doc_lens"]))  # documents share rows
        # mask: the very batch (one document per row already); pack: the documents taken apart
        truth = (
            per_document(batch)
            if padding == "pack"
            else {k: batch[k] for k in ("input_ids", "labels", "attention_mask")}
        )
        want_loss, want = step(stock, opt_stock, truth)
        got_loss, got = step(ours, opt_ours, batch)
        assert got_loss == pytest.approx(want_loss, rel=1e-5), (got_loss, want_loss)
        assert got.keys() == want.keys()
        for name, g in want.items():
            scale = float(g.abs().max())
            assert float((got[name] - g).abs().max()) <= 1e-4 * max(scale, 1e-12), name
        assert any(float(g.abs().max()) > 0 for n, g in want.items() if "lora_A" in n) or len(losses) == 0
        losses.append(got_loss)
    assert losses[-1] < losses[0]  # LoRA trains
    state = path_of(ours.model)  # the proof found the HF model inside the PeftModel, and holds on LoRA
    assert state is not None and state.path == FLAT and state.schedule.proven_on_batch, state


@pytest.mark.slow
def test_lora_export_loads_with_peft(tokenizer: Any, assets: Path, pretrained: Path, tmp_path: Path) -> None:
    """``hf_checkpointer`` on ours with LoRA writes the adapter; peft loads it on the base, same logits."""
    from composer import Trainer
    from llmfoundry.callbacks import HuggingFaceCheckpointer
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from foundry_attn.integrations.llm_foundry.dataloaders import build_text_dataloader

    ours = build(OURS, tokenizer, pretrained, tmp_path / "events")
    spec = build_text_dataloader(
        tokenizer,
        8,
        {"local": str(assets / "text"), "split": "train", "max_seq_len": MAX_SEQ_LEN, "shuffle": False},
        padding="pack",
        drop_last=True,
        num_workers=0,
        prefetch_factor=None,
        persistent_workers=False,
        pin_memory=False,
    )
    trainer = Trainer(
        model=ours,
        train_dataloader=spec,
        max_duration="2ba",
        optimizers=torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=1e-2),
        callbacks=[HuggingFaceCheckpointer(save_folder=str(tmp_path / "hf"), save_interval="2ba")],
        precision="fp32",
        device="cpu",
        progress_bar=False,
        save_folder=None,
    )
    trainer.fit()
    trainer.close()
    export = tmp_path / "hf" / "huggingface" / "ba2"
    assert (export / "adapter_config.json").exists() and (export / "adapter_model.safetensors").exists()
    assert not (export / "model.safetensors").exists()  # the adapter only (should_save_peft_only)
    base = AutoModelForCausalLM.from_pretrained(pretrained, torch_dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, export).eval()
    assert any(float(p.abs().max()) > 0 for n, p in loaded.named_parameters() if "lora_B" in n)  # it trained
    ids = torch.tensor([tokenizer("the red cat sees a big dog . the old fox").input_ids])
    ours.eval()
    with torch.no_grad():
        want = ours.model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
        untrained = base.__class__.from_pretrained(pretrained)(input_ids=ids).logits
    assert float((want - untrained).abs().max()) > 1e-3  # the adapter changes the logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
