"""What the isolation probe costs at build, next to one training step of the same model.

    foundry-attn bench isolation --json            # CPU: tiny demo model and SmolLM2-135M (30 layers), ~1 min
    foundry-attn bench isolation --json --device cuda   # GPU: bf16, FA2 when flash-attn imports
    foundry-attn bench isolation --json --quick         # smoke run: the tiny model, 1 repeat

For each model and backend (CPU: sdpa, eager, flex_attention, FA2 on the reference kernel; CUDA: sdpa, eager,
flex_attention, flash_attention_2 when flash-attn imports), ``isolation_check`` runs on a freshly attached model:
``first_ms`` is the first probe (what a build pays: it runs once; flex builds its first block mask there),
``warm_ms`` the median of the next ``repeats``. ``step_ms`` is one forward + backward of a packed row of
documents (1395 real tokens: the padding benchmark's six) with the same backend, median of ``repeats``
(``bench.timing.round_robin``: GC off inside a step); ``probe_vs_step`` = first_ms / step_ms. Models are random
Llamas (``foundry_attn.shapes``): the demo's tiny one (vocab 64) and SmolLM2-135M's full depth; fp32 on CPU, bf16
on CUDA. Core module: torch and transformers only.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, cast

import torch

from foundry_attn.adapters import EAGER, FA2, FLEX, SDPA, attach
from foundry_attn.bench import machine
from foundry_attn.bench.timing import median, round_robin
from foundry_attn.capability import flex_backward_error
from foundry_attn.forward import forward_documents
from foundry_attn.isolation import isolation_check
from foundry_attn.shapes import SMOLLM2_135M_SHAPE, SMOLLM2_VOCAB, TINY_SHAPE, llama_config

COMMAND = "foundry-attn bench isolation --json"
LENGTHS = (220, 217, 295, 183, 130, 350)
MODELS = {"tiny": (64, TINY_SHAPE), "smollm2_135m": (SMOLLM2_VOCAB, SMOLLM2_135M_SHAPE)}


def _backends(device: torch.device) -> list[tuple[str, bool]]:
    """(backend, on the FA2 reference kernel)."""
    found = [(SDPA, False), (EAGER, False)]
    if flex_backward_error(device.type) is None:  # the policy refuses flex where it cannot train
        found.append((FLEX, False))
    if device.type == "cpu":
        return [*found, (FA2, True)]
    try:
        import flash_attn  # noqa: F401
    except Exception:  # any failure means no FA2 row
        return found
    return [*found, (FA2, False)]


def measure(model_name: str, backend: str, reference: bool, device: torch.device, repeats: int) -> dict[str, Any]:
    vocab, shape = MODELS[model_name]
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    config = llama_config(vocab, **shape, attn_implementation=SDPA, attention_dropout=0.0)
    torch.manual_seed(0)
    from transformers import LlamaForCausalLM

    model = cast(torch.nn.Module, LlamaForCausalLM(config))  # to mypy, transformers' top-level classes are dummies
    model = model.to(device=device, dtype=dtype).train()
    attach(model, backend, fa2_reference=reference)
    failure, first = isolation_check(model)
    warm = [isolation_check(model)[1] for _ in range(repeats)]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (1, sum(LENGTHS)), generator=gen).to(device)
    batch = {"input_ids": ids, "labels": ids.clone(), "doc_lens": [list(LENGTHS)]}

    def step() -> None:
        model.zero_grad(set_to_none=True)
        forward_documents(model, batch).loss.backward()

    step()  # warm-up
    step_ms = median(round_robin({"step": step}, repeats, device=device).seconds["step"]) * 1e3
    return {
        "model": model_name,
        "backend": backend + (" (reference kernel)" if reference else ""),
        "passed": failure is None,
        "first_ms": first,
        "warm_ms": median(warm),
        "step_ms": step_ms,
        "probe_vs_step": first / step_ms,
    }


def run(device: str | None = None, repeats: int = 3, models: tuple[str, ...] = tuple(MODELS)) -> dict[str, Any]:
    dev = torch.device(device or "cpu")
    rows = [measure(m, b, ref, dev, repeats) for m in models for b, ref in _backends(dev)]
    return {
        "command": COMMAND,
        "device": str(dev),
        **machine(),
        "repeats": repeats,
        "rows": rows,
        "all_passed": all(r["passed"] for r in rows),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--device", default=None, help="cpu (default) or cuda[:N]")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", action="append", choices=tuple(MODELS), help="only this model (repeatable)")
    args = parser.parse_args(argv)
    result = run(args.device, args.repeats, tuple(args.model or MODELS))
    print(json.dumps(result, indent=2) if args.json else result)
    return 0 if result["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
