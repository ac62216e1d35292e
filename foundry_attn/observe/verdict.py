"""Do the packed documents of a batch see each other? Measured on the real model, else read from its structure.

    rows = packed_rows(batch)                        # (row, start, lengths) of rows marked with 2+ documents
    verdict = measure(hf_model, batch, logits)       # the first documents of one row alone vs the packed slice
    verdict = structural(hf_model, Features.of(batch))      # where a second forward is not possible
    verdict.line()  # 'documents isolated (measured: ...)' | 'documents LEAK (...)' | 'not packed (...)'

The measurement is the proof's comparison (:mod:`foundry_attn.flat.comparison`) on a training batch: the model's own
forward on each of the first documents of the row with the most documents, in eval mode without grad or global RNG,
against the logits the training forward produced for those tokens. Those forwards are hidden from the tracers. The
structural reading says what the model *would* do from what it is given; it is labelled so, never shown as a
measurement. Core module: torch and transformers only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import itertools
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import transformers

from foundry_attn.attention.backends import backend_of, config_value
from foundry_attn.flat.comparison import (
    Run,
    against_alone,
    alone_inputs,
    evaluating,
    half,
    hidden,
    limits_for,
    run,
    training_noise,
)
from foundry_attn.flat.layout import DocumentRow, Layout, packed_rows
from foundry_attn.flat.state import path_of
from foundry_attn.observe.discovery import mpt_attn_impl

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
    worst: float | None = None
    row: int | None = None
    lengths: tuple[int, ...] = ()  # the row's first documents, compared
    leaking: tuple[int, ...] = ()  # indices among them that differ from each alone
    ms: float = 0.0

    @property
    def isolated(self) -> bool | None:
        return {ISOLATED: True, LEAKS: False}.get(self.state)

    def line(self) -> str:
        if self.state == NOT_PACKED:
            return f"not packed ({self.reason})"
        if self.state == UNKNOWN:
            return f"isolation unknown: {self.reason}"
        head = "documents isolated" if self.state == ISOLATED else "documents LEAK"
        if self.how == STRUCTURAL:
            return f"{head} (structural reading, not measured: {self.reason})"
        docs = f"documents {list(range(len(self.lengths)))} (lengths {list(self.lengths)}) of row {self.row}"
        if self.state == ISOLATED:
            return f"{head} (measured: {docs} alone vs packed, worst |diff| {self.worst:.1e}, {self.ms:.0f} ms)"
        return (
            f"{head} (measured: {docs} alone vs packed; document(s) {list(self.leaking)} differ by up to "
            f"{self.worst:.2e}, {self.ms:.0f} ms)"
        )

    def as_dict(self) -> dict[str, Any]:
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
        sync)."""
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


def _detects_packing() -> bool:
    """transformers builds document masks from restarting ``position_ids`` (5.x ``masking_utils``)."""
    if importlib.util.find_spec("transformers.masking_utils") is None:
        return False
    from transformers import masking_utils

    return hasattr(masking_utils, "find_packed_sequence_indices")


