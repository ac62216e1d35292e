"""torch's varlen flash kernel called directly (``attention/aten_flash.py``): the autograd plumbing around aten's
forward and backward, run here on a pure-PyTorch reference in aten's signature (CUDA's kernel is not on a CPU), against
each sequence alone through SDPA, grouped KV heads as they are, a window and a scale; the check that admits the direct
call, and what it does where the call fails or differs."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from foundry_attn.attention import aten_flash
from foundry_attn.attention.torch_varlen import call_varlen
from foundry_attn.bench.reference_kernels import reference_varlen_attn

LENGTHS = (9, 23, 5)


def _reference_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, scale, **window) -> tuple:
    """aten ``_flash_attention_forward``'s signature over the pure-PyTorch reference (NOT a GPU kernel)."""
    left, right = window["window_size_left"], window["window_size_right"]
    with torch.enable_grad():
        out = reference_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(left, right),
                                    enable_gqa=True)  # fmt: skip
    empty = q.new_empty(0)
    return out.detach(), empty, empty, empty, empty


def _reference_backward(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout, causal, rng, unused, **kw) -> tuple:
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    window = (kw["window_size_left"], kw["window_size_right"])
    with torch.enable_grad():
        again = reference_varlen_attn(*inputs, cu_q, cu_k, max_q, max_k, scale=kw["scale"], window_size=window,
                                      enable_gqa=True)  # fmt: skip
        return torch.autograd.grad(again, inputs, grad)


@pytest.fixture
def reference_ops(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(aten_flash, "OPS", [_reference_forward, _reference_backward])
    monkeypatch.setattr(aten_flash, "_CHECKED", {})
    yield


def _alone(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """Each sequence alone through SDPA (KV heads repeated), causal, within ``window`` keys (itself included)."""
    outs, start = [], 0
    for n in LENGTHS:
        qs, ks, vs = (t[start : start + n].transpose(0, 1) for t in (q, k, v))
        ks, vs = (t.repeat_interleave(qs.shape[0] // ks.shape[0], 0) for t in (ks, vs))
        allowed = torch.ones(n, n, dtype=torch.bool).tril()
        if window:
            allowed &= ~torch.ones(n, n, dtype=torch.bool).tril(-window)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale).transpose(0, 1))
        start += n
    return torch.cat(outs)


def _inputs() -> tuple[list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    qkv = [torch.randn(total, h, 16, generator=gen).requires_grad_() for h in (4, 2, 2)]
    cu = torch.tensor([0, 9, 32, 37], dtype=torch.int32)
    return qkv, cu


@pytest.mark.parametrize("window", [None, 4])
def test_the_direct_call_is_each_sequence_alone_with_grouped_heads_as_they_are(
    reference_ops: None, window: int | None
) -> None:
    (q, k, v), cu = _inputs()
    flash_window = (window - 1, 0) if window else (-1, 0)
    out = aten_flash.flash_varlen(q, k, v, cu, cu, max(LENGTHS), max(LENGTHS), 0.3, flash_window)
    want = _alone(q, k, v, 0.3, window)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    weight = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad((out * weight).sum(), (q, k, v))
    truth = torch.autograd.grad((want * weight).sum(), (q, k, v))
    for a, b in zip(got, truth, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert got[1].shape == k.shape  # the KV heads' gradients, summed over their groups by the kernel


def _check(q: torch.Tensor) -> bool:
    return aten_flash._agrees(q.device, q.dtype, reference_varlen_attn, call_varlen)


def test_the_direct_call_is_checked_once_against_varlen_attn_and_only_on_cuda(
    reference_ops: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    q = torch.zeros(4, 4, 64)
    assert _check(q)  # output and gradients agree on a grouped-head call
    assert not aten_flash.runs_directly(q, reference_varlen_attn, call_varlen)  # a CPU: varlen_attn's path
    assert aten_flash._CHECKED == {(q.device, q.dtype): False}

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no such kernel here")

    monkeypatch.setattr(aten_flash, "OPS", [failing, _reference_backward])
    with caplog.at_level(logging.WARNING):
        assert not _check(q)
    assert "called directly fails here (no such kernel here); varlen_attn runs" in caplog.text

    def off(*args: Any, **kwargs: Any) -> tuple:
        out, *rest = _reference_forward(*args, **kwargs)
        return (out * 1.1, *rest)

    monkeypatch.setattr(aten_flash, "OPS", [off, _reference_backward])
    with caplog.at_level(logging.WARNING):
        assert not _check(q)
    assert "called directly differs by" in caplog.text
