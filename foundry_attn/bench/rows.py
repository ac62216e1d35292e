"""What one document per row costs where stock's own packed mask is exact: the rows path against the flat row.

    foundry-attn bench rows --json            # GPT-J eager, the blog mix (six documents, 1395 tokens), ~2 min
    foundry-attn bench rows --json --quick    # smoke run

GPT-J computes attention in its own code (no attention interface), so our documents never reach it; on transformers
5.x stock splits a packed row at restarting ``position_ids`` by itself, and the proof holds for that: the model stays
flat (``PathState.stock_mask``) instead of padding every document to the longest. Both variants are attached and
proven, train the same packed batch, and are timed side by side (``bench.timing.round_robin``, medians): ``flat_ms``
and ``rows_ms`` one forward + backward, ``rows_vs_flat`` their ratio. ``correct``: both losses within 1e-5 of stock on
each document alone. Random weights, fp32, the CPU. Core module: torch and transformers only.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from foundry_attn.bench import machine
from foundry_attn.bench.timing import median, paired_ratio_median, round_robin
from foundry_attn.flat.inputs import stock_splits_packed_rows
from foundry_attn.flat.packing import PaddingCollator
from foundry_attn.path.attach import attach
from foundry_attn.path.forward import forward_documents
from foundry_attn.verify.llama_shapes import BLOG_LENGTHS

COMMAND = "foundry-attn bench rows --json"
LOSS_TOL = 1e-5


def _model(quick: bool) -> Any:
    from transformers import GPTJConfig, GPTJForCausalLM

    torch.manual_seed(0)
    size = (
        dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8)
        if quick
        else dict(n_embd=256, n_layer=4, n_head=8, rotary_dim=16)
    )
    config = GPTJConfig(vocab_size=1000, n_positions=1024, bos_token_id=1, eos_token_id=2, **size)
    config.attn_pdrop = config.resid_pdrop = config.embd_pdrop = 0.0
    model: Any = GPTJForCausalLM(config)
    model.train()
    model.config._attn_implementation = "eager"  # GPT-J has no sdpa class
    return model


def _truth(model: Any, docs: list[torch.Tensor]) -> float:
    with torch.no_grad():
        total = sum(
            F.cross_entropy(model(input_ids=d[None]).logits[0, :-1], d[1:], reduction="sum").item() for d in docs
        )
    return total / sum(d.numel() - 1 for d in docs)


def run(quick: bool = False, device: str | None = None, **_: Any) -> dict[str, Any]:
    """Both paths on the blog mix, timed side by side."""
    if not stock_splits_packed_rows():
        why = "this transformers does not split packed rows itself: a model our documents cannot reach has no flat row"
        return {"command": COMMAND, "correct": None, "all_targets_met": None, "skipped": why}
    lengths = BLOG_LENGTHS[:2] if quick else BLOG_LENGTHS
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 1000, (n,), generator=gen) for n in lengths]
    batch = PaddingCollator(0, 2, sum(lengths), mode="pack")(docs)
    flat = _model(quick)
    rows = copy.deepcopy(flat)
    truth = _truth(copy.deepcopy(flat).eval(), docs)
    states = {"flat": attach(flat, "eager"), "rows": attach(rows, "eager", path="rows")}
    models = {"flat": flat, "rows": rows}
    losses: dict[str, float] = {}

    def step(name: str) -> None:
        model = models[name]
        model.zero_grad(set_to_none=True)
        out = forward_documents(model, batch)
        out.loss.backward()
        losses[name] = out.loss.item()

    for name in models:  # the first batch's proof, outside the timed steps
        step(name)
    variants: dict[str, Callable[[], None]] = {n: functools.partial(step, n) for n in models}
    timings = round_robin(variants, 2 if quick else 8)
    flat_ms, rows_ms = (median(timings.seconds[n]) * 1e3 for n in ("flat", "rows"))
    errors = {n: abs(loss - truth) for n, loss in losses.items()}
    return {
        "command": COMMAND,
        "machine": machine(),
        "model": "GPT-J (random, fp32, eager)" + (" tiny" if quick else ", 256 hidden, 4 layers"),
        "lengths": list(lengths),
        "paths": {n: {"path": s.path, "stock_mask": s.stock_mask, "reason": s.reason} for n, s in states.items()},
        "flat_ms": flat_ms,
        "rows_ms": rows_ms,
        "rows_vs_flat": paired_ratio_median(timings.seconds["rows"], timings.seconds["flat"]),
        "loss_errors": errors,
        "correct": states["flat"].stock_mask and all(e <= LOSS_TOL for e in errors.values()),
        "all_targets_met": None,
    }
