"""``upad_tracer``: how often transformers' flash-attention path unpads, and what reaches the kernel.

See :class:`UpadTracer`.
"""

from __future__ import annotations

from typing import Any

from composer.core import State, Time
from composer.loggers import Logger
from composer.utils import dist
from torch import nn

from foundry_attn.flat.unwrap import find_hf_model
from foundry_attn.integrations.composer.common import (
    ReleasingCallback,
    check_log_interval,
    open_event_log,
)
from foundry_attn.observe.events import EventLog
from foundry_attn.observe.tracer import TracerCore

__all__ = ["UpadTracer"]


class UpadTracer(ReleasingCallback):
    """Counts transformers' flash-attention unpad / varlen / dense calls per sampled step.

    On a sampled batch (the first batch, then every ``log_interval``-th) this callback wraps the helpers that
    ``_flash_attention_forward`` calls (transformers 4.51: ``_upad_input``, ``prepare_fa2_from_position_ids``,
    ``flash_attn_varlen_func``, ``flash_attn_func``, ``pad_input``; the later names are found by
    :func:`foundry_attn.observe.flash_symbols.discover`), counts their calls in the step, and records cu_seqlens_q/k and
    max_seqlen_q/k of the first call and which kernel entry ran first (``varlen`` or ``dense``). For LLM-Foundry's
    MPT (``attn_config.attn_impl: flash``), which calls flash-attn itself, it wraps what MPT looks up at call time
    instead (``flash_attn.flash_attn_interface.flash_attn_varlen_func`` / ``flash_attn_func``,
    ``flash_attn.bert_padding.pad_input``, see :func:`foundry_attn.observe.flash_symbols.discover_mpt`); MPT unpads once
    per forward, so its ``upad`` / ``posids`` counts stay 0. The implementation named is the one that runs
    (:func:`foundry_attn.observe.discovery.attn_implementation`: HF's ``_attn_implementation``, MPT's ``attn_impl``).

    The wrappers are installed when the model's forward starts and removed when it ends, even when it raises
    (an ``always_call`` forward hook), and again at :attr:`.Event.BATCH_END`, :attr:`.Event.FIT_END` and
    ``close``. They are layers (:mod:`foundry_attn.patching`), so two tracers, and the FA2 reference kernel
    context that our model enters per forward, nest in any order. Calls recomputed by activation
    checkpointing during backward are not counted. A symbol missing from the installed transformers is
    reported once (which, which version) and training goes on; a run whose implementation is not flash
    attention, or that runs under ``torch.compile``, is told once that there is nothing to trace.

    Example, in an LLM-Foundry YAML:

    .. code-block:: yaml

        callbacks:
          upad_tracer:
            log_interval: 50        # or '50ba'; the first batch is always traced
            events_dir: null        # default: the model's events_dir, else default_events_dir(run_name)
            print_counts: true      # one console line per traced batch (rank 0)

    Example, with Composer's Trainer:

    .. code-block:: python

        from composer import Trainer
        from foundry_attn.integrations.composer.upad_tracer import UpadTracer

        trainer = Trainer(
            model=model,
            train_dataloader=train_dataloader,
            max_duration="1ep",
            callbacks=[UpadTracer(log_interval="50ba")],
        )

    The metrics are logged by the :class:`.Logger` at :attr:`.Event.BATCH_END` of each sampled batch, when
    the model runs a flash-attention implementation (``flash_attention_2``, also on the pure-PyTorch reference
    kernel; MPT's ``flash``) and at least one flash-attention symbol was found (this callback logs no
    hyperparameters). Counts are calls in the traced forward of the step (every microbatch of it), summed over all
    layers:

    .. list-table::
        :header-rows: 1
        :widths: 30 50 20

        * - Key
          - Logged data
          - When
        * - ``attn/upad_calls_per_step``
          - Calls of transformers' per-layer unpad helper (``_upad_input``): a 2-D padding mask reached the
            flash path. 0 when our model unpadded once before the layers, and for MPT (it unpads once per forward).
          - Every traced batch.
        * - ``attn/posids_calls_per_step``
          - Calls of the position-ids helper (``prepare_fa2_from_position_ids``): packed rows split by
            ``position_ids``.
          - Every traced batch.
        * - ``attn/varlen_calls_per_step``
          - Calls of the variable-length kernel (``flash_attn_varlen_func``; MPT's flash path: one per layer).
          - Every traced batch.
        * - ``attn/dense_calls_per_step``
          - Calls of the dense kernel (``flash_attn_func``): no unpadding, every position computed.
          - Every traced batch.
        * - ``attn/pad_calls_per_step``
          - Calls of ``pad_input``: outputs padded back after an unpad (MPT: ``bert_padding.pad_input`` per layer).
          - Every traced batch.
        * - ``attn/max_seqlen``
          - ``max_seqlen_q`` of the first kernel call of the step (else of the first unpad / position-ids call).
          - Traced batches where one of those calls reported it.

    It also appends an ``upad_trace`` event (JSONL: counts, entry, cu_seqlens, the first call of each helper,
    the kernel) per traced batch to the event log, and prints one line of counts per traced batch (rank 0).

    Args:
        log_interval (int | str | Time, optional): Batches between traced batches: an integer >= 1, a time
            string in batches such as ``'25ba'``, or a :class:`.Time` in batches. The first batch is always
            traced. Default: ``50``.
        events_dir (str, optional): Folder of the ``upad_trace`` events. Default: the model's own
            ``events_dir`` (``foundry_attn_causal_lm``), else ``default_events_dir(run_name)``.
        print_counts (bool, optional): Print one line of counts per traced batch (rank 0). Default: ``True``.
    """

    def __init__(
        self,
        log_interval: int | str | Time = 50,
        events_dir: str | None = None,
        print_counts: bool = True,
    ) -> None:
        self.log_interval = check_log_interval("upad_tracer", log_interval)
        self.events_dir = events_dir
        self.core = TracerCore(print_counts)  # what is traced and reported: the core, shared with the Trainer's
        self._hf: nn.Module | None = None
        self._model_id: int | None = None
        self._handles: list[Any] = []
        self._step = 0

    @property
    def events(self) -> EventLog | None:
        """This callback's event log (its core's), opened at ``FIT_START``.

        Returns:
            The :class:`~foundry_attn.observe.events.EventLog`, or None before ``FIT_START``.

        Example::

            >>> tracer.events.path      # after trainer.fit(), run_name 'my-run', rank 0
            PosixPath('my-run/attn_events/events-rank0.jsonl')
        """
        return self.core.events

    @property
    def implementation(self) -> str | None:
        """The attention implementation the model runs, read at ``FIT_START`` (HF's, or MPT's ``attn_impl``).

        Returns:
            Its name; None before ``FIT_START`` or without a Hugging Face model.

        Example::

            >>> tracer.implementation      # LLM-Foundry's MPT with attn_impl: flash
            'flash'
        """
        return self.core.implementation

    @property
    def last_summary(self) -> dict[str, Any]:
        """The last traced batch's trace, as in its ``upad_trace`` event.

        Returns:
            ``counts``, ``entry``, ``max_seqlen``, ``cu_seqlens``, ``first`` (each helper's first call) and
            ``symbols``; ``{}`` before a traced batch.

        Example::

            >>> tracer.last_summary["first"]["varlen"]["cu_seqlens_q"]
            [0, 12, 21, 28, 40]
        """
        return self.core.last_summary

    @property
    def last_metrics(self) -> dict[str, float]:
        """The metrics the last traced batch logged.

        Returns:
            ``attn/<role>_calls_per_step`` and ``attn/max_seqlen``; ``{}`` before a traced batch.

        Example::

            >>> tracer.last_metrics["attn/varlen_calls_per_step"]      # a 2-layer MPT, attn_impl: flash
            2.0
        """
        return self.core.last_metrics

    def _resolve(self, state: State) -> None:
        """The HF model, and whether there is anything to trace, once per model."""
        if self._model_id == id(state.model):
            return
        self._model_id = id(state.model)
        found = find_hf_model(state.model)
        self._hf = found[1] if found else None
        self.core.resolve(state.model, self._hf)

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.core.attach()

    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.core.detach()

    def release(self) -> None:
        """The forward hooks off the model and every wrapper undone (idempotent); ``FIT_END`` and ``close`` call it.

        Example::

            >>> tracer.release()
        """
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        self.core.release()

    # -- events
    def fit_start(self, state: State, logger: Logger) -> None:
        """At ``FIT_START``: open the event log and find what there is to trace (said once when nothing).

        Args:
            state: Composer's training state (its model and run name).
            logger: Composer's logger.

        Example::

            >>> tracer.fit_start(state, logger)      # Composer calls it at FIT_START
        """
        if self.core.events is None:
            self.core.events = open_event_log(state, self.events_dir)
        self._resolve(state)

    def batch_start(self, state: State, logger: Logger) -> None:
        """At ``BATCH_START`` of a sampled batch: counts from zero, and the hooks that wrap the model's forward.

        Args:
            state: Composer's training state (its model and batch count).
            logger: Composer's logger.

        Example::

            >>> tracer.batch_start(state, logger)      # Composer calls it at BATCH_START
        """
        self.release()
        self._step = int(state.timestamp.batch)
        if self._step % self.log_interval:
            return
        self._resolve(state)
        if self._hf is None or not self.core.start():
            return
        self._handles = [
            self._hf.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
            self._hf.register_forward_hook(self._post_forward, with_kwargs=True, always_call=True),
        ]

    def batch_end(self, state: State, logger: Logger) -> None:
        """At ``BATCH_END`` of a traced batch: its ``attn/*`` metrics logged, its ``upad_trace`` event appended and
        one console line of counts (rank 0).

        Args:
            state: Composer's training state.
            logger: Composer's logger; it gets ``attn/varlen_calls_per_step``, ``attn/max_seqlen``, ...

        Example::

            >>> tracer.batch_end(state, logger)      # Composer calls it at BATCH_END
        """
        traced = bool(self._handles)
        self.release()
        if traced and self.core.tracer is not None:
            logger.log_metrics(self.core.report(self._step, rank0=dist.get_global_rank() == 0))
