"""EventLog: one whole JSON line per event, stamped with where it ran; fails early when it cannot write."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from foundry_attn.observe.events import ENV_EVENTS_DIR, EventLog, default_events_dir
from foundry_attn.selection.capability import Capability
from tests.conftest import read_events

T4 = Capability(True, "Tesla T4", (7, 5), "2.7.0+cu126", "4.51.3", None, "flash-attn is not installed", None, "node-7")


def test_one_json_line_per_event_with_stamp(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events", rank=3, cap=T4)
    assert log.path == tmp_path / "events" / "events-rank3.jsonl" and log.path.exists()
    assert log.path.read_text() == ""  # created empty at construction
    before = time.time()
    first = log.append("attn_decision", chosen="sdpa", dtype=torch.bfloat16)
    log.append("upad", calls=2)
    lines = log.path.read_text().splitlines()
    assert len(lines) == 2
    event = json.loads(lines[0])
    assert event == json.loads(json.dumps(first, default=str))
    assert event["kind"] == "attn_decision" and event["rank"] == 3 and event["chosen"] == "sdpa"
    assert event["host"] == "node-7" and event["device_name"] == "Tesla T4" and event["capability"] == "sm75"
    assert event["versions"] == {
        "torch": "2.7.0+cu126",
        "transformers": "4.51.3",
        "flash_attn": None,
        "transformer_engine": None,
    }
    assert before <= event["time"] <= time.time()
    assert event["dtype"] == "torch.bfloat16"  # not JSON: written as text, never a broken line
    assert json.loads(lines[1])["calls"] == 2


def test_without_capability_probes_this_machine(tmp_path: Path) -> None:
    event = EventLog(tmp_path, rank=0).append("hello")
    for key in ("host", "device_name", "capability", "versions", "time"):
        assert key in event
    assert event["versions"]["torch"] == torch.__version__


def test_appends_to_an_existing_log(tmp_path: Path) -> None:
    EventLog(tmp_path, 0, T4).append("a")
    EventLog(tmp_path, 0, T4).append("b")  # a restarted run appends, it does not truncate
    assert [e["kind"] for e in read_events(tmp_path)] == ["a", "b"]


def test_concurrent_appends_stay_whole_lines(tmp_path: Path) -> None:
    log = EventLog(tmp_path, 0, T4)

    def worker(i: int) -> None:
        for j in range(25):
            log.append("tick", worker=i, j=j, payload="x" * 500)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = read_events(tmp_path, "tick")
    assert len(events) == 100
    for i in range(4):
        assert [e["j"] for e in events if e["worker"] == i] == list(range(25))


def test_unwritable_directory_fails_at_construction(tmp_path: Path) -> None:
    regular = tmp_path / "a-file"
    regular.write_text("not a folder")
    with pytest.raises(OSError) as info:
        EventLog(regular / "events", rank=0, cap=T4)
    msg = str(info.value)
    assert "events_dir" in msg and str(regular / "events") in msg and "not writable" in msg
    assert ENV_EVENTS_DIR in msg and "writable folder" in msg
    assert isinstance(info.value.__cause__, OSError)


def test_read_events_all_ranks_and_kind_filter(tmp_path: Path) -> None:
    for rank in (10, 2, 0):
        log = EventLog(tmp_path, rank, T4)
        log.append("attn_decision", chosen="sdpa")
        log.append("upad", calls=rank)
    (tmp_path / "notes.txt").write_text("ignored")
    events = read_events(tmp_path)
    assert len(events) == 6
    assert [e["rank"] for e in read_events(tmp_path, "attn_decision")] == [0, 2, 10]
    assert [e["calls"] for e in read_events(tmp_path, "upad")] == [0, 2, 10]
    assert read_events(tmp_path, "missing") == []
    assert read_events(tmp_path / "nothing-here") == []


def test_default_events_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(ENV_EVENTS_DIR, str(tmp_path / "from-env"))
    monkeypatch.setenv("RUN_NAME", "env-run")
    assert default_events_dir("my-run") == tmp_path / "from-env"
    monkeypatch.delenv(ENV_EVENTS_DIR)
    assert default_events_dir("my-run") == Path("my-run") / "attn_events"
    assert default_events_dir() == Path("env-run") / "attn_events"
    monkeypatch.delenv("RUN_NAME")
    assert default_events_dir() == Path("foundry_attn_run") / "attn_events"
    monkeypatch.setenv(ENV_EVENTS_DIR, "")  # empty means unset
    assert default_events_dir("r") == Path("r") / "attn_events"
