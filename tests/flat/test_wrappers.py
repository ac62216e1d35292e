"""Exact under the wrappers people train with: torch.compile, DDP and FSDP2 (CPU, gloo), with checkpointing.

Each run is compared with stock transformers running each document alone (``conformance.truth_alone``), and
every attention call is recorded: it must get the ``[1, 1, 1, 1]`` placeholder and the documents, so the
fast path stays on (no L x L mask) whatever wraps the model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from foundry_attn.path.attach import attach
from foundry_attn.path.forward import forward_documents
from foundry_attn.verify import conformance
from tests.conftest import REPO, skip_unless_flex_trains
from tests.flat.wrapped_worker import HANG_S, recorded

pytestmark = pytest.mark.slow  # torch.compile and torchrun subprocesses: 1.5-16 s each here


def _errors(family: str, backend: str, loss: torch.Tensor, model: torch.nn.Module) -> tuple[float, float]:
    want_loss, want_grad = conformance.truth_alone(family, backend)
    grad = conformance.grads_of(model)
    return abs(loss.item() - want_loss), ((grad - want_grad).norm() / want_grad.norm()).item()


@pytest.mark.parametrize(
    ("family", "backend", "compiler", "checkpointing"),
    [
        ("llama", "sdpa", "aot_eager", "plain"),
        ("mistral", "sdpa", "aot_eager", "checkpoint_wrapper"),
        ("gemma3", "eager", "aot_eager", "plain"),
        ("qwen2", "flash_attention_2", "aot_eager", "hf_non_reentrant"),
        ("mistral", "flex_attention", "aot_eager", "plain"),
    ],
)
def test_compiled_model_is_exact(
    monkeypatch: pytest.MonkeyPatch, family: str, backend: str, compiler: str, checkpointing: str
) -> None:
    """``torch.compile(model)`` with aot_eager: inductor's traced graph and autograd, without its C++ codegen (about
    30 compiles of a minute or more on a fresh machine). Inductor's codegen of our attention runs in
    ``tests/path/test_execution.py::test_the_default_inductor_step_is_exact``, the compiled step's default."""
    from transformers.modeling_utils import AttentionInterface

    skip_unless_flex_trains(backend)
    torch._dynamo.reset()
    model = conformance.build(family, backend)
    calls: list[bool] = []
    name = attach(model, backend, fa2_reference=True).flat_name
    monkeypatch.setitem(AttentionInterface._global_mapping, name, AttentionInterface._global_mapping[name])
    recorded(name, calls)  # undone by monkeypatch after the test
    conformance.enable_checkpointing(model, checkpointing)
    out = forward_documents(
        torch.compile(model, backend=compiler), conformance.collated(conformance.sample_documents(), "pack")
    )
    out.loss.backward()
    loss_err, grad_err = _errors(family, backend, out.loss, model)
    assert loss_err <= conformance.LOSS_TOL and grad_err <= conformance.GRAD_TOL, (loss_err, grad_err)
    assert calls and all(calls), calls  # placeholder + documents in every call: no L x L mask


