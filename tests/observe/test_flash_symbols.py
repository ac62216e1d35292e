"""Where transformers keeps its flash-attention symbols (4.51 and 5.x names, through the lazy importer), the
FlashCallTracer that counts them, and the tracer layered with the reference kernel in any order."""

from __future__ import annotations

import importlib
import types

import pytest
import torch

from foundry_attn.attention.fa2_reference import reference_flash_attn
from foundry_attn.observe.flash_calls import FlashCallTracer
from foundry_attn.observe.flash_symbols import DENSE, PAD, POSIDS, UPAD, VARLEN, discover
from foundry_attn.patching import original
from tests.conftest import PATCHED_MODULES, assert_restored, snapshot

# ---- symbol discovery --------------------------------------------------------------------------------------


def test_discover_the_installed_transformers_names() -> None:
    """The real names of both stacks we test on: 4.51 (pinned by LLM-Foundry) and 5.x (`make test-latest`)."""
    import transformers

    syms = discover()
    if transformers.__version__.startswith("4.51"):
        assert syms.found == {
            UPAD: "_upad_input",
            POSIDS: "prepare_fa2_from_position_ids",
            VARLEN: "flash_attn_varlen_func",
            DENSE: "flash_attn_func",
            PAD: "pad_input",
        }
        assert syms.lazy_import is None
    else:
        lazy = "lazy_import_flash_attention()"
        assert syms.found == {
            UPAD: "_upad_input",
            POSIDS: "_prepare_from_posids",
            VARLEN: f"{lazy}[1]",
            DENSE: f"{lazy}[0]",
            PAD: f"{lazy}[-2]",
        }
        assert syms.lazy_import == "lazy_import_flash_attention"
    assert syms.missing == {} and syms.describe_missing() == []


def _fake_5x_module() -> types.ModuleType:
    """A module shaped like later transformers: renamed helpers, kernels handed out by a lazy importer."""
    src = """
import torch
_calls = []
def _upad_input(q, k, v, mask, qlen, unpad_fn):
    cu = torch.tensor([0, 2, 3], dtype=torch.int32)
    return q, k, v, None, (cu, cu), (2, 2)
def _prepare_from_posids(q, k, v, position_ids):
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    return q, k, v, (cu, cu), (2, 2)
def _flash(q, k, v, **kw):
    return q
def _varlen(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, **kw):
    return q
def _pad(x, idx, b, s):
    return x
_pad_fn = None
def lazy_import_flash_attention(implementation):
    global _pad_fn
    _pad_fn = _pad
    return (_flash, _varlen, _pad_fn, None), dict
def _flash_attention_forward(q, k, v, attention_mask, query_length, position_ids=None, impl=None):
    (flash_fn, varlen_fn, pad_fn, unpad_fn), process = lazy_import_flash_attention(impl)
    if attention_mask is not None:
        q, k, v, idx, (cq, ck), (mq, mk) = _upad_input(q, k, v, attention_mask, query_length, unpad_fn)
        return pad_fn(varlen_fn(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq, max_seqlen_k=mk), idx, 1, 1)
    if position_ids is not None:
        q, k, v, (cq, ck), (mq, mk) = _prepare_from_posids(q, k, v, position_ids)
        return varlen_fn(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq, max_seqlen_k=mk)
    return flash_fn(q, k, v)
"""
    mod = types.ModuleType("fake_fa_utils_5x")
    exec(compile(src, "fake_fa_utils_5x", "exec"), mod.__dict__)  # a fixture module
    return mod


