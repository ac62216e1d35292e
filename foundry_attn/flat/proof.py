"""The proof that a packed row trains as its documents alone: the flat row **that trains** against **stock** on
each document alone, in its logits and in its gradients.

    inputs, _ = flat_inputs(hf_model, ids, positions, None, layout)     # the forward's own flat row
    proof = prove_flat(hf_model, inputs, stock="sdpa", compare=(0, 2))
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
:mod:`foundry_attn.flat.comparison`'s, shared with the inspector's verdict. Eval mode, no global RNG: it changes nothing
the training run sees. Where training mode computes what eval mode does, a proof due on a training batch takes the
batch's own forward as its packed side (:func:`prove_step`): the flat row runs once. Core module: torch and
transformers only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from foundry_attn.attention.documents import DOCS_KEY, Documents, DocumentsDropped, FlatUnsupported
from foundry_attn.attention.fa2_reference import kernel_context
from foundry_attn.flat.comparison import (
    HeadCall,
    Run,
    against_alone,
    alone_inputs,
    documents_grad,
    embeddings,
    evaluating,
    flat_tokens,
    influence,
    limits_for,
    limits_note,
    loss_grads,
    params_differ,
    run,
    summed,
    token_embeddings,
    trainable,
    worse,
)
from foundry_attn.flat.implementation import running
from foundry_attn.flat.inputs import one_per_row, stock_packed
from foundry_attn.flat.layout import Layout, Truth
from foundry_attn.flat.model_forward import own_forward
from foundry_attn.flat.packing import IGNORE_INDEX
from foundry_attn.flat.proving import hidden
from foundry_attn.flat.unwrap import unwrapped


@dataclasses.dataclass(frozen=True)
class Proof:
    """One proof: ``ok`` with the worst differences, or the reason it failed (and which documents)."""

    ok: bool
    worst: float = 0.0  # logits
    reason: str = ""
    ms: float = 0.0
    lengths: tuple[int, ...] = ()  # the documents compared, alone
    compared: tuple[int, ...] = ()  # their indices in the flat row
    tokens: int = 0  # the flat row's length
    worst_grad: float | None = None  # gradients (None: forward only)
    ran: bool = True  # both sides ran (False: the reason is that one could not)
    judged: bool = True  # stock computed each document alone (False: nothing was judged, the reason says why)
    rows: bool = False  # a proof of one document per row (else of the flat row)

    def describe(self) -> str:
        """The proof in words, for the state's reason or a refusal.

        Returns:
            ``passed in ... ms (...)`` with the worst differences, or ``failed (...): <reason>``.

        Example::

            >>> proof.describe()
            'passed in 591 ms (documents [28, 13] of a 41-token row, worst |diff| 0.0e+00, gradients 1.3e-07)'
        """
        grads = "" if self.worst_grad is None else f", gradients {self.worst_grad:.1e}"
        docs = f"documents {list(self.lengths)} of a {self.tokens}-token row"
        if self.ok:
            return f"passed in {self.ms:.0f} ms ({docs}, worst |diff| {self.worst:.1e}{grads})"
        return f"failed ({docs}): {self.reason}"


def pick(docs: Documents) -> tuple[int, int]:
    """The two documents of a flat row to run alone: the longest (the length a kernel picks its code path by,
    past a window where any document is) and the last of two tokens or more (the most exposed to what precedes it,
    with targets: a 1-token document has no next-token loss); where that is the longest, the shortest other of two
    tokens or more (another place in the row, at the least cost). A row of one document runs it twice: always two
    forwards alone, so FSDP ranks proving the same batch all-gather the same number of times.

    Args:
        docs: the flat row's :class:`~foundry_attn.attention.documents.Documents`.

    Returns:
        The two documents' indices in the row (``(0, 0)`` for a row of one).

    Example::

        >>> pick(Documents((0, 13, 42, 60)))     # lengths [13, 29, 18]: the longest and the last
        (1, 2)
    """
    lengths = docs.lengths
    if len(lengths) == 1:
        return 0, 0
    last = max((i for i, n in enumerate(lengths) if n > 1), default=len(lengths) - 1)
    longest = max(range(len(lengths)), key=lambda i: (lengths[i], i))
    if longest != last:
        return longest, last
    rest = [i for i in range(len(lengths)) if i != last]
    others = [i for i in rest if lengths[i] > 1] or rest
    return min(others, key=lambda i: lengths[i]), last


def pick_rows(docs: Documents) -> tuple[int, int]:
    """The two documents a rows proof lays out one per row: the longest (no padding) and the shortest (the most
    padding, where a model that is not padding-invariant shows it); rows do not see each other, so the place in
    the row does not matter. A row of one document runs it twice, as :func:`pick`.

    Args:
        docs: the flat row's :class:`~foundry_attn.attention.documents.Documents`.

    Returns:
        The two documents' indices in the row.

    Example::

        >>> pick_rows(Documents((0, 13, 42, 60)))     # lengths [13, 29, 18]: the longest and the shortest
        (1, 0)
    """
    lengths = docs.lengths
    longest = max(range(len(lengths)), key=lambda i: (lengths[i], i))
    shortest = min(range(len(lengths)), key=lambda i: (lengths[i], -i))
    return (longest, shortest) if shortest != longest else pick(docs)


#: the packed side of a proof: (model, the compared documents' spans, grads) -> its run, or None and why not
PackedSide = Callable[[Any, Sequence[tuple[int, int]], bool], tuple["Run | None", str]]


def prove_flat(
    model: Any,
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
        model: the transformers model, or a wrapper of one, pointed at our implementation.
        inputs: the flat row's forward arguments, its documents under ``DOCS_KEY``.
        stock: the stock implementation that runs each document alone (``sdpa``, ``eager``, ...).
        compare: the indices of the documents to run alone (None: :func:`pick`).
        reference: run FA2 on the pure-PyTorch reference kernel.
        grads: compare gradients too (input embeddings and every parameter that trains).
        truth: the documents' positions and labels from the batch (None: the model's own, every next token).

    Returns:
        The :class:`Proof`.

    Example::

        >>> proof = prove_flat(hf_model, inputs, "sdpa")
        >>> proof.ok, proof.worst, proof.compared
        (True, 0.0, (0, 1))
    """
    return _prove(model, inputs, stock, compare, reference, grads, truth, None)


