"""Exact or refused: every (model family, backend) pair against stock transformers, document by document.

    foundry-attn conformance --markdown      # the table in docs/conformance.md
    cell("mistral", "sdpa", "pack", "hf_reentrant")  # -> Cell(status="exact", loss_err=..., grad_err=...)

For each family a tiny random config keeps every attention feature of the real one (sliding windows of 4
tokens, Gemma's softcap and ``query_pre_attn_scalar``, Gemma3's local/global pattern, GQA, MoE). A batch of
documents longer and shorter than the window runs through ``forward_documents`` (``pack``: several per row;
``mask``: one per row, right-padded) with or without activation checkpointing, and its loss and gradients
are compared with stock transformers running each document alone with the same backend, in fp32 (flex: stock
eager, as stock flex cannot train on CPU). A pair the policy refuses is recorded with its reason.
Core module: torch and transformers only.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from foundry_attn.backends import EAGER, FA2, NAMES, SDPA
from foundry_attn.forward import forward_documents, kernel_context, pad_id, repad_logits
from foundry_attn.packing import IGNORE_INDEX
from foundry_attn.paths import TRUTH, attach

MODES = ("pack", "mask")
CHECKPOINTING = ("plain", "hf_reentrant", "hf_non_reentrant", "checkpoint_wrapper")
LENGTHS = (5, 11, 3, 9)  # window 4: two documents longer, one shorter
PACK_WIDTH = 16
VOCAB = 64
LOSS_TOL, GRAD_TOL = 1e-5, 1e-4

_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def _llama_like(module: str, config: str, model: str, **extra: Any) -> Callable[[], Any]:
    def build() -> tuple[Any, type]:
        import importlib

        mod = importlib.import_module(f"transformers.models.{module}")
        return getattr(mod, config)(**{**_SHAPE, **extra}), getattr(mod, model)

    return build


FAMILIES: dict[str, Callable[[], tuple[Any, type]]] = {
    "llama": _llama_like("llama", "LlamaConfig", "LlamaForCausalLM"),
    "mistral": _llama_like("mistral", "MistralConfig", "MistralForCausalLM", sliding_window=4),
    "mixtral": _llama_like(
        "mixtral", "MixtralConfig", "MixtralForCausalLM", sliding_window=4, num_local_experts=4, num_experts_per_tok=2
    ),
    "qwen2": _llama_like(
        "qwen2", "Qwen2Config", "Qwen2ForCausalLM", use_sliding_window=True, sliding_window=4, max_window_layers=0
    ),
    "qwen3": _llama_like("qwen3", "Qwen3Config", "Qwen3ForCausalLM", head_dim=8),
    "gemma2": _llama_like(
        "gemma2",
        "Gemma2Config",
        "Gemma2ForCausalLM",
        head_dim=8,
        sliding_window=4,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    ),
    "gemma3": _llama_like(
        "gemma3",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        head_dim=8,
        sliding_window=4,
        sliding_window_pattern=2,
        query_pre_attn_scalar=16,
    ),
    "phi3": _llama_like("phi3", "Phi3Config", "Phi3ForCausalLM", sliding_window=4, pad_token_id=0),
    "gpt_neox": _llama_like("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM", rotary_pct=0.5),
    "gpt2": _llama_like(
        "gpt2",
        "GPT2Config",
        "GPT2LMHeadModel",
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=128,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
    ),
    "olmo2": _llama_like("olmo2", "Olmo2Config", "Olmo2ForCausalLM"),
}


@dataclasses.dataclass(frozen=True)
class Cell:
    family: str
    backend: str
    mode: str
    checkpointing: str
    status: str  # "exact" | "refused" | "WRONG"
    detail: str = ""
    loss_err: float | None = None
    grad_err: float | None = None
    path: str = ""  # "flat" | "rows" (foundry_attn.paths), for a cell that ran


def build(family: str, backend: str, seed: int = 0, switch: bool = True) -> torch.nn.Module:
    """The tiny model of ``family``, stock, loaded for ``backend`` (flex/FA2 load as eager, then switch to it;
    ``switch=False`` keeps the name it loaded with, as a model built for the FA2 reference kernel has)."""
    config, model_class = FAMILIES[family]()
    config._attn_implementation = backend if backend in (SDPA, EAGER) else EAGER
    torch.manual_seed(seed)
    model = model_class(config)
    if switch:
        model.config._attn_implementation = backend
    return model.train()


def refusal(family: str, backend: str) -> str | None:
    """What the policy says of this pair on the CPU (FA2 on the reference kernel), or None."""
    from foundry_attn.loading import decide
    from foundry_attn.policy import AttentionUnavailableError

    config, _ = FAMILIES[family]()
    try:
        decide(None, backend, (backend,), strict=True, compute_dtype="fp32", fa2_reference=True, config=config)
    except (AttentionUnavailableError, ValueError) as exc:
        return str(exc).split("failed: ", 1)[-1].split(". Fix: ")[0].split(" (fix: ")[0]
    return None


def _documents(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen) for n in LENGTHS]


def _batch(docs: list[torch.Tensor], mode: str) -> dict[str, Any]:
    """``pack``: documents end to end in rows of PACK_WIDTH; ``mask``: one per row, right-padded."""
    if mode == "mask":
        rows = [[d] for d in docs]
        width = max(d.numel() for d in docs)
    else:
        rows, used = [[]], 0
        for d in docs:
            if used + d.numel() > PACK_WIDTH:
                rows.append([])
                used = 0
            rows[-1].append(d)
            used += d.numel()
        width = PACK_WIDTH
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for r, row in enumerate(rows):
        flat = torch.cat(row)
        ids[r, : flat.numel()] = flat
        labels[r, : flat.numel()] = flat
    return {"input_ids": ids, "labels": labels, "doc_lens": [[d.numel() for d in row] for row in rows]}


def enable_checkpointing(model: Any, kind: str) -> None:
    """Turn on one of :data:`CHECKPOINTING` for ``model``'s decoder layers."""
    if kind.startswith("hf_"):
        model.gradient_checkpointing_enable({"use_reentrant": kind == "hf_reentrant"})
    elif kind == "checkpoint_wrapper":  # what Composer applies for fsdp_config.activation_checkpointing
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )

        layers = tuple({type(m) for m in model.modules() if type(m).__name__ in model._no_split_modules})
        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
            check_fn=lambda m: isinstance(m, layers) and m is not model,
        )


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def _grad_err(grad: torch.Tensor, want: torch.Tensor) -> float:
    """The relative L2 error of a gradient."""
    return ((grad - want).norm() / want.norm().clamp_min(1e-12)).item()


