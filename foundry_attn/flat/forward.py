"""One forward of a HF causal LM that honours document boundaries under every backend: two paths.

    attach(hf_model, "sdpa")                        # once: foundry_attn.flat.attach (proves the flat path)
    out = forward_documents(hf_model, batch)        # batch from foundry_attn.flat.packing, or any 2-D mask
    logits = repad_logits(out)                      # [rows, width, vocab], only if you need them

**flat**: the batch is unpadded once into one flat row of real tokens, and every attention call carries the
documents as an argument (``foundry_documents``) to our function for its backend (``foundry_attn.attention.functions``):
FA2 varlen with ``cu_seq_lens``, one causal SDPA call per document, eager math per document, or one flex
call with a document ``BlockMask``. No L x L mask is built: the model's own mask code gets a ``[1, 1, 1, 1]``
placeholder, which it passes through unchanged. Only for a model whose flat path was proven
(:func:`foundry_attn.flat.attach.attach`); the proof is kept on the model and re-checked on the batches that train.

**rows**: the stock backend, one document per row, right-padded, with a 2-D mask and the model's own
position ids: exact for every family that handles right padding, at the cost of padding. Everything else
(a model nobody attached, one whose flat proof failed) runs this way.
Core module: torch and transformers only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import torch

from foundry_attn.attention.backends import config_value
from foundry_attn.attention.documents import DOCS_KEY, Documents
from foundry_attn.attention.fa2_reference import reference_flash_attn
from foundry_attn.flat.layout import Layout, flattened_lengths
from foundry_attn.flat.packing import IGNORE_INDEX
from foundry_attn.flat.unwrap import compiled, unwrapped
from foundry_attn.selection.policy import FA2

log = logging.getLogger(__name__)

FLAT, ROWS = "flat", "rows"
PATH_ATTR = "foundry_path"  # the PathState :func:`foundry_attn.flat.attach.attach` keeps on the HF model


class StepProof(Protocol):
    """A proof that takes a batch's own training forward as its packed side
    (:class:`foundry_attn.flat.attach.StepProof`)."""

    def capturing(self) -> contextlib.AbstractContextManager:
        """Around the training forward."""
        ...

    def settle(self, out: Any, error: BaseException | None = None) -> bool:
        """Prove on the forward's ``out`` (or the ``error`` it raised); whether the flat forward stands (False: rows
        now, the batch runs again there)."""
        ...


class PathGuard(Protocol):
    """What ``forward_documents`` asks of the path kept on a model (:class:`foundry_attn.flat.attach.PathState`)."""

    path: str
    flat_name: str

    def before_batch(
        self, model: Any, inputs: Mapping[str, Any], own_positions: bool, in_step: bool = False
    ) -> bool | StepProof:
        """Prove the flat path on ``inputs`` when due; whether the batch runs them (False: rows), or (``in_step``)
        a proof that takes the batch's forward as its packed side."""
        ...

    def before_rows_batch(
        self, model: Any, tokens: int, longest: int, flat: Callable[[], Mapping[str, Any]], own_positions: bool
    ) -> None:
        """Prove the rows path on this batch's documents when due."""
        ...


class Placed(NamedTuple):
    """Where a batch's real tokens went: ``src`` indexes them in the model's layout (its flat row or padded rows),
    ``dst`` in the batch's ``[rows, width]``; both ascending."""

    src: torch.Tensor
    dst: torch.Tensor
    rows: int
    width: int


@dataclasses.dataclass
class Prepared:
    """A batch laid out for the model: its ``inputs``, where its tokens went (``placed``, for :func:`repad_logits`),
    whether it has no target, and the proof due on it that its forward serves (``proof``: run the forward with
    :func:`run_prepared`)."""

    inputs: dict[str, Any]
    placed: Placed
    no_targets: bool
    proof: StepProof | None = None


def path_state(model: Any) -> PathGuard | None:
    """The proven path of ``model`` (or of the HF model inside a wrapper), or None if it was never attached."""
    return getattr(unwrapped(model), PATH_ATTR, None)


