"""Reading a model config's values, on homogeneous configs and on 5.x heterogeneous ones (per-layer attributes that
raise when read globally).

    config_value(config, "sliding_window", None, min)     # the shortest window of any layer
    config_values(config, "head_dim")                     # every layer's

Core module: standard library only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def config_values(config: Any, name: str) -> list[Any]:
    """``config.<name>``, or on a heterogeneous 5.x config (gemma4, dots3: per-layer attributes that raise when
    read globally) the value of every layer; empty when absent.

    Args:
        config: a transformers model config.
        name: the attribute to read.

    Returns:
        The values found, one per layer on a heterogeneous config; empty when absent or None.

    Example::

        >>> from transformers import Gemma2Config, LlamaConfig
        >>> config_values(Gemma2Config(), "sliding_window"), config_values(LlamaConfig(), "sliding_window")
        ([4096], [])
    """
    try:
        value = getattr(config, name)
    except AttributeError:
        return []
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError, without importing 5.x names
        layers = getattr(config, "per_layer_config", None) or []
        return [v for layer in layers if (v := getattr(layer, name, None)) is not None]
    return [] if value is None else [value]


def config_value(config: Any, name: str, default: Any = None, pick: Callable = max) -> Any:
    """One value of ``config.<name>`` (``pick`` of the per-layer values on a heterogeneous config), or ``default``.

    Args:
        config: a transformers model config.
        name: the attribute to read.
        default: what to return when the config has no value.
        pick: chooses one of the per-layer values (``max``; ``min`` for the shortest window).

    Returns:
        The picked value (the first layer's where values do not compare), or ``default``.

    Example::

        >>> from transformers import FalconConfig, Gemma2Config
        >>> config_value(Gemma2Config(), "sliding_window", None, min)   # the shortest window of any layer
        4096
        >>> config_value(FalconConfig(alibi=True), "alibi", False)
        True
    """
    values = config_values(config, name)
    if not values:
        return default
    try:
        return pick(values)
    except TypeError:  # values that do not compare: the first layer's
        return values[0]
