"""The registered model, dataloaders and callbacks in real LLM-Foundry runs on CPU."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from foundry_attn.selection.capability import probe
from foundry_attn.selection.policy import AttentionUnavailableError
from tests.conftest import REPO, read_events

pytestmark = pytest.mark.foundry  # composer train.py and the registry

YAML = str(REPO / "yamls" / "tiny_cpu.yaml")
#: flash-attn importable (a GPU box): there the policy may pick FA2 where this CPU box falls back to sdpa, saying why
FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
#: the `composer -n 2` runs below are CPU runs (gloo), also on a CUDA box
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


def _overrides(assets: Path, events: Path, *extra: str) -> list[str]:
    return [
        f"variables.assets={assets}",
        f"model.events_dir={events}",
        "max_duration=4ba",
        "eval_interval=2ba",
        "eval_subset_num_batches=1",
        "console_log_interval=1ba",
        f"save_folder={events.parent / 'ckpt'}",
        "save_interval=1000ba",
        *extra,
    ]


@pytest.mark.slow
def test_train_from_yaml_registered_names(assets: Path, tmp_path: Path) -> None:
    """A real LLM-Foundry run by the registered model / dataloader / callback names: sdpa on CPU."""
    from llmfoundry.command_utils import train_from_yaml

    trainer = train_from_yaml(YAML, _overrides(assets, tmp_path / "events"))
    model = trainer.state.model
    if not FLASH_ATTN:  # this CPU box (a GPU box without flash-attn too): sdpa, and why
        assert model.attn_decision.chosen == "sdpa"
        assert "flash-attn is not installed" in model.attn_decision.reason
        assert model.attn_implementation == "sdpa" and model.model.config._attn_implementation == "foundry_sdpa"
        assert next(model.parameters()).dtype == torch.float32  # fallback keeps LLM-Foundry's dtype
    else:  # a GPU box with flash-attn: what it chose is what runs
        assert model.attn_implementation == model.attn_decision.chosen
    [event] = read_events(tmp_path / "events", "attn_impl")
    assert event["chosen"] == model.attn_decision.chosen and event["rank"] == 0
    assert event["device_name"] == probe().device_name  # "cpu" here, the GPU's name on a CUDA box
    assert event["versions"]["torch"] == torch.__version__
    trainer.close()


@pytest.mark.slow
def test_finetuning_loader_fa2_reference(assets: Path, tmp_path: Path) -> None:
    """The finetuning loader in pack mode, through transformers' FA2 path on the reference kernel."""
    from llmfoundry.command_utils import train_from_yaml

    trainer = train_from_yaml(
        str(REPO / "yamls" / "tiny_finetune_cpu.yaml"),
        _overrides(
            assets,
            tmp_path / "events",
            "model.attn_implementation=flash_attention_2",
            "model.fa2_reference_kernel=true",
        ),
    )
    assert trainer.state.model.attn_decision.chosen == "flash_attention_2"
    assert "reference" in trainer.state.model.attn_decision.reason
    trainer.close()


@pytest.mark.parametrize("key", ["attn_implementation", "attn_fallback"])
def test_unknown_names_fail_before_building(assets: Path, tmp_path: Path, key: str) -> None:
    from foundry_attn.integrations.llm_foundry.model import FoundryAttnCausalLM

    value = "flash2" if key == "attn_implementation" else ["flash2", "sdpa"]
    with pytest.raises(ValueError, match=r"valid values: .*flash_attention_2"):
        FoundryAttnCausalLM(
            tokenizer=None,
            pretrained_model_name_or_path=str(assets / "tiny-llama"),
            pretrained=False,
            events_dir=str(tmp_path),
            **{key: value},
        )


