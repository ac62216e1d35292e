"""The proof that a packed row trains as its documents alone: the flat row **that trains** against **stock** on
each document alone, in its logits and in its gradients.

    inputs, _ = flat_inputs(hf_model, ids, positions, None, layout)     # the forward's own flat row
    verdict = prove_flat(hf_model, inputs, stock="sdpa", compare=(0, 2))
    verdict.ok, verdict.worst, verdict.reason

The packed side is the flat row the forward built for the batch (its full length, its ``position_ids``, every row
of the batch flattened into one), so the proof runs the layout that trains. The truth is the model's own forward
on one document, with its own (stock) backend and none of our arguments. Anything the flat path drops (attention
sinks, a position bias, a window that lives only in the mask, state an SSM layer carries from one document to the
next, position ids counted from ``padding_idx``) shows up as a difference, the first document included.

With ``grads`` the proof also compares the gradient of each compared document's next-token loss with respect to the
input embeddings (packed slice against the document alone), and checks that no other document's embeddings
receive any of it: an attention whose forward is right and whose backward is wrong is caught too.

fp32 compares max |diff| (logits ``ATOL_FP32`` x max |logit|, gradients ``GRAD_RTOL_FP32`` x max |grad|). Half
precision (autocast or half weights) compares **per token**, the worst token's relative L2 difference over the
vocabulary (or the hidden size, for gradients) against ``TOKEN_RTOL_HALF``, a limit set from measured bf16 noise
(``foundry-attn bench proof``: stock against itself, no leak), so a leak confined to a few tokens is not averaged
away. Eval mode, no global RNG: it changes nothing the training run sees. Core module: torch and transformers only.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import itertools
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from foundry_attn.backends import config_value, set_implementation
from foundry_attn.documents import DOCS_KEY, Documents, DocumentsDropped, FlatUnsupported
from foundry_attn.forward import kernel_context, one_per_row
from foundry_attn.layout import Layout
from foundry_attn.unwrap import unwrapped

#: fp32: logits max |diff| <= ATOL_FP32 * max(1, max |logit|); gradients max |diff| <= GRAD_RTOL_FP32 * max |grad|
ATOL_FP32 = 1e-4
GRAD_RTOL_FP32 = 1e-4
#: half precision, per token: logits' relative L2 difference over the vocabulary, gradients' over the hidden size
#: (relative to the token's norm plus the mean token norm: a token whose gradient is ~0 is no scale). Floors set
#: from measured bf16 noise of exact paths on the CPU (logits 0, gradients up to 9.5e-3; leaks: logits from 4.4e-3,
#: gradients from 2.3e-2 normed; ``foundry-attn bench proof`` measures them again), raised to NOISE_FACTOR times
#: stock's own noise where a device has more (:func:`stock_noise`: stock against itself, measured at each proof)
TOKEN_RTOL_HALF = 2e-3
GRAD_TOKEN_RTOL_HALF = 2e-2
NOISE_FACTOR = 4.0


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a proof tolerates: fp32 (max |diff|) or half precision (per token, with the noise measured)."""

    fp32: bool = True
    logits: float = ATOL_FP32
    grads: float = GRAD_RTOL_FP32
    noise: tuple[float, float] | None = None  # stock against itself (logits, gradients), half precision

    @classmethod
    def half(cls, noise: tuple[float, float]) -> Limits:
        return cls(
            False,
            max(TOKEN_RTOL_HALF, NOISE_FACTOR * noise[0]),
            max(GRAD_TOKEN_RTOL_HALF, NOISE_FACTOR * noise[1]),
            noise,
        )


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
    """One proof: ``ok`` with the worst differences, or the reason it failed (and which documents)."""

    ok: bool
    worst: float = 0.0  # logits
    reason: str = ""
    ms: float = 0.0
    lengths: tuple[int, ...] = ()  # the documents compared, alone
    compared: tuple[int, ...] = ()  # their indices in the flat row
    tokens: int = 0  # the flat row's length
    worst_grad: float | None = None  # gradients (None: forward only)

    def describe(self) -> str:
        grads = "" if self.worst_grad is None else f", gradients {self.worst_grad:.1e}"
        docs = f"documents {list(self.lengths)} of a {self.tokens}-token row"
        if self.ok:
            return f"passed in {self.ms:.0f} ms ({docs}, worst |diff| {self.worst:.1e}{grads})"
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