def _doc_loss(logits: torch.Tensor, doc: torch.Tensor, targets: int) -> torch.Tensor:
    """Next-token cross-entropy of one document, summed and divided by every target of the batch: the same
    function of the logits on both sides, whatever loss convention the model's own ``labels`` path has."""
    return F.cross_entropy(logits[:-1].float(), doc[1:], reduction="sum") / targets


def rows_inputs(docs: list[torch.Tensor], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Stock's batch for ``docs``: one document per row, right-padded with ``pad_id``, a 2-D mask, labels -100 on
    padding."""
    width = max(d.numel() for d in docs)
    ids = torch.full((len(docs), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for r, d in enumerate(docs):
        ids[r, : d.numel()], mask[r, : d.numel()], labels[r, : d.numel()] = d, 1, d
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@functools.lru_cache(maxsize=64)
def _truth(family: str, backend: str) -> tuple[float, torch.Tensor]:
    """Stock transformers, each document alone, the backend the flat path is proven against
    (``paths.TRUTH``): the mean loss over every target, its gradient. Stock eager where stock transformers cannot
    run FA2 itself (5.x GPT-2 FA2 in fp32 looks for an ``nn.Linear`` that GPT-2's ``Conv1D`` projections are not)."""
    try:
        return _stock_alone(family, TRUTH[backend])
    except StopIteration:
        return _stock_alone(family, EAGER)


def _stock_alone(family: str, stock: str) -> tuple[float, torch.Tensor]:
    model = build(family, stock)
    docs = _documents()
    targets = sum(d.numel() - 1 for d in docs)
    total = 0.0
    with kernel_context(stock, torch.device("cpu"), fa2_reference=True):
        for d in docs:
            loss = _doc_loss(model(input_ids=d[None]).logits[0], d, targets)
            loss.backward()
            total += loss.item()
    return total, _grads(model)


def cell(family: str, backend: str, mode: str = "pack", checkpointing: str = "plain") -> Cell:
    """Run one cell of the table."""
    why = refusal(family, backend)
    if why:
        return Cell(family, backend, mode, checkpointing, "refused", why)
    model = build(family, backend, switch=backend != FA2)
    # FA2 exists on this CPU only as the reference kernel: installed around the whole run, as for the truth
    with kernel_context(backend, torch.device("cpu"), fa2_reference=True):
        state = attach(model, backend, fa2_reference=True)
        enable_checkpointing(model, checkpointing)
        out = forward_documents(model, _batch(_documents(), mode))  # proves on this batch; a dropped argument: rows
        out.loss.backward()
    want_loss, want_grad = _truth(family, backend)
    grad = _grads(model)
    loss_err = abs(out.loss.item() - want_loss)
    grad_err = _grad_err(grad, want_grad)
    ok = loss_err <= LOSS_TOL and grad_err <= GRAD_TOL
    status = "exact" if ok else "WRONG"
    return Cell(family, backend, mode, checkpointing, status, state.reason, loss_err, grad_err, state.path)


def table(cells: list[Cell]) -> str:
    """Markdown: one row per family, one column per backend; a refusal shows its reason."""
    by = {(c.family, c.backend): c for c in cells}
    rows = {(c.family, c.backend) for c in cells if c.path == "rows"}
    worst: dict[tuple[str, str], Cell] = {}
    for c in cells:
        key = (c.family, c.backend)
        if c.status == "WRONG" or key not in worst:
            worst[key] = c
    lines = ["| family | " + " | ".join(NAMES) + " |", "| --- |" + " --- |" * len(NAMES)]
    for family in FAMILIES:
        row = []
        for backend in NAMES:
            shown = worst.get((family, backend)) or by.get((family, backend))
            row.append(
                ""
                if shown is None
                else ("exact (rows)" if (family, backend) in rows else "exact")
                if shown.status == "exact"
                else f"refused: {shown.detail}"
                if shown.status == "refused"
                else "**WRONG**"
            )
        lines.append(f"| {family} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def run_all(families: tuple[str, ...] = tuple(FAMILIES)) -> list[Cell]:
    return [cell(f, b, m, k) for f in families for b in NAMES for m in MODES for k in CHECKPOINTING]


# ---- the zoo: every causal-LM type transformers ships ---------------------------------------------------

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
    from foundry_attn import zoo

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
    from foundry_attn import zoo

    if model_class not in _DISPATCHES_BY_NAME:
        try:
            kinds = [{type(m) for m in zoo.build(config, model_class, name).modules()} for name in (EAGER, SDPA)]
            _DISPATCHES_BY_NAME[model_class] = kinds[0] == kinds[1]
        except Exception:
            _DISPATCHES_BY_NAME[model_class] = False
    return _DISPATCHES_BY_NAME[model_class]


def _zoo_truth(config: Any, model_class: type, backend: str, docs: list[torch.Tensor]) -> tuple[float, torch.Tensor]:
    """Stock, each document alone, this backend: the loss and its gradient."""
    model = _zoo_model(config, model_class, backend)
    targets = sum(d.numel() - 1 for d in docs)
    with kernel_context(backend, torch.device("cpu"), fa2_reference=True):
        # all-ones masks, as a padded batch gives (Moshi is not causal without one); one backward (recurrent state)
        losses = [
            _doc_loss(
                model(input_ids=d[None], attention_mask=torch.ones_like(d[None]), use_cache=False).logits[0], d, targets
            )
            for d in docs
        ]
        total = torch.stack(losses).sum()
        total.backward()
    return total.item(), _grads(model)


def _zoo_stock_rows(
    config: Any, model_class: type, backend: str, docs: list[torch.Tensor]
) -> tuple[float, torch.Tensor]:
    """Stock, one document per row, right-padded (the model's pad id), a 2-D mask: what stock trains on."""
    model = _zoo_model(config, model_class, backend)
    targets = sum(d.numel() - 1 for d in docs)
    with kernel_context(backend, torch.device("cpu"), fa2_reference=True):
        batch = rows_inputs(docs, pad_id(model))
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        loss = sum(_doc_loss(logits[r, : d.numel()], d, targets) for r, d in enumerate(docs))
        assert isinstance(loss, torch.Tensor)
        loss.backward()
    return loss.item(), _grads(model)


def _zoo_ours(model: Any, docs: list[torch.Tensor]) -> float:
    """Ours on the packed batch (no labels: the loss is :func:`_doc_loss` on the re-padded logits)."""
    batch = _batch(docs, "pack")
    del batch["labels"]
    logits = repad_logits(forward_documents(model, batch))
    targets = sum(d.numel() - 1 for d in docs)
    it = iter(docs)
    loss = sum(
        _doc_loss(logits[r, start : start + n], next(it), targets)
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
    return tb is not None and Path(__file__).parent in Path(tb.tb_frame.f_code.co_filename).parents


def zoo_cell(model_type: str, requested: str) -> ZooCell:
    """Run ``model_type``'s tiny config under ``requested`` (``auto``: the default chain; a backend: strict) through
    ``attach`` + ``forward_documents`` on packed documents, against stock on each document alone."""
    from foundry_attn import zoo
    from foundry_attn.loading import decide
    from foundry_attn.policy import DEFAULT_FALLBACK, AttentionUnavailableError
    from foundry_attn.proof import synthetic_documents

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
        docs = synthetic_documents(config, ZOO_LENGTHS, torch.device("cpu"))
        want_loss, want_grad = _zoo_truth(config, model_class, backend, docs)
    except Exception as exc:
        return done("crash" if raised_by_us(exc) else "stock fails", f"{type(exc).__name__}: {exc}", chosen=backend)
    try:
        model = _zoo_model(config, model_class, backend)
        # FA2 exists on this CPU only as the reference kernel: installed around the whole run, as for the truth
        with kernel_context(backend, torch.device("cpu"), fa2_reference=True):
            state = attach(model, backend, fa2_reference=backend == FA2)
            loss = _zoo_ours(model, docs)
    except Exception as exc:
        return done("crash", f"{type(exc).__name__}: {exc}", chosen=backend)
    grad = _grads(model)
    loss_err = abs(loss - want_loss)
    grad_err = _grad_err(grad, want_grad)
    ok = loss_err <= LOSS_TOL and grad_err <= GRAD_TOL
    status = "exact" if ok else "WRONG"
    if not ok and state.path == "rows":  # is it stock's own padded rows that differ from each document alone?
        rows_loss, rows_grad = _zoo_stock_rows(config, model_class, backend, docs)
        if abs(loss - rows_loss) <= LOSS_TOL and _grad_err(grad, rows_grad) <= GRAD_TOL:
            status = "stock differs"
    return done(
        status,
        state.reason,
        chosen=backend,
        path=state.path,
        loss_err=loss_err,
        grad_err=grad_err,
    )


#: the backends a core user names in ``attach(model, backend)`` (not strict), on a model built as they build it
CORE_BACKENDS = (SDPA, EAGER, FA2)


def core_cell(model_type: str, backend: str) -> ZooCell:
    """A core user's cell: the model built as ``from_pretrained`` builds it (sdpa where its class has it, else eager),
    then ``attach(model, backend)`` (explicit, not strict) and ``forward_documents`` on packed documents, against
    stock on each document alone under ``backend``. ``refused`` only where stock cannot train the pair either
    (``over-refused`` otherwise); an exception out of our code is a ``crash``."""
    from foundry_attn import zoo
    from foundry_attn.policy import AttentionUnavailableError
    from foundry_attn.proof import synthetic_documents

    def done(status: str, detail: str = "", **kw: Any) -> ZooCell:
        first = detail.splitlines()[0][:300] if detail else ""
        return ZooCell(model_type, f"attach {backend}", status, detail=first, **kw)

    try:
        config, model_class = zoo.tiny(model_type)
        built = SDPA if getattr(model_class, "_supports_sdpa", False) else EAGER
        model = _zoo_model(config, model_class, built)
    except zoo.Unbuildable as exc:
        return done("unbuildable", str(exc))
    except Exception as exc:  # stock cannot build its own default here
        return done("stock fails", f"{type(exc).__name__}: {exc}")
    docs = synthetic_documents(config, ZOO_LENGTHS, torch.device("cpu"))
    try:
        truth: tuple[float, torch.Tensor] | None = _zoo_truth(config, model_class, backend, docs)
    except Exception as exc:  # ours is a crash, unless attach refuses the pair anyway (below)
        truth, stock_error, ours = None, f"{type(exc).__name__}: {exc}", raised_by_us(exc)
    try:
        with kernel_context(backend, torch.device("cpu"), fa2_reference=True):
            state = attach(model, backend, fa2_reference=backend == FA2)
            loss = _zoo_ours(model, docs)
    except AttentionUnavailableError as exc:
        # stock fails too, or runs something else than the model (4.51's sdpa drops Gemma2's softcap silently)
        refused = str(exc).split("failed: ", 1)[-1].split(". Fix: ")[0]
        inexact = "check 'exactness'" in str(exc)
        return done("refused" if truth is None or inexact else "over-refused", refused, chosen=backend)
    except Exception as exc:
        return done("crash", f"{type(exc).__name__}: {exc}", chosen=backend)
    if truth is None:
        return done("crash" if ours else "stock fails", stock_error, chosen=backend, path=state.path)
    grad = _grads(model)
    loss_err, grad_err = abs(loss - truth[0]), _grad_err(grad, truth[1])
    status = "exact" if loss_err <= LOSS_TOL and grad_err <= GRAD_TOL else "WRONG"
    if status == "WRONG" and state.path == "rows":
        rows_loss, rows_grad = _zoo_stock_rows(config, model_class, backend, docs)
        if abs(loss - rows_loss) <= LOSS_TOL and _grad_err(grad, rows_grad) <= GRAD_TOL:
            status = "stock differs"
    return done(status, state.reason, chosen=backend, path=state.path, loss_err=loss_err, grad_err=grad_err)


def run_zoo(
    model_types: tuple[str, ...] | None = None,
    backends: tuple[str, ...] = ZOO_BACKENDS,
    core: tuple[str, ...] = CORE_BACKENDS,
) -> list[ZooCell]:
    """Every type under each of ``backends`` (the registered model's policy) and, as a core user calls it, ``attach``
    with each of ``core`` (cells named ``attach <backend>``)."""
    from foundry_attn import zoo

    types = model_types or tuple(zoo.model_types())
    return [zoo_cell(t, b) for t in types for b in backends] + [core_cell(t, b) for t in types for b in core]


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