def prove_packed(
    model: Any,
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
        model: the transformers model, or a wrapper of one.
        inputs: the flat row's forward arguments (:func:`~foundry_attn.flat.inputs.flat_inputs`).
        stock: the stock implementation, for the packed row and for each document alone.
        compare: the indices of the documents to run alone (None: :func:`pick`).
        reference: run FA2 on the pure-PyTorch reference kernel.
        grads: compare gradients too.
        truth: the documents' positions and labels from the batch (None: the model's own, every next token).

    Returns:
        The :class:`Proof`.

    Example::

        >>> prove_packed(hf_model, inputs, "sdpa").ok     # transformers 5.x: stock splits the row at its positions
        True
    """
    side: PackedSide = lambda hf, spans, grads: _stock_packed_run(hf, inputs, spans, grads, stock)  # noqa: E731
    return _prove(model, inputs, stock, compare, reference, grads, truth, None, side, ours=False)


def prove_rows(
    model: Any,
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
        model: the transformers model, or a wrapper of one.
        inputs: the flat row's forward arguments, its documents under ``DOCS_KEY``.
        rows_name: the stock implementation the padded rows run under (``PathState.rows_name``).
        stock: the stock implementation that runs each document alone.
        compare: the indices of the documents to run (None: :func:`pick`).
        reference: run FA2 on the pure-PyTorch reference kernel.
        grads: compare gradients too.
        truth: the documents' positions and labels from the batch (None: the model's own, every next token).
        left: left-pad the rows (default: right).
        groups: the documents of each forward the batch's rows run in (:meth:`PathState.forwards`; empty: one).

    Returns:
        The :class:`Proof` of the rows path.

    Example::

        >>> prove_rows(hf_model, inputs, "sdpa", "sdpa").describe()
        'passed in 167 ms (documents [28, 13] of a 41-token row, worst |diff| 4.5e-08, gradients 1.9e-07)'
    """
    side = _rows_side(inputs, rows_name, reference, truth, left, groups)
    return _prove(model, inputs, stock, compare, reference, grads, truth, rows_name, side)


