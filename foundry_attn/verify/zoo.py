"""A tiny random config for every model type in transformers' causal-LM auto mapping.

    config, model_class = tiny("mistral")   # hidden 64, 2 layers, 4 heads of 16, 2 KV heads, sliding_window=WINDOW
    model = model_class(config)

Each config starts from the config class's defaults and is shrunk generically (``_SCALARS``: hidden 64, 2 layers,
4 heads of 16, GQA 2, vocab 128, MoE 4 experts top-2, ...), keeping each family's attention features so that they
bite on short documents: sliding windows and attention chunks of :data:`WINDOW` tokens, a windowed and a global
layer, and one layer of every mixer kind a hybrid has (per-layer lists are cut to their distinct kinds, and
``_KINDS`` adds the kinds a family's default config leaves out). Dropouts are 0; sub-configs (text, vision, ...)
are shrunk the same way; ``use_cache`` is off (training). ``_FAMILY`` holds the few overrides where the generic
shrink is not enough, each with its reason. A type that cannot train here raises :class:`Unbuildable` with the
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
import transformers
from transformers import PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from foundry_attn.attention.backends import EAGER, SDPA
from foundry_attn.attention.fa2_reference import kernel_context
from foundry_attn.flat.attach import attach
from foundry_attn.flat.state import PathState

WINDOW = 4
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 2, 4, 2, 16
FFN, EXPERT_FFN, VOCAB, POSITIONS = 64, 32, 128, 128
EXPERTS, TOP_K = 4, 2
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers")


class Unbuildable(Exception):
    """This type cannot be built and trained here; ``str(exc)`` is the reason."""


class _ConfigError(RuntimeError):
    """The shrunk keyword arguments do not make a valid config (a family the tables do not cover yet)."""


def model_types() -> list[str]:
    """The model types of the installed transformers' causal-LM auto mapping, sorted."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _names(*names: str, value: Any) -> dict[str, Any]:
    return dict.fromkeys(names, value)


