"""transformers ``Trainer`` and TRL: what attention really did, as transformers ``TrainerCallback`` objects.

    from foundry_attn.integrations import hf_trainer
    from foundry_attn.flat.attach import attach

    attach(model, "sdpa")      # optional: padding-free batches then train exactly (docs/trainer.md)
    trainer = SFTTrainer(model=model, args=SFTConfig(padding_free=True, output_dir="out"), train_dataset=data)
    hf_trainer.install(trainer)        # or Trainer(..., callbacks=hf_trainer.callbacks())
    trainer.train()

The Composer callbacks' twins (:mod:`foundry_attn.integrations.composer`), on the same core: :class:`AttnDecision` (each
rank's attention: ``attach``'s backend and path, or the model's own setting; one line over every rank on rank 0),
:class:`AttentionInspector` (masks, fill and the measured verdict on packed documents of sampled steps) and
:class:`UpadTracer` (flash-attention unpad / varlen / dense calls of sampled steps). Metrics join the next logs
the Trainer reports, ahead of every reporter (W&B, TensorBoard, MLflow, the console), however the callbacks were
added; ``trainer.log`` is never called, so the Trainer's and TRL's own logged values stay as they are. A second
:func:`install` adds nothing. Events go to ``<output_dir>/attn_events/events-rank<r>.jsonl``, the kinds Composer runs
write, so ``foundry-attn events`` and ``foundry-attn report`` read Trainer runs and mixed fleets alike. Hooks live
for one forward of a sampled step and are gone by its end, even when it raises. transformers only (TRL optional).
"""

from __future__ import annotations

import logging
import sys
import types
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler

from foundry_attn.checks import check_interval
from foundry_attn.flat.forward_probe import ForwardProbe
from foundry_attn.flat.proving import proving
from foundry_attn.flat.state import PathState, path_of
from foundry_attn.flat.unwrap import COMPILED, compiled, find_hf_model
from foundry_attn.observe.discovery import attn_implementation, decision_of
from foundry_attn.observe.events import EventLog
from foundry_attn.observe.inspector import InspectorCore, InspectorResults
from foundry_attn.observe.probe import BatchInfo, ModelInspector
from foundry_attn.observe.tracer import TracerCore
from foundry_attn.observe.verdict import Verdict, judge
from foundry_attn.selection.policy import summarize as summarize_ranks

__all__ = ["AttentionInspector", "AttnDecision", "UpadTracer", "callbacks", "install"]

log = logging.getLogger(__name__)

#: what a Trainer user changes so that packed documents stop seeing each other
FIX = (
    "call foundry_attn.attach(model, backend) before building the Trainer (padding-free batches then train "
    "on the proven path), or train without padding_free"
)


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class Run:
    """What the three callbacks of one :func:`callbacks` call share: the trainer (if known), the event log (one
    launch id for every rank, rank 0's) and the metrics waiting for the Trainer's next logs."""

    def __init__(self, trainer: Any = None, events_dir: str | None = None) -> None:
        self.trainer, self.events_dir = trainer, events_dir
        self.events: EventLog | None = None
        self.pending: dict[str, float] = {}
        self.merger = _Merger(self)
        self.placed = False

    def open(self, args: Any) -> EventLog:
        """The event log, opened once, at train begin (every rank calls it there)."""
        if self.events is None:
            launch = [uuid.uuid4().hex[:12]]
            if _distributed():
                torch.distributed.broadcast_object_list(launch, src=0)
            folder = self.events_dir or Path(args.output_dir) / "attn_events"
            run = getattr(args, "run_name", None) or Path(args.output_dir).name
            self.events = EventLog(folder, args.process_index, run=run, launch=launch[0])
        return self.events

    def place(self, handler: CallbackHandler | None) -> None:
        """Put :class:`_Merger` first among ``handler``'s callbacks, before the Trainer's reporters (once per
        Trainer); None (no handler found) leaves the merging to our own ``on_log``."""
        self.placed = handler is not None
        if handler is not None and self.merger not in handler.callbacks:
            handler.callbacks = [self.merger, *handler.callbacks]  # a new list: the running event goes on over the old

    def log(self, metrics: Mapping[str, float]) -> None:
        """Hold ``metrics`` for the Trainer's next logs (never ``trainer.log``: TRL folds its own metrics into
        every call of it and clears them)."""
        self.pending.update(metrics)

    def merge(self, logs: dict | None, state: Any) -> None:
        """``pending`` into the logs being reported, and into their copy the Trainer just kept in its history."""
        if not self.pending or logs is None:
            return
        history = getattr(state, "log_history", None)
        if history and history[-1] == {**logs, "step": state.global_step}:  # the Trainer's copy of these logs
            history[-1].update(self.pending)
        logs.update(self.pending)
        self.pending.clear()


