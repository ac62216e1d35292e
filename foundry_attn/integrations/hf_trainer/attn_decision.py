"""``AttnDecision`` for transformers' ``Trainer``: each rank's attention, and every move of the run to rows (the
Composer twin: :mod:`foundry_attn.integrations.composer.attn_decision`).
"""

from __future__ import annotations

import logging
from typing import Any

from typing_extensions import override

from foundry_attn.integrations.hf_trainer.common import SampledCallback, Session
from foundry_attn.observe.discovery import decision_of
from foundry_attn.observe.path_watch import PathWatch
from foundry_attn.observe.ranks import announce
from foundry_attn.path.state import FLAT, PathState, path_of

__all__ = ["AttnDecision"]

log = logging.getLogger(__name__)


class AttnDecision(SampledCallback):
    """Each rank's attention at train begin: what :func:`~foundry_attn.path.attach.attach` decided (the backend, why,
    the path and its proof) or the implementation the model runs, once per rank and in one line over every rank on
    rank 0 (``attention: 2/2 ranks sdpa; path flat``); a proof that moves the run to rows, at the end of its step.

        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=hf_trainer.callbacks())

    Logged keys and events: docs/trainer.md, "Logged keys".

    Args:
        session: the :class:`~foundry_attn.integrations.hf_trainer.common.Session` shared with the other callbacks.
        log_interval: kept for a uniform signature (the decision is logged at train begin and on a change).
    """

    owner = "attn_decision"

    def __init__(self, session: Session | None = None, log_interval: int = 50) -> None:
        super().__init__(session, log_interval)
        self._state: PathState | None = None
        self._watch: PathWatch | None = None

    @override
    def begin(self, args: Any) -> None:
        """Say this rank's decision and gather every rank's (a collective: every rank runs it)."""
        assert self.events is not None
        announce(decision_of(self._hf), self.events, args.process_index, log)
        self._state = path_of(self._hf)
        if self._state is not None:
            self._watch = PathWatch(self._state)
            self.session.log({"attn/path_flat": float(self._state.path == FLAT)})

    @override
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """An ``attn_impl`` event per change this step (path, execution), and ``attn/path_flat`` on a move to rows."""
        changed = () if self._watch is None else self._watch.changed()
        for what in (w for w in changed if w != "layout"):
            if self.events is not None:
                self.events.append("attn_impl", **decision_of(self._hf), at=what)
        if "path" in changed and self._state is not None:
            self.session.log({"attn/path_flat": float(self._state.path == FLAT)})
