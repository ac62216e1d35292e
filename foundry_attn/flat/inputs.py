"""A batch's real tokens laid out for the model: one flat row with its documents, or one document per row.

    built = build(hf_model, plan)                                            # a batch's plan, built once
    inputs, placed = flat_inputs(hf_model, ids, labels, layout)              # the flat row + Documents
    inputs, placed = one_per_row(hf_model, ids, positions, labels, layout)   # rows, right-padded, a 2-D mask
    logits = placed_back(out.logits, placed)                                 # [rows, width, vocab] again

Pure functions of the batch, its :class:`~foundry_attn.flat.layout.Layout` and the HF model's config (the model
itself, not a wrapper: callers unwrap once): no state, no decision (which layout a batch gets is
:func:`foundry_attn.path.plan.plan_batch`'s). Core module: torch and transformers only.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from foundry_attn.attention.config_values import config_value
from foundry_attn.attention.documents import DOCS_KEY, Documents
from foundry_attn.flat.capacity import at_capacity
from foundry_attn.flat.layout import Layout, flattened_lengths
from foundry_attn.flat.packing import IGNORE_INDEX


class Placed(NamedTuple):
    """Where a batch's real tokens went: ``src`` indexes them in the model's layout (its flat row or padded rows),
    ``dst`` in the batch's ``[rows, width]``; both ascending."""

    src: torch.Tensor
    dst: torch.Tensor
    rows: int
    width: int


#: what the ecosystem's packed batches carry that our documents stand for (everything else passes on to the model)
FLATTENED_KEYS = frozenset(
    {"input_ids", "labels", "position_ids", "attention_mask", "use_cache", "cu_seq_lens_q", "cu_seq_lens_k"}
    | {"max_length_q", "max_length_k", "seq_idx"}
)


