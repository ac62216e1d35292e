"""Every exact layout of a batch, timed side by side, and the one the run chooses.

    foundry-attn bench layouts --json                 # CPU, fp32, 2 layers of 256 hidden, ~10 min
    foundry-attn bench layouts --json --quick         # smoke run
    foundry-attn bench layouts --json --device cuda   # a GPU: the same families and mixes, bf16

Families whose attention our documents cannot reach (GPT-J and GPT-Neo under eager, StableLM under sdpa and eager,
transformers 5.x): the flat row on stock's packed mask (``flat``), one document per row (``rows``), and the run as
attached (``chosen``: :func:`foundry_attn.flat.layout_cost.cheapest` per batch) at 8 x 128, 16 x 256 and 64 x 32
tokens and one 2048-token document with 64 of 32 (where the rows run in two forwards by width:
:func:`foundry_attn.flat.layout_cost.row_groups`). Llama under sdpa and eager, 2048 real tokens in 1, 4, 16, 64 and
256 equal documents: our flat row (``chosen``), ``rows``, and stock padding-free (``stock_padding_free``: the packed
row with restarting ``position_ids``, transformers 5.x), with the attention calls per layer of our flat forward.

Per cell: each variant's median step (forward + backward) in ms, its peak memory (:class:`~.timing.PeakMemory`), its
loss, ``chosen_vs_best`` (the chosen variant's time over the fastest exact one's), and the layout the run chose with
its reason. A variant whose planned memory does not fit the free memory is not run, and says so. Core module: torch
and transformers only.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from foundry_attn.bench import machine
from foundry_attn.bench.timing import PeakMemory, median, round_robin
from foundry_attn.flat.inputs import stock_splits_packed_rows
from foundry_attn.flat.layout_cost import MEMORY_SHARE, MOST_FORWARDS, ModelShape, free_memory, layout_costs
from foundry_attn.path.attach import attach
from foundry_attn.path.forward import forward_documents
from foundry_attn.path.state import path_of

COMMAND = "foundry-attn bench layouts --json"
#: families whose attention our documents cannot reach: (name, model type, implementation)
STOCK_MASK = (("gptj", "eager"), ("gpt_neo", "eager"), ("stablelm", "sdpa"), ("stablelm", "eager"))
MIXES = {"8x128": (128,) * 8, "16x256": (256,) * 16, "64x32": (32,) * 64, "2048+64x32": (2048,) + (32,) * 64}
QUICK_MIXES = {"4x32": (32,) * 4, "16x8": (8,) * 16, "64+8x8": (64,) + (8,) * 8}
SPLITS = (1, 4, 16, 64, 256)
TOKENS = 2048
#: the chosen layout within this factor of the fastest exact candidate
TARGET = 1.15
#: timed steps per variant, round-robin (``--rounds``)
ROUNDS = 3


def _config(model_type: str, hidden: int, layers: int, positions: int) -> Any:
    import transformers

    heads = max(1, hidden // 64)
    common = dict(vocab_size=1000, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if model_type == "gptj":
        return transformers.GPTJConfig(
            n_embd=hidden, n_layer=layers, n_head=heads, rotary_dim=16, n_positions=positions, **common
        )
    if model_type == "gpt_neo":
        return transformers.GPTNeoConfig(
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            attention_types=[[["global", "local"], layers // 2 or 1]],
            max_position_embeddings=positions,
            window_size=256,
            **common,
        )
    kind = {"stablelm": transformers.StableLmConfig, "llama": transformers.LlamaConfig}[model_type]
    return kind(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=positions,
        **common,
    )


def _model(model_type: str, impl: str, quick: bool, device: torch.device) -> Any:
    import transformers

    hidden, layers = (64, 2) if quick else (256, 2)
    config = _config(model_type, hidden, layers, 4096)
    for key in ("attn_pdrop", "resid_pdrop", "embd_pdrop", "attention_dropout", "hidden_dropout"):
        if hasattr(config, key):
            setattr(config, key, 0.0)
    config._attn_implementation = impl
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return model.to(device=device, dtype=dtype).train()


def _batch(lengths: Sequence[int], device: torch.device) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, 1000, (n,), generator=gen)
    labels = ids.masked_fill(ids == 0, -100)
    return {"input_ids": ids.to(device), "labels": labels.to(device), "doc_lens": [[n] for n in lengths]}


def _packed(lengths: Sequence[int], device: torch.device) -> dict[str, Any]:
    """Stock padding-free: one row, restarting position_ids, no mask (``DataCollatorWithFlattening``)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (1, sum(lengths)), generator=gen)
    labels = ids.clone()
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()])
    labels[0, starts] = -100
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return {"input_ids": ids.to(device), "labels": labels.to(device), "position_ids": positions.to(device)}


def _step(model: Any, batch: dict[str, Any], attached: bool) -> float:
    model.zero_grad(set_to_none=True)
    out = forward_documents(model, batch) if attached else model(**batch, use_cache=False)
    out.loss.backward()
    return float(out.loss.detach())