def kernel_context(impl: str, device: torch.device, fa2_reference: bool = False) -> contextlib.AbstractContextManager:
    """The FA2 reference kernel around a block that runs transformers' *stock* FA2 code (CPU stand-in).

    Models attached with ``attach(model, "flash_attention_2", fa2_reference=True)`` need no context: their
    attention function installs the reference kernel for each call itself.
    """
    if impl == FA2 and fa2_reference:
        return reference_flash_attn()
    return contextlib.nullcontext()


def forward_documents(model: Any, batch: Mapping) -> Any:
    """Run ``model`` (a HF causal LM, or a DDP / FSDP / compiled wrapper of one) so that no document sees another."""
    prepared = prepare_documents(model, batch, in_step=not compiled(model))
    out, prepared = run_prepared(lambda inputs: model(**inputs, use_cache=False), model, batch, prepared)
    return finish_documents(out, prepared.placed, prepared.no_targets)


def run_prepared(
    forward: Callable[[dict[str, Any]], Any], model: Any, batch: Mapping, prepared: Prepared
) -> tuple[Any, Prepared]:
    """``forward(prepared.inputs)``; where a proof is due on the batch, the forward is its packed side
    (:class:`StepProof`) and, if the proof moves the run to rows, the batch runs again there. Returns the output
    and the layout it ran."""
    if prepared.proof is None:
        return forward(prepared.inputs), prepared
    return _proven(forward, model, batch, prepared.proof, prepared)


@torch.compiler.disable  # a step proof is made only for uncompiled forwards; this keeps a compiled caller's graph
def _proven(
    forward: Callable[[dict[str, Any]], Any], model: Any, batch: Mapping, proof: StepProof, prepared: Prepared
) -> tuple[Any, Prepared]:
    try:
        with proof.capturing():
            out = forward(prepared.inputs)
    except Exception as exc:  # the flat row does not run in training: rows, where the batch runs again
        if proof.settle(None, exc):
            raise
    else:
        if proof.settle(out):
            return out, prepared
    prepared = prepare_documents(model, batch)  # the run is on rows now (proven there when due)
    return forward(prepared.inputs), prepared


@torch.compiler.disable
def finish_documents(out: Any, placed: Placed, no_targets: bool, shaped: bool = False) -> Any:
    """Record where the tokens went (for :func:`repad_logits`); ``shaped``: re-pad the logits to the batch's
    ``[rows, width, vocab]`` now (the loss stays the one computed on the flat row). A microbatch without targets
    adds zero loss (HF's mean over no target is nan), still connected to every parameter the forward used."""
    out.foundry_layout = placed
    if no_targets:
        out.loss = out.logits.sum() * 0.0
    if shaped:
        repad_logits(out)
    return out


@torch.compiler.disable
def prepare_documents(model: Any, batch: Mapping, in_step: bool = False) -> Prepared:
    """The model's inputs for ``batch`` (:class:`Prepared`). Host-side work on Python ints, so never traced: under
    ``torch.compile`` (Composer's ``compile_config`` compiles the forward around this) the model sees only tensors
    and our ``Documents``. ``in_step``: the caller runs the forward uncompiled through :func:`run_prepared`, so a
    proof due on the batch may take that forward as its packed side."""
    ids = batch["input_ids"]
    layout = Layout.from_batch(batch)
    if layout.real_tokens == 0:
        raise ValueError("empty batch: no real tokens (every row is padding)")
    labels = batch.get("labels")
    no_targets = labels is not None and not _has_targets(batch, labels)
    if no_targets:
        labels = None
    hf = unwrapped(model)
    state = path_state(hf)
    if state is None:
        _say_unproven(type(hf).__name__)
    elif state.path == FLAT and hf.config._attn_implementation == state.flat_name:
        inputs, placed = flat_inputs(model, ids, _flat_positions(ids, layout), labels, layout)
        # the proof, when due, runs these very inputs (or their forward); a failure moves the batch and run to rows
        route = state.before_batch(model, inputs, own_positions=not layout.marked, in_step=in_step)
        if route:
            return Prepared(inputs, placed, no_targets, None if route is True else route)
    elif state.path == ROWS:  # proven as flat is: its first batch, changes, longer batches, the interval

        def flat() -> dict[str, Any]:
            return flat_inputs(model, ids, _flat_positions(ids, layout), None, layout)[0]

        state.before_rows_batch(model, layout.real_tokens, layout.max_length, flat, not layout.marked)
    # rows: each document starts its own row, so the model's own position ids are right (RoBERTa-style offsets
    # included); only a user's explicit position_ids with their own mask are passed on
    inputs, placed = one_per_row(model, ids, None if layout.marked else layout.positions, labels, layout)
    return Prepared(inputs, placed, no_targets)


