"""Per-rank JSONL event logs: one whole line per event, or nothing.

    model:   {name: foundry_attn_causal_lm, events_dir: ./runs/my-run/attn_events}
    callbacks:
      attention_inspector: {events_dir: ./runs/my-run/attn_events}

Each line carries ``kind``, ``rank``, ``host``, ``device_name``, ``capability``, library versions and
``time``. Core module: standard library only (plus the capability snapshot).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from foundry_attn.capability import Capability, probe

ENV_EVENTS_DIR = "FOUNDRY_ATTN_EVENTS_DIR"


def default_events_dir(run_name: str | None = None) -> Path:
    """``$FOUNDRY_ATTN_EVENTS_DIR``, else ``./<run_name>/attn_events`` (Composer's run folder)."""
    if os.environ.get(ENV_EVENTS_DIR):
        return Path(os.environ[ENV_EVENTS_DIR])
    return Path(run_name or os.environ.get("RUN_NAME") or "foundry_attn_run") / "attn_events"


class EventLog:
    """Appends JSON lines to ``<dir>/events-rank<r>.jsonl``; checks it can write when created.

    ``cap`` stamps every line with host, device and versions; without it this machine is probed.
    """

    def __init__(self, directory: str | os.PathLike, rank: int, cap: Capability | None = None) -> None:
        self.directory = Path(directory)
        self.rank = rank
        self.path = self.directory / f"events-rank{rank}.jsonl"
        cap = cap if cap is not None else probe()
        self._stamp: dict = {
            "host": cap.host,
            "device_name": cap.device_name,
            "capability": cap.sm,
            "versions": {
                "torch": cap.torch_version,
                "transformers": cap.transformers_version,
                "flash_attn": cap.flash_attn_version,
                "transformer_engine": cap.transformer_engine_version,
            },
        }
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            os.close(os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
        except OSError as exc:
            raise OSError(
                f"events_dir {str(self.directory)!r} is not writable ({exc.strerror}); "
                f"set events_dir (or ${ENV_EVENTS_DIR}) to a writable folder"
            ) from exc

    def append(self, kind: str, **fields: object) -> dict:
        """Write one event. The line is serialised first and written with a single append."""
        event = {"kind": kind, "rank": self.rank, **self._stamp, "time": time.time(), **fields}
        line = (json.dumps(event, default=str) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            written = os.write(fd, line)
            if written != len(line):  # a short write (disk full): take the partial line back out
                os.ftruncate(fd, os.fstat(fd).st_size - written)
                raise OSError(f"short write to {self.path}: {written}/{len(line)} bytes")
        finally:
            os.close(fd)
        return event


def read_events(directory: str | os.PathLike, kind: str | None = None) -> list[dict]:
    """All events in ``directory`` (every rank, rank 0 first), optionally of one ``kind``, in file order per rank."""
    out = []
    paths = Path(directory).glob("events-rank*.jsonl")
    for path in sorted(paths, key=lambda p: (len(p.name), p.name)):  # rank2 before rank10
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if kind is None or event["kind"] == kind:
                out.append(event)
    return out