def prove_step(
    model: Any,
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
    Valid where training mode computes what eval mode does (:func:`foundry_attn.flat.step_proof.step_blocker`).

    Args:
        model: the model the training forward ran, or a wrapper of one.
        inputs: the flat row that forward took, its documents under ``DOCS_KEY``.
        out: what the forward returned (its ``logits`` are read).
        captured: its input embeddings (:func:`~foundry_attn.flat.comparison.embeddings`).
        stock: the stock implementation that runs each document alone.
        compare: the indices of the documents to run alone (None: :func:`pick`).
        head: its output layer's calls (:func:`~foundry_attn.flat.comparison.head_calls`).
        reference: run FA2 on the pure-PyTorch reference kernel.
        grads: compare gradients too.
        truth: the documents' positions and labels from the batch (None: the model's own, every next token).

    Returns:
        The :class:`Proof` (``ran`` False where the forward gave no logits or no attention call saw the documents).

    Example::

        >>> with embeddings(hf_model, True) as captured, head_calls(hf_model, True) as head:
        ...     out = hf_model(**inputs)
        >>> prove_step(hf_model, inputs, out, captured, "sdpa", head=head).ok
        True
    """

    def packed(hf: Any, spans: Sequence[tuple[int, int]], _: bool) -> tuple[Run | None, str]:
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
            logits, ids, spans, embeds, head, retain_graph=True, params=trainable(hf), labels=row_labels(inputs)
        )
        return Run(flat_tokens(logits).detach(), *grads_), ""

    return _prove(model, inputs, stock, compare, reference, grads, truth, None, packed)


NO_CALLS = "no attention call received the documents: this model's attention bypasses transformers' interface"


def _prove(
    model: Any,
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
    hf = getattr(unwrapped(model), "_orig_mod", unwrapped(model))  # the eager module under torch.compile
    docs: Documents = inputs[DOCS_KEY]
    compare = (pick(docs) if rows_name is None else pick_rows(docs)) if compare is None else tuple(compare)
    if packed is None:
        packed = _flat_side(inputs) if rows_name is None else _rows_side(inputs, rows_name, reference, truth)
    with hidden(), _state_kept(hf):
        worst, worst_grad, reason = _compare(
            hf, inputs, stock, compare, reference, grads, truth, rows_name, packed, ours
        )
    lengths = tuple(docs.spans[i][1] - docs.spans[i][0] for i in compare)
    ms = (time.perf_counter() - start) * 1e3
    ran, judged = not isinstance(reason, _NotRun), not isinstance(reason, _StockFailed)
    tokens = docs.bounds[-1]
    return Proof(
        not reason, worst, str(reason), ms, lengths, compare, tokens, worst_grad, ran, judged, rows_name is not None
    )


@contextlib.contextmanager
def _state_kept(hf: Any) -> Iterator[None]:
    """The tensors modules keep as plain attributes (RecurrentGemma's recurrent and conv state, a layer's cached
    rotary table) as they were before the proof: its forwards leave nothing the training forwards read (a state
    left with the proof's freed graph would fail the next backward)."""
    kept = [(m, {k: v for k, v in vars(m).items() if isinstance(v, torch.Tensor) or v is None}) for m in hf.modules()]
    try:
        yield
    finally:
        for module, before in kept:
            for key in [k for k, v in vars(module).items() if isinstance(v, torch.Tensor) and k not in before]:
                delattr(module, key)
            for key, value in before.items():
                if vars(module).get(key, value) is not value:
                    setattr(module, key, value)


class _NotRun(str):
    """A proof's reason that says one side could not run at all (``Proof.ran`` is False)."""


class _StockFailed(_NotRun):
    """A proof's reason that says stock could not compute a document alone: nothing was judged
    (``Proof.judged`` is False), so the run keeps the decision of the last proof that could judge."""


def undefined_values(runs: Sequence[Run], spans: Sequence[tuple[int, int]], packed: bool = False) -> str:
    """Where runs are not finite (a fully masked score row, a softmax over nothing), in words; "" where they are.

    Args:
        runs: one run per span, or with ``packed`` one run of the whole row.
        spans: the documents' ``(start, end)`` in the row.
        packed: read the one run at each span (else each run whole).

    Returns:
        Each document with non-finite logits or gradients, and at how many tokens; "" where every value is finite.

    Example::

        >>> undefined_values([Run(logits)], [(0, 3), (3, 5)], packed=True)     # a nan at token 3
        'document of 2 tokens: nan or inf logits at 1 of its 2 tokens'
    """
    bad = []
    for i, (s, e) in enumerate(spans):
        mine = runs[0] if packed else runs[i]
        logits = mine.logits[s:e] if packed else mine.logits
        tokens = int((~torch.isfinite(logits.float())).any(-1).sum())
        grads = mine.grad is not None and not bool(torch.isfinite(mine.grad[s:e] if packed else mine.grad).all())
        if tokens or grads:
            what = f"nan or inf logits at {tokens} of its {e - s} tokens" if tokens else "nan or inf gradients"
            bad.append(f"document of {e - s} tokens: {what}")
    return "; ".join(bad)


def _compare(
    hf: Any,
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

    with evaluating(hf, grad=grads):
        with running(hf, stock), kernel_context(stock, ids.device, reference):
            try:
                runs = [run(hf, alone(span), [(0, span[1] - span[0])], grads, labels(span)) for span in spans]
            except Exception as exc:
                return 0.0, None, _StockFailed(f"stock {stock} cannot run one document alone here: {_short(exc)}")
            undefined = undefined_values(runs, spans)
            if undefined:  # a nan is the comparison breaking, never "the model differs"
                return 0.0, None, _StockFailed(f"stock {stock} cannot compute one document alone here: {undefined}")
            limits = limits_for(hf, alone(spans[-1]), runs[-1], stock)
        packed, why = side(hf, spans, grads)
    if packed is None:
        return 0.0, None, _NotRun(why)
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
    return worst, worst_grad, (_dropped_in_training(hf, inputs) if ours else None) or ""


def _dropped_in_training(hf: Any, inputs: Mapping[str, Any]) -> str | None:
    """Under HF gradient checkpointing some layers call attention without ``**kwargs`` (GPT-NeoX in 4.51), which
    the eval-mode proof never sees: one flat forward in training mode, without grad (an exception inside a
    non-reentrant checkpoint with grad would leave its hooks behind), the RNG restored after its dropout."""
    if not getattr(hf, "is_gradient_checkpointing", False):
        return None
    device = inputs["input_ids"].device
    was_training = hf.training
    hf.train()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            _, why = _flat_run(hf, inputs, [], False)
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

        >>> passes_kwargs(gpt2_model), passes_kwargs(llama_model)
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

        >>> row_labels(flat_inputs(hf, ids, positions, labels, layout)[0]).shape      # 47 + 17 real tokens
        torch.Size([64])
    """
    labels = inputs.get("labels")
    return None if labels is None else labels.reshape(-1)


def _flat_run(
    hf: Any, inputs: Mapping[str, Any], spans: Sequence[tuple[int, int]], grads: bool
) -> tuple[Run | None, str]:
    """The flat path's run of ``inputs``, or None and why it cannot run. The documents object is a fresh copy, so
    its call count is this forward's alone."""
    if not passes_kwargs(hf):
        base = type(getattr(hf, "base_model", hf)).__name__
        return None, f"{base}.forward takes no **kwargs: the documents cannot reach attention"
    docs: Documents = inputs[DOCS_KEY]
    fresh = Documents(docs.bounds, docs.device_bounds, docs.host_bounds)
    try:
        flat = run(hf, {**inputs, DOCS_KEY: fresh, "labels": None}, spans, grads, row_labels(inputs))
    except DocumentsDropped as exc:
        caller = next((type(m).__name__ for m in hf.modules() if any(c is exc.module for c in m.children())), "?")
        checkpointing = (
            "; HF gradient checkpointing calls the layers without **kwargs: use Composer's activation_checkpointing "
            "(checkpoint_wrapper) to keep the flat path"
            if getattr(hf, "is_gradient_checkpointing", False) and hf.training
            else ""
        )
        return None, f"{exc}; the caller is {caller}{checkpointing}"
    except FlatUnsupported as exc:
        return None, str(exc)
    except Exception as exc:
        return None, f"the flat row does not run: {_short(exc)}"
    if fresh.calls == 0:
        return None, NO_CALLS
    return flat, ""


def rows_train_error(hf: Any, inputs: Mapping[str, Any], rows_name: str, reference: bool, left: bool = False) -> str:
    """Why one document per row (as :func:`prove_rows` lays it out) does not run a training forward here, or "" when it
    runs: for a rows proof whose own forwards could not run (Reformer refuses a backward in eval mode; a backend
    whose kernel is missing fails anywhere). Without grad, the RNG and the mode restored after.

    Args:
        hf: the transformers model.
        inputs: the flat row's forward arguments (its first two documents run).
        rows_name: the stock implementation the padded rows run under.
        reference: run FA2 on the pure-PyTorch reference kernel.
        left: left-pad the rows (default: right).

    Returns:
        The error, or "" where the training forward runs.

    Example::

        >>> rows_train_error(hf_model, inputs, "sdpa", reference=False)
        ''
    """
    docs: Documents = inputs[DOCS_KEY]
    device = inputs["input_ids"].device
    was_training = hf.training
    hf.train()
    try:
        with (
            hidden(),
            _state_kept(hf),
            torch.no_grad(),
            torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
        ):
            run_, why = _rows_run(hf, inputs, docs.spans[:2], False, rows_name, reference, None, left, docs.max_length)
    finally:
        hf.train(was_training)
    if run_ is None:
        return why
    undefined = undefined_values([run_], docs.spans[:2], packed=True)
    return f"one document per row ({rows_name}) computes {undefined}" if undefined else ""


def _stock_packed_run(
    hf: Any, inputs: Mapping[str, Any], spans: Sequence[tuple[int, int]], grads: bool, stock: str
) -> tuple[Run | None, str]:
    """Stock's own run of the flat row (its packed mask), or None and why it cannot run."""
    try:
        with running(hf, stock):
            return run(hf, {**stock_packed(inputs), "labels": None}, spans, grads, row_labels(inputs)), ""
    except Exception as exc:
        return None, f"the flat row with stock's packed mask does not run: {_short(exc)}"


def _flat_side(inputs: Mapping[str, Any]) -> PackedSide:
    return lambda hf, spans, grads: _flat_run(hf, inputs, spans, grads)


def _rows_side(
    inputs: Mapping[str, Any],
    rows_name: str,
    reference: bool,
    truth: Truth | None,
    left: bool = False,
    groups: Sequence[Sequence[int]] = (),
) -> PackedSide:
    docs: Documents = inputs[DOCS_KEY]
    spans, lengths = docs.spans, docs.lengths
    width = {spans[d]: max(lengths[m] for m in group) for group in groups for d in group}

    def side(hf: Any, spans: Sequence[tuple[int, int]], grads: bool) -> tuple[Run | None, str]:
        by_width: dict[int, list[tuple[int, int]]] = {}
        for span in spans:  # as wide as its forward's rows, or as the batch's longest document
            by_width.setdefault(width.get(span, docs.max_length), []).append(span)
        runs = []
        for wide, some in by_width.items():
            one, why = _rows_run(hf, inputs, some, grads, rows_name, reference, truth, left, wide)
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
    hf: Any,
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
        with running(hf, rows_name), kernel_context(rows_name, ids.device, reference):
            with embeddings(hf, grads) as captured:
                out = own_forward(hf, **rows, use_cache=False).logits
    except Exception as exc:
        return None, f"one document per row ({rows_name}) does not run: {_short(exc)}"
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


def _short(exc: BaseException) -> str:
    """The error's first line; for one without text (a StopIteration), where it was raised."""
    text = str(exc).strip().splitlines()
    if text:
        return f"{type(exc).__name__}: {text[0]}"[:300]
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = (
        f" (raised in {last[0].name}, {'/'.join(last[0].filename.split('/')[-3:])}:{last[0].lineno})" if last else ""
    )
    return f"{type(exc).__name__}{where}"
