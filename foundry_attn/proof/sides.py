"""The packed side of a proof: the flat row, stock's packed mask, or one document per row, run as they train.

    side = flat_side(inputs)                       # the flat row that trains (foundry_attn.proof.prove runs it)
    run_, error = side(subject, spans, True)       # its logits and gradients, or why it could not run

Each side returns a :class:`~foundry_attn.proof.runs.Run` of the whole row (or why it could not run); the proof
(:mod:`foundry_attn.proof.prove`) compares it with each document alone. Core module: torch and transformers only.
"""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from foundry_attn.attention.documents import DOCS_KEY, Documents, DocumentsDropped, FlatUnsupported
from foundry_attn.attention.fa2_reference import kernel_context
from foundry_attn.flat.inputs import one_per_row, stock_packed
from foundry_attn.flat.layout import Layout, Truth
from foundry_attn.flat.packing import IGNORE_INDEX
from foundry_attn.proof.comparison import summed
from foundry_attn.proof.proving import hidden
from foundry_attn.proof.result import NO_CALLS
from foundry_attn.proof.runs import (
    Run,
    embeddings,
    loss_grads,
    run,
    state_kept,
    token_embeddings,
    trainable,
)
from foundry_attn.proof.subject import Subject
from foundry_attn.proof.tolerance import undefined_values

#: the packed side of a proof: (the model, the compared documents' spans, grads) -> its run, or None and why not
PackedSide = Callable[[Subject, Sequence[tuple[int, int]], bool], tuple["Run | None", str]]


def checkpointing(hf: Any) -> bool:
    """Whether transformers' activation checkpointing is on in ``hf`` (``is_activation_checkpointing``; before
    transformers 5, ``is_gradient_checkpointing``, which 5.x keeps as a deprecated alias until v6).

    Args:
        hf: a transformers model (or any module: False).

    Returns:
        True where the model's layers recompute their forward in backward.

    Example::

        >>> checkpointing(hf_model), hf_model.gradient_checkpointing_enable(), checkpointing(hf_model)
        (False, None, True)
    """
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(hf), name):
            return bool(getattr(hf, name))
    return False


def dropped_in_training(subject: Subject, inputs: Mapping[str, Any]) -> str | None:
    """Under HF gradient checkpointing some layers call attention without ``**kwargs`` (GPT-NeoX in 4.51), which
    the eval-mode proof never sees: one flat forward in training mode, without grad (an exception inside a
    non-reentrant checkpoint with grad would leave its hooks behind), the RNG restored after its dropout.

    Args:
        subject: the model.
        inputs: the flat row's inputs.

    Returns:
        Why the flat row does not run in training mode under checkpointing, or None.

    Example::

        >>> dropped_in_training(subject, inputs) is None      # no checkpointing, or the documents reach attention
        True
    """
    hf = subject.model
    if not checkpointing(hf):
        return None
    device = inputs["input_ids"].device
    was_training = hf.training
    hf.train()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            _, why = _flat_run(subject, inputs, [], False)
    finally:
        hf.train(was_training)
    return f"under HF gradient checkpointing: {why}" if why else None