def packed_call(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """A call's keywords as the batch :func:`prepare_documents` lays out (``doc_lens`` read by
    :func:`foundry_attn.flat.layout.flattened_lengths`, its ``labels`` and ``position_ids``) and the keywords that pass
    on to the model; None for a call that is not one packed row.

    Args:
        kwargs: the keywords of a model call (``input_ids``, ``position_ids``, ``labels``, ...).

    Returns:
        The batch and the keywords left for the model, or None.

    Example::

        >>> row = torch.arange(7)[None]                               # one packed row: [1, 7]
        >>> batch, rest = packed_call(dict(input_ids=row, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3]])))
        >>> batch["doc_lens"], rest
        ([[3, 4]], {})
    """
    lengths = flattened_lengths(kwargs)
    if lengths is None:
        return None
    batch: dict[str, Any] = {"input_ids": kwargs["input_ids"], "doc_lens": [lengths]}
    for key in ("labels", "position_ids"):
        if kwargs.get(key) is not None:
            batch[key] = kwargs[key]
    return batch, {k: v for k, v in kwargs.items() if k not in FLATTENED_KEYS}


def real_tokens(router_logits: Any, src: torch.Tensor) -> Any:
    """A layer's router logits (``[tokens, experts]`` or ``[rows, width, experts]``) at the real tokens only.

    Args:
        router_logits: one layer's router logits (anything else passes through).
        src: :attr:`Placed.src`, the real tokens' indices in the model's layout.

    Returns:
        ``[real tokens, experts]`` logits, or ``router_logits`` as given.

    Example::

        >>> _, placed = one_per_row(hf, ids, None, None, layout)    # doc_lens [[3, 4], [5]]: 3 x 5 rows
        >>> real_tokens(torch.zeros(15, 8), placed.src).shape       # [15, 8] router logits, 12 real tokens
        torch.Size([12, 8])
    """
    if not isinstance(router_logits, torch.Tensor):
        return router_logits
    flat = router_logits.reshape(-1, router_logits.shape[-1])
    return flat[src] if flat.shape[0] != src.numel() else router_logits


@functools.lru_cache(maxsize=16)
def placeholder(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The ``[1, 1, 1, 1]`` zeros the flat row hands the model as its ``attention_mask``
    (:func:`~foundry_attn.attention.documents.is_placeholder`), one per dtype and device: read, never written.

    Args:
        dtype: the model's dtype.
        device: the batch's device.

    Returns:
        The placeholder (the same tensor for every batch).

    Example::

        >>> placeholder(torch.float32, torch.device("cpu")) is placeholder(torch.float32, torch.device("cpu"))
        True
    """
    return torch.zeros(1, 1, 1, 1, dtype=dtype, device=device)


def _no_first_targets(labels: torch.Tensor, starts: list[int], view: bool = True) -> torch.Tensor:
    """The real tokens' labels with each document's first token no target: no document predicts the next
    (``view``: ``labels`` is a view of the batch's, so copied first; else a gathered copy, changed in place). Even
    rows (one document each) lose their first column."""
    labels = labels.clone() if view else labels
    if labels.shape[0] > 1:
        labels[:, 0] = IGNORE_INDEX
    else:
        labels.view(-1)[torch.tensor(starts, device=labels.device)] = IGNORE_INDEX
    return labels


def flat_inputs(
    hf: Any, ids: torch.Tensor, labels: torch.Tensor | None, layout: Layout, even: bool = False
) -> tuple[dict[str, Any], Placed]:
    """Unpad once into one flat row of real tokens; every attention call gets the documents. The proof
    (:mod:`foundry_attn.proof.prove`) runs these very inputs: the layout that trains. With ``even``, documents all of
    one length are laid out as rows of it, one each (the same tokens, no padding): sdpa and eager then attend each row
    as it is, where the flat row would regroup the documents in every layer.

    Args:
        hf: the HF model (not a wrapper), read for its config, dtype and base model.
        ids: the batch's ``input_ids``, ``[rows, width]``.
        labels: its ``[rows, width]`` labels, or None.
        layout: the batch's :class:`~foundry_attn.flat.layout.Layout`.
        even: documents of one length as rows of it (``[documents, length]``), not one row.

    Returns:
        The model's keywords (a ``[1, real tokens]`` row, or even rows; the documents under ``DOCS_KEY``) and
        :class:`Placed`.

    Example::

        >>> inputs, placed = flat_inputs(hf, ids, labels, layout)  # doc_lens [[3, 4], [5]]
        >>> inputs["input_ids"].shape, inputs[DOCS_KEY]
        (torch.Size([1, 12]), Documents(bounds=(0, 3, 7, 12)))
    """
    docs = Documents.of(layout.bounds(), ids.device)
    total, lengths = docs.bounds[-1], layout.lengths
    shape = (len(lengths), lengths[0]) if even and len(lengths) > 1 and len(set(lengths)) == 1 else (1, total)
    # even rows of an unpadded batch: its tokens as they are, no gather (only there: under torch.compile, views of
    # the batch's own tensors made Gemma-2 compile a third graph where the gathered row keeps two)
    unpadded = shape[0] > 1 and total == ids.numel()
    flat = torch.arange(total, device=ids.device) if unpadded else layout.real_indices(ids.device)

    def real(values: torch.Tensor) -> torch.Tensor:
        return (values.reshape(-1) if unpadded else values.reshape(-1)[flat]).view(shape)

    own = layout.own_positions
    if own is not None:
        positions = real(own)
    elif shape[0] > 1:  # even rows: each a document counting from 0
        positions = torch.arange(shape[1], device=ids.device).expand(shape)
    else:
        positions = layout.restarting_positions(ids.device).view(shape)
    inputs: dict[str, Any] = dict(
        input_ids=real(ids),
        position_ids=positions,
        labels=None if labels is None else _no_first_targets(real(labels), list(docs.bounds[:-1]), unpadded),
    )
    # under torch.compile: the row length and the document count vary from batch to batch; one dynamic graph
    for value in (*inputs.values(), docs.device_bounds, docs.host_bounds):
        if value is not None:
            torch._dynamo.maybe_mark_dynamic(value, value.dim() - 1)
    # Gemma2/3, Cohere2 read it from a 4-D mask with .item() (a graph break); their mask offset, max(0, it - max(row,
    # window)), is 0 for any value up to the row: 0 keeps the length out of a compiled graph's guards (mypy: Hashable)
    if "last_cache_position" in base_parameters(type(hf.base_model)):  # type: ignore[arg-type]
        inputs["last_cache_position"] = 0
    inputs["attention_mask"] = placeholder(hf.dtype, ids.device)
    # a MoE forward hands its mask to the router loss, which reads it as [batch, seq]: every token of the flat row is
    # real, so all ones (transformers 5.x builds no mask for our names; 4.51 builds L x L)
    if config_value(hf.config, "output_router_logits", False):
        inputs["attention_mask"] = torch.ones(shape, dtype=torch.long, device=ids.device)
    inputs[DOCS_KEY] = docs
    return inputs, Placed(flat if unpadded else torch.arange(total, device=ids.device), flat, layout.rows, layout.width)


@functools.cache
def stock_splits_packed_rows() -> bool:
    """Whether stock transformers keeps the documents of one packed row apart by itself (5.x ``masking_utils``: a
    block-diagonal mask from restarting ``position_ids`` when the call has no mask and no cache).

    Returns:
        True where ``masking_utils`` has ``find_packed_sequence_indices`` (5.x), else False.

    Example::

        >>> import transformers
        >>> stock_splits_packed_rows() == transformers.__version__.startswith("5.")  # False on 4.51, True on 5.x
        True
    """
    import importlib.util

    if importlib.util.find_spec("transformers.masking_utils") is None:
        return False
    from transformers import masking_utils

    return hasattr(masking_utils, "find_packed_sequence_indices")


def stock_packed(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The flat row as stock's padding-free batch gives it (:func:`flat_inputs` without a mask: under a stock
    implementation, stock builds its own packed mask from the restarting ``position_ids``), for a model whose
    attention our documents cannot reach. The documents stay in the call (stock's functions take them as an unused
    keyword; our forward reads them as a call it must not lay out again).

    Args:
        inputs: the keywords :func:`flat_inputs` made.

    Returns:
        The same keywords less ``attention_mask``.

    Example::

        >>> sorted(stock_packed(inputs))
        ['foundry_documents', 'input_ids', 'labels', 'position_ids']
    """
    return {k: v for k, v in inputs.items() if k != "attention_mask"}


@functools.lru_cache(maxsize=64)
def base_parameters(base_class: type[torch.nn.Module]) -> frozenset[str]:
    """The parameter names of a module class's ``forward`` (a base model's, a causal LM's: what it reads besides
    ``**kwargs``).

    Args:
        base_class: a module class, e.g. ``type(hf.base_model)``.

    Returns:
        Its ``forward``'s parameter names (``self`` included).

    Example::

        >>> "last_cache_position" in base_parameters(type(hf.base_model))  # LlamaModel
        False
    """
    return frozenset(inspect.signature(base_class.forward).parameters)


def one_per_row(
    hf: Any,
    ids: torch.Tensor,
    positions: torch.Tensor | None,
    labels: torch.Tensor | None,
    layout: Layout,
    left: bool = False,
    first_targets: bool = False,
    width: int = 0,
    documents: Sequence[int] | None = None,
) -> tuple[dict[str, Any], Placed]:
    """One document per row with a 2-D mask, right-padded (exact under any stock backend for a model that handles
    right padding) or, with ``left``, left-padded, with each document's positions counted from its first token where
    the model takes ``position_ids`` (a model that assumes left padding: CPM-Ant). Each document's first label is
    ignored (no document predicts its first token), except with ``first_targets``: a model whose loss does not shift
    its labels reads it as a target of its own (CPM-Ant; :func:`foundry_attn.proof.runs.loss_shifts`).

    Args:
        hf: the HF model (not a wrapper), read for its pad token and ``forward``'s parameters.
        ids: the batch's ``input_ids``, ``[rows, width]``.
        positions: its ``[rows, width]`` position ids, or None (the model's own).
        labels: its ``[rows, width]`` labels, or None.
        layout: the batch's :class:`~foundry_attn.flat.layout.Layout`.
        left: left-pad the rows instead of right-padding them.
        first_targets: keep each document's first label (a model whose loss does not shift its labels).
        width: the rows' width, at least the longest document's (0: the longest document's): a proof lays out a few
            documents as wide as the batch's rows.
        documents: only these documents (indices in batch order), for one of several forwards by width (None: all).

    Returns:
        The model's keywords (``[documents, longest]`` rows with a 2-D ``attention_mask``) and :class:`Placed`.

    Example::

        >>> inputs, placed = one_per_row(hf, ids, None, labels, layout)  # doc_lens [[3, 4], [5]]
        >>> inputs["attention_mask"]
        tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    """
    flat = layout.real_indices(ids.device)
    lengths = layout.lengths
    if documents is not None:
        bounds = list(itertools.accumulate(lengths, initial=0))
        flat = torch.cat([flat[bounds[d] : bounds[d + 1]] for d in documents])
        lengths = [lengths[d] for d in documents]
    width = max(width, *lengths)
    starts = [d * width + (width - n if left else 0) for d, n in enumerate(lengths)]
    dst = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)]).to(ids.device)
    rows = len(lengths)

    def scatter(values: torch.Tensor, fill: int) -> torch.Tensor:
        out = values.new_full((rows * width,), fill)
        out[dst] = values.reshape(-1)[flat]
        return out.view(rows, width)

    row_labels = scatter(labels, IGNORE_INDEX) if labels is not None else None
    if row_labels is not None and not first_targets:
        row_labels.view(-1)[torch.tensor(starts, device=ids.device)] = IGNORE_INDEX  # no document predicts its first
    inputs: dict[str, torch.Tensor | None] = {
        "input_ids": scatter(ids, pad_id(hf)),
        "attention_mask": scatter(torch.ones_like(ids), 0),
    }
    if positions is not None:
        inputs["position_ids"] = scatter(positions, 0)
    elif left and "position_ids" in base_parameters(type(hf)):  # type: ignore[arg-type]  # (see flat_inputs)
        counted = ids.new_zeros(rows * width)
        counted[dst] = torch.cat([torch.arange(n) for n in lengths]).to(ids.device)
        inputs["position_ids"] = counted.view(rows, width)
    inputs["labels"] = row_labels
    return inputs, Placed(dst, flat, layout.rows, layout.width)


