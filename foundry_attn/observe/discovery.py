"""Where the attention is in a model: its decoder layers and attention modules, and the attention implementation it
runs (the HF model inside wrappers: :func:`foundry_attn.flat.unwrap.find_hf_model`).

    name, hf = find_hf_model(state.model)        # through DDP / FSDP / checkpoint / compile wrappers
    modules = discover_modules(hf)               # .layers, .attention: (clean name, module) pairs
    attn_implementation(hf)                      # "sdpa" (HF's _attn_implementation, MPT's attn_impl, ...)
    decision_of(hf)                              # the attn_impl event: attach's choice and proof, or the model's

Imports torch and the core (transformers only when it looks for a ``PreTrainedModel``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from foundry_attn.attention.backends import backend_of
from foundry_attn.flat.unwrap import clean_name
from foundry_attn.path.state import path_of
from foundry_attn.selection.policy import Decision

_ATTENTION_LIKE = re.compile(r"attention|attn", re.IGNORECASE)


def mpt_attn_impl(module: nn.Module | None) -> str | None:
    """LLM-Foundry MPT's ``attn_config['attn_impl']`` (``torch``, ``flash``, ``flex``) of ``module``, or None.

    MPT's config is a ``PretrainedConfig`` whose ``_attn_implementation`` stays ``eager`` whatever runs: its
    attention is chosen by ``attn_config``, which is read first.

    Args:
        module: a model (MPT or any other), or None.

    Returns:
        ``attn_config['attn_impl']`` where the config has one as a string, else None.

    Example::

        >>> mpt_attn_impl(mpt_model), mpt_attn_impl(llama_model)
        ('flash', None)
    """
    attn_config = getattr(getattr(module, "config", None), "attn_config", None)
    impl = attn_config.get("attn_impl") if isinstance(attn_config, Mapping) else None
    return impl if isinstance(impl, str) else None


def attn_implementation(module: nn.Module | None) -> str | None:
    """The attention implementation that really runs in ``module``; None without a module.

    MPT's ``attn_impl`` (:func:`mpt_attn_impl`), else the config's ``_attn_implementation`` (``sdpa`` for our
    registered ``foundry_sdpa``), else ``unknown (class X)``.

    Args:
        module: the HF model (not a wrapper), or None.

    Returns:
        The implementation's name (``sdpa``, ``flash_attention_2``, MPT's ``torch``, ...), ``unknown (class X)``
        where nothing says, or None without a module.

    Example::

        >>> attn_implementation(llama_model)  # attn_implementation="sdpa"
        'sdpa'
    """
    if module is None:
        return None
    mpt = mpt_attn_impl(module)
    if mpt is not None:
        return mpt
    impl = backend_of(getattr(getattr(module, "config", None), "_attn_implementation", None))
    return impl if impl else f"unknown (class {type(module).__name__})"


# ---- model discovery ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class ModuleMap:
    """The modules inspected: decoder layers and attention modules (name, module), in model order."""

    layers: list[tuple[str, nn.Module]]
    attention: list[tuple[str, nn.Module]]
    attention_like: dict[str, int]  # class name -> count, found by the heuristic
    selector: str | None = None
    selector_matched: bool = True


def discover_modules(model: nn.Module, attention_selector: str | None = None) -> ModuleMap:
    """Decoder layers (the largest ``ModuleList`` of blocks holding attention) and attention modules.

    Attention modules are, by default, the outermost modules whose class name says attention
    (``LlamaAttention``, ``Qwen2Attention``, ``GPTNeoXAttention``, ...); ``attention_selector`` (a regex
    searched in the module path and the class name) replaces that rule.

    Args:
        model: the HF model (not a wrapper).
        attention_selector: a regex searched in each module's path and class name; None: the class-name rule.

    Returns:
        The :class:`ModuleMap`: ``layers`` and ``attention`` as (clean name, module) pairs in model order, the
        attention-like classes counted, and whether the selector matched a module.

    Example::

        >>> [name for name, _ in discover_modules(llama_model).attention]
        ['model.layers.0.self_attn', 'model.layers.1.self_attn']
    """
    named = [(clean_name(n), m) for n, m in model.named_modules() if m is not model]
    heuristic: list[tuple[str, nn.Module]] = []
    for name, module in named:
        if _ATTENTION_LIKE.search(type(module).__name__) and not any(
            name.startswith(parent + ".") for parent, _ in heuristic
        ):
            heuristic.append((name, module))
    like: dict[str, int] = {}
    for _, module in heuristic:
        like[type(module).__name__] = like.get(type(module).__name__, 0) + 1
    attention = heuristic
    matched = True
    if attention_selector:
        pattern = re.compile(attention_selector)
        attention = [(n, m) for n, m in named if pattern.search(n) or pattern.search(type(m).__name__)]
        matched = bool(attention)
    attn_ids = {id(m) for _, m in heuristic}
    layers: list[tuple[str, nn.Module]] = []
    for name, module in named:
        if isinstance(module, nn.ModuleList) and len(module) > len(layers):
            children = [(f"{name}.{i}" if name else str(i), child) for i, child in enumerate(module)]
            if all(any(id(sub) in attn_ids for sub in child.modules()) for _, child in children):
                layers = children
    if not layers:  # no stack of blocks: the parents of the attention modules
        by_name = dict(named)
        for name, _ in heuristic:
            parent = name.rpartition(".")[0]
            if parent in by_name and all(parent != n for n, _ in layers):
                layers.append((parent, by_name[parent]))
    return ModuleMap(layers, attention, like, attention_selector, matched)


def decision_of(hf: Any) -> dict[str, Any]:
    """The ``attn_impl`` event fields of ``hf`` (the decision callbacks' core), built by
    :meth:`~foundry_attn.selection.policy.Decision.as_dict` alone: what :func:`foundry_attn.path.attach.attach` decided,
    with the path and proof as they are now, or the implementation the model runs, set by the model.

    Args:
        hf: the transformers model (not a wrapper).

    Returns:
        ``requested``, ``chosen``, ``fell_back``, ``reason``, ``strict``, ``compute_dtype``, ``proof``, ``path``,
        ``path_reason``, ``warning`` and ``candidates``.

    Example::

        >>> decision_of(hf_model)["reason"]
        "attach(model, 'sdpa')"
    """
    state = path_of(hf)
    decision = state.decision_now() if state is not None else None
    if decision is None:
        impl = attn_implementation(hf) or "unknown"
        param = next(hf.parameters(), None)
        dtype = str(param.dtype if param is not None else torch.float32).removeprefix("torch.")
        reason = "set by the model, not chosen by foundry_attn (not attached; its config._attn_implementation)"
        decision = Decision.given(impl, reason, compute_dtype=dtype)
    return decision.as_dict()
