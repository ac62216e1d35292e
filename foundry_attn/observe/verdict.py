"""Do the packed documents of a batch see each other? Measured on the real model, else read from its structure.

    rows = packed_rows(batch)                        # (row, start, lengths) of rows marked with 2+ documents
    verdict = measure(hf_model, batch, logits, embeds=embeds)   # one document's influence on those before it
    verdict = structural(hf_model, Features.of(batch))      # where neither a gradient nor a forward is possible
    verdict.line()  # 'documents isolated (measured: ...)' | 'documents LEAK (...)' | 'not packed (...)'

The measurement is the proof's judgement of isolation (:func:`foundry_attn.proof.comparison.influence`): the gradient
of the second document's next-token loss with respect to the first document's input embeddings, in the row with
the most documents. Isolated documents give exactly zero at any precision; a leak through attention, an SSM or
convolution state, or a token shift gives a non-zero block, however small: no noise floor, one answer in fp32 and
bf16. It is taken through the training forward's own graph where the caller captured its input embeddings (no
second forward), else through a forward of those documents of its own in the model's own mode. Nothing here
switches the model to eval mode or touches the global RNG, and its forwards are hidden from the tracers. The
structural reading says what the model *would* do from what it is given; it is labelled so, never shown as a
measurement. Core module: torch and transformers only."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import time
from collections.abc import Mapping
from typing import Any

import torch
import transformers

from foundry_attn.attention.backends import backend_of
from foundry_attn.attention.config_values import config_value
from foundry_attn.flat.inputs import stock_splits_packed_rows
from foundry_attn.flat.layout import DocumentRow, packed_rows
from foundry_attn.observe.discovery import mpt_attn_impl
from foundry_attn.observe.row_calls import against_alone, packed_slice, row_forward
from foundry_attn.path.state import compiled_by, path_of
from foundry_attn.proof.comparison import influence
from foundry_attn.proof.proving import hidden
from foundry_attn.proof.runs import next_token_loss
from foundry_attn.proof.tolerance import training_noise

ISOLATED, LEAKS, NOT_PACKED, UNKNOWN = "isolated", "leaks", "not packed", "unknown"
MEASURED, STRUCTURAL = "measured", "structural"
#: why a batch is not packed, as far as anything can tell: rows of concatenated text (LLM-Foundry's text loader) may
#: hold many documents, but nothing in the batch says where they start, and the model cannot see it either
NO_BOUNDARIES = "no row holds two marked documents (doc_lens, sequence_id or restarting position_ids)"
#: documents of the chosen row run alone: the first two (the second is the first that can see a neighbour)
DOCUMENTS = 2


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One verdict: ``state`` (isolated / leaks / not packed / unknown), ``how`` it was reached, and why."""

    state: str
    how: str = ""
    reason: str = ""
    worst: float | None = None  # measured: the largest |gradient| one document's loss has on the others' embeddings
    row: int | None = None
    lengths: tuple[int, ...] = ()  # the row's first documents, compared
    leaking: tuple[int, ...] = ()  # indices among them that differ from each alone
    ms: float = 0.0

    @property
    def isolated(self) -> bool | None:
        """Whether the documents are isolated: True, False (they leak), or None (not packed, unknown).

        Returns:
            The state as a bool, or None.

        Example::

            >>> Verdict(LEAKS, STRUCTURAL, "MPT attends across documents").isolated
            False
        """
        return {ISOLATED: True, LEAKS: False}.get(self.state)

    def line(self) -> str:
        """The verdict in one line, for logs and the console table; a structural reading says it was not measured.

        Returns:
            The line.

        Example::

            >>> Verdict(LEAKS, STRUCTURAL, "MPT attends across documents").line()
            'documents LEAK (structural reading, not measured: MPT attends across documents)'
        """
        if self.state == NOT_PACKED:
            return f"not packed ({self.reason})"
        if self.state == UNKNOWN:
            return f"isolation unknown: {self.reason}"
        head = "documents isolated" if self.state == ISOLATED else "documents LEAK"
        if self.how == STRUCTURAL:
            return f"{head} (structural reading, not measured: {self.reason})"
        docs = f"documents {list(range(len(self.lengths)))} (lengths {list(self.lengths)}) of row {self.row}"
        which = f"document {len(self.lengths) - 1}" if self.state == ISOLATED else f"document(s) {list(self.leaking)}"
        return f"{head} (measured: {docs}; {which}: {self.reason}, {self.ms:.0f} ms)"

    def as_dict(self) -> dict[str, Any]:
        """The verdict as plain data: the ``attn_verdict`` event's fields.

        Returns:
            Every field by name (``worst`` None for NaN), and ``line``.

        Example::

            >>> Verdict(NOT_PACKED, reason=NO_BOUNDARIES).as_dict()["state"]
            'not packed'
        """
        out = dataclasses.asdict(self)
        out["worst"] = None if self.worst is None or math.isnan(self.worst) else self.worst
        out["line"] = self.line()
        return out


