"""``attn_decision``: each rank's attention decision in the run's loggers (MLflow, W&B, ...)."""

from __future__ import annotations

from typing import Any

from composer.core import Callback, State
from composer.loggers import Logger
from typing_extensions import override

from foundry_attn.flat.unwrap import find_hf_model
from foundry_attn.integrations.composer.common import foundry_model
from foundry_attn.observe.discovery import attn_implementation, mpt_attn_impl
from foundry_attn.observe.path_watch import PathWatch

__all__ = ["AttnDecision", "decision_hparams", "stock_hparams"]


def stock_hparams(model: Any) -> dict[str, Any]:
    """``attn/chosen`` and ``attn/reason`` of a model that made no decision of ours: what runs, and where it was read.

    Args:
        model: what Composer trains (``state.model``), wrapped or not; None gives ``{}``.

    Returns:
        ``{"attn/chosen": ..., "attn/reason": ...}``, or ``{}`` without a model.

    Example::

        >>> stock_hparams(state.model)["attn/chosen"]      # LLM-Foundry's mpt_causal_lm, attn_impl: torch
        'torch'
    """
    found = find_hf_model(model)
    hf = found[1] if found is not None else model
    impl = attn_implementation(hf)
    if impl is None:
        return {}
    if mpt_attn_impl(hf) is not None:
        source = "MPT's attn_config['attn_impl']"
    elif impl.startswith("unknown"):
        source = "no attention setting found on the model"
    else:
        source = "the model's config._attn_implementation"
    return {"attn/chosen": impl, "attn/reason": f"set by the model, not chosen by foundry_attn ({source})"}


def decision_hparams(model: Any) -> dict[str, Any]:
    """The ``attn/*`` hyperparameters of a ``foundry_attn_causal_lm`` (through DDP), with the every-rank summary it
    gathered when it was built; ``{}`` for other models.

    Args:
        model: what Composer trains (``state.model``), or the ``foundry_attn_causal_lm`` itself.

    Returns:
        ``attn/requested``, ``attn/chosen``, ... ``attn/summary`` (docs/callbacks.md, attn_decision), or ``{}``.

    Example::

        >>> hparams = decision_hparams(state.model)      # attn_implementation: auto, flash-attn not installed
        >>> hparams["attn/chosen"], hparams["attn/fell_back"], hparams["attn/path"]
        ('sdpa', True, 'flat')
    """
    ours = foundry_model(model)
    if ours is None:
        return {}
    decision = ours.attn_decision
    return {
        "attn/requested": decision.requested,
        "attn/chosen": decision.chosen,
        "attn/fell_back": decision.fell_back,
        "attn/reason": decision.reason,
        "attn/compute_dtype": decision.compute_dtype,
        "attn/path": decision.path,
        "attn/path_reason": decision.path_reason,
        "attn/layout": decision.layout,
        "attn/layout_reason": decision.layout_reason,
        "attn/execution": decision.execution,
        "attn/execution_reason": decision.execution_reason,
        "attn/summary": ours.attn_summary,
    }


class AttnDecision(Callback):
    """Logs the attention decision of a ``foundry_attn_causal_lm`` as run hyperparameters.

    At ``INIT`` it logs what the model decided when it was built (what was asked for, what runs, why) on every rank,
    so that a fallback on some ranks shows in MLflow, W&B or any Composer logger, and logs the path, layout or
    execution again when a batch changes them. For other models it logs only ``attn/chosen`` and ``attn/reason``,
    read from the model. Every key it logs, and when: docs/callbacks.md (attn_decision).

    Example, in an LLM-Foundry YAML:

    .. code-block:: yaml

        callbacks:
          attn_decision: {}

    Example, with Composer's Trainer:

    .. code-block:: python

        from composer import Trainer
        from foundry_attn.integrations.composer.attn_decision import AttnDecision

        trainer = Trainer(model=model, train_dataloader=train_dataloader, max_duration="1ep",
                          callbacks=[AttnDecision()])  # model: a foundry_attn_causal_lm

    Args:
        (none): ``AttnDecision()`` takes no arguments (``attn_decision: {}`` in YAML).
    """

    def __init__(self) -> None:
        self._ours: Any = None
        self._watch: PathWatch | None = None

    @override
    def init(self, state: State, logger: Logger) -> None:
        """At INIT: the model's decision logged (:func:`decision_hparams`), else :func:`stock_hparams`."""
        hparams = decision_hparams(state.model)
        if not hparams:
            stock = stock_hparams(state.model)
            if stock:
                logger.log_hyperparameters(stock)
            return
        logger.log_hyperparameters(hparams)
        self._ours = foundry_model(state.model)
        self._watch = PathWatch(self._ours.attn_state)

    @override
    def batch_end(self, state: State, logger: Logger) -> None:
        """At BATCH_END: the path, layout or execution logged again where the batch changed them."""
        changed = () if self._watch is None else self._watch.changed()
        if not changed:
            return
        keys = tuple(f"attn/{what}" for what in changed)
        logger.log_hyperparameters({k: v for k, v in decision_hparams(self._ours).items() if k.startswith(keys)})
