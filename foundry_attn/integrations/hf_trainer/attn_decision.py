"""``AttnDecision`` for transformers' ``Trainer``: each rank's attention, and every move of the run to rows.

See :class:`AttnDecision`; the Composer twin is :mod:`foundry_attn.integrations.composer.attn_decision`.
"""

from __future__ import annotations

import logging
from typing import Any

from foundry_attn.integrations.hf_trainer.common import SampledCallback, Session
from foundry_attn.observe.discovery import decision_of
from foundry_attn.observe.path_watch import PathWatch
from foundry_attn.observe.ranks import announce
from foundry_attn.path.state import FLAT, PathState, path_of

__all__ = ["AttnDecision"]

log = logging.getLogger(__name__)


class AttnDecision(SampledCallback):
    """Each rank's attention at train begin: what :func:`~foundry_attn.path.attach.attach` decided (the backend, why,
    the path and its proof) or the implementation the model runs, said once per rank and in one line over every rank
    on rank 0 (``attention: 2/2 ranks sdpa; path flat``); a proof that moves the run to rows, at the end of its step.

        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=hf_trainer.callbacks())

    .. list-table::
        :header-rows: 1
        :widths: 30 50 20

        * - Key
          - Logged data
          - When
        * - ``attn/path_flat``
          - 1.0 when the run is flat (unpadded once, the documents an argument of every attention call), 0.0 on
            rows (one document per row); attached models only.
          - The first logs, and the logs after a step whose proof moved the run to rows.
        * - ``attn_impl`` event
          - ``requested``, ``chosen``, ``fell_back``, ``reason``, ``strict``, ``compute_dtype``, ``proof``, ``path``,
            ``path_reason``, ``warning``, ``candidates`` (``Decision.as_dict``); ``at: path`` on a move to rows.
          - Train begin; the end of a step whose proof moved the run to rows.

    Args:
        session: the :class:`~foundry_attn.integrations.hf_trainer.common.Session` shared with the other callbacks.
        log_interval: kept for a uniform signature (the decision is logged at train begin and on a change).
    """

    owner = "attn_decision"

    def __init__(self, session: Session | None = None, log_interval: int = 50) -> None:
        super().__init__(session, log_interval)
        self._hf: Any = None
        self._state: PathState | None = None
        self._watch: PathWatch | None = None

    def begin(self, args: Any, model: Any, hf: Any) -> None:
        """Say this rank's decision and gather every rank's (a collective: every rank's train begin runs it).

        Args:
            args: the Trainer's ``TrainingArguments``.
            model: what the Trainer calls (a wrapper, compiled or not).
            hf: the HF model inside it.

        Example::

            >>> callback.begin(trainer.args, trainer.model, hf_model)   # from on_train_begin: attn/path_flat, next logs
        """
        assert self.events is not None
        announce(decision_of(hf), self.events, args.process_index, log)
        self._hf, self._state = hf, path_of(hf)
        if self._state is not None:
            self._watch = PathWatch(self._state)
            self.session.log({"attn/path_flat": float(self._state.path == FLAT)})

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """A proof of this step that moved the run to rows (the state's event): an event and the metric; the first
        batch's device that changed the execution (graphed without CUDA): an event.

        Args:
            args: the Trainer's ``TrainingArguments``.
            state: the Trainer's ``TrainerState``.
            control: the Trainer's ``TrainerControl``.
            **kwargs: the Trainer's other event keywords, unused.

        Example::

            >>> callback.on_step_end(args, state, control)   # the Trainer calls it after each optimizer step
        """
        changed = () if self._watch is None else self._watch.changed()
        for what in (w for w in changed if w != "layout"):
            if self.events is not None:
                self.events.append("attn_impl", **decision_of(self._hf), at=what)
        if "path" in changed and self._state is not None:
            self.session.log({"attn/path_flat": float(self._state.path == FLAT)})