# attribute name -> tiny value, applied where the config class takes the attribute
_SCALARS: dict[str, Any] = {
    **_names("hidden_size", "d_model", "n_embd", "embedding_dim", "emb_dim", "lru_width", value=HIDDEN),
    **_names("word_embed_proj_dim", "backbone_hidden_size", "hidden_size_global", value=HIDDEN),
    **_names("embedding_size", "input_embedding_size", "output_embedding_size", value=HIDDEN),
    **_names("adapter_in_dim", "adapter_input_size", "adapter_out_dim", "out_hidden_size", value=HIDDEN),
    **_names(*_LAYER_COUNTS, "encoder_layers", "num_decoder_layers", "num_encoder_layers", value=LAYERS),
    **_names("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads", value=HEADS),
    **_names("decoder_attention_heads", "encoder_attention_heads", "swa_num_attention_heads", value=HEADS),
    **_names("num_decoder_attention_heads", "num_encoder_attention_heads", value=HEADS),
    **_names("num_key_value_heads", "num_kv_heads", "swa_num_key_value_heads", "kv_n_heads", value=KV_HEADS),
    **_names("head_dim", "attention_head_dim", "attention_head_size", "d_head", "dim_head", value=HEAD_DIM),
    **_names("kv_channels", "swa_head_dim", "v_head_dim", "index_head_dim", "indexer_head_dim", value=HEAD_DIM),
    **_names("linear_key_head_dim", "linear_value_head_dim", "linear_head_dim", "d_rel", value=HEAD_DIM),
    **_names("qk_rope_head_dim", "qk_nope_head_dim", "rotary_dim", value=HEAD_DIM // 2),
    **_names("q_lora_rank", "kv_lora_rank", "o_lora_rank", "adapter_rank", "laurel_rank", "hc_lowrank", value=32),
    **_names("index_n_heads", "linear_num_heads", "linear_num_value_heads", "indexer_n_heads", value=HEADS),
    **_names("linear_num_key_heads", value=KV_HEADS),
    **_names("intermediate_size", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "d_inner", "dff", value=FFN),
    **_names("dim_ff", "ffn_hidden_size", "feed_forward_size", "intermediate_size_mlp", value=FFN),
    **_names("dense_intermediate_size", "prefix_dense_intermediate_size", "router_hidden_size", value=FFN),
    **_names("moe_intermediate_size", "expert_ffn_hidden_size", "shared_expert_intermediate_size", value=EXPERT_FFN),
    **_names("moe_shared_expert_intermediate_size", "shared_experts_intermediate_size", value=EXPERT_FFN),
    **_names("shared_intermediate_size", "ple_embed_dim", "hidden_size_per_layer_input", value=EXPERT_FFN),
    **_names("vocab_size", "decoder_vocab_size", "unpadded_vocab_size", "vocab_size_per_layer_input", value=VOCAB),
    **_names("encoder_hash_byte_group_vocab", "pronunciation_vocab_size", "shape_vocab_size", value=VOCAB),
    # towers a causal LM builds but text never runs through (vision, audio): small, so that they build fast
    **_names("pronunciation_embed_dim", "shape_embed_dim", "mm_embed_dim", "audio_embed_dim", value=HIDDEN),
    **_names("output_proj_dims", "mlp_dim", "nemo_conv_channels", "ext_pw_out_channel", value=HIDDEN),
    **_names("depthwise_separable_out_channel", value=HIDDEN),
    **_names("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_target_positions", value=POSITIONS),
    **_names("context_length", "model_max_length", "max_source_positions", value=POSITIONS),
    **_names("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", value=EXPERTS),
    **_names("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token", "top_k_experts", value=TOP_K),
    **_names("n_group", "num_expert_group", value=2),
    **_names("topk_group", value=1),
    **_names("n_shared_experts", "num_shared_experts", "moe_num_shared_experts", "zero_expert_num", value=1),
    **_names("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index", value=1),
    **_names("decoder_sparse_step", "moe_layer_interval", "interleave_moe_layer_step", value=1),
    # attention windows and chunks, so that they bite on short documents
    **_names("sliding_window", "attention_chunk_size", "attention_window_size", "window_size", value=WINDOW),
    **_names("local_attention", "local_attention_window_len", "sliding_window_size", "keep_window_size", value=WINDOW),
    **_names("index_topk", value=WINDOW),
    **_names("use_sliding_window", value=True),
    **_names("max_window_layers", value=1),  # 2 layers: one windowed under either convention (i >= 1 or i < 1)
    **_names("sliding_window_pattern", "global_attn_every_n_layers", "no_rope_layer_interval", value=2),
    # hybrids: the other mixer at layer 0, attention (or MoE) at layer 1
    **_names("attn_layer_period", "expert_layer_period", "layer_group_size", value=2),
    **_names("attn_layer_offset", "expert_layer_offset", value=1),
    # state-space / linear mixers (torch paths, no kernels)
    **_names("state_size", "mamba_d_state", "ssm_state_size", value=8),
    **_names("mamba_d_head", "mamba_head_dim", "mamba_headdim", value=HEAD_DIM),
    **_names("mamba_n_heads", "mamba_num_heads", value=2 * HIDDEN // HEAD_DIM),
    **_names("mamba_n_groups", "n_groups", "mamba_ngroups", value=1),
    **_names("time_step_rank", "mamba_dt_rank", value=8),
    **_names("mamba_d_ssm", value=2 * HIDDEN),
    **_names("chunk_size", "mamba_chunk_size", value=16),
    **_names("use_mamba_kernels", "use_mem_eff_path", value=False),
    # training: no KV cache (4.51 Llama4 builds a bf16 HybridChunkedCache from its config otherwise)
    **_names("use_cache", "output_router_logits", value=False),
}

# set even where the default is None (None there means "derive it" or "no window": we want one)
_EVEN_IF_NONE = frozenset(
    {"head_dim", "sliding_window", "num_key_value_heads", "n_routed_experts", "num_experts_per_tok", "n_shared_experts"}
)

_DROPOUT_WORDS = ("dropout", "pdrop", "layerdrop", "dropatt", "drop_rate", "dropout_p")
_TOKEN_SUFFIXES = ("token_id", "token_ids", "token_index", "_index", "_idx")

# layer kinds a family supports that its default config leaves out (the default is all one kind)
_KINDS: dict[str, dict[str, list[str]]] = {
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},  # default: all mamba
    "lfm2": {"layer_types": ["conv", "full_attention"]},  # default: all attention
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "ministral": {"layer_types": ["sliding_attention", "full_attention"]},
    "laguna": {"layer_types": ["sliding_attention", "full_attention"]},
    "mellum": {"layer_types": ["sliding_attention", "full_attention"]},
    "cohere_compass_text": {"layer_types": ["sliding_attention", "full_attention"]},
    "zaya": {"layer_types": ["hybrid", "hybrid_sliding"]},
    "minimax_m3_vl_text": {"layer_types": ["minimax_m3_sparse", "full_attention"]},  # default: all full
    # the hybrid layers share one transformer block: two of them, so that it is shared (5.x ties it)
    "zamba": {"layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
}

_V4 = int(transformers.__version__.split(".")[0]) < 5

# per-family overrides, only where the generic shrink is not enough
_ROPE_PER_KIND = {"rope_type": "default", "rope_theta": 10000.0}
_FAMILY: dict[str, dict[str, Any]] = {
    # the router samples its experts at random in training: no two calls agree, so nothing can be compared
    "phimoe": {"router_jitter_noise": 0.0},
    # rope parameters per layer kind; the default's flat dict has no entry for its own layer kinds
    "cohere_compass_text": {
        "rope_parameters": {k: dict(_ROPE_PER_KIND) for k in ("sliding_attention", "full_attention")}
    },
    "mamba2": {"num_heads": 2 * HIDDEN // HEAD_DIM, "head_dim": HEAD_DIM},  # heads * head_dim == expand * hidden
    "zaya": {"num_experts_per_tok": 1},  # "ZAYA currently supports num_experts_per_tok=1 only"
    # Qwen4-Exp's QSA indexer is off unless all five are set: on, selecting WINDOW tokens in blocks of 2
    "qwen4_exp_text": dict(
        indexer_n_heads=HEADS,
        indexer_kv_heads=1,
        indexer_head_dim=HEAD_DIM,
        indexer_budget=WINDOW,
        indexer_compress_ratio=2,
    ),
    "dots3_note_text": {"num_key_value_heads": HEADS},  # MLA: "num_key_value_heads must match num_attention_heads"
    # DbrxAttention reads attn_config.rope_theta (not a field) and clamps q/k/v with clip_qkv (None fails)
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    # KV sharing across layers (the last num_kv_shared_layers reuse the last unshared layer of their kind)
    "gemma3n_text": dict(
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2,
        activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0],
    ),
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "bamba": {"attn_layer_indices": [LAYERS - 1]},  # default None: every layer Mamba
    "xmod": {"default_language": "en_XX"},
    "mllama_text_model": {"rope_scaling": {"rope_type": "default"}},  # 4.51: None by default, rotary reads it
    "musicgen_decoder": {"num_codebooks": 1},  # input_ids are [batch * codebooks, seq]: one codebook, one row
    "musicgen_melody_decoder": {"num_codebooks": 1},
    "modernbert-decoder": {"local_attention": 2 * WINDOW},  # a total width: sliding_window = local_attention // 2
    # axial position embeddings train only on rows of exactly prod(axial_pos_shape) tokens: learned ones instead
    # (chunk lengths stay 64: in training a row longer than a chunk must be a multiple of it)
    "reformer": {"axial_pos_embds": False},
    # 4.51: without the cache the RG-LRU keeps its state from the previous forward (a second backward fails);
    # with it, a row longer than attention_window_size attends to its last keys under the first keys' mask
    **({"recurrent_gemma": {"use_cache": True, "attention_window_size": POSITIONS}} if _V4 else {}),
    # block-sparse indexer: WINDOW tokens in blocks of 2
    "minimax_m3_vl_text": {"index_block_size": 2, "index_topk_blocks": WINDOW // 2},
}

# types that cannot train alone, whatever the config
_UNBUILDABLE = {
    "gemma4_assistant": "a speculative-decoding draft head: forward needs the target model's inputs_embeds and "
    "shared_kv_states (every layer reuses the target's KV), so it cannot train alone",
    "gemma4_unified_assistant": "a speculative-decoding draft head: forward needs the target model's inputs_embeds "
    "and shared_kv_states (every layer reuses the target's KV), so it cannot train alone",
    "transfo-xl": "deprecated; its forward calls Tensor.type_as(dtype=...), which torch rejects: it fails for any "
    "config",
    "speech_to_text_2": "deprecated; its _init_weights reads Speech2Text2SinusoidalPositionalEmbedding.weight, "
    "which does not exist: construction fails for any config, the default one included",
}

# optional packages a type cannot be built without (module names)
_REQUIRES: dict[str, tuple[str, ...]] = {"gemma3n": ("timm",), "qdqbert": ("pytorch_quantization",)}

# keyword arguments without which the config class has no (usable) default, 4.51
_DEFAULT_KWARGS: dict[str, dict[str, Any]] = {
    **{
        name: {"text_encoder": {"model_type": "t5"}, "audio_encoder": {"model_type": "encodec"}, "decoder": {}}
        for name in ("musicgen", "musicgen_melody")  # MusicgenConfig() raises
    },
    "phi4_multimodal": {"vision_config": {}, "audio_config": {}},  # default vision_config None; the model needs it
}


def _is_dropout(name: str) -> bool:
    return any(w in name for w in _DROPOUT_WORDS) and not name.startswith("use_")


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
    for name in _LAYER_COUNTS:
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
    tiny = kwargs.get(name, _SCALARS.get(name))
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
        if key is None and name in _base_names() and (top or name.endswith(_TOKEN_SUFFIXES) or _is_dropout(name)):
            key = name  # 4.51: the base class's keyword arguments (token ids, dropouts)
        if key is None or key.startswith("_") or name in out:
            continue  # derived in __init__ from what we set
        if key in _EVEN_IF_NONE and not value:
            value = None  # None or 0: "derive it" / "no window"; we want one
        elif value is None:
            value = signature.get(key)
            if value is None or value is inspect.Parameter.empty:
                continue
        rule = _SCALARS.get(name, _SCALARS.get(key))
        if isinstance(value, float) and _is_dropout(name):
            out[key] = 0.0
        elif rule is not None:
            if isinstance(rule, bool) or value is None or (isinstance(value, int) and value > 0):
                out[key] = rule
        elif name.endswith(_TOKEN_SUFFIXES):
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
    for name, kinds in _KINDS.get(model_type, {}).items():
        if name in signature:
            out[name] = kinds
            need = max(need, len(kinds))
    for count in _LAYER_COUNTS:
        if count in out:
            out[count] = need
    if found.get("kv_lora_rank"):  # MLA expands keys to every head: no GQA; head_dim is the rope or the q/k part
        if "num_key_value_heads" in out:
            out["num_key_value_heads"] = HEADS
        if "head_dim" in out and found.get("head_dim") == found.get("qk_rope_head_dim"):
            out["head_dim"] = out.get("qk_rope_head_dim", HEAD_DIM // 2)
    for name, value in _FAMILY.get(model_type, {}).items():
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
        for count in _LAYER_COUNTS:
            if count in kwargs:
                fixes[count] = max(n, kwargs[count])
    return fixes


def _tiny_kwargs(default: PretrainedConfig, model_type: str, top: bool = True) -> dict[str, Any]:
    """The keyword arguments of the tiny config of ``default``'s class, checked by building it."""
    config_class = type(default)
    kwargs = {**_DEFAULT_KWARGS.get(model_type, {}), **_overrides(default, model_type, top)}
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
    if model_type in _UNBUILDABLE:
        raise Unbuildable(_UNBUILDABLE[model_type])
    for package in _REQUIRES.get(model_type, ()):
        if importlib.util.find_spec(package) is None:
            raise Unbuildable(f"needs the optional package {package!r}, not installed")
    try:
        config_class = _own_config_class(model_type)
    except (KeyError, ImportError, AttributeError) as exc:
        raise Unbuildable(f"no config class: {type(exc).__name__}: {_first_line(exc)}") from exc
    try:
        default = config_class(**copy.deepcopy(_DEFAULT_KWARGS.get(model_type, {})))
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
