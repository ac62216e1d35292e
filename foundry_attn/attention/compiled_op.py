"""Per-document attention as one opaque op, so ``torch.compile`` traces a layout as data, not as code.

    out, _ = document_attention(q, k, v, host_bounds, "sdpa", window=0, scale=0.125, softcap=0.0)  # [B, H, T, D]

Eagerly, the sdpa and eager functions of :mod:`foundry_attn.attention.dense_functions` group the documents by length
on the host (:mod:`foundry_attn.attention.length_groups`), which Dynamo would trace and specialise on every new layout
(a recompile per batch). Under compile they call this op instead: ``foundry_attn::document_attention``
(``torch.library.custom_op``) takes the document bounds as a CPU int32 tensor, groups the documents inside (no
device sync: the bounds never leave the host) into at most 8 right-padded batches, and is a single node in the
graph whatever the layout. Its backward, ``foundry_attn::document_attention_backward``, runs on the same batches:
sdpa on the CPU calls torch's own flash-attention kernels forward and backward (the forward saves their
logsumexp); elsewhere it recomputes the probabilities and applies the softmax-attention gradient in fp32 (as
flash-attn's backward does). Inputs have GQA heads already expanded; no dropout (callers refuse it under compile).
Core module: torch only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F

from foundry_attn.attention.length_groups import LengthGroups, groups_for

#: the most attention scores one call of the eager math makes on the CPU (a batch of documents is split beyond it,
#: never a document): bigger buffers cost more there than the calls they save (glibc hands them back to the OS
#: between calls and faults them in again; 4 documents of 512 tokens at once: up to 1.24x the time of one at a time)
CPU_SCORES = 1 << 20


def allowed(n: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[n, n] bool: causal, and (with a window) a query sees at most ``window`` keys, itself included.

    Args:
        n: the document's length.
        window: how many keys a query sees, itself included (0 or None: no window).
        device: where the mask is made.

    Returns:
        The ``[n, n]`` bool mask: True where query ``i`` may see key ``j``.

    Example::

        >>> allowed(4, 2, torch.device("cpu"))[3].tolist()
        [False, False, True, True]
    """
    i = torch.arange(n, device=device)
    rel = i[:, None] - i[None, :]
    return (rel >= 0) & (rel < window) if window else rel >= 0


def sdpa_document(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, scale: float | None, dropout: float = 0.0
) -> torch.Tensor:
    """Causal SDPA over one document ``[B, H, n, D]``; a window longer than the document changes nothing. Grouped KV
    heads go to SDPA as they are (``enable_gqa``) where no mask is needed and its fused kernel takes them here (CUDA;
    the CPU from torch 2.8 or so); else repeated, so it never falls back to SDPA's math.

    Args:
        q: the document's queries ``[B, H, n, D]``.
        k: its keys ``[B, H_kv, n, D]`` (``H_kv`` divides ``H``).
        v: its values ``[B, H_kv, n, Dv]``.
        window: how many keys a query sees, itself included (0 or None: no window).
        scale: the softmax scale (None: ``1/sqrt(D)``).
        dropout: the attention dropout probability.

    Returns:
        The document's attention output ``[B, H, n, Dv]``.

    Example::

        >>> q = torch.randn(1, 8, 17, 64)  # one 17-token document
        >>> sdpa_document(q, q, q, window=None, scale=None).shape
        torch.Size([1, 8, 17, 64])
    """
    n, groups = q.shape[2], q.shape[1] // k.shape[1]
    if window and n > window:
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed(n, window, q.device), dropout_p=dropout, scale=scale
        )
    if groups > 1 and _grouped_natively(q.device, q.dtype, q.shape[-1], v.shape[-1]):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scale, is_causal=True, enable_gqa=True)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scale, is_causal=True)


@functools.cache
def _grouped_natively(device: torch.device, dtype: torch.dtype, dim: int, value_dim: int) -> bool:
    """Whether SDPA's fused kernel takes grouped KV heads as they are on ``device`` (not its math fallback)."""
    from torch.nn.attention import SDPBackend

    q = torch.zeros(1, 2, 4, dim, dtype=dtype, device=device)
    k, v = q[:, :1], torch.zeros(1, 1, 4, value_dim, dtype=dtype, device=device)
    return torch._fused_sdp_choice(q, k, v, is_causal=True, enable_gqa=True) != SDPBackend.MATH.value


