"""Document-aware attention functions, registered in transformers' attention interface by name.

    from foundry_attn.paths import attach
    attach(hf_model, "sdpa")            # proven: config._attn_implementation = "foundry_sdpa" (flat), or rows
    out = forward_documents(hf_model, batch)

Each backend (``flash_attention_2``, ``sdpa``, ``eager``, ``flex_attention``) has one function here,
registered once under ``foundry_<backend>`` with ``AttentionInterface.register``. The model runs one flat
row of real tokens, and every layer's call carries the documents as a keyword argument
(``foundry_documents``) that transformers passes through to the attention function. Nothing is patched
for the length of a forward: checkpoint recompute, DDP/FSDP wrappers and ``torch.compile`` re-run the same
call with the same arguments, so they see the same documents.

Each function also honours what the layer passes with the call: ``sliding_window`` (per layer),
``softcap``, ``scaling``, ``dropout``, grouped KV heads. What a backend cannot honour is declared in
:data:`BACKENDS`; :func:`refusal` turns a model that needs it into a reason, and the function itself
raises rather than drop it. Windows follow each backend's stock convention in transformers 4.51: sdpa,
eager and flex let a query see ``sliding_window`` keys (itself included), FA2 ``sliding_window + 1``.
Core module: torch and transformers only.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, cast

import torch
from transformers import modeling_flash_attention_utils as _fa_utils
from transformers.integrations.sdpa_attention import repeat_kv

from foundry_attn.document_op import document_attention, eager_document, eager_math, sdpa_document
from foundry_attn.fa2_reference import reference_flash_attn

DOCS_KEY = "foundry_documents"
PREFIX = "foundry_"
FA2, FLEX, SDPA, EAGER = "flash_attention_2", "flex_attention", "sdpa", "eager"
TORCH_VARLEN = "torch_varlen"  # torch's own varlen flash kernel (>= 2.10, CUDA): FA2's layout without flash-attn
FA2_REFERENCE = "fa2_reference"  # registered as foundry_fa2_reference: FA2 code paths on the CPU reference kernel
#: transformers 5.x picks the flash kernel by the name it is given; 4.51 by what is installed
_FA_NAMES_ITS_KERNEL = "attn_implementation" in inspect.signature(_fa_utils._flash_attention_forward).parameters
_FA_TOP_LEFT = _fa_utils.flash_attn_supports_top_left_mask()  # flash-attn < 2.1 (read once, as transformers does)


class Documents:
    """Where each document sits in the flat row of one forward.

    ``bounds = (0, l0, l0 + l1, ...)`` as Python ints for the eager paths, and the same bounds as int32 tensors
    made once per forward (:meth:`of`): ``cu`` on the model's device (FA2, flex), ``host_bounds`` on the CPU
    (:mod:`foundry_attn.document_op` reads it without a device sync). Under ``torch.compile`` only the tensors
    are read, so a new layout is new data for the same graph, not a new graph. (A plain class, not a dataclass:
    Dynamo guards every field of a dataclass it meets, and only the attributes read of a plain object.)
    """

    def __init__(
        self, bounds: tuple[int, ...], cu: torch.Tensor | None = None, host_bounds: torch.Tensor | None = None
    ) -> None:
        self.bounds, self.cu, self.host_bounds = tuple(bounds), cu, host_bounds
        self.calls = 0  # attention calls that received these documents (uncompiled; the proof reads it)

    def __repr__(self) -> str:
        return f"Documents(bounds={self.bounds})"

    @classmethod
    def of(cls, bounds: tuple[int, ...] | list[int], device: torch.device | str = "cpu") -> Documents:
        host = torch.tensor(bounds, dtype=torch.int32)
        return cls(tuple(bounds), host.to(device, non_blocking=True), host)

    @classmethod
    def from_lengths(cls, lengths: list[int]) -> Documents:
        return cls((0, *itertools.accumulate(lengths)))

    @functools.cached_property
    def spans(self) -> list[tuple[int, int]]:
        return list(itertools.pairwise(self.bounds))

    @functools.cached_property
    def max_length(self) -> int:
        return max((e - s for s, e in self.spans), default=0)

    def cu_seq_lens(self, device: torch.device) -> torch.Tensor:
        if self.cu is not None and self.cu.device == torch.device(device):
            return self.cu
        return torch.tensor(self.bounds, dtype=torch.int32, device=device)

    def host(self) -> torch.Tensor:
        return self.host_bounds if self.host_bounds is not None else torch.tensor(self.bounds, dtype=torch.int32)

    def document_ids(self, device: torch.device) -> torch.Tensor:
        lengths = torch.tensor([e - s for s, e in self.spans])
        return torch.repeat_interleave(torch.arange(len(self.spans)), lengths).to(device)

    def positions(self, device: torch.device) -> torch.Tensor:
        return torch.cat([torch.arange(e - s) for s, e in self.spans]).to(device)[None]


def torch_varlen_kernel() -> Callable | None:
    """``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


