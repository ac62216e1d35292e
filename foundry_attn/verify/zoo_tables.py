"""The tables :mod:`foundry_attn.verify.zoo` shrinks every causal-LM config by, and the tiny sizes they hold.

:data:`SCALARS`: attribute name -> tiny value (hidden 64, 2 layers, 4 heads of 16, GQA 2, vocab 128, MoE 4 experts
top-2, windows and chunks of :data:`WINDOW` tokens, ...), applied where a config class takes the attribute;
:data:`KINDS`: the layer kinds a family's default config leaves out; :data:`FAMILY`: the few per-family overrides
where the generic shrink is not enough, each with its reason; :data:`UNBUILDABLE` and :data:`REQUIRES`: the types
that cannot train here, and why. A new family that the zoo cannot shrink is a new row here.
Core module: transformers only.
"""

from __future__ import annotations

from typing import Any

import transformers

WINDOW = 4
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 2, 4, 2, 16
FFN, EXPERT_FFN, VOCAB, POSITIONS = 64, 32, 128, 128
EXPERTS, TOP_K = 4, 2
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers")


def _names(*names: str, value: Any) -> dict[str, Any]:
    return dict.fromkeys(names, value)


# attribute name -> tiny value, applied where the config class takes the attribute
SCALARS: dict[str, Any] = {
    **_names("hidden_size", "d_model", "n_embd", "embedding_dim", "emb_dim", "lru_width", value=HIDDEN),
    **_names("word_embed_proj_dim", "backbone_hidden_size", "hidden_size_global", value=HIDDEN),
    **_names("embedding_size", "input_embedding_size", "output_embedding_size", value=HIDDEN),
    **_names("adapter_in_dim", "adapter_input_size", "adapter_out_dim", "out_hidden_size", value=HIDDEN),
    **_names(*LAYER_COUNTS, "encoder_layers", "num_decoder_layers", "num_encoder_layers", value=LAYERS),
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
EVEN_IF_NONE = frozenset(
    {"head_dim", "sliding_window", "num_key_value_heads", "n_routed_experts", "num_experts_per_tok", "n_shared_experts"}
)

DROPOUT_WORDS = ("dropout", "pdrop", "layerdrop", "dropatt", "drop_rate", "dropout_p")
TOKEN_SUFFIXES = ("token_id", "token_ids", "token_index", "_index", "_idx")

# layer kinds a family supports that its default config leaves out (the default is all one kind)
KINDS: dict[str, dict[str, list[str]]] = {
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
FAMILY: dict[str, dict[str, Any]] = {
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
UNBUILDABLE = {
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
REQUIRES: dict[str, tuple[str, ...]] = {"gemma3n": ("timm",), "qdqbert": ("pytorch_quantization",)}

# keyword arguments without which the config class has no (usable) default, 4.51
DEFAULT_KWARGS: dict[str, dict[str, Any]] = {
    **{
        name: {"text_encoder": {"model_type": "t5"}, "audio_encoder": {"model_type": "encodec"}, "decoder": {}}
        for name in ("musicgen", "musicgen_melody")  # MusicgenConfig() raises
    },
    "phi4_multimodal": {"vision_config": {}, "audio_config": {}},  # default vision_config None; the model needs it
}
