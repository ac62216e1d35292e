"""What our Composer callbacks share: the models inside ``state.model``, the event log, intervals, release."""

from __future__ import annotations

from typing import Any

from composer.core import Callback, State, Time, TimeUnit
from composer.utils import dist
from typing_extensions import override

from foundry_attn.checks import check_interval
from foundry_attn.flat.unwrap import find_inside
from foundry_attn.observe.events import EventLog, default_events_dir

__all__ = ["ReleasingCallback", "check_log_interval", "foundry_model", "open_event_log"]


def foundry_model(model: Any) -> Any:
    """The ``foundry_attn_causal_lm`` inside ``state.model`` (also through DDP's ``.module``), or None.

    Args:
        model: what Composer trains (``state.model``), wrapped or not.

    Returns:
        The outermost module that carries an ``attn_decision``, or None.

    Example::

        >>> foundry_model(state.model).attn_decision.chosen
        'sdpa'
    """
    found = find_inside(model, lambda m: getattr(m, "attn_decision", None) is not None)
    return None if found is None else found[1]


_LOG_INTERVAL = (
    "an integer >= 1 (batches between samples; the first batch is always sampled), a time string "
    "in batches such as '25ba', or a composer Time in batches"
)


def check_log_interval(owner: str, log_interval: Any, key: str = "log_interval") -> int:
    """An interval in batches: ``25``, ``'25ba'`` or ``Time(25, TimeUnit.BATCH)``; else a ValueError saying so.

    Args:
        owner: the callback named in the error (``attention_inspector``, ``upad_tracer``).
        log_interval: what the user gave.
        key: the key named in the error (``verdict_interval`` for the inspector's verdicts).

    Returns:
        The interval in batches.

    Example::

        >>> check_log_interval("upad_tracer", "25ba")
        25
    """
    value = log_interval
    if isinstance(log_interval, str | Time):
        try:
            parsed = Time.from_input(log_interval)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{owner}: {key} must be {_LOG_INTERVAL}; got {log_interval!r} ({exc})") from None
        if parsed.unit != TimeUnit.BATCH:
            raise ValueError(
                f"{owner}: {key} must be {_LOG_INTERVAL}; got {log_interval!r}, whose unit is "
                f"{parsed.unit.name.lower()} ('{parsed.unit.value}'), not batches ('ba')"
            )
        value = parsed.value
    return check_interval(owner, key, value, accepted=_LOG_INTERVAL)


def open_event_log(state: State, events_dir: str | None) -> EventLog:
    """This rank's event log in ``events_dir``, else the ``foundry_attn_causal_lm``'s folder, else the run's.

    Args:
        state: Composer's training state (its model and run name).
        events_dir: the callback's ``events_dir``, or None.

    Returns:
        The :class:`~foundry_attn.observe.events.EventLog`, ``<folder>/events-rank<r>.jsonl``.

    Example::

        >>> open_event_log(state, None).path      # run_name 'my-run', rank 0
        PosixPath('my-run/attn_events/events-rank0.jsonl')
    """
    ours = foundry_model(state.model)
    if ours is not None and not ours.attn_events.bound:  # the model's log waited for the run's name
        ours.attn_events.bind(default_events_dir(state.run_name), run=state.run_name)
    directory = events_dir or (ours.attn_events.directory if ours is not None else default_events_dir(state.run_name))
    return EventLog(directory, dist.get_global_rank(), ours.attn_capability if ours is not None else None)


class ReleasingCallback(Callback):
    """A callback on a core (``core.events``: its event log) whose hooks are undone at ``FIT_END``, ``close`` and
    after it, even when training raised."""

    core: Any  # the torch-only core (InspectorCore, TracerCore), shared with the Trainer's callback
    events_dir: str | None

    @property
    def events(self) -> EventLog | None:
        """This callback's event log, opened at FIT_START.

        Returns:
            The :class:`~foundry_attn.observe.events.EventLog`, or None before FIT_START.

        Example::

            >>> inspector.events.path      # after trainer.fit(), run_name 'my-run', rank 0
            PosixPath('my-run/attn_events/events-rank0.jsonl')
        """
        return self.core.events

    def _open_events(self, state: State) -> None:
        if self.core.events is None:
            self.core.events = open_event_log(state, self.events_dir)

    def release(self) -> None:
        """Every hook and patch of this callback off, idempotently (subclasses implement it).

        Example::

            >>> tracer.release()      # a second call does nothing
        """
        raise NotImplementedError

    @override
    def fit_end(self, state: State, logger: Any) -> None:
        """At FIT_END: :meth:`release`."""
        self.release()

    @override
    def close(self, state: State, logger: Any) -> None:
        """At close (also after training raised): :meth:`release`."""
        self.release()

    @override
    def post_close(self) -> None:
        """After close: :meth:`release` once more."""
        self.release()
