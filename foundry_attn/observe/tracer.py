"""``upad_tracer``'s core, for both glues: what transformers' flash-attention path did in one forward, reported.

    core = TracerCore(print_counts=True)
    core.resolve(model, hf)               # once per model: anything to trace, or why not (said once, an event)
    core.start(); core.attach()           # around the sampled forward: the tracer's patches on
    core.detach(); metrics = core.report(step, rank0=True)   # metrics, an ``upad_trace`` event, one console line

The Composer callback (:mod:`foundry_attn.integrations.composer.upad_tracer`) and the Trainer's
(:mod:`foundry_attn.integrations.hf_trainer`) only say when: which step, which forward, where the metrics go.
"""

from __future__ import annotations

import logging
from typing import Any

from foundry_attn.attention.backends import FA2
from foundry_attn.attention.fa2_reference import REFERENCE_NAME
from foundry_attn.observe.discovery import attn_implementation, mpt_attn_impl
from foundry_attn.observe.events import EventLog
from foundry_attn.observe.flash_calls import FlashCallTracer
from foundry_attn.observe.flash_symbols import (
    DENSE,
    PAD,
    POSIDS,
    ROLES,
    UPAD,
    VARLEN,
    FlashSymbols,
    discover,
    discover_mpt,
    is_flash,
    is_reference,
    short_list,
    symbol_label,
)
from foundry_attn.observe.probe import COMPILED
from foundry_attn.path.state import compiled_by, path_of

log = logging.getLogger(__name__)


