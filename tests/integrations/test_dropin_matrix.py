"""The drop-in matrix: swap ``hf_causal_lm`` for ``foundry_attn_causal_lm`` in a YAML and change nothing else.

For stock and ours, ``attn_implementation`` ``auto`` (stock: the key left out, which LLM-Foundry 0.22 builds as
eager; ours: ``auto``, sdpa on this CPU) and ``sdpa``, on a pretrained tiny Llama with LLM-Foundry's own loaders
(``text``) and callbacks:

- (a) the ``hf_checkpointer`` export reloads in plain transformers with the trained model's logits, and its
  ``config.json`` is stock's, byte for byte;
- (b) eval metrics (``eval_loader``) and an ICL task (language modeling, a local jsonl) equal stock's;
- (c) ``generate`` gives stock's tokens;
- (d) a stock Composer checkpoint resumes into ours and ours into stock, each trains on as the other would;
- (e) ``llmfoundry eval`` (``eval_from_yaml``) on ours equals stock.

One training run per cell (2 batches, the export and a Composer checkpoint at the end, then eval and ICL) and
one ``llmfoundry eval`` of the four cells are shared by the module.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.foundry, pytest.mark.slow]

STOCK, OURS = "hf_causal_lm", "foundry_attn_causal_lm"
ATTNS = ("auto", "sdpa")
CELLS = [(name, attn) for attn in ATTNS for name in (STOCK, OURS)]
MAX_SEQ_LEN = 128
ICL_LABELS = ("tiny_lm", "tiny_mc")
TOL = dict(atol=1e-5, rtol=1e-5)  # fp32 on CPU: ours runs the documents flat, stock one per row
#: flash-attn importable (a GPU box): there ``auto`` may choose FA2 where this CPU box chooses sdpa
FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


# ---- shared artifacts -------------------------------------------------------------------------------------


def save_pretrained_llama(assets: Path, out: Path, seed: int = 0) -> Path:
    """The tiny Llama of ``assets`` with seeded random weights, saved as a pretrained checkpoint (safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(assets / "tiny-llama"))
    model.save_pretrained(out)
    return out


def write_icl(folder: Path, n: int = 8) -> Path:
    """Two tiny ICL tasks as local jsonl in LLM-Foundry's formats: language modeling (``context`` /
    ``continuation``) and multiple choice (``query`` / ``choices`` / ``gold``, an accuracy that moves with the
    logits where the LM task's exact-match accuracy stays 0 on a tiny model)."""
    import random

    from foundry_attn.integrations.llm_foundry.assets import sentence

    rng = random.Random(5)
    with open(folder / "tiny_lm.jsonl", "w") as lm, open(folder / "tiny_mc.jsonl", "w") as mc:
        for i in range(n):
            words = sentence(rng).split()
            lm.write(json.dumps({"context": " ".join(words[:4]), "continuation": " " + " ".join(words[4:])}) + "\n")
            choices = [" ".join(words[4:]), " ".join(sentence(rng).split()[4:])]
            mc.write(json.dumps({"query": " ".join(words[:4]), "choices": choices, "gold": i % 2}) + "\n")
    return folder


def model_cfg(name: str, attn: str, pretrained: Path, events: Path) -> dict[str, Any]:
    """What a user writes: only the name differs (ours' ``auto`` is its default; stock's is the key left out)."""
    cfg: dict[str, Any] = {"name": name, "pretrained_model_name_or_path": str(pretrained), "pretrained": True}
    if attn != "auto":
        cfg["attn_implementation"] = attn
    if name == OURS:
        cfg["events_dir"] = str(events)
    return cfg


def icl_tasks(icl: Path) -> list[dict[str, Any]]:
    return [
        {
            "label": label,
            "dataset_uri": str(icl / f"{label}.jsonl"),
            "num_fewshot": [0],
            "icl_task_type": kind,
            "continuation_delimiter": " " if kind == "multiple_choice" else "",
        }
        for label, kind in zip(ICL_LABELS, ("language_modeling", "multiple_choice"), strict=True)
    ]


