"""Packed against alone: the one comparison behind the proof (:mod:`foundry_attn.flat.proof`) and the inspector's
verdict (:mod:`foundry_attn.observe.verdict`).

    alone = [run(hf, alone_inputs(doc), [(0, len(doc))], grads=True) for doc in documents]   # stock, eval mode
    result = against_alone(packed, spans, alone, limits_for(hf, alone_inputs(documents[-1]), alone[-1]))
    result.worst, result.worst_grad, result.differ     # the documents whose packed slice is not their run alone

A run is one forward's logits and, with grads, the gradient of its documents' next-token loss with respect to the
input embeddings. fp32 compares max |diff| (logits ``ATOL_FP32`` x max |logit|, gradients ``GRAD_RTOL_FP32`` x
max |grad|). Half precision (autocast or half weights) compares **per token**, the worst token's relative L2
difference over the vocabulary (or the hidden size, for gradients), against limits set from measured bf16 noise
and raised to ``NOISE_FACTOR`` times stock's own noise (:func:`stock_noise`), so a leak confined to a few tokens is
not averaged away. Forwards made here are a check's, not the batch's (:func:`hidden`). Core module: torch and
transformers only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from foundry_attn.attention.config_values import config_value
from foundry_attn.flat.forward_probe import looked_up
from foundry_attn.flat.implementation import running
from foundry_attn.flat.model_forward import own_forward
from foundry_attn.flat.packing import IGNORE_INDEX
from foundry_attn.flat.proving import hidden

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
#: every parameter that trains, fp32: max |diff| <= PARAM_RTOL x max(its own largest truth gradient, PARAM_FLOOR x the
#: largest truth gradient of any parameter); the floor keeps a gradient that is rounding noise (a key bias, which
#: softmax cancels) from being judged relative to itself. Half precision: present where the truth has one
PARAM_RTOL = 1e-3
PARAM_FLOOR = 1e-4


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a proof tolerates: fp32 (max |diff|) or half precision (per token, with the noise measured)."""

    fp32: bool = True
    logits: float = ATOL_FP32
    grads: float = GRAD_RTOL_FP32
    noise: tuple[float, float] | None = None  # stock against itself (logits, gradients), half precision

    @classmethod
    def half(cls, noise: tuple[float, float]) -> Limits:
        """Half-precision limits: the per-token floors, raised to ``NOISE_FACTOR`` times stock's own noise.

        Args:
            noise: stock against itself (logits, gradients), as :func:`stock_noise` measures it.

        Returns:
            Per-token :class:`Limits` (``fp32`` False) that keep ``noise``.

        Example::

            >>> Limits.half((1e-3, 8e-3))
            Limits(fp32=False, logits=0.004, grads=0.032, noise=(0.001, 0.008))
        """
        return cls(
            False,
            max(TOKEN_RTOL_HALF, NOISE_FACTOR * noise[0]),
            max(GRAD_TOKEN_RTOL_HALF, NOISE_FACTOR * noise[1]),
            noise,
        )


@contextlib.contextmanager
def evaluating(model: Any, grad: bool = False) -> Iterator[None]:
    """Eval mode for the block (no dropout), without grad unless ``grad``; the mode is restored after.

    Args:
        model: the module to put in eval mode.
        grad: keep autograd on inside the block (a proof with gradients).

    Returns:
        A context manager.

    Example::

        >>> with evaluating(hf_model, grad=True):
        ...     alone = run(hf_model, alone_inputs(doc[None]), [(0, len(doc))], grads=True)
    """
    was_training = model.training
    model.eval()
    try:
        with torch.set_grad_enabled(grad):
            yield
    finally:
        model.train(was_training)


