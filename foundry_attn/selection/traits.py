"""What a model asks of an attention kernel, read from its class and config: the backends its class declares, what
its config refuses, what each backend must honour per document, and whether its FA2 class calls flash-attn itself.

    traits = ModelTraits.from_model_class(LlamaForCausalLM, config)
    traits.supports, traits.needs.softcap, traits.head_dim

Core module: torch only (it reads the backend table, :mod:`foundry_attn.attention.backends`).
"""

from __future__ import annotations

import dataclasses
import sys

from foundry_attn.attention.backends import EAGER, FA2, FLEX, NAMES, SDPA, TORCH_VARLEN, ModelNeeds, config_refusals
from foundry_attn.attention.config_values import config_value


@dataclasses.dataclass(frozen=True)
class ModelTraits:
    """What the model asks of an attention kernel. ``supports`` holds the implementations its class has;
    ``needs`` what each backend must honour per document (softcap, dropout); ``config_refuses`` the backends its
    config refuses to be set to, with the config's words."""

    class_name: str = "?"
    head_dim: int | None = None
    supports: frozenset[str] = frozenset(NAMES)
    needs: ModelNeeds = ModelNeeds()
    config_refuses: tuple[tuple[str, str], ...] = ()
    fa2_calls_flash_attn: bool = False  # its FA2 class, built at construction, calls flash-attn itself (4.51)
    te_attention: bool = False  # its code builds TransformerEngine's own attention (which calls flash-attn itself)
    router_loss: bool = False  # its forward hands the mask to a router loss that reads it as [batch, seq] (MoE)

    @classmethod
    def from_model_class(cls, model_class: type, config: object | None = None) -> ModelTraits:
        """The traits of ``model_class``: the backends its ``_supports_*`` flags declare (torch_varlen with FA2 or
        sdpa), and with ``config`` its head dim, needs and refusals.

        Args:
            model_class: the causal-LM class that will be built (``LlamaForCausalLM``).
            config: its config; None reads the class only (no head dim, needs or refusals).

        Returns:
            The model's traits.

        Example::

            >>> from transformers import LlamaConfig, LlamaForCausalLM
            >>> traits = ModelTraits.from_model_class(LlamaForCausalLM, LlamaConfig())
            >>> sorted(traits.supports), traits.head_dim
            (['eager', 'flash_attention_2', 'flex_attention', 'sdpa', 'torch_varlen'], 128)
        """
        flags = {  # transformers 4.51 names first; later releases renamed the FA2 flag
            FA2: ("_supports_flash_attn_2", "_supports_flash_attn"),
            FLEX: ("_supports_flex_attn",),
            SDPA: ("_supports_sdpa",),
        }
        supports = {EAGER} | {
            impl for impl, names in flags.items() if any(getattr(model_class, n, False) for n in names)
        }
        compatible = getattr(model_class, "_compatible_flash_implementations", None)
        if compatible is not None and FA2 not in compatible:  # 5.x: stock runs another kernel (sinks) under FA2
            supports.discard(FA2)
        if supports & {FA2, SDPA}:  # our varlen function serves any class built on the attention interface
            supports.add(TORCH_VARLEN)
        name = model_class.__name__
        if config is None:
            return cls(name, None, frozenset(supports))
        calls_flash_attn, te_attention = _fa2_calls_flash_attn(model_class), _te_attention(model_class)
        head_dim, router = head_dim_of(config), bool(config_value(config, "output_router_logits", False))
        refuses = config_refusals(config, sorted(supports - {EAGER}))
        needs = ModelNeeds.of(name, config)
        return cls(name, head_dim, frozenset(supports), needs, refuses, calls_flash_attn, te_attention, router)


def _te_attention(model_class: type) -> bool:
    """Whether the modules ``model_class`` is made of import TransformerEngine (remote code built on
    ``transformer_engine.pytorch``); a transformers model never is."""
    modules = (sys.modules.get(klass.__module__) for klass in model_class.__mro__)
    names = (
        getattr(v, "__module__", None) or getattr(v, "__name__", "") for m in modules if m for v in vars(m).values()
    )
    return any(isinstance(n, str) and n.startswith("transformer_engine") for n in names)


def _fa2_calls_flash_attn(model_class: type) -> bool:
    """Whether ``model_class`` builds its attention classes at construction (a module-level ``*_ATTENTION_CLASSES``
    table, transformers 4.51: GPT-J, Falcon, OPT, DBRX, ...) and its module imported transformers' flash forward only
    with flash-attn installed: its FA2 class then cannot run without flash-attn, reference kernel or not."""
    module = sys.modules.get(model_class.__module__)
    if module is None:
        return False
    tables = [v for k, v in vars(module).items() if k.endswith("_ATTENTION_CLASSES") and isinstance(v, dict)]
    return any(FA2 in t for t in tables) and "_flash_attention_forward" not in vars(module)


def head_dim_of(config: object) -> int | None:
    """The attention head dim of ``config``: its ``head_dim`` (the largest layer's), else hidden size / heads.

    Args:
        config: a transformers model config.

    Returns:
        The head dim, or None when the config gives neither.

    Example::

        >>> from transformers import GPT2Config, LlamaConfig
        >>> head_dim_of(LlamaConfig()), head_dim_of(GPT2Config())
        (128, 64)
    """
    head_dim = config_value(config, "head_dim")  # the largest layer's on a heterogeneous config
    if head_dim:
        return int(head_dim)
    hidden, heads = config_value(config, "hidden_size"), config_value(config, "num_attention_heads", pick=min)
    return hidden // heads if hidden and heads else None