def text_loader(assets: Path, split: str) -> dict[str, Any]:
    """LLM-Foundry's stock ``text`` loader on the MDS rows (right-padded with EOS, which is also the pad)."""
    return {
        "name": "text",
        "dataset": {"local": str(assets / "text"), "split": split, "max_seq_len": MAX_SEQ_LEN, "shuffle": False},
        "drop_last": split == "train",
        "num_workers": 0,
        "prefetch_factor": None,
        "persistent_workers": False,
        "pin_memory": False,
    }


def train_cfg(
    name: str, attn: str, pretrained: Path, assets: Path, work: Path, run: str, icl: Path, **extra: Any
) -> dict[str, Any]:
    return {
        "run_name": run,
        "seed": 17,
        "max_seq_len": MAX_SEQ_LEN,
        "model": model_cfg(name, attn, pretrained, work / "events" / run),
        "tokenizer": {"name": str(assets / "tokenizer"), "kwargs": {"model_max_length": MAX_SEQ_LEN}},
        "train_loader": text_loader(assets, "train"),
        "eval_loader": text_loader(assets, "val"),
        "icl_tasks": icl_tasks(icl),
        "icl_subset_num_batches": 1,
        "scheduler": {"name": "constant_with_warmup", "t_warmup": "0ba"},
        "optimizer": {"name": "decoupled_adamw", "lr": 3.0e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0},
        "max_duration": "2ba",
        "eval_interval": "2ba",
        "eval_first": False,
        "eval_subset_num_batches": 2,
        "global_train_batch_size": 4,
        "device_train_microbatch_size": 4,
        "device_eval_batch_size": 4,
        "precision": "fp32",
        "progress_bar": False,
        "log_to_console": False,
        "python_log_level": None,
        "save_folder": str(work / "ckpt" / run),
        "save_interval": "2ba",
        "save_overwrite": True,
        "callbacks": {
            "hf_checkpointer": {"save_folder": str(work / "hf" / run), "save_interval": "2ba", "precision": "float32"}
        },
        **extra,
    }


def run_train(cfg: dict[str, Any], path: Path) -> Any:
    """``llmfoundry train`` on a YAML written from ``cfg``; the trainer, closed."""
    from llmfoundry.command_utils import train_from_yaml
    from omegaconf import OmegaConf

    OmegaConf.save(OmegaConf.create(cfg), path)
    trainer = train_from_yaml(str(path), [])
    trainer.close()
    return trainer


def cell_id(cell: tuple[str, str]) -> str:
    return f"{'stock' if cell[0] == STOCK else 'ours'}-{cell[1]}"


class Cell:
    """One trained cell: its trainer, the export folder, its Composer checkpoint, its metrics and its logits."""

    def __init__(self, trainer: Any, export: Path, checkpoint: Path, probe: dict[str, torch.Tensor]) -> None:
        self.trainer = trainer
        self.model = trainer.state.model
        self.export = export
        self.checkpoint = checkpoint
        self.metrics = metrics_of(trainer)
        self.model.eval()
        with torch.no_grad():
            self.logits = self.model.model(**probe).logits  # the HF model itself, stock's call
            self.greedy = generate(self.model, probe)
            torch.manual_seed(0)
            self.sampled = generate(self.model, probe, do_sample=True, top_k=0).sequences


def generate(model: Any, probe: dict[str, torch.Tensor], **kwargs: Any) -> Any:
    """``ComposerHFCausalLM.generate`` on the probe: 8 new tokens (greedy unless told), with each step's scores."""
    kwargs.setdefault("do_sample", False)
    return model.generate(
        probe["input_ids"],
        attention_mask=probe["attention_mask"],
        max_new_tokens=8,
        return_dict_in_generate=True,
        output_scores=True,
        **kwargs,
    )


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The module's folder, also the working directory (LLM-Foundry copies ICL datasets into the cwd)."""
    path = tmp_path_factory.mktemp("dropin")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(path)
        yield path


@pytest.fixture(scope="module")
def pretrained(assets: Path, work: Path) -> Path:
    return save_pretrained_llama(assets, work / "tiny-llama-pretrained")