_VARLEN_PARAMETERS: dict[Callable, frozenset[str]] = {}


def varlen_parameters(kernel: Callable | None) -> frozenset[str]:
    """The keywords a ``varlen_attn`` takes (2.10-2.11: ``is_causal``; 2.12+: ``window_size``, ``enable_gqa``),
    read once per kernel; empty for None."""
    if kernel is None:
        return frozenset()
    if kernel not in _VARLEN_PARAMETERS:
        _VARLEN_PARAMETERS[kernel] = frozenset(inspect.signature(kernel).parameters)
    return _VARLEN_PARAMETERS[kernel]


def call_varlen(
    kernel: Callable,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    causal: bool = True,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hk, D] -> [T, Hq, D] through torch's ``varlen_attn`` in whichever signature it has:
    a window ``(left, right)`` as flash-attn counts it, grouped KV heads (repeated where there is no
    ``enable_gqa``), and ``scale`` (folded into the query where the kernel takes none)."""
    params = varlen_parameters(kernel)
    left, right = window
    extra: dict[str, Any] = {}
    if "window_size" in params:
        extra["window_size"] = (left, 0 if causal else right)
    elif (left, right) != (-1, -1):
        raise ValueError(f"foundry_attn: torch {torch.__version__} varlen_attn has no window_size (torch >= 2.12)")
    else:
        extra["is_causal"] = causal
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    if "scale" in params:
        extra["scale"] = scale
    elif scale is not None and scale != q.shape[-1] ** -0.5:
        q = q * (scale * q.shape[-1] ** 0.5)
    return kernel(q, k, v, cu_q, cu_k, max_q, max_k, **extra)


@dataclasses.dataclass(frozen=True)
class Backend:
    """What one backend's document-aware function can honour, per layer."""

    name: str
    softcap: bool
    dropout: bool
    window: bool = True
    gqa: bool = True
    causal: bool = True

    @property
    def registered_name(self) -> str:
        return PREFIX + self.name


BACKENDS: dict[str, Backend] = {
    FA2: Backend(FA2, softcap=True, dropout=True),
    SDPA: Backend(SDPA, softcap=False, dropout=True),
    EAGER: Backend(EAGER, softcap=True, dropout=True),
    # softcap as a flex score_mod gives nan gradients under non-reentrant checkpoint recompute (eager flex,
    # torch 2.7): refused until it is proven exact
    FLEX: Backend(FLEX, softcap=False, dropout=False),
    # torch.nn.attention.varlen.varlen_attn: causal only, no softcap, no dropout; windows from torch 2.12
    TORCH_VARLEN: Backend(
        TORCH_VARLEN,
        softcap=False,
        dropout=False,
        window="window_size" in varlen_parameters(torch_varlen_kernel()),
    ),
}


def config_values(config: Any, name: str) -> list[Any]:
    """``config.<name>``, or on a heterogeneous 5.x config (gemma4, dots3: per-layer attributes that raise when
    read globally) the value of every layer; empty when absent."""
    try:
        value = getattr(config, name)
    except AttributeError:
        return []
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError, without importing 5.x names
        layers = getattr(config, "per_layer_config", None) or []
        return [v for layer in layers if (v := getattr(layer, name, None)) is not None]
    return [] if value is None else [value]


def config_value(config: Any, name: str, default: Any = None, pick: Callable = max) -> Any:
    """One value of ``config.<name>`` (``pick`` of the per-layer values on a heterogeneous config), or ``default``."""
    values = config_values(config, name)
    if not values:
        return default
    try:
        return pick(values)
    except TypeError:  # values that do not compare: the first layer's
        return values[0]


