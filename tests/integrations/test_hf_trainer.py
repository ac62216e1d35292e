"""transformers ``Trainer`` and TRL ``SFTTrainer(padding_free=True)`` runs, real ones: an attached model trains the
padding-free batch exactly as each document alone (loss of the first step against stock on each document, no
rounding), and :mod:`foundry_attn.integrations.hf_trainer`'s callbacks report what attention did: the decision, the
inspector's table and its measured verdict (the leak of stock padding-free named, as an independent measurement says),
metrics through ``trainer.log``, events that ``foundry-attn events`` and ``report`` read, and no hook left on the
model."""

from __future__ import annotations

import copy
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

from foundry_attn import cli
from foundry_attn.integrations import hf_trainer
from foundry_attn.observe.events import event_files, iter_events
from foundry_attn.path.attach import attach
from foundry_attn.proof.synthetic import synthetic_documents
from foundry_attn.verify import conformance, zoo

pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
pytestmark = pytest.mark.slow

LENGTHS = (5, 11, 3, 9, 7, 13, 4, 8)  # two steps of four documents


def _model(model_type: str, backend: str) -> torch.nn.Module:
    if model_type not in zoo.model_types():
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    config, model_class = zoo.tiny(model_type)
    torch.manual_seed(0)
    return zoo.build(config, model_class, backend).train()


def _truth(stock: torch.nn.Module, docs: list[torch.Tensor]) -> float:
    """Stock on each document alone: the summed next-token loss over every target, divided by their number (the
    Trainer's normalisation: ``num_items_in_batch``)."""
    with torch.no_grad():
        total = sum(
            F.cross_entropy(stock(input_ids=d[None]).logits[0, :-1].float(), d[1:], reduction="sum") for d in docs
        )
    return float(total) / sum(d.numel() - 1 for d in docs)


