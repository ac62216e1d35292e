"""Which implementation a model runs, written in one place: ``config._attn_implementation`` is set only here.

    name = point(hf_model, "sdpa")              # ours, "foundry_sdpa": the flat path (attach proves it first)
    use(hf_model, state.rows_name)              # the stock stand-in: one document per row
    with running(hf_model, "eager"): ...        # a proof's truth or rows side, the model's own name restored after

The name is ours while the path is flat, the stock stand-in of the backend table while rows
(:func:`foundry_attn.attention.backends.rows_name`), and a proof's stock backend for the block it runs in. When each
applies is the :class:`~foundry_attn.path.state.PathState`'s decision (flat, rows, stock's packed mask); the proof
runs stock inside :func:`running`; attach puts the model's own back on a refusal. Core module: torch and transformers
only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from foundry_attn.attention.backends import FA2, FA2_REFERENCE, PREFIX


def current(hf: Any) -> str:
    """The implementation the HF model runs now.

    Args:
        hf: the transformers model (not a wrapper).

    Returns:
        Its ``config._attn_implementation`` (``foundry_sdpa`` while flat, ``sdpa`` while rows).

    Example::

        >>> current(hf_model)
        'foundry_sdpa'
    """
    return hf.config._attn_implementation


def use(hf: Any, name: str) -> None:
    """Set ``name`` on the model's config and on every config its text decoder reads: the text config, and the copy a
    multimodal model's language model holds (Gemma3, GOT-OCR2 in 4.51).

    Args:
        hf: the transformers model (not a wrapper).
        name: ours (``foundry_sdpa``) or a stock name (``sdpa``).

    Example::

        >>> use(hf_model, "sdpa")     # the rows path's stock stand-in
    """
    config = hf.config
    config._attn_implementation = name
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for module in hf.modules():
        held = getattr(module, "config", None)
        if held is not None and held is not config and type(held) is type(text):
            held._attn_implementation = name
    if text is not config:
        text._attn_implementation = name


@contextlib.contextmanager
def running(hf: Any, name: str) -> Iterator[None]:
    """``name`` for the block (a proof's stock side), the model's own restored after, even when the block raises.

    Args:
        hf: the transformers model (not a wrapper).
        name: the implementation the block runs.

    Returns:
        A context manager.

    Example::

        >>> with running(hf_model, "sdpa"):
        ...     alone = hf_model(input_ids=doc[None]).logits
        >>> alone.shape, current(hf_model)
        (torch.Size([1, 23, 64]), 'foundry_sdpa')
    """
    before = current(hf)
    use(hf, name)
    try:
        yield
    finally:
        use(hf, before)


def point(hf: Any, backend: str, fa2_reference: bool = False) -> str:
    """Point the HF model's attention at our function for ``backend``, unproven.

    Low level: :func:`foundry_attn.path.attach.attach` points, proves the flat path against stock and records the
    path; ``forward_documents`` runs a model that was only pointed one document per row.

    Args:
        hf: the transformers model (not a wrapper).
        backend: one of the backend table's names (checked where the user gives it: attach).
        fa2_reference: FA2 on the pure-PyTorch reference kernel (CPU tests).

    Returns:
        The name now in ``config._attn_implementation``.

    Example::

        >>> point(hf_model, "sdpa")
        'foundry_sdpa'
    """
    from foundry_attn.attention.functions import register  # transformers' interface: only where a model is pointed

    register()
    name = PREFIX + (FA2_REFERENCE if backend == FA2 and fa2_reference else backend)
    use(hf, name)
    return name
