"""The worker of ``foundry-attn bench train``: one variant (stock padded, stock packing, ours mask, ours pack) of one
mix, trained by LLM-Foundry's own ``train`` in its own process, reporting every batch to the parent
(:mod:`foundry_attn.bench.train`): its time, its loss against the truth (each document alone, computed without any
of our code), host work and memory.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

OUR_CALLBACKS = ("attn_decision", "attention_inspector", "upad_tracer")


def documents_of(batch: Mapping) -> list[tuple[Any, Any]]:
    """(ids, labels) of every document of a training batch: ours by ``doc_lens``, stock packed rows by
    ``sequence_id`` (real tokens only), stock padded rows by their attention mask."""
    ids, labels = batch["input_ids"], batch["labels"]
    docs = []
    if "doc_lens" in batch:
        for r, lens in enumerate(batch["doc_lens"]):
            start = 0
            for n in lens:
                docs.append((ids[r, start : start + n], labels[r, start : start + n]))
                start += n
        return docs
    mask = batch["attention_mask"].bool()
    for r in range(ids.shape[0]):
        if "sequence_id" in batch:
            seq = batch["sequence_id"][r]
            for k in seq[mask[r]].unique().tolist():
                keep = mask[r] & (seq == k)
                docs.append((ids[r][keep], labels[r][keep]))
        else:
            docs.append((ids[r][mask[r]], labels[r][mask[r]]))
    return docs


def _count_documents(batch: Mapping) -> int:
    """How many documents a batch holds (Composer counts stock rows as samples, packed or not)."""
    if "doc_lens" in batch:
        return sum(len(lens) for lens in batch["doc_lens"])
    if "sequence_id" in batch:  # LLM-Foundry's packed rows: 0..k-1 per row, -1 on padding
        return int((batch["sequence_id"].max(dim=1).values + 1).sum())
    return int(batch["input_ids"].shape[0])


def truth_loss(truth: Any, docs: list[tuple[Any, Any]], autocast: bool) -> float:
    """Each document alone through ``truth`` (stock transformers): the summed token losses over the targets."""
    import torch
    import torch.nn.functional as F

    total = torch.zeros((), dtype=torch.float64)
    count = 0
    device = next(truth.parameters()).device
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        for ids, labels in docs:
            logits = truth(input_ids=ids[None].to(device), use_cache=False).logits[0, :-1].float()
            target = labels[1:].to(device)
            keep = target != -100
            total += F.cross_entropy(logits[keep], target[keep], reduction="sum").double().cpu()
            count += int(keep.sum())
    return float(total / max(count, 1))


class _Timed:
    """A callable that adds its own wall time per call to ``sink`` (keyed by the probe's current batch)."""

    def __init__(self, fn: Callable, sink: list[float]) -> None:
        self.fn, self.sink = fn, sink

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.sink.append(time.perf_counter() - start)


def _register(registry: dict[str, Any]) -> None:
    """The worker's bench-only callback and logger, registered in LLM-Foundry's registries by new names."""
    from composer.core import Callback, Event
    from composer.loggers import LoggerDestination
    from llmfoundry import registry as llm_registry

    class Metrics(LoggerDestination):
        """Every metric Composer logs (SpeedMonitor's throughput among them), the last value of each."""

        def __init__(self) -> None:
            super().__init__()
            self.last: dict[str, float] = {}
            registry["metrics"] = self

        def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
            for k, v in metrics.items():
                if isinstance(v, int | float):
                    self.last[k] = float(v)

    class Probe(Callback):
        """Per batch: tokens, Composer's batch wall clock, the loss; on the first ``truth_batches`` the truth;
        each other callback's ``run_event`` timed (wrapped at FIT_START)."""

        def __init__(self, truth_batches: int = 2) -> None:
            self.truth_batches = truth_batches
            self.batches: list[dict[str, Any]] = []
            self._wrapped = False
            self._truth_model: Any = None
            registry["probe"] = self

        def run_event(self, event: Event, state: Any, logger: Any) -> None:
            if event == Event.FIT_START and not self._wrapped:
                self._wrap(state)
            elif event == Event.BATCH_START:
                self.current: dict[str, Any] = {"callbacks_s": {}}
            elif event == Event.BEFORE_FORWARD and len(self.batches) < self.truth_batches:
                # a warm-up batch: the truth now, on the weights this batch trains with (not timed)
                started = time.perf_counter()
                self.current["truth"] = self.truth(state.model.model, None, state.batch, _autocast(state))
                self.current["truth_s"] = time.perf_counter() - started
            elif event == Event.BEFORE_FORWARD:
                self.current["batch_ref"] = state.batch  # a timed batch: the truth after the step (a reference)
            elif event == Event.AFTER_LOSS:
                self.current["loss"] = float(state.loss.detach().float())
            elif event == Event.BATCH_END:
                ts = state.timestamp
                self.current.update(
                    batch=int(ts.batch),
                    tokens=int(ts.token) - int(state.previous_timestamp.token),
                    samples=int(ts.sample) - int(state.previous_timestamp.sample),
                    batch_wct_s=ts.batch_wct.total_seconds(),
                    rows=int(state.batch["input_ids"].shape[0]),
                    documents=_count_documents(state.batch),
                    positions=int(state.batch["input_ids"].numel()),
                )
                self.batches.append(self.current)

        def _wrap(self, state: Any) -> None:
            self._wrapped = True
            for cb in state.callbacks:
                name = _callback_name(cb)
                if name in OUR_CALLBACKS:
                    cb.run_event = _PerBatch(cb.run_event, name, self)

        def truth(self, hf: Any, weights: Mapping | None, batch: Mapping, autocast: bool) -> float:
            """The batch's documents alone through a stock copy of ``hf`` holding ``weights`` (default: hf's)."""
            from transformers import LlamaForCausalLM

            if self._truth_model is None:
                config = type(hf.config).from_dict(hf.config.to_dict())
                config._attn_implementation = "sdpa"
                truth: Any = LlamaForCausalLM(config)  # to mypy, transformers' top-level classes are dummies
                self._truth_model = truth.to(device=hf.device, dtype=hf.dtype).eval()
            self._truth_model.load_state_dict(hf.state_dict() if weights is None else weights)
            return truth_loss(self._truth_model, documents_of(batch), autocast)

    llm_registry.callbacks.register("foundry_attn_bench_probe", func=Probe)
    llm_registry.loggers.register("foundry_attn_bench_metrics", func=Metrics)


class _PerBatch:
    """A callback's ``run_event`` timed: its seconds per batch go into the probe's current batch record."""

    def __init__(self, fn: Callable, name: str, probe: Any) -> None:
        self.fn, self.name, self.probe = fn, name, probe

    def __call__(self, event: Any, state: Any, logger: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.fn(event, state, logger)
        finally:
            spent = time.perf_counter() - start
            current = getattr(self.probe, "current", None)
            if current is not None:
                current["callbacks_s"][self.name] = current["callbacks_s"].get(self.name, 0.0) + spent


def _callback_name(cb: Any) -> str:
    names = {"AttnDecision": "attn_decision", "AttentionInspector": "attention_inspector"}
    names["UpadTracer"] = "upad_tracer"
    return names.get(type(cb).__name__, type(cb).__name__)


def _autocast(state: Any) -> bool:
    return state.precision.value == "amp_bf16"


def _rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _patch_iterator(host: dict[str, list[float]]) -> None:
    """One train iterator per Trainer, kept across ``fit()`` calls; the loader's collate_fn timed."""
    from composer.core import TrainerMode
    from composer.trainer import trainer as trainer_module

    original = trainer_module.Trainer._iter_dataloader

    def persistent(self: Any, trainer_mode: Any) -> Any:
        if trainer_mode != TrainerMode.TRAIN:
            return original(self, trainer_mode)
        it = getattr(self, "_bench_train_iter", None)
        if it is None:
            loader = self.state.dataloader
            if hasattr(loader, "collate_fn"):
                loader.collate_fn = _Timed(loader.collate_fn, host["collate_s"])
            it = self._bench_train_iter = original(self, trainer_mode)

        def batches() -> Any:  # closing this generator (fit breaks after its batch) leaves ``it`` open
            while True:
                try:
                    batch = next(it)
                except StopIteration:
                    return
                yield batch

        return batches()

    trainer_module.Trainer._iter_dataloader = persistent  # type: ignore[method-assign]


def worker(conn: Any, job: dict[str, Any]) -> None:
    """One variant: build and warm up on "build", one batch per "step", the report on "finish"."""
    log = open(job["log"], "w")  # the process's stdout and stderr until it exits
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ[key] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["WANDB_MODE"] = "disabled"
    if job["device"] == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    phase = "import"
    try:
        import torch

        if job.get("threads"):
            torch.set_num_threads(job["threads"])
        from llmfoundry.command_utils import train
        from omegaconf import OmegaConf

        import foundry_attn.integrations.llm_foundry.model as model_module

        registry: dict[str, Any] = {}
        host: dict[str, list[float]] = {"collate_s": [], "prepare_documents_s": []}
        _register(registry)
        _patch_iterator(host)
        model_module.prepare_documents = _Timed(model_module.prepare_documents, host["prepare_documents_s"])
        rss_at_import = _current_rss_mb()
        conn.send(("ok", {"rss_at_import_mb": rss_at_import}))
        trainer = None
        steps: list[dict[str, float]] = []
        cuda = job["device"].startswith("cuda")
        while True:
            command = conn.recv()
            phase = command
            if command == "build":
                started = time.perf_counter()
                trainer = train(OmegaConf.create(job["config"]))
                conn.send(("ok", {"build_and_warmup_s": time.perf_counter() - started}))
            elif command == "step":
                assert trainer is not None
                if cuda and not steps:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                collated, prepared = len(host["collate_s"]), len(host["prepare_documents_s"])
                hf = trainer.state.model.model
                weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}  # what this batch trains
                cpu, start = time.process_time(), time.perf_counter()
                trainer.fit(duration="1ba", spin_dataloaders=False)
                if cuda:
                    torch.cuda.synchronize()
                wall, cpu = time.perf_counter() - start, time.process_time() - cpu
                probe = registry["probe"]
                record = probe.batches[-1]  # after the clock: the truth of the batch just trained, on its weights
                started = time.perf_counter()
                record["truth"] = probe.truth(hf, weights, record.pop("batch_ref"), _autocast(trainer.state))
                record["truth_s"] = time.perf_counter() - started
                del weights
                steps.append(
                    {
                        "wall_s": wall,
                        "cpu_s": cpu,
                        "collate_s": sum(host["collate_s"][collated:]),
                        "prepare_documents_s": sum(host["prepare_documents_s"][prepared:]),
                    }
                )
                conn.send(("ok", steps[-1]))
            elif command == "finish":
                probe, metrics = registry["probe"], registry["metrics"]
                report = {
                    "batches": probe.batches,
                    "steps": steps,
                    "metrics": {k: v for k, v in metrics.last.items() if k.startswith(("throughput/", "time/"))},
                    "peak_rss_mb": _rss_mb(),
                    "rss_at_import_mb": rss_at_import,
                    "host_warmup": {k: v[: job["warmup"]] for k, v in host.items()},
                    "peak_cuda_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
                    "attn_implementation": _attention_of(trainer),
                }
                conn.send(("ok", report))
                return
    except BaseException as exc:  # reported to the parent; the other variants go on
        with contextlib.suppress(Exception):
            conn.send(("error", {"phase": phase, "error": f"{type(exc).__name__}: {exc}", "traceback": _tb()}))
    finally:
        with contextlib.suppress(Exception):
            conn.close()


def _tb() -> str:
    return "".join(traceback.format_exc().splitlines(keepends=True)[-12:])


def _attention_of(trainer: Any) -> str | None:
    model = getattr(trainer.state.model, "model", None)
    name = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if name is None:
        return None
    from foundry_attn.attention.backends import backend_of

    return backend_of(name)
