"""``attn_decision``: put each rank's attention choice into the run's loggers (MLflow, W&B, ...).

    callbacks:
      attn_decision: {}

Logs hyperparameters ``attn/requested``, ``attn/chosen``, ``attn/fallback``, ``attn/reason`` (this
rank) and ``attn/summary`` (all ranks) at ``INIT``.
"""

from __future__ import annotations

from typing import Any

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from foundry_attn.policy import summarize


def find_decision(model: Any) -> Any:
    """The ``Decision`` of a ``foundry_attn_causal_lm``, through DDP/FSDP wrappers; None for other models."""
    for module in (model, getattr(model, "module", None)):
        if module is not None and getattr(module, "attn_decision", None) is not None:
            return module.attn_decision
    return None


def decision_hparams(model: Any) -> dict[str, Any]:
    decision = find_decision(model)
    if decision is None:
        return {}
    return {"attn/requested": decision.requested, "attn/chosen": decision.chosen,
            "attn/fallback": decision.fallback, "attn/reason": decision.reason,
            "attn/compute_dtype": decision.compute_dtype}


class AttnDecisionLogger(Callback):
    """Log the attention decision of every rank as run hyperparameters."""

    def init(self, state: State, logger: Logger) -> None:
        hparams = decision_hparams(state.model)
        if not hparams:
            return
        gathered = dist.all_gather_object({
            "rank": dist.get_global_rank(), "chosen": hparams["attn/chosen"],
            "fallback": hparams["attn/fallback"], "reason": hparams["attn/reason"],
        })
        logger.log_hyperparameters({**hparams, "attn/summary": summarize(gathered)})
