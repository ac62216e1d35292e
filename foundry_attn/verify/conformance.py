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

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from foundry_attn.attention.backends import BACKENDS, EAGER, FA2, NAMES, SDPA
from foundry_attn.attention.fa2_reference import kernel_context
from foundry_attn.flat.packing import IGNORE_INDEX
from foundry_attn.path.attach import attach
from foundry_attn.path.forward import forward_documents

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
    path: str = ""  # "flat" | "rows" (foundry_attn.path.attach), for a cell that ran


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
    from foundry_attn.selection.decision import decide
    from foundry_attn.selection.policy import AttentionUnavailableError

    config, _ = FAMILIES[family]()
    try:
        decide(None, backend, (backend,), strict=True, compute_dtype="fp32", fa2_reference=True, config=config)
    except (AttentionUnavailableError, ValueError) as exc:
        return str(exc).split("failed: ", 1)[-1].split(". Fix: ")[0].split(" (fix: ")[0]
    return None


def sample_documents(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen) for n in LENGTHS]


def collated(docs: list[torch.Tensor], mode: str) -> dict[str, Any]:
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


def grads_of(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def grad_error(grad: torch.Tensor, want: torch.Tensor) -> float:
    """The relative L2 error of a gradient."""
    return ((grad - want).norm() / want.norm().clamp_min(1e-12)).item()


def document_loss(logits: torch.Tensor, doc: torch.Tensor, targets: int) -> torch.Tensor:
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
def truth_alone(family: str, backend: str) -> tuple[float, torch.Tensor]:
    """Stock transformers, each document alone, the backend the flat path is proven against (the backend table's
    ``truth``): the mean loss over every target, its gradient. Stock eager where stock transformers cannot run FA2
    itself (5.x GPT-2 FA2 in fp32 looks for an ``nn.Linear`` that GPT-2's ``Conv1D`` projections are not)."""
    try:
        return stock_alone(family, BACKENDS[backend].truth)
    except StopIteration:
        return stock_alone(family, EAGER)


def stock_alone(family: str, stock: str) -> tuple[float, torch.Tensor]:
    model = build(family, stock)
    docs = sample_documents()
    targets = sum(d.numel() - 1 for d in docs)
    total = 0.0
    with kernel_context(stock, torch.device("cpu"), fa2_reference=True):
        for d in docs:
            loss = document_loss(model(input_ids=d[None]).logits[0], d, targets)
            loss.backward()
            total += loss.item()
    return total, grads_of(model)


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
        out = forward_documents(
            model, collated(sample_documents(), mode)
        )  # proves on this batch; a dropped argument: rows
        out.loss.backward()
    want_loss, want_grad = truth_alone(family, backend)
    grad = grads_of(model)
    loss_err = abs(out.loss.item() - want_loss)
    grad_err = grad_error(grad, want_grad)
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