@dataclasses.dataclass(frozen=True)
class Features:
    """What a batch tells the model about its documents, for the structural reading."""

    packed: bool
    sequence_id: bool = False
    position_ids: bool = False
    padding_mask: bool = False  # a 2-D attention_mask with zeros

    @classmethod
    def of(cls, batch: Mapping, rows: list[DocumentRow] | None = None) -> Features:
        """``rows``: :func:`foundry_attn.flat.layout.packed_rows` of ``batch`` when the caller has them (a host
        sync).

        Args:
            batch: the collated batch.
            rows: its packed rows, where the caller has them; None: read here.

        Returns:
            What the batch holds: packed rows, ``sequence_id``, ``position_ids``, a padding mask.

        Example::

            >>> Features.of({"input_ids": ids, "doc_lens": [[3, 5], [4, 4]]})
            Features(packed=True, sequence_id=False, position_ids=False, padding_mask=False)
        """
        mask = batch.get("attention_mask")
        return cls(
            packed=bool(packed_rows(batch) if rows is None else rows),
            sequence_id=isinstance(batch.get("sequence_id"), torch.Tensor),
            position_ids=isinstance(batch.get("position_ids"), torch.Tensor),
            padding_mask=isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool((mask == 0).any()),
        )


# ---- the structural reading ----------------------------------------------------------------------------------


def _mpt_uses_sequence_id(hf: Any) -> bool | None:
    """MPT's ``attn_uses_sequence_id``, or None for a model that is not MPT."""
    if mpt_attn_impl(hf) is None:
        return None
    return bool(hf.config.attn_config.get("attn_uses_sequence_id", False))


def structural(hf: Any, features: Features) -> Verdict:
    """What the model does with packed documents, read from the model and the batch's keys (not measured).

    Args:
        hf: the HF model (not a wrapper).
        features: what the batch tells the model (:meth:`Features.of`).

    Returns:
        The :class:`Verdict`, ``how`` ``structural``; ``not packed`` where no row holds two marked documents.

    Example::

        >>> structural(llama_model, Features.of({"input_ids": ids, "doc_lens": [[3, 5], [4, 4]]})).state  # stock sdpa
        'leaks'
    """
    if not features.packed:
        return Verdict(NOT_PACKED, reason=NO_BOUNDARIES)
    state = path_of(hf)
    if state is not None:
        return Verdict(ISOLATED, STRUCTURAL, f"foundry_attn's {state.path} path, proven against stock per document")
    uses = _mpt_uses_sequence_id(hf)
    if uses is not None:
        if uses and features.sequence_id:
            return Verdict(ISOLATED, STRUCTURAL, "MPT masks attention by sequence_id (attn_uses_sequence_id: true)")
        why = "the batch has no sequence_id" if uses else "attn_uses_sequence_id is false"
        return Verdict(LEAKS, STRUCTURAL, f"MPT attends across documents: {why}")
    impl = backend_of(config_value(getattr(hf, "config", None), "_attn_implementation", None)) or "?"
    # 5.x masks split rows only without a cache (``past_key_values`` None): ``use_cache: false``, as LLM-Foundry sets
    splits = impl == "flash_attention_2" or (
        stock_splits_packed_rows() and not config_value(hf.config, "use_cache", True)
    )
    if features.position_ids and not features.padding_mask and splits:
        return Verdict(ISOLATED, STRUCTURAL, f"stock {impl} splits rows where position_ids restart")
    given = (
        "reads only the padding mask"
        if features.padding_mask
        else "reads restarting position_ids only without a cache (use_cache is true)"
        if features.position_ids and stock_splits_packed_rows()
        else "ignores restarting position_ids"
        if features.position_ids
        else "gets no document boundaries"
    )
    return Verdict(
        LEAKS,
        STRUCTURAL,
        f"stock {impl} in transformers {transformers.__version__} {given}: each document attends to those before it",
    )


def fix_for(hf: Any) -> str:
    """What a user changes so that packed documents stop seeing each other.

    Args:
        hf: the HF model.

    Returns:
        One sentence: MPT's ``attn_uses_sequence_id``, else foundry_attn's model; or ``padding: mask``.

    Example::

        >>> fix_for(llama_model)
        'use model name foundry_attn_causal_lm (it keeps packed documents apart on every backend), or padding: mask'
    """
    if _mpt_uses_sequence_id(hf) is not None:
        return (
            "set model.attn_config.attn_uses_sequence_id: true (the foundry_attn loaders emit sequence_id), "
            "or train with padding: mask"
        )
    return "use model name foundry_attn_causal_lm (it keeps packed documents apart on every backend), or padding: mask"


