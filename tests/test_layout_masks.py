"""Layout (where the documents are) and the document masks built from it: additive 4-D and flex BlockMask."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from foundry_attn.layout import Layout
from foundry_attn.masks import BlockMaskCache, block_causal_additive, eager_flex_attention
from foundry_attn.packing import PaddingCollator

LAYOUT = Layout(((2, 1), (3,), ()), 4)  # row 0: two documents + 1 pad; row 1: one + 1 pad; row 2: all padding


def test_from_batch_doc_lens() -> None:
    batch = PaddingCollator(0, 0, 6, mode="pack")([torch.tensor([5, 6, 0, 7, 8, 9, 0, 0]),
                                                    torch.tensor([3, 0, 0, 0, 0, 0, 0, 0])])
    layout = Layout.from_batch(batch)
    assert layout == Layout(((3, 2), (4,)), 5)
    assert torch.equal(layout.position_ids(), batch["position_ids"])
    assert layout.real_tokens == sum(batch["total_tokens"])


def test_from_batch_attention_mask() -> None:
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    layout = Layout.from_batch({"input_ids": torch.zeros(3, 4, dtype=torch.long), "attention_mask": mask})
    assert layout.doc_lens == ((3,), (1,), ()) and layout.width == 4
    # the same numbers transformers' own unpad path computes, per layer, with host syncs
    from transformers.modeling_flash_attention_utils import _get_unpad_data

    indices, cu_seqlens, max_len = _get_unpad_data(mask)
    assert torch.equal(layout.real_indices(), indices)
    # transformers keeps a zero-length entry for the all-padding row; a layout lists documents only
    assert torch.equal(layout.cu_seq_lens(), cu_seqlens.unique_consecutive()) and layout.max_length == max_len
    same = Layout.from_batch({"input_ids": torch.zeros(3, 4), "attention_mask": mask, "doc_lens": None})
    assert same == layout


def test_from_batch_plain_input_ids() -> None:
    layout = Layout.from_batch({"input_ids": torch.zeros(2, 5, dtype=torch.long)})
    assert layout.doc_lens == ((5,), (5,)) and not layout.has_padding and layout.fill_ratio == 1.0
    assert torch.equal(layout.position_ids(), torch.arange(5).expand(2, 5))


def test_properties() -> None:
    assert LAYOUT.rows == 3 and LAYOUT.lengths == [2, 1, 3]
    assert LAYOUT.bounds() == [0, 2, 3, 6]
    assert LAYOUT.real_tokens == 6 and LAYOUT.max_length == 3
    assert LAYOUT.has_padding and LAYOUT.fill_ratio == 0.5
    assert LAYOUT.signature() == (((2, 1), (3,), ()), 4)
    assert Layout((), 4).max_length == 0


def test_cu_seq_lens_real_indices_segments_positions() -> None:
    cu = LAYOUT.cu_seq_lens()
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 3, 6]
    idx = LAYOUT.real_indices()
    assert idx.dtype == torch.long and idx.tolist() == [0, 1, 2, 4, 5, 6]
    assert LAYOUT.segment_ids().tolist() == [[1, 1, 2, -1], [1, 1, 1, -1], [-1, -1, -1, -1]]
    assert LAYOUT.position_ids().tolist() == [[0, 1, 0, 0], [0, 1, 2, 0], [0, 1, 2, 3]]
    hidden = torch.arange(12.0).reshape(3, 4)
    assert hidden.flatten()[idx].tolist() == [0.0, 1.0, 2.0, 4.0, 5.0, 6.0]
    full = Layout(((4,), (2, 2)), 4)
    assert full.segment_ids().tolist() == [[1, 1, 1, 1], [1, 1, 2, 2]] and not full.has_padding


def loop_mask(layout: Layout) -> torch.Tensor:
    """[rows, 1, L, L] bool by explicit loops: same segment (documents; the pad tail is one more) and not later."""
    out = torch.zeros(layout.rows, 1, layout.width, layout.width, dtype=torch.bool)
    for r, row in enumerate(layout.doc_lens):
        bounds = [0]
        for n in (*row, layout.width - sum(row)):
            bounds.append(bounds[-1] + n)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            for i in range(a, b):
                for j in range(a, i + 1):
                    out[r, 0, i, j] = True
    return out


@pytest.mark.parametrize("layout", [LAYOUT, Layout(((1, 1, 1, 1),), 4), Layout(((5,), (2, 3), (1, 2)), 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_causal_additive_equals_loop_mask(layout: Layout, dtype: torch.dtype) -> None:
    mask = block_causal_additive(layout.segment_ids(), dtype)
    assert mask.shape == (layout.rows, 1, layout.width, layout.width) and mask.dtype == dtype
    allowed = loop_mask(layout)
    assert (mask[allowed] == 0).all()
    assert (mask[~allowed] == torch.finfo(dtype).min).all()
    assert allowed.diagonal(dim1=-2, dim2=-1).all()  # no empty softmax row


def test_additive_mask_makes_packed_documents_independent() -> None:
    layout = Layout(((3, 2), (4,)), 5)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 8) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_additive(layout.segment_ids(), q.dtype))
    for r, row in enumerate(layout.doc_lens):
        start = 0
        for n in row:
            s = slice(start, start + n)
            alone = F.scaled_dot_product_attention(q[r : r + 1, :, s], k[r : r + 1, :, s], v[r : r + 1, :, s],
                                                   is_causal=True)
            torch.testing.assert_close(out[r : r + 1, :, s], alone, atol=1e-6, rtol=1e-6)
            start += n


def test_block_mask_cache_per_layout_and_device() -> None:
    cache = BlockMaskCache(size=2)
    cpu = torch.device("cpu")
    first = cache.get(LAYOUT, cpu)
    assert cache.get(LAYOUT, cpu) is first
    assert cache.get(Layout(LAYOUT.doc_lens, LAYOUT.width), "cpu") is first  # equal layout, same device name
    other = cache.get(Layout(((4,), (3,), (1,)), 4), cpu)
    assert other is not first
    assert cache.get(LAYOUT, cpu) is first  # still cached (size 2), and now the most recent
    cache.get(Layout(((1,), (1,), (1,)), 4), cpu)  # evicts the least recently used: `other`
    assert cache.get(LAYOUT, cpu) is first
    assert cache.get(Layout(((4,), (3,), (1,)), 4), cpu) is not other


def test_flex_block_mask_matches_additive_mask_on_cpu() -> None:
    from torch.nn.attention.flex_attention import flex_attention

    layout = Layout(((3, 2), (4,), ()), 6)
    block_mask = BlockMaskCache().get(layout, torch.device("cpu"))
    assert block_mask.shape[0] == layout.rows and tuple(block_mask.shape[-2:]) == (6, 6)
    torch.manual_seed(1)
    q, k, v = (torch.randn(3, 2, 6, 8) for _ in range(3))
    got = flex_attention(q, k, v, block_mask=block_mask)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_additive(layout.segment_ids(), q.dtype))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_eager_flex_attention_context_restores() -> None:
    module = importlib.import_module("transformers.integrations.flex_attention")
    original = module.compile_friendly_flex_attention
    with eager_flex_attention():
        assert module.compile_friendly_flex_attention is not original
    assert module.compile_friendly_flex_attention is original
    with pytest.raises(RuntimeError), eager_flex_attention():
        raise RuntimeError("boom")
    assert module.compile_friendly_flex_attention is original
