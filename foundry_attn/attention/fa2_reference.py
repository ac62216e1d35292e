"""A pure-PyTorch *reference* of flash-attn's ``flash_attn_func`` / ``flash_attn_varlen_func``.

It is NOT flash-attn: it is slow, exact (fp32 softmax) and exists so the real FA2 code paths of
transformers run on a CPU, for tests and diagnosis. The policy never selects it; a model uses it only
when a YAML says so explicitly, and then logs that loudly:

    model:
      name: foundry_attn_causal_lm
      attn_implementation: flash_attention_2
      fa2_reference_kernel: true      # CPU diagnosis only

    with reference_flash_attn():      # in Python
        model(**batch)

Semantics follow flash-attn >= 2.1: keyword API, causal mask aligned bottom-right, GQA by head
groups, ``softmax_scale`` default ``1/sqrt(head_dim)``, sliding ``window_size``, ``softcap``.
Dropout must be 0. Core module: torch and transformers only.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from foundry_attn.attention.backends import FA2
from foundry_attn.patching import Patch, patch_attribute

REFERENCE_NAME = "fa2-reference (pure PyTorch, not flash-attn)"


def _segment_mask(
    cu_q: torch.Tensor, cu_k: torch.Tensor, tq: int, tk: int, causal: bool, window: Sequence[int]
) -> torch.Tensor:
    """[tq, tk] bool: may query i see key j (same sequence, causal/window as flash-attn). Made on the bounds' device
    from the row lengths ``tq``/``tk`` (the tensors' own shapes): no host sync; zero-length sequences are skipped."""
    lens_q, lens_k = cu_q.diff().long(), cu_k.diff().long()
    seg_q = torch.searchsorted(cu_q[1:], torch.arange(tq, device=cu_q.device, dtype=cu_q.dtype), right=True)
    seg_k = torch.searchsorted(cu_k[1:], torch.arange(tk, device=cu_k.device, dtype=cu_k.dtype), right=True)
    pos_q = torch.arange(tq, device=cu_q.device) - cu_q.long()[seg_q]
    pos_k = torch.arange(tk, device=cu_k.device) - cu_k.long()[seg_k]
    # flash-attn >= 2.1 aligns the causal diagonal bottom-right: query i sits at key i + (len_k - len_q)
    shift = torch.cat([lens_k - lens_q, lens_k.new_zeros(1)])[seg_q]  # a token past the last bound: no shift
    rel = pos_k[None, :] - (pos_q + shift)[:, None]  # key offset relative to the query's diagonal
    allowed = seg_q[:, None] == seg_k[None, :]
    left, right = window
    if causal:
        right = 0
    if right >= 0:
        allowed &= rel <= right
    if left >= 0:
        allowed &= rel >= -left
    return allowed


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    softmax_scale: float | None,
    softcap: float,
) -> torch.Tensor:
    """q [Tq, Hq, D], k/v [Tk, Hk, D(v)], allowed [Tq, Tk] -> [Tq, Hq, D(v)] in q's dtype, contiguous (as flash-attn
    returns it: callers ``.view`` it)."""
    hq, hk = q.shape[1], k.shape[1]
    if hq % hk:
        raise ValueError(f"number of query heads {hq} is not a multiple of key/value heads {hk}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qf, kf, vf = (t.float().transpose(0, 1) for t in (q, k, v))  # [H, T, D]
    kf, vf = kf.repeat_interleave(hq // hk, 0), vf.repeat_interleave(hq // hk, 0)
    scores = qf @ kf.transpose(1, 2) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query with no key gets zeros, as in flash-attn
    return (probs @ vf).transpose(0, 1).to(q.dtype).contiguous()


def _check_unsupported(dropout_p: float, alibi_slopes: object, return_attn_probs: bool) -> None:
    if dropout_p:
        raise NotImplementedError("fa2 reference: dropout_p must be 0 (it is an exact reference)")
    if alibi_slopes is not None or return_attn_probs:
        raise NotImplementedError("fa2 reference: alibi_slopes and return_attn_probs are not supported")


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: object = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: object = None,
) -> torch.Tensor:
    """Reference of ``flash_attn.flash_attn_varlen_func``: q [total_q, Hq, D] -> [total_q, Hq, D].

    Args:
        q: the queries of every sequence, concatenated ``[total_q, Hq, D]``.
        k: the keys ``[total_k, Hk, D]`` (``Hq`` a multiple of ``Hk``).
        v: the values ``[total_k, Hk, Dv]``.
        cu_seqlens_q: int32 query bounds ``(0, l0, l0 + l1, ...)``.
        cu_seqlens_k: int32 key bounds, likewise.
        max_seqlen_q: the longest query sequence (taken for the signature; the bounds decide).
        max_seqlen_k: the longest key sequence (likewise).
        dropout_p: must be 0.
        softmax_scale: the softmax scale (None: ``1/sqrt(D)``).
        causal: causal within each sequence, aligned bottom-right.
        window_size: ``(left, right)`` keys a query sees beside its diagonal (-1: unbounded).
        softcap: caps the scores at ``softcap * tanh(scores / softcap)`` (0: no cap).
        alibi_slopes: must be None.
        deterministic: taken for the signature (the reference always is).
        return_attn_probs: must be False.
        block_table: taken for the signature; ignored.

    Returns:
        The output ``[total_q, Hq, Dv]`` in ``q``'s dtype, contiguous.

    Raises:
        NotImplementedError: dropout, ALiBi or attention probabilities were asked for.

    Example::

        >>> q, k, v = torch.randn(7, 4, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 8)  # 4 query heads, 2 KV heads
        >>> cu = torch.tensor([0, 3, 7], dtype=torch.int32)  # two sequences: 3 and 4 tokens
        >>> flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, causal=True).shape
        torch.Size([7, 4, 8])
    """
    _check_unsupported(dropout_p, alibi_slopes, return_attn_probs)
    allowed = _segment_mask(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], causal, tuple(window_size))
    return _attend(q, k, v, allowed, softmax_scale, softcap)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: object = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> torch.Tensor:
    """Reference of ``flash_attn.flash_attn_func``: q [B, Sq, Hq, D] -> [B, Sq, Hq, D(v)].

    Args:
        q: the queries ``[B, Sq, Hq, D]``.
        k: the keys ``[B, Sk, Hk, D]`` (``Hq`` a multiple of ``Hk``).
        v: the values ``[B, Sk, Hk, Dv]``.
        dropout_p: must be 0.
        softmax_scale: the softmax scale (None: ``1/sqrt(D)``).
        causal: causal, aligned bottom-right.
        window_size: ``(left, right)`` keys a query sees beside its diagonal (-1: unbounded).
        softcap: caps the scores at ``softcap * tanh(scores / softcap)`` (0: no cap).
        alibi_slopes: must be None.
        deterministic: taken for the signature (the reference always is).
        return_attn_probs: must be False.

    Returns:
        The output ``[B, Sq, Hq, Dv]`` in ``q``'s dtype.

    Raises:
        NotImplementedError: dropout, ALiBi or attention probabilities were asked for.

    Example::

        >>> q, k, v = torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 8), torch.randn(2, 5, 2, 8)
        >>> flash_attn_func(q, k, v, causal=True).shape
        torch.Size([2, 5, 4, 8])
    """
    _check_unsupported(dropout_p, alibi_slopes, return_attn_probs)
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=q.device)
    cu_k = torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32, device=q.device)
    allowed = _segment_mask(cu_q, cu_k, b * sq, b * sk, causal, tuple(window_size))
    out = _attend(
        q.reshape(b * sq, *q.shape[2:]),
        k.reshape(b * sk, *k.shape[2:]),
        v.reshape(b * sk, *v.shape[2:]),
        allowed,
        softmax_scale,
        softcap,
    )
    return out.reshape(b, sq, q.shape[2], v.shape[-1])