def half(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a forward in ``dtype`` on ``device`` computes in half precision (half weights or autocast).

    Args:
        dtype: the weights' dtype.
        device: the device the forward runs on (autocast is read for its type).

    Returns:
        True for fp16/bf16 weights or an autocast enabled on ``device``'s type.

    Example::

        >>> half(next(hf_model.parameters()).dtype, ids.device)     # fp32 weights, no autocast
        False
    """
    return dtype in (torch.float16, torch.bfloat16) or torch.is_autocast_enabled(device.type)


def per_token(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> torch.Tensor:
    """Each token's (last dimension's) relative L2 difference; ``floor`` adds that share of the mean token norm to
    each denominator.

    Args:
        got: the tensor compared, ``[..., d]``.
        want: the truth, of the same shape.
        floor: the share of the mean token norm added to each denominator (1.0 for gradients).

    Returns:
        One relative difference per token, of shape ``got.shape[:-1]``.

    Example::

        >>> per_token(logits * 1.01, logits)     # [13, vocab] -> [13]
        tensor([0.0100, 0.0100, 0.0100, ..., 0.0100])
    """
    got, want = got.float(), want.float()
    norms = want.norm(dim=-1)
    scale = norms + floor * norms.mean() if norms.numel() else norms
    return (got - want).norm(dim=-1) / scale.clamp_min(1e-12)


def differs(got: torch.Tensor, want: torch.Tensor, fp32: bool, limit: float | None = None) -> tuple[float, bool]:
    """The difference of two logits tensors and whether it is beyond tolerance (nan always is). fp32: max |diff|
    against ``limit`` (default :data:`ATOL_FP32`) x max(1, max |want|); half: the worst token's relative L2
    difference against ``limit`` (default :data:`TOKEN_RTOL_HALF`).

    Args:
        got: the packed slice's logits ``[n, vocab]``.
        want: the document's logits alone ``[n, vocab]``.
        fp32: compare max |diff| (True) or per token (False: half precision).
        limit: the tolerance (None: the default above).

    Returns:
        The difference and whether it is beyond tolerance (another shape: ``(inf, True)``).

    Example::

        >>> differs(packed.logits[s:e], alone.logits, fp32=True)
        (4.5e-08, False)
    """
    if got.shape != want.shape:
        return float("inf"), True
    if not got.numel():
        return 0.0, False
    if fp32:
        worst = (got.float() - want.float()).abs().max().item()
        return worst, not worst <= (limit or ATOL_FP32) * max(1.0, want.float().abs().max().item())
    worst = per_token(got, want).max().item()
    return worst, not worst <= (limit or TOKEN_RTOL_HALF)


def grad_differs(got: torch.Tensor, want: torch.Tensor, limits: Limits) -> tuple[float, bool]:
    """Gradients: fp32 relative to the largest (a gradient has no unit scale); half per token.

    Args:
        got: the packed slice's input-embedding gradient ``[n, hidden]``.
        want: the document's gradient alone ``[n, hidden]``.
        limits: the proof's :class:`Limits` (``fp32`` and ``grads`` are read).

    Returns:
        The worst relative difference and whether it is beyond ``limits.grads`` (another shape: ``(inf, True)``).

    Example::

        >>> grad_differs(packed.grad[s:e], alone.grad, Limits())
        (1.3e-07, False)
    """
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
def embeddings(hf: Any, grads: bool) -> Iterator[list[torch.Tensor]]:
    """The input embeddings of each forward in the block, as tensors the loss can be differentiated against (a
    frozen embedding's output becomes a leaf that requires grad: the same values, the same graph above it).

    Args:
        hf: the transformers model (its ``get_input_embeddings()`` is hooked).
        grads: hook only with gradients (False: the list stays empty).

    Returns:
        A context manager that yields the list the block's forwards append their input embeddings to.

    Example::

        >>> with embeddings(hf_model, grads=True) as captured:
        ...     logits = hf_model(input_ids=ids).logits
        >>> captured[0].shape      # torch.Size([1, 13, hidden])
    """
    captured: list[torch.Tensor] = []
    module = hf.get_input_embeddings() if grads and hasattr(hf, "get_input_embeddings") else None
    if module is None:
        yield captured
        return

    def hook(_: Any, args: Any, out: Any) -> Any:
        if not looked_up(args) or not isinstance(out, torch.Tensor) or not out.is_floating_point():
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


#: one call of a plain ``nn.Linear`` output layer: its input, its output, its weight and its bias (or None)
HeadCall = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


@contextlib.contextmanager
def head_calls(hf: Any, grads: bool) -> Iterator[list[HeadCall]]:
    """The calls of the model's output layer in the block, where it is a plain ``nn.Linear`` (no adapter, no
    quantised subclass): :func:`documents_grad` carries the loss's gradient through it on the compared rows.

    Args:
        hf: the transformers model (its ``get_output_embeddings()`` is hooked).
        grads: hook only with gradients (False: the list stays empty).

    Returns:
        A context manager that yields the list of :data:`HeadCall` tuples, one per call of the output layer.

    Example::

        >>> with embeddings(hf_model, True) as captured, head_calls(hf_model, True) as head:
        ...     logits = hf_model(input_ids=ids).logits
        >>> len(head)      # 1 (0 where the output layer is no plain nn.Linear)
    """
    calls: list[HeadCall] = []
    module = hf.get_output_embeddings() if grads and hasattr(hf, "get_output_embeddings") else None
    if type(module) is not torch.nn.Linear:
        yield calls
        return
    handle = module.register_forward_hook(lambda m, args, out: calls.append((args[0], out, m.weight, m.bias)))
    try:
        yield calls
    finally:
        handle.remove()


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The summed next-token loss of one document's ``[n, vocab]`` logits on its ``[n]`` ids.

    Args:
        logits: one document's logits ``[n, vocab]``.
        ids: its token ids ``[n]``.

    Returns:
        A scalar fp32 tensor: the cross-entropy of each token after the first, summed.

    Example::

        >>> next_token_loss(alone.logits, doc)
        tensor(50.0477)
    """
    return F.cross_entropy(logits[:-1].float(), ids[1:], reduction="sum")


