"""``AttentionInspector`` for transformers' ``Trainer``: what the attention of a sampled step really sees, and whether
its packed documents see each other.

See :class:`AttentionInspector`; the Composer twin is :mod:`foundry_attn.integrations.composer.attention_inspector`,
on the same core (:class:`foundry_attn.observe.inspector.InspectorCore`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from foundry_attn.checks import check_interval
from foundry_attn.integrations.hf_trainer.common import FIX, SampledCallback, Session
from foundry_attn.observe.discovery import attn_implementation
from foundry_attn.observe.inspector import OWNER, InspectorCore, InspectorResults
from foundry_attn.observe.probe import COMPILED, BatchInfo, ModelInspector
from foundry_attn.observe.verdict import Verdict, judge, second_forward_blocked
from foundry_attn.path.forward import LEFT_PADDED
from foundry_attn.path.state import compiled_by, path_of
from foundry_attn.proof.forward_probe import ForwardProbe

__all__ = ["AttentionInspector"]


class AttentionInspector(InspectorResults, SampledCallback):
    """On sampled steps, what the first forward gave the model, its decoder layers and attention modules (mask,
    fill, restarting positions; :class:`foundry_attn.observe.probe.ModelInspector`), and every ``verdict_interval``
    steps the verdict on packed documents: the influence of one document on another, measured on the step's own
    graph (:func:`foundry_attn.observe.verdict.judge`; the structural reading, labelled so, under compile, FSDP or
    dropout). A leak is a warning that says what to change. Hooks live for one forward and are gone by its end.

        trainer = SFTTrainer(model=model, args=SFTConfig(padding_free=True, output_dir="out"), train_dataset=data)
        install(trainer)      # or Trainer(..., callbacks=hf_trainer.callbacks())

    The metrics join the Trainer's next logs (every reporter gets them); the keys are the Composer inspector's
    (:class:`foundry_attn.integrations.composer.attention_inspector.AttentionInspector` describes each at length):

    .. list-table::
        :header-rows: 1
        :widths: 30 50 20

        * - Key
          - Logged data
          - When
        * - ``attn/inspected_modules``
          - Forward calls recorded: the model, its decoder layers, its attention modules.
          - Every sampled step.
        * - ``attn/mask_none_modules``, ``attn/mask_2d_modules``, ``attn/mask_4d_modules``,
            ``attn/mask_block_modules``, ``attn/mask_with_zeros_modules``
          - Attention modules given no mask, a 2-D, a 4-D mask, a flex ``BlockMask``; a mask that hides a key
            causality would show.
          - Every sampled step.
        * - ``attn/fill_ratio``, ``attn/real_tokens``, ``attn/compute_fill_ratio``
          - Real tokens / positions of the batch, the real tokens, the same ratio at the attention modules.
          - Sampled steps whose batch size is known.
        * - ``attn/packed_position_ids``
          - 1.0 when ``position_ids`` restart inside a row (padding-free batches).
          - Sampled steps with 2-D ``position_ids``.
        * - ``attn/documents_isolated``, ``attn/verdict_worst_diff``
          - 1.0 when packed documents do not see each other (0.0: a leak); the measured influence (0.0 isolated).
          - The first step and every ``verdict_interval``-th, when a row holds two documents or more.
        * - ``attn_inspect``, ``attn_verdict`` events
          - The records of every module, the batch, the metrics; the verdict and its line.
          - As the metrics.

    Args:
        session: the :class:`~foundry_attn.integrations.hf_trainer.common.Session` shared with the other callbacks.
        log_interval: optimizer steps between inspected steps, an integer >= 1 (the first is always inspected).
        verdict: judge whether packed documents see each other.
        verdict_interval: optimizer steps between verdicts, an integer >= 1 (the first step always has one).
        attention_selector: a regular expression on module path or class name for the attention modules (checked
            here: an invalid one is a ValueError now); default: the outermost attention-like classes.
        print_table: print the table on the console the first time (rank 0).
    """

    owner = OWNER

    def __init__(
        self,
        session: Session | None = None,
        log_interval: int = 50,
        verdict: bool = True,
        verdict_interval: int = 100,
        attention_selector: str | None = None,
        print_table: bool = True,
    ) -> None:
        super().__init__(session, log_interval)
        self.verdict = verdict
        self.verdict_interval = check_interval(self.owner, "verdict_interval", verdict_interval)
        self.core = InspectorCore(attention_selector, print_table, unit="step")  # the Composer inspector's core
        self.inspector: ModelInspector | None = None
        self._model: Any = None
        self._hf: Any = None
        self._pending: tuple[list[dict[str, Any]], BatchInfo, Verdict | None] | None = None
        self._probe: ForwardProbe | None = None

    def begin(self, args: Any, model: Any, hf: Any) -> None:
        """The probe on the HF model (none under ``torch.compile``: said once, the inspector steps aside).

        Args:
            args: the Trainer's ``TrainingArguments``.
            model: what the Trainer calls (a wrapper, compiled or not).
            hf: the HF model inside it.

        Example::

            >>> inspector.begin(trainer.args, trainer.model, hf_model)   # from on_train_begin
        """
        self._model, self._hf = model, hf
        self.core.events = self.events
        how = compiled_by(model) or compiled_by(hf)
        if how:
            self.core.say_once("compiled", COMPILED.format(owner=self.owner, how=how))
            return
        self.inspector = self.core.probe(hf)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Arm the hooks for the first forward of a sampled step (Trainer event).

        Args:
            args: the Trainer's ``TrainingArguments``.
            state: the Trainer's ``TrainerState``.
            control: the Trainer's ``TrainerControl``.
            **kwargs: the Trainer's other event keywords, unused.

        Example::

            >>> inspector.on_step_begin(args, state, control)   # the Trainer calls it before each optimizer step
        """
        step = state.global_step
        inspect, judged = step % self.log_interval == 0, self.verdict and step % self.verdict_interval == 0
        if self.inspector is None or not (inspect or judged) or self._model is None:
            return
        inspector = self.inspector

        probe = ForwardProbe(self._hf) if judged else None  # the forward's own autocast and input embeddings
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
        blocked = second_forward_blocked(self._model, self._hf)
        return judge(self._hf, batch, output, blocked, probe.context(), embeds=probe.embeds)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Report the sampled step's records and verdict (Trainer event).

        Args:
            args: the Trainer's ``TrainingArguments``.
            state: the Trainer's ``TrainerState``.
            control: the Trainer's ``TrainerControl``.
            **kwargs: the Trainer's other event keywords, unused.

        Example::

            >>> inspector.on_step_end(args, state, control)   # then the next logs carry attn/documents_isolated 1.0
        """
        self.release()
        path = path_of(self._hf) if self._hf is not None else None
        if path is not None and any(change.reason == LEFT_PADDED for change in path.changes):
            self.core.say_once("left_padded", f"{self.owner}: {LEFT_PADDED}")
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
            self.session.log(metrics)

    def release(self) -> None:
        """Every hook of ours off the model, the probe's included (idempotent).

        Example::

            >>> inspector.release()
        """
        super().release()
        if self.inspector is not None:
            self.inspector.disarm()
        if self._probe is not None:
            self._probe.remove()
            self._probe = None
