"""What each ``foundry-attn bench train`` variant trains: the run's settings, its assets, its LLM-Foundry config.

:class:`Settings` (the model's shapes, the warm-up and timed batches, the mixes; ``--quick``: a toy model),
:func:`write_assets` (a word-level tokenizer, the model config and one prompt/response jsonl per mix, nothing
downloaded) and :func:`variant_config` (the ``train`` config of ``stock_padded``, ``stock_packing``, ``ours_mask`` or
``ours_pack``). The schedule and the report are :mod:`foundry_attn.bench.train`'s.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from foundry_attn.bench.train_worker import OUR_CALLBACKS
from foundry_attn.verify.llama_shapes import BLOG_LENGTHS, SMOLLM2_135M_SHAPE

VARIANTS = ("stock_padded", "stock_packing", "ours_mask", "ours_pack")
MIXES: dict[str, tuple[int, ...]] = {"blog": tuple(BLOG_LENGTHS), "long": (2000, 1536, 1024, 700, 420, 180)}
MAX_SEQ_LEN = 2048
ROWS = 6  # examples per device batch: the blog's batch
SEED = 17
EXAMPLES = 600  # per mix: enough for stock packing's profile and every batch


@dataclasses.dataclass(frozen=True)
class Settings:
    """How big and how long one run is."""

    hidden_size: int = SMOLLM2_135M_SHAPE["hidden_size"]  # SmolLM2-135M's layer shapes
    intermediate_size: int = SMOLLM2_135M_SHAPE["intermediate_size"]
    num_attention_heads: int = SMOLLM2_135M_SHAPE["num_attention_heads"]
    num_key_value_heads: int = SMOLLM2_135M_SHAPE["num_key_value_heads"]
    layers: int = 4
    vocab: int = 8192
    warmup: int = 1  # batches before timing (the first step of a process is ~1.4x slower on CPU)
    timed: int = 2  # every batch, warm-up and timed, has its loss checked against the truth
    mixes: tuple[str, ...] = ("blog", "long")
    device: str = "cpu"
    precision: str = "fp32"

    @classmethod
    def make(cls, quick: bool, device: str | None = None) -> Settings:
        dev = device or "cpu"
        precision = "fp32" if dev == "cpu" else "amp_bf16"
        if quick:  # a toy model: the smoke test checks the plumbing, not the numbers
            return cls(
                hidden_size=32,
                intermediate_size=64,
                num_attention_heads=2,
                num_key_value_heads=1,
                layers=1,
                vocab=512,
                warmup=1,
                timed=2,
                mixes=("blog",),
                device=dev,
                precision=precision,
            )
        return cls(device=dev, precision=precision)


# ---- assets ---------------------------------------------------------------------------------------------------


def write_assets(root: Path, settings: Settings) -> dict[str, Path]:
    """Tokenizer, model config and one jsonl per mix under ``root``; nothing downloaded."""
    from foundry_attn.integrations.llm_foundry.assets import WORDS, build_tokenizer
    from foundry_attn.verify.llama_shapes import llama_config

    build_tokenizer(root / "tokenizer")
    s = settings
    config = llama_config(
        s.vocab,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads,
        head_dim=s.hidden_size // s.num_attention_heads,
        max_position_embeddings=MAX_SEQ_LEN,
        rope_theta=100000.0,
        attention_dropout=0.0,
    )
    config.save_pretrained(root / "model")
    paths = {"tokenizer": root / "tokenizer", "model": root / "model"}
    words = [w for w in WORDS if w != "<|endoftext|>"]
    for mix in s.mixes:
        rng = random.Random(SEED)
        folder = root / "data" / mix
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "train.jsonl", "w") as f:
            for i in range(EXAMPLES):
                n = MIXES[mix][i % len(MIXES[mix])]  # tokens, EOS included (LLM-Foundry appends it)
                prompt = max(1, n // 5)
                text = [rng.choice(words) for _ in range(n - 1)]
                f.write(json.dumps({"prompt": " ".join(text[:prompt]), "response": " ".join(text[prompt:])}) + "\n")
        paths[mix] = folder
    return paths


def stock_attention(device: str) -> str:
    """The attention stock ``hf_causal_lm`` gets: FA2 on CUDA where flash-attn imports, else ``sdpa``."""
    if device.startswith("cuda"):
        try:
            import flash_attn  # noqa: F401
        except Exception:  # any failure: no FA2 for stock
            return "sdpa"
        return "flash_attention_2"
    return "sdpa"


def variant_config(variant: str, mix: str, paths: Mapping[str, Path], settings: Settings, root: Path) -> dict:
    """The LLM-Foundry train config of one variant (a plain dict; the worker makes it an OmegaConf config)."""
    dataset: dict[str, Any] = {
        "hf_name": str(paths[mix]),
        "split": "train",
        "max_seq_len": MAX_SEQ_LEN,
        "decoder_only_format": True,
        "shuffle": False,
    }
    if variant == "stock_packing":
        dataset["packing_ratio"] = "auto"
    loader: dict[str, Any] = {
        "dataset": dataset,
        "drop_last": True,
        "num_workers": 0,
        "prefetch_factor": None,
        "persistent_workers": False,
        "pin_memory": False,
    }
    callbacks: dict[str, Any] = {
        "speed_monitor": {"window_size": settings.timed},  # exactly the timed batches (see the docstring)
        "foundry_attn_bench_probe": {"truth_batches": settings.warmup},  # then the timed ones, after each step
    }
    run = f"bench-train-{mix}-{variant}"
    if variant.startswith("stock"):
        model: dict[str, Any] = {
            "name": "hf_causal_lm",
            "pretrained_model_name_or_path": str(paths["model"]),
            "pretrained": False,
            "attn_implementation": stock_attention(settings.device),
        }
        loader["name"] = "finetuning"
    else:
        model = {
            "name": "foundry_attn_causal_lm",
            "pretrained_model_name_or_path": str(paths["model"]),
            "pretrained": False,
            "attn_implementation": "auto",
            "events_dir": str(root / "events" / run),
        }
        loader["name"] = "foundry_attn_finetuning"
        loader["padding"] = variant.split("_")[1]
        callbacks = {**{name: {} for name in OUR_CALLBACKS}, **callbacks}
    return {
        "run_name": run,
        "seed": SEED,
        "max_seq_len": MAX_SEQ_LEN,
        "model": model,
        "tokenizer": {"name": str(paths["tokenizer"]), "kwargs": {"model_max_length": MAX_SEQ_LEN}},
        "train_loader": loader,
        "scheduler": {"name": "constant_with_warmup", "t_warmup": "0ba"},
        "optimizer": {"name": "decoupled_adamw", "lr": 1.0e-3, "betas": [0.9, 0.95], "eps": 1.0e-8},
        "max_duration": f"{settings.warmup}ba",
        "eval_interval": 1,
        "global_train_batch_size": ROWS,
        "device_train_microbatch_size": ROWS,
        "device_eval_batch_size": ROWS,
        "precision": settings.precision,
        "progress_bar": False,
        "log_to_console": False,
        "python_log_level": "error",
        "spin_dataloaders": False,
        "callbacks": callbacks,
        "loggers": {"foundry_attn_bench_metrics": {}},
    }
