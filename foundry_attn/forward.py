"""One forward of a HF causal LM that honours document boundaries under every backend.

    attach(hf_model, "sdpa")                        # once: foundry_attn.adapters
    out = forward_documents(hf_model, batch)        # batch from foundry_attn.packing, or any 2-D mask
    logits = repad_logits(out)                      # [rows, width, vocab], only if you need them

The batch is unpadded once into one flat row of real tokens. Every attention call of the model then
carries the documents as an argument (``foundry_documents``) to our function for its backend
(``foundry_attn.adapters``): FA2 varlen with ``cu_seq_lens``, one causal SDPA call per document, eager
math per document, or one flex call with a document ``BlockMask``. No L x L mask is built: the model's own
mask code gets a ``[1, 1, 1, 1]`` placeholder, which it passes through unchanged.

A model whose base ``forward`` passes nothing on to attention (GPT-2 in transformers 4.51) keeps its
stock backend and runs one document per row, right-padded, with a 2-D mask: exact, at the cost of padding.
Core module: torch and transformers only.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Mapping
from typing import Any

import torch

from foundry_attn.adapters import DOCS_KEY, REGISTERED, Documents
from foundry_attn.fa2_reference import reference_flash_attn
from foundry_attn.layout import Layout
from foundry_attn.packing import IGNORE_INDEX
from foundry_attn.policy import FA2


def kernel_context(impl: str, device: torch.device, fa2_reference: bool = False) -> contextlib.AbstractContextManager:
    """The FA2 reference kernel around a block that runs transformers' *stock* FA2 code (CPU stand-in).

    Models attached with ``attach(model, "flash_attention_2", fa2_reference=True)`` need no context: their
    attention function installs the reference kernel for each call itself.
    """
    if impl == FA2 and fa2_reference:
        return reference_flash_attn()
    return contextlib.nullcontext()


def unwrapped(model: Any) -> Any:
    """The HF model inside DDP / FSDP1 wrappers, which hide its ``config`` (``torch.compile`` and FSDP2 keep it)."""
    while not hasattr(model, "config") and isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def forward_documents(model: Any, batch: Mapping) -> Any:
    """Run ``model`` (a HF causal LM, or a DDP / FSDP / compiled wrapper of one) so that no document sees another."""
    inputs, placed, no_targets = prepare_documents(model, batch)
    return finish_documents(model(**inputs, use_cache=False), placed, no_targets)


@torch.compiler.disable
def finish_documents(out: Any, placed: tuple, no_targets: bool) -> Any:
    """Record where the tokens went (for :func:`repad_logits`); a microbatch without targets adds zero loss
    (HF's mean over no target is nan), still connected to every parameter the forward used."""
    out.foundry_layout = placed
    if no_targets:
        out.loss = out.logits.sum() * 0.0
    return out


@torch.compiler.disable
def prepare_documents(model: Any, batch: Mapping) -> tuple[dict[str, Any], tuple, bool]:
    """The model's inputs for ``batch``, where its tokens went (for :func:`repad_logits`), and whether it has
    no target at all. Host-side work on Python ints, so never traced: under ``torch.compile`` (Composer's
    ``compile_config`` compiles the forward around this) the model sees only tensors and our ``Documents``."""
    ids = batch["input_ids"]
    layout = Layout.from_batch(batch)
    if layout.real_tokens == 0:
        raise ValueError("empty batch: no real tokens (every row is padding)")
    positions = batch.get("position_ids")
    if positions is None:  # ours restart per document; a user's mask keeps HF's default (index in the row)
        positions = (
            layout.position_ids(ids.device)
            if batch.get("doc_lens") is not None
            else torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        )
    labels = batch.get("labels")
    no_targets = labels is not None and not _has_targets(batch, labels)
    if no_targets:
        labels = None
    flat_path = unwrapped(model).config._attn_implementation in REGISTERED
    inputs, placed = (_flat if flat_path else _rows)(model, ids, positions, labels, layout)
    return inputs, placed, no_targets


def _has_targets(batch: Mapping, labels: torch.Tensor) -> bool:
    """Whether any token has a target (host counts when the collator gave them: no device sync)."""
    counts = batch.get("loss_generating_tokens")
    if counts is not None:
        return sum(counts) > 0
    return labels.device.type != "cpu" or bool((labels[:, 1:] != IGNORE_INDEX).any())


def _flat_labels(labels: torch.Tensor | None, flat: torch.Tensor, starts: list[int]) -> torch.Tensor | None:
    if labels is None:
        return None
    labels = labels.reshape(-1)[flat][None].clone()
    labels[0, torch.tensor(starts, device=labels.device)] = IGNORE_INDEX  # no document predicts the next
    return labels


def _flat(
    model: Any, ids: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor | None, layout: Layout
) -> tuple[dict[str, Any], tuple]:
    """Unpad once into one flat row of real tokens; every attention call gets the documents."""
    flat = layout.real_indices(ids.device)
    docs = Documents.of(layout.bounds(), ids.device)
    total = docs.bounds[-1]
    inputs: dict[str, Any] = dict(
        input_ids=ids.reshape(-1)[flat][None],
        position_ids=positions.reshape(-1)[flat][None],
        labels=_flat_labels(labels, flat, list(docs.bounds[:-1])),
    )
    # under torch.compile: the row length and the document count vary from batch to batch; one dynamic graph
    for value in (*inputs.values(), docs.cu, docs.host_bounds):
        if value is not None:
            torch._dynamo.maybe_mark_dynamic(value, value.dim() - 1)
    hf = unwrapped(model)
    # Gemma2/3 read last_cache_position from a 4-D mask with .item() (a graph break); the mask is ours, so is the value
    # (the ignore: a class is hashable, but mypy misreads its __hash__ against lru_cache's Hashable)
    if "last_cache_position" in _base_parameters(type(hf.base_model)):  # type: ignore[arg-type]
        inputs["last_cache_position"] = total
    inputs["attention_mask"] = torch.zeros(1, 1, 1, 1, dtype=hf.dtype, device=ids.device)  # the placeholder
    inputs[DOCS_KEY] = docs
    return inputs, (torch.arange(total, device=ids.device), flat, layout.rows, layout.width)


@functools.lru_cache(maxsize=64)
def _base_parameters(base_class: type[torch.nn.Module]) -> frozenset[str]:
    """The parameter names of a base model's ``forward`` (what it reads besides ``**kwargs``)."""
    return frozenset(inspect.signature(base_class.forward).parameters)


def _rows(
    model: Any, ids: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor | None, layout: Layout
) -> tuple[dict[str, Any], tuple]:
    """One document per row, right-padded, with a 2-D mask: exact under any stock backend."""
    flat = layout.real_indices(ids.device)
    lengths = layout.lengths
    width = max(lengths)
    dst = torch.cat([torch.arange(d * width, d * width + n) for d, n in enumerate(lengths)]).to(ids.device)
    rows = len(lengths)

    def scatter(values: torch.Tensor, fill: int) -> torch.Tensor:
        out = values.new_full((rows * width,), fill)
        out[dst] = values.reshape(-1)[flat]
        return out.view(rows, width)

    row_labels = scatter(labels, IGNORE_INDEX) if labels is not None else None
    if row_labels is not None:
        row_labels[:, 0] = IGNORE_INDEX
    inputs = dict(
        input_ids=scatter(ids, 0),
        position_ids=scatter(positions, 0),
        attention_mask=scatter(torch.ones_like(ids), 0),
        labels=row_labels,
    )
    return inputs, (dst, flat, layout.rows, layout.width)


def repad_logits(out: Any) -> torch.Tensor:
    """``[rows, width, vocab]`` logits of the original batch (zeros at padding), scattered back once."""
    packed = getattr(out, "foundry_layout", None)
    if packed is None:
        return out.logits
    src, dst, rows, width = packed
    logits = out.logits.reshape(-1, out.logits.shape[-1])
    padded = logits.new_zeros(rows * width, logits.shape[-1])
    padded[dst] = logits[src]
    out.logits = padded.view(rows, width, -1)
    out.foundry_layout = None
    return out.logits


def has_layout(batch: Mapping) -> bool:
    """A batch to lay out ourselves: ours (``doc_lens``), or any with a 2-D mask (either padding side)."""
    if batch.get("mode") is not None:  # ICL / generation batches keep the stock path
        return False
    if "doc_lens" in batch:  # only the key: under compile, reading the list would guard on its length
        return True
    mask = batch.get("attention_mask")
    return isinstance(mask, torch.Tensor) and mask.dim() == 2
