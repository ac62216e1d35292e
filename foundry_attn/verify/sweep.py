"""The zoo sweep: every causal-LM type transformers ships, as the registered model and as a core user meet it.

    foundry-attn conformance --zoo --markdown        # the tables in docs/zoo.md
    zoo_cell("mistral", "auto")                      # the registered model's choice, trained on packed documents
    core_cell("mistral", "sdpa")                     # attach(model, "sdpa") + forward_documents, as a core user

Each cell builds the type's tiny config (:mod:`foundry_attn.verify.zoo`), trains one packed batch and compares its loss
and gradients with stock transformers on each document alone (:mod:`foundry_attn.verify.conformance`'s measures):
``exact`` (flat or rows), ``refused`` (why), ``stock differs`` / ``stock fails`` / ``unbuildable`` (stock's own result),
or ``WRONG`` / ``crash`` (ours: never expected). Core module: torch and transformers only.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
from pathlib import Path
from typing import Any

import torch

from foundry_attn.attention.backends import EAGER, FA2, SDPA, load_name
from foundry_attn.attention.fa2_reference import kernel_context
from foundry_attn.flat.inputs import pad_id
from foundry_attn.path.attach import attach
from foundry_attn.path.forward import forward_documents, repad_logits
from foundry_attn.path.state import NoExactPath
from foundry_attn.proof.runs import alone_inputs
from foundry_attn.proof.synthetic import synthetic_documents
from foundry_attn.verify.conformance import (
    GRAD_TOL,
    LOSS_TOL,
    collated,
    document_loss,
    grad_error,
    grads_of,
    rows_inputs,
)

ZOO_BACKENDS = ("auto", SDPA, EAGER, FA2)  # FA2: transformers' FA2 code path on the CPU reference kernel
ZOO_LENGTHS = (5, 11, 3, 9)  # windows of zoo.WINDOW (4) bite; rows of PACK_WIDTH hold two documents each


@dataclasses.dataclass(frozen=True)
class ZooCell:
    """One (model type, requested backend): ``exact`` (on ``path``), ``refused`` (why), ``WRONG``, ``crash``,
    ``stock differs`` (rows equal stock's own padded rows, which differ from each document alone), or
    ``unbuildable`` / ``stock fails`` (stock transformers itself cannot run it here: not ours to train)."""

    model_type: str
    requested: str
    status: str
    chosen: str = ""
    path: str = ""
    detail: str = ""
    loss_err: float | None = None
    grad_err: float | None = None


def _zoo_model(config: Any, model_class: type, backend: str) -> Any:
    """Built for ``backend`` (``zoo.build``: the same model every time); FA2 on the reference kernel, so families
    that pick an attention class per backend at construction get their FA2 class. Where transformers will not
    build FA2 here (5.x checks for the package), a family that dispatches by name at call time (the same module
    classes under eager and sdpa) is built eager and switched; any other cannot run FA2 here (ValueError)."""
    from foundry_attn.verify import zoo

    load_as = backend if backend in (SDPA, EAGER, FA2) else EAGER
    try:
        with kernel_context(backend, torch.device("cpu"), fa2_reference=True):
            model = zoo.build(config, model_class, load_as)
    except ImportError as exc:
        if not _dispatches_by_name(config, model_class):
            raise ValueError(f"{model_class.__name__} picks its attention classes at construction: {exc}") from exc
        model = zoo.build(config, model_class, EAGER)
    model.config._attn_implementation = backend
    return model


_DISPATCHES_BY_NAME: dict[type, bool] = {}


def _dispatches_by_name(config: Any, model_class: type) -> bool:
    """Whether ``model_class`` builds the same modules under eager and sdpa (it reads the attention name at call
    time); two builds, once per class."""
    from foundry_attn.verify import zoo

    if model_class not in _DISPATCHES_BY_NAME:
        try:
            kinds = [{type(m) for m in zoo.build(config, model_class, name).modules()} for name in (EAGER, SDPA)]
            _DISPATCHES_BY_NAME[model_class] = kinds[0] == kinds[1]
        except Exception:
            _DISPATCHES_BY_NAME[model_class] = False
    return _DISPATCHES_BY_NAME[model_class]


def _zoo_stock(model_type: str, backend: str) -> tuple[Any, list[torch.Tensor], int]:
    """Stock's model of ``model_type`` built for ``backend``, the zoo's documents, and their targets."""
    from foundry_attn.verify import zoo

    config, model_class = zoo.tiny(model_type)
    docs = synthetic_documents(config, ZOO_LENGTHS, torch.device("cpu"))
    return _zoo_model(config, model_class, backend), docs, sum(d.numel() - 1 for d in docs)


@functools.lru_cache(maxsize=4)  # a type's cells, run one after the other, share stock's truth per backend
def _truth(model_type: str, backend: str) -> tuple[float, torch.Tensor]:
    """Stock, each document of the zoo's alone, under ``backend``: the loss and its gradient (the same config, weights
    and ids every time: :func:`foundry_attn.verify.zoo.tiny`, ``synthetic_documents``)."""
    model, docs, targets = _zoo_stock(model_type, backend)
    with kernel_context(backend, torch.device("cpu"), fa2_reference=True):
        # all-ones masks, as a padded batch gives (Moshi is not causal without one); one backward (recurrent state)
        losses = [
            document_loss(
                model(input_ids=d[None], attention_mask=torch.ones_like(d[None]), use_cache=False).logits[0], d, targets
            )
            for d in docs
        ]
        total = torch.stack(losses).sum()
        total.backward()
    return total.item(), grads_of(model)


@functools.lru_cache(maxsize=4)  # like the truth: a type's cells that fall back to stock's rows share them
def _zoo_stock_rows(model_type: str, backend: str) -> tuple[float, torch.Tensor]:
    """Stock on the zoo's documents, one per row, right-padded (its pad id), a 2-D mask: what stock trains on."""
    model, docs, targets = _zoo_stock(model_type, backend)
    with kernel_context(backend, torch.device("cpu"), fa2_reference=True):
        batch = rows_inputs(docs, pad_id(model))
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        loss = sum(document_loss(logits[r, : d.numel()], d, targets) for r, d in enumerate(docs))
        assert isinstance(loss, torch.Tensor)
        loss.backward()
    return loss.item(), grads_of(model)