def test_strict_fails_with_check_device_and_fix(assets: Path, tmp_path: Path) -> None:
    from foundry_attn.integrations.llm_foundry.model import FoundryAttnCausalLM

    fix = r"Fix: pip install flash-attn.*; or set attn_strict: false to fall back"  # the LLM-Foundry YAML's keys
    with pytest.raises(AttentionUnavailableError, match=r"^attn_strict: .* on cpu .*flash-attn installed.*" + fix):
        FoundryAttnCausalLM(
            tokenizer=None,
            pretrained_model_name_or_path=str(assets / "tiny-llama"),
            pretrained=False,
            events_dir=str(tmp_path),
            attn_implementation="flash_attention_2",
            attn_strict=True,
        )
    [event] = read_events(tmp_path, "attn_impl")  # the log says which rank failed, and why
    assert event["failed"] and event["chosen"] is None and "flash-attn installed" in event["reason"]
    assert event["launch"] and event["strict"]


def test_unwritable_events_dir_fails_at_start(assets: Path, tmp_path: Path) -> None:
    from foundry_attn.integrations.llm_foundry.model import FoundryAttnCausalLM

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError, match="not writable"):
        FoundryAttnCausalLM(
            tokenizer=None,
            pretrained_model_name_or_path=str(assets / "tiny-llama"),
            pretrained=False,
            events_dir=str(blocker / "events"),
        )


def test_explicit_request_falls_back_down_the_chain(assets: Path, tmp_path: Path) -> None:
    from foundry_attn.integrations.llm_foundry.model import FoundryAttnCausalLM

    model = FoundryAttnCausalLM(
        tokenizer=None,
        pretrained_model_name_or_path=str(assets / "tiny-llama"),
        pretrained=False,
        events_dir=str(tmp_path),
        attn_implementation="flash_attention_2",
        attn_fallback=["eager"],
    )
    if FLASH_ATTN:  # a GPU box with flash-attn may grant the request itself
        assert model.attn_implementation == model.attn_decision.chosen in ("flash_attention_2", "eager")
        return
    assert model.attn_decision.chosen == "eager" and model.attn_decision.fell_back
    assert model.attn_implementation == "eager"


