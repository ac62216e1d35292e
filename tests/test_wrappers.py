"""Exact under the wrappers people train with: torch.compile, DDP and FSDP2 (CPU, gloo), with checkpointing.

Each run is compared with stock transformers running each document alone (``conformance._truth``), and
every attention call is recorded: it must get the ``[1, 1, 1, 1]`` placeholder and the documents, so the
fast path stays on (no L x L mask) whatever wraps the model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from foundry_attn import conformance
from foundry_attn.adapters import attach
from foundry_attn.forward import forward_documents

from .conftest import REPO
from .wrapped_worker import recorded


def _errors(family: str, backend: str, loss: torch.Tensor, model: torch.nn.Module) -> tuple[float, float]:
    want_loss, want_grad = conformance._truth(family, backend)
    grad = conformance._grads(model)
    return abs(loss.item() - want_loss), ((grad - want_grad).norm() / want_grad.norm()).item()


@pytest.mark.parametrize(("family", "backend", "compiler", "checkpointing"), [
    ("llama", "sdpa", "inductor", "plain"),
    ("mistral", "sdpa", "aot_eager", "checkpoint_wrapper"),
    ("gemma3", "eager", "aot_eager", "plain"),
    ("qwen2", "flash_attention_2", "aot_eager", "hf_non_reentrant"),
    ("mistral", "flex_attention", "aot_eager", "plain"),
])
def test_compiled_model_is_exact(family: str, backend: str, compiler: str, checkpointing: str) -> None:
    """``torch.compile(model)`` (inductor once, aot_eager for the rest: the same traced graph and autograd)."""
    torch._dynamo.reset()
    model = conformance.build(family, backend)
    calls: list[bool] = []
    recorded(attach(model, backend, fa2_reference=True), calls)
    conformance.enable_checkpointing(model, checkpointing)
    out = forward_documents(torch.compile(model, backend=compiler), conformance._batch(conformance._documents(),
                                                                                       "pack"))
    out.loss.backward()
    loss_err, grad_err = _errors(family, backend, out.loss, model)
    assert loss_err <= conformance.LOSS_TOL and grad_err <= conformance.GRAD_TOL, (loss_err, grad_err)
    assert calls and all(calls), calls  # placeholder + documents in every call: no L x L mask


@pytest.mark.parametrize(("wrapper", "ranks", "family", "backend", "checkpointing"), [
    ("fsdp2", 1, "llama", "sdpa", "plain"),
    ("fsdp2", 2, "gemma3", "sdpa", "checkpoint_wrapper"),
    ("fsdp2", 2, "llama", "flash_attention_2", "checkpoint_wrapper"),
    ("fsdp2", 2, "qwen2", "flex_attention", "plain"),
    ("ddp", 1, "mistral", "eager", "plain"),
    ("ddp", 2, "phi3", "sdpa", "hf_non_reentrant"),
])
def test_distributed_is_exact(tmp_path: Path, wrapper: str, ranks: int, family: str, backend: str,
                              checkpointing: str) -> None:
    """Each rank packs its share of the documents; rank 0 compares the averaged gradients with the truth."""
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
         str(REPO / "tests" / "wrapped_worker.py"), family, backend, wrapper, str(out), checkpointing],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())
    assert result["loss_err"] <= conformance.LOSS_TOL and result["grad_err"] <= conformance.GRAD_TOL, result
    assert result["fast"] and result["calls"] > 0, result
    assert result["wrapped"].startswith("DistributedDataParallel" if wrapper == "ddp" else "FSDP"), result
