"""axolotl runs on its own sample-packed batches, with foundry_attn's plugin and without, each against the truth.

    python -m tests.axolotl.runs OUT_DIR [VARIANT ...]     # writes OUT_DIR/results.json

Every run is axolotl 0.19's own pipeline (``load_cfg``, ``load_datasets``, ``axolotl.train.train``: its tokenizing,
``MultipackBatchSampler``, ``V2BatchSamplerDataCollatorForSeq2Seq``, Trainer), CPU, fp32, offline, on the project's
tiny Llama and word-level tokenizer and a local jsonl of documents. The test plugin :mod:`tests.axolotl.probe` records
the first step: the batch, the loss the Trainer trained on and every parameter's gradient. The truth is stock
transformers running each document of that batch alone (its own forward, the backend that ran, no foundry_attn):
the loss is the mean next-token loss over every document's own targets. One process runs every variant (axolotl's
import is the slow part); axolotl's process-wide state (its plugin manager, the sdpa_varlen patch) is reset between.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

PLUGIN = "foundry_attn.integrations.axolotl.FoundryAttnPlugin"
PROBE = "tests.axolotl.probe.FirstStepProbe"

#: name -> (attn_implementation, foundry_attn plugin on, foundry_attn_backend, axolotl's sdpa_varlen patch on)
VARIANTS: dict[str, tuple[str, bool, str | None, bool]] = {
    "ours-sdpa": ("sdpa", True, None, False),
    "ours-sdpa-varlen-auto": ("sdpa", True, "auto", True),
    "ours-eager": ("eager", True, None, False),
    "ours-eager-varlen": ("eager", True, "eager", True),
    "stock-sdpa": ("sdpa", False, None, False),
    "stock-sdpa-varlen": ("sdpa", False, None, True),
    "stock-eager": ("eager", False, None, False),
}


def write_assets(folder: Path, documents: int = 96, seed: int = 0) -> Path:
    """The tiny Llama (random weights, saved), the word-level tokenizer beside it, ``train.jsonl`` of documents.

    Args:
        folder: where they go.
        documents: how many documents (1 to 8 sentences each, 9 to about 70 tokens).
        seed: the seed of the weights and the documents.

    Returns:
        ``folder``.
    """
    from transformers import LlamaForCausalLM

    from foundry_attn.integrations.llm_foundry.assets import build_tokenizer, sentence
    from foundry_attn.verify.llama_shapes import TINY_SHAPE, llama_config

    if (folder / "train.jsonl").exists():
        return folder
    tokenizer = build_tokenizer(folder / "tiny-llama")
    torch.manual_seed(seed)
    vocab = (len(tokenizer) + 63) // 64 * 64
    LlamaForCausalLM(llama_config(vocab, **TINY_SHAPE)).save_pretrained(folder / "tiny-llama")
    rng = random.Random(seed)
    with open(folder / "train.jsonl.tmp", "w") as f:
        for _ in range(documents):
            text = " ".join(sentence(rng) for _ in range(rng.randint(1, 8)))
            f.write(json.dumps({"text": text}) + "\n")
    os.replace(folder / "train.jsonl.tmp", folder / "train.jsonl")
    return folder


def config(
    assets: Path, out: Path, impl: str, plugin: bool, backend: str | None, steps: int = 2, width: int = 128
) -> dict[str, Any]:
    """An axolotl config: completion documents, sample packing, 2 rows of ``width`` per step, fp32, no clipping.

    Args:
        assets: :func:`write_assets`' folder.
        out: the run's output_dir.
        impl: ``attn_implementation``.
        plugin: foundry_attn's plugin in ``plugins``.
        backend: ``foundry_attn_backend`` (None: left out).
        steps: ``max_steps``.
        width: ``sequence_len``.

    Returns:
        The config as a YAML would give it.
    """
    cfg: dict[str, Any] = {
        "base_model": str(assets / "tiny-llama"),
        "tokenizer_type": "PreTrainedTokenizerFast",
        "datasets": [{"path": str(assets / "train.jsonl"), "ds_type": "json", "type": "completion"}],
        "dataset_prepared_path": str(assets / "prepared"),
        "output_dir": str(out),
        "sequence_len": width,
        "sample_packing": True,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "max_steps": steps,
        "num_epochs": 1,
        "learning_rate": 1e-3,
        "optimizer": "adamw_torch",
        "lr_scheduler": "constant",
        "max_grad_norm": 0.0,
        "attn_implementation": impl,
        "bf16": False,
        "fp16": False,
        "tf32": False,
        "logging_steps": 1,
        "save_strategy": "no",
        "save_first_step": False,
        "val_set_size": 0,
        "seed": 0,
        "dataloader_num_workers": 0,
        "dataset_num_proc": 1,
        "plugins": [PROBE, *([PLUGIN] if plugin else [])],
    }
    if backend is not None:
        cfg["foundry_attn_backend"] = backend
    return cfg


def truth(
    model_dir: Path, impl: str, batch: dict[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Each document of ``batch`` alone through stock transformers (``impl``, fp32): the loss and every parameter's
    gradient of it, with each document's own targets (``alone``: the truth) and with, besides, each document's first
    token a target of the previous document's last token as the labels of a packed row make it (``crossing``: what a
    run that keeps the documents' attention apart but trains on the labels as they are computes).

    Documents: where ``position_ids`` restart; a segment without targets (axolotl's tail padding) is none.

    Args:
        model_dir: the saved tiny Llama (the weights of the first step).
        impl: the attention the run's model used.
        batch: the batch the Trainer handed ``compute_loss``.

    Returns:
        ``{"alone": (loss, grads), "crossing": (loss, grads)}``, gradients by parameter name.
    """
    from transformers import AutoModelForCausalLM

    from foundry_attn.integrations.axolotl.batches import documents

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=impl, dtype=torch.float32)
    model.train()
    ce = torch.nn.functional.cross_entropy
    own, cross, own_count, cross_count = torch.zeros(()), torch.zeros(()), 0, 0
    for r in range(batch["input_ids"].shape[0]):
        start, last = 0, None  # the previous document's last logits in this row
        for n in documents(batch["position_ids"][r].tolist()):
            ids = batch["input_ids"][r, start : start + n][None]
            labels = batch["labels"][r, start : start + n][None]
            start += n
            if last is not None and labels[0, 0] != -100:
                cross, cross_count = cross + ce(last, labels[0, :1], reduction="sum"), cross_count + 1
            targets = int((labels[:, 1:] != -100).sum())
            if not targets:
                last = None
                continue
            logits = model(input_ids=ids, use_cache=False).logits.float()
            own = own + ce(logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum")
            own_count += targets
            last = logits[0, -1:]
    params = dict(model.named_parameters())
    out = {}
    for name, loss in (("alone", own / own_count), ("crossing", (own + cross) / (own_count + cross_count))):
        grads = torch.autograd.grad(loss, list(params.values()), retain_graph=True, allow_unused=True)
        out[name] = (loss.detach(), {k: g for k, g in zip(params, grads, strict=True) if g is not None})
    return out


def distances(record: dict[str, Any], loss: torch.Tensor, grads: dict[str, torch.Tensor]) -> dict[str, Any]:
    """How far a run's first step is from the truth: the loss (absolute) and the worst parameter's gradient
    (``max |g - truth| / max |truth|``, per parameter).

    Args:
        record: the probe's record.
        loss: the truth's loss.
        grads: the truth's gradients.

    Returns:
        ``loss``, ``truth``, ``loss_diff``, ``grad_rel``, ``worst_param``, ``params``, ``num_items``.
    """
    got = {k.removeprefix("module."): v for k, v in record["grads"].items()}
    assert set(got) == set(grads), (sorted(set(got) ^ set(grads)))[:5]
    rel = {k: ((got[k] - w).abs().max() / w.abs().max().clamp_min(1e-12)).item() for k, w in grads.items()}
    worst = max(rel, key=lambda k: rel[k])
    num = record.get("num_items")
    return {
        "loss": record["loss"],
        "truth": loss.item(),
        "loss_diff": abs(record["loss"] - loss.item()),
        "grad_rel": rel[worst],
        "worst_param": worst,
        "params": len(rel),
        "num_items": int(num) if num is not None else None,
    }


def speed(record: dict[str, Any]) -> dict[str, Any]:
    """Real tokens/s (wall and CPU time) over every step after the first (the first proves and warms up), and the peak
    RSS.

    Args:
        record: the probe's record (its ``steps``: seconds, real tokens, positions, CPU seconds).

    Returns:
        ``steps``, ``real_tokens``, ``positions``, ``timed_seconds``, ``real_tokens_per_s``, ``cpu_seconds``,
        ``real_tokens_per_cpu_s``, ``peak_rss_mib``, ``train_rss_mib`` (the peak over the RSS at train begin).
    """
    every = record.get("steps", [])
    later = every[1:]
    seconds, real, positions, cpu = (sum(step[k] for step in later) for k in range(4))
    peak, base = record.get("peak_rss_mib"), record.get("rss_at_train_begin_mib")
    return {
        "steps": len(every),
        "real_tokens": real,
        "positions": positions,
        "timed_seconds": round(seconds, 3),
        "real_tokens_per_s": round(real / seconds, 1) if seconds else None,
        "cpu_seconds": round(cpu, 3),
        "real_tokens_per_cpu_s": round(real / cpu, 1) if cpu else None,
        "peak_rss_mib": None if peak is None else round(peak, 1),
        "train_rss_mib": None if peak is None or base is None else round(peak - base, 1),
    }


def run(name: str, assets: Path, out: Path, steps: int = 2, width: int = 128) -> dict[str, Any]:
    """One variant through axolotl's own pipeline; its first step against the truth, its later steps timed.

    Args:
        name: a key of :data:`VARIANTS`.
        assets: :func:`write_assets`' folder.
        out: where the run writes.
        steps: optimizer steps (``max_steps``).
        width: ``sequence_len``.

    Returns:
        The distances, the batch's shape and documents, the plugin's summary, the ``attn/*`` keys logged, real
        tokens/s over the steps after the first, the peak RSS during training.
    """
    from axolotl.cli.config import load_cfg
    from axolotl.common.datasets import load_datasets
    from axolotl.integrations.base import PluginManager
    from axolotl.monkeypatch.attention import sdpa_varlen
    from axolotl.train import train
    from axolotl.utils.dict import DictDefault

    from foundry_attn.flat.layout import padding_spans
    from foundry_attn.integrations.axolotl.batches import documents

    impl, plugin, backend, varlen = VARIANTS[name]
    record_path = out / f"{name}.pt"
    os.environ["FOUNDRY_ATTN_PROBE_OUT"] = str(record_path)
    os.environ["FOUNDRY_ATTN_PROBE_SDPA_VARLEN"] = "1" if varlen else "0"
    PluginManager.get_instance().plugins.clear()  # a singleton: the last run's plugins would run again
    began = time.perf_counter()
    try:
        cfg = load_cfg(DictDefault(config(assets, out / name, impl, plugin, backend, steps, width)))
        meta = load_datasets(cfg=cfg)
        _, _, trainer = train(cfg=cfg, dataset_meta=meta)
        registered = sdpa_varlen._PATCH_APPLIED
    finally:
        sdpa_varlen.unpatch_sdpa_varlen()
    seconds = time.perf_counter() - began
    record = torch.load(record_path)
    ours = PluginManager.get_instance().plugins.get(PLUGIN)
    summary = ours.summary() if ours is not None else None
    ran = summary["backend"] if summary is not None else impl
    batch = record["batch"]
    pads = padding_spans(batch)
    spans = [
        (r, start, start + n)
        for r, row in enumerate(batch["position_ids"].tolist())
        for start, n in zip(itertools.accumulate(documents(row), initial=0), documents(row), strict=False)
    ]
    result = {
        "variant": name,
        "attn_implementation": impl,
        "plugin": plugin,
        "backend": backend,
        "sdpa_varlen": registered,
        "ran": ran,
        "seconds": round(seconds, 1),
        "shape": list(batch["input_ids"].shape),
        "keys": sorted(batch),
        "documents": [n for row in batch["position_ids"].tolist() for n in documents(row)],
        "padding": sum(e - s for _, s, e in pads),
        "padding_documents": [k for k, span in enumerate(spans) if span in pads],
        "proofs_compared": []
        if ours is None
        else [list(p.compared) for _, p in ours.state.proofs[ours.attach_proofs :]],
        "summary": summary,
        **speed(record),
        "logged": sorted({k for logs in trainer.state.log_history for k in logs if k.startswith("attn/")}),
        "first_logs": {k: v for k, v in trainer.state.log_history[0].items() if isinstance(v, (int, float))},
    }
    truths = truth(assets / "tiny-llama", ran, batch)
    result.update(distances(record, *truths["alone"]))
    crossing = distances(record, *truths["crossing"])
    result.update(crossing_truth=crossing["truth"], crossing_loss_diff=crossing["loss_diff"])
    result.update(crossing_grad_rel=crossing["grad_rel"])
    return result


def main(argv: list[str]) -> None:
    """``python -m tests.axolotl.runs OUT_DIR [VARIANT ...]``: every variant by default.

    Args:
        argv: the arguments.
    """
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    assets = write_assets(out / "assets")
    results = [run(name, assets, out) for name in (argv[1:] or list(VARIANTS))]
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    for r in results:
        print(
            f"{r['variant']:24s} ran {r['ran']:6s} varlen {r['sdpa_varlen']!s:5s} loss {r['loss']:.6f} "
            f"truth {r['truth']:.6f} |diff| {r['loss_diff']:.1e} grad rel {r['grad_rel']:.1e}; against the crossing "
            f"targets {r['crossing_loss_diff']:.1e} / {r['crossing_grad_rel']:.1e} ({r['seconds']} s)"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