# ---- the measurement -----------------------------------------------------------------------------------------


def active_dropout(hf: Any) -> str | None:
    """The dropout that makes a training forward's logits noisy, or None (eval mode, or p = 0 everywhere).

    Args:
        hf: the HF model.

    Returns:
        Where the randomness comes from (:func:`foundry_attn.proof.tolerance.training_noise`), or None.

    Example::

        >>> active_dropout(dropout_llama.eval()), active_dropout(dropout_llama.train())  # attention_dropout=0.1
        (None, 'attention_dropout=0.1 in model.layers.0.self_attn')
    """
    return training_noise(hf) if hf.training else None


def measure(
    hf: Any,
    batch: Mapping,
    logits: torch.Tensor | None,
    documents: int = DOCUMENTS,
    context: contextlib.AbstractContextManager | None = None,
    rows: list[DocumentRow] | None = None,
    embeds: torch.Tensor | None = None,
    rerun: bool = True,
) -> Verdict:
    """Does the last of the first ``documents`` documents of the row with the most documents reach the ones before
    it? The gradient of its next-token loss with respect to their input embeddings
    (:func:`foundry_attn.proof.comparison.influence`): exactly zero when they are isolated, at any precision.
    Differentiated through the training forward itself where its ``logits`` and input ``embeds`` (a
    :class:`~foundry_attn.proof.forward_probe.ForwardProbe`'s) are given with their graph, which is kept for the step's
    backward; else through a forward of those documents of their own, as the batch gives them, in the model's own
    mode (an eval switch can change a model: RWKV rescales its weights in place) and ``context`` (the run's
    precision), hidden from the tracers, the global RNG untouched; without ``rerun`` (a model on foundry_attn's path,
    whose own forward is not stock's) the structural reading instead. ``rows``:
    :func:`foundry_attn.flat.layout.packed_rows` of ``batch``, when the caller has them.

    Args:
        hf: the HF model (not a wrapper).
        batch: the collated batch, its documents marked (``doc_lens``, ``sequence_id`` or restarting ``position_ids``).
        logits: the training forward's logits, or None.
        documents: how many of the row's first documents are compared (at least 2).
        context: the run's precision (an autocast context) for a forward of its own; None: none.
        rows: :func:`~foundry_attn.flat.layout.packed_rows` of ``batch``, where the caller has them.
        embeds: the training forward's input embeddings, with their graph.
        rerun: whether a forward of its own may run; False: the structural reading where there is no graph.

    Returns:
        The :class:`Verdict`, ``how`` ``measured`` (or the structural reading, so labelled); ``not packed`` where no
        row holds two marked documents.

    Example::

        >>> print(measure(llama_model, {"input_ids": ids, "doc_lens": [[3, 5], [4, 4]]}, None).line())  # stock sdpa
        documents LEAK (measured: documents [0, 1] (lengths [3, 5]) of row 0; document(s) [1]: its loss reaches ...)
    """
    rows = packed_rows(batch) if rows is None else rows
    if not rows:
        return Verdict(NOT_PACKED, reason=NO_BOUNDARIES)
    row, start, lengths = max(rows, key=lambda r: len(r.lengths))
    lengths = lengths[: max(2, documents)]
    n = sum(lengths)
    began = time.perf_counter()
    spans = list(itertools.pairwise(itertools.accumulate(lengths, initial=0)))
    last = spans[-1]
    ids = batch["input_ids"][row, start : start + n]
    packed = None if logits is None else packed_slice(logits, batch, row, start, n)
    mine = None if embeds is None else packed_slice(embeds, batch, row, start, n)
    target = ids[last[0] : last[1]]
    sliced: torch.Tensor | None = None
    with hidden(), torch.random.fork_rng(devices=[]):
        if packed is not None and mine is not None and packed.requires_grad and embeds is not None:
            loss = next_token_loss(packed[last[0] : last[1]], target)
            # the step's backward follows; None: these embeddings are not the ones the logits came from
            (grad,) = torch.autograd.grad(loss, embeds, retain_graph=True, allow_unused=True)
            sliced = None if grad is None else packed_slice(grad, batch, row, start, n)
            values = packed[last[0] : last[1]].detach()
        if sliced is None and not rerun:
            reading = structural(hf, Features.of(batch, rows))
            return dataclasses.replace(reading, reason=f"{reading.reason}; not measured: no training graph to read")
        if sliced is None:
            row_logits, source = row_forward(hf, batch, row, start, n, context)
            (grad,) = torch.autograd.grad(next_token_loss(row_logits[0, last[0] : last[1]], target), source)
            sliced = grad[0]
            values = row_logits[0, last[0] : last[1]].detach()
        reach = influence(sliced, [last])
        # no other document's content reaches it; does its place in the row change it? (DeepSeek-V3.2's indexer)
        diff, off, skipped = math.nan, False, ""
        if not reach.leaks:
            try:
                diff, off = against_alone(hf, batch, (row, start, n), last, values, context, rerun)
            except Exception as exc:  # a cross-check that cannot run leaves the influence measured, and says so
                skipped = f" (not compared with it alone: {type(exc).__name__}: {str(exc)[:120]})"
    ms = (time.perf_counter() - began) * 1e3
    leaking = (len(lengths) - 1,) if reach.leaks or off else ()
    if reach.leaks:
        return Verdict(LEAKS, MEASURED, reach.describe(), reach.reach, row, tuple(lengths), leaking, ms)
    if off:
        why = f"{reach.describe()}, but its logits differ from it alone by {diff:.2e}: its place in the row changes it"
        return Verdict(LEAKS, MEASURED, why, diff, row, tuple(lengths), leaking, ms)
    why = reach.describe() + (skipped or f", and its logits match it alone (worst |diff| {diff:.1e})")
    return Verdict(ISOLATED, MEASURED, why, None if skipped else diff, row, tuple(lengths), (), ms)


