"""What our callbacks share: finding the models inside ``state.model``, events, one-time notices, intervals.

Composer glue; the callbacks are ``attn_decision``, ``attention_inspector`` and ``upad_tracer``. The HF model inside
wrappers is :func:`foundry_attn.flat.unwrap.find_hf_model`'s; the torch-only probe is :mod:`foundry_attn.observe`'s.
"""

from __future__ import annotations

from typing import Any

from composer.core import Callback, State, Time, TimeUnit
from composer.utils import dist

from foundry_attn.checks import check_interval
from foundry_attn.flat.unwrap import find_inside
from foundry_attn.observe.events import EventLog, default_events_dir

__all__ = [
    "ReleasingCallback",
    "check_log_interval",
    "foundry_model",
    "open_event_log",
]


def foundry_model(model: Any) -> Any:
    """The ``foundry_attn_causal_lm`` inside ``state.model`` (also through DDP's ``.module``), or None.

    Args:
        model: what Composer trains (``state.model``), wrapped or not.

    Returns:
        The outermost module (``model`` itself first) that carries an ``attn_decision``, or None for other models.

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
    """``log_interval`` in batches: an integer >= 1, a time string in batches (``'25ba'``) or a :class:`.Time`
    in batches (``Time(25, TimeUnit.BATCH)``), as Composer's own callbacks take intervals. Any other unit
    (``'2ep'``, ``'100tok'``, ...) is a ValueError that says what is accepted.

    Args:
        owner: the callback that reads it (``attention_inspector``, ``upad_tracer``), named in the error.
        log_interval: what the user gave: ``25``, ``'25ba'`` or ``Time(25, TimeUnit.BATCH)``.
        key: the key named in the error (``verdict_interval`` for the inspector's verdicts).

    Returns:
        The interval in batches, an ``int``.

    Raises:
        ValueError: not an integer >= 1, not a time string, or a unit other than batches.

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
    """The callback's event log: ``events_dir`` if set, else the registered model's own events folder
    (``foundry_attn_causal_lm``'s ``events_dir``), else ``default_events_dir(run_name)``.

    Args:
        state: Composer's training state (its model and run name).
        events_dir: the callback's ``events_dir``; None for the model's folder, else the run's.

    Returns:
        This rank's :class:`~foundry_attn.observe.events.EventLog`, ``<folder>/events-rank<r>.jsonl``.

    Example::

        >>> open_event_log(state, None).path      # at FIT_START, run_name 'my-run', rank 0
        PosixPath('my-run/attn_events/events-rank0.jsonl')
    """
    ours = foundry_model(state.model)
    if ours is not None and not ours.attn_events.bound:  # the model's log waited for the run's name
        ours.attn_events.bind(default_events_dir(state.run_name), run=state.run_name)
    directory = events_dir or (ours.attn_events.directory if ours is not None else default_events_dir(state.run_name))
    return EventLog(directory, dist.get_global_rank(), ours.attn_capability if ours is not None else None)


class ReleasingCallback(Callback):
    """A callback whose hooks/patches are undone at ``FIT_END``, at ``close`` and after it, even when training
    raised (Composer calls ``close`` then). Subclasses implement ``release``, idempotently."""

    def release(self) -> None:
        """Every hook and patch of this callback off; a subclass implements it, idempotently.

        Raises:
            NotImplementedError: on this base class.

        Example::

            >>> tracer.release()      # an UpadTracer: its wrappers off; a second call does nothing
        """
        raise NotImplementedError

    def fit_end(self, state: State, logger: Any) -> None:
        """At ``FIT_END``: :meth:`release`.

        Args:
            state: Composer's training state.
            logger: Composer's logger.

        Example::

            >>> callback.fit_end(state, logger)      # Composer calls it at FIT_END
        """
        self.release()

    def close(self, state: State, logger: Any) -> None:
        """At ``close`` (also after training raised): :meth:`release`.

        Args:
            state: Composer's training state.
            logger: Composer's logger.

        Example::

            >>> trainer.close()      # Composer calls callback.close(state, logger), then post_close()
        """
        self.release()

    def post_close(self) -> None:
        """After ``close``: :meth:`release` once more.

        Example::

            >>> trainer.close()      # Composer calls callback.post_close() after close
        """
        self.release()