def _stock_rows_differ(exc: BaseException, model_type: str, backend: str, truth: Any) -> bool:
    """Whether ``exc`` is attach's refusal of a model that neither path trains as each document alone, and stock's own
    padded rows differ from each document alone too (``stock differs``: stock cannot train the packed batch exactly
    either, so the refusal is no loss)."""
    if not isinstance(exc, NoExactPath) or truth is None:
        return False
    rows_loss, rows_grad = _zoo_stock_rows(model_type, backend)
    return abs(rows_loss - truth[0]) > LOSS_TOL or grad_error(rows_grad, truth[1]) > GRAD_TOL


def _outcome(
    loss: float,
    grad: torch.Tensor,
    truth: tuple[float, torch.Tensor],
    path: str,
    model_type: str,
    backend: str,
) -> tuple[str, float, float]:
    """``exact`` or ``WRONG`` against each document alone, or ``stock differs`` where a rows result that is not
    exact equals stock's own padded rows (``model_type`` on ``backend``); with the loss and gradient errors."""
    loss_err, grad_err = abs(loss - truth[0]), grad_error(grad, truth[1])
    if loss_err <= LOSS_TOL and grad_err <= GRAD_TOL:
        return "exact", loss_err, grad_err
    if path == "rows":
        rows_loss, rows_grad = _zoo_stock_rows(model_type, backend)
        if abs(loss - rows_loss) <= LOSS_TOL and grad_error(grad, rows_grad) <= GRAD_TOL:
            return "stock differs", loss_err, grad_err
    return "WRONG", loss_err, grad_err


