"""Which ranks fell back, on which GPUs, and why: queries over the event logs of one run or a tree of runs.

    foundry-attn events runs/                     # every event, one line each (--kind, --run, --since filter)
    foundry-attn events runs/ --fell-back         # run, launch, rank, host, device, sm, requested -> chosen, why
    foundry-attn events runs/ --summary           # fallback frequency by device class and by reason
    foundry-attn events runs/ --fell-back --json  # the same rows for machines

Files are streamed line by line; a line that is not a whole JSON event (cut by a crash, written by another tool)
is counted and reported at the end, never fatal, and unknown kinds and fields are carried along. A rank's
decision is its last ``attn_impl`` event of a launch (a switch at the first forward replaces the first one).
Core module: standard library only.
"""

from __future__ import annotations

import collections
import datetime
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from foundry_attn.observe.events import Skipped, event_files, iter_events

FELL_BACK_COLUMNS = ("run", "launch", "rank", "host", "device_name", "capability", "requested", "chosen", "reason")


class EventsError(ValueError):
    """A path that holds no events: the one-line message says which and why."""


def files(path: str | os.PathLike) -> list[Path]:
    """The event files under ``path`` (:func:`~foundry_attn.observe.events.event_files`), or a one-line error.

    Args:
        path: an event file, a run's folder, or a tree of runs.

    Returns:
        The files, rank 2 before rank 10.

    Raises:
        EventsError: ``path`` does not exist, or holds no ``events-rank*.jsonl``.

    Example::

        >>> [p.name for p in files(runs / "my-run")]  # 8 ranks
        ['events-rank0.jsonl', 'events-rank1.jsonl', ..., 'events-rank7.jsonl']
    """
    root = Path(path)
    if not root.exists():
        raise EventsError(f"{path}: no such file or folder")
    found = event_files(root)
    if not found:
        raise EventsError(f"{path}: no event files (events-rank*.jsonl) in it")
    return found


def _run_of(event: dict, path: Path) -> str:
    """The event's run name; for events written without one, the folder the run's ``attn_events`` sits in."""
    if event.get("run"):
        return str(event["run"])
    parent = path.parent
    return parent.parent.name if parent.name == "attn_events" else parent.name


def events(
    paths: Iterable[Path],
    kind: str | None = None,
    run: str | None = None,
    since: float | None = None,
    skipped: Skipped | None = None,
) -> Iterator[dict]:
    """Every event of ``paths`` with ``run`` filled in, filtered by kind, run name and time.

    Args:
        paths: the event files (:func:`files`).
        kind: only events of this kind; None: every kind.
        run: only this run's events; None: every run's.
        since: only events written at or after this time (seconds since the epoch, :func:`parse_time`).
        skipped: where the lines that are not whole JSON events are counted, if given.

    Returns:
        An iterator over the events; ``run`` is the run's folder name where an event was written without one.

    Example::

        >>> recent = list(events(files(runs / "my-run"), since=parse_time("2026-11-22")))  # the second launch's
        >>> len(recent), sorted({e["kind"] for e in recent})
        (11, ['attn_impl', 'attn_inspect', 'attn_verdict', 'upad_trace'])
    """
    for path in paths:
        for event in iter_events([path], kind, skipped):
            event["run"] = _run_of(event, path)
            if run is not None and event["run"] != run:
                continue
            if since is not None and float(event.get("time") or 0) < since:
                continue
            yield event


def decisions(stream: Iterable[dict]) -> list[dict]:
    """The last ``attn_impl`` event of every (run, launch, rank).

    Args:
        stream: events with ``run`` filled in (:func:`events`).

    Returns:
        One ``attn_impl`` event per (run, launch, rank), the last of each.

    Example::

        >>> len(decisions(events(files(runs / "my-run"))))  # 8 ranks, launched twice
        16
    """
    last: dict[tuple, dict] = {}
    for event in stream:
        if event.get("kind") == "attn_impl":
            last[(event["run"], event.get("launch"), event.get("rank"))] = event
    return list(last.values())


def failed(decision: dict) -> bool:
    """A rank whose build raised (strict, or nothing in the chain could run).

    Args:
        decision: a rank's ``attn_impl`` event.

    Returns:
        True where the build failed or chose nothing.

    Example::

        >>> failed({"chosen": None, "failed": True}), failed({"chosen": "sdpa"})
        (True, False)
    """
    return bool(decision.get("failed")) or decision.get("chosen") is None


def _fell_back_flag(decision: dict) -> bool:
    """The decision's ``fell_back`` (``fallback`` in logs written before the rename)."""
    return bool(decision.get("fell_back", decision.get("fallback")))


def unmet(decision: dict) -> bool:
    """A rank that did not get what it asked for: it fell back, or its build failed.

    Args:
        decision: a rank's ``attn_impl`` event.

    Returns:
        True where it fell back or failed.

    Example::

        >>> unmet({"requested": "flash_attention_2", "chosen": "sdpa", "fell_back": True})
        True
    """
    return _fell_back_flag(decision) or failed(decision)


