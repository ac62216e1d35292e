"""Per-rank JSONL event logs: one whole line per event, or nothing.

    model:   {name: foundry_attn_causal_lm, events_dir: ./runs/my-run/attn_events}
    callbacks:
      attention_inspector: {events_dir: ./runs/my-run/attn_events}

Each line carries ``kind``, ``rank``, ``run`` and ``launch`` (one id shared by every rank of a launch),
``host``, ``device_name``, ``capability``, library versions and ``time``. Readers (:func:`iter_events`) skip
a line that is not whole JSON and count it, so a file cut by a crash or another tool never hides the rest.
Core module: standard library only (plus the capability snapshot).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from foundry_attn.selection.capability import Capability, probe

ENV_EVENTS_DIR = "FOUNDRY_ATTN_EVENTS_DIR"


def default_events_dir(run_name: str | None = None) -> Path:
    """``$FOUNDRY_ATTN_EVENTS_DIR``, else ``./<run_name>/attn_events`` (Composer's run folder).

    Args:
        run_name: the run's name; None: ``$RUN_NAME``, else ``foundry_attn_run``.

    Returns:
        The folder (not made here).

    Example::

        >>> default_events_dir("my-run")  # FOUNDRY_ATTN_EVENTS_DIR unset
        PosixPath('my-run/attn_events')
    """
    if os.environ.get(ENV_EVENTS_DIR):
        return Path(os.environ[ENV_EVENTS_DIR])
    return Path(run_name or os.environ.get("RUN_NAME") or "foundry_attn_run") / "attn_events"


def run_from_env() -> str | None:
    """The run's name as the launcher gives it: ``$COMPOSER_RUN_NAME``, else ``$RUN_NAME``.

    Returns:
        The name, or None where neither is set.

    Example::

        >>> from unittest import mock
        >>> with mock.patch.dict(os.environ, {"RUN_NAME": "my-run"}):  # as the launcher sets it
        ...     run_from_env()
        'my-run'
    """
    return os.environ.get("COMPOSER_RUN_NAME") or os.environ.get("RUN_NAME")


class EventLog:
    """Appends JSON lines to ``<dir>/events-rank<r>.jsonl``; checks it can write when it gets its folder.

    ``cap`` stamps every line with host, device and versions; without it this machine is probed. Made with
    ``directory=None`` it holds its events until :meth:`bind` names the folder (the model is built before
    Composer knows the run's name; our callbacks bind it at ``FIT_START``).
    """

    def __init__(
        self,
        directory: str | os.PathLike | None,
        rank: int,
        cap: Capability | None = None,
        run: str | None = None,
        launch: str | None = None,
    ) -> None:
        self.rank = rank
        cap = cap if cap is not None else probe()
        self._stamp: dict = {
            "run": run or run_from_env(),
            "launch": launch,
            "host": cap.host,
            "device_name": cap.device_name,
            "capability": cap.sm,
            "versions": {
                "torch": cap.torch_version,
                "transformers": cap.transformers_version,
                "flash_attn": cap.flash_attn_installed or cap.flash_attn_version,  # installed, imports or not
                "transformer_engine": cap.transformer_engine_version,
            },
        }
        self._pending: list[dict] = []
        self.directory: Path | None = None
        self.path: Path | None = None
        if directory is not None:
            self.bind(directory)

    @property
    def bound(self) -> bool:
        """Whether :meth:`bind` has named the folder (events are written, not held).

        Returns:
            True once the log has its folder.

        Example::

            >>> EventLog(None, rank=0).bound
            False
        """
        return self.directory is not None

    def bind(self, directory: str | os.PathLike, run: str | None = None) -> None:
        """Name the folder (and the run, if it was not known), then write the events held so far.

        Args:
            directory: the folder, made if missing.
            run: the run's name, stamped where the log was made without one.

        Raises:
            OSError: the folder cannot be written (the message names ``events_dir``).

        Example::

            >>> log = EventLog(None, rank=0)  # events held until the folder is known
            >>> log.bind("runs/my-run/attn_events", run="my-run")
            >>> log.path
            PosixPath('runs/my-run/attn_events/events-rank0.jsonl')
        """
        self.directory = Path(directory)
        self.path = self.directory / f"events-rank{self.rank}.jsonl"
        if run and not self._stamp["run"]:
            self._stamp["run"] = run
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:  # a line left unfinished by someone else: our first event starts on a line of its own
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    os.write(fd, b"\n")
            finally:
                os.close(fd)
        except OSError as exc:
            raise OSError(
                f"events_dir {str(self.directory)!r} is not writable ({exc.strerror}); "
                f"set events_dir (or ${ENV_EVENTS_DIR}) to a writable folder"
            ) from exc
        pending, self._pending = self._pending, []
        for event in pending:
            self._write({**event, "run": event.get("run") or self._stamp["run"]})

    def append(self, kind: str, **fields: object) -> dict:
        """Write one event (held until :meth:`bind` when the folder is not known yet).

        Args:
            kind: the event's kind (``attn_impl``, ``attn_inspect``, ``attn_verdict``, ``upad_trace``, ...).
            **fields: the event's own fields (they win over the stamp's).

        Returns:
            The event: ``kind``, ``rank``, the stamp (run, launch, host, device, versions), ``time`` and ``fields``.

        Example::

            >>> log = EventLog("attn_events", rank=0)
            >>> event = log.append("attn_verdict", step=3, state="isolated")
            >>> event["kind"], event["rank"], event["step"]
            ('attn_verdict', 0, 3)
        """
        event = {"kind": kind, "rank": self.rank, **self._stamp, "time": time.time(), **fields}
        if self.path is None:
            self._pending.append(event)
        else:
            self._write(event)
        return event

    def _write(self, event: dict) -> None:
        """The line is serialised first and written with a single append."""
        assert self.path is not None
        line = (json.dumps(event, default=str) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            written = os.write(fd, line)
            if written != len(line):  # a short write (disk full): take the partial line back out
                os.ftruncate(fd, os.fstat(fd).st_size - written)
                raise OSError(f"short write to {self.path}: {written}/{len(line)} bytes")
        finally:
            os.close(fd)


@dataclasses.dataclass
class Skipped:
    """Lines a reader passed over: not whole JSON objects (cut by a crash, written by another tool)."""

    lines: int = 0
    files: set[str] = dataclasses.field(default_factory=set)


def event_files(path: str | os.PathLike) -> list[Path]:
    """Every ``events-rank*.jsonl`` under ``path`` (one run's folder, or a tree of runs), rank 2 before rank 10.

    Args:
        path: an event file, a run's ``attn_events`` folder, or a tree of runs.

    Returns:
        The files, by folder and rank; ``[path]`` for a file.

    Example::

        >>> for rank in (10, 2, 1, 0):
        ...     EventLog("attn_events", rank).path.touch()
        >>> [p.name for p in event_files("attn_events")]
        ['events-rank0.jsonl', 'events-rank1.jsonl', 'events-rank2.jsonl', 'events-rank10.jsonl']
    """
    root = Path(path)
    if root.is_file():
        return [root]
    return sorted(root.rglob("events-rank*.jsonl"), key=lambda p: (str(p.parent), len(p.name), p.name))


def iter_events(paths: Iterable[Path], kind: str | None = None, skipped: Skipped | None = None) -> Iterator[dict]:
    """Events of ``paths`` in file order; lines that are not whole JSON events are skipped and counted.

    With ``kind``, only the lines that contain ``"<kind>"`` are parsed (one substring test per line, which is
    what makes ``--fell-back`` over a million events fast); a line left unparsed that does not even end in
    ``}`` is still counted as broken.

    Args:
        paths: the event files (:func:`event_files`).
        kind: only events of this kind; None: every event.
        skipped: where the lines passed over are counted, if given.

    Returns:
        An iterator over the events, one dict each.

    Example::

        >>> skipped = Skipped()
        >>> rank3 = event_files(runs / "my-run" / "attn_events" / "events-rank3.jsonl")  # a T4, then an A100
        >>> [e["chosen"] for e in iter_events(rank3, "attn_impl", skipped)], skipped.lines
        (['sdpa', 'flash_attention_2'], 0)
    """
    needle = None if kind is None else f'"{kind}"'.encode()
    for path in paths:
        with open(path, "rb") as f:
            for line in f:
                if needle is not None and needle not in line:
                    if (
                        skipped is not None
                        and not line.endswith(b"}\n")
                        and line.strip()
                        and not line.rstrip().endswith(b"}")
                    ):
                        skipped.lines += 1
                        skipped.files.add(str(path))
                    continue
                event = _parse(line, path, skipped)
                if event is not None and (kind is None or event["kind"] == kind):
                    yield event


def _parse(line: bytes, path: Path, skipped: Skipped | None) -> dict | None:
    """The event on ``line``, or None (a broken line is counted)."""
    try:
        event = json.loads(line)
    except ValueError:
        event = None
    if isinstance(event, dict) and "kind" in event:
        return event
    if line.strip() and skipped is not None:
        skipped.lines += 1
        skipped.files.add(str(path))
    return None
