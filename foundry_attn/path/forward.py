"""One forward of a HF causal LM that honours document boundaries under every backend: two paths.

    attach(hf_model, "sdpa")                        # once: foundry_attn.path.attach (proves the flat path)
    out = forward_documents(hf_model, batch)        # batch from foundry_attn.flat.packing, or any 2-D mask
    logits = repad_logits(out)                      # [rows, width, vocab], only if you need them

**flat**: the batch is unpadded once into one flat row of real tokens, and every attention call carries the
documents as an argument (``foundry_documents``) to our function for its backend (``foundry_attn.attention.functions``):
FA2 varlen with ``cu_seq_lens``, one causal SDPA call per document, eager math per document, or one flex
call with a document ``BlockMask``. No L x L mask is built: the model's own mask code gets a ``[1, 1, 1, 1]``
placeholder, which it passes through unchanged. Only for a model whose flat path was proven
(:func:`foundry_attn.path.attach.attach`); the proof is kept on the model and re-checked on the batches that train.

**rows**: the stock backend, one document per row, right-padded, with a 2-D mask and the model's own
position ids: exact for every family that handles right padding, at the cost of padding. Everything else
(a model nobody attached, one whose flat proof failed) runs this way.
Core module: torch and transformers only.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from foundry_attn.flat.inputs import Placed, RowForward, base_parameters, build, placed_back, real_tokens
from foundry_attn.flat.layout import padding_side
from foundry_attn.flat.unwrap import compiled, unwrapped
from foundry_attn.path.execution import PROOF_DUE, ROWS_BATCH
from foundry_attn.path.plan import PAST_CAPACITY as PAST_CAPACITY
from foundry_attn.path.plan import Plan, plan_batch, replan
from foundry_attn.path.proven import prove_plan
from foundry_attn.path.state import FLAT, path_of
from foundry_attn.proof.step_proof import StepProof

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Prepared:
    """A batch laid out for the model by its :class:`~foundry_attn.path.plan.Plan`: its ``inputs``, where its tokens
    went (``placed``, for :func:`repad_logits`), the proof due on it that its forward serves (``proof``), and, where
    its rows run in several forwards by width, each one (``forwards``; ``inputs`` is the first's). Run it with
    :func:`run_prepared`."""

    plan: Plan
    inputs: dict[str, Any]
    placed: Placed
    proof: StepProof | None = None
    forwards: tuple[RowForward, ...] = ()

    no_targets: bool = dataclasses.field(init=False)
    """Whether the batch has no target (the plan's ``no_targets``): its loss is zero, still connected to the
    parameters. A field, not a property on the plan, so a compiled caller reads a bool, not the frozen plan."""

    def __post_init__(self) -> None:
        self.no_targets = self.plan.no_targets


def forward_documents(model: Any, batch: Mapping) -> Any:
    """Run ``model`` on ``batch`` so that no document sees another: flat where :func:`~foundry_attn.path.attach.attach`
    proved it (one row of real tokens, unpadded once), else one document per row.

    Args:
        model: a transformers causal LM, or a DDP / FSDP / compiled wrapper of one.
        batch: ``input_ids`` with ``doc_lens`` (:class:`~foundry_attn.flat.packing.PaddingCollator`'s packed
            rows) or a 2-D ``attention_mask`` (either padding side); ``labels`` and ``position_ids`` optional.

    Returns:
        The model's output. Its ``loss`` is each document's as if alone; its ``logits`` are in the model's layout
        (:func:`repad_logits` gives them back as ``[rows, width, vocab]``).

    Example::

        >>> from foundry_attn.flat.packing import PaddingCollator
        >>> examples = [torch.tensor([5, 6, 2, 7, 8, 9, 2]), torch.tensor([4, 4, 2])]   # documents of 3, 4 and 3
        >>> batch = PaddingCollator(pad_id=0, eos_id=2, max_seq_len=64, mode="pack")(examples)
        >>> out = forward_documents(model, batch)
        >>> out.loss.backward()
    """
    prepared = prepare_documents(model, batch, in_step=not compiled(model))
    out, prepared = run_prepared(lambda inputs: model(**inputs, use_cache=False), model, prepared)
    return finish_documents(out, prepared.placed, prepared.no_targets)


def run_prepared(
    forward: Callable[[dict[str, Any]], Any], model: Any, prepared: Prepared, summed: bool = False
) -> tuple[Any, Prepared]:
    """``forward(prepared.inputs)``, or one forward per group of rows joined (:func:`joined`); where a proof is
    due on the batch, the forward is its packed side (:class:`StepProof`) and, if the proof moves the run, the batch
    runs again where its new plan says. The flat row runs as the state's execution says (eager, compiled or graphed:
    :mod:`foundry_attn.path.execution`); a proof due, and rows, run eagerly. Returns the output and the layout it ran.

    Args:
        forward: runs the model on a layout's inputs.
        model: the model ``forward`` calls (a wrapper or not).
        prepared: :func:`prepare_documents`' answer for the batch.
        summed: the model's loss is a sum over the batch's targets (``num_items_in_batch`` given), not a mean.

    Returns:
        The output and the :class:`Prepared` it ran (a new one where the batch ran again on rows).

    Example::

        >>> prepared = prepare_documents(model, batch, in_step=True)   # doc_lens [[20, 30], [40]]
        >>> out, prepared = run_prepared(lambda inputs: model(**inputs, use_cache=False), model, prepared)
        >>> out.logits.shape                                            # the flat row: 90 real tokens
        torch.Size([1, 90, 64])
    """
    hf, execution, way = _way(model, prepared, torch.compiler.is_compiling())
    if way == PROOF_DUE:  # a flat row whose proof takes its forward, uncompiled
        return _proven(forward, hf, prepared.proof, prepared)
    if way == FLAT:
        return execution.run(forward, prepared.inputs, hf), prepared
    if prepared.forwards:
        return joined([forward(f.inputs) for f in prepared.forwards], prepared.forwards, summed), prepared
    return forward(prepared.inputs), prepared


@torch.compiler.disable  # host-side: under a compiled caller, the frozen plan's fields would all become guards
def _way(model: Any, prepared: Prepared, compiling: bool) -> tuple[Any, Any, str]:
    """The transformers model, its path's execution (None: unattached), and the way the batch runs: ``PROOF_DUE``,
    ``FLAT`` or ``ROWS_BATCH``; a batch the execution does not take is counted here (not under a compiled caller)."""
    hf = unwrapped(model)
    state = path_of(hf) if prepared.plan.attached else None
    if state is None:  # unattached: rows, unproven
        return hf, None, ROWS_BATCH
    way = PROOF_DUE if prepared.proof is not None else FLAT if prepared.plan.path == FLAT else ROWS_BATCH
    if way != FLAT and not compiling:
        state.execution.ran_eagerly(way)
    return hf, state.execution, way


def joined(outs: Sequence[Any], forwards: Sequence[RowForward], summed: bool = False) -> Any:
    """The outputs of a batch's rows run in several forwards by width as one: the logits of every real token in
    batch order (``[1, tokens, vocab]``), the loss the batch's targets give in one forward (each forward's mean
    weighted by its targets; ``summed``: added up). Per-row fields (hidden states, router logits) are not joined:
    :meth:`~foundry_attn.flat.layout_cost.LayoutChoice.forwards` runs such a model in one forward.

    Args:
        outs: each forward's output, in the order of ``forwards``.
        forwards: the :class:`RowForward` each ran (:func:`foundry_attn.flat.inputs.row_forwards`).
        summed: each forward's loss is already a share of the batch's sum (``num_items_in_batch``).

    Returns:
        The output of the first forward with targets, its ``logits`` and ``loss`` those of the batch.

    Example::

        >>> from foundry_attn.flat.inputs import row_forwards
        >>> from foundry_attn.flat.layout import Layout
        >>> layout = Layout.from_batch(batch)                            # doc_lens [[20, 30], [40]]
        >>> groups = ((2,), (0, 1))                                      # 40 alone, then 20 and 30
        >>> forwards, placed = row_forwards(model, batch["input_ids"], None, batch["labels"], layout, groups)
        >>> out = joined([model(**f.inputs) for f in forwards], forwards)
        >>> out.logits.shape                     # 90 real tokens, a vocabulary of 64
        torch.Size([1, 90, 64])
    """
    total = sum(f.targets for f in forwards)
    out = next((o for o, f in zip(outs, forwards, strict=True) if f.targets), outs[0])
    first = outs[0].logits
    logits = first.new_empty(sum(f.order.numel() for f in forwards), first.shape[-1])
    for o, f in zip(outs, forwards, strict=True):
        logits.index_copy_(0, f.order, o.logits.reshape(-1, o.logits.shape[-1])[f.src])
    out.logits = logits[None]
    losses = [o.loss * (1.0 if summed else f.targets / total) for o, f in zip(outs, forwards, strict=True) if f.targets]
    if losses:
        out.loss = torch.stack(losses).sum()
    return out


@torch.compiler.disable  # a step proof is made only for uncompiled forwards; this keeps a compiled caller's graph
def _proven(
    forward: Callable[[dict[str, Any]], Any], hf: Any, proof: StepProof, prepared: Prepared
) -> tuple[Any, Prepared]:
    try:
        with proof.capturing():
            out = forward(prepared.inputs)
    except Exception as exc:  # the flat row does not run in training: the batch runs again where the state is now
        proof.settle(None, exc)
    else:
        if proof.settle(out):
            return out, prepared
    prepared = _laid_out(hf, replan(hf, prepared.plan))  # rows, or stock's packed mask, now
    return forward(prepared.inputs), prepared


@torch.compiler.disable
def finish_documents(out: Any, placed: Placed, no_targets: bool, shaped: bool = False) -> Any:
    """Record where the tokens went (for :func:`repad_logits`); ``shaped``: re-pad the logits to the batch's
    ``[rows, width, vocab]`` now (the loss stays the one computed on the flat row). A microbatch without targets
    adds zero loss (HF's mean over no target is nan), still connected to every parameter the forward used.

    Args:
        out: the model's output on the prepared inputs.
        placed: where the batch's tokens went (``prepared.placed``).
        no_targets: the batch has no target (``prepared.no_targets``).
        shaped: re-pad the logits to ``[rows, width, vocab]`` now.

    Returns:
        ``out``, changed in place.

    Example::

        >>> prepared = prepare_documents(model, batch)                  # doc_lens [[20, 30], [40]]
        >>> out = model(**prepared.inputs, use_cache=False)
        >>> out = finish_documents(out, prepared.placed, prepared.no_targets, shaped=True)
        >>> out.logits.shape                 # two rows of 64, a vocabulary of 64
        torch.Size([2, 64, 64])
    """
    out.foundry_layout = placed
    if no_targets:
        out.loss = out.logits.sum() * 0.0
    if shaped:
        repad_logits(out)
    return out


@torch.compiler.disable
def prepare_documents(model: Any, batch: Mapping, in_step: bool = False, grouped: bool | None = None) -> Prepared:
    """The model's inputs for ``batch`` (:class:`Prepared`): planned once (:func:`~foundry_attn.path.plan.plan_batch`),
    built once from the plan (:func:`~foundry_attn.flat.inputs.build`), and where a proof is due, proven on them; a
    proof that moves the run returns a new plan, built in its turn. Host-side work on Python ints, so never traced:
    under ``torch.compile`` (Composer's ``compile_config`` compiles the forward around this) the model sees only
    tensors and our ``Documents``. ``in_step``: the caller runs the forward uncompiled through :func:`run_prepared`,
    so a proof due on the batch may take that forward as its packed side, and rows may run in several forwards by width.

    Args:
        model: a transformers causal LM, or a wrapper of one.
        batch: ``input_ids`` with ``doc_lens`` or a 2-D ``attention_mask``; ``labels`` and ``position_ids`` optional.
        in_step: the caller runs the forward uncompiled, through :func:`run_prepared`.
        grouped: rows may run in several forwards by width (None: as ``in_step``; False where the caller reads
            per-row outputs, hidden states, that :func:`joined` does not join).

    Returns:
        The :class:`Prepared` inputs: one flat row where flat is proven, else one document per row.

    Raises:
        ValueError: the batch has no real token.

    Example::

        >>> prepared = prepare_documents(model, batch, in_step=True)   # doc_lens [[20, 30], [40]]
        >>> prepared.inputs["input_ids"].shape
        torch.Size([1, 90])
    """
    hf = unwrapped(model)
    plan = plan_batch(hf, batch, in_step, in_step if grouped is None else grouped)
    built, proof = build(hf, plan), None
    if plan.at is not None:  # a proof due: on these inputs, or in their forward (proof); a moved run is a new plan
        state = path_of(hf)
        assert state is not None
        settled, proof = prove_plan(state, hf, plan, built.row)
        if settled is not plan:
            return _laid_out(hf, settled)
    return Prepared(plan, built.inputs, built.placed, proof, built.forwards)


def _laid_out(hf: Any, plan: Plan) -> Prepared:
    """A plan with no proof due, built."""
    built = build(hf, plan)
    return Prepared(plan, built.inputs, built.placed, forwards=built.forwards)


def packed_model(model: Any, forward: Callable[..., Any], batch: dict[str, Any], extra: dict[str, Any]) -> Any:
    """What a packed call of an attached model runs (its :class:`~foundry_attn.flat.model_forward.FlattenedForward`):
    the proven path, flat or rows, with the proof, as :func:`forward_documents`; the logits in the batch's one row.

    Args:
        model: the transformers causal LM.
        forward: its class ``forward`` (called unbound: nothing for Dynamo to guard).
        batch: the call's packed documents as a batch (:func:`foundry_attn.flat.inputs.packed_call`).
        extra: the call's other keywords, passed on.

    Returns:
        The model's output, shaped as the call's batch.

    Example::

        >>> row = torch.randint(3, 64, (1, 41))
        >>> restarting = torch.cat([torch.arange(28), torch.arange(13)])[None]   # two documents, 28 and 13 tokens
        >>> out = model(input_ids=row, position_ids=restarting, labels=row)   # an attached model routes it here
        >>> out.logits.shape
        torch.Size([1, 41, 64])
    """
    in_step = not torch.compiler.is_compiling()
    per_row = any(extra.get(k) for k in ("output_hidden_states", "output_attentions", "output_router_logits"))
    prepared = prepare_documents(model, batch, in_step=in_step, grouped=in_step and not per_row)
    summed = extra.get("num_items_in_batch") is not None
    out, prepared = run_prepared(
        lambda inputs: forward(model, **inputs, use_cache=False, **extra), model, prepared, summed
    )
    return finish_documents(out, prepared.placed, prepared.no_targets, shaped=True)


def packed_backbone(model: Any, forward: Callable[..., Any], batch: dict[str, Any], extra: dict[str, Any]) -> Any:
    """What a packed call of an attached model's base model runs (TRL's fused LM head calls the backbone itself):
    the proven path, flat or rows (proven on the causal LM, its own forward), ``last_hidden_state`` back in the
    batch's one row, and router logits of real tokens only.

    Args:
        model: the transformers causal LM whose ``base_model`` was called.
        forward: the base model's class ``forward``.
        batch: the call's packed documents as a batch.
        extra: the call's other keywords, passed on.

    Returns:
        The base model's output, shaped as the call's batch.

    Example::

        >>> row = torch.randint(3, 64, (1, 41))
        >>> restarting = torch.cat([torch.arange(28), torch.arange(13)])[None]   # two documents, 28 and 13 tokens
        >>> hidden = model.base_model(input_ids=row, position_ids=restarting).last_hidden_state
        >>> hidden.shape
        torch.Size([1, 41, 32])
    """
    base = model.base_model
    prepared = prepare_documents(model, batch)  # a proof due runs its own forward of the causal LM
    inputs = {k: v for k, v in prepared.inputs.items() if k != "labels"}
    if "use_cache" in base_parameters(type(base)):  # type: ignore[arg-type]  # (see flat_inputs)
        extra["use_cache"] = False
    out = forward(base, **inputs, **extra)
    out.last_hidden_state = placed_back(out.last_hidden_state, prepared.placed)
    routers = getattr(out, "router_logits", None)
    if routers:  # the caller's router loss reads every token as real: the rows path's padding leaves
        out.router_logits = tuple(real_tokens(r, prepared.placed.src) for r in routers)
    return out


#: what a plain left-padded batch trains through an attached model's own forward, said once (path reason, inspector)
LEFT_PADDED = (
    "left-padded rows reached the model's own forward (a 2-D mask, no packed documents) and train as stock trains "
    "them, not as each row alone: a pad position predicts each row's first token, and a model that counts positions "
    "from the row's start (absolute position embeddings: GPT-2, GPT-Neo, BioGPT) sees them shifted by the padding. "
    "Pad on the right (tokenizer.padding_side = 'right'), or run the batch through forward_documents, for each row "
    "as alone"
)


def plain_call(model: Any, kwargs: Mapping[str, Any]) -> None:
    """Read a plain call of an attached model (a 2-D mask, the model's own forward: transformers' ``Trainer`` on padded
    rows) before stock runs it: the first training call with padding tells its side (one host sync, once a run); a
    left-padded one is said in the path's reason and as a path change (the glues' path event), once.

    Args:
        model: the transformers causal LM.
        kwargs: the call's keywords.

    Example::

        >>> _ = model.train()
        >>> left_padded_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8])
        >>> out = model(input_ids=ids, attention_mask=left_padded_mask, labels=ids)   # an attached model reads it here
        >>> LEFT_PADDED in path_of(model).reason
        True
    """
    state = path_of(model)
    mask = kwargs.get("attention_mask")
    if state is None or state.padding_read or not model.training or kwargs.get("past_key_values") is not None:
        return
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return
    side = padding_side(mask)
    if side is None:
        return
    state.learned(padding_read=True)
    if side == "left":
        state.keep(f"{state.reason}; {LEFT_PADDED}", change=LEFT_PADDED)


def repad_logits(out: Any) -> torch.Tensor:
    """``[rows, width, vocab]`` logits of the original batch (zeros at padding), scattered back once; a view, no
    copy, where neither the batch nor the model's layout has padding (a packed row, full rows).

    Args:
        out: an output of :func:`forward_documents` (or of any forward: its logits as they are).

    Returns:
        The logits, ``[rows, width, vocab]``; also kept as ``out.logits``.

    Example::

        >>> repad_logits(forward_documents(model, batch)).shape   # two rows of 64, a vocabulary of 64
        torch.Size([2, 64, 64])
    """
    packed = getattr(out, "foundry_layout", None)
    if packed is None:
        return out.logits
    out.logits = placed_back(out.logits, packed)
    out.foundry_layout = None
    return out.logits


def has_layout(batch: Mapping) -> bool:
    """A batch to lay out ourselves: ours (``doc_lens``), or any with a 2-D mask (either padding side).

    Args:
        batch: a training or evaluation batch.

    Returns:
        Whether :func:`prepare_documents` lays it out (False for ICL and generation batches, with ``mode``).

    Example::

        >>> has_layout({"input_ids": ids, "doc_lens": [[20, 30], [40]]})
        True
        >>> has_layout({"input_ids": ids, "mode": "icl_task"})     # LLM-Foundry's ICL evaluation
        False
    """
    if batch.get("mode") is not None:  # ICL / generation batches keep the stock path
        return False
    if "doc_lens" in batch:  # only the key: under compile, reading the list would guard on its length
        return True
    mask = batch.get("attention_mask")
    return isinstance(mask, torch.Tensor) and mask.dim() == 2
