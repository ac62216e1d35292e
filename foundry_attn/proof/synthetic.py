"""The synthetic documents the proof at attach runs: seeded ids that avoid special tokens, lengths past any short
window of the config.

    docs, missed = proof_documents(config, device)          # [28 ids, 13 ids, 1 id], a window they leave out
    docs = synthetic_documents(config, (30, 17), device)   # any lengths

Core module: torch only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from foundry_attn.attention.config_values import config_value


def synthetic_documents(config: Any, lengths: Sequence[int], device: torch.device) -> list[torch.Tensor]:
    """Seeded token ids (a local generator: the global RNG is untouched) that avoid the config's special ids.

    Args:
        config: the model's config (its ``vocab_size`` and pad, bos and eos ids are read).
        lengths: each document's number of tokens.
        device: where the ids go.

    Returns:
        One 1-D tensor of ids per length, below ``min(vocab_size, 1000)``.

    Example::

        >>> [len(d) for d in synthetic_documents(hf_model.config, (28, 13), torch.device("cpu"))]
        [28, 13]
    """
    gen = torch.Generator().manual_seed(0)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config  # multimodal: its decoder's
    vocab = int(config_value(config, "vocab_size", 0) or config_value(text, "vocab_size", 0) or 1000)
    special: set[int] = set()
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = config_value(config, name)
        special.update(v for v in (value if isinstance(value, list | tuple) else [value]) if isinstance(v, int))
    low, high = 1, max(2, min(vocab, 1000))
    docs = []
    for n in lengths:
        ids = torch.randint(low, high, (n,), generator=gen)
        for s in special:
            ids[ids == s] = (s + 1) % high or low
        docs.append(ids.to(device))
    return docs


def shortest_window(config: Any) -> int | None:
    """The shortest sliding window or attention chunk the config names (per layer on a heterogeneous one).

    Args:
        config: the model's config.

    Returns:
        The shortest positive window or chunk, or None where the config names none.

    Example::

        >>> from transformers import LlamaConfig, MistralConfig
        >>> shortest_window(MistralConfig()), shortest_window(LlamaConfig())
        (4096, None)
    """
    windows = [
        int(w)
        for n in ("sliding_window", "attention_chunk_size", "local_window", "window_size")
        if isinstance(w := config_value(config, n, None, min), int) and w > 0
    ]
    return min(windows, default=None)


def proof_lengths(window: int | None, longest: int = 23) -> tuple[int, ...]:
    """The documents of the proof at attach, as batches hold them: the first longer than the config's shortest window
    or chunk, then 13 tokens, then a 1-token document (the flat proof compares the first and the 13 tokens, the last
    with targets; one document per row the first and the 1-token one, the most padded).

    Args:
        window: the config's shortest window or chunk (:func:`shortest_window`), or None.
        longest: the first document's length where the shortest window is longer than 59 tokens.

    Returns:
        The lengths: the first 5 past the window (or ``longest + 5`` without one; 9 at least), 13, then 1.

    Example::

        >>> proof_lengths(None), proof_lengths(16)
        ((28, 13, 1), (21, 13, 1))
    """
    short = window or longest
    first = short + 5 if short + 5 <= 64 else longest
    return max(first, 9), 13, 1


def proof_documents(config: Any, device: torch.device) -> tuple[list[torch.Tensor], str]:
    """The documents of the proof at attach (:func:`proof_lengths`, :func:`synthetic_documents`) and the window of
    the config they leave unexercised (:func:`unexercised`), the config's windows read once.

    Args:
        config: the model's config.
        device: where the ids go.

    Returns:
        The documents, and the window no document passes in words ("" where one passes every window).

    Example::

        >>> from transformers import MistralConfig
        >>> docs, missed = proof_documents(MistralConfig(), torch.device("cpu"))
        >>> [len(d) for d in docs], missed
        ([23, 13, 1], 'a window of 4096 tokens (documents up to 23)')
    """
    window = shortest_window(config)
    lengths = proof_lengths(window)
    return synthetic_documents(config, lengths, device), unexercised(window, lengths)


def unexercised(window: int | None, lengths: Sequence[int]) -> str:
    """What documents of ``lengths`` leave out of the config's windows: the shortest window or chunk no document
    passes, in words, or "".

    Args:
        window: the config's shortest window or chunk (:func:`shortest_window`), or None.
        lengths: the proof's document lengths.

    Returns:
        ``"a window of N tokens (documents up to M)"``, or "" where a document passes every window (or none is set).

    Example::

        >>> unexercised(4096, (28, 13, 1))
        'a window of 4096 tokens (documents up to 28)'
    """
    if window is None or max(lengths) > window:
        return ""
    return f"a window of {window} tokens (documents up to {max(lengths)})"