# flash_attn.bert_padding equivalents, which transformers imports next to the kernels
def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``bert_padding.index_first_axis``: the rows ``indices`` of ``x``.

    Args:
        x: a tensor of flattened tokens ``[B * S, ...]``.
        indices: the rows to take.

    Returns:
        ``x[indices]``.

    Example::

        >>> x = torch.randn(2, 3, 4, 8)               # two rows of 3 tokens, the last one padding
        >>> indices = torch.tensor([0, 1, 2, 3, 4])   # the 5 real tokens
        >>> index_first_axis(x.reshape(6, 4, 8), indices).shape
        torch.Size([5, 4, 8])
    """
    return x[indices]


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """``bert_padding.pad_input``: unpadded tokens back into a zero-padded batch.

    Args:
        hidden_states: the real tokens ``[total, ...]``.
        indices: their positions in the flattened ``[batch * seqlen]`` batch (from :func:`unpad_input`).
        batch: the batch size.
        seqlen: the padded sequence length.

    Returns:
        The batch ``[batch, seqlen, ...]``, zeros at the padding.

    Example::

        >>> flat, indices, *_ = unpad_input(torch.randn(2, 3, 4, 8), torch.tensor([[1, 1, 1], [1, 1, 0]]))
        >>> padded = pad_input(flat, indices, 2, 3)   # flat: [5, 4, 8]
        >>> padded.shape, padded[1, 2].abs().sum().item()   # the padding: zeros
        (torch.Size([2, 3, 4, 8]), 0.0)
    """
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out[indices] = hidden_states
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: object = None):
    """``bert_padding.unpad_input``: the real tokens of a padded batch, flattened.

    Args:
        hidden_states: the padded batch ``[B, S, ...]``.
        attention_mask: ``[B, S]``, 1 for a real token.
        unused_mask: taken for flash-attn >= 2.7's signature; ignored.

    Returns:
        ``(tokens [total, ...], indices, cu_seqlens, max_seqlen, seqlens)``.

    Example::

        >>> x = torch.randn(2, 3, 4, 8)   # two rows of 3 tokens, the last one padding
        >>> flat, indices, cu, longest, lengths = unpad_input(x, torch.tensor([[1, 1, 1], [1, 1, 0]]))
        >>> flat.shape, cu, longest
        (torch.Size([5, 4, 8]), tensor([0, 3, 5], dtype=torch.int32), 3)
    """
    seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])[indices]
    return flat, indices, cu_seqlens, int(seqlens.max()), seqlens


def _always_true(*_args: object, **_kwargs: object) -> bool:
    return True


_KERNELS = {
    "flash_attn_func": flash_attn_func,
    "flash_attn_varlen_func": flash_attn_varlen_func,
    "pad_input": pad_input,
    "unpad_input": unpad_input,
    "index_first_axis": index_first_axis,
    "_flash_supports_window_size": True,
}
_AVAILABILITY = ("is_flash_attn_2_available", "is_flash_attn_available")
_FA_MODULES = ("transformers.modeling_flash_attention_utils",)
_CHECK_MODULES = (
    "transformers.modeling_flash_attention_utils",
    "transformers.modeling_utils",
    "transformers.utils",
    "transformers.utils.import_utils",
)


#: transformers 5.x: the kernels come from ``lazy_import_flash_attention(name)``, which caches what
#: ``_lazy_imports`` returned in these globals; the reference resets them on entry and restores them on exit
_LAZY_IMPORTS = "_lazy_imports"
_LAZY_CACHE = (
    "_loaded_implementation",
    "_flash_fn",
    "_flash_varlen_fn",
    "_flash_with_kvcache_fn",
    "_pad_fn",
    "_unpad_fn",
    "_process_flash_kwargs_fn",
    "_process_with_kvcache_kwargs_fn",
)


def _reference_lazy_imports(
    implementation: str | None,
    *args: object,
    dense: Callable = flash_attn_func,
    varlen: Callable = flash_attn_varlen_func,
    **kwargs: object,
) -> tuple:
    """5.x ``_lazy_imports``: (dense, varlen, kvcache, pad, unpad) for ``flash_attention_2``."""
    if implementation not in (None, "flash_attention_2"):
        raise ValueError(f"fa2 reference: only flash_attention_2 runs on the reference kernel, not {implementation!r}")
    return dense, varlen, None, pad_input, unpad_input


_active = 0  # how many reference_flash_attn blocks are open (the tracer asks whether a kernel ran under one)


def active() -> bool:
    """Whether transformers' FA2 code runs on the reference (or a stand-in) kernel right now, not flash-attn.

    Returns:
        True inside a :func:`reference_flash_attn` block.

    Example::

        >>> active()
        False
        >>> with reference_flash_attn(): print(active())
        True
    """
    return _active > 0


@contextlib.contextmanager
def reference_flash_attn(varlen: Callable | None = None, dense: Callable | None = None) -> Iterator[None]:
    """Install the reference kernels where transformers looks them up; restore everything on exit.

    ``varlen`` / ``dense``: other kernels to install instead, with the signatures of flash-attn's
    ``flash_attn_varlen_func`` / ``flash_attn_func`` (e.g. PyTorch's own varlen kernel behind a wrapper, so
    transformers' stock FA2 code path runs on a GPU without flash-attn: ``foundry_attn.bench.gpu``). Each
    defaults to the pure-PyTorch reference above; the padding helpers are always the reference's.

    Patches the module globals of ``transformers.modeling_flash_attention_utils`` (which it reads at
    call time; in 5.x its ``_lazy_imports`` and the kernel cache of ``lazy_import_flash_attention``) and
    makes ``is_flash_attn_2_available`` answer True. The patches are replacement layers
    (``foundry_attn.patching``): they sit *beneath* any tracer wrapper (``upad_tracer``),
    so a tracer attached before or after still counts the calls, and contexts and tracers may close in
    any order. Nests with itself.

    Args:
        varlen: the kernel to install as ``flash_attn_varlen_func`` (None: the reference).
        dense: the kernel to install as ``flash_attn_func`` (None: the reference).

    Returns:
        A context manager; the kernels are in place while it is open.

    Example::

        >>> with reference_flash_attn():  # transformers' stock FA2 path, on a CPU
        ...     out = model(**batch)
    """
    dense, varlen = dense or flash_attn_func, varlen or flash_attn_varlen_func
    kernels = {**_KERNELS, "flash_attn_func": dense, "flash_attn_varlen_func": varlen}
    lazy_imports = (
        _reference_lazy_imports
        if dense is flash_attn_func and varlen is flash_attn_varlen_func
        else functools.partial(_reference_lazy_imports, dense=dense, varlen=varlen)
    )
    patches: list[Patch] = []
    try:
        for mod_name in _FA_MODULES:
            mod = importlib.import_module(mod_name)
            for name, value in kernels.items():
                patches.append(patch_attribute(mod, name, replace=value))
            if _LAZY_IMPORTS in mod.__dict__:  # 5.x
                patches.append(patch_attribute(mod, _LAZY_IMPORTS, replace=lazy_imports))
                for name in _LAZY_CACHE:
                    if name in mod.__dict__:
                        patches.append(patch_attribute(mod, name, replace=None))
        for mod_name in _CHECK_MODULES:
            mod = importlib.import_module(mod_name)
            for name in _AVAILABILITY:
                if name in mod.__dict__:
                    patches.append(patch_attribute(mod, name, replace=_always_true))
        global _active
        _active += 1
        try:
            yield
        finally:
            _active -= 1
    finally:
        for patch in reversed(patches):
            patch.remove()


def kernel_context(impl: str, device: torch.device, fa2_reference: bool = False) -> contextlib.AbstractContextManager:
    """The FA2 reference kernel around a block that runs transformers' *stock* FA2 code (CPU stand-in).

    Models attached with ``attach(model, "flash_attention_2", fa2_reference=True)`` need no context: their
    attention function installs the reference kernel for each call itself.

    Args:
        impl: the attention implementation the block runs (only ``flash_attention_2`` gets the kernel).
        device: the device the block runs on (not read).
        fa2_reference: whether to install the reference kernel.

    Returns:
        :func:`reference_flash_attn` for ``flash_attention_2`` with ``fa2_reference``, else a null context.

    Example::

        >>> with kernel_context("flash_attention_2", torch.device("cpu"), fa2_reference=True):
        ...     stock = model(**batch)
    """
    if impl == FA2 and fa2_reference:
        return reference_flash_attn()
    return contextlib.nullcontext()