class _Merger(TrainerCallback):
    """First among the Trainer's callbacks: the ``attn/*`` metrics waiting since the last log join the logs the
    Trainer is about to report, so every reporter (TensorBoard, W&B, MLflow, the console) gets them."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        self.run.merge(logs, state)


def _calling_handler() -> CallbackHandler | None:
    """The Trainer's :class:`CallbackHandler` that is calling this callback event (a Trainer given our callbacks
    with ``Trainer(callbacks=...)`` is not known to them otherwise)."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, CallbackHandler):
            return owner
        frame = frame.f_back
    return None


class _Callback(TrainerCallback):
    """Sampling (the first optimizer step, then every ``log_interval``-th), one-forward hooks, release."""

    owner = ""

    def __init__(self, run: Run | None = None, log_interval: int = 50) -> None:
        self.run = run or Run()
        self.log_interval = check_interval(self.owner, "log_interval", log_interval)
        self._handles: list[Any] = []

    @property
    def events(self) -> EventLog | None:
        return self.run.events

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.run.open(args)
        trainer = self.run.trainer
        self.run.place(trainer.callback_handler if trainer is not None else _calling_handler())
        found = find_hf_model(model) if model is not None else None
        self.begin(args, model, found[1] if found is not None else model)

    def begin(self, args: Any, model: Any, hf: Any) -> None:
        """At train begin, with the model the Trainer calls and the HF model inside it."""

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if not self.run.placed:  # no handler found to go first in: the reporters after us still get them
            self.run.merge(logs, state)

    def one_forward(self, model: Any, before: Callable[[dict], None], after: Callable[[dict, Any], None]) -> None:
        """Hooks on ``model`` for its next forward that is the batch's (a proof's forwards are not): ``before``
        with its keywords at its start (the first pre-hook), ``after`` with its keywords and output at its end
        (None when it raised; the last hook, so :meth:`release` may remove every hook of ours there: torch calls a
        hook removed while its forward runs without the keywords it was registered with)."""

        def pre(_: Any, args: tuple, kwargs: dict) -> None:
            if not proving():
                before(kwargs)

        def post(_: Any, args: tuple, kwargs: dict, output: Any) -> None:
            if proving():
                return
            self.release()
            after(kwargs, output)

        self._drop_hooks()
        self._handles = [
            model.register_forward_pre_hook(pre, with_kwargs=True, prepend=True),
            model.register_forward_hook(post, with_kwargs=True, always_call=True),
        ]

    def _drop_hooks(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def release(self) -> None:
        """Every hook and patch of ours off the model (idempotent)."""
        self._drop_hooks()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.release()


# ---- the decision -------------------------------------------------------------------------------------------


class AttnDecision(_Callback):
    """Each rank's attention, at train begin: an ``attn_impl`` event, a log line, and on rank 0 one line over every
    rank (``attention: 2/2 ranks sdpa; path flat``); a proof that moves the run to rows is another event. Metrics
    ``attn/path_flat`` (1 flat, 0 rows; attached models) at the first step."""

    owner = "attn_decision"

    _hf: Any = None

    def begin(self, args: Any, model: Any, hf: Any) -> None:
        self._hf = hf
        info = decision_of(hf)
        rank = args.process_index
        assert self.events is not None
        self.events.append("attn_impl", **info)
        log.info(
            "attention rank %d: %s (%s); path %s (%s)",
            rank,
            info["chosen"],
            info["reason"],
            info["path"] or "-",
            info["path_reason"] or "-",
        )
        gathered = [{"rank": rank, **info}]
        if _distributed():
            everyone: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(everyone, gathered[0])
            gathered = everyone
        if rank == 0:
            log.warning(summarize_ranks(gathered))
        state = path_of(hf)
        if state is not None:
            if self._moved not in state.listeners:
                state.listeners.append(self._moved)
            self.run.log({"attn/path_flat": float(state.path == "flat")})

    def _moved(self, state: PathState) -> None:
        """A proof on a training batch moved the run to rows."""
        info = decision_of(self._hf)
        if self.events is not None:
            self.events.append("attn_impl", **info, at="path")
        self.run.log({"attn/path_flat": float(info["path"] == "flat")})


# ---- the inspector and its verdict ------------------------------------------------------------------------


class AttentionInspector(InspectorResults, _Callback):
    """On sampled steps, what the first forward gave the model, its decoder layers and attention modules (mask,
    fill, restarting positions; :class:`foundry_attn.observe.probe.ModelInspector`), and every ``verdict_interval``
    steps the verdict on packed documents: the first documents of the batch's row with the most run alone and
    compared with the training forward's logits (:func:`foundry_attn.observe.verdict.measure`; the structural reading,
    labelled so, under compile, FSDP or dropout). A leak is a warning that says what to change.
    Metrics: the ``attn/*`` of the Composer inspector; events ``attn_inspect`` and ``attn_verdict``."""

    owner = "attention_inspector"

    def __init__(
        self,
        run: Run | None = None,
        log_interval: int = 50,
        verdict: bool = True,
        verdict_interval: int = 100,
        attention_selector: str | None = None,
        print_table: bool = True,
    ) -> None:
        super().__init__(run, log_interval)
        self.verdict = verdict
        self.verdict_interval = check_interval(self.owner, "verdict_interval", verdict_interval)
        self.core = InspectorCore(attention_selector, print_table, unit="step")  # the Composer inspector's core
        self.inspector: ModelInspector | None = None
        self._model: Any = None
        self._hf: Any = None
        self._pending: tuple[list[dict[str, Any]], BatchInfo, Verdict | None] | None = None
        self._probe: ForwardProbe | None = None

    def begin(self, args: Any, model: Any, hf: Any) -> None:
        self._model, self._hf = model, hf
        self.core.events = self.events
        if compiled(model) or compiled(hf):
            self.core.say_once("compiled", COMPILED.format(owner=self.owner))
            return
        self.inspector = self.core.probe(hf)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step
        inspect, judge = step % self.log_interval == 0, self.verdict and step % self.verdict_interval == 0
        if self.inspector is None or not (inspect or judge) or self._model is None:
            return
        inspector = self.inspector

        probe = ForwardProbe(self._hf) if judge else None  # the forward's own autocast and input embeddings
        self._probe = probe

        def before(batch: dict) -> None:
            inspector.batch = BatchInfo.from_batch(batch)

        def after(batch: dict, output: Any) -> None:
            records, inspector.records = inspector.records, []
            verdict = None
            if probe is not None and output is not None:
                probe.remove()
                verdict = self._judge(batch, output, probe)
            self._pending = (records, inspector.batch, verdict)

        if inspect:
            inspector.arm()
        self.one_forward(self._model, before, after)  # after arm: its post-hook is the last

    def _judge(self, batch: Mapping, output: Any, probe: ForwardProbe) -> Verdict:
        from torch.distributed.tensor import DTensor

        hf = self._hf
        blocked = (
            "the model is compiled"
            if compiled(self._model)
            else "FSDP shards the weights (a second forward on one rank would hang the others)"
            if isinstance(next(hf.parameters()), DTensor)
            else None
        )
        return judge(hf, batch, output, blocked, probe.context(), embeds=probe.embeds)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.release()
        pending, self._pending = self._pending, None
        if pending is None:
            return
        records, batch, verdict = pending
        step = state.global_step - 1  # the step these records are of (global_step counts it done)
        implementation = attn_implementation(self._hf)
        metrics = self.core.inspected(step, records, batch, type(self._hf).__name__, implementation) if records else {}
        if verdict is not None:
            metrics.update(self.core.judged(step, verdict, FIX))
        self.core.table(step, records, batch, implementation, verdict, args.process_index)
        if metrics:
            self.run.log(metrics)

    def release(self) -> None:
        super().release()
        if self.inspector is not None:
            self.inspector.disarm()
        if self._probe is not None:
            self._probe.remove()
            self._probe = None


# ---- the unpad tracer ---------------------------------------------------------------------------------------


class UpadTracer(_Callback):
    """On sampled steps where the model runs transformers' flash-attention code, its unpad, position-ids, varlen,
    dense and pad calls in the first forward, the first ``cu_seqlens`` and ``max_seqlen``: the Composer tracer's
    core (:class:`foundry_attn.observe.tracer.TracerCore`), patched for that forward only. Metrics
    ``attn/<role>_calls_per_step`` and ``attn/max_seqlen``; event ``upad_trace``. Other implementations: said
    once, nothing traced."""

    owner = "upad_tracer"

    def __init__(self, run: Run | None = None, log_interval: int = 50, print_counts: bool = True) -> None:
        super().__init__(run, log_interval)
        self.core = TracerCore(print_counts)
        self._model: Any = None
        self._traced = False

    @property
    def last_metrics(self) -> dict[str, float]:
        return self.core.last_metrics

    def begin(self, args: Any, model: Any, hf: Any) -> None:
        self._model = model
        self.core.events = self.events
        self.core.resolve(model, hf)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step % self.log_interval or not self.core.start():
            return
        self._traced = True
        self.one_forward(self._model, lambda _: self.core.attach(), lambda _, __: self.core.detach())

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.release()
        traced, self._traced = self._traced, False
        if traced:  # global_step counts the step done
            self.run.log(self.core.report(state.global_step - 1, rank0=args.process_index == 0, unit="step"))

    def release(self) -> None:
        super().release()
        self.core.release()


# ---- what a user calls --------------------------------------------------------------------------------------


def callbacks(
    trainer: Any = None,
    *,
    events_dir: str | None = None,
    log_interval: int = 50,
    verdict_interval: int = 100,
) -> list[TrainerCallback]:
    """The decision, the inspector and the unpad tracer, sharing one event log (default
    ``<output_dir>/attn_events``). With ``trainer`` their metrics go through ``trainer.log``."""
    run = Run(trainer, events_dir)
    return [
        AttnDecision(run, log_interval),
        AttentionInspector(run, log_interval, verdict_interval=verdict_interval),
        UpadTracer(run, log_interval),
    ]


def install(trainer: Any, **options: Any) -> list[TrainerCallback]:
    """Add the decision, the inspector and the unpad tracer (:func:`callbacks`) to ``trainer``, first among its
    callbacks' reporters; a second call adds nothing (a warning).

    Args:
        trainer: a transformers ``Trainer`` or TRL ``SFTTrainer``, before ``train()``.
        **options: :func:`callbacks`' keywords: ``events_dir`` (default ``<output_dir>/attn_events``),
            ``log_interval`` (optimizer steps between samples, default 50), ``verdict_interval`` (default 100).

    Returns:
        The callbacks in the trainer (the ones already there on a second call).

    Example::

        >>> from foundry_attn import attach, install
        >>> attach(model, "sdpa")                      # optional: padding-free batches then train exactly
        >>> trainer = SFTTrainer(model=model, args=SFTConfig(padding_free=True, output_dir="out"), train_dataset=data)
        >>> install(trainer)
        >>> trainer.train()                            # attn/* metrics in every reporter; events in out/attn_events
    """
    present: list[TrainerCallback] = [c for c in trainer.callback_handler.callbacks if isinstance(c, _Callback)]
    if present:
        log.warning(
            "foundry_attn: install: this trainer already has foundry_attn's callbacks (%s); nothing added",
            ", ".join(type(c).__name__ for c in present),
        )
        return present
    added = callbacks(trainer, **options)
    for callback in added:
        trainer.add_callback(callback)
    return added
