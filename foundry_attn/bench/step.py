"""``make demo``'s model, one training step at a time: the step time a newcomer's first run sees.

    foundry-attn bench step --json            # CPU, fp32, the demo's tiny Llama, ~1 min
    PYTHONPATH=../older python foundry_attn/bench/step.py   # the same steps on another checkout, to compare

The demo's model (``tiny-llama``: hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 64), attached with ``sdpa`` (what
``attn_implementation: auto`` picks on a CPU), trained with AdamW on 20 packed batches of 8 rows of 128 tokens
(:class:`~foundry_attn.flat.packing.PaddingCollator` ``mode="pack"``, 14 documents of 8-120 tokens each, seeded):
the median of every timed step (``rounds`` passes over the batches after 3 warm-up steps). Imports only what every
checkout since the flat path has (``attach``, ``forward_documents``, the collator, ``verify.llama_shapes``), so the
file runs as a script against an older ``foundry_attn`` on ``PYTHONPATH``. Core module: torch and transformers only.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import torch

COMMAND = "foundry-attn bench step --json"
#: the demo tokenizer's vocabulary (``foundry-attn assets``: 64 words)
VOCAB = 64
BATCHES, DOCUMENTS, ROW = 20, 14, 128


def run(quick: bool = False, device: str | None = None, rounds: int = 4, **_: Any) -> dict[str, Any]:
    """The demo model's median training step on ``device`` (default: the CPU).

    Args:
        quick: one pass over 4 batches (a smoke run).
        device: where the model runs.
        rounds: passes over the batches.

    Returns:
        ``command``, ``median_step_ms``, ``steps``, the documents per batch and ``correct`` (every loss finite).

    Example::

        >>> run(quick=True)["median_step_ms"] > 0
        True
    """
    import transformers

    from foundry_attn.bench import on_device
    from foundry_attn.flat.packing import PaddingCollator
    from foundry_attn.path.attach import attach
    from foundry_attn.path.forward import forward_documents
    from foundry_attn.verify.llama_shapes import TINY_SHAPE, llama_config

    dev = torch.device(device or "cpu")
    torch.manual_seed(17)
    config = llama_config(VOCAB, **TINY_SHAPE)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dev).train()
    attach(model, "sdpa")
    gen = torch.Generator().manual_seed(17)
    collate = PaddingCollator(pad_id=0, eos_id=0, max_seq_len=ROW, mode="pack")
    batches = []
    for _round in range(4 if quick else BATCHES):
        lengths = torch.randint(8, 120, (DOCUMENTS,), generator=gen).tolist()
        docs = [torch.randint(1, 64, (n,), generator=gen) for n in lengths]
        batches.append(on_device(collate(docs), dev))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses: list[float] = []

    def step(batch: dict[str, Any]) -> float:
        optimizer.zero_grad(set_to_none=True)
        out = forward_documents(model, batch)
        out.loss.backward()
        optimizer.step()
        losses.append(float(out.loss.detach()))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter()

    for batch in batches[:3]:
        step(batch)
    times = []
    for _pass in range(1 if quick else rounds):
        for batch in batches:
            start = time.perf_counter()
            times.append(step(batch) - start)
    return {
        "command": COMMAND + (" --quick" if quick else ""),
        "threads": torch.get_num_threads(),
        "median_step_ms": statistics.median(times) * 1e3,
        "steps": len(times),
        "documents_per_batch": DOCUMENTS,
        "correct": all(loss == loss and abs(loss) < float("inf") for loss in losses),
        "all_targets_met": None,
    }


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
