"""``attention_inspector``'s core, for both glues: the probe on a model, and what a sampled forward and a verdict
report.

    core = InspectorCore(selector=None, print_table=True)
    probe = core.probe(hf)                                     # ModelInspector, its selector's warnings said once
    metrics = core.inspected(step, records, batch, name, impl)   # attn/* metrics, an ``attn_inspect`` event
    metrics |= core.judged(step, verdict, fix)                 # attn/* metrics, ``attn_verdict``, a leak warned once
    core.table(step, records, batch, impl, verdict, rank=0)    # the console table, once

The Composer callback (:mod:`foundry_attn.integrations.composer.attention_inspector`) and the Trainer's
(:mod:`foundry_attn.integrations.hf_trainer.attention_inspector`) only say when: which step, which forward, where the
metrics go. Both validate their arguments here, at construction.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from foundry_attn.observe.console_table import format_table
from foundry_attn.observe.events import EventLog
from foundry_attn.observe.probe import BatchInfo, ModelInspector, summarize
from foundry_attn.observe.verdict import LEAKS, NOT_PACKED, Verdict

log = logging.getLogger(__name__)

OWNER = "attention_inspector"


class InspectorCore:
    """What one inspector reports, whoever calls it: metrics, events, the table once, warnings once each."""

    def __init__(self, selector: str | None = None, print_table: bool = True, unit: str = "batch") -> None:
        if selector is not None:  # both glues' inspectors fail here, at construction, not at the first batch
            try:
                re.compile(selector)
            except re.error as exc:
                raise ValueError(
                    f"{OWNER}: attention_selector {selector!r} is not a valid regular expression: {exc}"
                ) from exc
        self.selector, self.print_table, self.unit = selector, print_table, unit
        self.events: EventLog | None = None
        self.said: set[str] = set()  # one warning of a kind per run
        self.last_records: list[dict[str, Any]] = []
        self.last_metrics: dict[str, float] = {}
        self.last_verdict: Verdict | None = None
        self._printed = False

    def say_once(self, key: str, message: str) -> bool:
        """``message`` at WARNING the first time ``key`` comes (LLM-Foundry's ``train.py`` shows warnings on the
        console); True when it was said now.

        Args:
            key: the kind of warning (``selector``, ``no_attn``, ``leak``).
            message: what is logged.

        Returns:
            True when it was said now, False when ``key`` came before.

        Example::

            >>> core = InspectorCore()
            >>> core.say_once("leak", "attention_inspector: packed documents attend to each other")  # a warning
            True
            >>> core.say_once("leak", "attention_inspector: packed documents attend to each other")  # said before
            False
        """
        if key in self.said:
            return False
        self.said.add(key)
        log.warning(message)
        return True

    def probe(self, model: Any) -> ModelInspector:
        """The probe on ``model`` (the HF model, or the whole model when none was found); a selector that matched
        nothing, or no attention-like module, is said once.

        Args:
            model: the HF model, or the whole model where none was found.

        Returns:
            The :class:`~foundry_attn.observe.probe.ModelInspector` on ``model``, with the core's selector.

        Example::

            >>> core = InspectorCore()
            >>> core.probe(llama_model).modules.attention[0][0]
            'model.layers.0.self_attn'
        """
        inspector = ModelInspector(model, self.selector)
        mods = inspector.modules
        if not mods.selector_matched:
            classes = ", ".join(f"{c} x{n}" for c, n in mods.attention_like.items()) or "none"
            self.say_once(
                "selector",
                f"{OWNER}: attention_selector {mods.selector!r} matched no module; attention-like classes found: "
                f"{classes}. The attention level is not inspected.",
            )
        elif not mods.attention:
            self.say_once(
                "no_attn",
                f"{OWNER}: found no attention-like module (class names with 'Attention'/'Attn'); set "
                "attention_selector",
            )
        return inspector

    def inspected(
        self, step: int, records: list[dict[str, Any]], batch: BatchInfo, model: str, implementation: str | None
    ) -> dict[str, float]:
        """A sampled forward's records: their ``attn/*`` metrics (:func:`~foundry_attn.observe.probe.summarize`)
        and an ``attn_inspect`` event.

        Args:
            step: the batch (or step) number.
            records: the probe's records of that forward.
            batch: what the collated batch held (:meth:`~foundry_attn.observe.probe.BatchInfo.from_batch`).
            model: the inspected model's name, for the event.
            implementation: the attention implementation it runs.

        Returns:
            The ``attn/*`` metrics, kept as ``last_metrics`` too.

        Example::

            >>> core = InspectorCore()
            >>> core.inspected(0, records, BatchInfo.from_batch(padded), "model", "sdpa")["attn/fill_ratio"]
            0.875
        """
        metrics = summarize(records, batch)
        self.last_records, self.last_metrics = records, metrics
        if self.events is not None:
            self.events.append(
                "attn_inspect",
                step=step,
                model=model,
                attn_implementation=implementation,
                batch={"shape": batch.shape, "real_tokens": batch.real_tokens, "fill_ratio": batch.fill_ratio},
                metrics=dict(metrics),
                modules=records,
            )
        return metrics

    def judged(self, step: int, verdict: Verdict, fix: str) -> dict[str, float]:
        """A verdict's ``attn/documents_isolated`` and ``attn/verdict_worst_diff``, an ``attn_verdict`` event, a log
        line, and a leak warned once with ``fix``.

        Args:
            step: the batch (or step) number.
            verdict: the verdict on that batch (:func:`~foundry_attn.observe.verdict.judge`).
            fix: what the leak warning tells the user to change (:func:`~foundry_attn.observe.verdict.fix_for`).

        Returns:
            ``attn/documents_isolated`` (1.0 or 0.0) where the verdict knows, ``attn/verdict_worst_diff`` where it
            measured one.

        Example::

            >>> from foundry_attn.observe.verdict import Features, fix_for, structural
            >>> core = InspectorCore()
            >>> core.judged(3, structural(llama_model, Features.of(batch)), fix_for(llama_model))  # packed, stock sdpa
            {'attn/documents_isolated': 0.0}
        """
        self.last_verdict = verdict
        metrics: dict[str, float] = {}
        if verdict.isolated is not None:
            metrics["attn/documents_isolated"] = float(verdict.isolated)
        if verdict.worst is not None and verdict.worst == verdict.worst:
            metrics["attn/verdict_worst_diff"] = float(verdict.worst)
        if self.events is not None:
            self.events.append("attn_verdict", step=step, **verdict.as_dict())
        log.info("%s: %s %d: %s", OWNER, self.unit, step, verdict.line())
        if verdict.state == LEAKS:
            self.say_once(
                "leak",
                f"{OWNER}: {self.unit} {step}: packed documents attend to each other: {verdict.line()}; fix: {fix}",
            )
        return metrics

    def table(
        self,
        step: int,
        records: list[dict[str, Any]],
        batch: BatchInfo,
        implementation: str | None,
        verdict: Verdict | None,
        rank: int,
    ) -> None:
        """The console table of the first inspected forward (rank 0), the first verdict under it.

        Args:
            step: the batch (or step) number.
            records: the probe's records of that forward.
            batch: what the collated batch held.
            implementation: the attention implementation the model runs.
            verdict: the batch's verdict, printed under the table; None: none.
            rank: this process's global rank (only rank 0 prints).

        Example::

            >>> core = InspectorCore()
            >>> core.table(0, records, BatchInfo.from_batch(padded), "sdpa", None, rank=0)
            attention_inspector: batch 0, rank 0, implementation sdpa, batch fill 0.875 (14/16 real)
            level          modules               mask  dtype    shape    hides    real   fill   packed  impl
            model          LlamaForCausalLM      2-D   int64    2x8      padding  14/16  0.875  -       sdpa
            ...
            >>> core.table(1, records, BatchInfo.from_batch(padded), "sdpa", None, rank=0)  # printed once: nothing now
        """
        if not (records and self.print_table and not self._printed and rank == 0):
            return
        self._printed = True
        fill = batch.fill_ratio
        title = f"{OWNER}: {self.unit} {step}, rank {rank}, implementation {implementation}" + (
            f", batch fill {fill:.3f} ({batch.real_tokens}/{batch.positions} real)" if fill is not None else ""
        )
        table = format_table(records, title)
        if verdict is not None and verdict.state != NOT_PACKED:
            table += f"\npacked documents: {verdict.line()}"
        log.info("\n%s", table)
        print(table, flush=True)


class InspectorResults:
    """What an inspector callback last reported, read from its :class:`InspectorCore` (``core``): a mixin both glues'
    ``AttentionInspector`` share."""

    core: InspectorCore

    @property
    def last_records(self) -> list[dict[str, Any]]:
        """The records of the last inspected forward.

        Returns:
            One record per hooked module; empty before the first.

        Example::

            >>> inspector.last_records[0]["cls"]
            'LlamaForCausalLM'
        """
        return self.core.last_records

    @property
    def last_metrics(self) -> dict[str, float]:
        """The ``attn/*`` metrics of the last inspected forward.

        Returns:
            The metrics; empty before the first.

        Example::

            >>> inspector.last_metrics["attn/fill_ratio"]  # the Trainer's inspector, after a step: 14 of 16 tokens real
            0.875
        """
        return self.core.last_metrics

    @property
    def last_verdict(self) -> Verdict | None:
        """The last verdict on a batch's packed documents.

        Returns:
            The :class:`~foundry_attn.observe.verdict.Verdict`, or None before the first.

        Example::

            >>> inspector.last_verdict.state  # the Trainer's inspector, after a step of two rows, a document each
            'not packed'
        """
        return self.core.last_verdict
