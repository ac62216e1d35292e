"""What the flat-path proof costs (at attach, and on a training batch), next to one training step.

    foundry-attn bench proof --json            # CPU: tiny demo model and SmolLM2-135M (30 layers), ~5 min
    foundry-attn bench proof --json --device cuda   # GPU: bf16, FA2 when flash-attn imports
    foundry-attn bench proof --json --quick         # smoke run: the tiny model, 1 repeat

For each model and backend (CPU: sdpa, eager, flex_attention, FA2 on the reference kernel; CUDA: sdpa, eager,
flex_attention, flash_attention_2 when flash-attn imports), on the packed row of the padding benchmark's six
documents (1395 real tokens), medians of ``repeats`` (``bench.timing.round_robin``: side by side, GC off):
``step_ms`` one forward + backward; ``batch_proof_ms`` what a full proof (the first batch, a change, a longer batch)
takes inside its step, timed directly: it takes the step's own forward as its packed side (``StepProof``), so it
adds the documents' gradient through the training graph and two documents alone through stock (``proven_step_ms``:
that whole step); ``interval_proof_ms`` the same for the interval's forward-only proof. ``proof_vs_step`` =
batch_proof_ms / step_ms; ``*_run_share`` the proofs' share of a 10,000-batch run (blog mix, lengths growing
256 -> 8192).
``standalone_*``: the proof with its own forward, what runs where the step's forward cannot serve (torch.compile,
checkpointing, FSDP2, dropout: ``proof.step_blocker``). ``attach_ms``: the proof at attach (two synthetic
documents). ``fingerprint_us``: the identity check every batch pays. Models are random Llamas
(``foundry_attn.verify.llama_shapes``): the demo's tiny one (vocab 64) and SmolLM2-135M's full depth; fp32 on CPU, bf16
on CUDA. The targets (``all_targets_met``) are judged on SmolLM2-135M. Core module: torch and transformers only.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from foundry_attn.attention.backends import EAGER, FA2, FLEX, SDPA
from foundry_attn.bench import machine
from foundry_attn.bench.timing import median, round_robin
from foundry_attn.flat.inputs import flat_inputs
from foundry_attn.flat.layout import Layout
from foundry_attn.path.attach import attach
from foundry_attn.path.forward import forward_documents
from foundry_attn.path.proven import prove
from foundry_attn.path.schedule import PROOF_INTERVAL, ceil2
from foundry_attn.proof.step_proof import step_blocker
from foundry_attn.selection.capability import flex_backward_error
from foundry_attn.verify.llama_shapes import BLOG_LENGTHS, SMOLLM2_135M_SHAPE, SMOLLM2_VOCAB, TINY_SHAPE, llama_config

COMMAND = "foundry-attn bench proof --json"
#: a run of RUN_BATCHES batches on two mixes: the blog mix at one length throughout, and a mix whose flat rows grow
#: from GROWING[0] to GROWING[1] tokens over the run (a long-context curriculum)
RUN_BATCHES = 10_000
GROWING = (256, 8192)
LENGTHS = BLOG_LENGTHS
MODELS = {"tiny": (64, TINY_SHAPE), "smollm2_135m": (SMOLLM2_VOCAB, SMOLLM2_135M_SHAPE)}


def proofs_in_run(tokens: list[int], interval: int = PROOF_INTERVAL) -> tuple[int, int]:
    """How many proofs a run whose batches have these flat-row lengths gets from
    :meth:`~foundry_attn.path.schedule.Schedule.due` (no change of code): with gradients (the first batch, each longer
    batch), and forward only (the interval)."""
    full, forward_only, covered = 0, 0, 0
    for batch, n in enumerate(tokens, start=1):
        if batch == 1 or n > covered:
            full, covered = full + 1, max(covered, ceil2(n))
        elif interval and batch % interval == 0:
            forward_only += 1
    return full, forward_only


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
    inputs, _ = flat_inputs(model, ids, None, layout)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        forward_documents(model, batch).loss.backward()

    in_step: dict[str, list[float]] = {"full": [], "interval": []}  # what each proof took inside its step

    def proven_step() -> None:  # a step on which a full proof is due (the first batch, a change, a longer batch)
        state.schedule.proven_on_batch = False
        step()
        in_step["full"].append(state.proofs[-1][1].ms)

    def interval_step() -> None:  # a step on which the interval's forward-only proof is due
        state.schedule.batches = PROOF_INTERVAL - 1
        step()
        in_step["interval"].append(state.proofs[-1][1].ms)

    def standalone() -> None:  # the full proof with its own forward (compile, checkpointing, FSDP2, dropout)
        prove(state, model, inputs, "bench")

    def standalone_interval() -> None:
        prove(state, model, inputs, "bench", grads=False)

    def fingerprint() -> None:
        state.schedule.fingerprint(state.names)

    step()  # warm-up (and the first-batch proof)
    fns = {
        "step": step,
        "proven_step": proven_step,
        "interval_step": interval_step,
        "standalone": standalone,
        "standalone_interval": standalone_interval,
        "fingerprint": fingerprint,
    }
    ms = {k: median(v) * 1e3 for k, v in round_robin(fns, repeats, device=device).seconds.items()}
    step_ms = ms["step"]
    # the proof's own time inside its step (its documents alone, its gradient through the training graph): timed
    # directly, as the difference of two step medians is noisier than the proof itself
    proof_ms, interval_ms = median(in_step["full"]), median(in_step["interval"])
    return {
        "model": model_name,
        "backend": backend + (" (reference kernel)" if reference else ""),
        "passed": state.path == "flat" and all(v.ok for _, v in state.proofs),
        "in_step": step_blocker(model) is None,  # the batch proofs take the step's own forward
        "attach_ms": attach_ms,
        "step_ms": step_ms,
        "batch_proof_ms": proof_ms,
        "proven_step_ms": ms["proven_step"],  # the whole step with the proof in it, for the record
        "proof_vs_step": proof_ms / step_ms,
        "interval": PROOF_INTERVAL,
        "interval_proof_ms": interval_ms,
        "cost_at_interval": interval_ms / step_ms / PROOF_INTERVAL,
        **_run_cost(proof_ms / step_ms, interval_ms / step_ms),
        "standalone_proof_ms": ms["standalone"],
        "standalone_proof_vs_step": ms["standalone"] / step_ms,
        "standalone_interval_ms": ms["standalone_interval"],
        **_run_cost(ms["standalone"] / step_ms, ms["standalone_interval"] / step_ms, "standalone_"),
        "fingerprint_us": ms["fingerprint"] * 1e3,
    }


def _run_cost(grad_proof: float, forward_proof: float, prefix: str = "") -> dict[str, Any]:
    """The proof's share of a whole run, from the proofs :func:`proofs_in_run` schedules (first
    batch, longer batches: logits and gradients; interval: logits only), each costing what it cost here relative to
    a step of the same length (both scale with the row)."""
    out: dict[str, Any] = {}
    growing = [GROWING[0] + (GROWING[1] - GROWING[0]) * i // RUN_BATCHES for i in range(RUN_BATCHES)]
    for mix, tokens in (("blog", [sum(LENGTHS)] * RUN_BATCHES), ("growing", growing)):
        full, forward_only = proofs_in_run(tokens, PROOF_INTERVAL)
        if not prefix:
            out[f"{mix}_proofs"] = [full, forward_only]
        out[f"{prefix}{mix}_run_share"] = (full * grad_proof + forward_only * forward_proof) / RUN_BATCHES
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
        # (on SmolLM2-135M's shapes: the tiny model's steps are too short for a share to mean anything)
        "all_targets_met": all(
            r["blog_run_share"] <= 0.01 and r["growing_run_share"] <= 0.01 and r["proof_vs_step"] <= 1.0
            for r in rows
            if r["model"] != "tiny"
        )
        if not quick
        else None,
    }
