"""The layouts benchmark's plumbing (``--quick``: tiny models): every cell runs its candidates, their losses agree,
and each says which layout the run chose and why; ``--rounds`` reaches the command line it prints. The demo model's
step bench runs and its losses are finite. The numbers belong to ``foundry-attn bench layouts --json`` and
``foundry-attn bench step --json`` (docs/performance.md), not a test."""

from __future__ import annotations

import json

import pytest

from foundry_attn.cli import main
from foundry_attn.flat.inputs import stock_splits_packed_rows


@pytest.mark.slow
def test_every_cell_runs_its_candidates_and_says_what_the_run_chose(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "layouts", "--json", "--quick", "--rounds", "2", "--threads", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    if not stock_splits_packed_rows():
        assert "does not split packed rows" in result["skipped"]
        return
    assert result["correct"] is True and result["command"].endswith("--quick --rounds 2")
    for name, cell in result["cells"].items():
        assert {"chosen", "flat", "rows"} <= set(cell["variants"]), name
        assert cell["chosen_layout"] in ("flat", "rows"), name
        if cell["stock_mask"]:
            assert cell["chosen_reason"], name
    assert result["targets"]["attention_calls_per_layer_at_most_8"]["met"]


def test_layers_tiers_and_memory_are_options_of_bench_gpu_only() -> None:
    for which, option in (("layouts", ["--layers", "2"]), ("step", ["--tiers", "padded_dense"])):
        with pytest.raises(
            SystemExit, match="--layers, --tiers, --memory-gb, --shape and --jsonl are options of bench gpu"
        ):
            main(["bench", which, *option])


def test_the_demo_models_step_is_timed_and_its_losses_finite(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "step", "--json", "--quick", "--threads", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["correct"] is True and result["median_step_ms"] > 0 and result["steps"] == 4
    assert result["command"] == "foundry-attn bench step --json --quick"