def _zoo_ours(model: Any, docs: list[torch.Tensor]) -> float:
    """Ours on the packed batch (no labels: the loss is :func:`document_loss` on the re-padded logits)."""
    batch = collated(docs, "pack")
    del batch["labels"]
    logits = repad_logits(forward_documents(model, batch))
    targets = sum(d.numel() - 1 for d in docs)
    it = iter(docs)
    loss = sum(
        document_loss(logits[r, start : start + n], next(it), targets)
        for r, row in enumerate(batch["doc_lens"])
        for start, n in zip(itertools.accumulate(row, initial=0), row, strict=False)
    )
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    return loss.item()


def raised_by_us(exc: BaseException) -> bool:
    """Whether ``exc`` was raised in our own code (the reference kernel, the zoo's documents, this module), not in
    stock transformers or torch under it: a zoo cell files it as a ``crash``, never as ``stock fails``. One we raise
    ``from`` another (the zoo's builder saying why stock cannot build a class) is judged by its cause."""
    if exc.__cause__ is not None:
        return raised_by_us(exc.__cause__)
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and Path(__file__).parents[1] in Path(tb.tb_frame.f_code.co_filename).parents  # the package


def zoo_cell(model_type: str, requested: str) -> ZooCell:
    """Run ``model_type``'s tiny config under ``requested`` (``auto``: the default chain; a backend: strict) through
    ``attach`` + ``forward_documents`` on packed documents, against stock on each document alone."""
    from foundry_attn.selection.decision import decide
    from foundry_attn.selection.policy import DEFAULT_FALLBACK, AttentionUnavailableError
    from foundry_attn.verify import zoo

    def done(status: str, detail: str = "", **kw: Any) -> ZooCell:
        return ZooCell(model_type, requested, status, detail=detail.splitlines()[0][:300] if detail else "", **kw)

    try:
        config, model_class = zoo.tiny(model_type)
    except zoo.Unbuildable as exc:
        return done("unbuildable", str(exc))
    auto = requested == "auto"
    try:
        decision = decide(
            None,
            requested,
            DEFAULT_FALLBACK if auto else (requested,),
            strict=not auto,
            compute_dtype="fp32",
            fa2_reference=requested == FA2,
            config=config,
            model_class=model_class,  # type: ignore[arg-type]  # (mypy reads transformers' dummy class)
        )
    except (AttentionUnavailableError, ValueError) as exc:
        return done("refused", str(exc).split("failed: ", 1)[-1].split(". Fix: ")[0])
    backend = decision.chosen
    try:
        truth = _truth(model_type, backend)
    except Exception as exc:
        return done("crash" if raised_by_us(exc) else "stock fails", f"{type(exc).__name__}: {exc}", chosen=backend)
    run = _attached(model_type, backend, backend)
    if run.error is not None and _stock_rows_differ(run.error, model_type, backend, truth):
        return done("stock differs", str(run.error), chosen=backend)
    if run.error is not None:
        return done("crash", f"{type(run.error).__name__}: {run.error}", chosen=backend)
    status, loss_err, grad_err = _outcome(run.loss, run.grad, truth, run.path, model_type, backend)
    return done(status, run.reason, chosen=backend, path=run.path, loss_err=loss_err, grad_err=grad_err)


@dataclasses.dataclass(frozen=True)
class _Attached:
    """One model built (``built``), attached and trained one packed step: path, why, loss, gradients; or the error."""

    built: bool
    path: str = ""
    reason: str = ""
    loss: float = 0.0
    grad: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0))
    error: Exception | None = None


@functools.lru_cache(maxsize=4)  # the registered model's cells and a core user's that build and attach alike run once
def _attached(model_type: str, load_as: str, backend: str) -> _Attached:
    """``model_type``'s tiny model built as ``load_as`` loads it, ``attach(model, backend)`` and :func:`_zoo_ours` on
    the zoo's documents (FA2 on the reference kernel, installed around the whole run, as for the truth)."""
    from foundry_attn.verify import zoo

    config, model_class = zoo.tiny(model_type)
    try:
        model = _zoo_model(config, model_class, load_as)
    except Exception as exc:
        return _Attached(False, error=exc)
    try:
        with kernel_context(backend, torch.device("cpu"), fa2_reference=True):
            state = attach(model, backend, fa2_reference=backend == FA2)
            loss = _zoo_ours(model, synthetic_documents(config, ZOO_LENGTHS, torch.device("cpu")))
    except Exception as exc:
        return _Attached(True, error=exc)
    return _Attached(True, state.path, state.reason, loss, grads_of(model))


