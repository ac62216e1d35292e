"""The verdict's own forwards of one row's documents, as the training forward was given them, and the slices of a
forward's output it compares (:mod:`foundry_attn.observe.verdict` judges with them).

    logits, embeds = row_forward(hf_model, batch, row, start, n, context)    # the row's first documents, own mode
    diff, off = against_alone(hf_model, batch, (row, start, n), last, packed, context, rerun=True)

Core module: torch and transformers only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from foundry_attn.flat.implementation import current
from foundry_attn.flat.inputs import base_parameters
from foundry_attn.flat.layout import Layout
from foundry_attn.flat.model_forward import own_forward
from foundry_attn.path.proven import subject_of
from foundry_attn.proof.runs import alone_inputs, embeddings, run
from foundry_attn.proof.tolerance import differs, half, limits_for


def packed_slice(values: torch.Tensor, batch: Mapping, row: int, start: int, n: int) -> torch.Tensor | None:
    """Tokens ``start:start+n`` of ``row`` of one forward's ``[rows, width, C]`` values (logits, embeddings), or of
    an output in foundry_attn's layout (the real tokens of each row in order: a flat row, or even rows).

    Args:
        values: the forward's ``[rows, width, C]`` values.
        batch: the batch it ran.
        row: the row of the batch.
        start: the first token's column in that row.
        n: how many tokens.

    Returns:
        ``[n, C]`` values, or None where the layout is neither.

    Example::

        >>> logits = llama_model(input_ids=batch["input_ids"]).logits  # [2, 64, vocab 64]; doc_lens [[20, 30], [40]]
        >>> packed_slice(logits, batch, row=0, start=20, n=30).shape  # row 0's second document
        torch.Size([30, 64])
    """
    ids = batch["input_ids"]
    if values.dim() != 3:
        return None
    if tuple(values.shape[:2]) == tuple(ids.shape[:2]):
        return values[row, start : start + n]
    try:
        layout = Layout.from_batch(batch)
    except ValueError:
        return None
    if values.shape[0] * values.shape[1] == layout.real_tokens:
        offset = sum(sum(lengths) for lengths in layout.doc_lens[:row]) + start - layout.start(row)
        return values.reshape(-1, values.shape[-1])[offset : offset + n]
    return None


#: the batch's per-token keys a judgement's own forward of one row's first documents passes on, sliced to them
ROW_KEYS = ("input_ids", "position_ids", "attention_mask", "token_type_ids")


def row_forward(
    hf: Any, batch: Mapping, row: int, start: int, n: int, context: contextlib.AbstractContextManager | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first documents of ``row`` (tokens ``start:start+n``) as the training forward was given them (its
    per-token keys sliced, its ``use_cache``), in the model's own mode and precision, with their input embeddings
    as tensors to differentiate against.

    Args:
        hf: the HF model (not a wrapper).
        batch: the batch the training forward took.
        row: the row.
        start: the first token's column.
        n: how many tokens.
        context: the run's precision (an autocast context), or None.

    Returns:
        ``[1, n, vocab]`` logits and ``[1, n, hidden]`` input embeddings.

    Raises:
        ValueError: the model has no input embedding module.

    Example::

        >>> logits, embeds = row_forward(llama_model, batch, row=0, start=0, n=50, context=None)  # row 0's documents
        >>> logits.shape, embeds.shape, embeds.requires_grad
        (torch.Size([1, 50, 64]), torch.Size([1, 50, 32]), True)
    """
    call = row_call(hf, batch, row, start, start + n, training=True)
    with untouched(hf), embeddings(hf, True) as captured, torch.enable_grad(), context or contextlib.nullcontext():
        logits = own_forward(hf, **call).logits
    if not captured:
        raise ValueError("the model has no input embedding module to differentiate against")
    return logits, captured[0]