def additive_mask(n: int, window: int | None, like: torch.Tensor, fill: float | None = None) -> torch.Tensor:
    """[n, n] additive mask in ``like``'s dtype: 0 where :func:`allowed`, ``fill`` (default: the dtype's min)
    elsewhere.

    Args:
        n: the document's length.
        window: how many keys a query sees, itself included (0 or None: no window).
        like: a tensor whose dtype and device the mask takes.
        fill: the value where a key is masked (None: the dtype's min).

    Returns:
        The ``[n, n]`` mask, on ``like``'s device.

    Example::

        >>> additive_mask(3, None, torch.zeros(1, dtype=torch.bfloat16))[0]
        tensor([ 0.0000e+00, -3.3895e+38, -3.3895e+38], dtype=torch.bfloat16)
    """
    fill = torch.finfo(like.dtype).min if fill is None else fill
    return torch.zeros((n, n), dtype=like.dtype, device=like.device).masked_fill_(
        ~allowed(n, window, like.device), fill
    )


def eager_math(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    softcap: float | None,
    additive: torch.Tensor | None,
    dropout: float = 0.0,
    training: bool = False,
) -> torch.Tensor:
    """transformers' eager attention on expanded heads: scores, softcap, additive mask, fp32 softmax, dropout.

    Args:
        q: the queries ``[B, H, S, D]``.
        k: the keys ``[B, H, K, D]``, GQA heads already expanded.
        v: the values ``[B, H, K, Dv]``, likewise.
        scale: what the scores are multiplied by.
        softcap: caps the scores at ``softcap * tanh(scores / softcap)`` (None or 0: no cap).
        additive: a mask added to the scores, broadcast to ``[B, H, S, K]`` (None: none).
        dropout: the attention dropout probability.
        training: whether dropout applies.

    Returns:
        The attention output ``[B, H, S, Dv]`` in ``q``'s dtype.

    Example::

        >>> q = k = v = torch.randn(1, 8, 17, 64)   # one 17-token document, heads expanded
        >>> out = eager_math(q, k, v, 0.125, None, additive_mask(17, None, q))
        >>> out.shape
        torch.Size([1, 8, 17, 64])
    """
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if additive is not None:
        scores = scores + additive
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(F.dropout(probs, p=dropout, training=training), v)


