"""Finding a model inside the wrappers training puts around it: DDP and FSDP1 (``.module``), ``torch.compile``
(``._orig_mod``), Composer's model (the HF model as an attribute).

    hf = unwrapped(model)                                          # the module that holds the HF config
    name, hf = find_hf_model(model)                                # the outermost PreTrainedModel, and its name

Core module: torch and transformers only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


def find_inside(model: Any, wanted: Callable[[Any], bool]) -> tuple[str, Any] | None:
    """The outermost module of ``model`` (itself first) that ``wanted`` accepts, with its dotted name (empty for
    ``model`` itself; wrapper segments such as ``module.`` included), or None.

    Args:
        model: the model or wrapper to search (DDP, FSDP1, ``torch.compile``, Composer's model).
        wanted: a test of one module.

    Returns:
        ``(name, module)`` for the first module ``wanted`` accepts, or None.

    Example::

        >>> wrapper = torch.nn.ModuleDict({"module": hf_model})      # as DDP holds it: under .module
        >>> name, found = find_inside(wrapper, lambda m: hasattr(m, "config"))
        >>> name, found is hf_model
        ('module', True)
    """
    if wanted(model):
        return "", model
    if not isinstance(model, torch.nn.Module):
        return None
    return next(((name, m) for name, m in model.named_modules() if wanted(m)), None)


_WRAPPER_SEGMENTS = frozenset({"module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def clean_name(name: str) -> str:
    """A module path without DDP / FSDP / checkpoint / compile wrapper segments (``module.``, ...).

    Args:
        name: a dotted module name, as ``named_modules()`` gives it.

    Returns:
        ``name`` less its wrapper segments.

    Example::

        >>> clean_name("module._fsdp_wrapped_module.model.layers.0.self_attn")
        'model.layers.0.self_attn'
    """
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_SEGMENTS)


@functools.cache
def _pretrained() -> type:
    from transformers import PreTrainedModel

    return PreTrainedModel


def _is_hf_model(module: Any) -> bool:
    return isinstance(module, _pretrained())


def find_hf_model(model: Any) -> tuple[str, Any] | None:
    """The outermost Hugging Face ``PreTrainedModel`` inside ``model`` (Composer, DDP, FSDP1, PEFT: its
    ``PeftModel`` forwards ``config`` but is not the model that runs), with its name less the wrapper segments.

    Args:
        model: the model or wrapper to search.

    Returns:
        ``(name, hf_model)`` (name empty for the model itself or under DDP's ``module``), or None.

    Example::

        >>> name, found = find_hf_model(torch.nn.ModuleDict({"module": hf_model}))  # as DDP holds it
        >>> name, type(found).__name__
        ('', 'LlamaForCausalLM')
    """
    found = find_inside(model, _is_hf_model)
    return None if found is None else (clean_name(found[0]), found[1])


def unwrapped(model: Any) -> Any:
    """The HF model inside wrappers (:func:`find_hf_model`); else the outermost module with a ``config``; ``model``
    itself when nothing inside has one.

    Args:
        model: the model or wrapper (DDP, FSDP1, ``torch.compile``, PEFT, Composer's model).

    Returns:
        The module that holds the HF config, or ``model``.

    Example::

        >>> unwrapped(torch.compile(hf_model)) is hf_model
        True
    """
    if _is_hf_model(model):  # the common call, once per batch: the HF model itself
        return model
    found = find_hf_model(model) or find_inside(model, lambda m: hasattr(m, "config"))
    return model if found is None else found[1]


def compiled(model: Any) -> bool:
    """Whether ``model`` runs under ``torch.compile``: wrapped (``torch.compile(model)``) or with its forward
    compiled in place (what Composer does for ``compile_config``).

    Args:
        model: the model or wrapper to test.

    Returns:
        True when ``model`` or its forward is compiled.

    Example::

        >>> compiled(hf_model), compiled(torch.compile(hf_model))
        (False, True)
    """
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(model, OptimizedModule) or hasattr(getattr(model, "forward", None), "_torchdynamo_orig_callable")
