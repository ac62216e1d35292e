"""Flat where proven, one document per row where not: :func:`attach` points a model's attention at ours and
proves the flat path, keeping the :class:`~foundry_attn.path.state.PathState` on the model.

    from foundry_attn import attach, forward_documents
    state = attach(hf_model, "sdpa")                 # proves the flat path against stock at once
    state.path, state.reason                         # "flat" | "rows", and why
    out = forward_documents(hf_model, batch)         # proves again on the first training batch, and after

    model:
      name: foundry_attn_causal_lm
      attn_path: auto              # auto | flat | rows; flat + attn_strict: true fails when flat is not proven
      attn_proof_interval: 100     # re-prove every N training batches (0: first batch and changes only)

What ``attach`` changes on the model, all of it here: ``config._attn_implementation`` (our registered name while flat,
the stock one while rows), ``model.foundry_path`` (the :class:`~foundry_attn.path.state.PathState`), the instance's
``forward`` and its base model's (:class:`~foundry_attn.flat.model_forward.FlattenedForward`, ``FlattenedBackbone``: the
ecosystem's packed batches take the proven path). When each path runs and when the proof is due again:
:mod:`foundry_attn.path.state`. Core module: torch and transformers only.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from foundry_attn.attention.backends import BACKENDS, EAGER, FA2, backend_of, rows_name
from foundry_attn.attention.functions import bypassed_by
from foundry_attn.checks import check_choice, check_interval
from foundry_attn.flat.implementation import current, point, use
from foundry_attn.flat.model_forward import replace_forwards
from foundry_attn.flat.unwrap import compiled, unwrapped
from foundry_attn.path.execution import AUTO_STEP, check_execution, execution_for
from foundry_attn.path.forward import packed_backbone, packed_model, plain_call
from foundry_attn.path.proven import prove_at_attach
from foundry_attn.path.schedule import PROOF_INTERVAL, Schedule
from foundry_attn.path.state import (
    AUTO_PATH,
    FLAT,
    PATH_ATTR,
    ROWS,
    FlatPathError,
    PathState,
    check_path,
)
from foundry_attn.selection import policy
from foundry_attn.selection.backend_checks import model_refusal
from foundry_attn.selection.decision import decide, weights_compute_dtype
from foundry_attn.selection.policy import DEFAULT_FALLBACK, AttentionUnavailableError, Decision
from foundry_attn.selection.traits import ModelTraits

log = logging.getLogger(__name__)


def attach(
    model: Any,
    backend: str | None = None,
    path: str = AUTO_PATH,
    *,
    fallback: Sequence[str] = DEFAULT_FALLBACK,
    compute_dtype: str = "auto",
    fa2_reference: bool = False,
    strict: bool = False,
    interval: int = PROOF_INTERVAL,
    prove_now: bool = True,
    capacity: int = 0,
    execution: str = AUTO_STEP,
) -> PathState:
    """Point ``model``'s attention at our function for ``backend`` and prove the flat path against stock on two
    synthetic documents; a model it does not hold for runs one document per row, with the reason.

    Args:
        model: a transformers causal LM, or a wrapper of one (DDP, FSDP, ``torch.compile``, PEFT).
        backend: ``auto`` (the fastest backend of ``fallback`` whose checks pass for this model, device, dtype and
            install, as the LLM-Foundry builder's ``attn_implementation: auto`` decides; a backend attach then
            refuses moves the choice down the chain), or ``flash_attention_2``, ``torch_varlen``,
            ``flex_attention``, ``sdpa`` or ``eager``; default: the one the model runs now.
        fallback: the chain ``auto`` walks, fastest first.
        compute_dtype: the dtype attention computes in, for ``auto``'s checks (``auto``: the weights' where they are
            half, else bf16 on a CUDA device (the Trainer's ``bf16=True`` autocast) and fp32 on a CPU;
            ``bf16``, ``fp16``, ``fp32``).
        path: ``auto`` (flat where proven), ``flat`` (binding with ``strict``: a failed proof raises
            :class:`~foundry_attn.path.state.FlatPathError`) or ``rows``.
        fa2_reference: run FA2 on the pure-PyTorch reference kernel (CPU tests; never chosen by itself).
        strict: with ``path="flat"``, fail instead of falling back to rows.
        interval: re-prove every ``interval`` training batches, forward only (0: first batch and changes only).
        prove_now: False leaves the proof to the first training batch (weights not materialised yet, or a kernel
            this device cannot run).
        capacity: pad each flat row to a few fixed shapes, up to this many tokens (:mod:`foundry_attn.flat.capacity`:
            a step a CUDA graph can capture, no host sync), where the backend reads the bounds on the device
            (flash_attention_2, torch_varlen); 0: each row at its own length.
        execution: how the flat step runs (:mod:`foundry_attn.path.execution`): ``auto`` (graphed on CUDA where the
            backend reads its bounds on the device, at ``capacity`` or the first flat batch's rows x width; else
            compiled; eager on a CPU), ``eager``, ``compiled`` (the decoder layers compiled, forward and backward) or
            ``graphed`` (compiled and captured in CUDA graphs; needs CUDA and a ``capacity``); where one cannot
            apply, the next, with the reason (``state.execution``).

    Returns:
        The :class:`~foundry_attn.path.state.PathState` kept on the model: ``path`` (``flat`` or ``rows``),
        ``reason``, every proof and, for ``auto``, the ``decision`` (each backend of the chain and why not).

    Raises:
        AttentionUnavailableError: ``backend`` cannot run this model exactly on either path, or cannot run here at
            all (the failed check, its cause, and the backends that can); under ``auto``, nothing in the chain can.

    Example::

        >>> from foundry_attn import attach
        >>> state = attach(model, "auto")     # one script for every GPU of a mixed pool
        >>> state.backend
        'sdpa'
        >>> print(state.decision.reason)      # where flash-attn is not installed
        flash_attention_2: flash-attn is not installed (pip install flash-attn --no-build-isolation)...
        >>> state.path, state.reason
        ('flat', 'proven at attach: passed in ... ms (documents [28, 13] of a 42-token row, ...)')
    """
    check_path(path)
    check_interval("attach", "interval", interval, minimum=0)
    check_interval("attach", "capacity", capacity, minimum=0)
    check_execution(execution)
    if backend is not None:
        check_choice("attention backend", backend, (policy.AUTO, *BACKENDS))
    hf, caller_compiles = unwrapped(model), compiled(model)
    device = next(hf.parameters()).device
    # auto's chain, or flash_attention_2 named where it may not run here: the checks' cause before a proof fails on it
    checked = backend == FA2 and prove_now and not fa2_reference and device.type != "meta"
    if backend == policy.AUTO or checked:
        requested, chain = (policy.AUTO, tuple(fallback)) if backend == policy.AUTO else (FA2, (FA2,))
        dtype = weights_compute_dtype(next(hf.parameters()).dtype, compute_dtype)
        try:
            decision = decide(
                None,
                requested,
                chain,
                compute_dtype=dtype,
                fa2_reference=fa2_reference,
                config=hf.config,
                model_class=type(hf),
            )
        except AttentionUnavailableError as exc:
            if backend == policy.AUTO or not exc.candidates:
                raise
            raise _fa2_cannot_run(exc) from exc
    if backend == policy.AUTO:
        decision, state = _chain(hf, decision, path, fa2_reference, strict, interval, prove_now)
        level = logging.WARNING if decision.fell_back else logging.INFO
        log.log(
            level,
            "foundry_attn: attention on %s: requested auto, chose %s (%s); path %s (%s)",
            decision.where,
            decision.chosen,
            decision.reason,
            state.path,
            state.reason,
        )
    else:
        state = _attach_backend(hf, backend, path, fa2_reference, strict, interval, prove_now)
    return with_step(state, hf, capacity, execution, caller_compiles)


def _fa2_cannot_run(exc: AttentionUnavailableError) -> AttentionUnavailableError:
    """flash_attention_2 named where it cannot run (flash-attn not installed, no CUDA device, the dtype): the cause, as
    ``auto``'s chain says it (``exc``: the check that failed, its only candidate)."""
    failed = exc.candidates[0]
    install = "" if failed.fix in failed.reason else f" ({failed.fix})"
    return AttentionUnavailableError(
        f"attach: {FA2} cannot run on {exc.where}: check '{failed.check}' failed: {failed.reason}{install}. "
        'Fix: call attach(model, "auto") (the fastest backend that runs here), or name another backend'
    )


