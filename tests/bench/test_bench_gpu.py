"""The GPU benchmark's plumbing on the CPU: the skip without CUDA, every CPU-capable tier through the CLI (losses
agree), the flash-attn-signature wrappers over torch's varlen kernel (both signatures) and SDPA, and which path
each tier really takes. The GPU numbers belong to ``foundry-attn bench gpu --json`` on a GPU (README), not a test.
"""

from __future__ import annotations

import copy
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from foundry_attn.attention.fa2_reference import flash_attn_func, flash_attn_varlen_func, reference_flash_attn
from foundry_attn.bench import gpu, reference_kernels
from foundry_attn.cli import main
from tests.conftest import assert_restored, snapshot

REPO = Path(__file__).resolve().parents[2]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA box runs the real benchmark instead")
TIERS = (  # the order the benchmark reports them in
    "padded_dense",
    "stock_unpad_per_layer",
    "stock_padding_free",
    "ours_torch_varlen",
    "ours_torch_varlen_capacity",
    "ours_flash_attn",
    "flex_document_mask",
    "sdpa_per_document",
)
CPU_TIERS = (
    "padded_dense",
    "stock_unpad_per_layer",
    "stock_padding_free",
    "ours_torch_varlen",
    "ours_torch_varlen_capacity",
    "sdpa_per_document",
)
#: exact against each document alone on a batch of several documents a row (stock's 2-D masks attend across them)
PACKED_EXACT = {"stock_padding_free", "ours_torch_varlen", "ours_torch_varlen_capacity"}


@no_cuda
def test_without_cuda_it_says_so_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "gpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"skipped": gpu.NEEDS_CUDA}
    assert main(["bench", "gpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "needs a CUDA GPU" in out


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


@pytest.mark.slow
def test_cpu_plumbing_runs_every_cpu_tier_and_losses_agree(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:  # one thread: a tiny model's steps are bound by overhead, and 2 threads on a busy box spin for cores
        assert main(["bench", "gpu", "--json", "--device", "cpu", "--quick", "--layers", "2", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(capsys.readouterr().out)
    assert {
        "command",
        "gpu_number",
        "note",
        "torch",
        "transformers",
        "machine",
        "settings",
        "tiers",
        "batches",
        "targets",
        "all_targets_met",
        "elapsed_s",
    } <= result.keys()
    assert result["command"] == "foundry-attn bench gpu --json --device cpu --quick --layers 2"
    assert result["torch"] == torch.__version__ and result["gpu_number"] is False
    assert {"threads", "torch", "transformers", "cpu", "device_name"} <= result["machine"].keys()
    assert result["settings"]["dtype"] == "float32" and result["settings"]["layers"] == 2
    tiers = result["tiers"]
    assert list(tiers) == list(TIERS)
    assert [n for n, t in tiers.items() if t["runs"]] == list(CPU_TIERS)
    for name in ("stock_unpad_per_layer", "stock_padding_free", "ours_torch_varlen", "ours_torch_varlen_capacity"):
        assert tiers[name]["kernel"] == "reference kernel (not a GPU number)"
    assert list(result["batches"]) == ["a_report", "b_no_padding", "c_mix"]
    report = result["batches"]["a_report"]
    assert report["fill"] == pytest.approx(1395 / (6 * 2048), rel=0.02)  # the report's lengths, scaled to 128
    for name, batch in result["batches"].items():
        assert {
            "title",
            "doc_lens",
            "real_tokens",
            "positions",
            "fill",
            "limit_vs_padded_dense",
            "tiers",
            "loss_agreement",
        } <= batch.keys()
        for tier in CPU_TIERS:
            stats = batch["tiers"][tier]
            assert stats["tokens_per_s"] > 0 and stats["step_ms"] > 0 and stats["peak_mem_mb"] > 0, (name, tier)
            assert {
                "ratio_vs_padded_dense",
                "paired_ratio_vs_padded_dense",
                "loss",
                "document_exact",
                "min_step_ms",
                "samples_ms",
            } <= stats.keys()
        assert batch["tiers"]["padded_dense"]["ratio_vs_padded_dense"] == 1.0
        assert set(batch["tiers"]) - set(CPU_TIERS) == {"ours_flash_attn", "flex_document_mask"}
        assert all("skipped" in batch["tiers"][t] for t in ("ours_flash_attn", "flex_document_mask"))
        agree = batch["loss_agreement"]
        assert agree["ok"] and agree["reference"] == "sdpa_per_document" and agree["tolerance"] == 1e-4, agree
        exact = {t for t in CPU_TIERS if batch["tiers"][t]["document_exact"]} - {"sdpa_per_document"}
        assert set(agree["checked"]) == exact
        assert exact == (set(CPU_TIERS) - {"sdpa_per_document"} if name != "c_mix" else PACKED_EXACT)
        assert all(agree["rel_diff"][t] <= 1e-4 for t in exact)
    for name, target in result["targets"].items():
        assert {"target", "value", "tier", "values", "stock_unpad_per_layer", "stock_padding_free"} <= target.keys()
        assert target["met"] is None and target["tier"] in PACKED_EXACT - {"stock_padding_free"}, name  # not judged
    assert result["all_targets_met"] is None


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
    monkeypatch.setattr(gpu, "reference_varlen_attn", counting(gpu.reference_varlen_attn, varlen_calls))
    monkeypatch.setattr(gpu, "flash_attn_func_via_sdpa", counting(gpu.flash_attn_func_via_sdpa, dense_calls))
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


def varlen_212(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
):
    return reference_kernels.reference_varlen_attn(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size, enable_gqa=enable_gqa
    )


def varlen_210(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, scale=None):
    assert query.shape[1] == key.shape[1]  # no enable_gqa before 2.12: the wrapper repeats KV heads
    return reference_kernels.reference_varlen_attn(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=(-1, 0 if is_causal else -1)
    )


def varlen_no_scale(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    assert query.shape[1] == key.shape[1]
    return reference_kernels.reference_varlen_attn(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=(-1, 0 if is_causal else -1)
    )


@pytest.mark.parametrize(
    "kernel", [varlen_212, varlen_210, varlen_no_scale], ids=["torch>=2.12", "torch2.10", "torch2.10-no-scale"]
)
@pytest.mark.parametrize("causal", [True, False])
def test_flash_varlen_wrapper_matches_flash_attn_semantics(kernel, causal: bool) -> None:
    torch.manual_seed(0)
    lengths = [5, 1, 9]
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    q, k, v = torch.randn(15, 4, 8), torch.randn(15, 2, 8), torch.randn(15, 2, 8)
    wrapped = reference_kernels.flash_varlen_from_torch(kernel)
    scale = 8**-0.5 if kernel is varlen_no_scale else 0.3  # without `scale`, only the default one
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
    if kernel is varlen_no_scale:
        with pytest.raises(NotImplementedError, match="no scale"):
            wrapped(q, k, v, cu, cu, 9, 9, softmax_scale=0.3, causal=causal)
    if kernel is not varlen_212:
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
