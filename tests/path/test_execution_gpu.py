"""The graphed execution on a GPU (skipped without CUDA and torch's varlen kernel): CUDA graphs recorded once per
bucket, every step equal to the eager one. Run on a GPU box: ``python -m pytest -q tests/path/test_execution_gpu.py``.
"""

from __future__ import annotations

import random

import pytest
import torch

from foundry_attn.attention.torch_varlen import torch_varlen_kernel
from foundry_attn.bench import on_device
from foundry_attn.path.attach import attach
from foundry_attn.path.execution import GRAPHED, PROOF_DUE
from foundry_attn.path.forward import forward_documents
from foundry_attn.verify import conformance

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch_varlen_kernel() is None,
        reason="needs a CUDA GPU and torch's varlen kernel (torch >= 2.10)",
    ),
]


def test_a_graphed_step_equals_the_eager_one_over_changing_layouts() -> None:
    torch._dynamo.reset()
    models = []
    for execution in (GRAPHED, "eager"):
        torch.manual_seed(0)
        model = conformance.build("llama", "sdpa").to("cuda", torch.bfloat16)
        state = attach(model, "torch_varlen", capacity=256, execution=execution)
        models.append((model, state))
    rng = random.Random(0)
    for _ in range(6):
        docs = [torch.randint(1, conformance.VOCAB, (rng.randint(2, 40),)) for _ in range(rng.randint(2, 5))]
        batch = on_device(conformance.collated(docs, "pack"), torch.device("cuda"))
        results = []
        for model, _ in models:
            model.zero_grad(set_to_none=True)
            loss = forward_documents(model, batch).loss
            loss.backward()
            results.append((loss.detach().float().clone(), conformance.grads_of(model).float()))
        (loss, grad), (want_loss, want_grad) = results
        torch.testing.assert_close(loss, want_loss, atol=2e-2, rtol=2e-2)
        assert ((grad - want_grad).norm() / want_grad.norm()).item() <= 5e-2
    state = models[0][1]
    assert state.execution.runs == GRAPHED and state.execution.eager == {PROOF_DUE: 1}, state.execution