def loss_shifts(hf: Any, doc: torch.Tensor) -> bool:
    """Whether the model's own loss is the next-token loss of its logits (transformers shifts the labels), read from
    one stock forward of ``doc`` with ``labels=doc``; False for a model whose loss reads each token's own label
    (CPM-Ant), so each document's first token is a target there too. True where it cannot be told.

    Args:
        hf: the transformers model, under its stock implementation.
        doc: one document's ids ``[n]``, two tokens or more.

    Returns:
        False only where the model's loss matches the unshifted cross-entropy and not the shifted one.

    Example::

        >>> loss_shifts(llama, doc), loss_shifts(cpmant, doc)
        (True, False)
    """
    try:
        with hidden(), evaluating(hf), torch.random.fork_rng(devices=[]):
            out = own_forward(hf, input_ids=doc[None], labels=doc[None], use_cache=False)
    except Exception:  # a model that cannot run a document alone is judged by the proof, which says why
        return True
    loss, logits = getattr(out, "loss", None), getattr(out, "logits", None)
    if not isinstance(loss, torch.Tensor) or not isinstance(logits, torch.Tensor) or logits.shape[1] != doc.numel():
        return True
    shifted = next_token_loss(logits[0], doc) / max(1, doc.numel() - 1)
    unshifted = F.cross_entropy(logits[0].float(), doc)

    def near(value: torch.Tensor) -> bool:
        return bool(torch.isclose(loss.detach().float(), value, rtol=1e-3, atol=1e-4))

    return not (near(unshifted) and not near(shifted))


def next_targets(
    ids: torch.Tensor, spans: Sequence[tuple[int, int]], labels: torch.Tensor | None = None
) -> torch.Tensor:
    """What each token of the documents at ``spans`` is trained to predict, in their order (-100: nothing). With
    ``labels`` (a row as the model takes them), the next token's label, the one after a document's end included: a
    target that crosses into the next document counts, as it would in training. Without, the next token inside
    the document.

    Args:
        ids: the row's token ids ``[tokens]``.
        spans: each document's ``(start, end)`` in the row.
        labels: the row's ``[tokens]`` labels, or None.

    Returns:
        A ``[sum of the documents' lengths]`` long tensor.

    Example::

        >>> next_targets(torch.tensor([5, 6, 7, 8]), [(0, 2), (2, 4)])
        tensor([   6, -100,    8, -100])
    """
    nxt = F.pad((ids if labels is None else labels)[1:], (0, 1), value=IGNORE_INDEX)
    if labels is None:
        nxt = nxt.clone()
        nxt[torch.tensor([e - 1 for _, e in spans], device=ids.device)] = IGNORE_INDEX
    return nxt[torch.cat([torch.arange(s, e, device=ids.device) for s, e in spans])]


#: parameter name -> the gradient of a loss with respect to it (None: the loss does not reach it)
ParamGrads = dict[str, torch.Tensor | None]


#: where the parameters that train are at most this share of all (adapters: LoRA), every one of them is compared
ADAPTER_SHARE = 0.1


