"""Layout (where the documents are) and the document-aware attention functions that read it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from foundry_attn.flat.layout import Layout
from foundry_attn.flat.packing import PaddingCollator


def _bounds(lengths: list[int]) -> list[int]:
    return [sum(lengths[:i]) for i in range(len(lengths) + 1)]


LAYOUT = Layout(((2, 1), (3,), ()), 4)  # row 0: two documents + 1 pad; row 1: one + 1 pad; row 2: all padding


def test_from_batch_doc_lens() -> None:
    batch = PaddingCollator(0, 0, 6, mode="pack")(
        [torch.tensor([5, 6, 0, 7, 8, 9, 0, 0]), torch.tensor([3, 0, 0, 0, 0, 0, 0, 0])]
    )
    layout = Layout.from_batch(batch)
    assert layout == Layout(((3, 2), (4,)), 5)
    assert torch.equal(layout.restarting_positions(), batch["position_ids"].flatten()[layout.real_indices()])
    assert layout.own_positions is None  # doc_lens: each document counts from 0
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
    assert layout.bounds() == cu_seqlens.unique_consecutive().tolist() and layout.max_length == max_len
    same = Layout.from_batch({"input_ids": torch.zeros(3, 4), "attention_mask": mask, "doc_lens": None})
    assert same == layout


def test_from_batch_plain_input_ids() -> None:
    layout = Layout.from_batch({"input_ids": torch.zeros(2, 5, dtype=torch.long)})
    assert layout.doc_lens == ((5,), (5,)) and layout.real_tokens == layout.rows * layout.width
    assert torch.equal(layout.restarting_positions(), torch.arange(5).repeat(2))


def test_properties() -> None:
    assert LAYOUT.rows == 3 and LAYOUT.lengths == [2, 1, 3]
    assert LAYOUT.bounds() == [0, 2, 3, 6]
    assert LAYOUT.real_tokens == 6 and LAYOUT.max_length == 3
    assert LAYOUT.real_tokens / (LAYOUT.rows * LAYOUT.width) == 0.5
    assert Layout((), 4).max_length == 0


def test_real_indices_and_positions() -> None:
    idx = LAYOUT.real_indices()
    assert idx.dtype == torch.long and idx.tolist() == [0, 1, 2, 4, 5, 6]
    assert LAYOUT.restarting_positions().tolist() == [0, 1, 0, 0, 1, 2]
    assert Layout((), 4).restarting_positions().tolist() == []
    hidden = torch.arange(12.0).reshape(3, 4)
    assert hidden.flatten()[idx].tolist() == [0.0, 1.0, 2.0, 4.0, 5.0, 6.0]
    full = Layout(((4,), (2, 2)), 4)
    assert full.real_tokens == full.rows * full.width


def test_left_padded_mask() -> None:
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0], [0, 1, 1, 1]])
    layout = Layout.from_batch({"input_ids": torch.zeros(3, 4, dtype=torch.long), "attention_mask": mask})
    assert layout.doc_lens == ((2,), (3,), (3,)) and layout.starts == (2, 0, 1)
    assert layout.real_indices().tolist() == mask.flatten().nonzero().flatten().tolist()
    assert layout.restarting_positions().tolist() == [0, 1, 0, 1, 2, 0, 1, 2]


def test_gappy_mask_is_refused() -> None:
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0]])
    with pytest.raises(ValueError, match=r"rows \[0\] have gaps"):
        Layout.from_batch({"input_ids": torch.zeros(2, 4, dtype=torch.long), "attention_mask": mask})


def _alone(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """Per-document reference: plain SDPA with an explicit causal (+ window) bool mask, GQA repeated."""
    n = q.shape[2]
    i = torch.arange(n)
    allowed = (i[:, None] >= i[None, :]) & ((i[:, None] - i[None, :] < window) if window else True)
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2)


@pytest.mark.parametrize("backend", ["sdpa", "eager", "flex_attention"])
@pytest.mark.parametrize("window", [None, 3])
def test_adapters_match_each_document_alone(backend: str, window: int | None) -> None:
    from foundry_attn.attention.documents import Documents
    from foundry_attn.attention.functions import FUNCTIONS

    docs = Documents.of(_bounds([5, 1, 8, 2]))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 16, 8, generator=gen)
    k, v = torch.randn(1, 2, 16, 8, generator=gen), torch.randn(1, 2, 16, 8, generator=gen)
    module = torch.nn.Module()
    out, _ = FUNCTIONS[backend](module, q, k, v, None, sliding_window=window, foundry_documents=docs)
    for s, e in docs.spans:
        want = _alone(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], window)
        torch.testing.assert_close(out[:, s:e], want, atol=1e-5, rtol=1e-5)


def test_every_registered_name_has_its_function() -> None:
    from foundry_attn.attention.backends import PREFIX, REGISTERED
    from foundry_attn.attention.functions import FUNCTIONS

    assert REGISTERED == {PREFIX + name: name for name in FUNCTIONS}


@pytest.mark.parametrize("backend", ["flash_attention_2", "torch_varlen", "sdpa", "eager", "flex_attention"])
def test_functions_refuse_what_the_backend_table_says_they_cannot_apply(backend: str) -> None:
    """The policy refuses a model by the table; the function refuses the same at its call (the shared opening)."""
    from foundry_attn.attention.backends import BACKENDS
    from foundry_attn.attention.documents import Documents
    from foundry_attn.attention.functions import FUNCTIONS

    caps, q = BACKENDS[backend], torch.randn(1, 2, 4, 8)
    for name, honoured in (("softcap", caps.softcap), ("dropout", caps.dropout)):
        if not honoured:
            with pytest.raises(ValueError, match=f"{backend} cannot apply attention"):
                FUNCTIONS[backend](torch.nn.Module(), q, q, q, None, **{name: 0.5}, foundry_documents=Documents((0, 4)))


def test_block_masks_cached_per_documents_window_and_device() -> None:
    from foundry_attn.attention.block_masks import BLOCK_MASKS
    from foundry_attn.attention.documents import Documents

    docs = Documents.of(_bounds([3, 4]))
    first = BLOCK_MASKS.get(docs, None, torch.device("cpu"))
    assert BLOCK_MASKS.get(Documents.of(_bounds([3, 4])), None, torch.device("cpu")) is first
    assert BLOCK_MASKS.get(docs, 2, torch.device("cpu")) is not first


def test_sdpa_refuses_softcap_and_a_lost_documents_argument() -> None:
    from foundry_attn.attention.documents import Documents
    from foundry_attn.attention.functions import sdpa_documents

    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="softcap"):
        sdpa_documents(torch.nn.Module(), q, q, q, None, softcap=50.0, foundry_documents=Documents((0, 4)))
    placeholder = torch.zeros(1, 1, 1, 1)
    with pytest.raises(RuntimeError, match="did not reach"):
        sdpa_documents(torch.nn.Module(), q, q, q, placeholder)