class FirstBatch:
    """The model's first training forward: its loss as computed (the Trainer's logs round it) and its documents,
    read from the restarting ``position_ids`` (the Trainer shuffles: the truth is computed on what it drew)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.loss: float | None = None
        self.docs: list[torch.Tensor] = []
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, _: Any, __: Any, kwargs: dict, out: Any) -> None:
        if self.loss is None and getattr(out, "loss", None) is not None:
            # TRL's fused LM head: the next-token part alone (its loss adds MoE routers' balance, a batch statistic)
            log_probs = getattr(out, "log_probs", None)
            targets = (kwargs["labels"][:, 1:] != -100).sum()
            self.loss = out.loss.item() if log_probs is None else (-log_probs.sum() / targets).item()
            ids, starts = kwargs["input_ids"][0], (kwargs["position_ids"][0] == 0).nonzero()[:, 0].tolist()
            self.docs = [ids[a:b] for a, b in zip(starts, [*starts[1:], ids.numel()], strict=True)]
            self.handle.remove()


def _trainer(
    model: torch.nn.Module, docs: list[torch.Tensor], out: Path, steps: int = 2, bf16: bool = False, **options: Any
) -> Trainer:
    """A Trainer on padding-free batches of four documents (``bf16``: accelerate's autocast, on the CPU too;
    ``options``: the Trainer's other keywords)."""
    args = TrainingArguments(
        output_dir=str(out),
        bf16=bf16,
        per_device_train_batch_size=4,
        max_steps=steps,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        learning_rate=1e-3,
    )
    data = [{"input_ids": d.tolist()} for d in docs]
    return Trainer(model=model, args=args, train_dataset=data, data_collator=DataCollatorWithFlattening(), **options)


def _train(model: torch.nn.Module, docs: list[torch.Tensor], out: Path) -> tuple[Trainer, list]:
    trainer = _trainer(model, docs, out)
    added = hf_trainer.install(trainer, log_interval=1, verdict_interval=1)
    trainer.train()
    return trainer, added


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize(("model_type", "backend"), [("llama", "sdpa"), ("gpt_oss", "eager"), ("jamba", "sdpa")])
def test_a_stock_trainer_run_is_observed_and_its_leak_named(
    model_type: str, backend: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No attach: the callbacks still observe, and the verdict agrees with stock's own loss on the flattened batch
    against each document alone (measured here, independently of the verdict's code)."""
    model = _model(model_type, backend)
    docs = synthetic_documents(model.config, LENGTHS, torch.device("cpu"))
    stock = copy.deepcopy(model)
    hooks = _hooks(model)
    first = FirstBatch(model)
    with caplog.at_level(logging.INFO, logger="foundry_attn.integrations.hf_trainer"):
        trainer, (_, inspector, _) = _train(model, docs, tmp_path)
    assert first.loss is not None
    leak = abs(first.loss - _truth(stock, first.docs))
    verdict = inspector.last_verdict
    assert verdict is not None and verdict.how == "measured", verdict
    first = next(e for e in iter_events(event_files(tmp_path / "attn_events"), "attn_verdict") if e["step"] == 0)
    assert first["state"] == ("leaks" if leak > conformance.LOSS_TOL else "isolated"), (leak, first["line"])
    if leak > conformance.LOSS_TOL:
        said = [r.message for r in caplog.records if "packed documents attend to each other" in r.message]
        assert said and "attach(model" in said[0], said
    logged = [h for h in trainer.state.log_history if "attn/documents_isolated" in h]
    assert len(logged) == 2 and "loss" in {
        k for h in trainer.state.log_history for k in h
    }  # the Trainer's own line too
    assert _hooks(model) == hooks  # nothing left on the model
    assert any(r.message.startswith("attention: 1/1 ranks") for r in caplog.records)


@pytest.mark.parametrize(
    ("model_type", "backend", "leaks"),
    [
        ("mistral", "sdpa", False),
        ("mixtral", "sdpa", False),
        ("qwen3_moe", "sdpa", False),
        ("gpt_oss", "eager", True),
        ("jamba", "sdpa", True),
    ],
)
def test_the_verdict_in_bf16_judges_with_the_forwards_own_precision(
    model_type: str, backend: str, leaks: bool, tmp_path: Path
) -> None:
    """``bf16=True`` (TRL's default): accelerate's autocast wraps the model's forward, so the verdict reads the
    precision inside it and runs each document alone at the packed row's shape. bf16 noise is no leak (Mistral,
    Mixtral and Qwen3-MoE keep documents apart under stock padding-free); a real leak (gpt-oss's sinks, Jamba's
    state) is still named."""
    if transformers.__version__ < "4.54":
        pytest.skip("4.51's sdpa ignores restarting position_ids: stock leaks there")
    model = _model(model_type, backend)
    docs = synthetic_documents(model.config, LENGTHS, torch.device("cpu"))
    trainer = _trainer(model, docs, tmp_path, steps=1, bf16=True)
    _, inspector, _ = hf_trainer.install(trainer, log_interval=1, verdict_interval=1)
    trainer.train()
    verdict = inspector.last_verdict
    assert verdict is not None and verdict.how == "measured" and verdict.state == ("leaks" if leaks else "isolated"), (
        verdict.line()
    )


@pytest.mark.parametrize(("model_type", "backend"), [("llama", "sdpa"), ("gpt_oss", "eager"), ("jamba", "sdpa")])
def test_an_attached_trainer_run_trains_as_each_document_alone(model_type: str, backend: str, tmp_path: Path) -> None:
    model = _model(model_type, backend)
    docs = synthetic_documents(model.config, LENGTHS, torch.device("cpu"))
    stock = copy.deepcopy(model)
    state = attach(model, backend)
    first = FirstBatch(model)
    _, (_, inspector, _) = _train(model, docs, tmp_path)
    truth = _truth(stock, first.docs)
    assert first.loss is not None and abs(first.loss - truth) <= conformance.LOSS_TOL, (first.loss, truth)
    assert state.path == ("flat" if model_type == "llama" else "rows"), state.reason  # sinks, SSM state: rows
    assert inspector.last_verdict is not None and inspector.last_verdict.isolated, inspector.last_verdict
    decisions = list(iter_events(event_files(tmp_path / "attn_events"), "attn_impl"))
    assert decisions[0]["chosen"] == backend and decisions[0]["reason"] == f"attach(model, {backend!r})"
    assert decisions[-1]["path"] == state.path


def test_the_events_of_a_trainer_run_read_as_a_composer_runs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = _model("llama", "sdpa")
    attach(model, "sdpa")
    _train(model, synthetic_documents(model.config, LENGTHS, torch.device("cpu")), tmp_path / "run")
    kinds = {e["kind"] for e in iter_events(event_files(tmp_path / "run"))}
    assert {"attn_impl", "attn_inspect", "attn_verdict", "upad_trace_idle"} <= kinds, kinds
    capsys.readouterr()  # the run's own output
    assert cli.main(["events", str(tmp_path / "run"), "--summary", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ranks"] == 1 and summary["fell_back"] == 0, summary
    assert cli.main(["report", str(tmp_path / "run"), "-o", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report" / "report.html").exists()


class Reporter(transformers.TrainerCallback):
    """What a reporter (TensorBoard, W&B) is handed at each log."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        self.seen.append(dict(logs or {}))


@pytest.mark.parametrize("how", ["callbacks", "install"])
def test_the_metrics_reach_the_reporters_however_the_callbacks_were_added(how: str, tmp_path: Path) -> None:
    """A reporter placed before ours (as report_to's are) gets the attn/* scalars in the Trainer's own logs."""
    model = _model("llama", "sdpa")
    docs = synthetic_documents(model.config, LENGTHS[:4], torch.device("cpu"))
    reporter = Reporter()
    ours = hf_trainer.callbacks(log_interval=1, verdict_interval=1) if how == "callbacks" else []
    trainer = _trainer(model, docs, tmp_path, steps=1, callbacks=[reporter, *ours])
    if how == "install":
        hf_trainer.install(trainer, log_interval=1, verdict_interval=1)
    trainer.train()
    assert any("loss" in logs and "attn/fill_ratio" in logs for logs in reporter.seen), reporter.seen


def test_the_tracer_names_the_reference_kernel_that_ran(tmp_path: Path) -> None:
    """``attach(model, "flash_attention_2", fa2_reference=True)``: the unpad tracer says the pure-PyTorch reference
    ran, not flash-attn (5.x hands its kernels out lazily: what ran is read at the call)."""
    from foundry_attn.attention.fa2_reference import REFERENCE_NAME

    model = _model("llama", "sdpa")
    attach(model, "flash_attention_2", fa2_reference=True)
    trainer = _trainer(model, synthetic_documents(model.config, LENGTHS[:4], torch.device("cpu")), tmp_path, steps=1)
    hf_trainer.install(trainer, log_interval=1)
    trainer.train()
    [trace] = iter_events(event_files(tmp_path / "attn_events"), "upad_trace")
    assert trace["kernel"] == REFERENCE_NAME and trace["counts"]["varlen"] > 0, trace


def test_a_second_install_adds_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = _model("llama", "sdpa")
    trainer = _trainer(model, synthetic_documents(model.config, LENGTHS[:4], torch.device("cpu")), tmp_path, steps=1)
    first = hf_trainer.install(trainer, log_interval=1)
    with caplog.at_level(logging.WARNING, logger="foundry_attn.integrations.hf_trainer"):
        assert hf_trainer.install(trainer, log_interval=1) == first
    assert "already has foundry_attn's callbacks" in caplog.text
    trainer.train()
    events = list(iter_events(event_files(tmp_path / "attn_events"), "attn_impl"))
    assert len(events) == 1, events


def _sft(model: torch.nn.Module, docs: list[torch.Tensor], out: Path, tokenizer: Any, **options: Any) -> Any:
    """TRL's ``SFTTrainer(padding_free=True)`` on ``docs``, fp32 (TRL's default is bf16, autocast on this CPU too: the
    truth here is fp32), one step of four documents unless ``options`` (SFTConfig's keywords) say otherwise."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    settings = {"per_device_train_batch_size": 4, "max_steps": 1, "logging_steps": 1, "bf16": False, **options}
    args = trl.SFTConfig(
        output_dir=str(out),
        padding_free=True,
        max_length=None,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        dataset_num_proc=None,
        **settings,
    )
    data = datasets.Dataset.from_list([{"input_ids": d.tolist()} for d in docs])
    return trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)


@pytest.mark.parametrize(
    ("model_type", "backend", "leaks"),
    [
        ("mistral", "sdpa", False),
        ("mistral", "eager", False),
        ("mixtral", "sdpa", False),
        ("mixtral", "eager", False),
        ("qwen3_moe", "sdpa", False),
        ("qwen3_moe", "eager", False),
        ("gpt_oss", "eager", True),
        ("jamba", "sdpa", True),
        ("deepseek_v32", "eager", True),
    ],
)
def test_sft_trainer_at_trls_defaults_names_every_leak_and_no_rounding(
    model_type: str, backend: str, leaks: bool, tmp_path: Path
) -> None:
    """TRL's defaults (bf16 autocast, gradient checkpointing), stock models, our callbacks: bf16 rounding between two
    forwards of other shapes is no leak (Mistral with a window of 8, Mixtral, Qwen3-MoE), while sinks, SSM state and
    DeepSeek-V3.2's place-dependent indexer are still named."""
    pytest.importorskip("trl")
    if transformers.__version__ < "4.54":
        pytest.skip("4.51's sdpa ignores restarting position_ids: stock leaks there")
    from foundry_attn.integrations.llm_foundry.assets import build_tokenizer

    if model_type not in zoo.model_types():
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    config, model_class = zoo.tiny(model_type)
    if model_type == "mistral":
        config.sliding_window = 8
    torch.manual_seed(0)
    model = zoo.build(config, model_class, backend).train()
    docs = synthetic_documents(model.config, (30, 17, 9, 22, 13, 1, 40, 12), torch.device("cpu"))
    trainer = _sft(model, docs, tmp_path, build_tokenizer(tmp_path / "tokenizer"), bf16=True, max_steps=2)
    assert trainer.args.bf16 and trainer.args.gradient_checkpointing  # TRL's defaults
    _, inspector, _ = hf_trainer.install(trainer, log_interval=1, verdict_interval=1)
    trainer.train()
    verdict = inspector.last_verdict
    assert verdict is not None and verdict.how == "measured", verdict
    assert verdict.state == ("leaks" if leaks else "isolated"), verdict.line()


def test_trl_logs_the_same_with_and_without_our_callbacks(tmp_path: Path) -> None:
    """TRL folds its entropy, token accuracy and token count into every trainer.log call and clears them: ours never
    call it, so TRL's logged values are the same with them as without."""
    pytest.importorskip("trl")
    from foundry_attn.integrations.llm_foundry.assets import build_tokenizer

    tokenizer = build_tokenizer(tmp_path / "tokenizer")
    logged = {}
    for installed in (False, True):
        model = _model("llama", "sdpa")
        docs = synthetic_documents(model.config, LENGTHS, torch.device("cpu"))
        trainer = _sft(
            model,
            docs,
            tmp_path / str(installed),
            tokenizer,
            per_device_train_batch_size=2,
            max_steps=4,
            logging_steps=2,
            seed=0,
        )
        if installed:
            hf_trainer.install(trainer, log_interval=2, verdict_interval=2)
        trainer.train()
        keys = ("entropy", "mean_token_accuracy", "num_tokens", "loss")
        logged[installed] = [{k: e[k] for k in keys if k in e} for e in trainer.state.log_history if "loss" in e]
    assert logged[False] and all(
        set(e) == {"entropy", "mean_token_accuracy", "num_tokens", "loss"} for e in logged[False]
    )
    assert logged[True] == logged[False], logged


def test_a_forward_that_raises_leaves_no_hook(tmp_path: Path) -> None:
    model = _model("llama", "sdpa")
    hooks = _hooks(model)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    model.model.layers[1].mlp.forward = broken
    with pytest.raises(RuntimeError, match="boom"):
        _train(model, synthetic_documents(model.config, LENGTHS, torch.device("cpu")), tmp_path)
    assert _hooks(model) == hooks


def test_sft_trainer_padding_free_attached_is_exact(tmp_path: Path) -> None:
    """TRL's ``SFTTrainer(padding_free=True)``: stock gpt-oss (eager) leaks through its sinks; attached it trains the
    first step's loss exactly as each document alone, and the callbacks name the stock leak."""
    pytest.importorskip("trl")
    from foundry_attn.integrations.llm_foundry.assets import build_tokenizer

    tokenizer = build_tokenizer(tmp_path / "tokenizer")
    results = {}
    for attached in (False, True):
        model = _model("gpt_oss", "eager")
        docs = synthetic_documents(model.config, LENGTHS, torch.device("cpu"))
        stock = copy.deepcopy(model)
        if attached:
            attach(model, "eager")
        trainer = _sft(model, docs, tmp_path / str(attached), tokenizer, gradient_checkpointing=False)
        _, inspector, _ = hf_trainer.install(trainer, log_interval=1, verdict_interval=1)
        first = FirstBatch(model)
        trainer.train()
        assert first.loss is not None
        results[attached] = (abs(first.loss - _truth(stock, first.docs)), inspector.last_verdict)
    assert results[False][0] > conformance.LOSS_TOL and results[False][1].state == "leaks", results
    assert results[True][0] <= conformance.LOSS_TOL and results[True][1].isolated, results


@pytest.mark.parametrize("order", ["peft first", "attach first"])
@pytest.mark.parametrize(("model_type", "backend"), [("llama", "sdpa"), ("gpt_oss", "eager")])
def test_sft_trainer_on_a_peft_model_is_exact(model_type: str, backend: str, order: str, tmp_path: Path) -> None:
    """LoRA and attach in either order, then TRL's fused head: each document's loss alone, flat (Llama) and rows
    (gpt-oss); attach finds the causal LM inside the PeftModel."""
    pytest.importorskip("trl")
    peft = pytest.importorskip("peft")
    from foundry_attn.bench import trainer as bench

    model = _model(model_type, backend)
    docs = synthetic_documents(model.config, LENGTHS[:4], torch.device("cpu"))
    lora = peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    if order == "attach first":
        attach(model, backend)
    model = peft.get_peft_model(model, lora)
    stock = copy.deepcopy(model)
    state = attach(model, backend) if order == "peft first" else None
    first = bench._FirstStep(model)
    trainer, losses = bench._train(model, [d.tolist() for d in docs], 4, 1, [], str(tmp_path))
    coef = trainer.router_aux_loss_coef if trainer.aux_loss_enabled else 0.0
    assert abs(losses[0] - bench.truth(stock, first.docs, coef)) <= conformance.LOSS_TOL
    if state is not None:
        assert state.path == ("flat" if model_type == "llama" else "rows"), state.reason


@pytest.mark.parametrize(
    ("model_type", "backend", "path"),
    [
        ("mixtral", "sdpa", "flat"),
        ("qwen3_moe", "sdpa", "flat"),
        ("gpt_oss", "eager", "rows"),
        ("jamba", "sdpa", "rows"),
    ],
)
def test_sft_trainer_with_the_router_loss_trains_the_truth(model_type: str, backend: str, path: str) -> None:
    """TRL switches the MoE router loss on (the config's coefficient) and passes output_router_logits on every step:
    attached, the loss TRL trains on is each document alone's next-token loss plus coef x the router loss over every
    real token routed with its document alone, Mixtral and Qwen3-MoE on the flat path (the flag is no attention
    argument), the rows families with their padding left out of the router loss. An eval call with the flag runs."""
    pytest.importorskip("trl")
    from foundry_attn.bench import trainer as bench

    result = bench.family(model_type, backend, "fp32")
    assert result["router_coef"] > 0 and result["exact"] and result["path"] == path, result
    model = _model(model_type, backend)
    model.config.output_router_logits = True
    state = attach(model, backend)
    docs = synthetic_documents(model.config, LENGTHS[:2], torch.device("cpu"))
    with torch.no_grad():
        flat = DataCollatorWithFlattening()([{"input_ids": d.tolist()} for d in docs])
        assert model.eval()(**flat, output_router_logits=True).aux_loss is not None
    assert state.path == path, state.reason


@pytest.mark.launch  # torchrun ranks
def test_a_ddp_trainer_run_reports_every_rank(tmp_path: Path) -> None:
    """torchrun, two CPU ranks (gloo), accelerate's DDP: each rank's decision, one launch id, the rank-0 line."""
    worker = str(Path(__file__).parent / "trainer_worker.py")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run(
        [*launch, worker, str(tmp_path), "attach"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert json.loads((tmp_path / "result.json").read_text()) == {"world": 2, "wrapped": "DistributedDataParallel"}
    decisions = list(iter_events(event_files(tmp_path / "attn_events"), "attn_impl"))
    assert sorted(d["rank"] for d in decisions) == [0, 1] and len({d["launch"] for d in decisions}) == 1, decisions
    assert all(d["chosen"] == "sdpa" and d["path"] == "flat" for d in decisions), decisions
    assert "attention: 2/2 ranks sdpa; path flat" in proc.stdout + proc.stderr
    verdicts = list(iter_events(event_files(tmp_path / "attn_events"), "attn_verdict"))
    assert {v["rank"] for v in verdicts} == {0, 1} and all(v["state"] == "isolated" for v in verdicts), verdicts


def test_the_trainer_bench_runs_stock_and_attached(capsys: pytest.CaptureFixture) -> None:
    """``foundry-attn bench trainer --quick``: every variant trains, ours is exact against the per-document truth."""
    pytest.importorskip("trl")
    assert cli.main(["bench", "trainer", "--json", "--quick"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["correct"] and result["families"][0]["exact"], result["families"]
    assert set(result["speed"]["step_ms"]) == {"stock", "ours", "ours_inspect", "ours_verdict"}


@pytest.mark.parametrize("setting", ["trl_defaults", "lora"])
@pytest.mark.parametrize(("model_type", "backend"), [("mixtral", "sdpa"), ("jamba", "sdpa")])
def test_the_trainer_bench_family_at_trl_defaults_and_with_lora(model_type: str, backend: str, setting: str) -> None:
    """The bench's family step at TRL's own defaults (bf16 autocast, gradient checkpointing, router loss on; judged
    against the bf16 truth at bf16's resolution) and with LoRA: attached trains the truth, flat for Mixtral."""
    pytest.importorskip("trl")
    if setting == "lora":
        pytest.importorskip("peft")
    from foundry_attn.bench import trainer as bench

    result = bench.family(model_type, backend, setting)
    if "skipped" in result:
        pytest.skip(result["skipped"])
    assert result["router_coef"] > 0 and result["exact"], result
    assert result["path"] == ("flat" if model_type == "mixtral" else "rows"), result


def test_plain_left_padded_rows_in_a_trainer_run_are_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Trainer on plain padded rows (a tokenizer's ``padding_side="left"``), the model attached: stock trains them,
    and the run says so once, in a path event and by the inspector."""
    from foundry_attn.path.forward import LEFT_PADDED
    from tests.flat.test_left_padded import left_padded

    model = _model("gpt2", "sdpa")
    attach(model, "sdpa")
    docs = synthetic_documents(model.config, LENGTHS, torch.device("cpu"))
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, logging_steps=1, report_to=[],
        use_cpu=True, save_strategy="no",
    )  # fmt: skip
    data = [{"doc": d} for d in docs]
    trainer = Trainer(
        model=model, args=args, train_dataset=data, data_collator=lambda rows: left_padded([r["doc"] for r in rows])
    )
    trainer.args.remove_unused_columns = False
    hf_trainer.install(trainer, log_interval=1, verdict_interval=1)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    paths = [e for e in iter_events(event_files(tmp_path / "attn_events"), "attn_impl") if e.get("at") == "path"]
    assert len(paths) == 1 and LEFT_PADDED in paths[0]["path_reason"], paths
    assert sum(LEFT_PADDED in r.getMessage() for r in caplog.records) == 1, [r.getMessage() for r in caplog.records]


def test_a_graphed_execution_without_cuda_is_said_in_a_trainer_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``attach(..., capacity=, execution="graphed")`` on a CPU: the first flat batch runs compiled instead, an
    ``attn_impl`` event says why, and the observers step aside saying what compiles the step."""
    from foundry_attn.path import execution

    monkeypatch.setattr(execution, "BACKEND", "aot_eager")  # inductor's traced graph and autograd, without codegen
    torch._dynamo.reset()
    model = _model("llama", "sdpa")
    state = attach(model, "flash_attention_2", fa2_reference=True, capacity=256, execution="graphed")
    assert state.execution.runs == "graphed"
    _train(model, synthetic_documents(model.config, LENGTHS, torch.device("cpu")), tmp_path)
    torch._dynamo.reset()
    assert state.execution.runs == "compiled" and "CUDA graphs need a CUDA device" in state.execution.reason
    events = list(iter_events(event_files(tmp_path / "attn_events")))
    moved = [e for e in events if e["kind"] == "attn_impl" and e.get("at") == "execution"]
    assert [(e["execution"], e["execution_reason"]) for e in moved] == [("compiled", state.execution.reason)]
    assert any("attn_execution graphed" in str(e.get("message", "")) for e in events), {e["kind"] for e in events}
