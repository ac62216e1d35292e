"""What the Trainer callbacks share: the :class:`Session` of one :func:`~foundry_attn.integrations.hf_trainer.callbacks`
call (the trainer, the event log, the metrics waiting for the next logs) and the sampled-step base class.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler
from typing_extensions import override

from foundry_attn.checks import check_interval
from foundry_attn.flat.unwrap import find_hf_model
from foundry_attn.observe.events import EventLog
from foundry_attn.observe.ranks import launch_id
from foundry_attn.proof.proving import proving

#: what a Trainer user changes so that packed documents stop seeing each other
FIX = (
    "call foundry_attn.attach(model, backend) before building the Trainer (padding-free batches then train "
    "on the proven path), or train without padding_free"
)


class Session:
    """What the callbacks of one :func:`~foundry_attn.integrations.hf_trainer.callbacks` call share: the trainer, the
    event log (one launch id over the ranks) and the metrics waiting for the Trainer's next logs.

    Args:
        trainer: the Trainer, where known (``install`` knows it; ``Trainer(callbacks=...)`` finds its handler).
        events_dir: the event log's folder (default ``<output_dir>/attn_events``).
    """

    def __init__(self, trainer: Any = None, events_dir: str | None = None) -> None:
        self.trainer, self.events_dir = trainer, events_dir
        self.events: EventLog | None = None
        self.pending: dict[str, float] = {}
        self.merger = Merger(self)
        self.placed = False

    def open(self, args: Any) -> EventLog:
        """The event log, opened once at train begin (on every rank: the launch id is a collective).

        Args:
            args: the Trainer's ``TrainingArguments``.

        Returns:
            The event log, ``<output_dir>/attn_events/events-rank<r>.jsonl`` by default.

        Example::

            >>> session.open(trainer.args).directory
            PosixPath('out/attn_events')
        """
        if self.events is None:
            folder = self.events_dir or Path(args.output_dir) / "attn_events"
            run = getattr(args, "run_name", None) or Path(args.output_dir).name
            self.events = EventLog(folder, args.process_index, run=run, launch=launch_id())
        return self.events

    def place(self, handler: CallbackHandler | None) -> None:
        """Put :class:`Merger` first among ``handler``'s callbacks, before the Trainer's reporters.

        Args:
            handler: the Trainer's callback handler; None leaves the merging to our own ``on_log``.

        Example::

            >>> session.place(trainer.callback_handler)
        """
        self.placed = handler is not None
        if handler is not None and self.merger not in handler.callbacks:
            handler.callbacks = [self.merger, *handler.callbacks]  # a new list: the running event goes on over the old

    def log(self, metrics: Mapping[str, float]) -> None:
        """Hold ``metrics`` for the Trainer's next logs (never ``trainer.log``: TRL folds its own metrics into every
        call of it and clears them).

        Args:
            metrics: ``attn/*`` values.

        Example::

            >>> session.log({"attn/path_flat": 1.0})
        """
        self.pending.update(metrics)

    def merge(self, logs: dict | None, state: Any) -> None:
        """``pending`` into the logs being reported, and into the copy the Trainer just kept in its history.

        Args:
            logs: the logs the Trainer is about to report (changed in place).
            state: the Trainer's ``TrainerState``.

        Example::

            >>> session.merge(logs, trainer.state)
        """
        if not self.pending or logs is None:
            return
        history = getattr(state, "log_history", None)
        if history and history[-1] == {**logs, "step": state.global_step}:  # the Trainer's copy of these logs
            history[-1].update(self.pending)
        logs.update(self.pending)
        self.pending.clear()


class Merger(TrainerCallback):
    """First among the Trainer's callbacks: the waiting ``attn/*`` metrics join the logs every reporter gets."""

    def __init__(self, session: Session) -> None:
        self.session = session

    @override
    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        """Merge the waiting metrics into ``logs``."""
        self.session.merge(logs, state)


def calling_handler() -> CallbackHandler | None:
    """The Trainer's :class:`CallbackHandler` calling this event (``Trainer(callbacks=...)`` does not tell us).

    Returns:
        The handler, or None when no caller up the stack is one.

    Example::

        >>> session.place(calling_handler())      # inside on_train_begin
    """
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, CallbackHandler):
            return owner
        frame = frame.f_back
    return None


class SampledCallback(TrainerCallback):
    """A Trainer callback that samples steps (the first optimizer step, then every ``log_interval``-th), hooks one
    forward of a sampled step, and releases its hooks at its end, at train end and when training raises.

    Args:
        session: the :class:`Session` shared with the other callbacks (default: a new one).
        log_interval: optimizer steps between samples, an integer >= 1 (the first step is always sampled).
    """

    owner = ""

    def __init__(self, session: Session | None = None, log_interval: int = 50) -> None:
        self.session = session or Session()
        self.log_interval = check_interval(self.owner, "log_interval", log_interval)
        self._handles: list[Any] = []
        self._model: Any = None  # what the Trainer calls (a wrapper, compiled or not), and the HF model inside it
        self._hf: Any = None

    @property
    def events(self) -> EventLog | None:
        """The shared event log.

        Returns:
            The :class:`~foundry_attn.observe.events.EventLog`, or None before train begin.

        Example::

            >>> callback.events.directory
            PosixPath('out/attn_events')
        """
        return self.session.events

    @override
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """Open the event log, go first among the reporters, and :meth:`begin`."""
        self.session.open(args)
        trainer = self.session.trainer
        self.session.place(trainer.callback_handler if trainer is not None else calling_handler())
        found = find_hf_model(model) if model is not None else None
        self._model, self._hf = model, found[1] if found is not None else model
        self.begin(args)

    def begin(self, args: Any) -> None:
        """At train begin, once ``_model`` (what the Trainer calls) and ``_hf`` (the HF model inside it) are set.

        Args:
            args: the Trainer's ``TrainingArguments``.

        Example::

            >>> callback.begin(trainer.args)
        """

    @override
    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        """Merge the waiting metrics where no handler was found to go first in."""
        if not self.session.placed:  # the reporters after us still get them
            self.session.merge(logs, state)

    def one_forward(self, model: Any, before: Callable[[dict], None], after: Callable[[dict, Any], None]) -> None:
        """Hooks on ``model`` for its next forward that is the batch's (a proof's forwards are not).

        Args:
            model: what the Trainer calls.
            before: called with the forward's keywords at its start (the first pre-hook).
            after: called with its keywords and output (None when it raised) at its end, after :meth:`release`.

        Example::

            >>> self.one_forward(model, lambda batch: seen.append(batch), lambda batch, out: None)
        """

        def pre(_: Any, args: tuple, kwargs: dict) -> None:
            if not proving():
                before(kwargs)

        def post(_: Any, args: tuple, kwargs: dict, output: Any) -> None:
            if proving():
                return
            self.release()
            after(kwargs, output)

        self._drop_hooks()
        self._handles = [
            model.register_forward_pre_hook(pre, with_kwargs=True, prepend=True),
            model.register_forward_hook(post, with_kwargs=True, always_call=True),  # last: release may drop them all
        ]

    def _drop_hooks(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def release(self) -> None:
        """Every hook and patch of ours off the model (idempotent).

        Example::

            >>> callback.release()
        """
        self._drop_hooks()

    @override
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Release everything."""
        self.release()
