"""What a proof's outcome does to the path: kept, the flat row on stock's packed mask, one document per row, or
refused. The path asks the proof (:mod:`foundry_attn.proof`) and acts on its answer here.

    prove_at_attach(state, hf_model)                         # on synthetic documents, the path's own proof
    prove(state, hf_model, inputs, "attach")                 # the flat row, at attach or on a batch
    prove_rows(state, hf_model, inputs, "attach")            # one document per row (right-, else left-padded)
    prove_plan(state, hf_model, plan, row)                   # the proof a batch's plan calls for: the plan after
    subject_of(hf_model)                                     # the model as the proof runs it (its one door)

Core module: torch and transformers only.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

import torch

from foundry_attn.attention.backends import BACKENDS, EAGER, SDPA
from foundry_attn.attention.documents import DOCS_KEY, Documents
from foundry_attn.flat.implementation import running, use
from foundry_attn.flat.inputs import flat_inputs, stock_splits_packed_rows
from foundry_attn.flat.layout import Layout, Truth
from foundry_attn.flat.layout_cost import FLAT, ROWS
from foundry_attn.flat.model_forward import own_forward
from foundry_attn.path.plan import Plan, replan
from foundry_attn.path.state import FlatPathError, NoExactPath, PathState
from foundry_attn.proof.prove import prove_flat, prove_packed
from foundry_attn.proof.prove import prove_rows as rows_proof
from foundry_attn.proof.proving import hidden
from foundry_attn.proof.result import Proof
from foundry_attn.proof.runs import alone_inputs, evaluating, loss_shifts, run
from foundry_attn.proof.sides import rows_train_error
from foundry_attn.proof.step_proof import StepProof
from foundry_attn.proof.subject import Subject
from foundry_attn.proof.synthetic import proof_documents

log = logging.getLogger(__name__)


def subject_of(hf: Any) -> Subject:
    """The model as the proof runs it: its own forward (not what attach set on the instance) and the stock
    implementation a block runs under, both the path's to give.

    Args:
        hf: the transformers model (:func:`~foundry_attn.flat.unwrap.unwrapped`).

    Returns:
        The :class:`~foundry_attn.proof.subject.Subject` the proof's functions take.

    Example::

        >>> prove_flat(subject_of(hf_model), inputs, "sdpa").ok
        True
    """
    return Subject(hf, functools.partial(own_forward, hf), functools.partial(running, hf))


def prove_at_attach(state: PathState, hf: Any) -> Proof:
    """The proof at attach: the path's proof on synthetic documents
    (:func:`~foundry_attn.proof.synthetic.proof_documents`, less what stock cannot compute alone, what they leave out
    said in the notes), and whether the model's loss trains each document's first token (``state.first_targets``:
    CPM-Ant).

    Args:
        state: the attached path's state (``path`` rows: the rows proof; else the flat one).
        hf: the transformers model, pointed at ours.

    Returns:
        The proof that stands.

    Raises:
        FlatPathError: the flat proof failed and the path is binding.
        NoExactPath: neither path is exact.

    Example::

        >>> prove_at_attach(state, hf_model).ok
        True
    """
    subject = subject_of(hf)
    docs, missed = proof_documents(hf.config, next(hf.parameters()).device)
    docs = _exercised(subject, state, docs, missed)
    state.learned(first_targets=not loss_shifts(subject, docs[0], state.rows_name))
    layout = Layout((tuple(int(d.numel()) for d in docs),), sum(int(d.numel()) for d in docs))
    inputs, _ = flat_inputs(hf, torch.cat(docs)[None], None, layout)
    if state.path == ROWS:
        return prove_rows(state, hf, inputs, "attach")
    return prove(state, hf, inputs, "attach")


def _exercised(subject: Subject, state: PathState, docs: list[torch.Tensor], missed: str) -> list[torch.Tensor]:
    """The synthetic documents attach proves on, less a 1-token one stock cannot compute alone (then no proof could
    judge); what they leave out (that document, ``missed``: a window no document passes, which the longest decides)
    is said in the notes: the first training batch that holds it is proven."""
    left_out = []
    single = [d for d in docs if d.numel() == 1]
    if single:
        try:
            with hidden(), evaluating(subject.model), subject.running(state.rows_name):
                logits = run(subject, alone_inputs(single[0][None]), [(0, 1)], grads=False).logits
            if not bool(torch.isfinite(logits).all()):
                raise ValueError("non-finite logits")
        except Exception as exc:
            docs = [d for d in docs if d.numel() > 1]
            left_out.append(f"a 1-token document (stock cannot compute one alone here: {type(exc).__name__})")
    if missed:
        left_out.append(missed)
    if left_out:
        note = f"attach did not exercise {' or '.join(left_out)}: the first training batch that holds it is proven"
        state.notes.append(note)
        log.info("foundry_attn: %s %s", type(subject.model).__name__, note)
    return docs


def prove(
    state: PathState, hf: Any, inputs: Mapping[str, Any], at: str, *, grads: bool = True, truth: Truth | None = None
) -> Proof:
    """Prove the flat path on ``inputs`` (:func:`foundry_attn.flat.inputs.flat_inputs`); a failure moves to rows
    (or raises, binding).

    Args:
        state: the path's state.
        hf: the transformers model (:func:`~foundry_attn.flat.unwrap.unwrapped`).
        inputs: the flat row's inputs, the documents under ``DOCS_KEY``.
        at: where the proof runs, for the reason (``"attach"``, ``"batch 1 (the first training batch)"``).
        grads: compare gradients too (False: forward only, the interval's proof).
        truth: the documents' positions and labels, read from the batch (None: the model's own).

    Returns:
        The :class:`~foundry_attn.proof.result.Proof` that stands (stock's packed mask's where it took over).

    Raises:
        FlatPathError: the proof failed and the path is binding (``attn_path: flat``, strict).
        NoExactPath: the proof failed and the rows path is not exact either.

    Example::

        >>> prove(state, hf_model, inputs, "attach").describe()     # inputs: a flat row of 90 tokens
        'passed in ... ms (documents [20, 40] of a 90-token row, worst |diff| ..., gradients ...)'
    """
    use(hf, state.flat_name)
    side = prove_packed if state.stock_mask else prove_flat
    stock = BACKENDS[state.backend].truth
    proof = side(subject_of(hf), inputs, stock, reference=state.reference, grads=grads, truth=truth)
    return keep_proof(state, hf, inputs, at, proof, grads, truth)


def keep_proof(
    state: PathState,
    hf: Any,
    inputs: Mapping[str, Any],
    at: str,
    proof: Proof,
    grads: bool,
    truth: Truth | None,
) -> Proof:
    """Keep ``proof`` of the flat path: proven lengths and code, or rows from now on (proven there too).

    Args:
        state: the path's state.
        hf: the transformers model.
        inputs: the flat row's inputs the proof ran.
        at: where the proof ran, for the reason.
        proof: the flat proof's result.
        grads: it compared gradients.
        truth: the documents' positions and labels, read from the batch (None: the model's own).

    Returns:
        ``proof``, or the proof of stock's packed mask where that holds in its place.

    Example::

        >>> proof = prove_flat(subject_of(hf_model), inputs, "sdpa")     # inputs: a flat row of 90 tokens
        >>> keep_proof(state, hf_model, inputs, "batch 1 (the first training batch)", proof, True, None).ok
        True
        >>> state.reason
        'proven at batch 1 (the first training batch): passed in ... ms (documents [20, 40] of a 90-token row, ...)'
    """
    state.proofs.append((at, proof))
    state.schedule.watch(hf, state.names)
    if _unjudged(state, hf, at, proof):
        return proof
    if not proof.ok and (packed := _stock_mask_holds(state, hf, inputs, at, proof, grads, truth)):
        return packed
    if not proof.ok:
        refuse(state, hf, f"proof at {at} {proof.describe()}", check="proof")
        prove_rows(state, hf, inputs, at, grads=grads, truth=truth)
        return proof
    state.schedule.cover(inputs[DOCS_KEY])
    if state.path == FLAT:
        mask = f"stock's packed mask ({state.rows_name}) " if state.stock_mask else ""
        state.keep(f"{mask}proven at {at}: {proof.describe()}")
    return proof


def refuse(state: PathState, hf: Any, reason: str, check: str = "proof") -> None:
    """Flat is refused for this model: rows from now on, one warning; binding: the error.

    Args:
        state: the path's state.
        hf: the transformers model (its config is pointed at ``state.rows_name``).
        reason: why, kept as ``state.reason`` and in ``state.changes``.
        check: the failed check, named in the binding error.

    Raises:
        FlatPathError: the path is binding (``attn_path: flat``, strict).

    Example::

        >>> refuse(state, hf_model, "proof at attach failed (documents [28, 13] of a 42-token row): ...")
        >>> state.path
        'rows'
    """
    if state.binding:
        keys = state.surface
        raise FlatPathError(
            f"the flat path ({keys.setting('path', 'flat')}) cannot run {type(hf).__name__} with {state.backend}: "
            f"check '{check}' failed: {reason}. Fix: {keys.fix('path', 'auto')} (one document per row where flat is "
            "not exact)"
        )
    state.to_rows(reason)
    use(hf, state.rows_name)
    log.warning("foundry_attn: %s runs one document per row (%s): %s", type(hf).__name__, state.rows_name, reason)


def _stock_mask_holds(
    state: PathState,
    hf: Any,
    inputs: Mapping[str, Any],
    at: str,
    failed: Proof,
    grads: bool,
    truth: Truth | None,
) -> Proof | None:
    """Where our flat row cannot run (the documents never reach attention: GPT-J's own attention code, a layer
    that drops ``**kwargs``; an argument or a mask content we cannot honour: ``indices``, sinks, Doge's bias),
    the flat row with stock's own packed mask (transformers 5.x splits a packed row at restarting
    ``position_ids``), proven the same way; the run stays flat on it (no padding), or None. Where ours ran and
    computed something else, the run goes to rows as before."""
    if (
        failed.ran
        or not failed.judged
        or state.stock_mask
        or state.backend not in (SDPA, EAGER)
        or not stock_splits_packed_rows()
    ):
        return None  # ours ran and computed otherwise (a leak, a window only the mask knows): rows
    proof = prove_packed(subject_of(hf), inputs, state.rows_name, reference=state.reference, grads=grads, truth=truth)
    state.proofs.append((f"stock's packed mask at {at}", proof))
    if not proof.ok:
        return None
    state.to_stock_mask(
        f"stock's packed mask ({state.rows_name}) proven at {at}: {proof.describe()} (ours: {failed.reason})"
    )
    use(hf, state.rows_name)
    state.schedule.cover(inputs[DOCS_KEY])
    state.schedule.watch(hf, state.names)
    log.info("foundry_attn: %s runs its flat rows on %s", type(hf).__name__, state.reason)
    _rows_candidate(state, hf, inputs, at, grads, truth)
    return proof


def _rows_candidate(
    state: PathState,
    hf: Any,
    inputs: Mapping[str, Any],
    at: str,
    grads: bool,
    truth: Truth | None,
    groups: tuple[tuple[int, ...], ...] = (),
) -> bool:
    """Prove one document per row as a second exact layout beside the flat row on stock's packed mask (whose
    attention scores the whole row): the cheaper of the two runs each batch. A failure leaves the flat row."""
    try:
        proof = prove_rows(state, hf, inputs, at, grads=grads, truth=truth, groups=groups)
    except NoExactPath as exc:
        proof = Proof(False, reason=str(exc), rows=True)
    state.learned(rows_proven=proof.ok)
    if not proof.ok:
        _note(state, hf, f"rows at {at} not a candidate beside the flat row: {proof.describe()}")
    return proof.ok


def prove_rows(
    state: PathState,
    hf: Any,
    inputs: Mapping[str, Any],
    at: str,
    *,
    grads: bool = True,
    truth: Truth | None = None,
    groups: tuple[tuple[int, ...], ...] = (),
) -> Proof:
    """Prove the rows path on the documents of ``inputs`` (:func:`foundry_attn.proof.prove.prove_rows`):
    right-padded rows, and where they differ from each document alone, left-padded ones (the run pads on the
    left from then on). Where neither is exact the model is refused (never trained off its documents alone):
    :class:`~foundry_attn.path.state.NoExactPath` with each path's cause.

    Args:
        state: the path's state.
        hf: the transformers model (:func:`~foundry_attn.flat.unwrap.unwrapped`).
        inputs: the flat row's inputs, whose documents are laid out one per row.
        at: where the proof runs, for the reason.
        grads: compare gradients too (False: forward only).
        truth: the documents' positions and labels, read from the batch (None: the model's own).
        groups: the documents of each forward where the batch's rows run in several by width (each compared
            document is laid out as wide as its forward's rows).

    Returns:
        The rows proof (the left-padded one where that is the exact one).

    Raises:
        NoExactPath: neither right- nor left-padded rows train as each document alone.

    Example::

        >>> prove_rows(state, hf_model, inputs, "attach").ok
        True
    """
    stock = BACKENDS[state.backend].truth
    proof_of = functools.partial(
        rows_proof, subject_of(hf), inputs, state.rows_name, stock, reference=state.reference, grads=grads, truth=truth
    )
    proof = proof_of(left=state.rows_left, groups=groups)
    state.proofs.append((f"rows at {at}", proof))
    if _unjudged(state, hf, f"rows at {at}", proof):
        return proof
    if not proof.ok and not state.rows_left and proof.ran:  # the rows ran and differ: the other side may not
        left = proof_of(left=True, groups=groups)
        state.proofs.append((f"rows left-padded at {at}", left))
        if left.ok:
            state.learned(rows_left=True)
            right = f"rows at {at}: right-padded rows {proof.describe()}"
            _note(state, hf, f"{right}; left-padded rows are exact: rows pad left")
            proof = left
    docs: Documents = inputs[DOCS_KEY]
    if proof.ok:
        state.schedule.cover(docs, rows=state.path == FLAT)
        state.keep(state.reason.split("; rows proven at ")[0] + f"; rows proven at {at}: {proof.describe()}")
        return proof
    if not proof.ran and not rows_train_error(
        subject_of(hf), inputs, state.rows_name, state.reference, state.rows_left
    ):
        # the proof's own forwards cannot run (Reformer: no backward in eval mode) but training does: rows, as
        # stock's padded batches, kept in the notes: unproven, never silent
        _note(state, hf, f"rows at {at} not proven: {proof.describe()}; one document per row trains here")
        return proof
    flat = "" if state.path == ROWS and state.reason.startswith("attn_path: rows") else f"flat: {state.reason}; "
    sides = "right- and left-padded" if proof.ran else "it does not run here"
    raise NoExactPath(
        f"foundry_attn: neither path trains {type(hf).__name__} with {state.backend} as each document alone: "
        f"{flat}one document per row ({sides}): {proof.describe()}. Fix: {state.surface.fix('backend', 'auto')} (the "
        "fastest backend that runs here), another backend, or train without packing"
    )


def _unjudged(state: PathState, hf: Any, at: str, proof: Proof) -> bool:
    """A proof that judged nothing (stock could not compute a document alone: a nan, an error) after one of the
    same path that did: the run keeps the decision of the last proof that judged, and says so. At attach, or
    with no such proof, False: nothing stands, so the proof's failure is the reason."""
    if proof.ok or proof.judged:
        return False
    earlier = [p for _, p in state.proofs[:-1] if p.ok and p.judged and p.rows == proof.rows]
    if not earlier:
        return False
    label = at if proof.rows else f"proof at {at}"
    note = f"{label} judged nothing: {proof.reason}; the decision of the last proof that judged stands"
    state.notes.append(note)
    log.warning("foundry_attn: %s %s", type(hf).__name__, note)
    return True