def capacity_refusal(state: PathState) -> str:
    """Why the flat row of ``state`` cannot be padded to a capacity ("" where it can).

    Args:
        state: the attached path's state.

    Returns:
        The reason, or "".

    Example::

        >>> capacity_refusal(attach(model, "sdpa"))
        "sdpa reads the documents' lengths on the host (flash_attention_2 and torch_varlen read their bounds on ...)"
    """
    if not BACKENDS[state.backend].static:
        return (
            f"{state.backend} reads the documents' lengths on the host (flash_attention_2 and torch_varlen read "
            "their bounds on the device)"
        )
    if state.traits.router_loss:
        return "the router's loss counts every token of the row, the padding's too"
    return ""


def with_step(state: PathState, hf: Any, capacity: int, execution: str, caller_compiles: bool = False) -> PathState:
    """How the flat step runs: each flat row padded to ``capacity`` where the backend reads the documents' bounds on
    the device (else the run says why not, once, and each row runs at its own length), and ``auto``, ``eager``,
    ``compiled`` or ``graphed`` where that applies (its capacity and backend; the device on the first batch), else
    the next one, the reason said (the path event, the inspector).

    Args:
        state: the attached path's state.
        hf: the transformers model.
        capacity: the most tokens of a padded row (0: off).
        execution: ``auto``, ``eager``, ``compiled`` or ``graphed``.
        caller_compiles: attach was given a compiled model (``torch.compile(model)``): the caller's compile runs it.

    Returns:
        ``state``, its ``capacity`` (0 where it cannot apply) and ``execution`` set.

    Example::

        >>> with_step(attach(model, "sdpa"), model, 0, "graphed").execution.runs   # no capacity under sdpa
        'compiled'
    """
    why = capacity_refusal(state)
    if capacity and why:
        note = f"capacity {capacity} not applied: {why}; each flat row runs at its own length"
        state.notes.append(note)
        log.warning("foundry_attn: %s %s", type(hf).__name__, note)
    applied = 0 if why else capacity
    rows, device = state.path == ROWS, next(hf.parameters()).device
    ran = execution_for(execution, caller_compiles, state.backend, applied, state.stock_mask, rows, device, why)
    state.run_with(capacity=applied, execution=ran)
    if execution != AUTO_STEP and ran.runs != execution:
        log.warning("foundry_attn: %s: attn_execution %s: %s", type(hf).__name__, execution, ran.reason)
    elif execution == AUTO_STEP:
        log.info("foundry_attn: %s: attn_execution %s", type(hf).__name__, ran.reason)
    return state