#: what the ecosystem's packed batches carry that our documents stand for (everything else passes on to the model)
FLATTENED_KEYS = frozenset(
    {"input_ids", "labels", "position_ids", "attention_mask", "use_cache", "cu_seq_lens_q", "cu_seq_lens_k"}
    | {"max_length_q", "max_length_k", "seq_idx"}
)


class FlattenedForward:
    """An attached model's ``forward`` (:func:`foundry_attn.flat.attach.attach` sets it on the instance): a batch the
    ecosystem packed into one row (transformers' ``DataCollatorWithFlattening``, TRL's ``padding_free``:
    restarting ``position_ids``, ``cu_seq_lens_*``, ``seq_idx``; :func:`foundry_attn.flat.layout.flattened_lengths`)
    runs the proven path, flat or rows, with the proof, exactly as :func:`forward_documents` runs ours; every other
    call (a 2-D mask, generation, our own flat inputs) runs the model's own ``forward`` unchanged.

        attach(model, "sdpa")
        SFTTrainer(model=model, args=SFTConfig(padding_free=True), ...)    # model(**batch) takes this path
    """

    def __init__(self, model: Any) -> None:
        self.model = model  # a deep copy of the model copies this too, bound to the copy

    @property
    def __signature__(self) -> inspect.Signature:
        """The model's own (the Trainer reads it to keep the dataset's columns)."""
        return inspect.signature(type(self.model).forward.__get__(self.model))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model, forward = self.model, type(self.model).forward  # no bound method made: nothing for Dynamo to guard
        if args or DOCS_KEY in kwargs:  # ours (flat inputs) or a positional call: the model's own forward
            return forward(model, *args, **kwargs)
        packed = packed_call(kwargs)
        if packed is None:
            return forward(model, **kwargs)
        batch, extra = packed
        prepared = prepare_documents(model, batch, in_step=not torch.compiler.is_compiling())
        out, prepared = run_prepared(
            lambda inputs: forward(model, **inputs, use_cache=False, **extra), model, batch, prepared
        )
        return finish_documents(out, prepared.placed, prepared.no_targets, shaped=True)


class FlattenedBackbone:
    """An attached model's base model ``forward``: a packed batch that reaches the backbone itself (TRL's fused LM
    head calls ``model.base_model`` and projects the hidden states in chunks, so the model's own ``forward`` never
    runs) takes the proven path too, flat or rows (proven on the causal LM, its own forward), and its
    ``last_hidden_state`` comes back in the batch's one row. Calls that carry our documents (the causal LM's own
    flat path), a mask, or no packed documents run the base model's forward unchanged."""

    def __init__(self, model: Any) -> None:
        self.model = model  # the causal LM; its base model is model.base_model

    @property
    def __signature__(self) -> inspect.Signature:
        base = self.model.base_model
        return inspect.signature(type(base).forward.__get__(base))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        base = self.model.base_model
        forward = type(base).forward
        packed = None if args or DOCS_KEY in kwargs or torch.compiler.is_compiling() else packed_call(kwargs)
        if packed is None:
            return forward(base, *args, **kwargs)
        batch, extra = packed
        prepared = prepare_documents(self.model, batch)  # a proof due runs its own forward of the causal LM
        inputs = {k: v for k, v in prepared.inputs.items() if k != "labels"}
        if "use_cache" in _base_parameters(type(base)):  # type: ignore[arg-type]  # (see flat_inputs)
            extra["use_cache"] = False
        out = forward(base, **inputs, **extra)
        out.last_hidden_state = placed_back(out.last_hidden_state, prepared.placed)
        routers = getattr(out, "router_logits", None)
        if routers:  # the caller's router loss reads every token as real: the rows path's padding leaves
            out.router_logits = tuple(_real_tokens(r, prepared.placed.src) for r in routers)
        return out