def pick(docs: Documents, window: int | None = None) -> tuple[int, int]:
    """The two documents of a flat row to run alone: the last (the one most exposed to what precedes it, ending at
    the row's full length) and the longest other (longer than ``window`` when one is). A row of one document runs
    it twice: always two forwards alone, so FSDP ranks proving the same batch all-gather the same number of times."""
    lengths = [e - s for s, e in docs.spans]
    last = len(lengths) - 1
    if last == 0:
        return 0, 0
    others = sorted(range(last), key=lambda i: -lengths[i])
    return next((i for i in others if window and lengths[i] > window), others[0]), last


@contextlib.contextmanager
def _implementation(hf: Any, name: str) -> Iterator[None]:
    """``config._attn_implementation`` set to ``name`` for the block, restored after."""
    before = hf.config._attn_implementation
    set_implementation(hf, name)
    try:
        yield
    finally:
        set_implementation(hf, before)


@contextlib.contextmanager
def evaluating(model: Any, grad: bool = False) -> Iterator[None]:
    """Eval mode for the block (no dropout), without grad unless ``grad``; the mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.set_grad_enabled(grad):
            yield
    finally:
        model.train(was_training)


def half(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a forward in ``dtype`` on ``device`` computes in half precision (half weights or autocast)."""
    return dtype in (torch.float16, torch.bfloat16) or torch.is_autocast_enabled(device.type)


