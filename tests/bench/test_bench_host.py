"""The host bench's plumbing (``--quick``: 4 layers): both variants run, their losses agree, the ops are counted and
the targets judged. The numbers belong to ``foundry-attn bench host --json`` (docs/performance.md), not a test."""

from __future__ import annotations

import json

import pytest

from foundry_attn.cli import main


@pytest.mark.slow
def test_the_host_bench_runs_stock_and_ours_and_counts_their_ops(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "host", "--json", "--quick", "--threads", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["correct"] is True and result["command"].endswith("--quick")
    for impl in ("sdpa", "eager"):
        cell = result[impl]
        assert cell["stock"]["ops"] > 0 and cell["ours"]["ops"] > 0, cell
        assert f"{impl}_ops_ratio_at_most_1.0" in result["targets"]
    static = result["capacity"]  # the FA2 code path padded to a capacity: no host sync in the step
    assert static["padded"]["syncs"] == 0 and result["targets"]["capacity_syncs_at_most_0"]["met"], static