def structural(hf: Any, features: Features) -> Verdict:
    """What the model does with packed documents, read from the model and the batch's keys (not measured)."""
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
    splits = impl == "flash_attention_2" or (_detects_packing() and not config_value(hf.config, "use_cache", True))
    if features.position_ids and not features.padding_mask and splits:
        return Verdict(ISOLATED, STRUCTURAL, f"stock {impl} splits rows where position_ids restart")
    given = (
        "reads only the padding mask"
        if features.padding_mask
        else "reads restarting position_ids only without a cache (use_cache is true)"
        if features.position_ids and _detects_packing()
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
    """What a user changes so that packed documents stop seeing each other."""
    if _mpt_uses_sequence_id(hf) is not None:
        return (
            "set model.attn_config.attn_uses_sequence_id: true (the foundry_attn loaders emit sequence_id), "
            "or train with padding: mask"
        )
    return "use model name foundry_attn_causal_lm (it keeps packed documents apart on every backend), or padding: mask"


# ---- the measurement -----------------------------------------------------------------------------------------


def active_dropout(hf: Any) -> str | None:
    """The dropout that makes a training forward's logits noisy, or None (eval mode, or p = 0 everywhere)."""
    return training_noise(hf) if hf.training else None


def _packed_slice(logits: torch.Tensor, batch: Mapping, row: int, start: int, n: int) -> torch.Tensor | None:
    """The logits of tokens ``start:start+n`` of ``row``: from ``[rows, width, V]`` output, or a flat
    ``[1, real tokens, V]`` one (real tokens of each row first, as foundry_attn's flat path returns them)."""
    ids = batch["input_ids"]
    if logits.dim() != 3:
        return None
    if tuple(logits.shape[:2]) == tuple(ids.shape[:2]):
        return logits[row, start : start + n]
    try:
        layout = Layout.from_batch(batch)
    except ValueError:
        return None
    if logits.shape[0] == 1 and logits.shape[1] == layout.real_tokens:
        offset = sum(sum(lengths) for lengths in layout.doc_lens[:row]) + start - layout.start(row)
        return logits[0, offset : offset + n]
    return None


def measure(
    hf: Any,
    batch: Mapping,
    logits: torch.Tensor,
    documents: int = DOCUMENTS,
    context: contextlib.AbstractContextManager | None = None,
    rows: list[DocumentRow] | None = None,
) -> Verdict:
    """Run the first ``documents`` documents of the row with the most documents alone through ``hf`` (its own
    backend, eval mode, no grad, hidden from the tracers; ``context``: the run's precision) and compare their
    logits with ``logits``, the training forward's output for ``batch``. Training forwards with active dropout
    cannot be compared: the caller reads the structure instead. ``rows``: :func:`foundry_attn.flat.layout.packed_rows`
    of ``batch``, when the caller has them."""
    rows = packed_rows(batch) if rows is None else rows
    if not rows:
        return Verdict(NOT_PACKED, reason=NO_BOUNDARIES)
    row, start, lengths = max(rows, key=lambda r: len(r.lengths))
    lengths = lengths[: max(2, documents)]
    packed = _packed_slice(logits, batch, row, start, sum(lengths))
    if packed is None:
        return Verdict(UNKNOWN, reason=f"output logits {list(logits.shape)} do not map onto the batch's rows")
    began = time.perf_counter()
    ids = batch["input_ids"][row, start : start + sum(lengths)]
    spans = list(itertools.pairwise(itertools.accumulate(lengths, initial=0)))
    with hidden(), evaluating(hf), torch.random.fork_rng(devices=[]), context or contextlib.nullcontext():
        # half precision (half weights, or the autocast the forward ran in): each document alone at the packed
        # row's width, right-padded and masked, so both sides round as one shape does (bf16 kernels round by shape)
        width = batch["input_ids"].shape[1] if half(next(hf.parameters()).dtype, ids.device) else 0
        alone = [
            Run(run(hf, alone_inputs(ids[a:b][None], width=width), [(0, b - a)], grads=False).logits[: b - a])
            for a, b in spans
        ]
        limits = limits_for(hf, alone_inputs(ids[spans[-1][0] :][None]), alone[-1])
    result = against_alone(Run(packed.detach()), spans, alone, limits)
    worst, leaking = result.worst, list(result.differ)
    ms = (time.perf_counter() - began) * 1e3
    state = LEAKS if leaking else ISOLATED
    return Verdict(state, MEASURED, "", worst, row, tuple(lengths), tuple(leaking), ms)


def judge(
    hf: Any,
    batch: Any,
    output: Any,
    blocked: str | None = None,
    context: contextlib.AbstractContextManager | None = None,
    rerun: Callable[[], torch.Tensor] | None = None,
) -> Verdict:
    """The verdict on one training batch, given its training forward's ``output``: measured (:func:`measure`)
    where a second forward is possible, else the structural reading, labelled so; never a guess shown as a
    measurement. ``blocked``: why a second forward is not possible, as the caller's stack knows it (compiled,
    sharded); active dropout is read here. ``rerun``: the batch's logits from a forward of its own, for an output
    that carries none (TRL's fused LM head); without it, such an output gives an unknown verdict."""
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
        if not isinstance(logits, torch.Tensor) and rerun is not None:
            logits = rerun()
        if not isinstance(logits, torch.Tensor):
            return Verdict(UNKNOWN, reason=f"the model's output ({type(output).__name__}) carries no logits")
        return measure(hf, batch, logits, context=context, rows=rows)
    except Exception as exc:  # the check never breaks training
        return Verdict(UNKNOWN, reason=f"the documents alone did not run: {type(exc).__name__}: {exc}")
