"""The proof that a packed row trains as its documents alone: the flat row **that trains** against **stock** on
each document alone, in its logits and in its gradients.

    inputs, _ = flat_inputs(hf_model, ids, None, layout)                # the forward's own flat row
    proof = prove_flat(subject_of(hf_model), inputs, stock="sdpa", compare=(0, 2))
    proof.ok, proof.worst, proof.reason

The packed side is the flat row the forward built for the batch (its full length, its ``position_ids``, every row
of the batch flattened into one), so the proof runs the layout that trains. The truth is the model's own forward
on one document, with its own (stock) backend and none of our arguments. Anything the flat path drops (attention
sinks, a position bias, a window that lives only in the mask, state an SSM layer carries from one document to the
next, position ids counted from ``padding_idx``) shows up as a difference, the first document included.

With ``grads`` the proof also compares the gradient of each compared document's next-token loss with respect to the
input embeddings (packed slice against the document alone), and checks that no other document's embeddings
receive any of it: an attention whose forward is right and whose backward is wrong is caught too.

The comparison and its limits (fp32 max |diff|; half precision per token, raised to stock's own noise) are
:mod:`foundry_attn.proof.comparison`'s, shared with the inspector's verdict. Eval mode, no global RNG: it changes
nothing the training run sees. Where training mode computes what eval mode does, a proof due on a training batch takes
the batch's own forward as its packed side (:func:`prove_step`): the flat row runs once. Core module: torch and
transformers only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from foundry_attn.attention.documents import DOCS_KEY, Documents
from foundry_attn.attention.fa2_reference import kernel_context
from foundry_attn.flat.layout import Truth
from foundry_attn.flat.packing import IGNORE_INDEX
from foundry_attn.proof.comparison import influence, params_differ, summed
from foundry_attn.proof.proving import hidden
from foundry_attn.proof.result import NO_CALLS, NotRun, Proof, StockFailed
from foundry_attn.proof.runs import (
    HeadCall,
    Run,
    alone_inputs,
    documents_grad,
    evaluating,
    flat_tokens,
    run,
    state_kept,
    token_embeddings,
    trainable,
)
from foundry_attn.proof.sides import (
    PackedSide,
    dropped_in_training,
    flat_side,
    row_labels,
    rows_side,
    short_error,
    stock_packed_run,
)
from foundry_attn.proof.subject import Subject
from foundry_attn.proof.tolerance import against_alone, limits_for, limits_note, undefined_values, worse


def pick(docs: Documents, real: Sequence[int] | None = None) -> tuple[int, int]:
    """The two documents of a flat row to run alone: the longest (the length a kernel picks its code path by,
    past a window where any document is) and the last of two tokens or more (the most exposed to what precedes it,
    with targets: a 1-token document has no next-token loss); where that is the longest, the shortest other of two
    tokens or more (another place in the row, at the least cost). A row of one document runs it twice: always two
    forwards alone, so FSDP ranks proving the same batch all-gather the same number of times.

    Args:
        docs: the flat row's :class:`~foundry_attn.attention.documents.Documents`.
        real: the documents to choose among (:func:`real_documents`: padding is none); None or empty: every one.

    Returns:
        The two documents' indices in the row (``(0, 0)`` for a row of one).

    Example::

        >>> pick(Documents((0, 13, 42, 60)))     # lengths [13, 29, 18]: the longest and the last
        (1, 2)
    """
    lengths = docs.lengths
    real = list(real or range(len(lengths)))
    if len(real) == 1:
        return real[0], real[0]
    last = max((i for i in real if lengths[i] > 1), default=real[-1])
    longest = max(real, key=lambda i: (lengths[i], i))
    if longest != last:
        return longest, last
    rest = [i for i in real if i != last]
    others = [i for i in rest if lengths[i] > 1] or rest
    return min(others, key=lambda i: lengths[i]), last


def pick_rows(docs: Documents, real: Sequence[int] | None = None) -> tuple[int, int]:
    """The two documents a rows proof lays out one per row: the longest (no padding) and the shortest (the most
    padding, where a model that is not padding-invariant shows it); rows do not see each other, so the place in
    the row does not matter. A row of one document runs it twice, as :func:`pick`.

    Args:
        docs: the flat row's :class:`~foundry_attn.attention.documents.Documents`.
        real: the documents to choose among (:func:`real_documents`); None or empty: every one.

    Returns:
        The two documents' indices in the row.

    Example::

        >>> pick_rows(Documents((0, 13, 42, 60)))     # lengths [13, 29, 18]: the longest and the shortest
        (1, 0)
    """
    lengths = docs.lengths
    among = list(real or range(len(lengths)))
    longest = max(among, key=lambda i: (lengths[i], i))
    shortest = min(among, key=lambda i: (lengths[i], -i))
    return (longest, shortest) if shortest != longest else pick(docs, among)


def real_documents(docs: Documents, labels: torch.Tensor | None) -> list[int] | None:
    """The documents of a flat row with a target of their own (a label past their first token): a segment of
    padding (axolotl's packed rows pad each row with one) has none (one host sync).

    Args:
        docs: the flat row's :class:`~foundry_attn.attention.documents.Documents`.
        labels: the row's labels as the batch gives them (``[1, tokens]``), or None (every next token a target).

    Returns:
        Their indices, or None where ``labels`` is None.

    Example::

        >>> real_documents(Documents((0, 3, 5)), torch.tensor([[5, 6, 7, -100, -100]]))
        [0]
    """
    if labels is None:
        return None
    counted = torch.cat([labels.new_zeros(1), (labels.reshape(-1) != IGNORE_INDEX).long().cumsum(0)])
    starts = torch.tensor([min(s + 1, e) for s, e in docs.spans], device=labels.device)
    ends = torch.tensor([e for _, e in docs.spans], device=labels.device)
    targets = (counted[ends] - counted[starts]).tolist()
    return [i for i, n in enumerate(targets) if n > 0]


def prove_flat(
    subject: Subject,
    inputs: Mapping[str, Any],
    stock: str,
    compare: Sequence[int] | None = None,
    *,
    reference: bool = False,
    grads: bool = True,
    truth: Truth | None = None,
) -> Proof:
    """Run ``inputs`` (the flat row of :func:`foundry_attn.flat.inputs.flat_inputs`, with its documents) through the
    flat path (the model's current ``config._attn_implementation``, ours) and the documents in ``compare`` (default:
    :func:`pick`) alone through ``stock``; compare logits and, with ``grads``, input-embedding gradients.
    ``truth``: what each document alone is given, read from the batch (a user's positions, the batch's labels);
    never the row's own, so whatever the row that trains does otherwise is judged.

    Raises nothing the stock forward on one document does not raise; a failure of the flat forward (a layer
    that drops our argument, an argument we cannot honour, a shape the model's mask code rejects) is a failed proof.

    Args:
        subject: the model (:func:`foundry_attn.path.proven.subject_of`), pointed at our implementation.
        inputs: the flat row's forward arguments, its documents under ``DOCS_KEY``.
        stock: the stock implementation that runs each document alone (``sdpa``, ``eager``, ...).
        compare: the indices of the documents to run alone (None: :func:`pick`).
        reference: run FA2 on the pure-PyTorch reference kernel.
        grads: compare gradients too (input embeddings and every parameter that trains).
        truth: the documents' positions and labels from the batch (None: the model's own, every next token).

    Returns:
        The :class:`Proof`.

    Example::

        >>> proof = prove_flat(subject, inputs, "sdpa")     # documents [28, 13, 1]
        >>> proof.ok, proof.compared, proof.lengths
        (True, (0, 1), (28, 13))
    """
    return _prove(subject, inputs, stock, compare, reference, grads, truth, None)


def prove_packed(
    subject: Subject,
    inputs: Mapping[str, Any],
    stock: str,
    compare: Sequence[int] | None = None,
    *,
    reference: bool = False,
    grads: bool = True,
    truth: Truth | None = None,
) -> Proof:
    """The flat row with stock's own packed mask (:func:`foundry_attn.flat.inputs.stock_packed`: no documents, no
    mask, restarting ``position_ids``, under the stock implementation ``stock``) against each document alone under
    ``stock``: the limits of :func:`prove_flat`. For a model whose attention our documents cannot reach.

    Args:
        subject: the model (:func:`foundry_attn.path.proven.subject_of`).
        inputs: the flat row's forward arguments (:func:`~foundry_attn.flat.inputs.flat_inputs`).
        stock: the stock implementation, for the packed row and for each document alone.
        compare: the indices of the documents to run alone (None: :func:`pick`).
        reference: run FA2 on the pure-PyTorch reference kernel.
        grads: compare gradients too.
        truth: the documents' positions and labels from the batch (None: the model's own, every next token).

    Returns:
        The :class:`Proof`.

    Example::

        >>> from foundry_attn.flat.inputs import stock_splits_packed_rows
        >>> prove_packed(subject, inputs, "sdpa").ok == stock_splits_packed_rows()     # 5.x splits it: True; 4.51 not
        True
    """
    return _prove(
        subject,
        inputs,
        stock,
        compare,
        reference,
        grads,
        truth,
        None,
        lambda subject, spans, grads: stock_packed_run(subject, inputs, spans, grads, stock),
        ours=False,
    )


def prove_rows(
    subject: Subject,
    inputs: Mapping[str, Any],
    rows_name: str,
    stock: str,
    compare: Sequence[int] | None = None,
    *,
    reference: bool = False,
    grads: bool = True,
    truth: Truth | None = None,
    left: bool = False,
    groups: Sequence[Sequence[int]] = (),
) -> Proof:
    """The rows path as it trains (:func:`foundry_attn.flat.inputs.one_per_row`: the documents in ``compare``, one per
    row, right-padded or with ``left`` left-padded, a 2-D mask, under ``rows_name``; each as wide as the rows of its
    forward where ``groups`` splits the batch's rows by width, else as the longest document) against each document alone
    under ``stock``: logits and gradients (input embeddings and every parameter), the limits of :func:`prove_flat`.
    A failure says the model's padded rows differ from its documents alone.

    Args:
        subject: the model (:func:`foundry_attn.path.proven.subject_of`).
        inputs: the flat row's forward arguments, its documents under ``DOCS_KEY``.
        rows_name: the stock implementation the padded rows run under (``PathState.rows_name``).
        stock: the stock implementation that runs each document alone.
        compare: the indices of the documents to run (None: :func:`pick`).
        reference: run FA2 on the pure-PyTorch reference kernel.
        grads: compare gradients too.
        truth: the documents' positions and labels from the batch (None: the model's own, every next token).
        left: left-pad the rows (default: right).
        groups: the documents of each forward the batch's rows run in
            (:meth:`~foundry_attn.flat.layout_cost.LayoutChoice.forwards`; empty: one).

    Returns:
        The :class:`Proof` of the rows path.

    Example::

        >>> prove_rows(subject, inputs, "sdpa", "sdpa").describe()     # the longest and the shortest, one per row
        'passed in ... ms (documents [28, 1] of a 42-token row, worst |diff| ..., gradients ...)'
    """
    side = rows_side(inputs, rows_name, reference, truth, left, groups)
    return _prove(subject, inputs, stock, compare, reference, grads, truth, rows_name, side)


def prove_step(
    subject: Subject,
    inputs: Mapping[str, Any],
    out: Any,
    captured: Sequence[torch.Tensor],
    stock: str,
    compare: Sequence[int] | None = None,
    *,
    head: Sequence[HeadCall] = (),
    reference: bool = False,
    grads: bool = True,
    truth: Truth | None = None,
) -> Proof:
    """:func:`prove_flat` with the batch's own training forward as the packed side: ``out`` is what the model
    returned for ``inputs`` (the flat row, in training mode), ``captured`` its input embeddings
    (:func:`embeddings`) and ``head`` its output layer's calls (:func:`head_calls`). With ``grads`` the compared
    documents' loss is differentiated through the training graph (:func:`documents_grad`), which is kept for the
    training backward. Only the documents alone run here: the forward is paid once.
    Valid where training mode computes what eval mode does (:func:`foundry_attn.proof.step_proof.step_blocker`).

    Args:
        subject: the model the training forward ran (:func:`foundry_attn.path.proven.subject_of`).
        inputs: the flat row that forward took, its documents under ``DOCS_KEY``.
        out: what the forward returned (its ``logits`` are read).
        captured: its input embeddings (:func:`~foundry_attn.proof.runs.embeddings`).
        stock: the stock implementation that runs each document alone.
        compare: the indices of the documents to run alone (None: :func:`pick`).
        head: its output layer's calls (:func:`~foundry_attn.proof.runs.head_calls`).
        reference: run FA2 on the pure-PyTorch reference kernel.
        grads: compare gradients too.
        truth: the documents' positions and labels from the batch (None: the model's own, every next token).

    Returns:
        The :class:`Proof` (``ran`` False where the forward gave no logits or no attention call saw the documents).

    Example::

        >>> from foundry_attn.proof.runs import embeddings, head_calls
        >>> with embeddings(hf_model, True) as captured, head_calls(hf_model, True) as head:
        ...     out = hf_model(**inputs)
        >>> prove_step(subject_of(hf_model), inputs, out, captured, "sdpa", head=head).ok
        True
    """

    def packed(subject: Subject, spans: Sequence[tuple[int, int]], _: bool) -> tuple[Run | None, str]:
        if inputs[DOCS_KEY].calls == 0:
            return None, NO_CALLS
        logits = getattr(out, "logits", None)
        if not isinstance(logits, torch.Tensor) or logits.shape[:2] != inputs["input_ids"].shape:
            return None, "the training forward returned no logits for the flat row"
        embeds = token_embeddings(captured, inputs["input_ids"])
        if not (grads and logits.requires_grad):
            return Run(flat_tokens(logits).detach()), ""
        ids = inputs["input_ids"].reshape(-1)
        grads_ = documents_grad(
            logits,
            ids,
            spans,
            embeds,
            head,
            retain_graph=True,
            params=trainable(subject.model),
            labels=row_labels(inputs),
        )
        return Run(flat_tokens(logits).detach(), *grads_), ""

    return _prove(subject, inputs, stock, compare, reference, grads, truth, None, packed)


def _prove(
    subject: Subject,
    inputs: Mapping[str, Any],
    stock: str,
    compare: Sequence[int] | None,
    reference: bool,
    grads: bool,
    truth: Truth | None,
    rows_name: str | None,
    packed: PackedSide | None = None,
    ours: bool = True,
) -> Proof:
    start = time.perf_counter()
    docs: Documents = inputs[DOCS_KEY]
    if compare is None:
        real = real_documents(docs, truth.labels if truth is not None else None)
        compare = pick(docs, real) if rows_name is None else pick_rows(docs, real)
    compare = tuple(compare)
    if packed is None:
        packed = rows_side(inputs, rows_name, reference, truth) if rows_name is not None else flat_side(inputs)
    with hidden(), state_kept(subject.model):
        worst, worst_grad, reason = _compare(
            subject, inputs, stock, compare, reference, grads, truth, rows_name, packed, ours
        )
    lengths = tuple(docs.spans[i][1] - docs.spans[i][0] for i in compare)
    ms = (time.perf_counter() - start) * 1e3
    ran, judged = not isinstance(reason, NotRun), not isinstance(reason, StockFailed)
    tokens = docs.bounds[-1]
    return Proof(
        not reason, worst, str(reason), ms, lengths, compare, tokens, worst_grad, ran, judged, rows_name is not None
    )


def _compare(
    subject: Subject,
    inputs: Mapping[str, Any],
    stock: str,
    compare: tuple[int, ...],
    reference: bool,
    grads: bool,
    truth: Truth | None,
    rows_name: str | None,
    side: PackedSide,
    ours: bool = True,
) -> tuple[float, float | None, str]:
    """The worst logits and gradient differences, and why the flat path (with ``rows_name``: the rows path) fails
    (empty when it holds)."""
    docs: Documents = inputs[DOCS_KEY]
    ids = inputs["input_ids"].reshape(1, -1)  # a flat row, or even rows token after token
    order = list(dict.fromkeys(compare))  # a row of one document compares it once
    spans = [docs.spans[i] for i in order]

    given = truth or Truth()

    def alone(span: tuple[int, int]) -> dict[str, Any]:
        return alone_inputs(ids[:, span[0] : span[1]], given.alone(span).positions)

    def labels(span: tuple[int, int]) -> torch.Tensor | None:
        mine = given.alone(span).labels
        return None if mine is None else mine[0]

    with evaluating(subject.model, grad=grads):
        with subject.running(stock), kernel_context(stock, ids.device, reference):
            try:
                runs = [run(subject, alone(span), [(0, span[1] - span[0])], grads, labels(span)) for span in spans]
            except Exception as exc:
                return 0.0, None, StockFailed(f"stock {stock} cannot run one document alone here: {short_error(exc)}")
            undefined = undefined_values(runs, spans)
            if undefined:  # a nan is the comparison breaking, never "the model differs"
                return 0.0, None, StockFailed(f"stock {stock} cannot compute one document alone here: {undefined}")
            limits = limits_for(subject, alone(spans[-1]), runs[-1], stock)
        packed, why = side(subject, spans, grads)
    if packed is None:
        return 0.0, None, NotRun(why)
    undefined = undefined_values([packed], spans, packed=True)
    if undefined:
        side_name = "the flat path" if rows_name is None else f"one document per row ({rows_name})"
        return math.nan, None, f"{side_name} computes {undefined}, where stock {stock} on each alone is finite"
    result = against_alone(packed, spans, runs, limits)
    worst, worst_grad = result.worst, result.worst_grad
    if result.differ:
        grad_note = "" if worst_grad is None else f" (gradients {worst_grad:.2e})"
        where = "of a packed row" if rows_name is None else f"one per row ({rows_name})"
        what = (
            "the flat path does not compute what stock computes for this model"
            if rows_name is None
            else "this model's padded rows differ from its documents alone, as in stock's own padded batches"
        )
        return (
            worst,
            worst_grad,
            f"document(s) {[order[i] for i in result.differ]} {where} differ from stock {stock} on each alone by "
            f"{worst:.2e}{grad_note}{limits_note(limits)}: {what}",
        )
    alone_params = summed(runs)
    if packed.params is not None and alone_params is not None:
        worst_param, wrong = params_differ(packed.params, alone_params, limits)
        worst_grad = worse(worst_grad or 0.0, worst_param)
        if wrong:
            return worst, worst_grad, f"{wrong}: the {'flat' if rows_name is None else 'rows'} path trains otherwise"
    if rows_name is not None:
        return worst, worst_grad, ""
    if packed.grad is not None:
        reach = influence(packed.grad, spans)
        if reach.leaks:
            return (
                worst,
                worst_grad,
                f"the compared documents of the packed row: {reach.describe()}: the flat path's backward mixes "
                "documents",
            )
    return worst, worst_grad, (dropped_in_training(subject, inputs) if ours else None) or ""