def attach_decision(
    model: Any,
    decision: Decision,
    path: str = AUTO_PATH,
    *,
    fa2_reference: bool = False,
    strict: bool = False,
    interval: int = PROOF_INTERVAL,
    prove_now: bool = True,
) -> tuple[Decision, PathState]:
    """Attach ``decision.chosen``; where attach refuses it (neither path runs it exactly here), or its rows would run
    another backend (torch_varlen's rows are sdpa's), the next backend of the decision's chain, the reason kept in
    the decision. The LLM-Foundry builder and ``attach(model, "auto")`` both walk the chain here.

    Args:
        model: a transformers causal LM, or a wrapper of one.
        decision: the selection's :class:`~foundry_attn.selection.policy.Decision` (``decide``), its chain included.
        path: ``auto``, ``flat`` or ``rows``, as for :func:`attach`.
        fa2_reference: run FA2 on the pure-PyTorch reference kernel.
        strict: with ``path="flat"``, fail instead of falling back to rows.
        interval: re-prove every ``interval`` training batches, forward only (0: first batch and changes only).
        prove_now: prove at once where the weights can run (not on meta, not real FA2 on a CPU); else the first batch.

    Returns:
        The decision with the chosen backend's proof and path, and the :class:`PathState` (``state.decision``).

    Raises:
        AttentionUnavailableError: nothing in the chain can run the model (or, strict, the requested backend
            cannot).

    Example::

        >>> decision = decide(None, "auto", config=hf_model.config, model_class=type(hf_model))
        >>> decision, state = attach_decision(hf_model, decision, "auto", interval=100)
        >>> decision.chosen, state.path
        ('sdpa', 'flat')
    """
    check_choice("attention backend", decision.chosen, BACKENDS)
    return _chain(unwrapped(model), decision, path, fa2_reference, strict, interval, prove_now)