def trainable(hf: Any) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters that train (``requires_grad``) whose gradients the proof compares, by name, each once (tied
    weights under their first name): all of them where they are adapters (at most :data:`ADAPTER_SHARE` of the
    model); else every one but the dense projections' weights (``nn.Linear``, ``nn.Embedding``, transformers'
    ``Conv1D``). Those are the product of each token's input and output gradient, which the proof already compares
    through the logits and the input embeddings, and computing them is a matmul per layer: most of a backward. What
    lives outside them (Doge's ``A``, a bias a mask carries, norms, sinks, biases) is where a path leaves a parameter
    behind. Sharded ones (FSDP2's DTensors, whose gradients reach them through FSDP's own hooks) are left out.

    Args:
        hf: the transformers model.

    Returns:
        ``(name, parameter)`` pairs, in ``named_parameters`` order.

    Example::

        >>> [name for name, _ in trainable(hf_model)][:2]     # a Llama: its norms
        ['model.layers.0.input_layernorm.weight', 'model.layers.0.post_attention_layernorm.weight']
    """
    from torch.distributed.tensor import DTensor
    from transformers.pytorch_utils import Conv1D

    named = [(n, p) for n, p in hf.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
    if sum(p.numel() for _, p in named) <= ADAPTER_SHARE * sum(p.numel() for p in hf.parameters()):
        return named
    dense = {id(m.weight) for m in hf.modules() if isinstance(m, torch.nn.Linear | torch.nn.Embedding | Conv1D)}
    return [(n, p) for n, p in named if id(p) not in dense]


def documents_grad(
    logits: torch.Tensor,
    ids: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    embeds: torch.Tensor | None,
    head: Sequence[HeadCall] = (),
    retain_graph: bool = False,
    params: Sequence[tuple[str, torch.nn.Parameter]] = (),
    labels: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, ParamGrads]:
    """The gradient of the summed next-token loss of the documents at ``spans`` of one row (``[1, tokens, vocab]``
    ``logits``, ``[tokens]`` ``ids``) with respect to the input embeddings ``embeds`` ``[1, tokens, hidden]``, and
    with respect to each of ``params`` (:func:`trainable`). The loss's gradient is taken on the documents' rows alone
    and, where the logits are the output of a plain linear output layer (``head``, :func:`head_calls`), carried
    through it on those rows (its weight's gradient made from the same rows): the same gradients, with no
    ``[tokens, vocab]`` backward for the rows outside the documents.

    Args:
        logits: the row's logits ``[1, tokens, vocab]`` (or even rows', :func:`flat_tokens`), with their graph.
        ids: the row's token ids ``[tokens]``.
        spans: each document's ``(start, end)`` in the row.
        embeds: the input embeddings ``[1, tokens, hidden]`` (:func:`token_embeddings`), or None: not asked.
        head: the output layer's calls of that forward (:func:`head_calls`).
        retain_graph: keep the graph after the backward (a training backward, or a module's cached tensor, needs it).
        params: the parameters to differentiate against, by name (:func:`trainable`).
        labels: the row's ``[tokens]`` labels, whose targets the loss takes (:func:`next_targets`; None: every next
            token of a document).

    Returns:
        The embeddings' gradient ``[tokens, hidden]`` (None without ``embeds``) and each parameter's, by name.

    Example::

        >>> grad, params = documents_grad(logits, ids[0], [(0, 6), (6, 13)], captured[0], head, params=trainable(hf))
        >>> grad.shape, sorted(params)[0]
        (torch.Size([13, 32]), 'model.layers.0.input_layernorm.weight')
    """
    index = torch.cat([torch.arange(s, e, device=logits.device) for s, e in spans])
    rows = flat_tokens(logits)[index].detach().requires_grad_()
    with torch.enable_grad():
        loss = F.cross_entropy(rows.float(), next_targets(ids, spans, labels), reduction="sum")
        (grad,) = torch.autograd.grad(loss, rows)
    call = next((c for c in head if c[1] is logits and c[0].shape[:2] == logits.shape[:2]), None)
    head_grads: dict[int, torch.Tensor] = {}
    if call is None:
        start, upstream = logits, torch.zeros_like(logits)
        flat_tokens(upstream)[index] = grad.to(logits.dtype)
    else:
        start, weight, bias = call[0], call[2], call[3]
        upstream = torch.zeros_like(start)
        flat_tokens(upstream)[index] = (grad.to(weight.dtype) @ weight).to(start.dtype)
        if weight.requires_grad:
            head_grads[id(weight)] = grad.to(weight.dtype).T @ flat_tokens(start)[index].detach().to(weight.dtype)
        if bias is not None and bias.requires_grad:
            head_grads[id(bias)] = grad.sum(0).to(bias.dtype)
    out, by_name = loss_grads(start, embeds, params, upstream, retain_graph)
    for name, param in params:
        extra, g = head_grads.get(id(param)), by_name[name]
        by_name[name] = g if extra is None else extra if g is None else g + extra
    return None if out is None else flat_tokens(out), by_name


def flat_tokens(values: torch.Tensor) -> torch.Tensor:
    """A forward's ``[rows, width, C]`` values as ``[tokens, C]``, token after token: a flat row's, or even rows'
    (:func:`foundry_attn.flat.inputs.flat_inputs`), whose tokens are the flat row's in order. A view where it can be.

    Args:
        values: logits, hidden states or gradients ``[rows, width, C]``.

    Returns:
        ``[rows * width, C]``.

    Example::

        >>> flat_tokens(torch.zeros(6, 8, 64)).shape      # six even rows of eight tokens
        torch.Size([48, 64])
    """
    return values.reshape(-1, values.shape[-1])


def loss_grads(
    outputs: torch.Tensor,
    embeds: torch.Tensor | None,
    params: Sequence[tuple[str, torch.nn.Parameter]],
    upstream: torch.Tensor | None = None,
    retain_graph: bool = False,
) -> tuple[torch.Tensor | None, ParamGrads]:
    """The gradient of ``outputs`` (a loss, or a tensor whose gradient is ``upstream``) with respect to ``embeds``
    (None: not asked) and to each of ``params``, by name (None where it does not reach one), in one backward.

    Args:
        outputs: a scalar loss, or a tensor whose gradient is ``upstream``.
        embeds: the input embeddings to differentiate against, or None.
        params: ``(name, parameter)`` pairs (:func:`trainable`).
        upstream: the gradient of ``outputs`` (None: ``outputs`` is a scalar loss).
        retain_graph: keep the graph after the backward.

    Returns:
        The gradient with respect to ``embeds`` (None where not asked) and each parameter's, by name.

    Example::

        >>> grad, params = loss_grads(loss, captured[0], trainable(hf_model), retain_graph=True)   # 2 padded rows
        >>> grad.shape, list(params)[-1]
        (torch.Size([2, 28, 32]), 'model.norm.weight')
    """
    wanted = [p for _, p in params] if embeds is None else [embeds, *(p for _, p in params)]
    if not wanted:
        return None, {}
    grads = list(torch.autograd.grad(outputs, wanted, upstream, retain_graph=retain_graph, allow_unused=True))
    out = None if embeds is None else grads.pop(0)
    return out, dict(zip((n for n, _ in params), grads, strict=True))


@dataclasses.dataclass
class Run:
    """One forward's logits ``[tokens, vocab]`` and, with grads, the gradient of the compared documents' loss with
    respect to the input embeddings ``[tokens, hidden]`` (None when the model has no embedding module to hook) and
    with respect to every parameter that trains (``params``, by name; None: not compared)."""

    logits: torch.Tensor
    grad: torch.Tensor | None = None
    params: ParamGrads | None = None


def run(
    hf: Any,
    inputs: Mapping[str, Any],
    spans: Sequence[tuple[int, int]],
    grads: bool,
    labels: torch.Tensor | None = None,
) -> Run:
    """``hf``'s own forward of ``inputs``, and with ``grads`` the gradients of the documents at ``spans``
    (:func:`documents_grad`, every parameter that trains included) on the targets of ``labels``.

    Args:
        hf: the transformers model (its own forward runs, not a wrapper's).
        inputs: the forward's keyword arguments (``input_ids`` ``[1, tokens]`` and the rest).
        spans: the documents whose loss is differentiated, each ``(start, end)`` in the row.
        grads: differentiate too (where grad is enabled), or logits only.
        labels: the row's ``[tokens]`` labels (None: every next token is a target).

    Returns:
        A :class:`Run`: the logits ``[tokens, vocab]`` and, with ``grads``, the gradients.

    Example::

        >>> alone = run(hf_model, alone_inputs(doc[None]), [(0, len(doc))], grads=True)
        >>> alone.logits.shape, alone.grad.shape
        (torch.Size([13, 64]), torch.Size([13, 32]))
    """
    with embeddings(hf, grads) as captured, head_calls(hf, grads) as head:
        logits = own_forward(hf, **inputs, use_cache=False).logits
    if not (grads and logits.requires_grad):
        return Run(flat_tokens(logits).detach())
    ids = inputs["input_ids"].reshape(-1)
    embeds = token_embeddings(captured, inputs["input_ids"])
    # the graph is kept until this run's tensors go: a module that caches a tensor made from its parameters (Mega's
    # EMA kernel) hands the next forward a graph a freed backward would have taken from it
    grad, params = documents_grad(
        logits, ids, spans, embeds, head, retain_graph=True, params=trainable(hf), labels=labels
    )
    return Run(flat_tokens(logits).detach(), grad, params)


def token_embeddings(captured: Sequence[torch.Tensor], ids: torch.Tensor) -> torch.Tensor | None:
    """The captured input embeddings of a forward of ``ids``, one per token (None where the model embeds more: a
    prompt CPM-Ant prepends), as a tensor that requires grad; None where there is none.

    Args:
        captured: the input embeddings :func:`embeddings` captured in that forward.
        ids: the forward's ``input_ids`` ``[rows, tokens]``.

    Returns:
        The first captured tensor ``[rows, tokens, hidden]``, or None.

    Example::

        >>> token_embeddings(captured, inputs["input_ids"]).shape     # a 41-token flat row
        torch.Size([1, 41, 32])
    """
    if not captured or not captured[0].requires_grad or captured[0].shape[:2] != ids.shape[:2]:
        return None
    return captured[0]


def training_noise(hf: Any) -> str | None:
    """What makes ``hf``'s training-mode forward random, or None: a dropout module with p > 0, or a float
    attribute of a module (functional attention dropout, router jitter) or of the config above 0.

    Args:
        hf: the transformers model.

    Returns:
        The first source of randomness found, named with where it is, or None.

    Example::

        >>> training_noise(hf_model)
        'attention_dropout=0.1 in model.layers.0.self_attn'
    """
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            return f"dropout p={module.p} at {name}"
        noisy = [k for k, v in vars(module).items() if _NOISY.search(k) and isinstance(v, float) and v > 0]
        if noisy:
            return f"{noisy[0]}={getattr(module, noisy[0])} in {name or 'the model'}"
    for key in ("attention_dropout", "attn_pdrop"):
        value = config_value(getattr(hf, "config", None), key, 0.0)
        if isinstance(value, int | float) and value > 0:
            return f"{key}={value}"
    return None


#: module attributes that make training mode random (functional attention dropout, router jitter)
_NOISY = re.compile(r"dropout|pdrop|jitter")


def stock_noise(hf: Any, alone: Mapping[str, Any], run: Run, stock: str | None = None) -> tuple[float, float]:
    """Stock against itself, no leak: the document alone (``run``) against the same document as the first row of
    a right-padded two-row batch (another shape, so other kernel tiles and reduction orders), and with ``stock``
    against the same document alone under another stock kernel of the same function (:func:`kernel_spread`: a
    flash kernel and stock sdpa round differently), per token, logits and gradients: the half-precision noise
    floor of this model on this device, at the comparison's own precision.

    Args:
        hf: the transformers model, under its stock implementation.
        alone: the document's inputs alone (:func:`alone_inputs`).
        run: its :class:`Run` alone.
        stock: the stock implementation ``run`` ran under (None: the shape's noise only).

    Returns:
        The worst token's relative difference in the logits and in the gradients (0.0: gradients not compared).

    Example::

        >>> stock_noise(hf_model, alone, run(hf_model, alone, [(0, 13)], grads=True), "sdpa")   # bf16 on a CPU
        (0.0, 0.0)
    """
    shape = _shape_noise(hf, alone, run)
    kernel = (0.0, 0.0) if stock is None else kernel_spread(hf, alone, run, stock)
    return max(shape[0], kernel[0]), max(shape[1], kernel[1])


def kernel_spread(hf: Any, alone: Mapping[str, Any], run_: Run, stock: str) -> tuple[float, float]:
    """The document alone under a second stock kernel (eager against sdpa or a flash kernel, sdpa against eager)
    against ``run_``, its run under ``stock``: how far two stock kernels of one function round apart here, per
    token. 0.0 where the class has no second kernel, where it raises, or where it is not finite (no spread is
    measured from a kernel that fails).

    Args:
        hf: the transformers model.
        alone: the document's inputs alone (:func:`alone_inputs`).
        run_: its :class:`Run` under ``stock``.
        stock: the stock implementation ``run_`` ran under.

    Returns:
        The worst token's relative difference in the logits and in the gradients.

    Example::

        >>> kernel_spread(hf_model, alone, run_alone, "sdpa")     # bf16 weights on a GPU: eager against sdpa
        (0.0087, 0.011)
    """
    other = "sdpa" if stock == "eager" else "eager"
    if other == "sdpa" and not getattr(type(hf), "_supports_sdpa", False):
        return 0.0, 0.0
    n = alone["input_ids"].shape[1]
    try:
        with running(hf, other):
            second = run(hf, alone, [(0, n)], run_.grad is not None)
    except Exception:
        return 0.0, 0.0
    logits = per_token(second.logits, run_.logits).max().item() if second.logits.shape == run_.logits.shape else 0.0
    grads = 0.0
    if second.grad is not None and run_.grad is not None and second.grad.shape == run_.grad.shape:
        grads = per_token(second.grad, run_.grad, floor=1.0).max().item()
    return (logits if math.isfinite(logits) else 0.0), (grads if math.isfinite(grads) else 0.0)


def _shape_noise(hf: Any, alone: Mapping[str, Any], run: Run) -> tuple[float, float]:
    """The document alone against itself as the first row of a right-padded two-row batch, per token."""
    ids = alone["input_ids"]
    n = ids.shape[1]
    pair = {
        "input_ids": torch.cat([ids, torch.cat([ids[:, : (n + 1) // 2], ids.new_zeros(1, n // 2)], 1)]),
        "attention_mask": torch.cat([torch.ones_like(ids), torch.ones_like(ids)]),
    }
    pair["attention_mask"][1, (n + 1) // 2 :] = 0
    if "position_ids" in alone:
        pair["position_ids"] = torch.cat([alone["position_ids"], alone["position_ids"]])
    with embeddings(hf, run.grad is not None) as captured:
        logits = own_forward(hf, **pair, use_cache=False).logits[0]
    noise = per_token(logits.detach(), run.logits).max().item()
    if run.grad is None or not captured or not captured[0].requires_grad:
        return noise, 0.0
    (grad,) = torch.autograd.grad(next_token_loss(logits, ids[0]), captured[0])
    return noise, per_token(grad[0], run.grad, floor=1.0).max().item()


def worse(worst: float, diff: float) -> float:
    """The worse of two differences, a nan kept.

    Args:
        worst: the worst difference so far.
        diff: the next difference.

    Returns:
        ``max(worst, diff)``, or nan where either is nan.

    Example::

        >>> worse(0.1, 0.2), worse(0.1, float("nan"))
        (0.2, nan)
    """
    return math.nan if math.isnan(diff) or math.isnan(worst) else max(worst, diff)  # max would drop a nan


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Packed runs against runs alone: the worst differences (gradients: None if not compared) and the indices of
    the documents beyond the limits."""

    worst: float
    worst_grad: float | None
    differ: tuple[int, ...]


def alone_inputs(ids: torch.Tensor, positions: torch.Tensor | None = None, width: int = 0) -> dict[str, Any]:
    """One document ``[1, n]`` as stock runs it alone, with the all-ones mask a padded batch would give it (some
    families are not causal without a mask: Moshi's eager attention); ``positions``: a user's own. ``width``:
    right-padded to it, the padding masked (the packed forward's shape: in half precision kernels round by shape).

    Args:
        ids: the document's token ids ``[1, n]``.
        positions: its ``position_ids`` ``[1, n]`` (None: the model's own).
        width: the width to right-pad to (0: none).

    Returns:
        The forward's keyword arguments: ``input_ids``, ``attention_mask`` and, with ``positions``, ``position_ids``.

    Example::

        >>> alone_inputs(doc[None], width=16)["attention_mask"]      # a 13-token document
        tensor([[1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0]])
    """
    pad = max(0, width - ids.shape[1])
    alone = {
        "input_ids": F.pad(ids, (0, pad)),
        "attention_mask": F.pad(torch.ones_like(ids), (0, pad)),
    }
    if positions is not None:
        alone["position_ids"] = F.pad(positions, (0, pad))
    return alone


def limits_for(hf: Any, alone: Mapping[str, Any], run_alone: Run, stock: str | None = None) -> Limits:
    """fp32 limits, or in half precision (half weights or autocast) the limits raised to stock's own noise on the
    document ``alone`` (whose run is ``run_alone``), at its shape and, with ``stock``, across stock's kernels.

    Args:
        hf: the transformers model (its first parameter's dtype is read).
        alone: the document's inputs alone (:func:`alone_inputs`).
        run_alone: its :class:`Run` alone.
        stock: the stock implementation it ran under (:func:`stock_noise`).

    Returns:
        :class:`Limits`: the fp32 defaults, or :meth:`Limits.half` of :func:`stock_noise`.

    Example::

        >>> limits_for(hf_model, alone, run_alone)     # fp32 weights, no autocast
        Limits(fp32=True, logits=0.0001, grads=0.0001, noise=None)
    """
    ids = alone["input_ids"]
    if not half(next(hf.parameters()).dtype, ids.device):
        return Limits()
    return Limits.half(stock_noise(hf, alone, run_alone, stock))


def against_alone(packed: Run, spans: Sequence[tuple[int, int]], alone: Sequence[Run], limits: Limits) -> Comparison:
    """Each document's slice ``spans[i]`` of the ``packed`` run against ``alone[i]``: logits and, where both
    have them, gradients.

    Args:
        packed: the packed row's :class:`Run`.
        spans: each compared document's ``(start, end)`` in that row.
        alone: each document's :class:`Run` alone, in the order of ``spans``.
        limits: the tolerances (:func:`limits_for`).

    Returns:
        A :class:`Comparison`: the worst differences and the documents beyond the limits.

    Example::

        >>> against_alone(packed, [(0, 28), (28, 41)], alone, limits)
        Comparison(worst=4.5e-08, worst_grad=1.9e-07, differ=())
    """
    worst, worst_grad, differ = 0.0, None, []
    for i, ((s, e), mine) in enumerate(zip(spans, alone, strict=True)):
        diff, bad = differs(packed.logits[s:e], mine.logits, limits.fp32, limits.logits)
        worst = worse(worst, diff)
        if packed.grad is not None and mine.grad is not None:
            gdiff, gbad = grad_differs(packed.grad[s:e], mine.grad, limits)
            worst_grad, bad = worse(worst_grad or 0.0, gdiff), bad or gbad
        if bad:
            differ.append(i)
    return Comparison(worst, worst_grad, tuple(differ))


def limits_note(limits: Limits) -> str:
    """The half-precision limits and the noise they were raised to, for a failure's reason.

    Args:
        limits: the limits the proof ran with.

    Returns:
        The note, with a leading space; "" for fp32 limits.

    Example::

        >>> limits_note(Limits.half((1e-3, 8e-3)))
        ' (half precision, worst token; limits 4.0e-03 logits, 3.2e-02 gradients; stock against itself ...)'
    """
    if limits.fp32 or limits.noise is None:
        return ""
    return (
        f" (half precision, worst token; limits {limits.logits:.1e} logits, {limits.grads:.1e} gradients; stock "
        f"against itself {limits.noise[0]:.1e}, {limits.noise[1]:.1e})"
    )


def summed(runs: Sequence[Run]) -> ParamGrads | None:
    """The parameter gradients of ``runs`` added up (the truth of documents run alone); None where one has none.

    Args:
        runs: the documents' runs alone.

    Returns:
        Each parameter's gradient summed over ``runs`` (None where none reaches it), or None.

    Example::

        >>> summed(runs)["model.norm.weight"].shape
        torch.Size([32])
    """
    if not runs or any(r.params is None for r in runs):
        return None
    total: ParamGrads = {}
    for r in runs:
        assert r.params is not None
        for name, g in r.params.items():
            have = total.get(name)
            total[name] = g if have is None else have if g is None else have + g
    return total


def params_differ(packed: ParamGrads, truth: ParamGrads, limits: Limits) -> tuple[float, str]:
    """Every parameter the truth gives a gradient must get one, within the limits (fp32: :data:`PARAM_RTOL` of its
    own largest, floored at :data:`PARAM_FLOOR` of the largest of any; half precision: present). The worst relative
    difference, and what is wrong (empty when nothing is), the parameters named.

    Args:
        packed: the packed side's parameter gradients.
        truth: the documents' gradients alone, summed (:func:`summed`).
        limits: the proof's limits (``fp32`` is read).

    Returns:
        The worst relative difference and the failure ("" where every parameter holds).

    Example::

        >>> params_differ(packed.params, summed(runs), limits)
        (3.1e-07, '')
    """
    largest = {n: (g.float().abs().max().item() if g is not None and g.numel() else 0.0) for n, g in truth.items()}
    floor = PARAM_FLOOR * max(largest.values(), default=0.0)
    worst, missing, off = 0.0, [], []
    for name, want in truth.items():
        scale = max(largest[name], floor)
        if scale == 0.0:
            continue
        got = packed.get(name)
        if got is None or (largest[name] > floor and not bool(got.any())):
            if largest[name] > floor:
                missing.append(f"{name} ({largest[name]:.1e} alone)")
            continue
        if not limits.fp32 or want is None:
            continue
        diff = (got.float() - want.float()).abs().max().item() / scale
        worst = worse(worst, diff)
        if not diff <= PARAM_RTOL:
            off.append(f"{name} ({diff:.1e} of its largest)")
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        named = f"{', '.join(missing[:3])}{more}"
        return worst, f"parameter(s) {named} get no gradient on this path (each document alone gives them one)"
    if off:
        more = f" and {len(off) - 3} more" if len(off) > 3 else ""
        return worst, f"parameter gradient(s) differ from each document alone: {', '.join(off[:3])}{more}"
    return worst, ""


@dataclasses.dataclass(frozen=True)
class Influence:
    """How far some documents' loss reaches the input embeddings of the other documents of their row: ``reach`` the
    largest |gradient| there, ``own`` the largest on their own tokens. Isolated documents give exactly zero at any
    precision (a masked score is an exact zero; so is its gradient); attention across the boundary, an SSM or
    convolution state, a token shift give a non-zero block. No noise floor, no limit."""

    reach: float
    own: float

    @property
    def leaks(self) -> bool:
        """Whether the loss reaches the other documents at all (a nan does too).

        Returns:
            True where ``reach`` is not exactly zero.

        Example::

            >>> influence(packed.grad, [(13, 42)]).leaks
            False
        """
        return not self.reach == 0.0  # nan leaks too

    def describe(self) -> str:
        """The verdict in words, for a proof's or the inspector's reason.

        Returns:
            One clause: exactly zero, or how far the loss reaches.

        Example::

            >>> Influence(0.0, 5.26).describe()
            "its loss has exactly zero gradient on the other documents' embeddings"
        """
        if not self.leaks:
            return "its loss has exactly zero gradient on the other documents' embeddings"
        share = self.reach / self.own if self.own > 0 else math.inf
        return (
            f"its loss reaches the other documents' embeddings: gradient {self.reach:.2e} ({share:.1e} of its largest "
            "on its own)"
        )


def influence(grad: torch.Tensor, own: Sequence[tuple[int, int]], row: tuple[int, int] | None = None) -> Influence:
    """:class:`Influence` of a loss whose gradient with respect to one row's embeddings is ``grad`` ``[tokens,
    hidden]``: its own documents at ``own``, the others every other token of ``row`` (default: the whole row).

    Args:
        grad: the loss's gradient with respect to the row's input embeddings ``[tokens, hidden]``.
        own: the ``(start, end)`` of the documents whose loss it is.
        row: the ``(start, end)`` of the row within ``grad`` (None: all of it).

    Returns:
        An :class:`Influence`: the largest |gradient| on the other documents' tokens and on their own.

    Example::

        >>> influence(packed.grad, [(13, 42)])
        Influence(reach=0.0, own=5.26)
    """
    start, end = row or (0, grad.shape[0])
    inside = torch.zeros(grad.shape[0], dtype=torch.bool, device=grad.device)
    for s, e in own:
        inside[s:e] = True
    others = ~inside
    others[:start] = False
    others[end:] = False
    mine = grad[inside].float().abs()
    theirs = grad[others].float().abs()
    return Influence(
        theirs.max().item() if theirs.numel() else 0.0,
        mine.max().item() if mine.numel() else 0.0,
    )
