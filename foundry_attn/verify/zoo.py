"""A tiny random config for every model type in transformers' causal-LM auto mapping.

    config, model_class = tiny("mistral")   # hidden 64, 2 layers, 4 heads of 16, 2 KV heads, sliding_window=WINDOW
    model = model_class(config)

Each config starts from the config class's defaults and is shrunk generically (``SCALARS``: hidden 64, 2 layers,
4 heads of 16, GQA 2, vocab 128, MoE 4 experts top-2, ...), keeping each family's attention features so that they
bite on short documents: sliding windows and attention chunks of :data:`WINDOW` tokens, a windowed and a global
layer, and one layer of every mixer kind a hybrid has (per-layer lists are cut to their distinct kinds, and
``KINDS`` adds the kinds a family's default config leaves out). Dropouts are 0; sub-configs (text, vision, ...)
are shrunk the same way; ``use_cache`` is off (training). ``FAMILY`` holds the few overrides where the generic
shrink is not enough, each with its reason. These tables live in :mod:`foundry_attn.verify.zoo_tables`; the shrink
that reads them, and the builds, here. A type that cannot train here raises :class:`Unbuildable` with the
reason; any other exception out of :func:`tiny` is a shrink this module gets wrong (a new family: extend the
tables). ``config._attn_implementation`` is left to callers. Works on transformers 4.51 and 5.x.
Core module: torch and transformers only.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import inspect
import itertools
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from foundry_attn.attention.backends import EAGER, SDPA
from foundry_attn.attention.fa2_reference import kernel_context
from foundry_attn.path.attach import attach
from foundry_attn.path.state import PathState
from foundry_attn.verify.zoo_tables import (
    DEFAULT_KWARGS,
    DROPOUT_WORDS,
    EVEN_IF_NONE,
    FAMILY,
    HEAD_DIM,
    HEADS,
    KINDS,
    LAYER_COUNTS,
    LAYERS,
    REQUIRES,
    SCALARS,
    TOKEN_SUFFIXES,
    UNBUILDABLE,
    VOCAB,
    WINDOW,
)


class Unbuildable(Exception):
    """This type cannot be built and trained here; ``str(exc)`` is the reason."""


class _ConfigError(RuntimeError):
    """The shrunk keyword arguments do not make a valid config (a family the tables do not cover yet)."""


def model_types() -> list[str]:
    """The model types of the installed transformers' causal-LM auto mapping, sorted."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _is_dropout(name: str) -> bool:
    return any(w in name for w in DROPOUT_WORDS) and not name.startswith("use_")


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]


@functools.cache
def _base_names() -> frozenset[str]:
    """What the base config class takes as keyword arguments (4.51: pad/bos/eos ids, is_decoder, ...)."""
    return frozenset(PretrainedConfig().to_dict())


def _signature(config_class: type) -> dict[str, Any]:
    """The config class's keyword arguments and their defaults (``inspect.Parameter.empty`` if none)."""
    try:
        params = inspect.signature(config_class).parameters
    except (TypeError, ValueError):
        return {}
    return {k: p.default for k, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}


def _attr(config: PretrainedConfig, name: str) -> Any:
    try:
        return getattr(config, name)
    except Exception:  # per-layer attributes of heterogeneous 5.x configs raise on global access
        return config.__dict__.get(name)


def _layer_count(found: dict[str, Any]) -> int | None:
    for name in LAYER_COUNTS:
        if isinstance(found.get(name), int):
            return int(found[name])
    return None


def _kinds(values: list[Any]) -> list[Any]:
    """The distinct values of a per-layer list, in order of first appearance."""
    out: list[Any] = []
    for v in values:
        if v not in out:
            out.append(v)
    return out


def _padded(kinds: list[Any], layers: int) -> list[Any]:
    return kinds + [kinds[-1]] * (layers - len(kinds))


def _is_index_list(value: list[Any]) -> bool:
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    return ints and all(a < b for a, b in itertools.pairwise(value))