def _chain(
    hf: Any, decision: Decision, path: str, fa2_reference: bool, strict: bool, interval: int, prove_now: bool
) -> tuple[Decision, PathState]:
    """:func:`attach_decision` on the HF model."""
    while True:
        chosen = decision.chosen
        device = next(hf.parameters()).device
        # the proof runs where the weights are: not on meta, not real FA2 on a model on the CPU
        now = (
            prove_now and device.type != "meta" and not (chosen == FA2 and not fa2_reference and device.type != "cuda")
        )
        # the path, its reason and the last proof are the state's (PathState.decision_now); "off": none asked
        decided = dataclasses.replace(decision, proof="first batch" if prove_now else "off")
        try:
            state = _attach_backend(hf, chosen, path, fa2_reference, strict, interval, now, decided)
        except FlatPathError:
            raise
        except AttentionUnavailableError as exc:
            why, check, fix = str(exc), "attach", "see the reason"
        else:
            if state.path != ROWS or backend_of(state.rows_name) == chosen:
                return decided, state
            why, check, fix = state.reason, "flat path", "see the error above"  # its rows run another backend
        decision = decision.with_rejection(chosen, why, check=check, fix=fix)


def _attach_backend(
    hf: Any,
    backend: str | None,
    path: str,
    fa2_reference: bool,
    strict: bool,
    interval: int,
    prove_now: bool,
    decided: Decision | None = None,
) -> PathState:
    """:func:`attach` for one named backend, on the HF model (``decided``: the chain's decision that chose it); a
    refusal leaves the model as it was."""
    before = getattr(hf, PATH_ATTR, None)
    built = before.rows_name if before is not None else current(hf)
    backend = backend or backend_of(built) or EAGER  # attach and decide checked the name given
    traits = ModelTraits.from_model_class(type(hf), hf.config)
    refused = model_refusal(traits, backend, fa2_reference)
    if refused:
        raise AttentionUnavailableError(refused)
    rows = rows_name(backend, built, fa2_reference, next(hf.parameters()).device.type == "cpu")
    bypassed = bypassed_by(backend)
    # the ecosystem's packed batches (DataCollatorWithFlattening) take the proven path
    forwards = replace_forwards(hf, packed_model, packed_backbone, plain_call)
    binding = strict and path == FLAT
    dtype = str(next(hf.parameters()).dtype).removeprefix("torch.")
    named = f"attach(model, {backend!r})"
    decision = decided or Decision.given(backend, named, strict=binding, compute_dtype=dtype, proof="first batch")
    state = PathState(
        backend,
        FLAT,
        "proven flat",
        point(hf, backend, fa2_reference),
        rows,
        reference=fa2_reference,
        binding=binding,
        schedule=Schedule(interval=interval),
        decision=decision,
        traits=traits,
    )
    setattr(hf, PATH_ATTR, state)
    if bypassed:
        state.notes.append(bypassed)
        log.warning("foundry_attn: %s", bypassed)
    if path == ROWS:
        state.to_rows("attn_path: rows", at_attach=True)
        use(hf, rows)
    if prove_now:
        try:
            prove_at_attach(state, hf)
        except AttentionUnavailableError:  # refused: the model as it was before this attach
            use(hf, built)
            if before is None:
                delattr(hf, PATH_ATTR)
            else:
                setattr(hf, PATH_ATTR, before)
            forwards.restore()
            raise
    elif path != ROWS:
        state.keep("flat, proven on the first training batch")
    return state