#: the backends a core user names in ``attach(model, backend)`` (not strict), on a model built as they build it
CORE_BACKENDS = (SDPA, EAGER, FA2)


def core_cell(model_type: str, backend: str) -> ZooCell:
    """A core user's cell: the model built as ``from_pretrained`` builds it (sdpa where its class has it, else eager),
    then ``attach(model, backend)`` (explicit, not strict) and ``forward_documents`` on packed documents, against
    stock on each document alone under ``backend``. ``refused`` only where stock cannot train the pair either
    (``over-refused`` otherwise); an exception out of our code is a ``crash``."""
    from foundry_attn.selection.policy import AttentionUnavailableError
    from foundry_attn.verify import zoo

    def done(status: str, detail: str = "", **kw: Any) -> ZooCell:
        first = detail.splitlines()[0][:300] if detail else ""
        return ZooCell(model_type, f"attach {backend}", status, detail=first, **kw)

    try:
        _, model_class = zoo.tiny(model_type)
    except zoo.Unbuildable as exc:
        return done("unbuildable", str(exc))
    try:
        truth: tuple[float, torch.Tensor] | None = _truth(model_type, backend)
    except Exception as exc:  # ours is a crash, unless attach refuses the pair anyway (below)
        truth, stock_error, ours = None, f"{type(exc).__name__}: {exc}", raised_by_us(exc)
    run = _attached(model_type, load_name(SDPA, model_class=model_class), backend)
    if not run.built:  # stock cannot build its own default here
        return done("stock fails", f"{type(run.error).__name__}: {run.error}")
    if isinstance(run.error, AttentionUnavailableError):
        if _stock_rows_differ(run.error, model_type, backend, truth):
            return done("stock differs", str(run.error), chosen=backend)
        # stock fails too, or runs something else than the model (4.51's sdpa drops Gemma2's softcap silently)
        refused = str(run.error).split("failed: ", 1)[-1].split(". Fix: ")[0]
        inexact = "check 'exactness'" in str(run.error)
        return done("refused" if truth is None or inexact else "over-refused", refused, chosen=backend)
    if run.error is not None:
        return done("crash", f"{type(run.error).__name__}: {run.error}", chosen=backend)
    if truth is None:
        return done("crash" if ours else "stock fails", stock_error, chosen=backend, path=run.path)
    status, loss_err, grad_err = _outcome(run.loss, run.grad, truth, run.path, model_type, backend)
    return done(status, run.reason, chosen=backend, path=run.path, loss_err=loss_err, grad_err=grad_err)


@dataclasses.dataclass(frozen=True)
class PaddingFreeCell:
    """One model type as a Trainer / TRL ``padding_free`` user meets it: the loss of one flattened batch
    (``DataCollatorWithFlattening``) against each document alone, stock (``stock_err``, or why stock cannot run it)
    and attached (``status``: ``exact`` on ``path``; ``refused`` (why); ``stock differs``: rows equal stock's own
    padded rows; ``unbuildable`` / ``stock fails``: stock cannot build or run it; ``WRONG`` / ``crash``: ours)."""

    model_type: str
    backend: str
    status: str
    path: str = ""
    stock_err: float | None = None
    stock_error: str = ""
    loss_err: float | None = None
    grad_err: float | None = None
    detail: str = ""
    verdict: str = ""  # our callbacks' verdict on stock's own run (isolated / leaks / ...), empty where it fails
    stock_logits_err: float | None = None  # stock's packed logits against each document alone, max |diff|


