"""MoE as it is really trained (``output_router_logits: true``): cross-entropy + coefficient x load-balancing loss equal
stock's on the same documents one per row with a 2-D mask (stock drops padding from the router statistics through
that mask), in ``pack`` and ``mask``, on whichever path the proof gives. The placeholder never reaches loss code."""

from __future__ import annotations

import pytest
import torch

from foundry_attn.path.attach import attach
from foundry_attn.path.forward import forward_documents
from foundry_attn.verify import conformance, sweep, zoo


def _moe_types() -> list[str]:
    """Every causal-LM type of this transformers whose config has a router loss switch."""
    from transformers import CONFIG_MAPPING

    found = []
    for model_type in zoo.model_types():
        try:
            if hasattr(CONFIG_MAPPING[model_type](), "output_router_logits"):
                found.append(model_type)
        except Exception:  # a config that needs an optional package: zoo.tiny says why in the test
            found.append(model_type)
    return found


MOE = _moe_types()


def _moe_model(model_type: str) -> torch.nn.Module:
    try:
        config, model_class = zoo.tiny(model_type)
    except (KeyError, zoo.Unbuildable) as exc:
        pytest.skip(f"{model_type}: not on this stack ({exc})")
    if not hasattr(config, "output_router_logits"):
        pytest.skip(f"{model_type}: no router loss in this release")
    config.output_router_logits = True
    config.router_aux_loss_coef = 0.5
    return zoo.build(config, model_class, "eager")


def _stock_rows(model: torch.nn.Module, docs: list[torch.Tensor]) -> tuple[float, float | None, torch.Tensor]:
    """Stock: one document per row, right-padded, a 2-D mask, labels -100 on padding."""
    out = model(**conformance.rows_inputs(docs), use_cache=False)
    out.loss.backward()
    aux = None if getattr(out, "aux_loss", None) is None else float(out.aux_loss)
    return out.loss.item(), aux, conformance.grads_of(model)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", MOE)
def test_router_loss_equals_stock(model_type: str) -> None:
    docs = conformance.sample_documents()
    stock = _moe_model(model_type)
    try:
        want_loss, want_aux, want_grad = _stock_rows(stock, docs)
    except Exception as exc:  # not ours to train: stock itself fails with output_router_logits on this config
        if sweep.raised_by_us(exc):
            raise
        pytest.skip(f"{model_type}: stock fails with output_router_logits: {type(exc).__name__}: {exc}")
    if want_aux is None:
        pytest.skip(f"{model_type}: its forward computes no load-balancing loss")
    assert want_aux > 0
    for mode in conformance.MODES:
        model = _moe_model(model_type)
        state = attach(model, "eager")
        out = forward_documents(model, conformance.collated(docs, mode))
        out.loss.backward()
        grad = conformance.grads_of(model)
        where = f"{model_type}/{mode} ({state.path}: {state.reason})"
        assert abs(out.loss.item() - want_loss) <= conformance.LOSS_TOL, where
        assert abs(float(out.aux_loss) - want_aux) <= conformance.LOSS_TOL, where
        assert ((grad - want_grad).norm() / want_grad.norm()).item() <= conformance.GRAD_TOL, where
