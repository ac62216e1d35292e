"""The ``torch_varlen`` adapter's glue, on the CPU: PyTorch's ``varlen_attn`` (CUDA only) stood in for by the
pure-PyTorch FA2 reference, in the three signatures torch has shipped (2.10: ``is_causal``, no ``scale``; 2.11:
``scale``, ``window_size``; 2.12+: ``enable_gqa`` too). Exact against stock transformers running each document alone
with sdpa."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from foundry_attn.attention import dense_functions, functions, varlen_functions
from foundry_attn.attention.backends import BACKENDS, PREFIX, TORCH_VARLEN, ModelNeeds
from foundry_attn.attention.fa2_reference import flash_attn_varlen_func
from foundry_attn.attention.torch_varlen import call_varlen, varlen_parameters
from foundry_attn.bench.reference_kernels import reference_varlen_attn
from foundry_attn.path.attach import attach
from foundry_attn.path.forward import forward_documents
from foundry_attn.selection.policy import AttentionUnavailableError
from foundry_attn.verify import conformance

calls: list[dict[str, Any]] = []


def varlen_212(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
) -> torch.Tensor:
    calls.append({"window_size": window_size, "enable_gqa": enable_gqa, "heads": (q.shape[1], k.shape[1])})
    assert enable_gqa or q.shape[1] == k.shape[1]
    return reference_varlen_attn(
        q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size, enable_gqa=enable_gqa
    )


def varlen_211(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    return_aux: object = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
) -> torch.Tensor:
    """torch 2.11's signature: a window and a scale, no ``enable_gqa`` (the adapter repeats KV heads)."""
    assert q.shape[1] == k.shape[1]
    return varlen_212(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size)


def varlen_210(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    is_causal: bool = False,
    return_aux: object = None,
) -> torch.Tensor:
    """torch 2.10's signature: ``is_causal``, no scale (the adapter folds the model's into the query), no window."""
    calls.append({"is_causal": is_causal, "heads": (q.shape[1], k.shape[1])})
    assert q.shape[1] == k.shape[1]
    return flash_attn_varlen_func(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, causal=is_causal)


@pytest.fixture(params=[varlen_212, varlen_211, varlen_210], ids=["torch>=2.12", "torch2.11", "torch2.10"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:

    fn = request.param
    monkeypatch.setattr(varlen_functions, "torch_varlen_kernel", lambda: fn)
    # the backend table as that torch would have it (windows from 2.11)
    windowed = dataclasses.replace(BACKENDS[TORCH_VARLEN], window="window_size" in varlen_parameters(fn))
    monkeypatch.setitem(BACKENDS, TORCH_VARLEN, windowed)
    calls.clear()
    return fn


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "phi3", "gemma3"])
def test_torch_varlen_documents_are_exact(kernel: Any, family: str) -> None:
    model = conformance.build(family, "sdpa")
    windowed = ModelNeeds.of(family, model.config).window
    if windowed and kernel is varlen_210:  # refused before anything is pointed, as the policy refuses it there
        with pytest.raises(AttentionUnavailableError, match=r"sliding window \(4\) with this torch.*one of \""):
            attach(model, TORCH_VARLEN)
        assert model.config._attn_implementation == "sdpa"
        return
    state = attach(model, TORCH_VARLEN)
    batch = conformance.collated(conformance.sample_documents(), "pack")
    assert state.path == "flat", state.reason
    out = forward_documents(model, batch)  # the first training batch: proven at its length, then run
    out.loss.backward()
    want_loss, want_grad = conformance.truth_alone(family, "sdpa")
    grad = conformance.grads_of(model)
    assert abs(out.loss.item() - want_loss) <= conformance.LOSS_TOL
    assert ((grad - want_grad).norm() / want_grad.norm()).item() <= conformance.GRAD_TOL
    layers = model.config.num_hidden_layers
    calls.clear()
    forward_documents(model, batch)
    assert len(calls) == layers  # one varlen call per layer over the flat row: no per-layer unpad
    if kernel is not varlen_210:
        heads = calls[0]["heads"]
        assert calls[0]["enable_gqa"] == (heads[0] != heads[1])
        assert calls[0]["window_size"] == ((windowed - 1 if windowed else -1), 0)