def padding_free_cell(model_type: str) -> PaddingFreeCell:
    """The model built as ``from_pretrained`` builds it (sdpa where its class has it, else eager); one flattened batch
    of the zoo's documents through stock, then through ``attach(model, backend)`` and ``model(**batch)``."""
    from transformers import DataCollatorWithFlattening

    from foundry_attn.selection.policy import AttentionUnavailableError
    from foundry_attn.verify import zoo

    try:
        config, model_class = zoo.tiny(model_type)
        backend = load_name(SDPA, model_class=model_class)
        model = _zoo_model(config, model_class, backend)
        stock = _zoo_model(config, model_class, backend)
    except zoo.Unbuildable as exc:
        return PaddingFreeCell(model_type, "", "unbuildable", detail=str(exc).splitlines()[0][:200])
    except Exception as exc:  # stock cannot build its own default here
        return PaddingFreeCell(model_type, "", "stock fails", detail=f"{type(exc).__name__}: {exc}"[:200])
    docs = synthetic_documents(config, ZOO_LENGTHS, torch.device("cpu"))
    batch = DataCollatorWithFlattening()([{"input_ids": d.tolist()} for d in docs])
    try:
        truth = _truth(model_type, backend)
    except Exception as exc:
        return PaddingFreeCell(model_type, backend, "stock fails", detail=f"{type(exc).__name__}: {exc}"[:200])
    targets = sum(d.numel() - 1 for d in docs)
    starts = list(itertools.accumulate((d.numel() for d in docs), initial=0))

    def loss_of(out: Any) -> torch.Tensor:  # next-token loss from the logits (some classes' own loss is not)
        logits = out.logits[0]
        return torch.stack(
            [document_loss(logits[s : s + d.numel()], d, targets) for s, d in zip(starts, docs, strict=False)]
        ).sum()

    stock_err, stock_error, verdict, logits_err = None, "", "", None
    try:
        out, verdict = _judged_stock(stock, batch)
        stock_err = abs(loss_of(out).item() - truth[0])
        with torch.no_grad():
            stock.eval()
            alone = [stock(**alone_inputs(d[None]), use_cache=False).logits[0] for d in docs]
        packed = out.logits[0].detach()
        pieces = zip(starts[:-1], alone, strict=True)
        logits_err = max((packed[s : s + a.shape[0]] - a).abs().max().item() for s, a in pieces)
    except Exception as exc:  # a model whose forward takes no position_ids, say
        stock_error = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
    try:
        state = attach(model, backend)
        model.train()
        loss = loss_of(model(**batch, use_cache=False))
        loss.backward()
    except AttentionUnavailableError as exc:  # stock runs this backend, but not exactly (4.51: Gemma2's softcap)
        if _stock_rows_differ(exc, model_type, backend, truth):
            detail = str(exc)[:200]
            return PaddingFreeCell(
                model_type, backend, "stock differs", "", stock_err, stock_error, detail=detail, verdict=verdict
            )
        refused = str(exc).split("failed: ", 1)[-1].split(". Fix: ")[0][:200]
        return PaddingFreeCell(
            model_type, backend, "refused", "", stock_err, stock_error, detail=refused, verdict=verdict
        )
    except Exception as exc:  # ours, or the model's own code failing on a flattened batch as stock's does
        status = "crash" if raised_by_us(exc) or not stock_error else "stock fails"
        detail = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        return PaddingFreeCell(model_type, backend, status, "", stock_err, stock_error, detail=detail, verdict=verdict)
    status, loss_err, grad_err = _outcome(loss.item(), grads_of(model), truth, state.path, model_type, backend)
    return dataclasses.replace(
        PaddingFreeCell(
            model_type, backend, status, state.path, stock_err, stock_error, loss_err, grad_err, state.reason[:200]
        ),
        verdict=verdict,
        stock_logits_err=logits_err,
    )


def _judged_stock(stock: Any, batch: dict[str, Any]) -> tuple[Any, str]:
    """Stock's training forward of the flattened ``batch`` (fp32), and the verdict our callbacks give it
    (:func:`foundry_attn.observe.verdict.judge` on the step's own graph)."""
    from foundry_attn.observe.verdict import judge
    from foundry_attn.proof.forward_probe import ForwardProbe

    stock.train()
    probe = ForwardProbe(stock)
    try:
        out = stock(**batch, use_cache=False)
    finally:
        probe.remove()
    return out, judge(stock, batch, out, embeds=probe.embeds).state


