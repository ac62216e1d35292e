"""One forward of a check and what it computed: logits, the next-token loss of the training targets, and its
gradients (input embeddings, every parameter that trains).

    alone = run(subject, alone_inputs(doc), [(0, len(doc))], grads=True)   # stock, eval mode, a check's forward
    alone.logits, alone.grad, alone.params

Forwards made here are a check's, not the batch's (:func:`~foundry_attn.proof.proving.hidden`). Core module: torch
and transformers only.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from foundry_attn.flat.packing import IGNORE_INDEX
from foundry_attn.proof.forward_probe import looked_up
from foundry_attn.proof.proving import hidden
from foundry_attn.proof.subject import Subject


@contextlib.contextmanager
def evaluating(hf: Any, grad: bool = False) -> Iterator[None]:
    """Eval mode for the block (no dropout), without grad unless ``grad``; the mode is restored after.

    Args:
        hf: the module to put in eval mode.
        grad: keep autograd on inside the block (a proof with gradients).

    Returns:
        A context manager.

    Example::

        >>> _ = hf_model.train()
        >>> with evaluating(hf_model, grad=True):
        ...     hf_model.training, torch.is_grad_enabled()
        (False, True)
        >>> hf_model.training     # restored
        True
    """
    was_training = hf.training
    hf.eval()
    try:
        with torch.set_grad_enabled(grad):
            yield
    finally:
        hf.train(was_training)


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
        >>> captured[0].shape, captured[0].requires_grad      # [rows, tokens, hidden]
        (torch.Size([2, 8, 32]), True)
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
        >>> len(head)      # 0 where the output layer is no plain nn.Linear
        1
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


@contextlib.contextmanager
def state_kept(hf: Any) -> Iterator[None]:
    """The tensors modules keep as plain attributes (RecurrentGemma's recurrent and conv state, a layer's cached
    rotary table) as they were before the proof: its forwards leave nothing the training forwards read (a state
    left with the proof's freed graph would fail the next backward).

    Args:
        hf: the transformers model.

    Returns:
        A context manager that puts every module's tensor attributes back on exit.

    Example::

        >>> with state_kept(hf_model):
        ...     hf_model.model.cached = torch.ones(1)     # a tensor a proof's forward leaves on a module
        >>> hasattr(hf_model.model, "cached")
        False
    """
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


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The summed next-token loss of one document's ``[n, vocab]`` logits on its ``[n]`` ids.

    Args:
        logits: one document's logits ``[n, vocab]``.
        ids: its token ids ``[n]``.

    Returns:
        A scalar fp32 tensor: the cross-entropy of each token after the first, summed.

    Example::

        >>> next_token_loss(torch.zeros(3, 64), torch.tensor([5, 6, 7]))     # uniform logits: 2 targets of log(64)
        tensor(8.3178)
    """
    return F.cross_entropy(logits[:-1].float(), ids[1:], reduction="sum")


def loss_shifts(subject: Subject, doc: torch.Tensor, stock: str) -> bool:
    """Whether the model's own loss is the next-token loss of its logits (transformers shifts the labels), read from
    one stock forward of ``doc`` with ``labels=doc``; False for a model whose loss reads each token's own label
    (CPM-Ant), so each document's first token is a target there too. True where it cannot be told.

    Args:
        subject: the model.
        doc: one document's ids ``[n]``, two tokens or more.
        stock: the stock implementation the forward runs under.

    Returns:
        False only where the model's loss matches the unshifted cross-entropy and not the shifted one.

    Example::

        >>> loss_shifts(subject_of(hf_model), doc, "sdpa"), loss_shifts(subject_of(cpmant), doc, "eager")
        (True, False)
    """
    try:
        with hidden(), evaluating(subject.model), torch.random.fork_rng(devices=[]), subject.running(stock):
            out = subject.forward(input_ids=doc[None], labels=doc[None], use_cache=False)
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

        >>> with embeddings(hf_model, True) as captured, head_calls(hf_model, True) as head:
        ...     logits = hf_model(input_ids=ids[:1]).logits
        >>> spans = [(0, 3), (3, 8)]     # two documents of the row
        >>> grad, params = documents_grad(logits, ids[0], spans, captured[0], head, params=trainable(hf_model))
        >>> grad.shape, sorted(params)[0]
        (torch.Size([8, 32]), 'model.layers.0.input_layernorm.weight')
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

        >>> with embeddings(hf_model, grads=True) as captured:
        ...     loss = hf_model(input_ids=ids, labels=ids).loss
        >>> grad, params = loss_grads(loss, captured[0], trainable(hf_model))
        >>> grad.shape, list(params)[-1]
        (torch.Size([2, 8, 32]), 'model.norm.weight')
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
    subject: Subject,
    inputs: Mapping[str, Any],
    spans: Sequence[tuple[int, int]],
    grads: bool,
    labels: torch.Tensor | None = None,
) -> Run:
    """The model's own forward of ``inputs``, and with ``grads`` the gradients of the documents at ``spans``
    (:func:`documents_grad`, every parameter that trains included) on the targets of ``labels``.

    Args:
        subject: the model (its own forward runs, not a wrapper's).
        inputs: the forward's keyword arguments (``input_ids`` ``[1, tokens]`` and the rest).
        spans: the documents whose loss is differentiated, each ``(start, end)`` in the row.
        grads: differentiate too (where grad is enabled), or logits only.
        labels: the row's ``[tokens]`` labels (None: every next token is a target).

    Returns:
        A :class:`Run`: the logits ``[tokens, vocab]`` and, with ``grads``, the gradients.

    Example::

        >>> alone = run(subject_of(hf_model), alone_inputs(doc[None]), [(0, len(doc))], grads=True)
        >>> alone.logits.shape, alone.grad.shape
        (torch.Size([13, 64]), torch.Size([13, 32]))
    """
    hf = subject.model
    with embeddings(hf, grads) as captured, head_calls(hf, grads) as head:
        logits = subject.forward(**inputs, use_cache=False).logits
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

        >>> with embeddings(hf_model, grads=True) as captured:
        ...     logits = hf_model(**inputs).logits
        >>> token_embeddings(captured, inputs["input_ids"]).shape     # a 42-token flat row
        torch.Size([1, 42, 32])
    """
    if not captured or not captured[0].requires_grad or captured[0].shape[:2] != ids.shape[:2]:
        return None
    return captured[0]


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
