"""Finding a model inside the wrappers training puts around it: DDP and FSDP1 (``.module``), ``torch.compile``
(``._orig_mod``), Composer's model (the HF model as an attribute).

    hf = unwrapped(model)                                          # the module that holds the HF config
    name, hf = find_inside(model, lambda m: isinstance(m, PreTrainedModel))   # the outermost one, and where

Core module: torch and transformers only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def find_inside(model: Any, wanted: Callable[[Any], bool]) -> tuple[str, Any] | None:
    """The outermost module of ``model`` (itself first) that ``wanted`` accepts, with its dotted name (empty for
    ``model`` itself; wrapper segments such as ``module.`` included), or None."""
    if wanted(model):
        return "", model
    if not isinstance(model, torch.nn.Module):
        return None
    return next(((name, m) for name, m in model.named_modules() if wanted(m)), None)


def unwrapped(model: Any) -> Any:
    """The HF model inside wrappers: the outermost ``PreTrainedModel`` (inside DDP / FSDP1, which hide its
    ``config``, and PEFT, whose ``PeftModel`` forwards ``config`` but is not the model that runs); else the
    outermost module with a ``config``; ``model`` itself when nothing inside has one."""
    from transformers import PreTrainedModel

    found = find_inside(model, lambda m: isinstance(m, PreTrainedModel)) or find_inside(
        model, lambda m: hasattr(m, "config")
    )
    return model if found is None else found[1]


def compiled(model: Any) -> bool:
    """Whether ``model`` runs under ``torch.compile``: wrapped (``torch.compile(model)``) or with its forward
    compiled in place (what Composer does for ``compile_config``)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(model, OptimizedModule) or hasattr(getattr(model, "forward", None), "_torchdynamo_orig_callable")