def _real_tokens(router_logits: Any, src: torch.Tensor) -> Any:
    """A layer's router logits (``[tokens, experts]`` or ``[rows, width, experts]``) at the real tokens only."""
    if not isinstance(router_logits, torch.Tensor):
        return router_logits
    flat = router_logits.reshape(-1, router_logits.shape[-1])
    return flat[src] if flat.shape[0] != src.numel() else router_logits


def packed_call(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """A call's keywords as the batch :func:`prepare_documents` lays out (``doc_lens`` read by
    :func:`foundry_attn.flat.layout.flattened_lengths`, its ``labels`` and ``position_ids``) and the keywords that pass
    on to the model; None for a call that is not one packed row."""
    lengths = flattened_lengths(kwargs)
    if lengths is None:
        return None
    batch: dict[str, Any] = {"input_ids": kwargs["input_ids"], "doc_lens": [lengths]}
    for key in ("labels", "position_ids"):
        if kwargs.get(key) is not None:
            batch[key] = kwargs[key]
    return batch, {k: v for k, v in kwargs.items() if k not in FLATTENED_KEYS}


def takes_flattened_batches(model: Any) -> None:
    """Set :class:`FlattenedForward` as ``model``'s forward, and :class:`FlattenedBackbone` as its base model's
    (once; the HF model inside a wrapper)."""
    hf = unwrapped(model)
    if not isinstance(vars(hf).get("forward"), FlattenedForward):
        hf.forward = FlattenedForward(hf)
    base = getattr(hf, "base_model", hf)
    if base is not hf and not isinstance(vars(base).get("forward"), FlattenedBackbone):
        base.forward = FlattenedBackbone(hf)


@functools.cache
def _say_unproven(class_name: str) -> None:
    log.warning(
        "foundry_attn: %s was never attached (foundry_attn.flat.attach.attach), so its flat path is not proven: "
        "forward_documents runs it one document per row (rows path; under FA2 that is transformers' per-layer "
        "unpad). Call attach(model, backend) once for the flat path.",
        class_name,
    )


def _flat_positions(ids: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The batch's own; else ours restart per document; a user's mask keeps HF's default (index in the row)."""
    if layout.positions is not None:
        return layout.positions
    if layout.marked:
        return layout.position_ids(ids.device)
    return torch.arange(ids.shape[1], device=ids.device).expand_as(ids)


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


def flat_inputs(
    model: Any, ids: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor | None, layout: Layout
) -> tuple[dict[str, Any], Placed]:
    """Unpad once into one flat row of real tokens; every attention call gets the documents. The proof
    (:mod:`foundry_attn.flat.proof`) runs these very inputs: the layout that trains."""
    flat = layout.real_indices(ids.device)
    docs = Documents.of(layout.bounds(), ids.device)
    total = docs.bounds[-1]
    inputs: dict[str, Any] = dict(
        input_ids=ids.reshape(-1)[flat][None],
        position_ids=positions.reshape(-1)[flat][None],
        labels=_flat_labels(labels, flat, list(docs.bounds[:-1])),
    )
    # under torch.compile: the row length and the document count vary from batch to batch; one dynamic graph
    for value in (*inputs.values(), docs.device_bounds, docs.host_bounds):
        if value is not None:
            torch._dynamo.maybe_mark_dynamic(value, value.dim() - 1)
    hf = unwrapped(model)
    # Gemma2/3 read last_cache_position from a 4-D mask with .item() (a graph break); the mask is ours, so is the value
    # (the ignore: a class is hashable, but mypy misreads its __hash__ against lru_cache's Hashable)
    if "last_cache_position" in _base_parameters(type(hf.base_model)):  # type: ignore[arg-type]
        inputs["last_cache_position"] = total
    inputs["attention_mask"] = (
        # a MoE forward hands its mask to the router loss, which reads it as [batch, seq]: every token of the
        # flat row is real, so all ones (transformers 5.x builds no mask for our names; 4.51 builds L x L)
        torch.ones(1, total, dtype=torch.long, device=ids.device)
        if config_value(hf.config, "output_router_logits", False)
        else torch.zeros(1, 1, 1, 1, dtype=hf.dtype, device=ids.device)  # the placeholder
    )
    inputs[DOCS_KEY] = docs
    return inputs, Placed(torch.arange(total, device=ids.device), flat, layout.rows, layout.width)


@functools.lru_cache(maxsize=64)
def _base_parameters(base_class: type[torch.nn.Module]) -> frozenset[str]:
    """The parameter names of a base model's ``forward`` (what it reads besides ``**kwargs``)."""
    return frozenset(inspect.signature(base_class.forward).parameters)


def one_per_row(
    model: Any, ids: torch.Tensor, positions: torch.Tensor | None, labels: torch.Tensor | None, layout: Layout
) -> tuple[dict[str, Any], Placed]:
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
    inputs: dict[str, torch.Tensor | None] = {
        "input_ids": scatter(ids, pad_id(model)),
        "attention_mask": scatter(torch.ones_like(ids), 0),
    }
    if positions is not None:
        inputs["position_ids"] = scatter(positions, 0)
    inputs["labels"] = row_labels
    return inputs, Placed(dst, flat, layout.rows, layout.width)


def pad_id(model: Any) -> int:
    """The id right padding is filled with: the model's pad token where it has one (RoBERTa-style position ids
    count from it), else 0."""
    pad = getattr(unwrapped(model).config, "pad_token_id", None)
    return pad if isinstance(pad, int) and pad >= 0 else 0


def repad_logits(out: Any) -> torch.Tensor:
    """``[rows, width, vocab]`` logits of the original batch (zeros at padding), scattered back once; a view, no
    copy, where neither the batch nor the model's layout has padding (a packed row, full rows)."""
    packed = getattr(out, "foundry_layout", None)
    if packed is None:
        return out.logits
    out.logits = placed_back(out.logits, packed)
    out.foundry_layout = None
    return out.logits


def placed_back(values: torch.Tensor, placed: Placed) -> torch.Tensor:
    """``[..., C]`` values in the model's layout as ``[rows, width, C]`` in the batch's (zeros at its padding); a
    view, no copy, where neither layout has padding (a packed row, full rows)."""
    src, dst, rows, width = placed  # both ascending: where the real tokens are in the model's layout, the batch's
    flat = values.reshape(-1, values.shape[-1])
    if src.numel() != flat.shape[0]:  # the rows layout pads its own rows
        flat = flat[src]
    if dst.numel() != rows * width:  # the batch has padding: zeros there
        flat = flat.new_zeros(rows * width, flat.shape[-1]).index_copy_(0, dst, flat)
    return flat.view(rows, width, -1)


def has_layout(batch: Mapping) -> bool:
    """A batch to lay out ourselves: ours (``doc_lens``), or any with a 2-D mask (either padding side)."""
    if batch.get("mode") is not None:  # ICL / generation batches keep the stock path
        return False
    if "doc_lens" in batch:  # only the key: under compile, reading the list would guard on its length
        return True
    mask = batch.get("attention_mask")
    return isinstance(mask, torch.Tensor) and mask.dim() == 2
