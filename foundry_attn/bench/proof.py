"""What the flat-path proof costs (at attach, and on a training batch), next to one training step.

    foundry-attn bench proof --json            # CPU: tiny demo model and SmolLM2-135M (30 layers), ~5 min
    foundry-attn bench proof --json --device cuda   # GPU: bf16, FA2 when flash-attn imports
    foundry-attn bench proof --json --quick         # smoke run: the tiny model, 1 repeat

For each model and backend (CPU: sdpa, eager, flex_attention, FA2 on the reference kernel; CUDA: sdpa, eager,
flex_attention, flash_attention_2 when flash-attn imports): ``attach_ms`` is the proof :func:`foundry_attn.paths.attach`
runs (two synthetic documents; flex builds its first block mask there); ``batch_proof_ms`` the proof on a training
batch (``PathState.before_batch``: the packed row of the padding benchmark's six documents, 1395 real tokens,
and two of them alone through stock), median of ``repeats``; ``step_ms`` one forward + backward of that batch,
median of ``repeats`` (``bench.timing.round_robin``: GC off inside a step). ``proof_vs_step`` = batch_proof_ms /
step_ms, and ``cost_at_interval`` that over the default interval (``paths.PROOF_INTERVAL``): the share of
training time the re-proof takes. ``fingerprint_us``: the identity check every batch pays. Models are random
Llamas (``foundry_attn.shapes``): the demo's tiny one (vocab 64) and SmolLM2-135M's full depth; fp32 on CPU,
bf16 on CUDA. Core module: torch and transformers only.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from foundry_attn.backends import EAGER, FA2, FLEX, SDPA
from foundry_attn.bench import machine
from foundry_attn.bench.timing import median, round_robin
from foundry_attn.capability import flex_backward_error
from foundry_attn.forward import flat_inputs, forward_documents
from foundry_attn.layout import Layout
from foundry_attn.paths import PROOF_INTERVAL, attach, proofs_in_run
from foundry_attn.shapes import SMOLLM2_135M_SHAPE, SMOLLM2_VOCAB, TINY_SHAPE, llama_config

COMMAND = "foundry-attn bench proof --json"
#: a run of RUN_BATCHES batches on two mixes: the blog mix at one length throughout, and a mix whose flat rows grow
#: from GROWING[0] to GROWING[1] tokens over the run (a long-context curriculum)
RUN_BATCHES = 10_000
GROWING = (256, 8192)
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
    state = attach(model, backend, fa2_reference=reference)
    attach_ms = state.proofs[-1][1].ms
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (1, sum(LENGTHS)), generator=gen).to(device)
    batch = {"input_ids": ids, "labels": ids.clone(), "doc_lens": [list(LENGTHS)]}
    layout = Layout.from_batch(batch)
    inputs, _ = flat_inputs(model, ids, layout.position_ids(device), None, layout)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        forward_documents(model, batch).loss.backward()

    def proof() -> None:  # what the first batch, a change or a longer batch pays: logits and gradients
        state.prove(model, inputs, "bench")

    def interval_proof() -> None:  # what the interval pays: logits only
        state.prove(model, inputs, "bench", grads=False)

    def fingerprint() -> None:
        state.fingerprint()

    step()  # warm-up (and the first-batch proof)
    fns = {"step": step, "proof": proof, "interval_proof": interval_proof, "fingerprint": fingerprint}
    seconds = round_robin(fns, repeats, device=device).seconds
    step_ms, proof_ms = median(seconds["step"]) * 1e3, median(seconds["proof"]) * 1e3
    interval_ms = median(seconds["interval_proof"]) * 1e3
    return {
        "model": model_name,
        "backend": backend + (" (reference kernel)" if reference else ""),
        "passed": state.path == "flat" and all(v.ok for _, v in state.proofs),
        "attach_ms": attach_ms,
        "batch_proof_ms": proof_ms,
        "step_ms": step_ms,
        "proof_vs_step": proof_ms / step_ms,
        "interval": PROOF_INTERVAL,
        "interval_proof_ms": interval_ms,
        "cost_at_interval": interval_ms / step_ms / PROOF_INTERVAL,
        **_run_cost(proof_ms / step_ms, interval_ms / step_ms),
        "fingerprint_us": median(seconds["fingerprint"]) * 1e6,
    }


def _run_cost(grad_proof: float, forward_proof: float) -> dict[str, Any]:
    """The proof's share of a whole run, from the proofs :func:`foundry_attn.paths.proofs_in_run` schedules (first
    batch, longer batches: logits and gradients; interval: logits only), each costing what it cost here relative to
    a step of the same length (both scale with the row)."""
    out: dict[str, Any] = {}
    growing = [GROWING[0] + (GROWING[1] - GROWING[0]) * i // RUN_BATCHES for i in range(RUN_BATCHES)]
    for mix, tokens in (("blog", [sum(LENGTHS)] * RUN_BATCHES), ("growing", growing)):
        full, forward_only = proofs_in_run(tokens, PROOF_INTERVAL)
        out[f"{mix}_proofs"] = [full, forward_only]
        out[f"{mix}_run_share"] = (full * grad_proof + forward_only * forward_proof) / RUN_BATCHES
    return out


def run(quick: bool = False, device: str | None = None) -> dict[str, Any]:
    """Every model x backend; ``quick``: the tiny model, one repeat."""
    dev = torch.device(device or "cpu")
    repeats, models = (1, ("tiny",)) if quick else (3, tuple(MODELS))
    rows = [measure(m, b, ref, dev, repeats) for m in models for b, ref in _backends(dev)]
    return {
        "command": COMMAND + (" --quick" if quick else ""),
        "device": str(dev),
        **machine(),
        "repeats": repeats,
        "rows": rows,
        "correct": all(r["passed"] for r in rows),  # every proof passed
        # at most 1% of a run on either mix, the first-batch proof at most one step
        "all_targets_met": all(
            r["blog_run_share"] <= 0.01 and r["growing_run_share"] <= 0.01 and r["proof_vs_step"] <= 1.0 for r in rows
        ),
    }