def eager_document(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None,
    scale: float,
    softcap: float | None,
    dropout: float = 0.0,
    training: bool = False,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`eager_math` over one document, causal (and windowed) within it; over a batch of right-padded documents
    (:func:`~foundry_attn.attention.dense_functions.by_length`), each alone. On the CPU in calls of at most
    :data:`CPU_SCORES` scores (:func:`per_call`).

    Args:
        q: the document's queries ``[B, H, n, D]``, GQA heads already expanded.
        k: its keys ``[B, H, n, D]``.
        v: its values ``[B, H, n, Dv]``.
        window: how many keys a query sees, itself included (0 or None: no window).
        scale: what the scores are multiplied by.
        softcap: caps the scores at ``softcap * tanh(scores / softcap)`` (None or 0: no cap).
        dropout: the attention dropout probability.
        training: whether dropout applies.
        mask: its :func:`additive_mask`, made once for every layer (None: made here).

    Returns:
        The document's attention output ``[B, H, n, Dv]`` in ``q``'s dtype.

    Example::

        >>> q = k = v = torch.randn(1, 8, 17, 64)   # one 17-token document, heads expanded
        >>> eager_document(q, k, v, window=4096, scale=0.125, softcap=50.0).shape  # Gemma-2 style
        torch.Size([1, 8, 17, 64])
    """
    mask = additive_mask(q.shape[2], window, q) if mask is None else mask
    if per_call(q) >= q.shape[0]:
        return eager_math(q, k, v, scale, softcap, mask, dropout, training)
    return _in_calls(lambda q, k, v: eager_math(q, k, v, scale, softcap, mask, dropout, training), q, k, v)


def per_call(q: torch.Tensor) -> int:
    """How many documents of a padded batch one call of the eager math takes: all of them on an accelerator; on the
    CPU as many as keep the call's ``[n, H, L, L]`` scores within :data:`CPU_SCORES`, and at least one.

    Args:
        q: the batch's queries ``[n, H, L, D]``.

    Returns:
        The documents per call.

    Example::

        >>> per_call(torch.zeros(256, 4, 8, 64)), per_call(torch.zeros(4, 4, 512, 64))   # on the CPU: all 256, then 1
        (4096, 1)
    """
    if not q.is_cpu:
        return q.shape[0]
    return max(1, CPU_SCORES // (q.shape[1] * q.shape[2] ** 2))


def _in_calls(fn: Callable[..., Any], *batch: torch.Tensor) -> Any:
    """``fn(*batch)`` in calls of :func:`per_call` documents (split along dim 0), its outputs concatenated."""
    n = per_call(batch[0])
    if n >= batch[0].shape[0]:
        return fn(*batch)
    outs = [fn(*chunk) for chunk in zip(*(t.split(n) for t in batch), strict=True)]
    return (
        torch.cat(outs) if isinstance(outs[0], torch.Tensor) else tuple(torch.cat(o) for o in zip(*outs, strict=True))
    )


def _groups(host_bounds: torch.Tensor, device: torch.device) -> LengthGroups:
    """The documents at ``host_bounds`` grouped by length for ``device`` (cached per layout: one host read a call)."""
    return groups_for(tuple(e - s for s, e in pairwise(host_bounds.tolist())), device)


def _padded(groups: LengthGroups, t: torch.Tensor, zero_pads: bool = False) -> list[torch.Tensor]:
    """``[B, H, T, ...]`` -> one ``[B * n, H, L, ...]`` batch per group (:meth:`LengthGroups.pad`)."""
    return groups.pad(t, zero_pads=zero_pads)


def _unpadded(groups: LengthGroups, pieces: list[torch.Tensor]) -> torch.Tensor:
    """:func:`_padded` undone: ``[B, H, T, ...]``, contiguous."""
    return groups.unpad(pieces).transpose(1, 2).contiguous()


def _flash(kind: str, query: torch.Tensor) -> bool:
    """sdpa on the CPU: torch's own flash kernel per batch, whose backward takes the saved logsumexp."""
    return kind == "sdpa" and query.device.type == "cpu"


def _window_bias(n: int, window: int, like: torch.Tensor) -> torch.Tensor | None:
    return additive_mask(n, window, like, float("-inf")) if window and n > window else None


@torch.library.custom_op("foundry_attn::document_attention", mutates_args=())
def document_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    host_bounds: torch.Tensor,
    kind: str,
    window: int,
    scale: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, H, T, D]`` attention of every document of the flat row alone (window 0: none, softcap 0: none),
    and the ``[B, H, T]`` fp32 logsumexp its backward needs (empty when the backward recomputes instead).

    Args:
        query: the flat row's queries ``[B, H, T, D]``, GQA heads already expanded.
        key: its keys ``[B, H, T, D]``.
        value: its values ``[B, H, T, Dv]``.
        host_bounds: the document bounds ``(0, l0, l0 + l1, ..., T)``, a CPU int32 tensor.
        kind: ``"sdpa"`` or ``"eager"`` (the math each document runs).
        window: how many keys a query sees, itself included (0: no window).
        scale: the softmax scale.
        softcap: the score cap of ``"eager"`` (0: no cap).

    Returns:
        ``(out, lse)``: the output ``[B, H, T, Dv]`` and the logsumexp (sdpa on the CPU; else an empty tensor).

    Example::

        >>> q = k = v = torch.randn(1, 8, 40, 64)                      # a flat row of 40 tokens on the CPU
        >>> bounds = torch.tensor([0, 17, 40], dtype=torch.int32)     # two documents (Documents.bounds_on("cpu"))
        >>> out, lse = document_attention(q, k, v, bounds, "sdpa", 0, 0.125, 0.0)
        >>> out.shape, lse.shape
        (torch.Size([1, 8, 40, 64]), torch.Size([1, 8, 40]))
    """
    groups = _groups(host_bounds, query.device)
    padded = zip(*(_padded(groups, t) for t in (query, key, value)), strict=True)
    if not _flash(kind, query):
        with torch.no_grad():
            outs = [
                sdpa_document(q, k, v, window, scale)
                if kind == "sdpa"
                else eager_document(q, k, v, window, scale, softcap)
                for q, k, v in padded
            ]
        return _unpadded(groups, outs), query.new_empty(0, dtype=torch.float)
    outs, lses = [], []
    for q, k, v in padded:
        bias = _window_bias(q.shape[2], window, query)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, bias is None, attn_mask=bias, scale=scale
        )
        outs.append(out)
        lses.append(lse.float())
    return _unpadded(groups, outs), _unpadded(groups, lses)


@document_attention.register_fake
def _(query, key, value, host_bounds, kind, window, scale, softcap):  # the op's signature
    lse = query.new_empty(query.shape[:-1] if _flash(kind, query) else (0,), dtype=torch.float)
    return query.new_empty((*query.shape[:-1], value.shape[-1])), lse


def _document_grads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, window: int, scale: float, softcap: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention core's gradients for a batch of right-padded documents, in fp32: P = softmax(cap(scale q k^T) +
    mask), O = P v (a pad row's ``dout`` is zero, so it adds nothing)."""
    q, k, v, dout = (t.float() for t in (q, k, v, dout))
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    capped = torch.tanh(scores / softcap) if softcap else None
    if capped is not None:
        scores = capped * softcap
    scores = scores.masked_fill(~allowed(q.shape[2], window, q.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    dv = torch.matmul(probs.transpose(2, 3), dout)
    dprobs = torch.matmul(dout, v.transpose(2, 3))
    dscores = probs * (dprobs - (dprobs * probs).sum(dim=-1, keepdim=True))
    if capped is not None:
        dscores = dscores * (1 - capped * capped)
    return torch.matmul(dscores, k) * scale, torch.matmul(dscores.transpose(2, 3), q) * scale, dv


@torch.library.custom_op("foundry_attn::document_attention_backward", mutates_args=())
def document_attention_backward(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    host_bounds: torch.Tensor,
    kind: str,
    window: int,
    scale: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`document_attention` for ``query``, ``key``, ``value``, one document at a time.

    Args:
        grad: the gradient of the forward's output ``[B, H, T, Dv]``, contiguous.
        query: the forward's queries.
        key: the forward's keys.
        value: the forward's values.
        out: the forward's output.
        lse: the forward's logsumexp (empty: each document's probabilities are recomputed in fp32).
        host_bounds: the forward's document bounds, a CPU int32 tensor.
        kind: the forward's ``kind``.
        window: the forward's window (0: none).
        scale: the forward's softmax scale.
        softcap: the forward's score cap (0: none).

    Returns:
        ``(dq, dk, dv)``, shaped like ``query``, ``key`` and ``value``.

    Example::

        >>> q = k = v = torch.randn(1, 8, 40, 64)
        >>> bounds = torch.tensor([0, 17, 40], dtype=torch.int32)
        >>> out, lse = document_attention(q, k, v, bounds, "eager", 0, 0.125, 0.0)
        >>> g = torch.ones_like(out)                                  # the gradient of out.sum()
        >>> dq, dk, dv = document_attention_backward(g, q, k, v, out, lse, bounds, "eager", 0, 0.125, 0.0)
        >>> dq.shape == q.shape   # autograd calls it for you: out.sum().backward()
        True
    """
    groups = _groups(host_bounds, query.device)
    grads = _padded(groups, grad, zero_pads=True)  # a pad row's output is no output: its gradient is zero
    qs, ks, vs = (_padded(groups, t) for t in (query, key, value))
    flash = lse.numel() > 0
    outs, lses = (_padded(groups, out), _padded(groups, lse)) if flash else ([], [])
    pieces = []
    recompute = functools.partial(_document_grads, window=window, scale=scale, softcap=softcap)
    for i, (q, k, v, gradient) in enumerate(zip(qs, ks, vs, grads, strict=True)):
        if flash:
            bias = _window_bias(q.shape[2], window, query)
            pieces.append(
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    gradient, q, k, v, outs[i], lses[i], 0.0, bias is None, attn_mask=bias, scale=scale
                )
            )
        else:
            pieces.append(_in_calls(recompute, q, k, v, gradient))
    # the fake's strides: each gradient like its input
    dq, dk, dv = (
        torch.empty_like(like).copy_(_unpadded(groups, [p[i] for p in pieces]))
        for i, like in enumerate((query, key, value))
    )
    return dq, dk, dv


@document_attention_backward.register_fake
def _(grad, query, key, value, out, lse, host_bounds, kind, window, scale, softcap):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx, inputs, output) -> None:  # torch.library's signature
    query, key, value, host_bounds, kind, window, scale, softcap = inputs
    ctx.save_for_backward(query, key, value, *output, host_bounds)
    ctx.options = (kind, window, scale, softcap)


def _backward(ctx, grad, _lse_grad):
    query, key, value, out, lse, host_bounds = ctx.saved_tensors
    dq, dk, dv = document_attention_backward(grad.contiguous(), query, key, value, out, lse, host_bounds, *ctx.options)
    return dq, dk, dv, None, None, None, None, None


document_attention.register_autograd(_backward, setup_context=_setup_context)
