"""The GPU benchmark's plumbing on the CPU: the skip without CUDA, every CPU-capable tier through the CLI (losses
agree; the compiled tiers on Dynamo's eager backend; equal memory in a tiny budget), the profile's counting, the
equal-memory search, the targets at each contender's best, the flash-attn-signature wrappers over torch's varlen
kernel (both signatures) and SDPA, and which path each tier really takes. The GPU numbers belong to
``foundry-attn bench gpu --json`` on a GPU (README), not a test.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from foundry_attn.attention.fa2_reference import flash_attn_func, flash_attn_varlen_func, reference_flash_attn
from foundry_attn.bench import gpu, gpu_memory, gpu_profile, gpu_report, gpu_tiers, reference_kernels
from foundry_attn.cli import main
from tests.attention.test_torch_varlen import varlen_210, varlen_211, varlen_212  # torch's three signatures
from tests.conftest import assert_restored, snapshot

REPO = Path(__file__).resolve().parents[2]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA box runs the real benchmark instead")
TIERS = (  # the order the benchmark reports them in
    "padded_dense",
    "padded_dense_compiled",
    "padded_dense_graphed",
    "stock_unpad_per_layer",
    "stock_padding_free",
    "ours_torch_varlen",
    "ours_torch_varlen_capacity",
    "ours_torch_varlen_compiled",
    "ours_torch_varlen_graphed",
    "ours_default",
    "ours_flash_attn",
    "flex_document_mask",
    "sdpa_per_document",
)
CPU_TIERS = (
    "padded_dense",
    "padded_dense_compiled",
    "stock_unpad_per_layer",
    "stock_padding_free",
    "ours_torch_varlen",
    "ours_torch_varlen_capacity",
    "ours_torch_varlen_compiled",
    "ours_default",
    "sdpa_per_document",
)
CPU_SKIPPED = {"padded_dense_graphed", "ours_torch_varlen_graphed", "ours_flash_attn", "flex_document_mask"}
RESULT_KEYS = set(
    "command gpu_number note torch transformers machine settings tiers batches equal_memory targets all_targets_met "
    "phases_s elapsed_s".split()
)
BATCH_KEYS = set("title doc_lens real_tokens positions fill limit_vs_padded_dense tiers loss_agreement".split())
TIER_KEYS = set(
    "ratio_vs_padded_dense paired_ratio_vs_padded_dense loss document_exact min_step_ms "
    "samples_ms execution compile_warmup_s warmup_steps gpu_busy_share launches_per_step".split()
)
#: exact against each document alone on a batch of several documents a row (stock's 2-D masks attend across them)
PACKED_EXACT = {
    "stock_padding_free",
    "ours_torch_varlen",
    "ours_torch_varlen_capacity",
    "ours_torch_varlen_compiled",
    "ours_default",
}
OURS = PACKED_EXACT - {"stock_padding_free"}
#: the equal-memory tiers that run on the CPU
CPU_EQUAL_MEMORY = (
    "padded_dense",
    "padded_dense_compiled",
    "stock_padding_free",
    "ours_torch_varlen",
    "ours_torch_varlen_capacity",
    "ours_torch_varlen_compiled",
)


@no_cuda
def test_without_cuda_it_says_so_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "gpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"skipped": gpu.NEEDS_CUDA}
    assert main(["bench", "gpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "needs a CUDA GPU" in out


@pytest.mark.launch  # a benchmark run end to end
@no_cuda
@pytest.mark.slow
def test_python_m_foundry_attn_cli_bench_runs_without_composer() -> None:
    """``python -m foundry_attn.cli bench gpu --json`` from a source tree, Composer and LLM-Foundry unimportable."""
    code = (
        "import runpy, sys\nsys.modules['composer'] = None\nsys.modules['llmfoundry'] = None\n"
        "sys.argv = ['foundry-attn', 'bench', 'gpu', '--json']\n"
        "runpy.run_module('foundry_attn.cli', run_name='__main__', alter_sys=True)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == {"skipped": gpu.NEEDS_CUDA}


@pytest.mark.launch  # the lent box's script end to end, its benches on the CPU
@no_cuda
@pytest.mark.slow
def test_the_gpu_box_script_runs_its_steps_in_order_and_keeps_each_result(tmp_path: Path) -> None:
    """``scripts/gpu-run.sh`` with ``BENCH_ARGS="--device cpu"``: three steps, each one's exit code and seconds in
    ``steps.tsv``, the benches' JSON and JSON lines, the card and versions in ``env.txt``; a step stopped at its
    limit says 124 and keeps what it wrote; an unknown step lists the valid ones."""
    env = {**os.environ, "OUT": str(tmp_path), "BENCH_ARGS": "--device cpu"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # `python` is this interpreter
    script = str(REPO / "scripts" / "gpu-run.sh")
    proc = subprocess.run(["bash", script], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split("\t") for line in (tmp_path / "steps.tsv").read_text().splitlines()]
    assert [(name, rc) for name, rc, _ in rows] == [
        ("step", "rc"), ("smollm2", "0"), ("graphed-test", "0"), ("llama1b", "0")
    ], (tmp_path / "smollm2.log").read_text()[-2000:]  # fmt: skip
    assert "1 skipped" in (tmp_path / "graphed-test.log").read_text()  # no CUDA here
    for name in ("smollm2", "llama1b"):
        assert json.loads((tmp_path / f"{name}.json").read_text())["gpu_number"] is False
        records = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        assert records[0]["kind"] == "start" and records[-1]["kind"] == "targets"
    assert "--shape llama-3.2-1b" in json.loads((tmp_path / "llama1b.json").read_text())["command"]
    assert torch.__version__ in (tmp_path / "env.txt").read_text()
    first = (tmp_path / "smollm2.jsonl").read_text()
    stopped = subprocess.run(["bash", script, "smollm2"], capture_output=True, text=True, timeout=60,
                             env={**env, "LIMIT_smollm2": "2"})  # fmt: skip
    assert stopped.returncode == 0 and stopped.stdout.startswith("smollm2\t124\t")  # stopped at its limit
    kept = (tmp_path / "smollm2.jsonl").read_text()
    assert kept.startswith(first) and all(json.loads(line) for line in kept.splitlines())  # appended, whole lines
    wrong = subprocess.run(["bash", script, "smollm3"], capture_output=True, text=True, timeout=60, env=env)
    assert wrong.returncode == 2 and "choose from smollm2, graphed-test, llama1b" in wrong.stderr


@pytest.mark.launch  # a benchmark run end to end
@pytest.mark.slow
def test_cpu_plumbing_runs_every_cpu_tier_and_losses_agree(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:  # one thread: a tiny model's steps are bound by overhead, and 2 threads on a busy box spin for cores
        args = ["bench", "gpu", "--json", "--device", "cpu", "--rounds", "2", "--layers", "2", "--threads", "1"]
        assert main(args) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(capsys.readouterr().out)
    assert RESULT_KEYS <= result.keys()
    assert result["command"] == "foundry-attn bench gpu --json --device cpu --layers 2 --rounds 2"
    assert result["torch"] == torch.__version__ and result["gpu_number"] is False
    assert {"threads", "torch", "transformers", "cpu", "device_name"} <= result["machine"].keys()
    assert result["settings"]["dtype"] == "float32" and result["settings"]["layers"] == 2
    assert list(result["phases_s"]) == ["setup", "a_report", "b_no_padding", "c_mix", "equal_memory"]
    tiers = result["tiers"]
    assert list(tiers) == list(TIERS)
    assert [n for n, t in tiers.items() if t["runs"]] == list(CPU_TIERS)
    for name in ("stock_unpad_per_layer", "stock_padding_free", "ours_torch_varlen", "ours_torch_varlen_capacity"):
        assert tiers[name]["kernel"] == "reference kernel (not a GPU number)"
    for name in ("padded_dense_compiled", "ours_torch_varlen_compiled"):  # Dynamo's capture, no inductor, on the CPU
        assert tiers[name]["execution"] == "compiled" and "backend='eager'" in tiers[name]["kernel"], tiers[name]
    assert "torch.compile of the decoder layers" in tiers["ours_torch_varlen_compiled"]["execution_reason"]
    assert (
        tiers["ours_default"]["execution_asked"] == "auto"
        and "auto: eager on cpu" in (tiers["ours_default"]["execution_reason"])
    )
    for name in ("padded_dense_graphed", "ours_torch_varlen_graphed"):
        assert (
            tiers[name]["execution_asked"] == "graphed" and "CUDA graphs need a CUDA device" in tiers[name]["skipped"]
        )
    assert list(result["batches"]) == ["a_report", "b_no_padding", "c_mix"]
    report = result["batches"]["a_report"]
    assert report["fill"] == pytest.approx(1395 / (6 * 2048), rel=0.02)  # the report's lengths, scaled to 128
    for name, batch in result["batches"].items():
        assert BATCH_KEYS <= batch.keys()
        for tier in CPU_TIERS:
            stats = batch["tiers"][tier]
            assert stats["tokens_per_s"] > 0 and stats["step_ms"] > 0, (name, tier)
            # a compiled step off CUDA has no peak: the CPU's dispatch mode would stop Dynamo compiling its frames
            assert stats["peak_mem_mb"] > 0 if stats["execution"] == "eager" else stats["peak_mem_mb"] is None
            assert TIER_KEYS <= stats.keys()
            assert stats["gpu_busy_share"] is None and stats["launches_per_step"] is None  # CUDA only, and why
            assert stats["profile"] == gpu_profile.NOT_CUDA
            assert stats["warmup_steps"] == 2, (name, tier)
        assert batch["tiers"]["padded_dense"]["ratio_vs_padded_dense"] == 1.0
        assert set(batch["tiers"]) - set(CPU_TIERS) == CPU_SKIPPED
        assert all("skipped" in batch["tiers"][t] for t in CPU_SKIPPED)
        agree = batch["loss_agreement"]
        assert agree["ok"] and agree["reference"] == "sdpa_per_document" and agree["tolerance"] == 1e-4, agree
        exact = {t for t in CPU_TIERS if batch["tiers"][t]["document_exact"]} - {"sdpa_per_document"}
        assert set(agree["checked"]) == exact
        assert exact == (set(CPU_TIERS) - {"sdpa_per_document"} if name != "c_mix" else PACKED_EXACT)
        assert all(agree["rel_diff"][t] <= 1e-4 for t in exact)
    memory = result["equal_memory"]
    assert memory["batch"] == "a_report" and memory["budget_mb"] == 24 and memory["cap"] == 8
    assert list(memory["tiers"]) == [
        *CPU_EQUAL_MEMORY[:2],
        "padded_dense_graphed",
        *CPU_EQUAL_MEMORY[2:],
        "ours_torch_varlen_graphed",
    ]
    for name in CPU_EQUAL_MEMORY:
        fit = memory["tiers"][name]
        if name.endswith("_compiled"):  # no peak measured for a compiled step off CUDA
            assert "not measured" in fit["skipped"], (name, fit)
            continue
        assert 1 <= fit["k"] <= 8 and fit["rows"] == 6 * fit["k"] and fit["tokens_per_s"] > 0, (name, fit)
        assert fit["peak_mem_mb"] <= 24 and fit["ratio_vs_padded_dense"] > 0
        for probe in fit["probes"]:  # monotone: what fits is at most k, what does not is past it
            assert (probe["k"] <= fit["k"]) == bool(probe.get("fits")), (name, fit)
    assert memory["tiers"]["padded_dense"]["ratio_vs_padded_dense"] == 1.0
    assert memory["tiers"]["ours_torch_varlen"]["k"] > memory["tiers"]["padded_dense"]["k"]  # 2 MB a batch, not 14
    assert list(result["targets"]) == list(gpu.TARGETS)
    for name, target in result["targets"].items():
        assert {"target", "value", "tier", "values", "batch"} <= target.keys()
        assert target["met"] is None and target["tier"] in OURS, name  # not judged
    assert result["targets"]["ours_default_vs_padded_best_a_report"]["tier"] == "ours_default"
    busy = result["targets"]["ours_best_gpu_busy_share_a_report"]
    assert busy["value"] is None  # no profile on the CPU
    assert result["targets"]["ours_best_vs_stock_padding_free_a_report"]["against"] == "stock_padding_free"
    assert result["all_targets_met"] is None
    text = gpu.summary(result)
    assert "equal memory: k x a_report in 24 MB" in text and "ours_best_vs_padded_best_a_report" in text


def counting(fn, calls: list):
    @functools.wraps(fn)  # the signature stays fn's (the wrapper inspects it)
    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return fn(*args, **kwargs)

    return counted


def test_each_tier_takes_its_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """stock: one unpad + varlen call per layer on padded rows (dense flash where no row is padded); ours: one
    varlen call per layer over the flat row of real tokens; padded_dense: neither."""
    varlen_calls: list[int] = []
    dense_calls: list[int] = []
    monkeypatch.setattr(gpu_tiers, "reference_varlen_attn", counting(gpu_tiers.reference_varlen_attn, varlen_calls))
    monkeypatch.setattr(
        gpu_tiers, "flash_attn_func_via_sdpa", counting(gpu_tiers.flash_attn_func_via_sdpa, dense_calls)
    )
    device = torch.device("cpu")
    settings = gpu.Settings.make(device, quick=True, layers=2, rounds=None)
    tiers = {t.name: t for t in gpu.make_tiers(device)}
    base = gpu.build_model(settings)
    report, full, _ = gpu.workloads(settings.width, settings.vocab)
    expected = {"a_report": ([report.real_tokens] * 2, []), "b_no_padding": ([], [6, 6])}  # per layer
    for workload in (report, full):
        batches = workload.batches(device)
        for name, (varlen, dense) in (
            ("stock_unpad_per_layer", expected[workload.name]),
            ("ours_torch_varlen", ([workload.real_tokens] * 2, [])),
            ("padded_dense", ([], [])),
        ):
            varlen_calls.clear()
            dense_calls.clear()
            model = base if name == "padded_dense" else copy.deepcopy(base)
            tiers[name].setup(model)
            tiers[name].step(model, batches[tiers[name].batch])  # ours: the first batch is proven, then runs
            varlen_calls.clear()
            dense_calls.clear()
            tiers[name].step(model, batches[tiers[name].batch])
            assert (varlen_calls, dense_calls) == (varlen, dense), (workload.name, name)


@pytest.mark.parametrize("kernel", [varlen_212, varlen_211, varlen_210], ids=["torch>=2.12", "torch2.11", "torch2.10"])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_varlen_wrapper_matches_flash_attn_semantics(kernel, causal: bool) -> None:
    torch.manual_seed(0)
    lengths = [5, 1, 9]
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    q, k, v = torch.randn(15, 4, 8), torch.randn(15, 2, 8), torch.randn(15, 2, 8)
    wrapped = reference_kernels.flash_varlen_from_torch(kernel)
    scale = 8**-0.5 if kernel is varlen_210 else 0.3  # without `scale`, only the default one
    got = wrapped(
        q,
        k,
        v,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=max(lengths),
        max_seqlen_k=max(lengths),
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        deterministic=False,
    )
    want = flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), softmax_scale=scale, causal=causal)
    torch.testing.assert_close(got, want)
    if kernel is varlen_210:
        with pytest.raises(NotImplementedError, match="no scale"):
            wrapped(q, k, v, cu, cu, 9, 9, softmax_scale=0.3, causal=causal)
        with pytest.raises(NotImplementedError, match="window_size"):
            wrapped(q, k, v, cu, cu, 9, 9, causal=True, window_size=(3, 0))
    else:  # a causal window reaches torch as (left, 0)
        windowed = wrapped(q, k, v, cu, cu, 9, 9, causal=True, window_size=(3, 0))
        torch.testing.assert_close(
            windowed, flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, causal=True, window_size=(3, 0))
        )
    with pytest.raises(NotImplementedError, match="softcap"):
        wrapped(q, k, v, cu, cu, 9, 9, softcap=5.0)


@pytest.mark.parametrize("causal", [True, False])
def test_dense_flash_attn_func_via_sdpa(causal: bool) -> None:
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 7, 4, 8), torch.randn(2, 7, 1, 8), torch.randn(2, 7, 1, 8)
    got = reference_kernels.flash_attn_func_via_sdpa(q, k, v, dropout_p=0.0, softmax_scale=None, causal=causal)
    torch.testing.assert_close(got, flash_attn_func(q, k, v, causal=causal), atol=1e-5, rtol=1e-5)
    with pytest.raises(NotImplementedError):
        reference_kernels.flash_attn_func_via_sdpa(q[:, :3], k, v, causal=True)  # bottom-right vs top-left: refused


def test_reference_flash_attn_installs_the_kernels_it_is_given() -> None:
    import transformers.modeling_flash_attention_utils as fa_utils

    def varlen(*args, **kwargs):
        raise AssertionError("not called")

    def dense(*args, **kwargs):
        raise AssertionError("not called")

    before = snapshot()
    with reference_flash_attn(varlen=varlen, dense=dense):
        assert fa_utils.flash_attn_varlen_func is varlen and fa_utils.flash_attn_func is dense
        if hasattr(fa_utils, "lazy_import_flash_attention"):  # 5.x: where the kernels are really looked up
            kernels = fa_utils.lazy_import_flash_attention("flash_attention_2")[0]
            assert kernels[0] is dense and kernels[1] is varlen
        with reference_flash_attn():  # nested: the reference again, then back to ours
            assert fa_utils.flash_attn_varlen_func is flash_attn_varlen_func
        assert fa_utils.flash_attn_varlen_func is varlen
    assert_restored(before)


def test_mix_is_seeded_and_fits_the_rows() -> None:
    for width in (gpu.WIDTH, gpu.CPU_WIDTH):
        rows = gpu.mix_lengths(width)
        assert rows == gpu.mix_lengths(width) and len(rows) == gpu.ROWS
        shortest = gpu.scaled((gpu.MIX_MIN,), width)[0]
        assert all(sum(r) <= width and all(shortest <= n <= width for n in r) for r in rows)
        assert any(len(r) > 1 for r in rows)  # packed: several documents share a row
    assert gpu.scaled(gpu.REPORT_LENGTHS, gpu.WIDTH) == list(gpu.REPORT_LENGTHS)
    report = gpu.workloads(gpu.WIDTH, 64)[0]
    assert report.real_tokens == 1395 and report.positions == 6 * 2048
    assert report.describe()["limit_vs_padded_dense"] == pytest.approx(8.81, abs=0.01)


def test_kernel_stats_count_launches_by_name_and_the_union_of_gpu_work() -> None:
    ms = 1_000_000
    events = [
        ("cudaLaunchKernel", False, 0, 1),
        ("cudaLaunchKernel_v7000", False, 2, 3),
        ("cuLaunchKernel", False, 4, 5),
        ("cudaGraphLaunch", False, 6, 7),
        ("aten::mm", False, 0, 9),
        ("cudaMemcpyAsync", False, 0, 1),
        ("gemm_kernel", True, 0, 4 * ms),
        ("elementwise_kernel", True, 2 * ms, 6 * ms),  # overlaps the gemm: counted once
        ("Memcpy HtoD (Pageable -> Device)", True, 8 * ms, 9 * ms),
        ("Stream Sync", True, 0, 10 * ms),  # a wait, not work
    ]
    stats = gpu_profile.kernel_stats(events, wall_s=0.01)
    assert stats["launches"] == {"cudaLaunchKernel": 2, "cuLaunchKernel": 1, "cudaGraphLaunch": 1}
    assert stats["launches_per_step"] == 4 and stats["gpu_kernels"] == 2
    assert stats["gpu_busy_ms"] == pytest.approx(7.0) and stats["gpu_busy_share"] == pytest.approx(0.7)
    assert stats["profiled_step_ms"] == pytest.approx(10.0)


def test_a_step_is_profiled_on_cuda_only_and_the_profilers_events_read_here() -> None:
    cpu = torch.device("cpu")
    a = torch.randn(32, 32)
    assert gpu_profile.profile_step(lambda: a @ a, cpu) == gpu_profile.not_profiled(gpu_profile.NOT_CUDA)
    stats = gpu_profile.profiled(lambda: a @ a, cpu, cuda=False)  # the host's events: nothing launched
    assert stats["launches_per_step"] == 0 and stats["gpu_busy_ms"] == 0 and stats["profiled_step_ms"] > 0
    ops = {op["name"]: op["calls"] for op in stats["host_ops"]}  # where the host's time went: matmul and its parts
    assert ops["aten::matmul"] == ops["aten::mm"] == 1, ops
    assert stats["host_ops_ms"] == pytest.approx(sum(op["self_ms"] for op in stats["host_ops"]), abs=1e-2)
    # self time: its own less what is nested in it on its thread; another thread's events are not nested
    ms = 1_000_000
    events = [
        ("outer", 1, 0, 10 * ms),
        ("inner", 1, 2 * ms, 5 * ms),
        ("inner", 1, 6 * ms, 7 * ms),
        ("other", 2, ms, 9 * ms),
    ]
    nested = gpu_profile.host_stats(events)
    assert nested["host_ops"] == [
        {"name": "other", "calls": 1, "self_ms": 8.0}, {"name": "outer", "calls": 1, "self_ms": 6.0},
        {"name": "inner", "calls": 2, "self_ms": 4.0},
    ] and nested["host_ops_ms"] == 18.0  # fmt: skip
    many = gpu_profile.host_stats([(f"op{i}", 1, 100 * i, 100 * i + i) for i in range(20)])
    assert [op["name"] for op in many["host_ops"]] == [f"op{i}" for i in range(19, 19 - gpu_profile.HOST_OPS, -1)]


def test_the_hosts_self_times_are_the_profilers_own() -> None:
    """``host_stats`` on a real training step's events counts what ``torch.profiler``'s ``key_averages`` does."""
    from torch.profiler import ProfilerActivity, profile

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(torch.randn(4, 16)).sum().backward()
    raw = [(e.name(), e.start_thread_id(), e.start_ns(), e.end_ns()) for e in prof.profiler.kineto_results.events()]
    ours = {op["name"]: (op["calls"], op["self_ms"]) for op in gpu_profile.host_stats(raw)["host_ops"]}
    theirs = {e.key: (e.count, round(e.self_cpu_time_total / 1e3, 3)) for e in prof.key_averages()}
    for name, (count, ms) in ours.items():
        assert theirs[name][0] == count and theirs[name][1] == pytest.approx(ms, abs=2e-3), (name, theirs[name])


@pytest.mark.parametrize("limit", [1, 2, 5, 11, 16])
@pytest.mark.parametrize("guess", [1, 2, 6, 11, 40])
def test_largest_fit_finds_the_largest_multiple_that_fits(limit: int, guess: int) -> None:
    probed: list[int] = []

    def fits(k: int) -> bool:
        probed.append(k)
        return k <= limit

    assert gpu_memory.largest_fit(fits, guess, cap=16) == limit
    assert len(probed) == len(set(probed)) and all(2 <= k <= 16 for k in probed)
    if guess == limit:  # a right guess: it and the next one
        assert len(probed) <= 2
    stopped = gpu_memory.largest_fit(lambda k: None if k > 3 else True, 2, cap=16)  # the time budget: the best so far
    assert stopped == 3


def test_a_probe_out_of_memory_or_predicted_past_the_budget_does_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    workload = gpu.workloads(gpu.CPU_WIDTH, 64)[0]
    model = torch.nn.Linear(4, 4)  # 80 bytes of gradients: the constant part
    tier = gpu_tiers.Tier("t", "", "", batch="padded")

    def warm(tier, model, batch, least, device):
        k = batch["input_ids"].shape[0] // gpu.ROWS
        if k == 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return gpu_tiers.Warm(0.0, 80 + 900 * k, 0.0, 1)

    monkeypatch.setattr(gpu_memory, "warm", warm)
    search = gpu_memory.Search(tier, model, workload, peak1=980, budget=4000)
    assert search.guess(cap=16) == 4  # (4000 - 80) // 900
    cpu = torch.device("cpu")
    k = gpu_memory.largest_fit(lambda k: search.fits(k, cpu, 1, None), search.guess(16), 16)
    assert k == 3 and search.peaks == {1: 980, 3: 2780}
    assert [(p["k"], p["fits"], "oom" in p) for p in search.probes] == [(4, False, True), (3, True, False)]
    assert search.fits(10, cpu, 1, None) is False
    assert search.probes[-1] == {"k": 10, "predicted_mb": (80 + 9000) / 2**20, "run": False}
    assert search.fits(2, cpu, 1, deadline=0.0) is None and "time budget" in (search.stopped or "")


def test_a_repeated_batch_stacks_the_same_documents() -> None:
    report = gpu.workloads(gpu.CPU_WIDTH, 64)[0]
    three = report.repeated(3)
    assert three.ids.shape == (3 * gpu.ROWS, gpu.CPU_WIDTH)
    assert torch.equal(three.ids[gpu.ROWS : 2 * gpu.ROWS], report.ids)
    assert three.real_tokens == 3 * report.real_tokens and three.doc_lens == report.doc_lens * 3
    assert three.batches(torch.device("cpu"))["flattened"]["input_ids"].shape == (1, 3 * report.real_tokens)


def test_a_subset_of_tiers_keeps_the_baseline_and_the_reference() -> None:
    tiers = gpu.make_tiers(torch.device("cpu"))
    gpu.select(tiers, "ours_torch_varlen_compiled")
    assert [t.name for t in tiers if t.skipped is None] == [
        "padded_dense",
        "ours_torch_varlen_compiled",
        "sdpa_per_document",
    ]
    assert {t.skipped for t in tiers if t.name in ("padded_dense_compiled", "stock_padding_free")} == {gpu.NOT_SELECTED}
    with pytest.raises(ValueError, match="unknown tiers padded; valid: padded_dense, padded_dense_compiled"):
        gpu.select(gpu.make_tiers(torch.device("cpu")), ["padded"])
    assert gpu.command("cpu", True, None, None, "a,b", 0.5) == (
        "foundry-attn bench gpu --json --device cpu --quick --tiers a,b --memory-gb 0.5"
    )


@pytest.mark.slow
def test_a_compiled_tier_compiles_in_its_warm_up_and_agrees() -> None:
    device = torch.device("cpu")
    settings = gpu.Settings.make(device, quick=True, layers=1, rounds=1)
    tiers = {t.name: t for t in gpu.make_tiers(device)}
    batch = gpu.workloads(settings.width, settings.vocab)[0].batches(device)["padded"]
    base = gpu.build_model(settings)
    compiled = copy.deepcopy(base)
    torch._dynamo.reset()
    try:
        tiers["padded_dense"].setup(base)
        tiers["padded_dense_compiled"].setup(compiled)
        eager = gpu_tiers.warm(tiers["padded_dense"], base, batch, 1, device)
        warmed = gpu_tiers.warm(tiers["padded_dense_compiled"], compiled, batch, 1, device)
    finally:
        torch._dynamo.reset()
    assert (eager.steps, warmed.steps) == (1, 2) and warmed.warmup_s > 0
    assert warmed.loss == pytest.approx(eager.loss, rel=1e-5)
    assert eager.peak and warmed.peak is None  # no dispatch mode around a compiled step off CUDA, so:
    graphs: list[int] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    layer = base.model.layers[0]  # its code is compiled again later in this process (it was not marked skipped)
    hidden = torch.randn(1, 8, base.config.hidden_size)
    positions = base.model.rotary_emb(hidden, torch.arange(8)[None])
    torch.compile(type(layer).forward, backend=counting)(layer, hidden, position_embeddings=positions)
    torch._dynamo.reset()
    assert graphs
    assert tiers["padded_dense_compiled"].runs == "compiled"
    assert "backend 'eager'" in tiers["padded_dense_compiled"].execution_reason


def _batch(speeds: dict[str, float], busy: float | None = None, disagree: tuple[str, ...] = ()) -> dict:
    names = [*speeds, "sdpa_per_document"]
    return {
        "limit_vs_padded_dense": 8.8,
        "tiers": {n: {"tokens_per_s": speeds.get(n, 1.0), "gpu_busy_share": busy} for n in names},
        "loss_agreement": {
            "reference": "sdpa_per_document",
            "checked": names[:-1],
            "rel_diff": {n: 1.0 if n in disagree else 0.0 for n in names},
            "tolerance": 2e-2,
        },
    }


def test_targets_take_each_contender_at_its_best() -> None:
    a = _batch(
        {
            "padded_dense": 100,
            "padded_dense_compiled": 150,
            "padded_dense_graphed": 200,
            "stock_unpad_per_layer": 80,
            "stock_padding_free": 500,
            "ours_torch_varlen": 400,
            "ours_torch_varlen_compiled": 620,
            "ours_default": 1100,
            "ours_torch_varlen_graphed": 1300,  # the fastest, but its loss disagrees: not ours at its best
        },
        busy=0.75,
        disagree=("ours_torch_varlen_graphed",),
    )
    a["tiers"]["ours_default"]["compile_warmup_s"] = 20.0
    a["tiers"]["padded_dense_graphed"]["compile_warmup_s"] = 50.0
    b = _batch({"padded_dense": 100, "padded_dense_graphed": 90, "ours_default": 96})
    goals = gpu_report.targets({"a_report": a, "b_no_padding": b}, gpu=True)
    vs_padded = goals["ours_best_vs_padded_best_a_report"]
    assert (vs_padded["tier"], vs_padded["against"]) == ("ours_default", "padded_dense_graphed")
    assert vs_padded["value"] == pytest.approx(5.5) and vs_padded["met"]
    assert vs_padded["stock_vs_padded_best"]["stock_padding_free"] == pytest.approx(2.5)
    assert goals["ours_best_vs_stock_padding_free_a_report"]["value"] == pytest.approx(2.2)
    eager = goals["ours_eager_vs_padded_eager_a_report"]
    assert (eager["tier"], eager["against"], eager["value"]) == ("ours_torch_varlen", "padded_dense", 4.0)
    b_goal = goals["ours_default_vs_padded_best_b_no_padding"]
    assert (b_goal["against"], b_goal["value"], b_goal["met"]) == ("padded_dense", pytest.approx(0.96), True)
    assert goals["ours_default_warmup_vs_padded_graphed_a_report"]["value"] == pytest.approx(2.5)
    assert goals["ours_best_gpu_busy_share_a_report"]["value"] == 0.75
    assert all(t["met"] for t in goals.values())
    assert all(t["met"] is None for t in gpu_report.targets({"a_report": a, "b_no_padding": b}, gpu=False).values())
    del a["tiers"]["padded_dense_graphed"]  # not run (--tiers): its targets are not judged, the others still are
    partial = gpu_report.targets({"a_report": a, "b_no_padding": b}, gpu=True)
    assert partial["ours_default_warmup_vs_padded_graphed_a_report"]["met"] is None
    assert partial["ours_default_vs_padded_best_a_report"]["met"] is True
    one_b = gpu_report.targets({"a_report": a, "b_no_padding": b}, gpu=True, shape="llama-3.2-1b")
    assert list(one_b) == list(gpu_report.TARGETS_BY_SHAPE["llama-3.2-1b"])


@no_cuda
def test_quick_runs_the_short_set_on_two_batches_and_writes_each_result_as_measured(tmp_path: Path) -> None:
    lines = tmp_path / "gpu.jsonl"
    result = gpu.run(quick=True, device="cpu", layers=1, rounds=1, jsonl=str(lines))
    ran = [n for n, t in result["tiers"].items() if t["runs"]]
    assert ran == ["padded_dense", "ours_torch_varlen", "ours_default", "sdpa_per_document"]  # graphed: CUDA only
    assert result["tiers"]["padded_dense_compiled"]["skipped"] == gpu.NOT_QUICK
    assert list(result["batches"]) == ["a_report", "b_no_padding"] and "skipped" in result["equal_memory"]
    records = [json.loads(line) for line in lines.read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds[:2] == ["start", "tiers"] and kinds[-1] == "targets"
    results = [(r["batch"], r["tier"]) for r in records if r["kind"] == "result"]
    assert results == [(b, t) for b in ("a_report", "b_no_padding") for t in ran]
    verdicts = [r for r in records if r["kind"] == "targets"]  # after each batch, on the batches measured so far
    assert [v["after"] for v in verdicts] == ["a_report", "b_no_padding"] and verdicts[-1]["targets"] == result[
        "targets"
    ]
    first = verdicts[0]["targets"].values()
    assert {t["batch"] for t in first if t["tier"] is not None} == {"a_report"}  # (b) not measured yet: not judged
    assert kinds.index("targets") == kinds.index("loss_agreement") + 1  # right after the first batch
    assert records[0]["command"].endswith(f"--quick --layers 1 --rounds 1 --jsonl {lines}")
    with pytest.raises(ValueError, match=r"unknown --shape 'gpt'; valid: smollm2-135m, llama-3\.2-1b"):
        gpu.Settings.make(torch.device("cpu"), True, None, None, "gpt")