@pytest.fixture(scope="module")
def icl(work: Path) -> Path:
    (work / "icl").mkdir()
    return write_icl(work / "icl")


@pytest.fixture(scope="module")
def probe(tokenizer: Any) -> dict[str, torch.Tensor]:
    """A left-padded prompt batch (as generation pads), two rows of different lengths."""
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(["the red cat sees a", "the big old dog chases a small fox"], return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = "right"
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


@pytest.fixture(scope="module")
def cells(
    assets: Path, work: Path, pretrained: Path, icl: Path, probe: dict[str, torch.Tensor]
) -> dict[tuple[str, str], Cell]:
    out = {}
    for name, attn in CELLS:
        run = cell_id((name, attn))
        trainer = run_train(train_cfg(name, attn, pretrained, assets, work, run, icl), work / f"{run}.yaml")
        out[name, attn] = Cell(trainer, work / "hf" / run / "huggingface" / "ba2", work / "ckpt" / run, probe)
    return out


# ---- the matrix -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ATTNS)
def test_trains_as_stock(cells: dict[tuple[str, str], Cell], attn: str) -> None:
    stock, ours = cells[STOCK, attn], cells[OURS, attn]
    if not FLASH_ATTN:
        assert ours.model.attn_implementation == "sdpa"  # auto on this CPU: sdpa (flash-attn is not installed)
    torch.testing.assert_close(float(ours.trainer.state.loss), float(stock.trainer.state.loss), **TOL)
    want, got = stock.model.model.state_dict(), ours.model.model.state_dict()
    assert want.keys() == got.keys()
    diffs = {k: float((got[k] - want[k]).abs().max()) for k in want}
    # Adam divides by sqrt(v): a weight whose gradient is ~0 moves by up to lr per step on float noise alone, so
    # the weights are compared at 1e-4 (lr is 3e-3); the losses and metrics above and below are at 1e-5
    assert max(diffs.values()) <= 1e-4, sorted(diffs.items(), key=lambda kv: -kv[1])[:5]


@pytest.mark.parametrize("cell", CELLS, ids=cell_id)
def test_export_reloads_in_transformers(cells: dict[tuple[str, str], Cell], probe: dict, cell: tuple) -> None:
    """(a) the ``hf_checkpointer`` export, loaded by plain transformers, gives the trained model's logits."""
    from transformers import AutoModelForCausalLM

    trained = cells[cell]
    reloaded = AutoModelForCausalLM.from_pretrained(trained.export, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = reloaded(**probe).logits
    real = probe["attention_mask"].bool()
    torch.testing.assert_close(logits[real], trained.logits[real], **TOL)


@pytest.mark.parametrize("attn", ATTNS)
def test_export_config_is_stocks(cells: dict[tuple[str, str], Cell], attn: str) -> None:
    stock, ours = cells[STOCK, attn].export, cells[OURS, attn].export
    assert (ours / "config.json").read_bytes() == (stock / "config.json").read_bytes()
    assert json.loads((ours / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def assert_metrics_equal(stock: dict[str, float], ours: dict[str, float]) -> None:
    """The same metrics, each within float precision: eval_loader's and both ICL tasks'."""
    assert stock.keys() == ours.keys()
    assert "eval/LanguageCrossEntropy" in stock, stock
    for label in ICL_LABELS:
        assert any(k.startswith(f"{label}/0-shot/InContextLearning") for k in stock), stock
    for key, want in stock.items():
        assert ours[key] == pytest.approx(want, rel=1e-5, abs=1e-6), (key, ours[key], want)


def metrics_of(trainer: Any) -> dict[str, float]:
    return {
        f"{label}/{metric}": float(value.compute())
        for label, metrics in trainer.state.eval_metrics.items()
        for metric, value in metrics.items()
    }


@pytest.mark.parametrize("attn", ATTNS)
def test_eval_and_icl_equal_stocks(cells: dict[tuple[str, str], Cell], attn: str) -> None:
    """(b) ``eval_loader`` metrics and the ICL tasks' accuracies, after training, equal stock's."""
    assert_metrics_equal(cells[STOCK, attn].metrics, cells[OURS, attn].metrics)


@pytest.mark.parametrize("attn", ATTNS)
def test_generate_equals_stocks(cells: dict[tuple[str, str], Cell], attn: str) -> None:
    """(c) ``generate`` on a left-padded batch (a KV cache): greedy, the same tokens and the same scores at every
    step; sampled under one seed, the same tokens."""
    stock, ours = cells[STOCK, attn], cells[OURS, attn]
    assert stock.greedy.sequences.shape[1] == stock.logits.shape[1] + 8
    assert torch.equal(ours.greedy.sequences, stock.greedy.sequences)
    torch.testing.assert_close(torch.stack(ours.greedy.scores), torch.stack(stock.greedy.scores), **TOL)
    assert torch.equal(ours.sampled, stock.sampled)


@pytest.mark.parametrize("attn", ATTNS)
def test_resume_across_model_names(
    cells: dict[tuple[str, str], Cell], assets: Path, work: Path, pretrained: Path, icl: Path, attn: str
) -> None:
    """(d) stock's Composer checkpoint into ours and ours into stock: the weights load whole, and the next
    batch trains as it would have under the other name."""
    losses, weights = {}, {}
    for name, source in ((OURS, STOCK), (STOCK, OURS)):
        run = f"{cell_id((name, attn))}-from-{'stock' if source == STOCK else 'ours'}"
        ckpt = cells[source, attn].checkpoint / "ep0-ba2-rank0.pt"
        trainer = run_train(
            train_cfg(
                name,
                attn,
                pretrained,
                assets,
                work,
                run,
                icl,
                load_path=str(ckpt),
                max_duration="3ba",
                eval_interval="3ba",
                eval_subset_num_batches=1,
                callbacks={},
                save_folder=None,
            ),
            work / f"{run}.yaml",
        )
        assert int(trainer.state.timestamp.batch) == 3
        losses[name] = float(trainer.state.loss)
        weights[name] = trainer.state.model.model.state_dict()
    torch.testing.assert_close(losses[OURS], losses[STOCK], **TOL)
    for key, want in weights[STOCK].items():  # at 1e-4: Adam (see test_trains_as_stock)
        torch.testing.assert_close(weights[OURS][key], want, atol=1e-4, rtol=0)


def test_llmfoundry_eval_equals_stock(assets: Path, work: Path, pretrained: Path, icl: Path) -> None:
    """(e) ``llmfoundry eval`` (``eval_from_yaml``), one run per cell: ours' metrics are stock's.

    (One run per cell: with several ``models`` and an ``eval_loader``, LLM-Foundry 0.22 pops the loader's
    ``name`` while building the first model's evaluators, and the second fails with ``KeyError: 'name'``.)
    """
    from llmfoundry.command_utils import eval_from_yaml
    from omegaconf import OmegaConf

    results = {}
    for cell in CELLS:
        run = f"eval-{cell_id(cell)}"
        cfg = {
            "run_name": run,
            "seed": 17,
            "max_seq_len": MAX_SEQ_LEN,
            "device_eval_batch_size": 4,
            "precision": "fp32",
            "models": [
                {
                    "model_name": cell_id(cell),
                    "model": model_cfg(*cell, pretrained, work / "events" / run),
                    "tokenizer": {"name": str(assets / "tokenizer"), "kwargs": {"model_max_length": MAX_SEQ_LEN}},
                }
            ],
            "eval_loader": text_loader(assets, "val"),
            "eval_subset_num_batches": 2,
            "icl_tasks": icl_tasks(icl),
            "python_log_level": None,
            "log_config": False,
        }
        OmegaConf.save(OmegaConf.create(cfg), work / f"{run}.yaml")
        [trainer], _ = eval_from_yaml(str(work / f"{run}.yaml"), [])
        results[cell] = metrics_of(trainer)
        trainer.close()
    for attn in ATTNS:
        assert_metrics_equal(results[STOCK, attn], results[OURS, attn])