@dataclasses.dataclass(frozen=True)
class RowForward:
    """One of the forwards a batch's rows run in by width: its ``inputs`` (:func:`one_per_row` of some documents),
    where their real tokens are in its rows (``src``) and in the batch's real tokens (``order``), and how many
    targets its labels hold (``targets``; its ``labels`` are None where it holds none)."""

    inputs: dict[str, Any]
    src: torch.Tensor
    order: torch.Tensor
    targets: int


def row_forwards(
    hf: Any,
    ids: torch.Tensor,
    positions: torch.Tensor | None,
    labels: torch.Tensor | None,
    layout: Layout,
    groups: Sequence[Sequence[int]],
    left: bool = False,
    first_targets: bool = False,
) -> tuple[tuple[RowForward, ...], Placed]:
    """One document per row in one forward per group of documents (:func:`one_per_row` of each, as wide as its
    longest), and where the batch's real tokens are once the forwards' outputs are joined in their order. The
    targets are counted with one host sync for all.

    Args:
        hf: the HF model (not a wrapper).
        ids: the batch's ``input_ids``, ``[rows, width]``.
        positions: its ``[rows, width]`` position ids, or None (the model's own).
        labels: its ``[rows, width]`` labels, or None.
        layout: the batch's :class:`~foundry_attn.flat.layout.Layout`.
        groups: the documents (indices in batch order) of each forward
            (:func:`foundry_attn.flat.layout_cost.row_groups`).
        left: left-pad the rows.
        first_targets: keep each document's first label.

    Returns:
        The :class:`RowForward` of each group, and the :class:`Placed` of their joined real tokens.

    Example::

        >>> layout = Layout(((40, 3, 4),), 47)                       # one row of documents of 40, 3 and 4 tokens
        >>> forwards, placed = row_forwards(hf, torch.arange(47)[None], None, None, layout, ((0,), (1, 2)))
        >>> [f.inputs["input_ids"].shape for f in forwards]
        [torch.Size([1, 40]), torch.Size([2, 4])]
    """
    bounds = list(itertools.accumulate(layout.lengths, initial=0))
    laid = [one_per_row(hf, ids, positions, labels, layout, left, first_targets, documents=g) for g in groups]
    orders = [torch.cat([torch.arange(bounds[d], bounds[d + 1]) for d in g]).to(ids.device) for g in groups]
    counts = [0] * len(groups)
    if labels is not None:
        counts = torch.stack([(inputs["labels"] != IGNORE_INDEX).sum() for inputs, _ in laid]).tolist()
    forwards = tuple(
        RowForward(inputs if n else {**inputs, "labels": None}, where.src, order, int(n))
        for (inputs, where), order, n in zip(laid, orders, counts, strict=True)
    )
    tokens = torch.arange(layout.real_tokens, device=ids.device)
    return forwards, Placed(tokens, layout.real_indices(ids.device), layout.rows, layout.width)


