"""The axolotl settings foundry_attn cannot honour, each with its reason and a fix in axolotl's keys (docs/axolotl.md,
"What it refuses"); the config is read as a mapping, raw or validated, without importing axolotl.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from foundry_attn.flat.unwrap import unwrapped
from foundry_attn.selection.decision import decide, weights_compute_dtype
from foundry_attn.selection.policy import AUTO, DEFAULT_FALLBACK, candidate_order
from foundry_attn.selection.surfaces import AXOLOTL, speaking

#: axolotl's ``attn_implementation`` values whose attention foundry_attn attaches (the others are axolotl's own patches)
ATTACHABLE = ("sdpa", "eager", "flash_attention_2", "flex_attention")
#: axolotl's legacy attention flags and the ``attn_implementation`` each stands for (axolotl maps them the same way)
LEGACY_FLAGS = {
    "xformers_attention": "xformers",
    "sage_attention": "sage",
    "flex_attention": "flex_attention",
    "flash_attention": "flash_attention_2",
    "sdp_attention": "sdpa",
    "eager_attention": "eager",
}
_TRITON = "routes attention through axolotl's Triton flash kernel"
_SPLITS = "splits each packed row across ranks (ring attention), and foundry_attn proves whole rows only"
#: settings that split a packed row, or shard the weights, across ranks
PARALLEL = {
    "context_parallel_size": _SPLITS,
    "sequence_parallel_degree": _SPLITS,
    "tensor_parallel_size": "shards every layer's weights across ranks, and foundry_attn's proof runs each document "
    "alone on one rank, which sharded weights cannot do",
}
#: axolotl's own patches of the attention a model runs, past foundry_attn's attach: key -> (the values that patch,
#: why, the value that does not)
PATCHES: dict[str, tuple[tuple[Any, ...], str, str]] = {
    "gemma4_hybrid_attn_impl": (
        (True,),
        "axolotl swaps the global layers' attention to its own sdpa after load",
        "false",
    ),
    "large_head_attention": (("auto", "triton_flash"), _TRITON, "sdpa"),
    "flash_attn_d512": ((True,), _TRITON, "false"),
    "flash_optimum": ((True,), "BetterTransformer replaces the attention modules", "false"),
}
FIX = "Fix: set "
LEAVE = ", or take foundry_attn out of plugins:"


def attention_setting(cfg: Mapping[str, Any]) -> str | None:
    """The attention axolotl will run: ``attn_implementation``, else the first legacy flag set, else None.

    Args:
        cfg: axolotl's config, raw or validated.

    Returns:
        The ``attn_implementation`` value, or None.

    Example::

        >>> attention_setting({"xformers_attention": True})
        'xformers'
    """
    impl = cfg.get("attn_implementation")
    if impl:
        return str(impl)
    return next((name for flag, name in LEGACY_FLAGS.items() if cfg.get(flag)), None)


def _above_one(value: Any) -> bool:
    try:
        return int(value or 1) > 1
    except (TypeError, ValueError):
        return False  # axolotl's own validation names a value that is not a number


def refusal(cfg: Mapping[str, Any]) -> str | None:
    """Why foundry_attn cannot train each document of this config as alone, with the fix; None where it can.

    Args:
        cfg: axolotl's config (a mapping; a missing key reads None).

    Returns:
        The setting, the reason and the fix, or None.

    Example::

        >>> refusal({"attn_implementation": "sdpa", "tensor_parallel_size": 2})
        "tensor_parallel_size: 2 shards every layer's weights across ranks, ... Fix: set tensor_parallel_size: 1 ..."
    """
    impl = attention_setting(cfg)
    if impl is not None and impl not in ATTACHABLE:
        return (
            f"attn_implementation: {impl} is axolotl's own attention patch or kernel, which foundry_attn cannot prove "
            f"or replace. {FIX}attn_implementation: {', '.join(ATTACHABLE[:-1])} or {ATTACHABLE[-1]} "
            f"(foundry_attn_backend: auto then picks among them){LEAVE}"
        )
    for key, why in PARALLEL.items():
        if _above_one(cfg.get(key)):
            return f"{key}: {cfg.get(key)} {why}. {FIX}{key}: 1{LEAVE}"
    if cfg.get("s2_attention"):
        why = "shifted sparse attention mixes token groups across documents"
        return f"s2_attention: true: {why}. {FIX}s2_attention: false{LEAVE}"
    for key, (values, why, fix) in PATCHES.items():
        value = cfg.get(key)
        if value is not None and value in values:
            shown = str(value).lower() if isinstance(value, bool) else value
            return f"{key}: {shown}: {why}, which foundry_attn cannot prove or replace. {FIX}{key}: {fix}{LEAVE}"
    if cfg.get("pretraining_dataset") and cfg.get("sample_packing") and cfg.get("pretrain_multipack_attn") is False:
        return (
            "pretrain_multipack_attn: false concatenates pretraining documents with positions counting on across "
            f"them, so no batch says where a document ends. {FIX}pretrain_multipack_attn: true (or leave it out)"
        )
    return None


def runs_here(model: Any, backend: str | None, strict: bool) -> tuple[str | None, tuple[str, ...]]:
    """A named backend checked for this model, device, dtype and install before any proof: where it cannot run here,
    refused under ``foundry_attn_strict`` with its cause, else the chain from it picks the next that runs.

    Args:
        model: the model axolotl loaded (a wrapper of one, PEFT included).
        backend: the backend named, ``auto`` or None (the model's own: nothing to check).
        strict: ``foundry_attn_strict``.

    Returns:
        The backend to attach and the chain ``auto`` walks (``auto`` and the chain from ``backend``, where it cannot
        run here).

    Raises:
        AttentionUnavailableError: strict, and ``backend`` cannot run here (the check, its cause, the fix).

    Example::

        >>> runs_here(model, "flash_attention_2", strict=False)     # a CPU without flash-attn
        ('auto', ('flash_attention_2', 'torch_varlen', 'sdpa', 'eager'))
    """
    if backend is None or backend == AUTO:
        return backend, DEFAULT_FALLBACK
    hf = unwrapped(model)
    dtype = weights_compute_dtype(next(hf.parameters()).dtype, "auto")
    with speaking(AXOLOTL):
        decision = decide(None, backend, DEFAULT_FALLBACK, strict, dtype, config=hf.config, model_class=type(hf))
    if decision.chosen == backend:
        return backend, DEFAULT_FALLBACK
    return AUTO, candidate_order(backend, DEFAULT_FALLBACK)