def _ranks(ranks: int, out: Path, *args: str) -> dict:
    """``wrapped_worker.py FAMILY BACKEND WRAPPER out [CHECKPOINTING [ROWS]]`` on ``ranks`` gloo ranks (torchrun);
    rank 0's result, its loss and gradients checked against each document alone."""
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    worker = [str(REPO / "tests" / "flat" / "wrapped_worker.py"), *args[:3], str(out), *args[3:]]
    for _ in range(2):  # gloo on torch 2.13 aborts (std::terminate) or hangs a rank at times on a loaded box
        proc = subprocess.Popen([*run, *worker], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = proc.communicate(timeout=HANG_S + 60)
        except subprocess.TimeoutExpired:  # SIGTERM: torchrun stops its ranks (each in a session of its own) too
            proc.terminate()
            stdout, stderr = proc.communicate(timeout=60)
        aborted = "terminate called without an active exception" in stderr
        if proc.returncode == 0 or not (aborted or "Timeout (0:" in stderr):
            break
    assert proc.returncode == 0, (stdout + stderr)[-4000:]
    result = json.loads(out.read_text())
    assert result["loss_err"] <= conformance.LOSS_TOL and result["grad_err"] <= conformance.GRAD_TOL, result
    return result


@pytest.mark.launch  # torchrun ranks
@pytest.mark.parametrize(
    ("wrapper", "ranks", "family", "backend", "checkpointing"),
    [
        ("fsdp2", 1, "llama", "sdpa", "plain"),
        ("fsdp2", 2, "gemma3", "sdpa", "checkpoint_wrapper"),
        ("fsdp2", 2, "llama", "flash_attention_2", "checkpoint_wrapper"),
        ("fsdp2", 2, "qwen2", "flex_attention", "plain"),
        ("ddp", 1, "mistral", "eager", "plain"),
        ("ddp", 2, "phi3", "sdpa", "hf_non_reentrant"),
    ],
)
def test_distributed_is_exact(
    tmp_path: Path, wrapper: str, ranks: int, family: str, backend: str, checkpointing: str
) -> None:
    """Each rank packs its share of the documents; rank 0 compares the averaged gradients with the truth."""
    skip_unless_flex_trains(backend)
    result = _ranks(ranks, tmp_path / "result.json", family, backend, wrapper, checkpointing)
    assert result["fast"] and result["calls"] > 0, result
    assert result["wrapped"].startswith("DistributedDataParallel" if wrapper == "ddp" else "FSDP"), result


@pytest.mark.launch  # torchrun ranks
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_a_compiled_execution_under_ddp_and_fsdp2_is_exact(tmp_path: Path, wrapper: str) -> None:
    """``attach(..., execution="compiled")`` under DDP and FSDP2 on 2 ranks: the second batch runs the compiled step,
    and the averaged gradients are each document's alone. Under DDP the first batch's proof takes its forward
    (eagerly, said once); under FSDP2 the proof runs forwards of its own (sharded parameters), so every training
    forward runs compiled."""
    result = _ranks(2, tmp_path / "result.json", "llama", "sdpa", wrapper, "plain", "", "compiled")
    eager = [1] if wrapper == "ddp" else []
    assert result["execution"] == "compiled" and list(result["eager"].values()) == eager, result


@pytest.mark.launch  # torchrun ranks
@pytest.mark.parametrize(("rows", "forwards"), [("split", [2, 2]), ("agree", [1, 1])])
def test_ddp_ranks_agree_on_the_forwards_of_rows_by_width(tmp_path: Path, rows: str, forwards: list[int]) -> None:
    """One document per row in forwards by width under DDP: every rank runs as many forwards (DDP broadcasts its
    buffers in each), the fewest any rank would, and the averaged gradients are each document's alone."""
    result = _ranks(2, tmp_path / "result.json", "llama", "sdpa", "ddp", "plain", rows)
    assert result["forwards"] == forwards, result


@pytest.mark.parametrize(("family", "backend"), [("mistral", "sdpa"), ("gemma2", "eager"), ("llama", "eager")])
def test_compiled_layouts_change_the_data_not_the_graph(family: str, backend: str) -> None:
    """16 packed batches of different layouts: no new graph after the first steps, no graph break, each step
    equal to the uncompiled one."""
    import logging

    torch._dynamo.reset()
    # Gemma2 warns (logger.warning_once) in every training forward not named "eager": a break outside attention
    with torch._dynamo.config.patch(ignore_logger_methods={logging.Logger.warning_once}):
        compiled_by_step, breaks = compiled_steps(family, backend, steps=16)
    # dynamic shapes from the start: one graph, Gemma2 too (its last_cache_position does not pin the row's length)
    assert compiled_by_step[0] == compiled_by_step[-1] == 1, compiled_by_step
    assert not breaks, breaks


def compiled_steps(family: str, backend: str, steps: int, **attached: Any) -> tuple[list[int], dict]:
    """Graphs compiled so far after each step, and the graph breaks; each step's loss and gradients checked equal to
    the uncompiled model's. ``attached``: :func:`attach`'s keywords (``capacity``, ``fa2_reference``)."""
    import random

    from torch._dynamo.utils import counters

    counters.clear()
    graphs: list[int] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(len(gm.graph.nodes))
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    model = conformance.build(family, backend)
    attach(model, backend, **attached)
    compiled = torch.compile(model, backend=counting)
    rng = random.Random(0)
    compiled_by_step = []
    for _ in range(steps):
        docs = [torch.randint(1, conformance.VOCAB, (rng.randint(2, 12),)) for _ in range(rng.randint(2, 5))]
        batch = conformance.collated(docs, "pack")
        results = []
        for runner in (model, compiled):
            model.zero_grad(set_to_none=True)
            loss = forward_documents(runner, batch).loss
            loss.backward()
            results.append((loss.detach(), conformance.grads_of(model)))
        (want_loss, want_grad), (loss, grad) = results
        torch.testing.assert_close(loss, want_loss, atol=conformance.LOSS_TOL, rtol=0)
        assert ((grad - want_grad).norm() / want_grad.norm()).item() <= conformance.GRAD_TOL
        compiled_by_step.append(len(graphs))
    return compiled_by_step, dict(counters["graph_break"])
