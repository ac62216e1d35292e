"""From a model path to an attention decision: traits of the model class, compute dtype, load checks.

Core module: torch and transformers only. The Composer model (``foundry_attn.integrations.llm_foundry.model``) calls
``decide`` before it builds anything, so a bad name or a strict failure costs no model build, and transformers'
own attention check runs here, on the config: the model then builds once, with what it accepts.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from foundry_attn.attention.backends import FA2, FLEX, SDPA, load_name
from foundry_attn.checks import check_choice
from foundry_attn.selection.backend_checks import fa2_smoke_test
from foundry_attn.selection.capability import Capability
from foundry_attn.selection.policy import AUTO, DEFAULT_FALLBACK, Decision, choose
from foundry_attn.selection.traits import ModelTraits

if TYPE_CHECKING:
    from transformers.modeling_utils import PreTrainedModel  # the top-level name is a dummy class to mypy

COMPUTE_DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_compute_dtype(name: str, cap: Capability) -> torch.dtype:
    """The dtype attention computes in.

    ``auto``: bf16 on a CUDA device that has it (else fp16), because LLM-Foundry trains on GPUs under
    Composer's ``precision: amp_bf16``/``amp_fp16`` autocast, where fp32 master weights still run
    attention in half precision; fp32 on CPU. Name the dtype when you train in fp32 on a GPU.

    Args:
        name: ``attn_compute_dtype``: ``auto``, ``bf16``, ``fp16`` or ``fp32``.
        cap: the machine (``auto`` reads whether it has CUDA).

    Returns:
        The torch dtype.

    Raises:
        ValueError: an unknown name.

    Example::

        >>> resolve_compute_dtype("auto", probe()), resolve_compute_dtype("fp16", probe())   # on a CPU
        (torch.float32, torch.float16)
    """
    named = COMPUTE_DTYPES[check_choice("attn_compute_dtype", name, COMPUTE_DTYPES)]
    if named is not None:
        return named
    if not cap.cuda:
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def model_class_for(config: PretrainedConfig) -> type[PreTrainedModel]:
    """The class ``AutoModelForCausalLM`` would build for ``config`` (for its ``_supports_*`` flags).

    Args:
        config: a transformers model config.

    Returns:
        The causal-LM class registered for the config's type.

    Raises:
        ValueError: no causal-LM class is registered for it (remote code: pass ``model_class`` to :func:`decide`).

    Example::

        >>> model_class_for(AutoConfig.from_pretrained(llama_path)).__name__   # a Llama checkpoint's directory
        'LlamaForCausalLM'
    """
    mapping = AutoModelForCausalLM._model_mapping
    if type(config) in mapping:
        return mapping[type(config)]
    auto_map = getattr(config, "auto_map", None) or {}
    raise ValueError(f"no causal-LM class for {type(config).__name__} (auto_map: {auto_map or 'none'})")


def transformers_load_check(
    model_class: type[PreTrainedModel], config: PretrainedConfig, name: str, dtype: torch.dtype
) -> str | None:
    """Run transformers' own load-time validation for ``name``; the error text, or None when it passes.

    4.51: the class-level ``_check_and_enable_*``. 4.54+/5.x: ``_check_and_adjust_attn_implementation``, an
    instance method, run on an instance that skipped ``__init__`` (no weights: only its class and the config);
    there it may also try a hub kernel for a missing flash-attn, and any failure of that is a refusal too.

    Args:
        model_class: the class that will be built.
        config: its config (not changed: the checks run on a copy).
        name: the implementation transformers will load (:func:`~foundry_attn.attention.backends.load_name`).
        dtype: the compute dtype, for 4.51's FA2 check.

    Returns:
        ``transformers refused it at load: ...``, or None when transformers accepts it.

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM   # on a machine without flash-attn
        >>> print(transformers_load_check(LlamaForCausalLM, LlamaConfig(), "flash_attention_2", torch.bfloat16))
        transformers refused it at load: FlashAttention2 has been toggled on, but it cannot be used due to ...
    """
    try:
        if hasattr(model_class, "_check_and_adjust_attn_implementation"):
            instance: Any = model_class.__new__(model_class)  # half-built on purpose: no __init__, no weights
            instance.config = copy.deepcopy(config)
            instance._check_and_adjust_attn_implementation(name, is_init_check=True)
            return None
        checks = {
            FA2: ("_check_and_enable_flash_attn_2", {"torch_dtype": dtype}),
            SDPA: ("_check_and_enable_sdpa", {}),
            FLEX: ("_check_and_enable_flex_attn", {}),
        }
        method, kwargs = checks.get(name, ("", {}))
        check = getattr(model_class, method, None) if method else None
        if check is not None:  # eager, or a release without this private check: our checks stand
            check(copy.deepcopy(config), hard_check_only=True, **kwargs)
    except (ValueError, ImportError) as exc:
        return f"transformers refused it at load: {exc}"
    except Exception as exc:  # 5.x hub-kernel loading fails with network errors, among others
        return f"transformers refused it at load: {type(exc).__name__}: {exc}"
    return None


def decide(
    model_path: str | None,
    requested: str = AUTO,
    fallback: tuple[str, ...] | list[str] = DEFAULT_FALLBACK,
    strict: bool = False,
    compute_dtype: str = "auto",
    cap: Capability | None = None,
    fa2_reference: bool = False,
    trust_remote_code: bool = True,
    config_overrides: dict | None = None,
    config: PretrainedConfig | None = None,
    model_class: type[PreTrainedModel] | None = None,
) -> Decision:
    """Choose the attention implementation for the model at ``model_path`` (or ``config``) on this device;
    ``model_class``: the class that will be built, where ``AutoModelForCausalLM`` cannot tell it from the config.

    Args:
        model_path: a hub name or local path, read when ``config`` is None.
        requested: ``attn_implementation``: ``auto`` or a backend name.
        fallback: ``attn_fallback``, fastest first.
        strict: ``attn_strict``: an explicit request must run, or this raises.
        compute_dtype: ``attn_compute_dtype`` (:func:`resolve_compute_dtype`).
        cap: the machine (None: :func:`~foundry_attn.selection.capability.probe` this one).
        fa2_reference: FA2 on the pure-PyTorch reference kernel (CPU tests).
        trust_remote_code: passed to ``AutoConfig.from_pretrained``.
        config_overrides: attributes set on the config read from ``model_path`` (not on a given ``config``).
        config: the model config, instead of reading ``model_path``.
        model_class: the class that will be built (None: ``AutoModelForCausalLM``'s for the config).

    Returns:
        The decision, after our checks and transformers' own load check of the chosen implementation.

    Raises:
        AttentionUnavailableError: a strict request cannot run, or nothing in the chain can.

    Example::

        >>> decision = decide(llama_path, "auto")     # a Llama checkpoint's directory, on a CPU without flash-attn
        >>> decision.chosen
        'sdpa'
        >>> print(decision.reason)
        flash_attention_2: flash-attn is not installed (pip install flash-attn --no-build-isolation)...
    """
    from foundry_attn.selection.capability import probe

    cap = cap or probe()
    if config is None:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        for key, value in (config_overrides or {}).items():
            setattr(config, key, value)
    model_class = model_class or model_class_for(config)
    traits = ModelTraits.from_model_class(model_class, config)
    dtype = resolve_compute_dtype(compute_dtype, cap)
    decision = choose(
        requested,
        fallback,
        cap,
        dtype,
        traits,
        strict,
        smoke_test=None if fa2_reference else fa2_smoke_test,
        fa2_reference=fa2_reference,
    )
    for cand in decision.candidates:  # transformers' own checks, for what we are about to load
        if cand.name != decision.chosen or (cand.name == FA2 and fa2_reference):
            continue
        error = transformers_load_check(model_class, config, load_name(cand.name, model_class=model_class), dtype)
        if error is None:
            break
        decision = decision.with_rejection(cand.name, error)
    return decision


def weights_compute_dtype(weights: torch.dtype, named: str) -> str:
    """``auto``'s compute dtype for a built model: the weights' where they are half, else the named one.

    Args:
        weights: the dtype of the model's weights.
        named: ``attn_compute_dtype`` (``auto``, ``bf16``, ``fp16``, ``fp32``).

    Returns:
        ``bf16`` or ``fp16`` for half weights under ``auto``; else ``named``.

    Example::

        >>> weights_compute_dtype(torch.bfloat16, "auto"), weights_compute_dtype(torch.float32, "auto")
        ('bf16', 'auto')
    """
    half = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(weights)
    return half if half is not None and named == "auto" else named