@pytest.mark.slow
@pytest.mark.launch
def test_two_ranks_gloo(assets: Path, tmp_path: Path) -> None:
    """`composer -n 2 train.py ...` on CPU: one event per rank, one summary line on rank 0."""
    events = tmp_path / "events"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled", **CPU_ONLY}
    cmd = [
        str(Path(sys.executable).parent / "composer"),
        "-n",
        "2",
        "--stdout",
        str(tmp_path / "rank{rank}.out"),
        "--stderr",
        str(tmp_path / "rank{rank}.err"),
        str(REPO / "train.py"),
        YAML,
        *_overrides(
            assets, events, "global_train_batch_size=4", "device_train_microbatch_size=2", "device_eval_batch_size=2"
        ),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    logs = proc.stdout + proc.stderr + "".join(p.read_text() for p in tmp_path.glob("rank*.*"))
    assert proc.returncode == 0, logs[-4000:]
    decisions = read_events(events, "attn_impl")
    assert sorted(e["rank"] for e in decisions) == [0, 1]
    assert len({e["launch"] for e in decisions}) == 1 and decisions[0]["launch"]  # one launch id, every rank
    assert logs.count("attention: 2/2 ranks sdpa") >= 1
    rank1 = "".join(p.read_text() for p in tmp_path.glob("rank1.*"))
    assert "attention: 2/2 ranks" not in rank1


@pytest.mark.slow
def test_gpu_yaml_falls_back_on_cpu(assets: Path, tmp_path: Path) -> None:
    """The SmolLM2-135M-shaped GPU yaml asks for FA2; here it runs on sdpa and says why (2 layers to stay fast)."""
    from llmfoundry.command_utils import train_from_yaml

    trainer = train_from_yaml(
        str(REPO / "yamls" / "smollm2_135m_gpu.yaml"),
        _overrides(
            assets,
            tmp_path / "events",
            "precision=fp32",
            "max_duration=1ba",
            "global_train_batch_size=2",
            "device_train_microbatch_size=2",
            "variables.max_seq_len=256",
            "model.config_overrides={num_hidden_layers: 2}",
        ),
    )
    decision = trainer.state.model.attn_decision
    assert decision.requested == "flash_attention_2"
    if not FLASH_ATTN:  # a GPU box with flash-attn may run FA2 itself
        assert decision.chosen == "sdpa" and decision.candidates[0].check == "flash-attn installed"
    assert trainer.state.model.model.config.hidden_size == 576
    trainer.close()


@pytest.mark.slow
@pytest.mark.launch
def test_one_rank_falls_back_and_the_fleet_view_names_it(assets: Path, tmp_path: Path) -> None:
    """`composer -n 2`, rank 1 asks for FA2 through attn_rank_overrides: the events name rank 1 and why."""
    from foundry_attn.cli import main

    events = tmp_path / "events"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled", **CPU_ONLY}
    cmd = [
        str(Path(sys.executable).parent / "composer"),
        "-n",
        "2",
        "--stdout",
        str(tmp_path / "rank{rank}.out"),
        "--stderr",
        str(tmp_path / "rank{rank}.err"),
        str(REPO / "train.py"),
        YAML,
        *_overrides(
            assets,
            events,
            "max_duration=2ba",
            "global_train_batch_size=4",
            "device_train_microbatch_size=2",
            "device_eval_batch_size=2",
            "model.attn_implementation=sdpa",
            "model.attn_rank_overrides={1: {attn_implementation: flash_attention_2, attn_fallback: [sdpa]}}",
        ),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    logs = proc.stdout + proc.stderr + "".join(p.read_text() for p in tmp_path.glob("rank*.*"))
    assert proc.returncode == 0, logs[-4000:]
    assert "attention: 2/2 ranks sdpa; 1/2 fell back (rank 1: " in logs
    out = tmp_path / "fell-back.json"
    with open(out, "w") as f, contextlib.redirect_stdout(f):
        assert main(["events", str(events), "--fell-back", "--json"]) == 0
    [row] = json.loads(out.read_text())
    assert (row["rank"], row["requested"], row["chosen"]) == (1, "flash_attention_2", "sdpa")
    assert "flash-attn" in row["reason"] or (FLASH_ATTN and "no CUDA device" in row["reason"])


def test_rank_overrides_take_known_keys_only() -> None:
    from foundry_attn.integrations.llm_foundry.keys import rank_override

    assert rank_override({1: {"attn_strict": True}}, 1) == {"attn_strict": True}
    assert rank_override({"1": {"attn_strict": True}}, 1) == {"attn_strict": True}
    assert rank_override({1: {"attn_strict": True}}, 0) == {} and rank_override(None, 0) == {}
    with pytest.raises(ValueError, match=r"unknown key.*attn_strictt.*valid keys: attn_implementation"):
        rank_override({0: {"attn_strictt": True}}, 0)


@pytest.mark.slow
def test_default_events_folder_follows_the_run_name(
    assets: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No events_dir: the model's events wait for the run's name, then land in ./<run_name>/attn_events."""
    from llmfoundry.command_utils import train_from_yaml

    monkeypatch.chdir(tmp_path)
    for key in ("FOUNDRY_ATTN_EVENTS_DIR", "RUN_NAME", "COMPOSER_RUN_NAME"):
        monkeypatch.delenv(key, raising=False)
    overrides = [o for o in _overrides(assets, tmp_path / "unused") if not o.startswith("model.events_dir")]
    trainer = train_from_yaml(YAML, [*overrides, "model.events_dir=null", "run_name=named-run", "max_duration=1ba"])
    trainer.close()
    [event] = read_events(tmp_path / "named-run" / "attn_events", "attn_impl")
    assert event["run"] == "named-run" and event["launch"]
    assert event["chosen"] == ("sdpa" if not FLASH_ATTN else trainer.state.model.attn_decision.chosen)
    assert not (tmp_path / "foundry_attn_run").exists()