def test_discover_and_trace_5x_successors_through_the_lazy_importer() -> None:
    mod = _fake_5x_module()
    syms = discover(mod)
    assert syms.found == {
        UPAD: "_upad_input",
        POSIDS: "_prepare_from_posids",
        VARLEN: "lazy_import_flash_attention()[1]",
        DENSE: "lazy_import_flash_attention()[0]",
        PAD: "lazy_import_flash_attention()[-2]",
    }
    q = torch.zeros(3, 1, 1)
    originals = dict(vars(mod))
    with FlashCallTracer(syms, module=mod) as tracer:
        mod._flash_attention_forward(q, q, q, torch.ones(1, 3), 3)
        mod._flash_attention_forward(q, q, q, None, 3, position_ids=torch.tensor([[0, 0, 1]]))
        mod._flash_attention_forward(q, q, q, None, 3)
    assert tracer.counts == {UPAD: 1, POSIDS: 1, VARLEN: 2, DENSE: 1, PAD: 1}
    assert tracer.first[UPAD]["cu_seqlens_q"] == [0, 2, 3] and tracer.first[POSIDS]["cu_seqlens_k"] == [0, 1, 3]
    assert tracer.first[VARLEN]["cu_seqlens_q"] == [0, 2, 3] and tracer.entry == VARLEN
    assert all(vars(mod)[k] is v for k, v in originals.items() if k != "_pad_fn")  # (set by the fake importer)


def test_missing_symbols_are_named_with_the_version() -> None:
    mod = types.ModuleType("bare_fa_utils")
    exec("def _flash_attention_forward(q):\n    return flash_attn_func(q)\n", mod.__dict__)
    syms = discover(mod)
    assert syms.found == {DENSE: "flash_attn_func"}
    lines = syms.describe_missing()
    assert any("_upad_input" in line and "prepare_fa_kwargs_from_attn_mask" in line for line in lines)
    assert all(line.startswith(f"transformers {syms.transformers_version} has none of") for line in lines)


# ---- layered patches: tracers and the reference kernel nest in any order ----------------------------------


@pytest.mark.parametrize("order", ["tracer_first", "reference_first", "interleaved"])
def test_tracer_and_reference_compose_in_any_order(order: str, llama) -> None:
    model = llama("flash_attention_2", seed=1)
    ids = torch.randint(1, 64, (2, 8))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    before = snapshot()
    tracer = FlashCallTracer()
    ref = reference_flash_attn()
    with torch.no_grad():
        if order == "tracer_first":
            tracer.attach()
            with ref:
                model(input_ids=ids, attention_mask=mask)
            tracer.detach()
        elif order == "reference_first":
            with ref:
                tracer.attach()
                model(input_ids=ids, attention_mask=mask)
                tracer.detach()
        else:  # the tracer outlives the reference context that it entered inside of
            ref.__enter__()
            tracer.attach()
            model(input_ids=ids, attention_mask=mask)
            ref.__exit__(None, None, None)
            fa_utils = importlib.import_module(PATCHED_MODULES[0])
            stock = before[PATCHED_MODULES[0]].get("flash_attn_varlen_func")  # the real kernel, on a CUDA box
            if stock is None:
                assert "flash_attn_varlen_func" not in vars(fa_utils)  # reference gone; the tracer is dormant there
            else:  # reference gone; the tracer wraps the real kernel it stood in for
                assert original(fa_utils, "flash_attn_varlen_func") is stock is not fa_utils.flash_attn_varlen_func
            assert original(fa_utils, "_upad_input") is not fa_utils._upad_input  # and still traces the rest
            tracer.detach()
    assert tracer.counts[UPAD] == tracer.counts[VARLEN] == tracer.counts[PAD] == 2
    assert tracer.first[VARLEN]["cu_seqlens_q"] == [0, 8, 13]
    assert_restored(before, traced=True)


def test_two_tracers_nest_and_leave_out_of_order(llama) -> None:
    model = llama("flash_attention_2", seed=2)
    ids = torch.randint(1, 64, (1, 6))
    before = snapshot()
    outer, inner = FlashCallTracer(), FlashCallTracer()
    with torch.no_grad(), reference_flash_attn():
        outer.attach()
        inner.attach()
        model(input_ids=ids)
        outer.detach()  # the first one leaves first
        model(input_ids=ids)
        inner.detach()
    assert outer.counts[DENSE] == 2 and inner.counts[DENSE] == 4  # two layers per forward
    assert outer.entry == inner.entry == DENSE
    assert_restored(before, traced=True)
