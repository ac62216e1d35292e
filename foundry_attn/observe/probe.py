"""The attention probe: what a model's forward gives its decoder layers and attention modules.

:class:`ModelInspector` hooks a model (forward pre-hooks with kwargs, through DDP / FSDP / checkpoint /
compile wrapper names), every decoder layer and every attention module found by :func:`discover_modules`,
and records, per module, for one forward: the mask (None, 2-D, 4-D, a flex ``BlockMask``), its dtype and
shape, what it hides beyond causality, read with the model's own alignment (``has_zeros``: padding, other
documents or other keys; ``window``: the model's sliding window; ``mask_hides``: both in words, see
:func:`describe_mask`), real tokens, fill ratio (real / positions), whether ``position_ids`` restart inside a
row (packed), and the attention implementation that runs (:func:`attn_implementation`: HF's
``_attn_implementation``, MPT's ``attn_impl``, ...); :meth:`ModelInspector.capture` shows the use, and
:func:`foundry_attn.observe.console_table.format_table` prints its records as a compact console table.

Imports torch and the core (:mod:`foundry_attn.observe.discovery` finds the modules); the
Composer callback built on it is :class:`foundry_attn.integrations.composer.attention_inspector.AttentionInspector`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from foundry_attn.attention.documents import is_placeholder
from foundry_attn.flat.layout import Layout, padding_spans
from foundry_attn.observe.discovery import ModuleMap, attn_implementation, discover_modules
from foundry_attn.proof.proving import proving

__all__ = [
    "ATTENTION",
    "LAYER",
    "MODEL",
    "BatchInfo",
    "ModelInspector",
    "summarize",
]

MODEL, LAYER, ATTENTION = "model", "layer", "attention"
# ---- what one module was given ------------------------------------------------------------------------------

#: what a callback says once when the model runs under ``torch.compile``, and steps aside
COMPILED = (
    "{owner}: the model runs under {how}; per-call hooks and patches inside a compiled graph would break or "
    "change it, so {owner} steps aside for this run; training goes on"
)


@functools.lru_cache(maxsize=256)
def _parameters(cls: type[nn.Module]) -> tuple[tuple[str, ...], bool] | None:
    """Names of ``cls.forward``'s positional parameters (without self), and whether it takes ``*args``."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = tuple(p.name for p in params if p.kind in kinds)
    if names and names[0] == "self":
        names = names[1:]
    return names, any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)


