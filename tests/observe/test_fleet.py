"""The fleet view: `foundry-attn events` over a tree of runs, tolerant of broken lines, clear on bad paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from foundry_attn.cli import main
from foundry_attn.observe.events import EventLog, Skipped, event_files, iter_events
from foundry_attn.selection.capability import probe


def this_device() -> str:
    """What the events below are stamped with, probing this machine: "cpu" here, the GPU's name on a CUDA box."""
    return probe().device_name


def _decision(log: EventLog, requested: str, chosen: str | None, reason: str, **extra: object) -> None:
    log.append("attn_impl", requested=requested, chosen=chosen, fell_back=chosen != requested, reason=reason, **extra)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """run-a: rank 1 fell back; run-b: fine, plus a newer writer's unknown kind; broken lines in two files."""
    a0 = EventLog(tmp_path / "run-a" / "attn_events", 0, launch="L1")
    a1 = EventLog(tmp_path / "run-a" / "attn_events", 1, launch="L1")
    b0 = EventLog(tmp_path / "run-b" / "attn_events", 0, run="run-b", launch="L2")
    _decision(a0, "flash_attention_2", "flash_attention_2", "all checks passed")
    _decision(a1, "flash_attention_2", "sdpa", "flash_attention_2 failed check 'compute capability': sm_75 < sm_80")
    a1.append("attn_inspect", step=0, metrics={"attn/fill": 0.9})
    _decision(b0, "sdpa", "sdpa", "requested")
    b0.append("from_the_future", new_field=[1, 2])
    with open(a1.path, "a") as f:
        f.write('{"kind": "attn_inspect", "rank": 1, "metr')  # cut by a crash
    with open(b0.path, "a") as f:
        f.write("not json at all\n")
    return tmp_path


def test_fell_back_names_the_rank_and_why(tree: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["events", str(tree), "--fell-back", "--json"]) == 0
    out, err = capsys.readouterr()
    [row] = json.loads(out)
    assert (row["run"], row["launch"], row["rank"], row["chosen"]) == ("run-a", "L1", 1, "sdpa")
    assert "compute capability" in row["reason"] and row["device_name"] == this_device()
    assert "skipped 2 line(s)" in err  # counted, never fatal
    assert main(["events", str(tree), "--fell-back"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["run", "launch", "rank"] and len(table) == 2


def test_summary_by_device_and_reason(tree: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["events", str(tree), "--summary", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["ranks"], result["fell_back"], result["runs"]) == (3, 1, 2)
    [(device, counts)] = result["by_device"].items()
    assert device.startswith(this_device()) and counts["fell_back"] == 1 and counts["ranks"] == 3
    assert list(result["by_reason"].values()) == [1]


def test_logs_written_before_the_rename_still_read() -> None:
    """``fell_back`` was ``fallback`` in the first logs: both count a rank that fell back."""
    from foundry_attn.observe import fleet

    old, new = {"chosen": "sdpa", "fallback": True}, {"chosen": "sdpa", "fell_back": True}
    assert fleet.unmet(old) and fleet.unmet(new) and not fleet.unmet({"chosen": "sdpa", "fell_back": False})
    assert fleet.one_line({"kind": "attn_impl", **old})["what"].endswith("(fell back)")


def test_listing_filters_and_keeps_unknown_kinds(tree: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["events", str(tree), "--run", "run-b", "--json"]) == 0
    kinds = [e["kind"] for e in json.loads(capsys.readouterr().out)]
    assert kinds == ["attn_impl", "from_the_future"]
    assert main(["events", str(tree), "--kind", "attn_inspect"]) == 0
    assert capsys.readouterr().out.count("attn_inspect") == 1
    assert main(["events", str(tree), "--since", "2999-01-01", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_a_writer_starts_a_new_line_after_a_cut_one(tmp_path: Path) -> None:
    path = tmp_path / "events-rank0.jsonl"
    path.write_text('{"kind": "attn_impl", "ra')
    EventLog(tmp_path, 0).append("attn_impl", chosen="sdpa")
    skipped = Skipped()
    assert [e["chosen"] for e in iter_events(event_files(tmp_path), skipped=skipped)] == ["sdpa"]
    assert skipped.lines == 1


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing", "no such file or folder"),
        ("empty", "no event files"),
        ("not_jsonl", "no events (skipped 2 line(s)"),
    ],
)
def test_bad_paths_give_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture, setup: str, message: str
) -> None:
    path = tmp_path / "events"
    if setup != "missing":
        path.mkdir()
    if setup == "not_jsonl":
        (path / "events-rank0.jsonl").write_text("a,b,c\n1,2,3\n")
    assert main(["events", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
