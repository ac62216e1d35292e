"""A broken flash-attn never stops a run: real flash-attn releases (Python files from their sdists), an extension
built, as it were, against another torch, a GPU node whose flash-attn has no extension, and TransformerEngine's real
wheels; each run is a subprocess through an entry point the README names, read back by its log and its events."""

from __future__ import annotations

import json
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from foundry_attn import guard
from foundry_attn.attention.backends import FA2, SDPA
from foundry_attn.selection import flash_compat
from foundry_attn.selection.policy import choose
from foundry_attn.selection.traits import ModelTraits
from tests.conftest import REPO, read_events
from tests.selection import real_installs
from tests.selection.test_flash_compat import A100, installed

BIN = Path(sys.executable).parent
YAML = str(REPO / "yamls" / "tiny_cpu.yaml")
pytestmark = [pytest.mark.slow, pytest.mark.launch]


def _run(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def _train(entry: str, assets: Path, events: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    """A short `composer train.py` or `llmfoundry train` run of the tiny yaml."""
    start = [str(BIN / "composer"), str(REPO / "train.py")] if entry == "composer" else [str(BIN / entry), "train"]
    overrides = [
        f"variables.assets={assets}",
        f"model.events_dir={events}",
        "max_duration=2ba",
        "eval_interval=2ba",
        "eval_subset_num_batches=1",
        f"save_folder={events.parent / 'ckpt'}",
        "save_interval=1000ba",
        *extra,
    ]
    events.parent.mkdir(parents=True, exist_ok=True)
    return _run([*start, YAML, *overrides], env, events.parent)


def _strict(assets: Path, tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The tiny run asking for FA2 with attn_strict: it stops before training with our error."""
    proc = _train(
        "composer",
        assets,
        tmp_path / "strict" / "events",
        env,
        "model.attn_implementation=flash_attention_2",
        "model.attn_strict=true",
    )
    assert proc.returncode != 0 and "AttentionUnavailableError" in proc.stderr, proc.stderr[-3000:]
    return proc


def test_the_guard_is_installed_with_the_package() -> None:
    """The .pth sits in site-packages (hatchling puts it there, editable installs too); at interpreter start it
    only installs the finder: torch is not imported, and FOUNDRY_ATTN_GUARD=0 leaves it out."""
    assert any((Path(p) / "foundry_attn_guard.pth").exists() for p in site.getsitepackages())
    probe = "import sys; print([type(f).__name__ for f in sys.meta_path][:1], 'torch' in sys.modules)"
    on = _run([sys.executable, "-c", probe], real_installs.env_with(), REPO)
    off = _run([sys.executable, "-c", probe], real_installs.env_with(FOUNDRY_ATTN_GUARD="0"), REPO)
    assert on.stdout.split() == ["['_Finder']", "False"], on.stdout + on.stderr
    assert "_Finder" not in off.stdout


def test_the_startup_bench_runs() -> None:
    """``foundry-attn bench guard``: interpreter starts with the guard on and off, side by side (no timing judged)."""
    from foundry_attn.bench import guard as bench

    result = bench.run(quick=True)
    assert result["rounds"] == 10 and set(result["median_ms"]) == {"on", "off"}
    assert isinstance(result["all_targets_met"], bool)


def test_the_wheel_carries_the_guard(tmp_path: Path) -> None:
    """A real (not editable) wheel puts foundry_attn_guard.pth at the top of site-packages."""
    proc = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(REPO)], {}, REPO)
    assert proc.returncode == 0, proc.stderr
    [wheel] = tmp_path.glob("foundry_attn-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "foundry_attn_guard.pth" in names and "foundry_attn/guard.py" in names


@pytest.mark.parametrize("version", ["2.3.0", "2.6.3", "2.8.3.post2"])
def test_doctor_on_real_releases_without_their_extension(version: str, tmp_path: Path) -> None:
    """The real sdists' Python files, no CUDA build: doctor names the missing extension, the installed version and
    the command that builds it, and agrees with the decision."""
    env = real_installs.env_with(real_installs.flash_attn(version))
    proc = _run([str(BIN / "foundry-attn"), "doctor", "--json"], env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    tried = report["flash_attn_import"]
    assert tried["installed"] == version and tried["kind"] == guard.NO_EXTENSION and tried["hidden"]
    assert "flash_attn_2_cuda" in tried["error"] and f"'flash-attn=={version}'" in tried["fix"]
    fa2 = report["candidates"][0]
    assert fa2["name"] == FA2 and fa2["check"] == "flash-attn import" and "extension is missing" in fa2["reason"]
    assert report["chosen"] == SDPA and report["flash_kernel"].startswith("none (check 'flash-attn import'")


@pytest.mark.foundry
def test_an_extension_built_for_another_torch_falls_back(assets: Path, tmp_path: Path) -> None:
    """Real flash-attn 2.6.3 whose extension needs a c10 symbol this torch lacks: stock dies in `import llmfoundry`
    (the guard off shows it); with the guard, `composer train.py` and `llmfoundry train` train to the end on sdpa,
    naming the undefined symbol and the reinstall for this torch; strict stops with our error; doctor agrees."""
    tree = real_installs.flash_attn("2.6.3", abi=True)
    env = real_installs.env_with(tree)
    stock = _train("composer", assets, tmp_path / "off" / "events", {**env, "FOUNDRY_ATTN_GUARD": "0"})
    assert stock.returncode != 0 and "The flash_attn package is not installed correctly" in stock.stderr
    fix = f"reinstall it built for this torch {torch.__version__.split('+')[0]}"
    for entry in ("composer", "llmfoundry"):
        events = tmp_path / entry / "events"
        proc = _train(entry, assets, events, env)
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log[-4000:]
        assert f"undefined symbol: {real_installs.MISSING_C10_SYMBOL}" in log and "chose sdpa" in log
        [event] = read_events(events, "attn_impl")
        assert event["chosen"] == SDPA and event["versions"]["flash_attn"] == "2.6.3"  # the installed version
        [fa2] = [c for c in event["candidates"] if c["name"] == FA2]
        assert fa2["check"] == "flash-attn import" and "built for another torch" in fa2["reason"]
        assert fa2["fix"].startswith(fix) and "'flash-attn==2.6.3'" in fa2["fix"]
    strict = _strict(assets, tmp_path, env)
    assert "check 'flash-attn import' failed" in strict.stderr and real_installs.MISSING_C10_SYMBOL in strict.stderr
    for extra in ([], ["--model-config", str(assets / "tiny-llama")]):
        proc = _run([str(BIN / "foundry-attn"), "doctor", *extra], env, tmp_path)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        assert "chosen: sdpa" in proc.stdout and f"fix: {fix}" in proc.stdout and "a run hides it" in proc.stdout


AUTO_SCRIPT = """
import importlib.util, logging
if importlib.util.find_spec("trl"):
    import trl  # noqa: F401  (first, as a TRL script does: it imports transformers, which may import flash_attn)
logging.basicConfig(level=logging.INFO)
from foundry_attn import attach
from tests.conftest import make_llama
state = attach(make_llama("sdpa").train(), "auto")
print("CHOSE", state.backend, state.path)
print("WHY", state.decision.reason)
"""


def test_auto_after_trl_with_an_extension_built_for_another_torch_falls_back(tmp_path: Path) -> None:
    """A Trainer / TRL script on a node whose flash-attn was built for another torch: ``import trl`` first, then
    ``attach(model, "auto")``: the run goes on, on a backend that runs, and the reason names the undefined symbol."""
    tree = real_installs.flash_attn("2.6.3", abi=True)
    proc = _run([sys.executable, "-c", AUTO_SCRIPT], real_installs.env_with(tree, REPO), REPO)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "CHOSE sdpa flat" in proc.stdout, out[-4000:]
    why = next(line for line in proc.stdout.splitlines() if line.startswith("WHY"))
    assert f"undefined symbol: {real_installs.MISSING_C10_SYMBOL}" in why and "flash_attention_2" in why


@pytest.mark.foundry
def test_a_gpu_node_whose_flash_attn_has_no_extension_falls_back(assets: Path, tmp_path: Path) -> None:
    """transformers answers is_flash_attn_2_available() from metadata as on CUDA, so stock imports flash_attn in
    `import transformers.modeling_utils` and dies; with the guard the run trains on sdpa, strict stops, doctor works."""
    env = real_installs.env_with(real_installs.gpu_node(tmp_path), real_installs.flash_attn("2.6.3"))
    check = [sys.executable, "-c", "import transformers.modeling_utils"]
    stock = _run(check, {**env, "FOUNDRY_ATTN_GUARD": "0"}, tmp_path)
    assert stock.returncode != 0 and "No module named 'flash_attn_2_cuda'" in stock.stderr  # the stand-in holds
    events = tmp_path / "run" / "events"
    proc = _train("composer", assets, events, env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    [event] = read_events(events, "attn_impl")
    assert event["chosen"] == SDPA and event["versions"]["flash_attn"] == "2.6.3"
    assert "CUDA extension is missing" in event["reason"]
    assert "flash_attn_2_cuda" in _strict(assets, tmp_path, env).stderr
    proc = _run([str(BIN / "foundry-attn"), "doctor", "--model-config", str(assets / "tiny-llama")], env, tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr and "chosen: sdpa" in proc.stdout, proc.stderr


def _with_trees(monkeypatch: pytest.MonkeyPatch, *trees: Path) -> None:
    for tree in trees:
        monkeypatch.syspath_prepend(str(tree))


@pytest.mark.parametrize(
    ("te", "fa", "raises", "named"),
    [
        ("2.20.2", "2.8.3.post2", None, ""),  # today's newest pair works
        ("2.19.0", "2.8.3.post2", None, ""),
        ("2.14.1", "2.8.3.post2", False, "not its .post releases"),  # TE turns its flash backend off, no error
        ("2.14.1", "2.8.3", None, ""),
        ("1.13.0", "2.8.3", False, "2.1.1 to 2.6.3"),  # gated at TE's import: a warning, not window_size_left
        ("1.13.0", "2.6.3", True, "softcap"),
        ("1.11.0", "2.8.3", True, "AssertionError: FlashAttention maximum version 2.6.3"),
        ("1.10.0", "2.6.3", True, "AssertionError: FlashAttention maximum version 2.5.8"),
        ("1.10.0", "2.3.0", None, ""),
    ],
)
def test_transformer_engine_pairs_from_the_real_wheels(
    monkeypatch: pytest.MonkeyPatch, te: str, fa: str, raises: bool | None, named: str
) -> None:
    """The real transformer-engine wheels and flash-attn sdists installed side by side: the rule names what TE's
    own code does with that flash-attn, and rejects FA2 only where that call raises."""
    _with_trees(monkeypatch, real_installs.transformer_engine(te), real_installs.flash_attn(fa))
    problems = [p for p in flash_compat.preflight(A100) if p.check == "TransformerEngine x flash-attn"]
    if raises is None:
        assert problems == []
        return
    [problem] = problems
    assert named in problem.reason and problem.te_attention
    assert (problem.rejects == FA2) == raises


def test_te_1_6_with_2_6_3_names_softcap_and_warns_outside_te_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """TE 1.6 (not on PyPI: versions faked) with flash-attn 2.6.3: its context-parallel backward misses
    softcap. A transformers model has no TE attention, so FA2 is kept with a warning; a model built on TE's attention
    is refused."""
    installed(monkeypatch, transformer_engine="1.6.0", flash_attn="2.6.3")
    [problem] = flash_compat.preflight(A100)
    assert "missing 1 required positional argument: 'softcap'" in problem.reason and problem.rejects == FA2
    llama = ModelTraits("LlamaForCausalLM", 64, frozenset({FA2, SDPA}))
    kept = choose(FA2, [FA2, SDPA], A100, torch.bfloat16, llama, smoke_test=None)
    assert kept.chosen == FA2 and "softcap" in kept.warning and "not in this model" in kept.warning
    te_model = ModelTraits("TEModel", 64, frozenset({FA2, SDPA}), te_attention=True)
    refused = choose(FA2, [FA2, SDPA], A100, torch.bfloat16, te_model, smoke_test=None)
    assert refused.chosen == SDPA and "softcap" in refused.candidates[0].reason
