"""Nothing that trains escapes the proof: every parameter's gradient, and a mask that carries a parameter.

The model here is a Llama whose attention adds a learnable bias to its ``attention_mask``, as Doge's dynamic mask
does: ``exp(A * softplus(feature of each key))``, with ``A`` zero at initialisation. Then the bias is a constant that
softmax cancels: logits, loss and input-embedding gradients agree whether the bias is applied or dropped, and only
``A``'s own gradient tells. On both stacks.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F

from foundry_attn.attention import function_calls
from foundry_attn.attention.documents import is_placeholder
from foundry_attn.flat.inputs import flat_inputs
from foundry_attn.flat.layout import Layout
from foundry_attn.flat.packing import PaddingCollator
from foundry_attn.path.attach import attach
from foundry_attn.path.forward import forward_documents, repad_logits
from foundry_attn.path.proven import subject_of
from foundry_attn.proof.prove import prove_flat
from tests.conftest import make_llama

LENGTHS = (13, 9, 17)


def _bias_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    length = hidden.shape[1]
    feature = F.softplus(hidden.mean(-1))  # [B, L]: one value per key
    bias = torch.exp(module.A[None, :, None] * feature[:, None, :])[:, :, None, :]  # [B, H, 1, L]
    mask = kwargs.get("attention_mask")
    low = torch.finfo(hidden.dtype).min
    if mask is None:  # stock builds no mask where is_causal suffices: the bias needs the causal part spelled out
        mask = torch.full((length, length), low, dtype=hidden.dtype, device=hidden.device).triu(1)[None, None]
    elif mask.dtype == torch.bool:
        mask = torch.where(mask, 0.0, low).to(hidden.dtype)
    elif is_placeholder(mask):
        pass  # the flat path's placeholder: as Doge does, the bias goes on whatever mask arrives
    kwargs["attention_mask"] = mask + bias
    return args, kwargs


def biased_llama(a: float = 0.0) -> torch.nn.Module:
    """A tiny Llama (sdpa, fp32) whose every attention adds ``exp(A * softplus(key feature))`` to its mask."""
    model = make_llama("sdpa")
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.A = torch.nn.Parameter(torch.full((model.config.num_attention_heads,), a))
        attn.register_forward_pre_hook(_bias_hook, with_kwargs=True)
    return model.train()


def _batch(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(3, 60, (n,), generator=gen) for n in LENGTHS]
    return PaddingCollator(0, 2, 64, mode="pack")(docs)


def _flat(model: torch.nn.Module) -> dict:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 60, (1, sum(LENGTHS)), generator=gen)
    layout = Layout((LENGTHS,), sum(LENGTHS))
    return flat_inputs(model, ids, None, layout)[0]


def test_a_mask_that_carries_a_learnable_bias_is_never_dropped() -> None:
    """Our documents would drop the bias: refused on our flat path, with the reason. Where stock splits a packed row
    itself (transformers 5.x), its own packed mask carries the bias and is proven exact (every parameter's gradient
    included): the row stays flat there; else one document per row."""
    model = biased_llama()
    state = attach(model, "sdpa")
    assert "attention_mask that carries a learnable bias" in state.reason, state.reason
    assert state.proofs[-1][1].ok, state.proofs[-1][1].describe()
    if state.path == "flat":  # one document per row is proven after it, a candidate for batches where it is cheaper
        proven = {at for at, proof in state.proofs if proof.ok}
        assert state.stock_mask and "stock's packed mask at attach" in proven, state.proofs
    else:
        assert state.proofs[-1][0] == "rows at attach", state.proofs


def test_a_parameter_the_flat_path_leaves_behind_fails_the_proof_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mask dropped silently (the refusal switched off): logits and embedding gradients agree, since A = 0
    makes the bias a constant; the parameter A gets no gradient, and the proof names it."""
    model = biased_llama()
    attach(model, "sdpa", prove_now=False)
    monkeypatch.setattr(function_calls, "mask_content", lambda mask: None)
    proof = prove_flat(subject_of(model), _flat(model), "sdpa")
    assert not proof.ok
    assert "model.layers.0.self_attn.A" in proof.reason and "get no gradient" in proof.reason, proof.reason
    assert proof.worst < 1e-5  # the logits alone would have passed it


def test_every_parameter_trains_exactly_on_the_path_attach_chose() -> None:
    """A packed batch through forward_documents: every parameter's gradient (A included, none missing) within 1e-3 of
    its own largest from each document alone through stock, the loss within 1e-5."""
    model = biased_llama()
    stock = copy.deepcopy(model)
    attach(model, "sdpa")
    batch = _batch()
    out = forward_documents(model, batch)
    out.loss.backward()
    total, targets, start = 0.0, 0, 0
    for n in LENGTHS:
        doc = batch["input_ids"][0, start : start + n]
        logits = stock(input_ids=doc[None]).logits[0, :-1]
        loss = F.cross_entropy(logits, doc[1:], reduction="sum")
        total, targets, start = total + loss, targets + n - 1, start + n
    (total / targets).backward()
    assert abs(out.loss.item() - (total / targets).item()) < 1e-5
    got = dict(model.named_parameters())
    for name, want in stock.named_parameters():
        assert want.grad is not None, name
        assert got[name].grad is not None, f"{name} missing"
        scale = want.grad.abs().max().item()
        assert (got[name].grad - want.grad).abs().max().item() <= 1e-3 * max(scale, 1e-12), name
    assert stock.model.layers[0].self_attn.A.grad.abs().max() > 0  # the parameter the proof must not miss


def test_a_model_that_assumes_left_padding_trains_exactly_on_left_padded_rows() -> None:
    """CPM-Ant ignores the attention mask and counts its real tokens from the left: right-padded rows are far off
    each document alone, so the rows path pads on the left (said once), and a packed batch trains exactly: the loss
    and every parameter's gradient, none missing."""
    from foundry_attn.verify import zoo

    config, model_class = zoo.tiny("cpmant")
    model = zoo.build(config, model_class, "eager").train()
    stock = copy.deepcopy(model)
    state = attach(model, "eager")
    assert state.path == "rows" and state.rows_left, state.reason
    assert any("left-padded rows are exact: rows pad left" in note for note in state.notes), state.notes
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, 100, (n,), generator=gen) for n in LENGTHS]
    batch = PaddingCollator(0, 2, 64, mode="pack")(docs)
    del batch["labels"]  # CPM-Ant's own loss does not shift its labels: the next-token loss from the logits
    logits = repad_logits(forward_documents(model, batch))[0]
    spans = itertools.pairwise(itertools.accumulate(LENGTHS, initial=0))
    targets = sum(n - 1 for n in LENGTHS)
    loss = sum(
        F.cross_entropy(logits[s : e - 1], d[1:], reduction="sum") for (s, e), d in zip(spans, docs, strict=True)
    )
    (loss / targets).backward()
    total = sum(F.cross_entropy(stock(input_ids=d[None]).logits[0, :-1], d[1:], reduction="sum") for d in docs)
    (total / targets).backward()
    assert abs(loss.item() - total.item()) / targets < 1e-5
    got = dict(model.named_parameters())
    for name, want in stock.named_parameters():
        if want.grad is None:
            continue
        assert got[name].grad is not None, f"{name} missing"
        scale = want.grad.abs().max().item()
        assert (got[name].grad - want.grad).abs().max().item() <= 1e-3 * max(scale, 1e-12), name
