"""``attention_inspector``: what the attention of a sampled batch really sees (masks, fill, packing), and whether
packed documents see each other (:mod:`foundry_attn.integrations.composer.document_verdict`)."""

from __future__ import annotations

from composer.core import State, Time
from composer.loggers import Logger
from composer.utils import dist
from typing_extensions import override

from foundry_attn.flat.unwrap import find_hf_model
from foundry_attn.integrations.composer.common import ReleasingCallback, check_log_interval
from foundry_attn.integrations.composer.document_verdict import DocumentVerdicts
from foundry_attn.observe.discovery import attn_implementation
from foundry_attn.observe.inspector import InspectorCore, InspectorResults
from foundry_attn.observe.probe import COMPILED, BatchInfo, ModelInspector, summarize
from foundry_attn.path.state import compiled_by

__all__ = ["AttentionInspector", "summarize"]


class AttentionInspector(InspectorResults, ReleasingCallback):
    """Inspects the attention masks, the fill and the packing that a sampled batch really reaches.

    On the first batch, then every ``log_interval``-th, it hooks the HF model inside ``state.model``, its decoder
    layers and attention modules for the first microbatch's forward only, and logs per module the mask each got,
    the fill and whether ``position_ids`` restart (packed documents). On the first batch, then every
    ``verdict_interval``-th, it judges whether packed documents see each other (measured where it can be) and warns
    on a leak. Every key it logs, and when: docs/callbacks.md (attention_inspector).

    Example, in an LLM-Foundry YAML:

    .. code-block:: yaml

        callbacks:
          attention_inspector:
            log_interval: 50              # or '50ba'; the first batch is always inspected
            events_dir: null              # default: the model's events_dir, else default_events_dir(run_name)
            attention_selector: null      # regex on module name or class; default: attention-like classes
            print_table: true             # a compact table on the console, the first time (rank 0)
            verdict: true                 # do packed documents see each other? measured, not inferred
            verdict_interval: 100         # batches between verdicts (the first batch always has one)

    Example, with Composer's Trainer:

    .. code-block:: python

        from composer import Trainer
        from foundry_attn.integrations.composer.attention_inspector import AttentionInspector

        trainer = Trainer(model=model, train_dataloader=train_dataloader, max_duration="1ep",
                          callbacks=[AttentionInspector(log_interval="50ba")])

    Args:
        log_interval (int | str | Time, optional): Batches between inspected batches: ``50``, ``'50ba'`` or a
            :class:`.Time` in batches. Default: ``50``.
        events_dir (str, optional): Folder of the events. Default: the model's ``events_dir``, else the run's.
        attention_selector (str, optional): A regex searched in each module's path and class name. Default: the
            outermost modules whose class name says attention (``LlamaAttention``, ...).
        print_table (bool, optional): Print the table the first time (rank 0). Default: ``True``.
        verdict (bool, optional): Judge whether packed documents see each other, and warn at fit start when the
            loader packs for a model that cannot keep them apart. Default: ``True``.
        verdict_interval (int | str | Time, optional): Batches between verdicts, as ``log_interval``; a verdict
            costs about half a step. Default: ``100``.
    """

    def __init__(
        self,
        log_interval: int | str | Time = 50,
        events_dir: str | None = None,
        attention_selector: str | None = None,
        print_table: bool = True,
        verdict: bool = True,
        verdict_interval: int | str | Time = 100,
    ) -> None:
        owner = "attention_inspector"
        self.log_interval = check_log_interval(owner, log_interval)
        self.verdict_interval = check_log_interval(owner, verdict_interval, "verdict_interval")
        self.events_dir = events_dir
        self.verdict = verdict
        self.core = InspectorCore(attention_selector, print_table)  # what is reported: shared with the Trainer's
        self._inspector: ModelInspector | None = None
        self._model_id: int | None = None
        self._hf_name: str | None = None
        self._sampled = False
        self._step = 0
        self._batch = BatchInfo()
        self.verdicts = DocumentVerdicts(self.verdict_interval, self.core)  # the second job: document_verdict

    def _resolve(self, state: State) -> ModelInspector | None:
        if self._inspector is not None and self._model_id == id(state.model):
            return self._inspector
        how = compiled_by(state.model)
        if how:
            self.core.say_once("compiled", COMPILED.format(owner="attention_inspector", how=how))
            return None
        found = find_hf_model(state.model)
        if found is None:
            self.core.say_once(
                "no_hf",
                "attention_inspector: no Hugging Face PreTrainedModel in state.model; "
                "inspecting the whole model without decoder-layer discovery",
            )
            self._hf_name, model = "", state.model
        else:
            self._hf_name, model = found
        self._inspector, self._model_id = self.core.probe(model), id(state.model)
        return self._inspector

    def release(self) -> None:
        """The probe's hooks off the model (idempotent).

        Example::

            >>> inspector.release()
        """
        if self._inspector is not None:
            self._inspector.disarm()

    @override
    def fit_start(self, state: State, logger: Logger) -> None:
        """At FIT_START: the event log opened, the HF model found, a loader that will leak warned (``verdict``)."""
        self._open_events(state)
        self._resolve(state)
        if self.verdict:
            self.verdicts.predict(state)

    @override
    def batch_start(self, state: State, logger: Logger) -> None:
        """At BATCH_START: whether this batch is inspected (and judged); any hook left over off."""
        self._step = int(state.timestamp.batch)
        self._sampled = self._step % self.log_interval == 0
        if self.verdict:
            self.verdicts.batch_start(self._step)
        self.release()

    @override
    def before_forward(self, state: State, logger: Logger) -> None:
        """At BEFORE_FORWARD of a batch's first microbatch: a due verdict's probe on the input embeddings and, in a
        sampled batch, the probe's hooks on, the batch read; neither under ``torch.compile`` (the inspector steps
        aside: a hook inside the compiled forward would break its graph)."""
        inspector = self._resolve(state)
        if inspector is None:
            return
        self.verdicts.before_forward(state)
        if self._sampled:
            self._sampled = False
            self._batch = BatchInfo.from_batch(state.batch)
            inspector.arm(self._batch)

    @override
    def after_forward(self, state: State, logger: Logger) -> None:
        """At AFTER_FORWARD: the hooks off, and a due verdict taken before the backward."""
        self.release()
        self.verdicts.after_forward(state)

    @override
    def batch_end(self, state: State, logger: Logger) -> None:
        """At BATCH_END: the verdict's and the sampled forward's attn/* metrics logged, its event, the table once."""
        self.release()
        verdict = self.verdicts.batch_end(state, logger, self._step)
        inspector = self._inspector
        if inspector is None or not inspector.records:
            return
        records, inspector.records = inspector.records, []
        implementation = attn_implementation(inspector.model)
        logger.log_metrics(self.core.inspected(self._step, records, self._batch, self._hf_name or "", implementation))
        self.core.table(self._step, records, self._batch, implementation, verdict, dist.get_global_rank())
