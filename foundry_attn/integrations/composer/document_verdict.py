"""``attention_inspector``'s verdict: do the packed documents of a batch see each other? Which batches get one,
the measurement (:func:`foundry_attn.observe.verdict.measure`) or the structural reading, and its report."""

from __future__ import annotations

from typing import Any

from composer.core import State
from composer.core.precision import get_precision_context
from composer.loggers import Logger

from foundry_attn.flat.packing import PaddingCollator
from foundry_attn.flat.unwrap import find_hf_model
from foundry_attn.observe.inspector import InspectorCore
from foundry_attn.observe.verdict import (
    LEAKS,
    UNKNOWN,
    Features,
    Verdict,
    fix_for,
    judge,
    second_forward_blocked,
    structural,
)
from foundry_attn.proof.forward_probe import ForwardProbe


def _packing_features(dataloader: Any) -> Features | None:
    """What the train loader's batches will carry when its collator packs documents (ours in ``pack`` mode,
    LLM-Foundry's ``BinPackCollator``), else None: nothing is drawn from the loader."""
    collate = getattr(dataloader, "collate_fn", None)
    collate = getattr(collate, "collate", collate)  # our finetuning loader wraps the collator
    if isinstance(collate, PaddingCollator):
        return Features(packed=True, sequence_id=True, position_ids=True) if collate.mode == "pack" else None
    try:
        from llmfoundry.data.packing import BinPackCollator
    except ImportError:  # pragma: no cover - the callbacks run under LLM-Foundry
        return None
    return Features(packed=True, sequence_id=True, padding_mask=True) if isinstance(collate, BinPackCollator) else None


class DocumentVerdicts:
    """One verdict on the first microbatch of every ``interval``-th batch (the first included), reported at its end."""

    def __init__(self, interval: int, core: InspectorCore) -> None:
        self.interval = interval
        self.core = core  # the inspector's: its events, its warnings (one of a kind per run), its last verdict
        self._due = False
        self._probe: ForwardProbe | None = None
        self._pending: Verdict | None = None

    def batch_start(self, step: int) -> None:
        """At the inspector's BATCH_START: whether batch ``step`` gets a verdict; a probe left over removed.

        Args:
            step: the batch's index; 0 and every ``interval``-th get one.

        Example::

            >>> inspector.verdicts.batch_start(int(state.timestamp.batch))
        """
        self._due = step % self.interval == 0
        self._drop_probe()

    def before_forward(self, state: State) -> None:
        """At BEFORE_FORWARD of a due batch's first microbatch: a probe on the HF model's input embeddings.

        Args:
            state: Composer's training state.

        Example::

            >>> inspector.verdicts.before_forward(state)
        """
        due, self._due = self._due, False  # the first microbatch only
        found = find_hf_model(state.model) if due else None
        self._drop_probe()
        if found is not None:  # the forward's input embeddings, for the gradient the verdict takes
            self._probe = ForwardProbe(found[1])

    def after_forward(self, state: State) -> None:
        """At AFTER_FORWARD: the probe off and the verdict taken, reported at BATCH_END.

        Args:
            state: Composer's training state.

        Example::

            >>> inspector.verdicts.after_forward(state)
        """
        probe, self._probe = self._probe, None
        if probe is not None:  # before the backward: the verdict differentiates the graph the step trains on
            probe.remove()
            self._pending = self.judge(state, probe.embeds)

    def _drop_probe(self) -> None:
        if self._probe is not None:
            self._probe.remove()
            self._probe = None

    def batch_end(self, state: State, logger: Logger, step: int) -> Verdict | None:
        """At BATCH_END: the batch's verdict reported (metrics, ``attn_verdict`` event, log line, a leak warned).

        Args:
            state: Composer's training state.
            logger: Composer's logger.
            step: the batch's index.

        Returns:
            The batch's :class:`~foundry_attn.observe.verdict.Verdict`, or None.

        Example::

            >>> inspector.verdicts.batch_end(state, logger, 0).state      # packed, ours
            'isolated'
        """
        verdict, self._pending = self._pending, None
        if verdict is not None:
            found = find_hf_model(state.model)
            metrics = self.core.judged(step, verdict, fix_for(found[1] if found else None))
            if metrics:
                logger.log_metrics(metrics)
        return verdict

    def judge(self, state: State, embeds: Any = None) -> Verdict:
        """The verdict on this microbatch: measured where a second forward is possible, else structural, labelled so.

        Args:
            state: Composer's training state after the forward.
            embeds: the forward's input embeddings (a ``ForwardProbe``'s); None: the documents run a forward alone.

        Returns:
            The :class:`~foundry_attn.observe.verdict.Verdict`.

        Example::

            >>> inspector.verdicts.judge(state).line()      # a batch of unpacked rows
            'not packed (no row holds two marked documents (doc_lens, sequence_id or restarting position_ids))'
        """
        found = find_hf_model(state.model)
        if found is None:
            return Verdict(UNKNOWN, reason="no Hugging Face PreTrainedModel in state.model to run documents alone")
        blocked = second_forward_blocked(state.model, found[1], sharded=state.fsdp_enabled)
        precision = get_precision_context(state.precision)
        return judge(found[1], state.batch, state.outputs, blocked, precision, embeds=embeds)

    def predict(self, state: State) -> None:
        """At fit start: a WARNING when the train loader packs documents for a model that cannot keep them apart.

        Args:
            state: Composer's training state (nothing is drawn from its ``train_dataloader``).

        Example::

            >>> inspector.verdicts.predict(state)
        """
        features = _packing_features(getattr(state, "train_dataloader", None))
        found = find_hf_model(state.model)
        if features is None or found is None:
            return
        reading = structural(found[1], features)
        if reading.state == LEAKS:
            self.core.say_once(
                "leak_predicted",
                f"attention_inspector: the train loader packs documents and this model cannot keep them apart "
                f"({reading.reason}); fix: {fix_for(found[1])}",
            )