def padding_free_labels(cell: PaddingFreeCell) -> tuple[str, str]:
    """How the table opens a cell's two columns: stock (``exact``, ``leaks``, ``fails`` or empty) and attached
    (``exact flat``, ``exact rows``, or the status)."""
    if cell.stock_err is not None:
        stock = "exact" if cell.stock_err <= LOSS_TOL else "leaks"
    else:
        stock = "fails" if cell.stock_error else ""
    return stock, f"exact {cell.path}" if cell.status == "exact" else cell.status


def padding_free_table(cells: list[PaddingFreeCell]) -> str:
    """Markdown: per model type, stock padding-free against each document alone, and ours attached."""
    lines = [
        "| model type | backend | stock padding-free | attached | our verdict on stock |",
        "| --- | --- | --- | --- | --- |",
    ]
    for c in cells:
        stock, ours = padding_free_labels(c)
        if stock == "leaks":
            stock = f"**leaks**: loss {c.stock_err:.1e} off"
        elif stock == "fails":
            stock = f"fails: {c.stock_error}".replace("|", "/")
        if c.status not in ("exact",):
            ours = f"{c.status}: {c.detail}".replace("|", "/")[:160]
        judged = c.verdict + (f" (logits {c.stock_logits_err:.1e} off)" if c.stock_logits_err is not None else "")
        lines.append(f"| {c.model_type} | {c.backend} | {stock} | {ours} | {judged} |")
    return "\n".join(lines)


def run_zoo(
    model_types: tuple[str, ...] | None = None,
    backends: tuple[str, ...] = ZOO_BACKENDS,
    core: tuple[str, ...] = CORE_BACKENDS,
) -> list[ZooCell]:
    """Every type under each of ``backends`` (the registered model's policy) and, as a core user calls it, ``attach``
    with each of ``core`` (cells named ``attach <backend>``)."""
    from foundry_attn.verify import zoo

    cells = []
    for t in model_types or tuple(zoo.model_types()):  # a type's cells one after the other: they share stock's truth
        cells += [zoo_cell(t, b) for b in backends] + [core_cell(t, b) for b in core]
    return cells


def zoo_counts(cells: list[ZooCell]) -> dict[str, int]:
    """Counts by outcome: ``exact flat``, ``exact rows``, ``refused``, ``WRONG``, ``crash``, ``unbuildable``, ..."""
    return dict(collections.Counter(zoo_label(c) for c in cells))


def zoo_label(cell: ZooCell) -> str:
    """A cell's outcome as the zoo table opens it: ``exact flat``, ``exact rows``, ``refused``, ``stock fails``, ..."""
    return f"exact {cell.path}" if cell.status == "exact" else cell.status


def zoo_table(cells: list[ZooCell]) -> str:
    """Markdown: one row per model type, one column per requested backend (``exact flat``, ``exact rows``, the
    refusal, ...), then the reason each type runs rows."""
    by = {(c.model_type, c.requested): c for c in cells}
    types = list(dict.fromkeys(c.model_type for c in cells))
    backends = list(dict.fromkeys(c.requested for c in cells))
    lines = ["| model type | " + " | ".join(backends) + " | why rows |", "| --- |" + " --- |" * (len(backends) + 1)]
    for t in types:
        row, why = [], ""
        for b in backends:
            c = by.get((t, b))
            if c is None:
                row.append("")
            elif c.status == "exact":
                row.append(f"exact {c.path}" + (f" ({c.chosen})" if b == "auto" else ""))
                why = why or (c.detail if c.path == "rows" else "")
            elif c.status in ("refused", "unbuildable", "stock fails"):
                row.append(f"{c.status}: {c.detail}".replace("|", "/")[:160])
            else:
                row.append(f"**{c.status}**: {c.detail}".replace("|", "/")[:160])
        lines.append(f"| {t} | " + " | ".join(row) + f" | {why.replace('|', '/')[:200]} |")
    return "\n".join(lines)
