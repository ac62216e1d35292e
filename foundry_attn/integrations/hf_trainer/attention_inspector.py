"""``AttentionInspector`` for transformers' ``Trainer``: what the attention of a sampled step sees, and whether its
packed documents see each other (the Composer twin's core, :class:`foundry_attn.observe.inspector.InspectorCore`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from typing_extensions import override

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
    """On sampled steps, the masks, fill and restarting positions the model, its decoder layers and attention
    modules were given; every ``verdict_interval`` steps, the verdict on packed documents, measured on the step's own
    graph (the structural reading, labelled so, under compile, FSDP or dropout). A leak is a warning with the fix.

        trainer = SFTTrainer(model=model, args=SFTConfig(padding_free=True, output_dir="out"), train_dataset=data)
        install(trainer)      # or Trainer(..., callbacks=hf_trainer.callbacks())

    Logged keys and events: docs/trainer.md, "Logged keys".

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
        self._pending: tuple[list[dict[str, Any]], BatchInfo, Verdict | None] | None = None
        self._probe: ForwardProbe | None = None

    @override
    def begin(self, args: Any) -> None:
        """The probe on the HF model (none under ``torch.compile``: said once, the inspector steps aside)."""
        self.core.events = self.events
        how = compiled_by(self._model) or compiled_by(self._hf)
        if how:
            self.core.say_once("compiled", COMPILED.format(owner=self.owner, how=how))
            return
        self.inspector = self.core.probe(self._hf)

    @override
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Arm the hooks for the first forward of a sampled step."""
        step = state.global_step
        inspect, judged = step % self.log_interval == 0, self.verdict and step % self.verdict_interval == 0
        if self.inspector is None or not (inspect or judged) or self._model is None:
            return
        inspector = self.inspector

        probe = self._probe = ForwardProbe(self._hf) if judged else None  # the forward's autocast and input embeddings

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

    @override
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Report the sampled step's records and verdict."""
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

    @override
    def release(self) -> None:
        """Every hook of ours off the model, the probe's included (idempotent)."""
        super().release()
        if self.inspector is not None:
            self.inspector.disarm()
        if self._probe is not None:
            self._probe.remove()
            self._probe = None
