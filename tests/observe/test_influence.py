"""A leak is named at any precision, and a judgement never changes the step it observes.

Stock models from the zoo's tiny configs on a packed row as ``DataCollatorWithFlattening`` builds it (restarting
``position_ids``, no mask), a training forward in fp32 and under bf16 autocast, judged as the callbacks judge it
(:func:`foundry_attn.observe.verdict.judge` with the forward's own input embeddings): families whose state crosses
the document boundary (SSM, short convolution) are LEAK in both precisions, an exact family is isolated in both,
and RWKV's training step runs exactly as it does without the judgement.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util

import pytest
import torch

from foundry_attn.observe.verdict import ISOLATED, LEAKS, judge
from foundry_attn.proof.forward_probe import ForwardProbe
from foundry_attn.proof.synthetic import synthetic_documents
from foundry_attn.verify import zoo
from foundry_attn.verify.sweep import ZOO_LENGTHS

#: stock padding-free on transformers 5.x: exact for llama (its packed mask), not where state crosses documents
EXPECTED = {"llama": ISOLATED, "jamba": LEAKS, "zamba": LEAKS, "falcon_h1": LEAKS, "lfm2": LEAKS}


def _model(model_type: str, impl: str) -> torch.nn.Module:
    if model_type not in zoo.model_types():
        pytest.skip(f"transformers here has no {model_type}")
    try:
        config, model_class = zoo.tiny(model_type)
        model = zoo.build(config, model_class, impl)
    except (zoo.Unbuildable, ValueError, ImportError) as exc:
        pytest.skip(f"{model_type} under {impl} cannot be built here: {exc}")
    model.config.use_cache = False
    return model.train()


def _flattened(model: torch.nn.Module) -> dict:
    docs = synthetic_documents(model.config, ZOO_LENGTHS, torch.device("cpu"))
    ids = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(d.numel()) for d in docs])[None]
    return {"input_ids": ids, "position_ids": positions}


def _judged(model: torch.nn.Module, batch: dict, bf16: bool) -> tuple:
    autocast = torch.autocast("cpu", torch.bfloat16) if bf16 else contextlib.nullcontext()
    probe = ForwardProbe(model)
    with autocast:
        out = model(**batch)
    probe.remove()
    verdict = judge(model, batch, out, context=probe.context(), embeds=probe.embeds)
    return verdict, out


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", list(EXPECTED))
def test_a_leak_is_named_at_any_precision_and_an_exact_family_never_is(model_type: str, impl: str, bf16: bool) -> None:
    model = _model(model_type, impl)
    verdict, out = _judged(model, _flattened(model), bf16)
    # transformers 4.51's sdpa and eager ignore restarting position_ids: stock Llama leaks there too
    expected = EXPECTED[model_type] if importlib.util.find_spec("transformers.masking_utils") else LEAKS
    assert verdict.how == "measured" and verdict.state == expected, verdict.line()
    if verdict.state == ISOLATED:
        assert "exactly zero gradient" in verdict.line(), verdict.line()
    out.logits.float().sum().backward()  # the step's own backward still runs on the graph the verdict kept


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_the_judgement_leaves_rwkvs_step_as_it_is_without_it(bf16: bool) -> None:
    """RWKV rescales its weights in place when switched to eval mode: a judgement that switched would break the
    step's backward (fp32) or leave the weights halved (bf16). Judged, the step's gradients and weights are those of
    the same step unjudged."""
    model = _model("rwkv", "eager")
    model.config.rescale_every = 1
    plain = copy.deepcopy(model)
    batch = {"input_ids": _flattened(model)["input_ids"]}
    batch["doc_lens"] = [list(ZOO_LENGTHS)]  # the documents the verdict reads (RWKV takes no position_ids)
    verdict, out = _judged(model, batch, bf16)
    assert verdict.state == LEAKS, verdict.line()  # its recurrent state crosses the boundary
    out.logits.float().sum().backward()
    autocast = torch.autocast("cpu", torch.bfloat16) if bf16 else contextlib.nullcontext()
    with autocast:
        want = plain(input_ids=batch["input_ids"])
    want.logits.float().sum().backward()
    for (name, got), (_, same) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
        assert torch.equal(got, same), f"{name} changed"
        assert (got.grad is None) == (same.grad is None) and (got.grad is None or torch.equal(got.grad, same.grad)), (
            name
        )