@dataclasses.dataclass(frozen=True)
class ModelNeeds:
    """What a model's attention asks of a kernel beyond causal/window/GQA, read from its config."""

    class_name: str = "?"
    softcap: float | None = None
    dropout: float = 0.0
    window: int | None = None

    @classmethod
    def of(cls, class_name: str, config: Any) -> ModelNeeds:
        dropout = max(float(config_value(config, n, 0.0) or 0.0) for n in ("attention_dropout", "attn_pdrop"))
        windowed = config_value(config, "use_sliding_window", True)
        window = config_value(config, "sliding_window", None, min) if windowed else None
        return cls(class_name, config_value(config, "attn_logit_softcapping") or None, dropout, window or None)


def passes_kwargs(model: Any) -> bool:
    """Whether the base model's ``forward`` takes ``**kwargs`` (GPT-2's does not: nothing reaches attention)."""
    base = getattr(model, "base_model", model)
    params = inspect.signature(base.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def refusal(backend: str, needs: ModelNeeds, fa2_version: str | None = None) -> str | None:
    """Why ``backend`` cannot run this model's documents exactly, or None when it can."""
    caps = BACKENDS[backend]
    if needs.softcap and not caps.softcap:
        return f"{backend} cannot apply {needs.class_name}'s attention logit softcap ({needs.softcap}) per document"
    if needs.window and not caps.window:
        return f"{backend} cannot apply {needs.class_name}'s sliding window ({needs.window}) with this torch"
    if needs.dropout and not caps.dropout:
        return f"{backend} cannot apply attention dropout ({needs.dropout}); set attention_dropout: 0 or use sdpa"
    if backend == FA2 and needs.softcap and fa2_version is not None:
        from packaging.version import Version

        if Version(fa2_version) < Version("2.6.0"):
            return f"flash-attn {fa2_version} has no softcap (needs >= 2.6.0) for {needs.class_name}"
    return None


# ---- the attention functions ---------------------------------------------------------------------------


def is_placeholder(mask: Any) -> bool:
    """The ``[1, 1, 1, 1]`` mask ``forward_documents`` hands the model: it masks nothing, and the model's own
    mask code (Gemma's sliding-window step included) passes it on without growing it to L x L."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[-2:] == (1, 1)


class DocumentsDropped(RuntimeError):
    """A layer called attention without our ``foundry_documents`` argument while the flat row was running."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.attention_class = type(module).__name__
        super().__init__(
            f"foundry_attn: the documents did not reach {self.attention_class}: the layer that calls it passed "
            f"no '{DOCS_KEY}' argument (it forwards no **kwargs to attention)"
        )


class FlatUnsupported(ValueError):
    """The attention call carries an argument the flat path does not honour (sinks, a position bias, ...)."""


#: what a layer may pass to attention that the flat row makes moot (positions and lengths are ours, no cache)
IGNORED_KWARGS = frozenset(
    (
        "position_ids",
        "cache_position",
        "past_key_value",
        "past_key_values",
        "use_cache",
        "output_attentions",
        "is_causal",
        "layer_idx",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "position_embeddings",
        "attn_implementation",
    )
)


def unhonoured(kwargs: dict) -> list[str]:
    """The arguments of an attention call that the flat path would drop: any that carries a value and is not
    known to be moot. Refusing them (rather than ignoring) keeps sinks, biases and the like exact."""
    return sorted(
        k
        for k, v in kwargs.items()
        if k not in IGNORED_KWARGS and v is not None and v is not False and not (isinstance(v, float) and v == 0.0)
    )


def _documents(kwargs: dict, attention_mask: Any, query: torch.Tensor, module: torch.nn.Module) -> Documents | None:
    """The documents of this call; a placeholder mask without them means a caller dropped our argument."""
    docs = kwargs.pop(DOCS_KEY, None)
    if docs is None:
        if query.shape[2] > 1 and is_placeholder(attention_mask):
            raise DocumentsDropped(module)
        return None
    extra = unhonoured(kwargs)
    if extra:
        raise FlatUnsupported(
            f"{type(module).__name__} passes {', '.join(repr(k) for k in extra)} to attention, which the flat "
            "path does not honour"
        )
    if not torch.compiler.is_compiling():
        docs.calls += 1
    return docs


def _no_softcap(backend: str, softcap: float | None) -> None:
    if softcap:
        raise ValueError(
            f"foundry_attn: {backend} cannot apply attention logit softcap {softcap}; "
            "use eager, flex_attention or flash_attention_2 for this model"
        )


def sdpa_documents(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """One causal SDPA call per document (a window adds a small per-document mask); no L x L mask."""
    docs = _documents(kwargs, attention_mask, query, module)
    _no_softcap(SDPA, softcap)
    if docs is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    key, value = _expand_kv(query, key, value)
    if torch.compiler.is_compiling():
        out = _compiled(SDPA, query, key, value, docs, sliding_window, scaling, None, dropout)
    else:
        out = torch.cat(
            [
                sdpa_document(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], sliding_window, scaling, dropout)
                for s, e in docs.spans
            ],
            dim=2,
        )
    return out.transpose(1, 2).contiguous(), None


def _compiled(
    kind: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    docs: Documents,
    window: int | None,
    scaling: float | None,
    softcap: float | None,
    dropout: float,
) -> torch.Tensor:
    """Under ``torch.compile``: every document in one opaque op over host-side bounds (no recompile per layout)."""
    if dropout:
        raise ValueError(
            f"foundry_attn: {kind} with attention dropout {dropout} under torch.compile is not "
            "supported; set attention_dropout: 0, or train uncompiled"
        )
    return document_attention(
        query, key, value, docs.host(), kind, window or 0, _scale(query, scaling), softcap or 0.0
    )[0]


def _expand_kv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped KV heads repeated to the query's heads (transformers' ``repeat_kv``)."""
    groups = query.shape[1] // key.shape[1]
    return repeat_kv(key, groups), repeat_kv(value, groups)


def _scale(query: torch.Tensor, scaling: float | None) -> float:
    return scaling if scaling is not None else query.shape[-1] ** -0.5


def _eager(
    module: torch.nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    additive: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """transformers' eager attention with the model's own additive mask (no documents). -> [B, H, S, D].

    Causal (bottom-right) where the module is and the model's mask is not: none, or padding only (GPT-2's
    ``[B, 1, 1, K]``); a full ``[B, 1, Q, K]`` mask is the model's own causal one and is used as it is."""
    k, v = _expand_kv(q, k, v)
    mask = additive[..., : k.shape[-2]] if additive is not None else None
    padding_only = mask is None or mask.shape[-2] == 1
    if padding_only and getattr(module, "is_causal", False) and q.shape[-2] > 1:
        ql, kl = q.shape[-2], k.shape[-2]
        future = torch.ones(ql, kl, dtype=torch.bool, device=q.device).triu_(kl - ql + 1)
        causal = torch.zeros(ql, kl, dtype=q.dtype, device=q.device).masked_fill_(future, torch.finfo(q.dtype).min)
        mask = causal if mask is None else torch.maximum(mask + causal, mask.new_tensor(torch.finfo(q.dtype).min))
    return eager_math(q, k, v, _scale(q, scaling), softcap, mask, dropout, module.training)