@pytest.mark.parametrize("window", [(-1, -1), (3, -1)])
def test_each_signature_gets_the_scale_the_grouped_heads_and_the_window_asked(kernel: Any, window: tuple) -> None:
    """``call_varlen`` on each signature, against the FA2 reference: a scale that is not ``1/sqrt(D)`` (folded into
    the query on 2.10), 4 heads over 2 KV heads (repeated before 2.12), a window where the kernel takes one."""
    torch.manual_seed(0)
    q, k, v = torch.randn(15, 4, 8), torch.randn(15, 2, 8), torch.randn(15, 2, 8)
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    if window != (-1, -1) and kernel is varlen_210:
        with pytest.raises(ValueError, match="has no window_size"):
            call_varlen(kernel, q, k, v, cu, cu, 9, 9, scale=0.3, window=window)
        return
    got = call_varlen(kernel, q, k, v, cu, cu, 9, 9, scale=0.3, window=window)
    want = flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, softmax_scale=0.3, causal=True, window_size=window)
    torch.testing.assert_close(got, want)


def test_torch_varlen_refuses_softcap_and_dropout(kernel: Any) -> None:
    """Neither path applies Gemma2's softcap (rows would be stock sdpa, which raises on it): refused at attach, with
    the policy's words and the backends that do run it."""
    model = conformance.build("gemma2", "eager")
    with pytest.raises(AttentionUnavailableError, match=r'softcap \(50.0\).*one of "flash_attention_2", "eager"'):
        attach(model, TORCH_VARLEN)
    assert model.config._attn_implementation == "eager"  # nothing pointed


def test_flex_block_masks_live_on_the_query_device_one_per_device() -> None:
    """Pipeline stages / device_map put layers on different devices: each device gets its own mask, and every
    tensor its mask_mod captures sits on that device (a foreign one fails under compile)."""
    from foundry_attn.attention.block_masks import BLOCK_MASKS
    from foundry_attn.attention.documents import Documents

    docs = Documents.of([0, 5, 16, 19])
    devices = [torch.device("cpu")] + [torch.device("cuda", i) for i in range(min(2, torch.cuda.device_count()))]
    masks = {str(d): BLOCK_MASKS.get(docs, None, d) for d in devices}
    assert len({id(m) for m in masks.values()}) == len(devices)  # one per device
    assert all(BLOCK_MASKS.get(docs, None, d) is masks[str(d)] for d in devices)  # cached per (device, layout)
    for name, mask in masks.items():
        captured = [
            c.cell_contents for c in mask.mask_mod.__closure__ or () if isinstance(c.cell_contents, torch.Tensor)
        ]
        assert captured and all(str(t.device) == name for t in captured), name
        assert all(str(t.device) == name for t in (mask.kv_num_blocks, mask.kv_indices))


def test_torch_varlen_without_documents_runs_stock_sdpa_on_the_models_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eval and generation (no documents in the call) run sdpa on the model's own mask, as the rows path does,
    never eager math: the padded logits and a cached decoding step equal stock sdpa's."""
    from tests.conftest import make_llama

    functions.register()
    sdpa_calls: list[int] = []
    stock_sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda *a, **k: sdpa_calls.append(1) or stock_sdpa(*a, **k),
    )
    monkeypatch.setattr(dense_functions, "eager_math", lambda *a, **k: pytest.fail("eager math ran"))
    ids = torch.randint(1, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    stock, ours = make_llama("sdpa"), make_llama("sdpa")
    ours.config._attn_implementation = PREFIX + TORCH_VARLEN
    with torch.no_grad():
        want = stock(input_ids=ids, attention_mask=mask).logits
        sdpa_calls.clear()
        got = ours(input_ids=ids, attention_mask=mask).logits
        assert sdpa_calls, "sdpa did not run"
        torch.testing.assert_close(got * mask[..., None], want * mask[..., None], atol=1e-6, rtol=0)
        gen = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert torch.equal(ours.generate(ids[:1], **gen), stock.generate(ids[:1], **gen))