def fell_back(decided: Iterable[dict]) -> list[dict]:
    """Every rank that did not get what it asked for, as flat rows.

    Args:
        decided: every rank's decision (:func:`decisions`).

    Returns:
        The :data:`FELL_BACK_COLUMNS` of each unmet decision, by run, launch and rank.

    Example::

        >>> [(row["rank"], row["device_name"], row["chosen"]) for row in fell_back(decided)]  # of runs/my-run
        [(3, 'Tesla T4', 'sdpa'), (7, 'Tesla T4', 'sdpa')]
    """
    rows = [{c: d.get(c) for c in FELL_BACK_COLUMNS} for d in decided if unmet(d)]
    return sorted(rows, key=lambda r: (str(r["run"]), str(r["launch"]), r["rank"] if r["rank"] is not None else -1))


def summary(decided: list[dict]) -> dict[str, Any]:
    """Fallback frequency by device class (device name and compute capability) and by reason.

    Args:
        decided: every rank's decision (:func:`decisions`).

    Returns:
        ``ranks``, ``fell_back``, ``runs``, ``by_device`` (per device class: ranks, fell back, rate) and
        ``by_reason`` (the count of each reason, most common first).

    Example::

        >>> summary(decided)["by_device"]["Tesla T4 (sm75)"]  # of runs/my-run: its first launch had two T4s
        {'ranks': 2, 'fell_back': 2, 'rate': 1.0}
    """
    by_device: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    reasons: collections.Counter[str] = collections.Counter()
    for d in decided:
        device = f"{d.get('device_name')} ({d.get('capability')})"
        by_device[device][0] += 1
        if unmet(d):
            by_device[device][1] += 1
            reasons[str(d.get("reason"))] += 1
    return {
        "ranks": len(decided),
        "fell_back": sum(n for _, n in by_device.values()),
        "runs": len({d["run"] for d in decided}),
        "by_device": {k: {"ranks": n, "fell_back": f, "rate": f / n} for k, (n, f) in sorted(by_device.items())},
        "by_reason": dict(reasons.most_common()),
    }


def parse_time(value: str) -> float:
    """Seconds since the epoch, or an ISO date/time (``2026-11-22``, ``2026-11-22T06:00``; UTC unless given).

    Args:
        value: what ``--since`` was given.

    Returns:
        Seconds since the epoch.

    Raises:
        ValueError: ``value`` is neither a number nor an ISO date/time.

    Example::

        >>> parse_time("2026-11-22"), parse_time("1700000000")
        (1795305600.0, 1700000000.0)
    """
    try:
        return float(value)
    except ValueError:
        stamp = datetime.datetime.fromisoformat(value)
        if stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=datetime.UTC)
        return stamp.timestamp()


def table(rows: list[dict], columns: Iterable[str]) -> str:
    """Aligned columns for people; the last column is never padded.

    Args:
        rows: one dict per row.
        columns: the keys shown, in order; a value that is missing or None shows as ``-``.

    Returns:
        The column names and the rows, joined by newlines.

    Example::

        >>> print(table(fell_back(decided), ["run", "rank", "host", "chosen"]))  # of runs/my-run
        run     rank  host    chosen
        my-run  3     node-0  sdpa
        my-run  7     node-1  sdpa
    """
    columns = list(columns)
    cells = [[str(r.get(c, "")) if r.get(c) is not None else "-" for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines)


def one_line(event: dict) -> dict:
    """A listing row: when, run, launch, rank, kind, and a few words of what happened.

    Args:
        event: any event (:func:`events`).

    Returns:
        ``time`` (UTC), ``run``, ``launch``, ``rank``, ``kind`` and ``what``: ``requested -> chosen`` for a decision,
        else the first 80 characters of its ``message``.

    Example::

        >>> event = {"kind": "attn_impl", "requested": "flash_attention_2", "chosen": "sdpa", "fell_back": True}
        >>> one_line(event)["what"]
        'flash_attention_2 -> sdpa (fell back)'
    """
    what = ""
    if event.get("kind") == "attn_impl":
        what = f"{event.get('requested')} -> {event.get('chosen')}" + (" (fell back)" if _fell_back_flag(event) else "")
    elif "message" in event:
        what = str(event["message"])[:80]
    when = datetime.datetime.fromtimestamp(float(event.get("time") or 0), datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
    return {
        "time": when,
        "run": event.get("run"),
        "launch": event.get("launch"),
        "rank": event.get("rank"),
        "kind": event.get("kind"),
        "what": what,
    }


def report_skipped(skipped: Skipped) -> str | None:
    """The note on the lines the readers passed over, for the end of a listing.

    Args:
        skipped: what the readers counted.

    Returns:
        One sentence, or None where no line was skipped.

    Example::

        >>> report_skipped(Skipped(3, {"a/events-rank0.jsonl", "b/events-rank0.jsonl"}))
        'skipped 3 line(s) that are not JSON events, in 2 file(s)'
    """
    if not skipped.lines:
        return None
    return f"skipped {skipped.lines} line(s) that are not JSON events, in {len(skipped.files)} file(s)"