def eager_documents(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' eager math, one document at a time (causal and window per document)."""
    docs = _documents(kwargs, attention_mask, query, module)
    if docs is None:
        out = _eager(module, query, key, value, attention_mask, dropout, scaling, softcap)
        return out.transpose(1, 2).contiguous(), None
    key, value = _expand_kv(query, key, value)
    if torch.compiler.is_compiling():
        out = _compiled(
            EAGER, query, key, value, docs, sliding_window, scaling, softcap, dropout if module.training else 0.0
        )
    else:
        scale = _scale(query, scaling)
        out = torch.cat(
            [
                eager_document(
                    query[:, :, s:e],
                    key[:, :, s:e],
                    value[:, :, s:e],
                    sliding_window,
                    scale,
                    softcap,
                    dropout,
                    module.training,
                )
                for s, e in docs.spans
            ],
            dim=2,
        )
    return out.transpose(1, 2).contiguous(), None


class _BlockMasks:
    """Flex ``BlockMask`` per (device, documents, window), built on ``q.device`` (never moved)."""

    def __init__(self, size: int = 16) -> None:
        self.size = size
        self._cache: OrderedDict[tuple, Any] = OrderedDict()

    def get(self, docs: Documents, window: int | None, device: torch.device) -> Any:
        from torch.nn.attention.flex_attention import create_block_mask

        key = (str(device), docs.bounds, window)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        ids = docs.document_ids(device)

        def document_causal(b, h, q_idx, kv_idx):  # flex's mask_mod signature
            same = (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)
            return same & (q_idx - kv_idx < window) if window else same

        total = docs.bounds[-1]
        # torch 2.7 annotates ``device`` as str; it takes a torch.device (and 2.13 says so)
        mask = create_block_mask(document_causal, B=None, H=None, Q_LEN=total, KV_LEN=total, device=device)  # type: ignore[arg-type,unused-ignore]
        self._cache[key] = mask
        if len(self._cache) > self.size:
            self._cache.popitem(last=False)
        return mask


BLOCK_MASKS = _BlockMasks()


@functools.cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_documents(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """One flex call over the flat row with a document ``BlockMask`` (window in the mask, softcap as score_mod).

    Uncompiled on CPU (the only dependable flex there in torch 2.7), compiled elsewhere.
    """
    docs = _documents(kwargs, attention_mask, query, module)
    _no_softcap(FLEX, softcap)
    if dropout:
        raise ValueError(f"foundry_attn: flex_attention cannot apply attention dropout {dropout}")
    if docs is None:
        from transformers.integrations.flex_attention import flex_attention_forward

        out, _ = flex_attention_forward(module, query, key, value, attention_mask, scaling=scaling, softcap=softcap)
        return out, None
    from torch.nn.attention.flex_attention import flex_attention

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / softcap) * softcap

    kernel = flex_attention if query.device.type == "cpu" else _compiled_flex()
    key, value = _expand_kv(query, key, value)
    # a tensor: without return_lse flex_attention returns no (out, lse) pair, which its annotation does not say
    out = cast(
        torch.Tensor,
        kernel(
            query,
            key,
            value,
            score_mod=score_mod if softcap else None,
            block_mask=BLOCK_MASKS.get(docs, sliding_window, query.device),
            scale=scaling,
        ),
    )
    return out.transpose(1, 2).contiguous(), None


def padding_of(mask: Any) -> torch.Tensor | None:
    """The ``[batch, keys]`` real-key mask inside a model's 4-D mask (a key no query may see is padding), for FA2's
    stock unpad; None when every key is real (or there is no mask). Causal and window structure is FA2's own."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return None
    visible = mask if mask.dtype == torch.bool else mask == 0
    real = visible.any(dim=-2)[:, 0]
    return None if bool(real.all()) else real.to(torch.int32)


def _fa2(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
    kwargs: dict,
) -> tuple[torch.Tensor, None]:
    """transformers' own FA2 code path with the documents as ``cu_seq_lens_*`` / ``max_length_*``."""
    docs = _documents(kwargs, attention_mask, query, module)
    if docs is None:  # rows, eval, generation: stock FA2 on the padding the model's own mask holds
        padding = padding_of(attention_mask)
        return _flash_forward(
            module, query, key, value, dropout, scaling, sliding_window, softcap, kwargs, padding
        ), None
    cu = docs.cu_seq_lens(query.device)
    # compiled: the row length bounds every document and is already a (dynamic) shape, so no guard on the layout
    longest = query.shape[2] if torch.compiler.is_compiling() else docs.max_length
    kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    if kwargs.get("position_ids") is None:  # 4.51 takes the varlen path only when position_ids is given
        kwargs["position_ids"] = docs.positions(query.device)
    return _flash_forward(module, query, key, value, dropout, scaling, sliding_window, softcap, kwargs), None


def _flash_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
    kwargs: dict,
    padding: torch.Tensor | None = None,
) -> torch.Tensor:
    """transformers' ``_flash_attention_forward`` as its own ``flash_attention_forward`` calls it, but for the
    stock FA2 kernel by name: 5.x resolves the kernel from ``config._attn_implementation``, which is ours here.
    ``padding``: a 2-D mask of real keys (stock's per-layer unpad), for calls without our documents."""
    if _FA_NAMES_ITS_KERNEL:
        kwargs["attn_implementation"] = FA2
    kwargs.pop("is_causal", None)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    target = None
    if q.dtype == torch.float32:  # PEFT-style fp32 activations: back to what the kernel computes in
        if torch.is_autocast_enabled(q.device.type):
            target = torch.get_autocast_dtype(q.device.type)
        else:  # the projections' dtype (GPT-2's are Conv1D, not Linear)
            target = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    return _fa_utils._flash_attention_forward(
        q,
        k,
        v,
        padding,
        query_length=query.shape[2],
        is_causal=cast(bool, module.is_causal),
        dropout=dropout,
        softmax_scale=scaling,
        sliding_window=sliding_window,
        softcap=softcap,
        use_top_left_mask=_FA_TOP_LEFT,
        target_dtype=target,
        **kwargs,
    )