def _attention_calls(model: Any, batch: dict[str, Any], layers: int) -> float:
    """Attention kernel calls per layer in one forward of ``batch`` (SDPA calls, or softmaxes under eager)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.no_grad():
        forward_documents(model, batch)
    names = ("aten::scaled_dot_product_attention", "aten::_softmax")
    calls = sum(e.count for e in prof.key_averages() if e.key in names)
    return calls / layers


def _time(
    variants: dict[str, tuple[Any, dict[str, Any], bool]], rounds: int, device: torch.device
) -> dict[str, dict[str, Any]]:
    result: dict[str, dict[str, Any]] = {}
    losses: dict[str, float] = {}
    for name, (model, batch, attached) in variants.items():  # the first batch's proofs, outside the timed steps
        losses[name] = _step(model, batch, attached)
        with PeakMemory(device) as mem:
            _step(model, batch, attached)
        result[name] = {"peak_mem_mb": mem.peak / 2**20, "loss": losses[name]}
    calls: dict[str, Callable[[], float]] = {n: functools.partial(_step, m, b, a) for n, (m, b, a) in variants.items()}
    timings = round_robin(calls, rounds, device=device)
    for name in variants:
        result[name]["step_ms"] = median(timings.seconds[name]) * 1e3
    return result


def _cell(
    model_type: str, impl: str, lengths: Sequence[int], quick: bool, device: torch.device, rounds: int = ROUNDS
) -> dict[str, Any]:
    base = _model(model_type, impl, quick, device)
    batch = _batch(lengths, device)
    variants: dict[str, tuple[Any, dict[str, Any], bool]] = {}
    skipped: dict[str, str] = {}
    chosen = copy.deepcopy(base)
    attach(chosen, impl)
    flat = copy.deepcopy(base)
    state = attach(flat, impl)
    state.learned(rows_proven=False)  # the flat row alone (stock's packed mask where ours cannot run)
    rows = copy.deepcopy(base)
    attach(rows, impl, path="rows")
    shape = ModelShape.of(base)
    plans = layout_costs(shape, list(lengths), ("flat", "rows"), state.stock_mask, MOST_FORWARDS)
    free = free_memory(device)
    for name, model, layout in (("chosen", chosen, None), ("flat", flat, "flat"), ("rows", rows, "rows")):
        need = plans[layout].memory if layout else min(c.memory for c in plans.values())
        if need > MEMORY_SHARE * free:
            skipped[name] = f"plans {need / 2**20:.0f} MB, {free / 2**20:.0f} MB free"
        else:
            variants[name] = (model, batch, True)
    if model_type == "llama" and stock_splits_packed_rows():
        stock = copy.deepcopy(base)
        variants["stock_padding_free"] = (stock, _packed(lengths, device), False)
    measured = _time(variants, 1 if quick else rounds, device)
    best = min(r["step_ms"] for r in measured.values())
    losses = [r["loss"] for r in measured.values()]
    tol = 2e-2 if device.type == "cuda" else 1e-4
    cstate = path_of(chosen)
    cell: dict[str, Any] = {
        "lengths": f"{len(lengths)} documents, longest {max(lengths)}, {sum(lengths)} tokens",
        "variants": measured,
        "skipped": skipped,
        "stock_mask": state.stock_mask,
        "chosen_layout": cstate.choice.layout if cstate else None,
        "chosen_reason": cstate.choice.reason if cstate else None,
        "chosen_vs_best": measured["chosen"]["step_ms"] / best if "chosen" in measured else None,
        "losses_agree": max(losses) - min(losses) <= tol * max(1.0, abs(losses[0])),
    }
    if model_type == "llama":
        cell["attention_calls_per_layer"] = _attention_calls(chosen, batch, base.config.num_hidden_layers)
    return cell


def run(quick: bool = False, device: str | None = None, rounds: int = ROUNDS, **_: Any) -> dict[str, Any]:
    """Every family and mix, ``rounds`` timed steps per variant; ``{"skipped": ...}`` where transformers does not
    split packed rows itself."""
    dev = torch.device(device or "cpu")
    if not stock_splits_packed_rows():
        why = "this transformers does not split packed rows itself: no flat row on stock's packed mask to compare"
        return {"command": COMMAND, "correct": None, "all_targets_met": None, "skipped": why}
    mixes = QUICK_MIXES if quick else MIXES
    cells: dict[str, dict[str, Any]] = {}
    for model_type, impl in STOCK_MASK[:1] if quick else STOCK_MASK:
        for mix, lengths in mixes.items():
            cells[f"{model_type}/{impl}/{mix}"] = _cell(model_type, impl, lengths, quick, dev, rounds)
    tokens = 256 if quick else TOKENS
    for impl in ("sdpa", "eager"):
        for split in SPLITS[:3] if quick else SPLITS:
            cells[f"llama/{impl}/{split}x{tokens // split}"] = _cell(
                "llama", impl, (tokens // split,) * split, quick, dev, rounds
            )
    ratios = [c["chosen_vs_best"] for c in cells.values() if c["chosen_vs_best"] is not None]
    calls = [c["attention_calls_per_layer"] for c in cells.values() if "attention_calls_per_layer" in c]
    return {
        "command": COMMAND
        + (" --quick" if quick else "")
        + (f" --rounds {rounds}" if rounds != ROUNDS else "")
        + (f" --device {device}" if device else ""),
        "machine": machine(),
        "device": str(dev),
        "cells": cells,
        "targets": {
            "chosen_within_15pct_of_best": {"target": TARGET, "value": max(ratios), "met": max(ratios) <= TARGET},
            "attention_calls_per_layer_at_most_8": {"target": 8, "value": max(calls), "met": max(calls) <= 8},
        },
        "correct": all(c["losses_agree"] for c in cells.values()),
        "all_targets_met": max(ratios) <= TARGET and max(calls) <= 8,
    }