def passes_kwargs(model: Any) -> bool:
    """Whether the base model's ``forward`` takes ``**kwargs`` (GPT-2's does not: nothing reaches attention).

    Args:
        model: the transformers model.

    Returns:
        True where its base model's ``forward`` has a ``**kwargs`` parameter.

    Example::

        >>> class Plain(torch.nn.Module):     # a forward without **kwargs: nothing reaches attention
        ...     def forward(self, input_ids):
        ...         return input_ids
        >>> passes_kwargs(Plain()), passes_kwargs(llama_model)
        (False, True)
    """
    base = getattr(model, "base_model", model)
    params = inspect.signature(base.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def row_labels(inputs: Mapping[str, Any]) -> torch.Tensor | None:
    """The ``[tokens]`` labels of a flat row's inputs, as its forward trains on them (None: it has none).

    Args:
        inputs: the flat row's forward arguments.

    Returns:
        Its one row of labels, or None.

    Example::

        >>> row_labels(inputs).shape      # 28 + 13 + 1 real tokens
        torch.Size([42])
    """
    labels = inputs.get("labels")
    return None if labels is None else labels.reshape(-1)


def _flat_run(
    subject: Subject, inputs: Mapping[str, Any], spans: Sequence[tuple[int, int]], grads: bool
) -> tuple[Run | None, str]:
    """The flat path's run of ``inputs``, or None and why it cannot run. The documents object is a fresh copy, so
    its call count is this forward's alone."""
    hf = subject.model
    if not passes_kwargs(hf):
        base = type(getattr(hf, "base_model", hf)).__name__
        return None, f"{base}.forward takes no **kwargs: the documents cannot reach attention"
    labels, docs = row_labels(inputs), inputs[DOCS_KEY]
    fresh = Documents(docs.bounds, docs.device_bounds, docs.host_bounds, docs.real, docs.pinned)
    try:
        flat = run(subject, {**inputs, DOCS_KEY: fresh, "labels": None}, spans, grads, labels)
    except DocumentsDropped as exc:
        caller = next((type(m).__name__ for m in hf.modules() if any(c is exc.module for c in m.children())), "?")
        hint = (
            "; HF gradient checkpointing calls the layers without **kwargs: use Composer's activation_checkpointing "
            "(checkpoint_wrapper) to keep the flat path"
            if checkpointing(hf) and hf.training
            else ""
        )
        return None, f"{exc}; the caller is {caller}{hint}"
    except FlatUnsupported as exc:
        return None, str(exc)
    except Exception as exc:
        return None, f"the flat row does not run: {short_error(exc)}"
    if fresh.calls == 0:
        return None, NO_CALLS
    return flat, ""


def rows_train_error(
    subject: Subject, inputs: Mapping[str, Any], rows_name: str, reference: bool, left: bool = False
) -> str:
    """Why one document per row (as :func:`prove_rows` lays it out) does not run a training forward here, or "" when it
    runs: for a rows proof whose own forwards could not run (Reformer refuses a backward in eval mode; a backend
    whose kernel is missing fails anywhere). Without grad, the RNG and the mode restored after.

    Args:
        subject: the model.
        inputs: the flat row's forward arguments (its first two documents run).
        rows_name: the stock implementation the padded rows run under.
        reference: run FA2 on the pure-PyTorch reference kernel.
        left: left-pad the rows (default: right).

    Returns:
        The error, or "" where the training forward runs.

    Example::

        >>> rows_train_error(subject, inputs, "sdpa", reference=False)
        ''
    """
    hf = subject.model
    docs: Documents = inputs[DOCS_KEY]
    device = inputs["input_ids"].device
    was_training = hf.training
    hf.train()
    try:
        with (
            hidden(),
            state_kept(hf),
            torch.no_grad(),
            torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
        ):
            run_, why = _rows_run(
                subject, inputs, docs.spans[:2], False, rows_name, reference, None, left, docs.max_length
            )
    finally:
        hf.train(was_training)
    if run_ is None:
        return why
    undefined = undefined_values([run_], docs.spans[:2], packed=True)
    return f"one document per row ({rows_name}) computes {undefined}" if undefined else ""


def stock_packed_run(
    subject: Subject, inputs: Mapping[str, Any], spans: Sequence[tuple[int, int]], grads: bool, stock: str
) -> tuple[Run | None, str]:
    """Stock's own run of the flat row (its packed mask), or None and why it cannot run.

    Args:
        subject: the model.
        inputs: the flat row's inputs.
        spans: the compared documents' ``(start, end)``.
        grads: compute their gradients too.
        stock: the stock implementation whose packed mask runs.

    Returns:
        ``(run, "")``, or ``(None, why)``.

    Example::

        >>> run_, why = stock_packed_run(subject, inputs, [(0, 28)], True, "sdpa")
        >>> run_.logits.shape, why
        (torch.Size([42, 64]), '')
    """
    labels = row_labels(inputs)
    try:
        with subject.running(stock):
            return run(subject, {**stock_packed(inputs), "labels": None}, spans, grads, labels), ""
    except Exception as exc:
        return None, f"the flat row with stock's packed mask does not run: {short_error(exc)}"


def flat_side(inputs: Mapping[str, Any]) -> PackedSide:
    """The flat row that trains, as a proof's packed side.

    Args:
        inputs: the flat row's inputs, its documents under ``DOCS_KEY``.

    Returns:
        The side: ``(model, spans, grads) -> (run or None, why not)``.

    Example::

        >>> run_, why = flat_side(inputs)(subject, [(0, 28)], True)
        >>> run_.logits.shape, run_.grad.shape, why      # the 42-token row
        (torch.Size([42, 64]), torch.Size([42, 32]), '')
    """
    return lambda subject, spans, grads: _flat_run(subject, inputs, spans, grads)


def rows_side(
    inputs: Mapping[str, Any],
    rows_name: str,
    reference: bool,
    truth: Truth | None,
    left: bool = False,
    groups: Sequence[Sequence[int]] = (),
) -> PackedSide:
    """One document per row as it trains (right- or ``left``-padded, under ``rows_name``), as a proof's packed side.

    Args:
        inputs: the flat row's inputs, its documents under ``DOCS_KEY``.
        rows_name: the stock implementation the rows run under.
        reference: FA2 on the pure-PyTorch reference kernel.
        truth: the documents' positions and labels from the batch (None: the model's own).
        left: left-pad the rows.
        groups: the documents of each forward the batch's rows run in (empty: one, as wide as the longest).

    Returns:
        The side: ``(model, spans, grads) -> (run or None, why not)``, the rows placed back in the flat row.

    Example::

        >>> run_, why = rows_side(inputs, "sdpa", False, None)(subject, [(0, 28)], True)
        >>> run_.logits.shape, why      # placed back in the 42-token row
        (torch.Size([42, 64]), '')
    """
    docs: Documents = inputs[DOCS_KEY]
    spans, lengths = docs.spans, docs.lengths
    width = {spans[d]: max(lengths[m] for m in group) for group in groups for d in group}

    def side(subject: Subject, spans: Sequence[tuple[int, int]], grads: bool) -> tuple[Run | None, str]:
        by_width: dict[int, list[tuple[int, int]]] = {}
        for span in spans:  # as wide as its forward's rows, or as the batch's longest document
            by_width.setdefault(width.get(span, docs.max_length), []).append(span)
        runs = []
        for wide, some in by_width.items():
            one, why = _rows_run(subject, inputs, some, grads, rows_name, reference, truth, left, wide)
            if one is None:
                return None, why
            runs.append(one)
        return _joined(runs), ""

    return side


def _joined(runs: Sequence[Run]) -> Run:
    """The runs of documents at separate places of the flat row (each zero elsewhere) as one."""
    if len(runs) == 1:
        return runs[0]
    grads = [r.grad for r in runs if r.grad is not None]
    grad = torch.stack(grads).sum(0) if len(grads) == len(runs) else None
    return Run(torch.stack([r.logits for r in runs]).sum(0), grad, summed(runs))


def _rows_run(
    subject: Subject,
    inputs: Mapping[str, Any],
    spans: Sequence[tuple[int, int]],
    grads: bool,
    rows_name: str,
    reference: bool,
    truth: Truth | None,
    left: bool = False,
    width: int = 0,
) -> tuple[Run | None, str]:
    """The rows path's run of the documents at ``spans`` (one per row, as :func:`one_per_row` lays out a training
    batch: ``width`` wide, ``left``-padded or right), placed back at their positions of the flat row; or None and
    why it cannot run."""
    hf = subject.model
    ids = inputs["input_ids"].reshape(1, -1)
    index = torch.cat([torch.arange(s, e) for s, e in spans]).to(ids.device)
    lengths = tuple(e - s for s, e in spans)
    positions = None if truth is None or truth.positions is None else truth.positions[:, index]
    labels = ids[:, index] if truth is None or truth.labels is None else truth.labels[:, index]
    rows, where = one_per_row(hf, ids[:, index], positions, labels, Layout((lengths,), len(index)), left, width=width)
    dst = where.src  # each document's tokens in the padded rows
    targets = F.pad(rows.pop("labels")[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)[dst]  # as the rows train
    rows = {k: v for k, v in rows.items() if v is not None}
    try:
        with subject.running(rows_name), kernel_context(rows_name, ids.device, reference):
            with embeddings(hf, grads) as captured:
                out = subject.forward(**rows, use_cache=False).logits
    except Exception as exc:
        return None, f"one document per row ({rows_name}) does not run: {short_error(exc)}"
    logits = out.reshape(-1, out.shape[-1])[dst]
    placed = logits.new_zeros(ids.shape[1], logits.shape[-1]).index_copy_(0, index, logits.detach())
    if not (grads and logits.requires_grad):
        return Run(placed), ""
    loss = F.cross_entropy(logits.float(), targets, reduction="sum")
    grad, params = loss_grads(loss, token_embeddings(captured, rows["input_ids"]), trainable(hf), retain_graph=True)
    if grad is None:
        return Run(placed, None, params), ""
    grad = grad.reshape(-1, grad.shape[-1])[dst]
    return Run(placed, grad.new_zeros(ids.shape[1], grad.shape[-1]).index_copy_(0, index, grad), params), ""


def short_error(exc: BaseException) -> str:
    """The error's first line; for one without text (a StopIteration), where it was raised.

    Args:
        exc: the exception.

    Returns:
        ``"<type>: <first line>"`` (at most 300 characters), or ``"<type> (raised in ...)"``.

    Example::

        >>> short_error(ValueError("no more"))
        'ValueError: no more'
    """
    text = str(exc).strip().splitlines()
    if text:
        return f"{type(exc).__name__}: {text[0]}"[:300]
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = (
        f" (raised in {last[0].name}, {'/'.join(last[0].filename.split('/')[-3:])}:{last[0].lineno})" if last else ""
    )
    return f"{type(exc).__name__}{where}"