class _Laid(Protocol):
    """What :func:`build` reads of a batch's plan (:class:`foundry_attn.path.plan.Plan`, handed in, never imported)."""

    @property
    def path(self) -> str: ...
    @property
    def layout(self) -> Layout: ...
    @property
    def ids(self) -> torch.Tensor: ...
    @property
    def labels(self) -> torch.Tensor | None: ...
    @property
    def groups(self) -> tuple[tuple[int, ...], ...]: ...
    @property
    def even(self) -> bool: ...
    @property
    def sizes(self) -> tuple[int, int] | None: ...
    @property
    def stock_mask(self) -> bool: ...
    @property
    def left(self) -> bool: ...
    @property
    def first_targets(self) -> bool: ...


class Built(NamedTuple):
    """A plan's inputs (:func:`build`): what the model runs (``inputs``; with ``forwards``, the first's), where the
    tokens went, the flat row with its documents that a proof runs (None on rows), and each forward by width."""

    inputs: dict[str, Any]
    placed: Placed
    row: dict[str, Any] | None = None
    forwards: tuple[RowForward, ...] = ()


def build(hf: Any, plan: _Laid) -> Built:
    """The inputs of a batch's plan, built once: the flat row (even rows, padded to the capacity, or on stock's packed
    mask as the plan says), or one document per row, in several forwards by width where the plan groups them.

    Args:
        hf: the HF model (not a wrapper).
        plan: the batch's plan (:func:`foundry_attn.path.plan.plan_batch`).

    Returns:
        The :class:`Built` inputs.

    Example::

        >>> from foundry_attn.path.plan import plan_batch
        >>> built = build(hf_model, plan_batch(hf_model, batch))     # doc_lens [[20, 30], [40]], attached: flat
        >>> built.inputs["input_ids"].shape, built.row is built.inputs
        (torch.Size([1, 90]), True)
    """
    layout, ids, labels = plan.layout, plan.ids, plan.labels
    if plan.path == "flat":
        row, placed = flat_inputs(hf, ids, labels, layout, plan.even)
        row = at_capacity(row, plan.sizes) if plan.sizes else row
        return Built(stock_packed(row) if plan.stock_mask else row, placed, row)
    # rows: each document starts its own row, so the model's own position ids are right (RoBERTa-style offsets
    # included); only a user's explicit position_ids with their own mask are passed on
    positions = None if layout.marked else layout.positions
    if plan.groups:
        forwards, placed = row_forwards(hf, ids, positions, labels, layout, plan.groups, plan.left, plan.first_targets)
        return Built(forwards[0].inputs, placed, forwards=forwards)
    return Built(*one_per_row(hf, ids, positions, labels, layout, plan.left, plan.first_targets))


