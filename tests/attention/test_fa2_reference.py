"""The pure-PyTorch flash-attn reference against per-sequence SDPA, and its patching context."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from foundry_attn.attention import fa2_reference as ref
from foundry_attn.attention.fa2_reference import flash_attn_func, flash_attn_varlen_func, reference_flash_attn
from foundry_attn.observe.flash_calls import FlashCallTracer
from tests.conftest import REAL_FLASH_ATTN, assert_restored, snapshot

HEADS = [(2, 2), (4, 2), (4, 1)]  # (query heads, key/value heads): MHA, GQA, MQA
D = 8


def sdpa_one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None = None
) -> torch.Tensor:
    """One sequence q [Lq, Hq, D], k/v [Lk, Hk, D] through SDPA -> [Lq, Hq, D]; causal bottom-right aligned."""
    group = q.shape[1] // k.shape[1]
    qt, kt, vt = q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1), v.repeat_interleave(group, 1)
    lq, lk = q.shape[0], k.shape[0]
    if causal and lq == lk:
        out = F.scaled_dot_product_attention(qt, kt, vt.transpose(0, 1), is_causal=True, scale=scale)
    else:
        mask = None
        if causal:  # flash-attn >= 2.1: query i sits at key i + (lk - lq)
            mask = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        out = F.scaled_dot_product_attention(qt, kt, vt.transpose(0, 1), attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    heads=st.sampled_from(HEADS),
    causal=st.booleans(),
    scale=st.sampled_from([None, 0.1, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_varlen_matches_per_sequence_sdpa(
    lengths: list[int], heads: tuple[int, int], causal: bool, scale: float | None, seed: int
) -> None:
    hq, hk = heads
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, D, generator=gen) for h in (hq, hk, hk))
    cu_seqlens = cu(lengths)
    out = flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens,
        max_seqlen_q=max(lengths),
        max_seqlen_k=max(lengths),
        softmax_scale=scale,
        causal=causal,
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    starts = cu_seqlens.tolist()
    for a, b in itertools.pairwise(starts):
        torch.testing.assert_close(out[a:b], sdpa_one(q[a:b], k[a:b], v[a:b], causal, scale), atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    pairs=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 5)), min_size=1, max_size=3),
    heads=st.sampled_from(HEADS),
    seed=st.integers(0, 2**16),
)
def test_varlen_causal_shorter_queries_align_bottom_right(
    pairs: list[tuple[int, int]], heads: tuple[int, int], seed: int
) -> None:
    """seqlen_q <= seqlen_k per sequence (decoding with a cache): the last query sees every key."""
    hq, hk = heads
    lens_q = [lq for lq, _ in pairs]
    lens_k = [lq + extra for lq, extra in pairs]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), hq, D, generator=gen)
    k, v = (torch.randn(sum(lens_k), hk, D, generator=gen) for _ in range(2))
    cq, ck = cu(lens_q), cu(lens_k)
    out = flash_attn_varlen_func(q, k, v, cq, ck, max(lens_q), max(lens_k), causal=True)
    for i in range(len(pairs)):
        qa, qb, ka, kb = int(cq[i]), int(cq[i + 1]), int(ck[i]), int(ck[i + 1])
        torch.testing.assert_close(out[qa:qb], sdpa_one(q[qa:qb], k[ka:kb], v[ka:kb], True), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("hq", "hk"), HEADS)
@pytest.mark.parametrize("causal", [True, False])
def test_dense_matches_sdpa(hq: int, hk: int, causal: bool) -> None:
    torch.manual_seed(0)
    q = torch.randn(3, 5, hq, D)
    k, v = torch.randn(3, 5, hk, D), torch.randn(3, 5, hk, D)
    scale = 0.3
    out = flash_attn_func(q, k, v, 0.0, softmax_scale=scale, causal=causal)  # dropout positional, as transformers
    expected = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=scale, enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    default = flash_attn_func(q, k, v, causal=causal)
    torch.testing.assert_close(default, flash_attn_func(q, k, v, softmax_scale=1 / math.sqrt(D), causal=causal))


def test_dense_causal_shorter_query_bottom_right() -> None:
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 3, 2, D), torch.randn(2, 7, 2, D), torch.randn(2, 7, 2, D)
    out = flash_attn_func(q, k, v, causal=True)
    for b in range(2):
        torch.testing.assert_close(out[b], sdpa_one(q[b], k[b], v[b], True), atol=1e-5, rtol=1e-5)
    # a single query (decoding) attends to every key
    one = flash_attn_func(q[:, :1], k, v, causal=True)
    torch.testing.assert_close(one, flash_attn_func(q[:, :1], k, v, causal=False))


def test_more_queries_than_keys_gives_zeros_for_unseeing_queries() -> None:
    """Causal, seqlen_q > seqlen_k: the first queries see no key; flash-attn returns zeros there."""
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 5, 2, D), torch.randn(1, 3, 2, D), torch.randn(1, 3, 2, D)
    out = flash_attn_func(q, k, v, causal=True)
    assert torch.isfinite(out).all()
    assert (out[0, :2] == 0).all()
    torch.testing.assert_close(out[0, 2:], sdpa_one(q[0, 2:], k[0], v[0], True), atol=1e-5, rtol=1e-5)


def test_sliding_window_and_softcap() -> None:
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 6, 2, D), torch.randn(1, 6, 2, D), torch.randn(1, 6, 2, D)
    out = flash_attn_func(q, k, v, causal=True, window_size=(2, 2))
    i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
    mask = (j <= i) & (j >= i - 2)
    expected = F.scaled_dot_product_attention(
        q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), attn_mask=mask
    ).transpose(0, 1)
    torch.testing.assert_close(out[0], expected, atol=1e-5, rtol=1e-5)
    capped = flash_attn_func(q * 10, k, v, softcap=1.0)
    scores = 1.0 * torch.tanh((q[0] * 10).transpose(0, 1) @ k[0].permute(1, 2, 0) / math.sqrt(D) / 1.0)
    torch.testing.assert_close(
        capped[0], (scores.softmax(-1) @ v[0].transpose(0, 1)).transpose(0, 1), atol=1e-5, rtol=1e-5
    )


def test_half_inputs_keep_dtype() -> None:
    q = torch.randn(1, 4, 2, D, dtype=torch.bfloat16)
    out = flash_attn_func(q, q, q, causal=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(
        out.float(), flash_attn_func(q.float(), q.float(), q.float(), causal=True), atol=1e-2, rtol=1e-2
    )


def test_outputs_are_contiguous_with_the_value_head_dim_as_flash_attn_returns_them() -> None:
    """Callers ``.view`` the output (AFMoE, JetMoE); MLA-style layers give values another head dim than queries."""
    q, k = torch.randn(2, 5, 4, D), torch.randn(2, 5, 2, D)
    v = torch.randn(2, 5, 2, 2 * D)
    dense = flash_attn_func(q, k, v, causal=True)
    assert dense.shape == (2, 5, 4, 2 * D) and dense.is_contiguous()
    flat = flash_attn_varlen_func(q[0], k[0], v[0], cu([2, 3]), cu([2, 3]), 3, 3, causal=True)
    assert flat.shape == (5, 4, 2 * D) and flat.is_contiguous()
    want = sdpa_one(q[0, :2], k[0, :2], v[0, :2], causal=True)
    torch.testing.assert_close(flat[:2], want, rtol=1e-5, atol=1e-5)


def test_unsupported_arguments_raise() -> None:
    q = torch.randn(1, 4, 2, D)
    with pytest.raises(NotImplementedError, match="dropout"):
        flash_attn_func(q, q, q, 0.1, causal=True)
    with pytest.raises(NotImplementedError, match="dropout"):
        flash_attn_varlen_func(q[0], q[0], q[0], cu([4]), cu([4]), 4, 4, dropout_p=0.5)
    with pytest.raises(NotImplementedError):
        flash_attn_func(q, q, q, alibi_slopes=torch.ones(2))
    with pytest.raises(ValueError, match="multiple"):
        flash_attn_func(torch.randn(1, 4, 3, D), q, q)


def test_bert_padding_helpers_round_trip() -> None:
    hidden = torch.randn(2, 4, 3)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    flat, indices, cu_seqlens, max_len, seqlens = ref.unpad_input(hidden, mask)
    assert flat.shape == (4, 3) and cu_seqlens.tolist() == [0, 3, 4] and cu_seqlens.dtype == torch.int32
    assert max_len == 3 and seqlens.tolist() == [3, 1]
    torch.testing.assert_close(ref.index_first_axis(hidden.reshape(8, 3), indices), flat)
    back = ref.pad_input(flat, indices, 2, 4)
    torch.testing.assert_close(back, hidden * mask[..., None])


# ---- reference_flash_attn(): where transformers looks, and restoring it exactly ------------------------------


def test_context_installs_reference_kernels() -> None:
    import transformers.modeling_flash_attention_utils as fa_utils
    import transformers.utils

    before = snapshot()
    stock = transformers.utils.is_flash_attn_2_available()
    if not REAL_FLASH_ATTN:  # on a CUDA box with flash-attn, transformers has the real kernels already
        assert not stock
        assert "flash_attn_varlen_func" not in vars(fa_utils)
    with reference_flash_attn():
        assert fa_utils.flash_attn_varlen_func is flash_attn_varlen_func
        assert fa_utils.flash_attn_func is flash_attn_func
        assert fa_utils.pad_input is ref.pad_input and fa_utils.index_first_axis is ref.index_first_axis
        assert fa_utils.unpad_input is ref.unpad_input and fa_utils._flash_supports_window_size is True
        assert transformers.utils.is_flash_attn_2_available()
        assert transformers.utils.import_utils.is_flash_attn_2_available()
        assert fa_utils.is_flash_attn_available()
        if hasattr(fa_utils, "lazy_import_flash_attention"):  # where 4.54+ / 5.x really look the kernels up
            kernels = fa_utils.lazy_import_flash_attention("flash_attention_2")[0]
            assert flash_attn_func in kernels and flash_attn_varlen_func in kernels
    assert_restored(before)
    assert transformers.utils.is_flash_attn_2_available() == stock
    if not REAL_FLASH_ATTN:
        assert not hasattr(fa_utils, "flash_attn_varlen_func") and getattr(fa_utils, "flash_attn_func", None) is None


def test_context_restores_when_body_raises() -> None:
    before = snapshot()
    with pytest.raises(KeyError, match="boom"), reference_flash_attn():
        raise KeyError("boom")
    assert_restored(before)


def test_nested_contexts_restore_in_order() -> None:
    import transformers.modeling_flash_attention_utils as fa_utils

    before = snapshot()
    with reference_flash_attn():
        inside = snapshot()
        with reference_flash_attn():
            assert fa_utils.flash_attn_varlen_func is flash_attn_varlen_func
        assert_restored(inside)
        assert fa_utils.flash_attn_varlen_func is flash_attn_varlen_func
    assert_restored(before)


def test_tiny_llama_stock_fa2_unpad_path_matches_sdpa_per_row(llama) -> None:
    """transformers' own FA2 padded path (2-D mask with zeros -> _upad_input -> varlen -> pad_input) on CPU."""
    fa2, sdpa = llama("flash_attention_2", seed=7), llama("sdpa", seed=7)
    lengths = [9, 5, 1]
    width = max(lengths)
    torch.manual_seed(0)
    ids = torch.randint(1, 64, (len(lengths), width))
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad(), reference_flash_attn(), FlashCallTracer() as tracer:
        logits = fa2(input_ids=ids, attention_mask=mask).logits
    layers = fa2.config.num_hidden_layers  # the unpad + varlen path really ran, once per layer
    assert tracer.counts["upad"] == tracer.counts["varlen"] == layers and tracer.counts["dense"] == 0
    with torch.no_grad():
        for row, n in enumerate(lengths):
            alone = sdpa(input_ids=ids[row : row + 1, :n]).logits[0]
            torch.testing.assert_close(logits[row, :n], alone, atol=1e-5, rtol=1e-5)