def _shrink_list(name: str, value: list[Any], layers: int | None) -> list[Any] | None:
    """A per-layer list cut to its kinds, a list of layer indices moved into the tiny layers, or None."""
    if not value or any(isinstance(v, (list, dict)) for v in value):
        return None
    if _is_index_list(value) and layers and name.endswith(("idxs", "ids", "indices", "layers")):
        if len(value) == layers:  # every layer
            return list(range(LAYERS))
        return [0] if value[0] == 0 else [LAYERS - 1]
    if (layers and len(value) == layers) or (all(isinstance(v, str) for v in value) and len(set(value)) < len(value)):
        kinds = [HEADS] if "heads" in name else _kinds(value)
        return _padded(kinds, max(LAYERS, len(kinds)))
    return None


def _token_id(value: Any, remap: dict[int, int]) -> Any:
    """Token ids outside the tiny vocabulary moved to its top (the same id stays the same id)."""
    if isinstance(value, list):
        return [_token_id(v, remap) for v in value]
    if not isinstance(value, int) or isinstance(value, bool) or 0 <= value < VOCAB:
        return value
    if value not in remap:
        remap[value] = VOCAB - 1 - len(remap)
    return remap[value]


def _scaled(tiny: int, default_global: Any, default_layer: Any) -> Any:
    """A per-layer override that keeps its ratio to the global value (heterogeneous 5.x configs)."""
    if not all(isinstance(v, int) and v > 0 for v in (default_global, default_layer)):
        return default_layer
    return max(1, round(tiny * default_layer / default_global))


def _layer_value(name: str, value: Any, found: dict[str, Any], kwargs: dict[str, Any]) -> Any:
    """One per-layer override: head counts and head_dim keep their ratio to the global value, other sizes
    take the tiny global value (MLA layers must keep ``head_dim == qk_nope_head_dim + qk_rope_head_dim``)."""
    tiny = kwargs.get(name, SCALARS.get(name))
    if tiny is None:
        return value
    if "heads" in name or name == "head_dim":
        return _scaled(tiny, found.get(name), value)
    return tiny


def _per_layer_config(found: dict[str, Any], kwargs: dict[str, Any], new_types: Any) -> dict[int, dict[str, Any]]:
    """``per_layer_config`` for the tiny layers: each takes the overrides of the default's first layer of its kind."""
    default = {int(k): v for k, v in found["per_layer_config"].items()}
    old_types = found.get("layer_types")
    out: dict[int, dict[str, Any]] = {}
    for i in range(kwargs.get("num_hidden_layers", LAYERS)):
        if isinstance(old_types, list) and isinstance(new_types, list) and new_types[i] in old_types:
            j = old_types.index(new_types[i])
        else:
            j = i
        if j in default:
            out[i] = {k: _layer_value(k, v, found, kwargs) for k, v in default[j].items()}
    return out