def second_forward_blocked(model: Any, hf: Any, sharded: bool = False) -> str | None:
    """Why the verdict may not differentiate or run the model again here (then it reads the structure), or None.

    Args:
        model: what the trainer calls (compiled or not, wrapped or not).
        hf: the HF model inside it.
        sharded: the trainer says its weights are sharded (Composer's ``state.fsdp_enabled``); else read from the
            model (FSDP2's DTensor parameters, an FSDP module).

    Returns:
        The reason, in the words of the verdict's event, or None.

    Example::

        >>> second_forward_blocked(torch.compile(model), hf_model)
        'the model is compiled (a second forward would recompile it)'
    """
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    if compiled_by(model):
        return "the model is compiled (a second forward would recompile it)"
    param = next(hf.parameters(), None)
    if sharded or isinstance(param, DTensor) or isinstance(model, FullyShardedDataParallel):
        return "FSDP shards the weights (a second forward on one rank would hang the others)"
    return None


def judge(
    hf: Any,
    batch: Any,
    output: Any,
    blocked: str | None = None,
    context: contextlib.AbstractContextManager | None = None,
    embeds: torch.Tensor | None = None,
) -> Verdict:
    """The verdict on one training batch, given its training forward's ``output`` and input ``embeds``: measured
    (:func:`measure`) where the model may be differentiated or run again, else the structural reading, labelled so;
    never a guess shown as a measurement. ``blocked``: why neither is possible, as the caller's stack knows it
    (compiled, sharded); active dropout is read here. An output without logits (TRL's fused LM head) is measured on
    a forward of the documents of its own.

    Args:
        hf: the HF model (not a wrapper).
        batch: the collated batch.
        output: the training forward's output (a mapping or an object with ``logits``).
        blocked: why the model may not be differentiated or run again (:func:`second_forward_blocked`), or None.
        context: the run's precision (an autocast context) for a forward of its own; None: none.
        embeds: the training forward's input embeddings, with their graph (a ``ForwardProbe``'s), or None.

    Returns:
        The :class:`Verdict`; ``unknown``, with why, where the batch has no ``input_ids`` or the measurement raised.

    Example::

        >>> judge(llama_model, batch, output=None).state  # stock sdpa, packed rows: measured on a forward of its own
        'leaks'
        >>> print(judge(hf_model, batch, output=None).line())  # hf_model: attached, on foundry_attn's path
        documents isolated (structural reading, not measured: foundry_attn's flat path, proven against stock ...)
    """
    if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), torch.Tensor):
        return Verdict(UNKNOWN, reason="the batch has no input_ids tensor")
    rows = packed_rows(batch)  # one host sync, shared by the reading and the measurement
    features = Features.of(batch, rows)
    if not features.packed:
        return Verdict(NOT_PACKED, reason=NO_BOUNDARIES)
    blocked = blocked or active_dropout(hf)
    if blocked:
        reading = structural(hf, features)
        return Verdict(reading.state, reading.how, f"{reading.reason}; not measured: {blocked}")
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    try:
        logits = logits if isinstance(logits, torch.Tensor) else None
        return measure(hf, batch, logits, context=context, rows=rows, embeds=embeds, rerun=path_of(hf) is None)
    except Exception as exc:  # the check never breaks training
        return Verdict(UNKNOWN, reason=f"the documents' influence was not measured: {type(exc).__name__}: {exc}")