def pad_id(hf: Any) -> int:
    """The id right padding is filled with: the model's pad token where it has one (RoBERTa-style position ids
    count from it), else 0.

    Args:
        hf: the HF model, read for ``config.pad_token_id``.

    Returns:
        The pad id.

    Example::

        >>> hf.config.pad_token_id, pad_id(hf)  # a Llama without a pad token
        (None, 0)
    """
    pad = getattr(hf.config, "pad_token_id", None)
    return pad if isinstance(pad, int) and pad >= 0 else 0


def placed_back(values: torch.Tensor, placed: Placed) -> torch.Tensor:
    """``[..., C]`` values in the model's layout as ``[rows, width, C]`` in the batch's (zeros at its padding); a
    view, no copy, where neither layout has padding (a packed row, full rows).

    Args:
        values: the model's output in its layout, e.g. ``out.logits``.
        placed: the :class:`Placed` of the inputs it ran.

    Returns:
        ``[rows, width, C]`` values.

    Example::

        >>> inputs, placed = flat_inputs(hf, ids, None, layout)  # doc_lens [[3, 4], [5]]
        >>> out = hf(**inputs)
        >>> out.logits.shape, placed_back(out.logits, placed).shape  # the batch: [2, 8]
        (torch.Size([1, 12, 64]), torch.Size([2, 8, 64]))
    """
    src, dst, rows, width = placed  # both ascending: where the real tokens are in the model's layout, the batch's
    flat = values.reshape(-1, values.shape[-1])
    if src.numel() != flat.shape[0]:  # the rows layout pads its own rows
        flat = flat[src]
    if dst.numel() != rows * width:  # the batch has padding: zeros there
        flat = flat.new_zeros(rows * width, flat.shape[-1]).index_copy_(0, dst, flat)
    return flat.view(rows, width, -1)