def _note(state: PathState, hf: Any, note: str) -> None:
    """What the rows path does that the reason does not say, kept in the notes; the first said as a warning."""
    said = any(n.startswith("rows at ") for n in state.notes)
    state.notes.append(note)
    (log.info if said else log.warning)("foundry_attn: %s %s", type(hf).__name__, note)


def prove_plan(state: PathState, hf: Any, plan: Plan, row: Mapping[str, Any] | None) -> tuple[Plan, StepProof | None]:
    """The proof ``plan`` calls for (``plan.at``), on the flat ``row`` the batch trains on (or, where it runs rows,
    on a flat row of its documents, which the rows proof lays out one per row): in the batch's own forward
    (``plan.in_step``: the :class:`~foundry_attn.proof.step_proof.StepProof` to run it in), else now. Returns the plan
    the batch runs: ``plan`` where the proof holds, else the batch where the proof moved the run
    (:func:`~foundry_attn.path.plan.replan`).

    Args:
        state: the path's state.
        hf: the transformers model.
        plan: this batch's :class:`~foundry_attn.path.plan.Plan`, with a proof due.
        row: the batch's flat row with its documents (:func:`foundry_attn.flat.inputs.build`), None where it runs rows.

    Returns:
        The plan the batch runs, and the step proof to run its forward in (None where the proof ran now).

    Example::

        >>> from foundry_attn.flat.inputs import build
        >>> from foundry_attn.path.plan import plan_batch
        >>> _ = hf_model.train()
        >>> plan = plan_batch(hf_model, batch)                      # the first training batch: a proof due
        >>> settled, step = prove_plan(state, hf_model, plan, build(hf_model, plan).row)
        >>> settled is plan, step
        (True, None)
    """
    assert plan.at is not None
    truth = Truth.of(plan.layout, plan.labels)
    flat = row if row is not None else flat_inputs(hf, plan.ids, plan.labels, plan.layout)[0]
    if plan.in_step:
        keep, again = functools.partial(keep_proof, state), functools.partial(prove, state)
        return plan, StepProof(state, keep, again, subject_of(hf), flat, plan.at, plan.grads, truth)
    before, path = (state.path, state.stock_mask, state.rows_left), None
    if plan.path == FLAT:
        prove(state, hf, flat, plan.at, grads=plan.grads, truth=truth)
    elif state.path == FLAT:  # one document per row as the cheaper candidate: a failure leaves the flat row
        runs = _rows_candidate(state, hf, flat, plan.at, plan.grads, truth, plan.groups)
        state.schedule.watch(hf, state.names)
        if not runs:
            state.choice.layout, state.choice.reason = FLAT, f"one document per row failed its proof at {plan.at}"
        path = ROWS if runs else FLAT  # the layout the batch runs, beside the run's path
    else:
        prove_rows(state, hf, flat, plan.at, grads=plan.grads, truth=truth, groups=plan.groups)
        state.schedule.watch(hf, state.names)
    if (state.path, state.stock_mask, state.rows_left) == before and path in (None, plan.path):
        return plan, None
    return replan(hf, plan, path), None