def fa2_documents(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """FA2 varlen through transformers' FA2 code path: no per-layer unpad, no host sync."""
    return _fa2(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, kwargs)


def fa2_reference_documents(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """:func:`fa2_documents` on the pure-PyTorch REFERENCE kernel (not flash-attn), installed for this call only."""
    with reference_flash_attn():
        return _fa2(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, kwargs)


def torch_varlen_documents(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """PyTorch's varlen flash kernel over the flat row: the FA2 layout (``cu_seqlens``, no per-layer unpad, no
    host sync) without flash-attn. A window lets a query see ``sliding_window`` keys (as our sdpa does)."""
    docs = _documents(kwargs, attention_mask, query, module)
    _no_softcap(TORCH_VARLEN, softcap)
    if dropout:
        raise ValueError(f"foundry_attn: torch_varlen cannot apply attention dropout {dropout}")
    if docs is None:  # rows, eval, generation: stock sdpa on the model's own mask, what the rows path runs
        return sdpa_documents(module, query, key, value, attention_mask, dropout, scaling, sliding_window, **kwargs)
    kernel = torch_varlen_kernel()
    if kernel is None:
        raise ValueError(f"foundry_attn: torch {torch.__version__} has no torch.nn.attention.varlen (torch >= 2.10)")
    cu = docs.cu_seq_lens(query.device)
    longest = query.shape[2] if torch.compiler.is_compiling() else docs.max_length
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [1, H, T, D] -> [T, H, D]
    window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
    out = call_varlen(kernel, q, k, v, cu, cu, longest, longest, scale=_scale(query, scaling), window=window)
    return out[None], None


FUNCTIONS = {
    FA2: fa2_documents,
    TORCH_VARLEN: torch_varlen_documents,
    SDPA: sdpa_documents,
    EAGER: eager_documents,
    FLEX: flex_documents,
    FA2_REFERENCE: fa2_reference_documents,
}
REGISTERED = {PREFIX + name: name for name in FUNCTIONS}  # registered name -> backend (or fa2_reference)


@functools.cache
def register() -> None:
    """Register every function with transformers (idempotent; registering changes nothing for other names)."""
    from transformers.modeling_utils import AttentionInterface

    for name, fn in FUNCTIONS.items():
        AttentionInterface.register(PREFIX + name, fn)
    try:  # transformers 5.x builds masks per name, and none at all for a name it does not know
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:  # 4.51: the model's own mask code builds a 4-D mask for any name but its own
        return
    masks = {SDPA: SDPA, FLEX: FLEX}  # FA2, torch_varlen and eager take the additive mask on their mask branch
    for name in FUNCTIONS:
        AttentionMaskInterface.register(PREFIX + name, ALL_MASK_ATTENTION_FUNCTIONS[masks.get(name, EAGER)])


def backend_of(impl: str | None) -> str | None:
    """``foundry_sdpa`` -> ``sdpa``; ``foundry_fa2_reference`` -> ``flash_attention_2``; stock names unchanged."""
    name = REGISTERED.get(impl or "", impl)
    return FA2 if name == FA2_REFERENCE else name


def point(model: Any, backend: str | None = None, fa2_reference: bool = False) -> str:
    """Point ``model``'s attention at our function for ``backend`` (default: its current one), unproven.

    Low level: :func:`foundry_attn.paths.attach` points, proves the flat path against stock and records the
    path; ``forward_documents`` runs a model that was only pointed one document per row.
    Returns the name now in ``config._attn_implementation``.
    """
    register()
    backend = backend or backend_of(model.config._attn_implementation)
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; valid: {', '.join(BACKENDS)}")
    name = PREFIX + (FA2_REFERENCE if backend == FA2 and fa2_reference else backend)
    model.config._attn_implementation = name
    return name
