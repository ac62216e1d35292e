"""transformers ``Trainer`` and TRL: what attention really did, as ``TrainerCallback`` objects (docs/trainer.md).

``install(trainer)`` or ``Trainer(..., callbacks=hf_trainer.callbacks())``; the Composer callbacks' twins.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

from foundry_attn.integrations.hf_trainer.attention_inspector import AttentionInspector
from foundry_attn.integrations.hf_trainer.attn_decision import AttnDecision
from foundry_attn.integrations.hf_trainer.common import SampledCallback, Session
from foundry_attn.integrations.hf_trainer.upad_tracer import UpadTracer

__all__ = ["AttentionInspector", "AttnDecision", "UpadTracer", "callbacks", "install"]

log = logging.getLogger(__name__)


def callbacks(
    trainer: Any = None, *, events_dir: str | None = None, log_interval: int = 50, verdict_interval: int = 100
) -> list[TrainerCallback]:
    """The decision, the inspector and the unpad tracer, sharing one :class:`~.common.Session` (one event log).

    Args:
        trainer: the Trainer, where known (:func:`install` passes it); None for ``Trainer(callbacks=...)``.
        events_dir: the event log's folder (default ``<output_dir>/attn_events``).
        log_interval: optimizer steps between sampled steps (the first is always sampled).
        verdict_interval: optimizer steps between verdicts on packed documents.

    Returns:
        ``[AttnDecision, AttentionInspector, UpadTracer]``.

    Example::

        >>> trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=hf_trainer.callbacks())
    """
    session = Session(trainer, events_dir)
    return [
        AttnDecision(session, log_interval),
        AttentionInspector(session, log_interval, verdict_interval=verdict_interval),
        UpadTracer(session, log_interval),
    ]


def install(trainer: Any, **options: Any) -> list[TrainerCallback]:
    """Add :func:`callbacks` to ``trainer``, ahead of its reporters; a second call adds nothing (a warning).

    Args:
        trainer: a transformers ``Trainer`` or TRL ``SFTTrainer``, before ``train()``.
        **options: :func:`callbacks`' keywords (``events_dir``, ``log_interval``, ``verdict_interval``).

    Returns:
        The callbacks in the trainer (the ones already there on a second call).

    Example::

        >>> attach(model, "sdpa")                      # optional: padding-free batches then train exactly
        >>> trainer = SFTTrainer(model=model, args=SFTConfig(padding_free=True, output_dir="out"), train_dataset=data)
        >>> install(trainer)
        >>> trainer.train()                            # attn/* metrics in every reporter; events in out/attn_events
    """
    present: list[TrainerCallback] = [c for c in trainer.callback_handler.callbacks if isinstance(c, SampledCallback)]
    if present:
        log.warning(
            "foundry_attn: install: this trainer already has foundry_attn's callbacks (%s); nothing added",
            ", ".join(type(c).__name__ for c in present),
        )
        return present
    added = callbacks(trainer, **options)
    for callback in added:
        trainer.add_callback(callback)
    return added
