"""GPU-only paths against the CPU reference: skipped without CUDA + flash-attn (run them on a GPU box)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from foundry_attn.bench import on_device
from foundry_attn.path.attach import attach
from foundry_attn.verify.llama_shapes import BLOG_LENGTHS
from tests.conftest import make_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None,
        reason="needs a CUDA GPU with flash-attn installed",
    ),
]


def test_real_flash_attn_varlen_matches_the_reference() -> None:
    from flash_attn import flash_attn_varlen_func as real

    from foundry_attn.attention.fa2_reference import flash_attn_varlen_func as reference

    torch.manual_seed(0)
    lens = list(BLOG_LENGTHS)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens), 9, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lens), 3, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kwargs = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=350, max_seqlen_k=350, causal=True)
    torch.testing.assert_close(real(q, k, v, **kwargs), reference(q, k, v, **kwargs), atol=2e-2, rtol=2e-2)


def test_policy_picks_fa2_on_this_gpu() -> None:
    from foundry_attn.selection.policy import choose

    decision = choose(dtype=torch.bfloat16)
    if torch.cuda.get_device_capability() >= (8, 0):
        assert decision.chosen == "flash_attention_2", decision.reason
    else:
        assert decision.chosen == "sdpa" and "< 8.0" in decision.reason


def test_unpad_once_on_real_fa2_matches_sdpa() -> None:
    from foundry_attn.flat.packing import PaddingCollator
    from foundry_attn.path.forward import forward_documents, repad_logits

    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("FA2 needs sm80+")
    rows = [torch.cat([torch.randint(1, 63, (n - 1,)), torch.tensor([0])]) for n in (5, 24, 13)]
    batch = PaddingCollator(63, 0, 24, "pack")(
        [torch.nn.functional.pad(r, (0, 24 - r.numel()), value=63) for r in rows]
    )
    batch = on_device(batch, torch.device("cuda"))
    outs = []
    for impl in ("flash_attention_2", "sdpa"):
        model = make_llama(impl).cuda().to(torch.bfloat16)
        attach(model, impl)  # our function: one flat row, the documents as call arguments (FA2: cu_seq_lens)
        with torch.no_grad():
            outs.append(repad_logits(forward_documents(model, batch)).float())
    real = batch["labels"] != -100
    torch.testing.assert_close(outs[0][real], outs[1][real], atol=5e-2, rtol=5e-2)