def per_token(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> torch.Tensor:
    """Each token's (last dimension's) relative L2 difference; ``floor`` adds that share of the mean token norm to
    each denominator."""
    got, want = got.float(), want.float()
    norms = want.norm(dim=-1)
    scale = norms + floor * norms.mean() if norms.numel() else norms
    return (got - want).norm(dim=-1) / scale.clamp_min(1e-12)


def differs(got: torch.Tensor, want: torch.Tensor, fp32: bool, limit: float | None = None) -> tuple[float, bool]:
    """The difference of two logits tensors and whether it is beyond tolerance (nan always is). fp32: max |diff|
    against ``limit`` (default :data:`ATOL_FP32`) x max(1, max |want|); half: the worst token's relative L2
    difference against ``limit`` (default :data:`TOKEN_RTOL_HALF`)."""
    if got.shape != want.shape:
        return float("inf"), True
    if not got.numel():
        return 0.0, False
    if fp32:
        worst = (got.float() - want.float()).abs().max().item()
        return worst, not worst <= (limit or ATOL_FP32) * max(1.0, want.float().abs().max().item())
    worst = per_token(got, want).max().item()
    return worst, not worst <= (limit or TOKEN_RTOL_HALF)


def _grad_differs(got: torch.Tensor, want: torch.Tensor, limits: Limits) -> tuple[float, bool]:
    """Gradients: fp32 relative to the largest (a gradient has no unit scale); half per token."""
    if got.shape != want.shape:
        return float("inf"), True
    if not got.numel():
        return 0.0, False
    if limits.fp32:
        scale = want.float().abs().max().item()
        worst = (got.float() - want.float()).abs().max().item() / max(scale, 1e-30)
    else:
        worst = per_token(got, want, floor=1.0).max().item()
    return worst, not worst <= limits.grads


@contextlib.contextmanager
def _embeddings(hf: Any, grads: bool) -> Iterator[list[torch.Tensor]]:
    """The input embeddings of each forward in the block, as tensors the loss can be differentiated against (a
    frozen embedding's output becomes a leaf that requires grad: the same values, the same graph above it)."""
    captured: list[torch.Tensor] = []
    module = hf.get_input_embeddings() if grads and hasattr(hf, "get_input_embeddings") else None
    if module is None:
        yield captured
        return

    def hook(_: Any, __: Any, out: Any) -> Any:
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return None
        if not out.requires_grad:
            out = out.detach().requires_grad_()
        captured.append(out)
        return out

    handle = module.register_forward_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


def _next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The summed next-token loss of one document's ``[n, vocab]`` logits on its ``[n]`` ids."""
    return F.cross_entropy(logits[:-1].float(), ids[1:], reduction="sum")


@dataclasses.dataclass
class Run:
    """One forward's logits ``[tokens, vocab]`` and, with grads, the gradient of the compared documents' loss with
    respect to the input embeddings ``[tokens, hidden]`` (None when the model has no embedding module to hook)."""

    logits: torch.Tensor
    grad: torch.Tensor | None = None


def _run(hf: Any, inputs: Mapping[str, Any], spans: Sequence[tuple[int, int]], grads: bool) -> Run:
    ids = inputs["input_ids"][0]
    with _embeddings(hf, grads) as captured:
        logits = hf(**inputs, use_cache=False).logits[0]
    if not (grads and captured and captured[0].requires_grad):
        return Run(logits.detach())
    loss = torch.stack([_next_token_loss(logits[s:e], ids[s:e]) for s, e in spans]).sum()
    (grad,) = torch.autograd.grad(loss, captured[0])
    return Run(logits.detach(), grad[0])


def prove_flat(
    model: Any,
    inputs: Mapping[str, Any],
    stock: str,
    compare: Sequence[int] | None = None,
    *,
    reference: bool = False,
    grads: bool = True,
    own_positions: bool = False,
) -> Verdict:
    """Run ``inputs`` (the flat row of :func:`foundry_attn.forward.flat_inputs`, with its documents) through the
    flat path (the model's current ``config._attn_implementation``, ours) and the documents in ``compare`` (default:
    :func:`pick`) alone through ``stock``; compare logits and, with ``grads``, input-embedding gradients.
    ``own_positions``: the documents alone get the row's ``position_ids`` (a user's positions) instead of the model's
    own.

    Raises nothing the stock forward on one document does not raise; a failure of the flat forward (a layer
    that drops our argument, an argument we cannot honour, a shape the model's mask code rejects) is a verdict.
    """
    return _prove(model, inputs, stock, compare, reference, grads, own_positions, None)


def prove_rows(
    model: Any,
    inputs: Mapping[str, Any],
    rows_name: str,
    stock: str,
    compare: Sequence[int] | None = None,
    *,
    reference: bool = False,
    grads: bool = True,
    own_positions: bool = False,
) -> Verdict:
    """The rows path as it trains (:func:`foundry_attn.forward.one_per_row`: the documents in ``compare``, one per
    row, right-padded, a 2-D mask, under ``rows_name``) against each document alone under ``stock``: logits and
    input-embedding gradients, the limits of :func:`prove_flat`. A failure says the model's padded rows differ from
    its documents alone (stock's own padded batches do the same)."""
    return _prove(model, inputs, stock, compare, reference, grads, own_positions, rows_name)


def _prove(
    model: Any,
    inputs: Mapping[str, Any],
    stock: str,
    compare: Sequence[int] | None,
    reference: bool,
    grads: bool,
    own_positions: bool,
    rows_name: str | None,
) -> Verdict:
    start = time.perf_counter()
    hf = getattr(unwrapped(model), "_orig_mod", unwrapped(model))  # the eager module under torch.compile
    docs: Documents = inputs[DOCS_KEY]
    compare = pick(docs) if compare is None else tuple(compare)
    with hidden(), _state_kept(hf):
        worst, worst_grad, reason = _compare(hf, inputs, stock, compare, reference, grads, own_positions, rows_name)
    lengths = tuple(docs.spans[i][1] - docs.spans[i][0] for i in compare)
    ms = (time.perf_counter() - start) * 1e3
    return Verdict(not reason, worst, reason, ms, lengths, compare, docs.bounds[-1], worst_grad)


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


def _alone_inputs(inputs: Mapping[str, Any], span: tuple[int, int], own_positions: bool) -> dict[str, Any]:
    """Stock on one document, with the all-ones mask a padded batch would give it (some families are not causal
    without a mask: Moshi's eager attention)."""
    s, e = span
    ids = inputs["input_ids"][:, s:e]
    alone = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if own_positions:
        alone["position_ids"] = inputs["position_ids"][:, s:e]
    return alone


def _compare(
    hf: Any,
    inputs: Mapping[str, Any],
    stock: str,
    compare: tuple[int, ...],
    reference: bool,
    grads: bool,
    own_positions: bool,
    rows_name: str | None = None,
) -> tuple[float, float | None, str]:
    """The worst logits and gradient differences, and why the flat path (with ``rows_name``: the rows path) fails
    (empty when it holds)."""
    docs: Documents = inputs[DOCS_KEY]
    ids = inputs["input_ids"]
    spans = {i: docs.spans[i] for i in dict.fromkeys(compare)}
    limits = Limits()
    with evaluating(hf, grad=grads):
        with _implementation(hf, stock), kernel_context(stock, ids.device, reference):
            try:
                alone = {
                    i: _run(hf, _alone_inputs(inputs, span, own_positions), [(0, span[1] - span[0])], grads)
                    for i, span in spans.items()
                }
                if half(next(hf.parameters()).dtype, ids.device):
                    last = spans[compare[-1]]
                    limits = Limits.half(
                        stock_noise(hf, _alone_inputs(inputs, last, own_positions), alone[compare[-1]])
                    )
            except Exception as exc:
                return 0.0, None, f"stock {stock} cannot run one document alone here: {_short(exc)}"
        if rows_name is None:
            packed, why = _flat_run(hf, inputs, list(spans.values()), grads)
        else:
            packed, why = _rows_run(hf, inputs, list(spans.values()), grads, rows_name, reference, own_positions)
    if packed is None:
        return 0.0, None, why
    worst, worst_grad, leaks = 0.0, None, []
    for i, (s, e) in spans.items():
        diff, bad = differs(packed.logits[s:e], alone[i].logits, limits.fp32, limits.logits)
        worst = _worse(worst, diff)
        want = alone[i].grad
        if packed.grad is not None and want is not None:
            gdiff, gbad = _grad_differs(packed.grad[s:e], want, limits)
            worst_grad, bad = _worse(worst_grad or 0.0, gdiff), bad or gbad
        if bad:
            leaks.append(i)
    if leaks:
        grad_note = "" if worst_grad is None else f" (gradients {worst_grad:.2e})"
        where = "of a packed row" if rows_name is None else f"one per row ({rows_name}, right-padded)"
        what = (
            "the flat path does not compute what stock computes for this model"
            if rows_name is None
            else "this model's padded rows differ from its documents alone, as in stock's own padded batches"
        )
        return (
            worst,
            worst_grad,
            f"document(s) {leaks} {where} differ from stock {stock} on each alone by {worst:.2e}"
            f"{grad_note}{_limits_note(limits)}: {what}",
        )
    if rows_name is not None:
        return worst, worst_grad, ""
    if packed.grad is not None:
        spilled = _spilled(packed.grad, list(spans.values()), limits)
        if spilled:
            return worst, worst_grad, spilled
    return worst, worst_grad, _dropped_in_training(hf, inputs) or ""


def _limits_note(limits: Limits) -> str:
    if limits.fp32 or limits.noise is None:
        return ""
    return (
        f" (half precision, worst token; limits {limits.logits:.1e} logits, {limits.grads:.1e} gradients; stock "
        f"against itself {limits.noise[0]:.1e}, {limits.noise[1]:.1e})"
    )


def stock_noise(hf: Any, alone: Mapping[str, Any], run: Run) -> tuple[float, float]:
    """Stock against itself, no leak: the document alone (``run``) against the same document as the first row of
    a right-padded two-row batch (another shape, so other kernel tiles and reduction orders), per token, logits
    and gradients: the half-precision noise floor of this model on this device."""
    ids = alone["input_ids"]
    n = ids.shape[1]
    pair = {
        "input_ids": torch.cat([ids, torch.cat([ids[:, : (n + 1) // 2], ids.new_zeros(1, n // 2)], 1)]),
        "attention_mask": torch.cat([torch.ones_like(ids), torch.ones_like(ids)]),
    }
    pair["attention_mask"][1, (n + 1) // 2 :] = 0
    if "position_ids" in alone:
        pair["position_ids"] = torch.cat([alone["position_ids"], alone["position_ids"]])
    with _embeddings(hf, run.grad is not None) as captured:
        logits = hf(**pair, use_cache=False).logits[0]
    noise = per_token(logits.detach(), run.logits).max().item()
    if run.grad is None or not captured or not captured[0].requires_grad:
        return noise, 0.0
    (grad,) = torch.autograd.grad(_next_token_loss(logits, ids[0]), captured[0])
    return noise, per_token(grad[0], run.grad, floor=1.0).max().item()


def _worse(worst: float, diff: float) -> float:
    return math.nan if math.isnan(diff) or math.isnan(worst) else max(worst, diff)  # max would drop a nan


def _spilled(grad: torch.Tensor, spans: Sequence[tuple[int, int]], limits: Limits) -> str:
    """The compared documents' loss must not reach any other document's embeddings (a backward that mixes
    documents): their gradient there is zero up to the tolerance, relative to the largest inside them."""
    inside = torch.zeros(grad.shape[0], dtype=torch.bool, device=grad.device)
    for s, e in spans:
        inside[s:e] = True
    if bool(inside.all()):
        return ""
    scale = max(grad[inside].float().abs().max().item(), 1e-30)
    outside = grad[~inside].float().abs().max().item()
    if outside <= limits.grads * scale:
        return ""
    return (
        f"the loss of documents packed in one row reaches other documents' embeddings (gradient {outside:.2e}, "
        f"{outside / scale:.1e} of its largest): the flat path's backward mixes documents"
    )


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
    """Whether the base model's ``forward`` takes ``**kwargs`` (GPT-2's does not: nothing reaches attention)."""
    base = getattr(model, "base_model", model)
    params = inspect.signature(base.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _flat_run(
    hf: Any, inputs: Mapping[str, Any], spans: Sequence[tuple[int, int]], grads: bool
) -> tuple[Run | None, str]:
    """The flat path's run of ``inputs``, or None and why it cannot run. The documents object is a fresh copy, so
    its call count is this forward's alone."""
    if not passes_kwargs(hf):
        base = type(getattr(hf, "base_model", hf)).__name__
        return None, f"{base}.forward takes no **kwargs: the documents cannot reach attention"
    docs: Documents = inputs[DOCS_KEY]
    fresh = Documents(docs.bounds, docs.cu, docs.host_bounds)
    try:
        run = _run(hf, {**inputs, DOCS_KEY: fresh, "labels": None}, spans, grads)
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
        return None, "no attention call received the documents: this model's attention bypasses transformers' interface"
    return run, ""


def _rows_run(
    hf: Any,
    inputs: Mapping[str, Any],
    spans: Sequence[tuple[int, int]],
    grads: bool,
    rows_name: str,
    reference: bool,
    own_positions: bool,
) -> tuple[Run | None, str]:
    """The rows path's run of the documents at ``spans`` (one per row, as :func:`one_per_row` lays out a training
    batch), placed back at their positions of the flat row; or None and why it cannot run."""
    ids = inputs["input_ids"]
    index = torch.cat([torch.arange(s, e) for s, e in spans]).to(ids.device)
    lengths = tuple(e - s for s, e in spans)
    positions = inputs["position_ids"][:, index] if own_positions and "position_ids" in inputs else None
    rows, (dst, *_) = one_per_row(hf, ids[:, index], positions, None, Layout((lengths,), len(index)))
    rows = {k: v for k, v in rows.items() if v is not None}
    try:
        with _implementation(hf, rows_name), kernel_context(rows_name, ids.device, reference):
            with _embeddings(hf, grads) as captured:
                out = hf(**rows, use_cache=False).logits
    except Exception as exc:
        return None, f"one document per row ({rows_name}) does not run: {_short(exc)}"
    logits = out.reshape(-1, out.shape[-1])[dst]
    placed = logits.new_zeros(ids.shape[1], logits.shape[-1]).index_copy_(0, index, logits.detach())
    if not (grads and captured and captured[0].requires_grad):
        return Run(placed), ""
    bounds = [0, *itertools.accumulate(lengths)]
    mine = ids[0, index]
    loss = torch.stack([_next_token_loss(logits[a:b], mine[a:b]) for a, b in itertools.pairwise(bounds)]).sum()
    (grad,) = torch.autograd.grad(loss, captured[0])
    grad = grad.reshape(-1, grad.shape[-1])[dst]
    return Run(placed, grad.new_zeros(ids.shape[1], grad.shape[-1]).index_copy_(0, index, grad)), ""


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
