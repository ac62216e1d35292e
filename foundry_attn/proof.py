"""The proof that a packed row trains as its documents alone: the packed slice against **stock** on each document.

    verdict = prove_flat(hf_model, [doc_a, doc_b], stock="sdpa")      # what foundry_attn.paths.attach runs
    verdict.ok, verdict.worst, verdict.reason

The truth is the model's own forward on one document, with its own (stock) backend and none of our arguments;
the packed row runs through our flat path. Anything the flat path drops (attention sinks, a position bias, a
window that lives only in the mask, state that an SSM layer carries from one document to the next, position
ids counted from ``padding_idx``) shows up as a difference, the first document included. Eval mode, no grad,
no global RNG: it changes nothing the training run sees. Core module: torch and transformers only.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import itertools
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from foundry_attn.backends import config_value
from foundry_attn.documents import DocumentsDropped, FlatUnsupported
from foundry_attn.forward import _flat, kernel_context
from foundry_attn.layout import Layout
from foundry_attn.unwrap import unwrapped

#: logits tolerance: fp32 max |diff| <= ATOL * max(1, max |logit|); half precision: relative L2 norm
ATOL_FP32 = 1e-4
RTOL_HALF = 2e-2


_PROVING = contextvars.ContextVar("foundry_attn_proving", default=False)


def proving() -> bool:
    """True inside a proof's forwards: the callbacks' hooks and tracers leave them out of what they report."""
    return _PROVING.get()


@contextlib.contextmanager
def hidden() -> Iterator[None]:
    """Forwards in this block are a check's, not the batch's: :func:`proving` is True inside it."""
    token = _PROVING.set(True)
    try:
        yield
    finally:
        _PROVING.reset(token)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One proof: ``ok`` with the worst difference, or the reason it failed (and which documents)."""

    ok: bool
    worst: float = 0.0
    reason: str = ""
    ms: float = 0.0
    lengths: tuple[int, ...] = ()  # the packed row's documents
    compared: tuple[int, ...] = ()  # the indices of the documents run alone

    def describe(self) -> str:
        docs = f"documents {list(self.lengths)}"
        if self.ok:
            return f"passed in {self.ms:.0f} ms ({docs}, worst |diff| {self.worst:.1e})"
        return f"failed ({docs}): {self.reason}"


def synthetic_documents(config: Any, lengths: Sequence[int], device: torch.device) -> list[torch.Tensor]:
    """Seeded token ids (a local generator: the global RNG is untouched) that avoid the config's special ids."""
    gen = torch.Generator().manual_seed(0)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config  # multimodal: its decoder's
    vocab = int(config_value(config, "vocab_size", 0) or config_value(text, "vocab_size", 0) or 1000)
    special: set[int] = set()
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = config_value(config, name)
        special.update(v for v in (value if isinstance(value, list | tuple) else [value]) if isinstance(v, int))
    low, high = 1, max(2, min(vocab, 1000))
    docs = []
    for n in lengths:
        ids = torch.randint(low, high, (n,), generator=gen)
        for s in special:
            ids[ids == s] = (s + 1) % high or low
        docs.append(ids.to(device))
    return docs


def shortest_window(config: Any) -> int | None:
    """The shortest sliding window or attention chunk the config names (per layer on a heterogeneous one)."""
    windows = [
        int(w)
        for n in ("sliding_window", "attention_chunk_size", "local_window", "window_size")
        if isinstance(w := config_value(config, n, None, min), int) and w > 0
    ]
    return min(windows, default=None)


def proof_lengths(config: Any, longest: int = 23) -> tuple[int, int]:
    """Two documents for the build-time proof, the first longer than any short window or chunk of the config."""
    short = shortest_window(config) or longest
    first = short + 5 if short + 5 <= 64 else longest
    return max(first, 9), 13


@contextlib.contextmanager
def _implementation(hf: Any, name: str) -> Iterator[None]:
    """``config._attn_implementation`` set to ``name`` for the block, restored after."""
    before = hf.config._attn_implementation
    hf.config._attn_implementation = name
    try:
        yield
    finally:
        hf.config._attn_implementation = before


@contextlib.contextmanager
def evaluating(model: Any) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def differs(got: torch.Tensor, want: torch.Tensor, fp32: bool) -> tuple[float, bool]:
    """The difference and whether it is beyond tolerance (nan always is)."""
    if got.shape != want.shape:
        return float("inf"), True
    got, want = got.float(), want.float()
    if fp32:
        worst = (got - want).abs().max().item()
        return worst, not worst <= ATOL_FP32 * max(1.0, want.abs().max().item())
    worst = ((got - want).norm() / want.norm().clamp_min(1e-6)).item()
    return worst, not worst <= RTOL_HALF


def prove_flat(
    model: Any,
    docs: Sequence[torch.Tensor],
    stock: str,
    compare: Sequence[int] | None = None,
    reference: bool = False,
) -> Verdict:
    """Run ``docs`` packed in one row through the flat path (the model's current ``config._attn_implementation``,
    ours) and the documents in ``compare`` (default: all) alone through ``stock``; compare the logits.

    Raises nothing the stock forward on one document does not raise; a failure of the flat forward (a layer
    that drops our argument, an argument we cannot honour, a shape the model's mask code rejects) is a verdict.
    """
    start = time.perf_counter()
    hf = getattr(unwrapped(model), "_orig_mod", unwrapped(model))  # the eager module under torch.compile
    compare = tuple(range(len(docs))) if compare is None else tuple(compare)
    with hidden():
        worst, reason = _compare(hf, docs, stock, compare, reference)
    lengths = tuple(int(d.numel()) for d in docs)
    return Verdict(not reason, worst, reason, (time.perf_counter() - start) * 1e3, lengths, compare)


