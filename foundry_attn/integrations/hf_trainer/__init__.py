"""transformers ``Trainer`` and TRL: what attention really did, as transformers ``TrainerCallback`` objects.

    from foundry_attn import attach, install

    attach(model, "sdpa")      # optional: padding-free batches then train exactly (docs/trainer.md)
    trainer = SFTTrainer(model=model, args=SFTConfig(padding_free=True, output_dir="out"), train_dataset=data)
    install(trainer)           # or Trainer(..., callbacks=hf_trainer.callbacks())
    trainer.train()

The Composer callbacks' twins (:mod:`foundry_attn.integrations.composer`), one module per callback, on the same cores:
:class:`~.attn_decision.AttnDecision` (each rank's attention: ``attach``'s backend and path, or the model's own
setting; one line over every rank on rank 0), :class:`~.attention_inspector.AttentionInspector` (masks, fill and the
measured verdict on packed documents of sampled steps) and :class:`~.upad_tracer.UpadTracer` (flash-attention unpad /
varlen / dense calls of sampled steps); what they share is :mod:`.common`. Metrics join the next logs the Trainer
reports, ahead of every reporter (W&B, TensorBoard, MLflow, the console), however the callbacks were added;
``trainer.log`` is never called, so the Trainer's and TRL's own logged values stay as they are. A second
:func:`install` adds nothing. Events go to ``<output_dir>/attn_events/events-rank<r>.jsonl``, the kinds Composer runs
write, so ``foundry-attn events`` and ``foundry-attn report`` read Trainer runs and mixed fleets alike. Hooks live
for one forward of a sampled step and are gone by its end, even when it raises. transformers only (TRL optional).
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
    trainer: Any = None,
    *,
    events_dir: str | None = None,
    log_interval: int = 50,
    verdict_interval: int = 100,
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
    """Add the decision, the inspector and the unpad tracer (:func:`callbacks`) to ``trainer``, first among its
    callbacks' reporters; a second call adds nothing (a warning).

    Args:
        trainer: a transformers ``Trainer`` or TRL ``SFTTrainer``, before ``train()``.
        **options: :func:`callbacks`' keywords: ``events_dir`` (default ``<output_dir>/attn_events``),
            ``log_interval`` (optimizer steps between samples, default 50), ``verdict_interval`` (default 100).

    Returns:
        The callbacks in the trainer (the ones already there on a second call).

    Example::

        >>> from foundry_attn import attach, install
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