class TracerCore:
    """One model's flash-attention calls on sampled forwards: the unpad, position-ids, varlen, dense and pad calls,
    the first ``cu_seqlens`` and ``max_seqlen`` (:class:`~foundry_attn.observe.flash_calls.FlashCallTracer`).
    Other implementations: said once (a warning and an event), nothing traced."""

    def __init__(self, print_counts: bool = True) -> None:
        self.print_counts = print_counts
        self.events: EventLog | None = None
        self.tracer: FlashCallTracer | None = None
        self.symbols: FlashSymbols | None = None
        self.implementation: str | None = None
        self.idle_reason: str | None = None
        self.last_summary: dict[str, Any] = {}
        self.last_metrics: dict[str, float] = {}
        self._reference = False
        self._said: set[str] = set()

    def say_once(self, key: str, message: str, **event: Any) -> None:
        """``message`` at WARNING the first time ``key`` comes, and an event of kind ``key``.

        Args:
            key: the kind of warning, and the event's kind.
            message: what is logged, and the event's ``message``.
            **event: the event's other fields.

        Example::

            >>> core = TracerCore()
            >>> core.events = EventLog("attn_events", rank=0)
            >>> core.say_once("upad_trace_idle", "upad_tracer: nothing to trace (...)", attn_implementation="sdpa")
            >>> core.say_once("upad_trace_idle", "upad_tracer: nothing to trace (...)")  # said before: no warning
            >>> len(core.events.path.read_text().splitlines())  # one upad_trace_idle event
            1
        """
        if key in self._said:
            return
        self._said.add(key)
        log.warning(message)
        if self.events is not None:
            self.events.append(key, message=message, **event)

    def resolve(self, model: Any, hf: Any) -> None:
        """Whether there is anything to trace in ``model`` (the HF model ``hf`` inside it, or None): flash
        attention (transformers' FA2, MPT's ``flash``), uncompiled, with its symbols found; whether attach put FA2
        on the pure-PyTorch reference kernel (its :class:`~foundry_attn.path.state.PathState` says).

        Args:
            model: what the trainer calls (a wrapper, compiled or not).
            hf: the HF model inside it, or None.

        Example::

            >>> core = TracerCore()
            >>> core.resolve(llama_model, llama_model)  # what the trainer calls, the HF model inside it
            >>> core.idle_reason
            "the attention implementation is 'sdpa', not flash_attention_2: transformers' flash-attention utilities ..."
            >>> core.resolve(fa2_model, fa2_model)
            >>> core.idle_reason, core.tracer is not None
            (None, True)
        """
        self.implementation = attn_implementation(hf)
        mpt = mpt_attn_impl(hf)
        state = path_of(hf) if hf is not None else None
        self._reference = state is not None and state.reference and state.backend == FA2
        how = compiled_by(model)
        if how:
            self.idle_reason = f"the model runs under {how}"
            self.say_once("upad_trace_compiled", COMPILED.format(owner="upad_tracer", how=how))
        elif hf is None:
            self.idle_reason = "no Hugging Face PreTrainedModel in the model"
        elif mpt is not None and mpt != "flash":
            self.idle_reason = (
                f"the attention implementation is {mpt!r} (MPT's attn_config['attn_impl']), not 'flash': "
                f"MPT calls no flash-attn kernel"
            )
        elif mpt is None and not is_flash(self.implementation):
            self.idle_reason = (
                f"the attention implementation is {self.implementation!r}, not flash_attention_2: "
                f"transformers' flash-attention utilities never run"
            )
        else:
            self.symbols = discover_mpt() if mpt is not None else discover()
            self._reference = self._reference or is_reference(self.symbols)
            missing = self.symbols.describe_missing()
            if missing:
                self.say_once(
                    "upad_trace_missing",
                    "upad_tracer: " + "; ".join(missing) + "; training continues",
                    symbols=self.symbols.as_dict(),
                )
            self.idle_reason = None if self.symbols.found else "no flash-attention symbol could be found"
        if self.idle_reason is not None:
            self.tracer = None
            self.say_once(
                "upad_trace_idle",
                f"upad_tracer: nothing to trace ({self.idle_reason})",
                attn_implementation=self.implementation,
            )
        else:
            assert self.symbols is not None
            self.tracer = FlashCallTracer(self.symbols, record=True)

    def start(self) -> bool:
        """A sampled forward is coming: counts from zero. False when there is nothing to trace.

        Returns:
            True where a tracer is ready (its counts reset), False where nothing is traced.

        Example::

            >>> core = TracerCore()
            >>> core.resolve(llama_model, llama_model)
            >>> core.start()  # the model runs sdpa: resolve said why, once
            False
        """
        if self.tracer is None:
            return False
        self.tracer.reset(record=True)
        return True

    def attach(self) -> None:
        """At the sampled forward's start: the tracer's patches on.

        Example::

            >>> core = TracerCore()
            >>> core.resolve(fa2_model, fa2_model)
            >>> if core.start():
            ...     core.attach()
            >>> core.tracer.attached
            True
            >>> core.release()
        """
        if self.tracer is not None:
            self.tracer.attach()

    def detach(self) -> None:
        """At its end (also when it raised).

        Example::

            >>> core = TracerCore()
            >>> core.resolve(fa2_model, fa2_model)
            >>> core.attach()
            >>> core.detach()  # in the ``finally`` after the sampled forward
            >>> core.tracer.attached
            False
        """
        if self.tracer is not None:
            self.tracer.detach()

    def release(self) -> None:
        """Every patch off (idempotent).

        Example::

            >>> core = TracerCore()
            >>> core.resolve(fa2_model, fa2_model)
            >>> core.attach()
            >>> core.attach()  # attached twice (nested)
            >>> core.release()  # at the end of training, or when the callback goes away
            >>> core.tracer.attached
            False
        """
        if self.tracer is not None:
            self.tracer.detach(force=True)

    def report(self, step: int, rank0: bool, unit: str = "batch") -> dict[str, float]:
        """The traced forward's ``attn/<role>_calls_per_step`` and ``attn/max_seqlen`` metrics, its ``upad_trace``
        event and (``rank0``, ``print_counts``) one console line of counts.

        Args:
            step: the batch (or step) number.
            rank0: this process is rank 0 (only it prints).
            unit: what ``step`` counts, for the console line.

        Returns:
            ``attn/<role>_calls_per_step`` per role and ``attn/max_seqlen`` (where a call gave one), as floats; kept as
            ``last_metrics`` too.

        Example::

            >>> core = TracerCore()
            >>> core.resolve(fa2_model, fa2_model)
            >>> core.start()
            True
            >>> core.attach()
            >>> try:  # FA2 on a CPU: the reference kernel (foundry_attn.attention.fa2_reference)
            ...     with reference_flash_attn(), torch.no_grad():
            ...         out = fa2_model(**padded)  # two rows, 8 and 6 real tokens
            ... finally:
            ...     core.detach()
            >>> core.report(3, rank0=False)["attn/varlen_calls_per_step"]  # a 2-layer model, one varlen call per layer
            2.0
        """
        tracer = self.tracer
        assert tracer is not None and self.symbols is not None
        summary = tracer.summary()
        metrics = {f"attn/{role}_calls_per_step": float(tracer.counts[role]) for role in ROLES}
        if tracer.max_seqlen is not None:
            metrics["attn/max_seqlen"] = float(tracer.max_seqlen)
        self.last_summary, self.last_metrics = summary, metrics
        ran = tracer.ran_reference  # what ran; before any kernel ran, what the model was built with
        kernel = REFERENCE_NAME if (ran if ran is not None else self._reference) else "flash-attn"
        if self.events is not None:
            self.events.append(
                "upad_trace", step=step, attn_implementation=self.implementation, kernel=kernel, **summary
            )
        if self.print_counts and rank0:
            label = {role: symbol_label(self.symbols, role) for role in ROLES}
            found, missing = self.symbols.found, self.symbols.missing
            shown = [r for r in (UPAD, POSIDS, VARLEN, DENSE, PAD) if r in found or r in missing]
            counts = ", ".join(f"{label[r]} {tracer.counts[r]}" for r in shown)
            note = f" [kernel: {kernel}]" if "kernel_note" not in self._said else ""
            self._said.add("kernel_note")
            print(
                f"upad_tracer: {unit} {step}: calls this step: {counts}; entry {tracer.entry or '-'}; "
                f"cu_seqlens {short_list(tracer.cu_seqlens)}; max_seqlen {tracer.max_seqlen}{note}",
                flush=True,
            )
        return metrics
