"""The proof in half precision judges as strictly as in fp32: per token, against stock on each document alone under
the same autocast, with limits from stock's own noise. SSM hybrids (their state crosses documents) end on rows;
Llama-like models stay flat; a leak of one token per document in one layer is caught at 1024-token documents."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import repeat_kv

from foundry_attn.attention.documents import DOCS_KEY
from foundry_attn.path.attach import attach
from foundry_attn.path.forward import forward_documents
from foundry_attn.verify import zoo
from tests.conftest import registered_attention

HYBRIDS = ("jamba", "falcon_h1", "zamba", "lfm2")  # conv / SSM state crosses documents on the flat row
LLAMA_LIKE = ("llama", "mistral", "qwen3", "olmo2", "phi3")


def _model(model_type: str) -> torch.nn.Module:
    if model_type not in zoo.model_types():
        pytest.skip(f"transformers here has no {model_type}")
    config, model_class = zoo.tiny(model_type)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return model_class(config).train()


def _batch(config, rows: list[list[int]], seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    width = max(sum(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, : sum(row)] = torch.randint(5, min(config.vocab_size, 1000), (sum(row),), generator=gen)
    return {"input_ids": ids, "labels": ids.clone(), "doc_lens": rows}


def _first_batch_path(model_type: str, autocast: bool) -> tuple[str, str]:
    model = _model(model_type)
    state = attach(model, "sdpa", prove_now=False)  # a model built on the CPU for a GPU run: the first batch proves
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        forward_documents(model, _batch(model.config, [[40, 30, 50], [60, 20]])).loss.backward()
    flat = [at for at, _ in state.proofs if not at.startswith("rows")]  # rows is proven after a failed flat proof
    assert flat[-1].startswith("batch 1"), state.proofs
    return state.path, state.reason


@pytest.mark.parametrize("model_type", HYBRIDS + LLAMA_LIKE)
def test_bf16_first_batch_proof_reaches_the_fp32_verdict(model_type: str) -> None:
    """Every leak the fp32 proof catches is caught in bf16, and no model exact in fp32 is sent to rows by noise."""
    if model_type in zoo.model_types() and not zoo.tiny(model_type)[1]._supports_sdpa:
        pytest.skip(f"{model_type} has no sdpa support in this transformers")
    fp32_path, fp32_reason = _first_batch_path(model_type, autocast=False)
    path, reason = _first_batch_path(model_type, autocast=True)
    assert path == fp32_path, (reason, fp32_reason)
    if model_type in HYBRIDS:
        assert path == "rows", reason
        # measured per token in bf16, or where the limits hold stock's own kernel spread, by the influence, exactly
        # (4.51's Jamba takes no **kwargs: refused before any comparison)
        said = ("half precision, worst token", "its loss reaches the other documents' embeddings", "takes no **kwargs")
        assert any(s in reason for s in said), reason


def _boundary_leak(genuine):
    """Layer 0 only: the first token of each document (but the first) also sees the previous document's last token."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        docs = kwargs.get(DOCS_KEY)
        out, weights = genuine(module, query, key, value, attention_mask, **kwargs)
        if docs is None or getattr(module, "layer_idx", 0) != 0:
            return out, weights
        groups = query.shape[1] // key.shape[1]
        k, v = repeat_kv(key, groups), repeat_kv(value, groups)
        out = out.clone()
        for s in docs.bounds[1:-1]:
            scores = (query[:, :, s : s + 1] @ k[:, :, s - 1 : s + 1].transpose(-1, -2)) * query.shape[-1] ** -0.5
            mixed = scores.softmax(-1).to(v.dtype) @ v[:, :, s - 1 : s + 1]  # [B, H, 1, D]
            out[:, s] = mixed[:, :, 0].to(out.dtype)
        return out, weights

    return attention


def test_a_one_token_boundary_leak_is_caught_in_bf16_at_1024_token_documents() -> None:
    model = _model("llama")
    with registered_attention("foundry_sdpa", _boundary_leak):
        state = attach(model, "sdpa", prove_now=False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            # two lengths: documents of one length would run as even rows, where no boundary is there to leak across
            forward_documents(model, _batch(model.config, [[1024, 1020]])).loss.backward()
    assert state.path == "rows" and "proof at batch 1" in state.reason, state.reason


def test_bf16_noise_of_an_exact_path_is_measured_and_below_the_limits() -> None:
    from foundry_attn.proof.tolerance import GRAD_TOKEN_RTOL_HALF, TOKEN_RTOL_HALF

    model = _model("llama")
    state = attach(model, "sdpa", prove_now=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        forward_documents(model, _batch(model.config, [[300, 200], [500]])).loss.backward()
    _, verdict = state.proofs[-1]
    assert verdict.ok and verdict.worst <= TOKEN_RTOL_HALF and verdict.worst_grad <= GRAD_TOKEN_RTOL_HALF, verdict
