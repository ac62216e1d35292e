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

from foundry_attn.callbacks.common import foundry_model
from foundry_attn.policy import summarize


def decision_hparams(model: Any) -> dict[str, Any]:
    """``attn/*`` hyperparameters of a ``foundry_attn_causal_lm`` (through DDP); empty for other models."""
    ours = foundry_model(model)
    if ours is None:
        return {}
    decision = ours.attn_decision
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