def against_alone(
    hf: Any,
    batch: Mapping,
    first: tuple[int, int, int],
    last: tuple[int, int],
    packed: torch.Tensor,
    context: contextlib.AbstractContextManager | None,
    rerun: bool,
) -> tuple[float, bool]:
    """The last of the row's first documents (``first``: row, start, tokens; ``last``: its span among them) alone,
    no grad, in the model's own mode, against its ``packed`` logits: the difference, and whether it is beyond
    :func:`foundry_attn.proof.tolerance.differs`' limit. Judged where rounding cannot pass for a difference: fp32 as
    the run is; under autocast with fp32 weights, both sides again with autocast off (``rerun``: stock's own forward
    of the row); else (half weights, or a model on our path) per token against limits measured at the comparison's
    own shape and precision (:func:`foundry_attn.proof.tolerance.limits_for`, as the proof's). The document alone
    gets the batch's own keys for its tokens (its positions, MPT's ``sequence_id``), or in half precision is
    right-padded to the batch's width, so both sides round as one shape does.

    Args:
        hf: the HF model (not a wrapper).
        batch: the batch.
        first: the row, the first documents' start and their tokens.
        last: the last document's span among them.
        packed: its logits in the packed forward.
        context: the run's precision (an autocast context), or None.
        rerun: the model's own forward is stock's (not on foundry_attn's path).

    Returns:
        The difference, and whether it is beyond the limit.

    Example::

        >>> packed = llama_model(input_ids=batch["input_ids"]).logits[0, 20:50]  # row 0's second document, in the row
        >>> diff, off = against_alone(llama_model, batch, (0, 0, 50), (20, 50), packed, None, rerun=True)
        >>> off  # stock sdpa: the first document reaches it
        True
    """
    row, start, n = first
    ids = batch["input_ids"][row, start + last[0] : start + last[1]]
    alone_call = row_call(hf, batch, row, start + last[0], start + last[1])
    with untouched(hf), torch.no_grad(), context or contextlib.nullcontext():
        weights = next(hf.parameters()).dtype
        if not half(weights, ids.device):
            return differs(packed, own_forward(hf, **alone_call, use_cache=False).logits[0], True)
        if rerun and weights == torch.float32:
            with torch.autocast(ids.device.type, enabled=False):
                whole = row_call(hf, batch, row, start, start + n, training=True)
                mine = own_forward(hf, **whole).logits[0, last[0] : last[1]]
                return differs(mine, own_forward(hf, **alone_call, use_cache=False).logits[0], True)
        width = batch["input_ids"].shape[1]
        alone = own_forward(hf, **alone_inputs(ids[None], width=width), use_cache=False).logits[0, : ids.shape[0]]
        own = alone_inputs(ids[None])
        subject = subject_of(hf)
        limits = limits_for(subject, own, run(subject, own, [(0, ids.shape[0])], False), current(hf) if rerun else None)
    return differs(packed, alone, False, limits.logits)


def row_call(hf: Any, batch: Mapping, row: int, start: int, end: int, training: bool = False) -> dict[str, Any]:
    """The batch's per-token keys the model takes (:data:`ROW_KEYS`, and any its ``forward`` names: MPT's
    ``sequence_id``), sliced to tokens ``start:end`` of ``row``; the labels stay out. ``training``: the training
    forward's ``use_cache`` too, where the batch gave one.

    Args:
        hf: the HF model, read for its ``forward``'s parameters.
        batch: the batch.
        row: the row.
        start: the first token's column.
        end: past the last token's column.
        training: add the training forward's ``use_cache``.

    Returns:
        The call's keywords.

    Example::

        >>> call = row_call(llama_model, {"input_ids": ids, "attention_mask": mask, "labels": ids}, 1, start=0, end=6)
        >>> sorted(call), call["input_ids"].shape
        (['attention_mask', 'input_ids'], torch.Size([1, 6]))
    """
    named = base_parameters(type(hf))  # type: ignore[arg-type]  # (a class is hashable: see flat.inputs)
    shape = batch["input_ids"].shape
    call = {
        k: v[row : row + 1, start:end]
        for k, v in batch.items()
        if (k in ROW_KEYS or k in named) and k != "labels" and isinstance(v, torch.Tensor) and v.shape == shape
    }
    if training and "use_cache" in batch:
        call["use_cache"] = batch["use_cache"]
    return call


@contextlib.contextmanager
def untouched(hf: Any) -> Iterator[None]:
    """A judgement's own forward must leave the model as it was: one that changes a weight or buffer in place (what
    RWKV does in eval mode) is said, never hidden, as the step that follows sees it.

    Args:
        hf: the HF model.

    Returns:
        A context manager.

    Raises:
        RuntimeError: a weight or buffer changed in place inside the block.

    Example::

        >>> with untouched(llama_model):  # a RuntimeError where the forward changed a weight in place
        ...     logits = own_forward(llama_model, input_ids=ids).logits
    """
    tensors = [*hf.parameters(), *hf.buffers()]
    versions = [t._version for t in tensors]
    yield
    changed = sum(t._version != v for t, v in zip(tensors, versions, strict=True))
    if changed:
        raise RuntimeError(f"the model changed {changed} of its own weights or buffers in place in this forward")
