"""``attention_inspector``: what the attention of a sampled batch really sees (masks, fill, packing).

See :class:`AttentionInspector`; the probe itself (no Composer) is :mod:`foundry_attn.observe.probe`; the verdict
on packed documents, the callback's second job, is :mod:`foundry_attn.integrations.composer.document_verdict`.
"""

from __future__ import annotations

from composer.core import State, Time
from composer.loggers import Logger
from composer.utils import dist

from foundry_attn.flat.unwrap import find_hf_model
from foundry_attn.integrations.composer.common import ReleasingCallback, check_log_interval, open_event_log
from foundry_attn.integrations.composer.document_verdict import DocumentVerdicts
from foundry_attn.observe.discovery import attn_implementation
from foundry_attn.observe.events import EventLog
from foundry_attn.observe.inspector import InspectorCore, InspectorResults
from foundry_attn.observe.probe import COMPILED, BatchInfo, ModelInspector, summarize
from foundry_attn.path.state import compiled_by

__all__ = ["AttentionInspector", "summarize"]


class AttentionInspector(InspectorResults, ReleasingCallback):
    """Inspects the attention masks, the fill and the packing that a sampled batch really reaches.

    On a sampled batch (the first batch, then every ``log_interval``-th) this callback hooks the Hugging Face
    model inside ``state.model`` (through DDP / FSDP wrappers), every decoder layer and every attention module
    (forward pre-hooks with kwargs, see :class:`foundry_attn.observe.probe.ModelInspector`), and records per module
    the mask it was given (None, 2-D, 4-D, a flex ``BlockMask``), its dtype and shape, whether it masks anything
    (2-D: padding; 4-D: a key that causality would show), the real tokens and fill ratio (real / positions),
    whether ``position_ids`` restart inside a row (packed documents), and the config's ``_attn_implementation``.
    The hooks exist only from :attr:`.Event.BEFORE_FORWARD` to :attr:`.Event.AFTER_FORWARD` of the sampled
    batch's first microbatch (they record nothing after that forward, even one that raised), so unsampled
    batches run with no hook and no host sync. Under ``torch.compile`` it says so once and steps aside.

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

        trainer = Trainer(
            model=model,
            train_dataloader=train_dataloader,
            max_duration="1ep",
            callbacks=[AttentionInspector(log_interval="50ba")],
        )

    The metrics are logged by the :class:`.Logger` at :attr:`.Event.BATCH_END` of each sampled batch (this
    callback logs no hyperparameters). The ``attn/mask_*_modules`` keys count **attention modules**, not decoder
    layers:

    .. list-table::
        :header-rows: 1
        :widths: 30 50 20

        * - Key
          - Logged data
          - When
        * - ``attn/inspected_modules``
          - Forward calls recorded in the sampled forward: the model, its decoder layers and its attention
            modules (those of the attention level are not counted when ``attention_selector`` matches nothing).
          - Every sampled batch.
        * - ``attn/mask_none_modules``
          - Attention modules given no mask (also ours when the documents travel as a call argument).
          - Every sampled batch.
        * - ``attn/mask_2d_modules``
          - Attention modules given a 2-D ``[batch, keys]`` padding mask.
          - Every sampled batch.
        * - ``attn/mask_4d_modules``
          - Attention modules given a 4-D ``[batch, heads, queries, keys]`` mask (eager / sdpa).
          - Every sampled batch.
        * - ``attn/mask_block_modules``
          - Attention modules given a flex ``BlockMask`` (stock ``flex_attention``).
          - Every sampled batch.
        * - ``attn/mask_with_zeros_modules``
          - Attention modules whose tensor mask hides a key that causality would show: a padding zero in a 2-D
            mask; padding, another document or another key in a 4-D one, read with the model's own alignment
            (``cache_position``; a sliding window alone does not count). A ``BlockMask`` is not read.
          - Every sampled batch.
        * - ``attn/fill_ratio``
          - Real tokens / positions of the collated batch (real tokens, as the forward reads them:
            ``doc_lens`` of our collator, else the 2-D ``attention_mask``, else every position).
          - Sampled batches whose size is known (``input_ids`` in the batch, or a tensor input of the model).
        * - ``attn/real_tokens``
          - Real (non-padding) tokens of the collated batch, counted as for ``attn/fill_ratio``.
          - As ``attn/fill_ratio``.
        * - ``attn/compute_fill_ratio``
          - The same ratio at the attention modules, averaged over them: 1.0 when FA2 / SDPA run unpadded.
          - Sampled batches where an attention module was seen.
        * - ``attn/packed_position_ids``
          - 1.0 when the model's ``position_ids`` restart inside a row (packed documents), else 0.0.
          - Sampled batches whose model got 2-D ``position_ids``.
        * - ``attn/documents_isolated``
          - 1.0 when the packed documents of the batch do not see each other, 0.0 when they do. Measured: the
            first documents of the row with the most documents run alone (eval mode, no grad, same backend and
            precision) and their logits are compared with the training forward's. Where a second forward is
            not possible (compiled, FSDP, active dropout) it is the structural reading, labelled so in the
            ``attn_verdict`` event and the log line.
          - The first batch and every ``verdict_interval``-th, when a row holds two documents or more.
        * - ``attn/verdict_worst_diff``
          - The measured influence: the largest gradient of the second document's loss on the first document's
            input embeddings (exactly 0.0 when isolated, at any precision).
          - Sampled batches where it was measured.

    It also appends an ``attn_inspect`` event (JSONL: the records of every module, the batch, the metrics) per
    sampled batch to the event log, and prints the table of :func:`foundry_attn.observe.console_table.format_table` on
    the console the first time (rank 0).

    Packed documents: each sampled batch gets a verdict, logged as a line (``documents isolated (measured:
    ...)``, ``documents LEAK (...)``, ``not packed (...)``) and an ``attn_verdict`` event. The first leak is a
    WARNING that says what to change; so is, at fit start, a train loader that packs for a model that cannot
    keep documents apart (stock sdpa / eager on transformers 4.51, MPT without ``attn_uses_sequence_id``).

    Args:
        log_interval (int | str | Time, optional): Batches between inspected batches: an integer >= 1, a
            time string in batches such as ``'25ba'``, or a :class:`.Time` in batches. The first batch is
            always inspected. Default: ``50``.
        events_dir (str, optional): Folder of the ``attn_inspect`` events. Default: the model's own
            ``events_dir`` (``foundry_attn_causal_lm``), else ``default_events_dir(run_name)``.
        attention_selector (str, optional): A regular expression searched in each module's path and class
            name; the matches are the attention modules. Default: ``None``, the outermost modules whose class
            name says attention (``LlamaAttention``, ``GPTNeoXAttention``, ...).
        print_table (bool, optional): Print the table on the console the first time (rank 0). Default:
            ``True``.
        verdict (bool, optional): Judge whether packed documents see each other, and warn at fit start
            when the loader packs for a model that cannot keep them apart. Default: ``True``.
        verdict_interval (int | str | Time, optional): Batches between verdicts, as ``log_interval`` takes
            them; the first batch always has one. A verdict differentiates the step's own graph once (to the
            input embeddings) and, where no document reaches another, runs one document alone: about half a step
            of a demo-sized model (0.49, against 0.36 for the earlier forwards alone), so it has its own interval:
            every 100th batch costs about 0.5%. Default: ``100``.
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

    @property
    def events(self) -> EventLog | None:
        """This callback's event log (its core's), opened at ``FIT_START``.

        Returns:
            The :class:`~foundry_attn.observe.events.EventLog`, or None before ``FIT_START``.

        Example::

            >>> inspector.events.path      # after trainer.fit(), run_name 'my-run', rank 0
            PosixPath('my-run/attn_events/events-rank0.jsonl')
        """
        return self.core.events

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
        """The probe's hooks off the model (idempotent); Composer's ``FIT_END`` and ``close`` call it too.

        Example::

            >>> inspector.release()
        """
        if self._inspector is not None:
            self._inspector.disarm()

    # -- events
    def fit_start(self, state: State, logger: Logger) -> None:
        """At ``FIT_START``: open the event log, find the HF model and (``verdict``) warn once when the train
        loader packs documents for a model that cannot keep them apart.

        Args:
            state: Composer's training state (its model, run name and train loader).
            logger: Composer's logger.

        Example::

            >>> inspector.fit_start(state, logger)      # Composer calls it at FIT_START
        """
        if self.core.events is None:
            self.core.events = open_event_log(state, self.events_dir)
        self._resolve(state)
        if self.verdict:
            self.verdicts.predict(state)

    def batch_start(self, state: State, logger: Logger) -> None:
        """At ``BATCH_START``: whether this batch is inspected (and judged); any hook left over off.

        Args:
            state: Composer's training state (its batch count).
            logger: Composer's logger.

        Example::

            >>> inspector.batch_start(state, logger)      # Composer calls it at BATCH_START
        """
        self._step = int(state.timestamp.batch)
        self._sampled = self._step % self.log_interval == 0
        if self.verdict:
            self.verdicts.batch_start(self._step)
        self.release()

    def before_forward(self, state: State, logger: Logger) -> None:
        """At ``BEFORE_FORWARD`` of a sampled batch's first microbatch: the probe's hooks on, the batch read.

        Args:
            state: Composer's training state (its model and microbatch).
            logger: Composer's logger.

        Example::

            >>> inspector.before_forward(state, logger)      # Composer calls it at BEFORE_FORWARD
        """
        self.verdicts.before_forward(state)
        if not self._sampled:
            return
        self._sampled = False
        inspector = self._resolve(state)
        if inspector is not None:
            self._batch = BatchInfo.from_batch(state.batch)
            inspector.arm(self._batch)

    def after_forward(self, state: State, logger: Logger) -> None:
        """At ``AFTER_FORWARD``: the hooks off, and a due verdict taken before the backward.

        Args:
            state: Composer's training state (its batch and outputs).
            logger: Composer's logger.

        Example::

            >>> inspector.after_forward(state, logger)      # Composer calls it at AFTER_FORWARD
        """
        self.release()
        self.verdicts.after_forward(state)

    def batch_end(self, state: State, logger: Logger) -> None:
        """At ``BATCH_END``: the verdict's and the sampled forward's ``attn/*`` metrics logged, the ``attn_inspect``
        event appended, and the table printed the first time (rank 0).

        Args:
            state: Composer's training state.
            logger: Composer's logger; it gets ``attn/mask_none_modules``, ``attn/fill_ratio``, ...

        Example::

            >>> inspector.batch_end(state, logger)      # Composer calls it at BATCH_END
        """
        self.release()
        verdict = self.verdicts.batch_end(state, logger, self._step)
        inspector = self._inspector
        if inspector is None or not inspector.records:
            return
        records, inspector.records = inspector.records, []
        implementation = attn_implementation(inspector.model)
        logger.log_metrics(self.core.inspected(self._step, records, self._batch, self._hf_name or "", implementation))
        self.core.table(self._step, records, self._batch, implementation, verdict, dist.get_global_rank())