def _compare(
    hf: Any, docs: Sequence[torch.Tensor], stock: str, compare: tuple[int, ...], reference: bool
) -> tuple[float, str]:
    """The worst difference, and why the flat path fails (empty when it holds)."""
    device = docs[0].device
    fp32 = next(hf.parameters()).dtype == torch.float32 and not torch.is_autocast_enabled(device.type)
    with evaluating(hf):
        with _implementation(hf, stock), kernel_context(stock, device, reference):
            try:
                alone = {i: _alone(hf, docs[i]) for i in compare}
            except Exception as exc:
                return 0.0, f"stock {stock} cannot run one document alone here: {_short(exc)}"
        packed, why = _flat_logits(hf, docs)
    if packed is None:
        return 0.0, why
    bounds = list(itertools.accumulate((int(d.numel()) for d in docs), initial=0))
    worst, leaks = 0.0, []
    for i in compare:
        diff, bad = differs(packed[bounds[i] : bounds[i + 1]], alone[i], fp32)
        worst = math.nan if math.isnan(diff) or math.isnan(worst) else max(worst, diff)  # max would drop a nan
        if bad:
            leaks.append(i)
    if leaks:
        return worst, (
            f"document(s) {leaks} of a packed row differ from stock {stock} on each alone by {worst:.2e}: the flat "
            "path does not compute what stock computes for this model"
        )
    return worst, _dropped_in_training(hf, docs) or ""


def _dropped_in_training(hf: Any, docs: Sequence[torch.Tensor]) -> str | None:
    """Under HF gradient checkpointing some layers call attention without ``**kwargs`` (GPT-NeoX in 4.51), which
    the eval-mode proof never sees: one flat forward in training mode, without grad (an exception inside a
    non-reentrant checkpoint with grad would leave its hooks behind), the RNG restored after its dropout."""
    if not getattr(hf, "is_gradient_checkpointing", False):
        return None
    device = docs[0].device
    was_training = hf.training
    hf.train()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            _, why = _flat_logits(hf, docs)
    finally:
        hf.train(was_training)
    return f"under HF gradient checkpointing: {why}" if why else None


def _alone(hf: Any, doc: torch.Tensor) -> torch.Tensor:
    """Stock on one document, with the all-ones mask a padded batch would give it (some families are not causal
    without a mask: Moshi's eager attention)."""
    return hf(input_ids=doc[None], attention_mask=torch.ones_like(doc[None]), use_cache=False).logits[0]


def passes_kwargs(model: Any) -> bool:
    """Whether the base model's ``forward`` takes ``**kwargs`` (GPT-2's does not: nothing reaches attention)."""
    base = getattr(model, "base_model", model)
    params = inspect.signature(base.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _flat_logits(hf: Any, docs: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, str]:
    """The flat path's logits of ``docs`` packed in one row, or None and why it cannot run."""
    if not passes_kwargs(hf):
        base = type(getattr(hf, "base_model", hf)).__name__
        return None, f"{base}.forward takes no **kwargs: the documents cannot reach attention"
    ids = torch.cat(list(docs))[None]
    lengths = [int(d.numel()) for d in docs]
    layout = Layout((tuple(lengths),), ids.shape[1])
    positions = layout.position_ids(ids.device)
    try:
        inputs, _ = _flat(hf, ids, positions, None, layout)
        docs_arg = inputs["foundry_documents"]
        logits = hf(**inputs, use_cache=False).logits[0]
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
    if docs_arg.calls == 0:
        return None, "no attention call received the documents: this model's attention bypasses transformers' interface"
    return logits, ""


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def batch_documents(
    batch_ids: torch.Tensor, layout: Layout, window: int | None = None
) -> tuple[list[torch.Tensor], tuple[int, ...]] | None:
    """The documents of one row of a training batch to prove on, at its real length, and which two to run
    alone: the row with the most documents (with one longer than ``window`` first); the last (the one most exposed
    to what precedes it) and the longest other (longer than ``window`` when one is). A row of one document is cut
    in two (a one-token row is used twice): always three forwards, so FSDP ranks proving the same batch index
    all-gather the same number of times.
    None: a batch without real tokens."""
    if not any(layout.doc_lens):
        return None

    def rank(i: int) -> tuple[bool, int, int]:  # a document longer than the window first, then most documents
        row = layout.doc_lens[i]
        return (bool(window) and len(row) > 1 and max(row[:-1]) > (window or 0), len(row), sum(row))

    r = max(range(len(layout.doc_lens)), key=rank)
    lens = list(layout.doc_lens[r])
    start = layout.starts[r] if layout.starts else 0
    row = batch_ids[r, start : start + sum(lens)]
    if len(lens) == 1 and lens[0] < 2:
        return [row, row], (0, 1)
    if len(lens) == 1:
        lens = [lens[0] // 2, lens[0] - lens[0] // 2]
    docs = list(torch.split(row, lens))
    last = len(docs) - 1
    others = sorted(range(last), key=lambda i: -lens[i])
    other = next((i for i in others if window and lens[i] > window), others[0])
    return docs, (other, last)
