"""foundry_attn as an axolotl plugin, on axolotl 0.19's own sample-packed batches (``make test-axolotl``).

Real axolotl in its own venv (``.venv-axolotl``), CPU, fp32, offline: the project's tiny Llama and word-level tokenizer,
a local jsonl of documents, ``sample_packing: true``. :mod:`tests.axolotl.runs` trains each variant's first steps with
axolotl's own pipeline and measures the first step against each document alone; ``axolotl train`` runs the one-line
YAML a user writes. Skipped, saying why, where axolotl is not installed (``make test``, ``make test-latest``).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("axolotl", reason="needs axolotl (make test-axolotl installs it in .venv-axolotl)")
os.environ.setdefault("AXOLOTL_DO_NOT_TRACK", "1")  # axolotl's telemetry: nothing leaves the machine
os.environ.setdefault("DO_NOT_TRACK", "1")

REPO = Path(__file__).resolve().parents[2]
PLUGIN = "foundry_attn.integrations.axolotl.FoundryAttnPlugin"
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "WANDB_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
    "DO_NOT_TRACK": "1",
    "AXOLOTL_DO_NOT_TRACK": "1",
    "PYTHONPATH": str(REPO),
    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",  # axolotl execs `accelerate`
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every variant of :data:`tests.axolotl.runs.VARIANTS`, one process (about 90 s on 2 cores)."""
    out = tmp_path_factory.mktemp("axolotl-runs")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.axolotl.runs", str(out)],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    print(proc.stdout[-2000:])
    return {r["variant"]: r for r in json.loads((out / "results.json").read_text())}


OURS = ["ours-sdpa", "ours-sdpa-varlen-auto", "ours-eager", "ours-eager-varlen"]
STOCK = ["stock-sdpa", "stock-sdpa-varlen", "stock-eager"]


@pytest.mark.slow
def test_the_batches_are_axolotls_own_packed_rows(results: dict[str, dict[str, Any]]) -> None:
    """What the Trainer handed the model: micro_batch_size rows of sequence_len, position_ids restarting per document,
    the tail padding a segment of its own without targets, labels copied from the ids, no attention mask (axolotl
    drops it for sdpa and eager)."""
    for r in results.values():
        assert r["shape"] == [2, 128], r["variant"]
        assert r["keys"] == ["input_ids", "labels", "position_ids"], r["keys"]
        assert len(r["documents"]) >= 6 and sum(r["documents"]) == 256, r["documents"]
    assert len({tuple(r["documents"]) for r in results.values()}) == 1  # every variant trained the same batch


@pytest.mark.slow
@pytest.mark.parametrize("variant", OURS)
def test_with_the_plugin_the_first_step_is_each_document_alone(
    results: dict[str, dict[str, Any]], variant: str
) -> None:
    """Loss within 1e-5 and every parameter's gradient within 1e-4 (relative) of stock transformers running each
    document alone, sdpa and eager, axolotl's sdpa_varlen patch on and off, ``foundry_attn_backend: auto``."""
    r = results[variant]
    assert r["loss_diff"] <= 1e-5 * max(1.0, abs(r["truth"])), r
    assert r["grad_rel"] <= 1e-4, r
    summary = r["summary"]
    assert summary["path"] == "flat" and summary["proven_on_batch"], summary
    assert summary["packed_batches"] >= 1 and summary["flattened"] >= 1, summary  # 2 rows read as one flat row
    assert summary["sdpa_varlen"] is r["sdpa_varlen"], summary
    assert summary["ran"].startswith(f"foundry_{r['ran']} "), summary["ran"]
    if r["sdpa_varlen"] and r["ran"] == "sdpa":
        assert "sdpa_varlen wrapper" in summary["ran"] and "bypassed" in summary["ran"], summary["ran"]
    assert {"attn/path_flat", "attn/documents_isolated", "attn/packed_position_ids"} <= set(r["logged"]), r["logged"]
    assert r["first_logs"]["attn/documents_isolated"] == 1.0 and r["first_logs"]["attn/path_flat"] == 1.0
    # true numbers: each row's tail padding is padding, and never one of the proof's documents
    assert r["padding"] > 0 and r["padding_documents"], r
    assert r["first_logs"]["attn/real_tokens"] == 256 - r["padding"], r["first_logs"]
    assert r["first_logs"]["attn/fill_ratio"] == (256 - r["padding"]) / 256, r["first_logs"]
    assert r["proofs_compared"] and not set(r["padding_documents"]) & {i for c in r["proofs_compared"] for i in c}


@pytest.mark.slow
def test_auto_chose_with_its_reason(results: dict[str, dict[str, Any]]) -> None:
    r = results["ours-sdpa-varlen-auto"]
    assert r["ran"] == ("flash_attention_2" if torch.cuda.is_available() else "sdpa"), r
    assert r["summary"]["foundry_attn_backend"] == "auto"