def _arguments(module: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """A forward call's arguments by parameter name: positional ones named from the signature, keyword
    ones as given (what lands in ``**kwargs`` is flat among them); unnamed extras as ``arg<i>``."""
    spec = _parameters(type(module))  # type: ignore[arg-type]  # a class is hashable; mypy misreads its __hash__
    names = spec[0] if spec is not None else ()
    out = dict(zip(names, args, strict=False))
    for i in range(len(names), len(args)):
        out[f"arg{i}"] = args[i]
    out.update(kwargs)
    return out


def _first_tensor(arguments: Mapping[str, Any]) -> torch.Tensor | None:
    for key in ("input_ids", "inputs_embeds", "hidden_states"):
        value = arguments.get(key)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return value
    return next((v for v in arguments.values() if isinstance(v, torch.Tensor) and v.dim() >= 2), None)


def _query_positions(
    q: int, k: int, cache_position: Any, cached: bool, device: torch.device
) -> tuple[torch.Tensor, int]:
    """Where a 4-D mask's queries sit among its key columns, and how many columns are keys really used.

    The model's own alignment: ``cache_position`` when the call carries it (4.51 passes it; its causal masks are
    ``target_length`` wide, e.g. ``q + 1`` for eager with no 2-D mask, columns past the last query no key);
    else, with a cache of earlier keys, the queries are the last ``q`` of ``k`` keys (5.x sizes masks to the
    keys); else (training, no cache) query ``i`` is key ``i`` and columns beyond ``q`` are no keys.
    """
    if isinstance(cache_position, torch.Tensor) and cache_position.dim() == 1 and cache_position.numel() == q:
        positions = cache_position.to(device=device, dtype=torch.long)
        return positions, min(k, int(positions.max()) + 1)
    if cached and k > q:
        return torch.arange(k - q, k, device=device), k
    return torch.arange(q, device=device), min(k, q)


def _read_4d(mask: torch.Tensor, cache_position: Any, cached: bool, window_hint: int | None = None) -> dict[str, Any]:
    """What a 4-D mask hides beyond causality, aligned as the model aligns it (see :func:`_query_positions`).

    Keys hidden exactly beyond a fixed distance ``w`` from each query are the model's sliding *window* ``w`` (each
    query sees its last ``w`` positions): ``window_hint`` (the config's ``sliding_window``) is checked first, else
    ``w`` is inferred once padding is set aside. A key hidden from every query that causally sees it (within the
    window) is *padding*; the rest is *documents* when each query sees one contiguous run of keys ending at itself
    (packed documents kept apart), else *other keys*. A key hidden in any head counts as hidden; rows that allow
    every column (4.51 sdpa unmasks fully masked rows) are left out. A mask that keeps documents apart inside a
    window the config does not name is read as documents.
    """
    allowed = mask > torch.finfo(mask.dtype).min / 2 if mask.is_floating_point() else mask.bool()
    allowed = allowed.all(dim=1) if allowed.shape[1] > 1 else allowed[:, 0]  # [batch, q, k]
    q, k = allowed.shape[-2:]
    qpos, used = _query_positions(q, k, cache_position, cached, mask.device)
    allowed = allowed[..., :used]
    distance = qpos[:, None] - torch.arange(used, device=mask.device)[None, :]  # [q, used]
    counted = (distance >= 0) & ~allowed.all(dim=-1, keepdim=True)  # [batch, q, used]
    window = None
    if window_hint:
        beyond = counted & (distance >= window_hint)
        if bool(beyond.any()) and not bool((beyond & allowed).any()):
            window, counted = window_hint, counted & (distance < window_hint)
    padding = (counted & allowed).sum(dim=1).eq(0) & counted.any(dim=1)  # [batch, used]: seen by no query
    real = counted & ~padding[:, None, :]
    rest = real & ~allowed
    if window is None and bool(rest.any()):
        w = int(distance.expand_as(rest)[rest].min())
        if bool(torch.equal(rest, real & (distance >= w))):
            window, rest = w, torch.zeros_like(rest)
    hides: list[str] = ["padding"] if bool(padding.any()) else []
    if bool(rest.any()):
        seen = real & allowed
        start = torch.where(seen.any(-1), seen.to(torch.uint8).argmax(-1), qpos.expand(seen.shape[:-1]))
        runs = real & (torch.arange(used, device=mask.device) >= start[..., None])
        hides.append("documents" if bool(torch.equal(seen, runs)) else "other keys")
    return {
        "has_zeros": bool(hides),
        "window": window,
        "mask_hides": ", ".join(hides + ([f"window {window}"] if window else [])) or "nothing",
    }


def describe_mask(
    mask: Any, cache_position: Any = None, cached: bool = False, window_hint: int | None = None
) -> dict[str, Any]:
    """Kind, dtype, shape and what the mask hides (reads device values: sampled batches only).

    ``has_zeros``: the mask hides keys the model's causality and own sliding window would show: a 2-D mask with a
    zero (padding), a 4-D mask hiding padding keys, other documents' keys or other keys (a sliding window alone
    is not counted: it hides keys on purpose). ``window``: the sliding window a 4-D mask applies, else None.
    ``mask_hides``: ``nothing``, ``padding``, ``documents``, ``other keys``, ``window <w>``, comma-joined; None
    when the mask is not read (none, a ``BlockMask``). ``cache_position`` / ``cached`` (a cache of earlier keys
    came with the call) place a 4-D mask's queries as the model does; ``window_hint`` is the model's configured
    sliding window, checked against the mask (a one-query decoding step cannot tell a window from padding alone).

    Args:
        mask: the ``attention_mask`` a module was given: None, a 2-D or 4-D tensor, a ``BlockMask``, ...
        cache_position: the call's ``cache_position``, where it carries one.
        cached: a cache of earlier keys came with the call.
        window_hint: the model's ``sliding_window``, or None.

    Returns:
        ``mask``, ``mask_dtype``, ``mask_shape``, ``has_zeros``, ``window`` and ``mask_hides``; for a 2-D mask also
        ``mask_real`` (its real tokens).

    Example::

        >>> describe_mask(torch.tensor([[1, 1, 1, 0]]))["mask_hides"]
        'padding'
    """
    unread = {"has_zeros": None, "window": None, "mask_hides": None}
    if mask is None or is_placeholder(mask):  # the documents travel as arguments, not in a mask
        return {"mask": "none", "mask_dtype": None, "mask_shape": None, **unread}
    if not isinstance(mask, torch.Tensor):
        shape = getattr(mask, "shape", None)
        return {"mask": type(mask).__name__, "mask_dtype": None, "mask_shape": list(shape) if shape else None, **unread}
    out: dict[str, Any] = {
        "mask": f"{mask.dim()}-D",
        "mask_dtype": str(mask.dtype).replace("torch.", ""),
        "mask_shape": list(mask.shape),
        **unread,
    }
    with torch.no_grad():
        if mask.dim() == 2:
            zeros = bool((mask == 0).any())
            out.update(has_zeros=zeros, mask_hides="padding" if zeros else "nothing")
            out["mask_real"] = int(mask.bool().sum())
        elif mask.dim() == 4 and mask.numel():
            out.update(_read_4d(mask, cache_position, cached, window_hint))
    return out


def _position_restarts(position_ids: Any, mask: Any) -> int | None:
    """How often positions restart inside a row (on real tokens when a matching 2-D mask is given)."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[-1] < 2:
        return None
    with torch.no_grad():
        restart = position_ids[:, 1:] <= position_ids[:, :-1]
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape == position_ids.shape:
            restart &= mask[:, 1:].bool()
        return int(restart.sum())


@dataclasses.dataclass
class BatchInfo:
    """What the collated batch holds: its ``[rows, width]`` and real tokens (from our collator or a mask)."""

    shape: tuple[int, ...] | None = None
    real_tokens: int | None = None

    @classmethod
    def from_batch(cls, batch: Any) -> BatchInfo:
        """Read by :class:`foundry_attn.flat.layout.Layout` (``doc_lens``, else a 2-D mask, else every position but
        the padding of packed rows, :func:`~foundry_attn.flat.layout.padding_spans`); a mask whose rows have gaps (the
        forward refuses it) is counted as it is.

        Args:
            batch: the collated batch (a mapping with ``input_ids``); anything else gives an empty :class:`BatchInfo`.

        Returns:
            Its ``[rows, width]`` and real tokens.

        Example::

            >>> BatchInfo.from_batch({"input_ids": ids, "attention_mask": mask})  # [2, 8], two padding tokens
            BatchInfo(shape=(2, 8), real_tokens=14)
        """
        if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), torch.Tensor):
            return cls()
        try:
            real = Layout.from_batch(batch).real_tokens - sum(e - s for _, s, e in padding_spans(batch))
        except ValueError:
            real = int(batch["attention_mask"].bool().sum())
        return cls(tuple(batch["input_ids"].shape), real)

    @property
    def positions(self) -> int | None:
        """How many positions the batch holds (rows x width).

        Returns:
            The count, or None where the shape is not known.

        Example::

            >>> BatchInfo((2, 8), 14).positions
            16
        """
        return None if self.shape is None else int(torch.Size(self.shape).numel())

    @property
    def fill_ratio(self) -> float | None:
        """The share of the batch's positions that hold real tokens.

        Returns:
            Real tokens / positions, or None where either is not known.

        Example::

            >>> BatchInfo((2, 8), 14).fill_ratio
            0.875
        """
        if self.positions is None or self.real_tokens is None:
            return None
        return self.real_tokens / max(1, self.positions)


class ModelInspector:
    """Pre-hooks (with kwargs) on a model, its decoder layers and attention modules that record one forward.

    ``capture()`` hooks, yields the record list, and unhooks; ``arm()``/``disarm()`` do the same in two steps.
    Only the first forward after ``arm()`` is recorded; hooks never change inputs or outputs.
    """

    def __init__(self, model: nn.Module, attention_selector: str | None = None, modules: ModuleMap | None = None):
        self.model = model
        self.modules = modules if modules is not None else discover_modules(model, attention_selector)
        window = getattr(getattr(model, "config", None), "sliding_window", None)
        self._window_hint = window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None
        self.records: list[dict[str, Any]] = []
        self._handles: list[Any] = []
        self._done = False
        self.batch = BatchInfo()
        self._masks: dict[tuple[int, int, bool], tuple[Any, Any, dict[str, Any]]] = {}
        self._positions: dict[tuple[int, int], tuple[Any, Any, int | None]] = {}

    @property
    def armed(self) -> bool:
        """Whether the hooks are on (between :meth:`arm` and :meth:`disarm`).

        Returns:
            True while hooked.

        Example::

            >>> ModelInspector(llama_model).armed
            False
        """
        return bool(self._handles)

    def targets(self) -> list[tuple[str, int, str, nn.Module]]:
        """What is hooked: the model, its decoder layers, its attention modules, in that order.

        Returns:
            ``(level, index, name, module)`` per target; the model's name is its class's.

        Example::

            >>> [(level, index, name) for level, index, name, _ in ModelInspector(llama_model).targets()][:2]
            [('model', 0, 'LlamaForCausalLM'), ('layer', 0, 'model.layers.0')]
        """
        out = [(MODEL, 0, type(self.model).__name__, self.model)]
        out += [(LAYER, i, n, m) for i, (n, m) in enumerate(self.modules.layers)]
        out += [(ATTENTION, i, n, m) for i, (n, m) in enumerate(self.modules.attention)]
        return out

    def arm(self, batch: BatchInfo | None = None) -> None:
        """Hook every target and start a new record list: the next forward (not the proof's) is recorded.

        Args:
            batch: what the collated batch holds (real tokens for the levels that see it whole); None: not known.

        Example::

            >>> probe = ModelInspector(llama_model)
            >>> probe.arm(BatchInfo.from_batch(padded))
            >>> out = llama_model(**padded)  # fills probe.records, in call order
            >>> probe.disarm()
            >>> [r["level"] for r in probe.records]
            ['model', 'layer', 'attention', 'layer', 'attention']
        """
        self.disarm()
        self.records, self._done, self._masks, self._positions = [], False, {}, {}
        self.batch = batch or BatchInfo()
        for level, index, name, module in self.targets():
            hook = functools.partial(self._pre, level, index, name)
            self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        # marks the forward done even when it raises; hooks are removed later (never inside a hook)
        self._handles.append(self.model.register_forward_hook(self._post, with_kwargs=True, always_call=True))

    def disarm(self) -> None:
        """Every hook off (idempotent); the records stay.

        Example::

            >>> probe = ModelInspector(llama_model)
            >>> probe.arm()
            >>> out = llama_model(**padded)
            >>> probe.disarm()
            >>> probe.armed, len(probe.records)  # the records stay
            (False, 5)
        """
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        self._masks, self._positions = {}, {}

    @contextlib.contextmanager
    def capture(self, batch: BatchInfo | None = None) -> Iterator[list[dict[str, Any]]]:
        """Hooked for a ``with`` block: :meth:`arm`, the record list, :meth:`disarm` (also where the block raised).

        Args:
            batch: what the collated batch holds, as :meth:`arm` takes it.

        Returns:
            A context manager whose value is the record list, filled by the block's first forward.

        Example::

            >>> with ModelInspector(llama_model).capture(BatchInfo.from_batch(padded)) as records:
            ...     out = llama_model(**padded)  # [2, 8], two padding tokens
            >>> records[0]["mask"], records[0]["fill_ratio"]
            ('2-D', 0.875)
        """
        self.arm(batch)
        try:
            yield self.records
        finally:
            self.disarm()

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not proving():  # the flat-path proof's forwards are not the batch's
            self._done = True

    def _mask_info(self, mask: Any, arguments: Mapping[str, Any]) -> dict[str, Any]:
        if mask is None:
            return describe_mask(None)
        cache_position = arguments.get("cache_position")
        cached = any(arguments.get(key) is not None for key in ("past_key_value", "past_key_values"))
        key = (id(mask), id(cache_position), cached)
        hit = self._masks.get(key)
        if hit is None or hit[0] is not mask or hit[1] is not cache_position:
            info = describe_mask(mask, cache_position, cached, self._window_hint)
            hit = self._masks[key] = (mask, cache_position, info)
        return hit[2]

    def _restarts(self, position_ids: Any, mask: Any) -> int | None:
        if not isinstance(position_ids, torch.Tensor):
            return None
        key = (id(position_ids), id(mask))
        hit = self._positions.get(key)
        if hit is None or hit[0] is not position_ids or hit[1] is not mask:
            hit = self._positions[key] = (position_ids, mask, _position_restarts(position_ids, mask))
        return hit[2]

    def _pre(self, level: str, index: int, name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._done or proving():
            return
        try:
            self.records.append(self._record(level, index, name, module, _arguments(module, args, kwargs)))
        except Exception as exc:  # inspection never breaks training
            self.records.append(
                {
                    "level": level,
                    "index": index,
                    "name": name,
                    "cls": type(module).__name__,
                    "error": f"{type(exc).__name__}: {exc}",
                }
            )

    def _record(self, level: str, index: int, name: str, module: nn.Module, arguments: dict) -> dict[str, Any]:
        mask = arguments.get("attention_mask")
        rec: dict[str, Any] = {"level": level, "index": index, "name": name, "cls": type(module).__name__}
        rec.update(self._mask_info(mask, arguments))
        mask_real = rec.pop("mask_real", None)
        x = _first_tensor(arguments)
        rows_width = tuple(x.shape[:2]) if x is not None else None
        positions = rows_width[0] * rows_width[1] if rows_width else None
        cu = arguments.get("cu_seq_lens_q", arguments.get("cu_seqlens_q"))
        if mask_real is not None and isinstance(mask, torch.Tensor) and tuple(mask.shape) == rows_width:
            real, source = mask_real, "mask"
        elif isinstance(cu, torch.Tensor) and cu.numel():
            real, source = int(cu[-1]), "cu_seq_lens"
        elif positions and positions == self.batch.positions and self.batch.real_tokens is not None:  # or flattened
            real, source = self.batch.real_tokens, "batch"
        else:
            real, source = positions, "assumed"
        restarts = self._restarts(arguments.get("position_ids"), mask)
        rec.update(
            {
                "rows_width": list(rows_width) if rows_width else None,
                "real_tokens": real,
                "positions": positions,
                "fill_ratio": (real / positions) if real is not None and positions else None,
                "fill_source": source,
                "position_restarts": restarts,
                "packed_positions": None if restarts is None else restarts > 0,
                "attn_implementation": attn_implementation(self.model),
            }
        )
        return rec


def summarize(records: list[dict[str, Any]], batch: BatchInfo | None = None) -> dict[str, float]:
    """The ``attn/*`` metrics of one forward's records (each key: docs/callbacks.md); the
    ``attn/mask_*_modules`` keys count attention modules by the mask they were given.

    Args:
        records: one forward's records (:meth:`ModelInspector.capture`'s).
        batch: what the collated batch held; None: the model level's record says.

    Returns:
        The metrics by name, as floats.

    Example::

        >>> summarize(records, BatchInfo.from_batch(padded))["attn/mask_4d_modules"]  # a 2-layer Llama on sdpa
        2.0
    """
    attn = [r for r in records if r["level"] == ATTENTION and "error" not in r]
    model = next((r for r in records if r["level"] == MODEL and "error" not in r), None)
    out: dict[str, float] = {
        "attn/inspected_modules": float(len(records)),
        "attn/mask_none_modules": float(sum(r["mask"] == "none" for r in attn)),
        "attn/mask_2d_modules": float(sum(r["mask"] == "2-D" for r in attn)),
        "attn/mask_4d_modules": float(sum(r["mask"] == "4-D" for r in attn)),
        "attn/mask_block_modules": float(sum(r["mask"] == "BlockMask" for r in attn)),
        "attn/mask_with_zeros_modules": float(sum(bool(r["has_zeros"]) for r in attn)),
    }
    fill = batch.fill_ratio if batch is not None else None
    if fill is None and model is not None:
        fill = model["fill_ratio"]
    if fill is not None:
        out["attn/fill_ratio"] = float(fill)
    real = batch.real_tokens if batch is not None else None
    if real is None and model is not None:
        real = model["real_tokens"]
    if real is not None:
        out["attn/real_tokens"] = float(real)
    fills = [r["fill_ratio"] for r in attn if r.get("fill_ratio") is not None]
    if fills:
        out["attn/compute_fill_ratio"] = float(sum(fills) / len(fills))
    if model is not None and model.get("packed_positions") is not None:
        out["attn/packed_position_ids"] = float(model["packed_positions"])
    return out
