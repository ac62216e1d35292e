"""The padding benchmark, untimed: a quick run through the CLI reports every mode, ratio and target.

The numbers themselves belong to ``foundry-attn bench padding --json`` (README), not to a test.
"""

from __future__ import annotations

import json

import pytest
import torch

from foundry_attn.bench.padding import MODES, TARGETS
from foundry_attn.bench.timing import PeakLiveBytes, PeakMemory, paired_ratio_median, round_robin
from foundry_attn.cli import main


@pytest.mark.slow
def test_quick_bench_reports_modes_ratios_and_targets(capsys) -> None:
    assert main(["bench", "padding", "--json", "--quick"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {
        "command",
        "settings",
        "modes",
        "ratios",
        "collator",
        "correctness",
        "targets",
        "all_targets_met",
    } <= result.keys()
    assert result["settings"]["quick"] is True
    assert result["settings"]["real_tokens"] == 1395
    for mode in MODES:
        stats = result["modes"][mode]
        assert stats["tokens_per_s"] > 0 and stats["step_ms"] > 0 and stats["peak_mem_mb"] > 0, mode
    assert result["modes"]["pack"]["positions"] == 1395
    assert result["modes"]["pad_max"]["positions"] == 6 * 2048
    for name in TARGETS:
        assert result["ratios"][name] > 0
        assert set(result["targets"][name]) == {"target", "value", "met"}
    for key in ("flattening_us", "pack_us", "mask_us"):
        assert result["collator"][key] > 0
    # a fast but wrong path cannot pass: every loss agrees with mask's, the packing with transformers'
    assert result["correctness"]["ok"], result["correctness"]
    assert result["correctness"]["collator_matches_flattening"]


def test_peak_live_bytes_counts_new_storages_not_views() -> None:
    x = torch.ones(1024, 256)  # 1 MiB, allocated before: not counted
    with PeakLiveBytes() as tracker:
        y = x.t() + 1  # a view of x (free) and one new 1 MiB tensor
        z = y * 2  # another 1 MiB
        del y, z
    assert tracker.peak == 2 * 2**20
    assert tracker.live == 0


def test_peak_memory_on_cpu_is_peak_live_bytes() -> None:
    x = torch.ones(1024, 256)
    with PeakMemory(torch.device("cpu")) as memory:
        y = x + 1  # 1 MiB
        z = y * 2  # another 1 MiB
        del y, z
    assert memory.peak == 2 * 2**20


def test_round_robin_spreads_the_slow_variant() -> None:
    calls: list[str] = []
    variants = {name: lambda name=name: calls.append(name) or name for name in ("a", "slow", "b")}
    times = round_robin(variants, rounds=6, samples={"slow": 2})
    assert [len(times.seconds[n]) for n in ("a", "slow", "b")] == [6, 2, 6]
    assert calls[:4] == ["a", "b", "b", "a"]  # the order rotates every round; "slow" runs in rounds 2 and 5
    assert times.values["slow"] == ["slow", "slow"]
    assert all(s >= 0 for s in times.seconds["a"] + times.cpu_seconds["a"])


def test_round_robin_gc_off_inside_a_call_and_self_timed_seconds() -> None:
    import gc

    seen: list[bool] = []
    times = round_robin({"x": lambda: seen.append(gc.isenabled()) or 0.25}, rounds=3, self_timed=True)
    assert seen == [False] * 3 and gc.isenabled()
    assert times.seconds["x"] == [0.25] * 3
    assert paired_ratio_median([2.0, 3.0, 8.0], [1.0, 1.0, 2.0]) == 3.0


@pytest.mark.launch  # a benchmark run end to end
@pytest.mark.slow
def test_quick_proof_and_compile_benches_run_and_agree(capsys) -> None:
    """The proof and compile benchmarks through the CLI, untimed: probes pass, one graph, losses agree."""
    assert main(["bench", "proof", "--json", "--quick"]) == 0
    proof = json.loads(capsys.readouterr().out)
    from foundry_attn.selection.capability import flex_backward_error

    backends = 4 if flex_backward_error("cpu") is None else 3  # flex is left out where it cannot train
    assert proof["correct"] and len(proof["rows"]) == backends
    assert main(["bench", "compile", "--json", "--quick"]) == 0
    [row] = json.loads(capsys.readouterr().out)["rows"]
    assert row["graphs_after_warmup"] == 0 and row["graph_breaks"] == 0 and row["losses_agree"], row
    from foundry_attn.bench.compile import cold_compile

    cold = cold_compile(torch.device("cpu"), layers=2)  # the full run's cold compile, at 2 layers
    assert cold["ours_compiled_kinds"] == {"LlamaDecoderLayer": 2} and cold["ours_compile_s"] > 0, cold
    assert cold["stock_compile_s"] > 0, cold


@pytest.mark.slow
def test_quick_events_bench_agrees(capsys) -> None:
    """A small sweep (4 runs x 10 ranks x 1000 events): the three readers agree and --fell-back finds the T4s."""
    assert main(["bench", "events", "--json", "--quick"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["agree"] and result["attn_impl_events"] == 40 and 0 < result["fell_back_ranks"] < 40


def test_every_benchmark_follows_one_protocol(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """``run(quick, device, ...)`` in every module; the CLI prints a summary and exits 1 only on failed checks."""
    import importlib
    import inspect

    from foundry_attn.bench import BENCHES

    for which in BENCHES:
        module = importlib.import_module(f"foundry_attn.bench.{which}")
        assert list(inspect.signature(module.run).parameters)[:2] == ["quick", "device"], which
    events = importlib.import_module("foundry_attn.bench.events")
    result = {"command": "foundry-attn bench events", "correct": False, "targets": {}, "all_targets_met": True}
    monkeypatch.setattr(events, "run", lambda quick, device: result)
    assert main(["bench", "events"]) == 1 and "exactness checks: FAILED" in capsys.readouterr().out
    monkeypatch.setattr(events, "run", lambda quick, device: {**result, "correct": True, "all_targets_met": False})
    assert main(["bench", "events"]) == 0 and "targets: NOT all met" in capsys.readouterr().out


@pytest.mark.launch  # a benchmark run end to end
@pytest.mark.slow
@pytest.mark.foundry
def test_quick_train_bench_runs_every_variant_through_llm_foundry(capsys) -> None:
    """Stock hf_causal_lm (padded, packing_ratio auto) and ours (mask, pack) through LLM-Foundry's train, untimed:
    every variant trains, Composer's SpeedMonitor reports its throughput, ours matches the per-document truth."""
    from foundry_attn.bench.train import VARIANTS

    assert main(["bench", "train", "--json", "--quick"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {"command", "settings", "mixes", "targets", "correct", "all_targets_met"} <= result.keys()
    blog = result["mixes"]["blog"]
    assert set(blog) == set(VARIANTS)
    for name in VARIANTS:
        v = blog[name]
        assert "error" not in v, v.get("error")
        assert v["tokens_per_s"] > 0 and v["tokens_per_s_wall"] > 0 and v["peak_rss_mb"] > 0, name
        assert v["steps"] == result["settings"]["warmup"] + result["settings"]["timed"], name
        assert v["loss_diff_vs_truth"] is not None, name
    # the same documents reach every variant: six per batch, except stock packing's packed rows (more per batch)
    assert blog["stock_padded"]["real_tokens_per_batch"] == 1395 == blog["ours_pack"]["real_tokens_per_batch"]
    assert blog["stock_packing"]["documents_per_batch"] > 6 and blog["ours_pack"]["rows_per_batch"] == 1
    assert result["correct"], {k: t for k, t in result["targets"].items() if "loss" in k}
    for name in ("ours_mask", "ours_pack"):
        host = blog[name]["host"]
        assert host["collate_ms"] > 0 and host["prepare_documents_ms"] > 0 and 0 < host["host_fraction"] < 1