def _overrides(config: PretrainedConfig, model_type: str, top: bool = True) -> dict[str, Any]:
    """Keyword arguments that turn the default ``config`` into a tiny one (sub-configs recursively)."""
    found = config.to_dict()
    signature = _signature(type(config))
    alias = {real: name for name, real in getattr(config, "attribute_map", {}).items() if name in signature}
    layers = _layer_count(found)
    out: dict[str, Any] = {}
    remap: dict[int, int] = {}
    need = LAYERS  # layers the per-layer lists need to hold each of their kinds
    for name, value in found.items():
        sub = _attr(config, name)
        if isinstance(sub, PretrainedConfig):
            out[name] = {"model_type": sub.model_type, **_tiny_kwargs(sub, sub.model_type, top=False)}
            continue
        key = name if name in signature else alias.get(name)
        if key is None and name in _base_names() and (top or name.endswith(TOKEN_SUFFIXES) or _is_dropout(name)):
            key = name  # 4.51: the base class's keyword arguments (token ids, dropouts)
        if key is None or key.startswith("_") or name in out:
            continue  # derived in __init__ from what we set
        if key in EVEN_IF_NONE and not value:
            value = None  # None or 0: "derive it" / "no window"; we want one
        elif value is None:
            value = signature.get(key)
            if value is None or value is inspect.Parameter.empty:
                continue
        rule = SCALARS.get(name, SCALARS.get(key))
        if isinstance(value, float) and _is_dropout(name):
            out[key] = 0.0
        elif rule is not None:
            if isinstance(rule, bool) or value is None or (isinstance(value, int) and value > 0):
                out[key] = rule
        elif name.endswith(TOKEN_SUFFIXES):
            out[key] = _token_id(value, remap)
        elif isinstance(value, list) and signature.get(key) is not None:  # an explicit default list
            shrunk = _shrink_list(name, value, layers)
            if shrunk is not None:
                out[key] = shrunk
                need = max(need, len(shrunk))
    rope = found.get("rope_parameters") or found.get("rope_scaling")
    if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list):
        key = "rope_parameters" if "rope_parameters" in found else "rope_scaling"
        out[key] = {**rope, "mrope_section": [3, 3, 2]}  # sums to HEAD_DIM // 2
    if top and "is_decoder" in found and not found.get("is_encoder_decoder"):
        out["is_decoder"] = True  # encoder families in the causal-LM mapping run causally only as decoders
    for name, kinds in KINDS.get(model_type, {}).items():
        if name in signature:
            out[name] = kinds
            need = max(need, len(kinds))
    for count in LAYER_COUNTS:
        if count in out:
            out[count] = need
    if found.get("kv_lora_rank"):  # MLA expands keys to every head: no GQA; head_dim is the rope or the q/k part
        if "num_key_value_heads" in out:
            out["num_key_value_heads"] = HEADS
        if "head_dim" in out and found.get("head_dim") == found.get("qk_rope_head_dim"):
            out["head_dim"] = out.get("qk_rope_head_dim", HEAD_DIM // 2)
    for name, value in FAMILY.get(model_type, {}).items():
        if name in signature or name in found:  # overrides for one stack's fields leave the other alone
            out[name] = {**out[name], **value} if isinstance(value, dict) and isinstance(out.get(name), dict) else value
    return out


def _fix_kinds(default: dict[str, Any], built: PretrainedConfig | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Per-layer lists the tiny config derived without one of the default's kinds or of the wrong length
    (all of the default's per-layer lists when the tiny config could not be built without them)."""
    layers, fixes = _layer_count(default), dict[str, Any]()
    now_layers = _layer_count(built.to_dict()) if built is not None else None
    for name, value in default.items():
        if not isinstance(value, list) or not value or layers is None or len(value) != layers:
            continue
        if any(isinstance(v, (list, dict)) for v in value) or _is_index_list(value) or name in kwargs:
            continue
        now = _attr(built, name) if built is not None else None
        if built is None or (isinstance(now, list) and (not set(value) <= set(now) or len(now) != now_layers)):
            kinds = _kinds(value)
            fixes[name] = _padded(kinds, max(LAYERS, len(kinds)))
    if fixes:
        n = max(len(v) for v in fixes.values())
        for count in LAYER_COUNTS:
            if count in kwargs:
                fixes[count] = max(n, kwargs[count])
    return fixes


def _tiny_kwargs(default: PretrainedConfig, model_type: str, top: bool = True) -> dict[str, Any]:
    """The keyword arguments of the tiny config of ``default``'s class, checked by building it."""
    config_class = type(default)
    kwargs = {**DEFAULT_KWARGS.get(model_type, {}), **_overrides(default, model_type, top)}
    found = default.to_dict()
    for attempt in range(4):
        try:
            built: PretrainedConfig | None = config_class(**copy.deepcopy(kwargs))
        except Exception as exc:
            built = None
            if attempt == 3 or not _fix_kinds(found, None, kwargs):
                msg = f"{config_class.__name__}(**tiny): {type(exc).__name__}: {_first_line(exc)}"
                raise _ConfigError(msg) from exc
        fixes = _fix_kinds(found, built, kwargs)
        if found.get("per_layer_config") and built is not None and "per_layer_config" not in kwargs:
            fixes["per_layer_config"] = _per_layer_config(found, kwargs, _attr(built, "layer_types"))
        if not fixes:
            break
        kwargs.update(fixes)
        if found.get("per_layer_config") and "layer_types" in fixes:
            kwargs["per_layer_config"] = _per_layer_config(found, kwargs, kwargs["layer_types"])
    return kwargs


def _own_config_class(model_type: str) -> type[PretrainedConfig]:
    """transformers' own config class for ``model_type``, not one a library registered under its name (importing
    LLM-Foundry registers its ``MPTConfig`` as ``mpt``)."""
    extra = CONFIG_MAPPING._extra_content
    if model_type not in extra:
        return CONFIG_MAPPING[model_type]
    held = extra.pop(model_type)
    try:
        return CONFIG_MAPPING[model_type]
    finally:
        extra[model_type] = held


def _model_class(config: PretrainedConfig) -> type[PreTrainedModel]:
    try:
        cls: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ValueError, ImportError, AttributeError) as exc:
        raise Unbuildable(f"no causal-LM class importable: {type(exc).__name__}: {_first_line(exc)}") from exc
    if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
        raise Unbuildable(f"the causal-LM mapping gives {cls!r}, not a model class")
    return cls


def _matching(config: PretrainedConfig, model_class: type[PreTrainedModel]) -> PretrainedConfig:
    """The (sub-)config the causal-LM class is built from (Mllama: its text config)."""
    wanted = getattr(model_class, "config_class", None)
    if not isinstance(wanted, type) or isinstance(config, wanted):
        return config
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = _attr(config, name)
        if isinstance(sub, PretrainedConfig) and isinstance(sub, wanted):
            return sub
    return config


@functools.cache
def _tiny_cached(model_type: str) -> tuple[PretrainedConfig, type[PreTrainedModel]]:
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise Unbuildable(f"{model_type!r} is not in this transformers' causal-LM mapping")
    if model_type in UNBUILDABLE:
        raise Unbuildable(UNBUILDABLE[model_type])
    for package in REQUIRES.get(model_type, ()):
        if importlib.util.find_spec(package) is None:
            raise Unbuildable(f"needs the optional package {package!r}, not installed")
    try:
        config_class = _own_config_class(model_type)
    except (KeyError, ImportError, AttributeError) as exc:
        raise Unbuildable(f"no config class: {type(exc).__name__}: {_first_line(exc)}") from exc
    try:
        default = config_class(**copy.deepcopy(DEFAULT_KWARGS.get(model_type, {})))
    except Exception as exc:
        raise Unbuildable(f"{config_class.__name__}() fails: {type(exc).__name__}: {_first_line(exc)}") from exc
    kwargs = _tiny_kwargs(default, model_type)
    config = config_class(**copy.deepcopy(kwargs))
    model_class = _model_class(config)
    return _matching(config, model_class), model_class


def tiny(model_type: str) -> tuple[PretrainedConfig, type[PreTrainedModel]]:
    """A tiny fp32-trainable config of model_type and its causal-LM class; raises Unbuildable(reason)."""
    config, model_class = _tiny_cached(model_type)
    return copy.deepcopy(config), model_class


__all__ = ["WINDOW", "Unbuildable", "model_types", "tiny"]


def build(config: PretrainedConfig, model_class: type[PreTrainedModel], attn_implementation: str) -> Any:
    """``model_class(config)`` built for ``attn_implementation``, seeded, in training mode; parameters the init
    leaves as ``torch.empty`` memory (4.51 Llama4's experts) are re-drawn, so two builds are the same model
    (construction runs with deterministic algorithms, which fill such memory with NaN, to find them)."""
    config = copy.deepcopy(config)
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        model: Any = model_class(config)
    finally:
        torch.use_deterministic_algorithms(before)
    model = model.float().train()
    bad = [n for n, p in model.named_parameters() if not p.isfinite().all() or p.abs().max() > 1e4]
    if bad:
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in bad:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    model._zoo_uninitialised = bad
    return model


def preview(
    model_type: str, backend: str, device: torch.device | str = "cpu", fa2_reference: bool = False
) -> PathState:
    """The path ``backend`` would get for ``model_type`` here: :func:`attach` on a tiny random config of that type
    (:func:`tiny`: the family's windows, GQA, MoE; two layers), on ``device`` (half precision on CUDA).
    What ``foundry-attn doctor --model-config`` prints; a real run proves again on its own weights and batches."""
    config, model_class = tiny(model_type)
    device = torch.device(device)
    config._attn_implementation = backend if backend in (SDPA, EAGER) else EAGER
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        model: Any = model_class(config)  # to mypy, transformers' classes are dummies
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = model.to(device=device, dtype=dtype).eval()
    with kernel_context(backend, device, fa2_reference):
        return attach(model, backend, fa2_reference=fa2_reference)