@pytest.mark.slow
@pytest.mark.parametrize("variant", STOCK)
def test_stock_axolotl_is_measured_beside_it(results: dict[str, dict[str, Any]], variant: str) -> None:
    """Stock axolotl on the same batch keeps the documents' attention apart (transformers' packed mask) but trains each
    document's first token as a target of the previous document's last token: the loss and gradients move by the
    distance recorded here (docs/axolotl.md), the same with the sdpa_varlen patch on and off."""
    r, ours = results[variant], results[variant.replace("stock", "ours", 1).replace("varlen", "varlen-auto")]
    assert r["summary"] is None and not r["logged"]
    assert r["loss_diff"] > 1e-4 and r["grad_rel"] > 1e-2, r  # the crossing targets
    assert r["loss_diff"] > 100 * max(ours["loss_diff"], 1e-7)
    # and nothing else: stock is the documents alone plus those targets, within fp32 noise (its attention is isolated)
    assert r["crossing_loss_diff"] <= 1e-5 * max(1.0, r["crossing_truth"]) and r["crossing_grad_rel"] <= 1e-4, r


@pytest.mark.slow
def test_one_yaml_line_with_axolotl_train(tmp_path: Path) -> None:
    """``axolotl train`` on a YAML with one ``plugins:`` line: the plugin says it loaded, the chain and its reason,
    what runs, the proof on the training batch; ``attn/*`` keys in axolotl's logs; the events file."""
    from tests.axolotl.runs import write_assets

    assets = write_assets(tmp_path / "assets", documents=48)
    (tmp_path / "train.yml").write_text(
        f"""base_model: {assets / "tiny-llama"}
datasets:
  - path: {assets / "train.jsonl"}
    ds_type: json
    type: completion
dataset_prepared_path: {tmp_path / "prepared"}
output_dir: {tmp_path / "out"}
sequence_len: 128
sample_packing: true
micro_batch_size: 2
max_steps: 2
learning_rate: 0.001
optimizer: adamw_torch
attn_implementation: sdpa
bf16: false
fp16: false
tf32: false
logging_steps: 1
save_strategy: "no"
val_set_size: 0
dataloader_num_workers: 0
plugins:
  - {PLUGIN}
foundry_attn_backend: auto
"""
    )
    proc = subprocess.run(
        ["axolotl", "train", str(tmp_path / "train.yml")],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert f"axolotl plugin loaded ({PLUGIN})" in out
    assert "foundry_attn: attention sdpa (asked auto; flash_attention_2:" in out
    assert "what runs: foundry_sdpa" in out
    assert "proven on the training batch: True" in out
    assert "'attn/documents_isolated': '1'" in out and "'attn/path_flat': '1'" in out
    events = [json.loads(line) for line in (tmp_path / "out" / "attn_events" / "events-rank0.jsonl").open()]
    kinds = {e["kind"] for e in events}
    assert {"attn_impl", "attn_axolotl", "attn_inspect", "attn_verdict"} <= kinds, kinds
    first = next(e for e in events if e["kind"] == "attn_axolotl" and e.get("at") == "first_step")
    assert first["path"] == "flat" and first["proven_on_batch"] and first["flattened"] >= 1, first


def test_a_misspelled_class_stops_the_run_with_the_valid_names() -> None:
    """axolotl skips a plugin whose module fails to import (one error line) but not one whose class is missing: a
    misspelled class name here fails ``load_cfg`` with the valid names."""
    from axolotl.cli.config import load_cfg
    from axolotl.integrations.base import PluginManager
    from axolotl.utils.dict import DictDefault

    PluginManager.get_instance().plugins.clear()
    with pytest.raises(AttributeError, match=r"valid names: FoundryAttnArgs, FoundryAttnPlugin"):
        load_cfg(DictDefault(base_model="x", plugins=["foundry_attn.integrations.axolotl.FoundryAttnPlugn"]))
    PluginManager.get_instance().plugins.clear()


def test_a_misspelled_backend_lists_the_valid_ones() -> None:
    from foundry_attn.integrations.axolotl.args import FoundryAttnArgs

    with pytest.raises(ValueError, match=r"foundry_attn_backend: unknown value 'sdpaa'; valid values: auto, "):
        FoundryAttnArgs(foundry_attn_backend="sdpaa")
    with pytest.raises(ValueError, match=r"foundry_attn_log_interval must be an integer >= 1"):
        FoundryAttnArgs(foundry_attn_log_interval=0)
    with pytest.raises(ValueError, match=r"foundry_attn_execution: unknown value 'graph'; valid values: auto, eager, "):
        FoundryAttnArgs(foundry_attn_execution="graph")
    with pytest.raises(ValueError, match=r"foundry_attn_capacity must be an integer >= 0"):
        FoundryAttnArgs(foundry_attn_capacity=-1)
    keys = FoundryAttnArgs(foundry_attn_capacity=4096, foundry_attn_execution="graphed")
    assert (keys.foundry_attn_capacity, keys.foundry_attn_execution) == (4096, "graphed")


@pytest.mark.parametrize(
    ("setting", "cause"),
    [
        ({"attn_implementation": "xformers"}, "axolotl's own attention patch"),
        ({"attn_implementation": "sdpa", "context_parallel_size": 2}, "splits each packed row across ranks"),
        ({"attn_implementation": "sdpa", "s2_attention": True}, "shifted sparse attention"),
        (
            {"pretraining_dataset": [{"path": "x"}], "sample_packing": True, "pretrain_multipack_attn": False},
            "no batch says where a document ends",
        ),
    ],
)
def test_settings_that_cannot_be_exact_are_refused_at_the_start(setting: dict, cause: str) -> None:
    from axolotl.utils.dict import DictDefault

    from foundry_attn.integrations.axolotl.plugin import FoundryAttnPlugin

    with pytest.raises(ValueError, match=cause):
        FoundryAttnPlugin().pre_model_load(DictDefault(setting))
    FoundryAttnPlugin().pre_model_load(DictDefault(attn_implementation="sdpa", sample_packing=True))  # accepted


def _features(tokenizer: Any, lengths: list[list[int]]) -> list[list[dict]]:
    """What axolotl's dataset gives its batch-sampler collators: per packed row, its examples (ids, labels = ids,
    attention_mask of ones, position_ids from 0)."""
    rows = []
    for row in lengths:
        feats = []
        for n in row:
            ids = torch.randint(2, len(tokenizer), (n,)).tolist()
            feats.append({"input_ids": ids, "labels": ids, "attention_mask": [1] * n, "position_ids": list(range(n))})
        rows.append(feats)
    return rows


def test_document_masks_from_axolotls_collators_are_read_and_checked(tmp_path: Path) -> None:
    """Where axolotl keeps the mask (a backend it does not trust with packing), the V2 collator numbers the documents
    1, 2, 3 and the V1 collator writes ones: both read as the same flat row, the mask dropped once checked against the
    positions; a mask that disagrees is refused, naming the row."""
    from axolotl.utils.collators.batching import (
        BatchSamplerDataCollatorForSeq2Seq,
        V2BatchSamplerDataCollatorForSeq2Seq,
    )

    from foundry_attn.integrations.axolotl.batches import read_packed
    from foundry_attn.integrations.llm_foundry.assets import build_tokenizer

    tokenizer = build_tokenizer(tmp_path / "tokenizer")
    torch.manual_seed(0)
    lengths = [[20, 9, 30], [41, 7]]
    features = _features(tokenizer, lengths)
    read = {}
    for collator in (V2BatchSamplerDataCollatorForSeq2Seq, BatchSamplerDataCollatorForSeq2Seq):
        batch = collator(tokenizer, padding=True, pad_to_multiple_of=64, return_tensors="pt")(copy.deepcopy(features))
        mask = batch["attention_mask"]
        assert mask.shape == (2, 64) and batch["position_ids"][0, 59:].tolist() == [0, 1, 2, 3, 4]  # tail padding
        if collator is V2BatchSamplerDataCollatorForSeq2Seq:
            assert mask[0].unique().tolist() == [0, 1, 2, 3], mask[0]
        out, shape = read_packed(dict(batch))
        assert shape == (2, 64) and "attention_mask" not in out and out["input_ids"].shape == (1, 128)
        read[collator.__name__] = out
    assert all(
        torch.equal(read["BatchSamplerDataCollatorForSeq2Seq"][k], v)
        for k, v in read["V2BatchSamplerDataCollatorForSeq2Seq"].items()
    )
    # padded rows of one document each (no packing): left to stock, which trains right padding exactly
    plain = V2BatchSamplerDataCollatorForSeq2Seq(tokenizer, padding=True, return_tensors="pt")(
        _features(tokenizer, [[20], [9]])
    )
    assert read_packed(dict(plain)) is None
    # a document number that disagrees with the positions
    batch = V2BatchSamplerDataCollatorForSeq2Seq(tokenizer, padding=True, pad_to_multiple_of=64, return_tensors="pt")(
        _features(tokenizer, lengths)
    )
    batch["attention_mask"][1, 45] = 1
    with pytest.raises(
        ValueError,
        match=r"row 1: attention_mask document numbers start documents at \[0, 41, 45, 46\] but position_ids "
        r"restart at \[0, 41\]",
    ):
        read_packed(dict(batch))


def test_the_trainers_target_count_leaves_out_each_documents_first_token() -> None:
    from foundry_attn.integrations.axolotl.batches import document_targets

    labels = torch.tensor([[5, 6, 7, 8, 9, -100], [1, 2, 3, 4, 5, 6]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]])
    counted = document_targets({"labels": labels, "position_ids": pos})["labels"]
    assert counted.tolist() == [[5, 6, 7, -100, 9, -100], [1, 2, -100, 4, 5, 6]]
    assert (counted[..., 1:] != -100).sum() == 7  # the Trainer counts labels[..., 1:]: 3 + 4


def test_the_package_and_the_plugin_module_import_without_axolotl() -> None:
    """``import foundry_attn`` and the plugin module never need axolotl (only axolotl loads the plugin)."""
    code = (
        "import sys; sys.modules['axolotl'] = None\n"
        "import foundry_attn, foundry_attn.integrations.axolotl as a\n"
        "assert a.FoundryAttnPlugin.__mro__[1] is object, a.FoundryAttnPlugin.__mro__\n"
        "print(a.FoundryAttnArgs(foundry_attn_backend='auto').foundry_attn_backend)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "auto", proc.stderr[-3000:]
