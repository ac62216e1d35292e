"""The Llama shapes the demo, tests and benchmarks build (random weights, nothing downloaded).

    llama_config(49152, **SMOLLM2_135M_SHAPE)   # SmolLM2-135M's layers; pad == bos == eos == 0

Core module: transformers only.
"""

from __future__ import annotations

from typing import Any

# LlamaConfig keyword arguments (ints, and a float rope_theta)
TINY_SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
SMOLLM2_135M_SHAPE: dict[str, Any] = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
)
SMOLLM2_VOCAB = 49152
#: Llama-3.2-1B's layers (tied embeddings), where people fine-tune: the GPU, not the host, sets the pace
LLAMA_3_2_1B_SHAPE: dict[str, Any] = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
)
LLAMA_3_2_VOCAB = 128256
#: the shapes ``foundry-attn bench gpu --shape NAME`` builds: (LlamaConfig keywords, vocabulary)
SHAPES: dict[str, tuple[dict[str, Any], int]] = {
    "smollm2-135m": (SMOLLM2_135M_SHAPE, SMOLLM2_VOCAB),
    "llama-3.2-1b": (LLAMA_3_2_1B_SHAPE, LLAMA_3_2_VOCAB),
}
#: the public report's batch: six documents, 1395 real tokens (the padding, proof and GPU benchmarks' workload)
BLOG_LENGTHS: tuple[int, ...] = (220, 217, 295, 183, 130, 350)


def llama_config(vocab_size: int, **shape: Any) -> Any:
    """A ``LlamaConfig`` with tied embeddings and token 0 as pad, bos and eos (the demo tokenizer's)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=True, **shape
    )
