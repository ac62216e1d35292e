"""Flat where proven, one document per row where not: :func:`attach` points a model's attention at ours and
proves the flat path, keeping the :class:`~foundry_attn.flat.state.PathState` on the model.

    from foundry_attn import attach, forward_documents
    state = attach(hf_model, "sdpa")                 # proves the flat path against stock at once
    state.path, state.reason                         # "flat" | "rows", and why
    out = forward_documents(hf_model, batch)         # proves again on the first training batch, and after

    model:
      name: foundry_attn_causal_lm
      attn_path: auto              # auto | flat | rows; flat + attn_strict: true fails when flat is not proven
      attn_proof_interval: 100     # re-prove every N training batches (0: first batch and changes only)

What ``attach`` changes on the model, all of it here: ``config._attn_implementation`` (our registered name while flat,
the stock one while rows), ``model.foundry_path`` (the :class:`~foundry_attn.flat.state.PathState`), the instance's
``forward`` and its base model's (:class:`~foundry_attn.flat.forward.FlattenedForward`, ``FlattenedBackbone``: the
ecosystem's packed batches take the proven path). When each path runs and when the proof is due again:
:mod:`foundry_attn.flat.state`. Core module: torch and transformers only.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch

from foundry_attn.attention.backends import (
    BACKENDS,
    EAGER,
    FA2,
    FA2_REFERENCE,
    FLEX,
    NAMES,
    PREFIX,
    REGISTERED,
    SDPA,
    backend_of,
    set_implementation,
)
from foundry_attn.attention.functions import point
from foundry_attn.checks import check_interval
from foundry_attn.flat.forward import takes_flattened_batches
from foundry_attn.flat.inputs import flat_inputs
from foundry_attn.flat.layout import Layout
from foundry_attn.flat.proof import proof_lengths, synthetic_documents
from foundry_attn.flat.state import AUTO, FLAT, PATH_ATTR, PROOF_INTERVAL, ROWS, ROWS_NAME, PathState, check_path
from foundry_attn.flat.unwrap import unwrapped
from foundry_attn.selection.policy import AttentionUnavailableError, ModelTraits, model_check

log = logging.getLogger(__name__)


def _bypassed(backend: str) -> str | None:
    """A function a user registered under the stock name that our dispatch bypasses, named."""
    from transformers.modeling_utils import AttentionInterface

    stock = {
        SDPA: ("transformers.integrations.sdpa_attention", "sdpa_attention_forward"),
        FA2: ("transformers.integrations.flash_attention", "flash_attention_forward"),
        FLEX: ("transformers.integrations.flex_attention", "flex_attention_forward"),
    }.get(backend)
    registered = AttentionInterface._global_mapping.get(backend)
    if stock is None or registered is None:
        return None
    original = getattr(importlib.import_module(stock[0]), stock[1], None)
    if registered is original:
        return None
    name = getattr(registered, "__qualname__", repr(registered))
    module = getattr(registered, "__module__", "?")
    return (
        f"{module}.{name} is registered as '{backend}'; the flat path runs foundry_{backend} instead and bypasses "
        "it (attn_path: rows runs it)"
    )


def attach(
    model: Any,
    backend: str | None = None,
    path: str = AUTO,
    *,
    fa2_reference: bool = False,
    strict: bool = False,
    interval: int = PROOF_INTERVAL,
    prove_now: bool = True,
) -> PathState:
    """Point ``model``'s attention at our function for ``backend`` and prove the flat path against stock on two
    synthetic documents; a model it does not hold for runs one document per row, with the reason.

    Args:
        model: a transformers causal LM, or a wrapper of one (DDP, FSDP, ``torch.compile``, PEFT).
        backend: ``flash_attention_2``, ``torch_varlen``, ``flex_attention``, ``sdpa`` or ``eager``; default: the
            one the model runs now.
        path: ``auto`` (flat where proven), ``flat`` (binding with ``strict``: a failed proof raises
            :class:`~foundry_attn.flat.state.FlatPathError`) or ``rows``.
        fa2_reference: run FA2 on the pure-PyTorch reference kernel (CPU tests; never chosen by itself).
        strict: with ``path="flat"``, fail instead of falling back to rows.
        interval: re-prove every ``interval`` training batches, forward only (0: first batch and changes only).
        prove_now: False leaves the proof to the first training batch (weights not materialised yet, or a kernel
            this device cannot run).

    Returns:
        The :class:`~foundry_attn.flat.state.PathState` kept on the model: ``path`` (``flat`` or ``rows``),
        ``reason`` and every proof.

    Raises:
        AttentionUnavailableError: ``backend`` cannot run this model exactly on either path (the error names the
            backends that can).

    Example::

        >>> from foundry_attn import attach
        >>> state = attach(model, "sdpa")
        >>> state.path, state.reason
        ('flat', 'proven at attach: passed in 41 ms (documents [17, 23] of a 40-token row, ...)')
    """
    check_path(path)
    check_interval("attach", "interval", interval, minimum=0)
    hf = unwrapped(model)
    before = getattr(hf, PATH_ATTR, None)
    built = before.rows_name if before is not None else hf.config._attn_implementation
    backend = backend or backend_of(built) or EAGER
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; valid: {', '.join(BACKENDS)}")
    _refuse_unsupported(hf, backend, fa2_reference)
    takes_flattened_batches(hf)  # the ecosystem's packed batches (DataCollatorWithFlattening) take the proven path
    rows_name = built if backend_of(built) == backend and built not in REGISTERED else ROWS_NAME[backend]
    if backend == FA2 and fa2_reference and built != FA2:  # our function's stock branch installs the reference
        rows_name = PREFIX + FA2_REFERENCE
    if backend == FLEX and next(hf.parameters()).device.type == "cpu":  # stock flex compiles: no CPU training
        rows_name = EAGER
    state = PathState(
        backend,
        FLAT,
        "proven flat",
        point(hf, backend, fa2_reference),
        rows_name,
        reference=fa2_reference,
        binding=strict and path == FLAT,
        interval=interval,
    )
    setattr(hf, PATH_ATTR, state)
    bypassed = _bypassed(backend)
    if bypassed:
        state.notes.append(bypassed)
        log.warning("foundry_attn: %s", bypassed)
    if path == ROWS:
        state.path, state.reason = ROWS, "attn_path: rows"
        set_implementation(hf, rows_name)
    if prove_now:
        device = next(hf.parameters()).device
        docs = synthetic_documents(hf.config, proof_lengths(hf.config), device)
        layout = Layout((tuple(int(d.numel()) for d in docs),), sum(int(d.numel()) for d in docs))
        ids = torch.cat(docs)[None]
        inputs, _ = flat_inputs(hf, ids, layout.position_ids(device), None, layout)
        if path == ROWS:
            state.prove_rows(hf, inputs, "attach")
        else:
            state.prove(hf, inputs, "attach")
    elif path != ROWS:
        state.reason = "flat, proven on the first training batch"
    return state


def _refuse_unsupported(hf: Any, backend: str, reference: bool = False) -> None:
    """The policy's model checks (:func:`foundry_attn.selection.policy.model_check`), before anything is pointed: a
    backend the class does not declare (stock refuses it at load) or whose kernel cannot honour the config (a softcap
    under sdpa, ALiBi under FA2) runs neither path exactly, so it is refused with the backends that do run the model."""
    traits = ModelTraits.from_model_class(type(hf), hf.config)
    failed = model_check(backend, traits, reference)
    if failed is None:
        return
    check, refused = failed
    runs = [name for name in NAMES if model_check(name, traits, reference) is None]
    raise AttentionUnavailableError(
        f"attach: {backend} cannot run {traits.class_name} exactly: check '{check}' failed: {refused}. Fix: attach "
        f"with one of {runs} (stock transformers refuses this pair at load too)"
    )
