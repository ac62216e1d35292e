"""``UpadTracer`` for transformers' ``Trainer``: transformers' flash-attention unpad, varlen and dense calls of a
sampled step.

See :class:`UpadTracer`; the Composer twin is :mod:`foundry_attn.integrations.composer.upad_tracer`, on the same core
(:class:`foundry_attn.observe.tracer.TracerCore`).
"""

from __future__ import annotations

from typing import Any

from foundry_attn.integrations.hf_trainer.common import SampledCallback, Session
from foundry_attn.observe.tracer import TracerCore

__all__ = ["UpadTracer"]


class UpadTracer(SampledCallback):
    """On sampled steps where the model runs transformers' flash-attention code, its unpad, position-ids, varlen,
    dense and pad calls in the first forward, the first ``cu_seqlens`` and ``max_seqlen``, patched for that forward
    only. Other implementations: said once, nothing traced.

        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=hf_trainer.callbacks())

    .. list-table::
        :header-rows: 1
        :widths: 30 50 20

        * - Key
          - Logged data
          - When
        * - ``attn/<role>_calls_per_step``
          - Calls of each flash-attention role in the traced forward: ``upad`` (unpad), ``posids`` (lengths from
            ``position_ids``), ``varlen``, ``dense``, ``pad``.
          - Every sampled step that ran flash attention.
        * - ``attn/max_seqlen``
          - The first varlen call's ``max_seqlen``.
          - As above, when a varlen call ran.
        * - ``upad_trace`` event
          - The counts, the first ``cu_seqlens`` and ``max_seqlen``, which kernel ran (flash-attn or the reference).
          - As above.

    Args:
        session: the :class:`~foundry_attn.integrations.hf_trainer.common.Session` shared with the other callbacks.
        log_interval: optimizer steps between traced steps, an integer >= 1 (the first is always traced).
        print_counts: print the counts on the console (rank 0).
    """

    owner = "upad_tracer"

    def __init__(self, session: Session | None = None, log_interval: int = 50, print_counts: bool = True) -> None:
        super().__init__(session, log_interval)
        self.core = TracerCore(print_counts)
        self._model: Any = None
        self._traced = False

    @property
    def last_metrics(self) -> dict[str, float]:
        """The last traced step's metrics.

        Returns:
            ``attn/*_calls_per_step`` and ``attn/max_seqlen``; empty before a traced step.

        Example::

            >>> tracer.last_metrics["attn/varlen_calls_per_step"]
            2.0
        """
        return self.core.last_metrics

    def begin(self, args: Any, model: Any, hf: Any) -> None:
        """Whether there is anything to trace (:meth:`~foundry_attn.observe.tracer.TracerCore.resolve`).

        Args:
            args: the Trainer's ``TrainingArguments``.
            model: what the Trainer calls (a wrapper, compiled or not).
            hf: the HF model inside it.

        Example::

            >>> tracer.begin(trainer.args, trainer.model, hf_model)   # from on_train_begin
        """
        self._model = model
        self.core.events = self.events
        self.core.resolve(model, hf)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Patch for the first forward of a sampled step (Trainer event).

        Args:
            args: the Trainer's ``TrainingArguments``.
            state: the Trainer's ``TrainerState``.
            control: the Trainer's ``TrainerControl``.
            **kwargs: the Trainer's other event keywords, unused.

        Example::

            >>> tracer.on_step_begin(args, state, control)   # the Trainer calls it before each optimizer step
        """
        if state.global_step % self.log_interval or not self.core.start():
            return
        self._traced = True
        self.one_forward(self._model, lambda _: self.core.attach(), lambda _, __: self.core.detach())

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Report the traced step (Trainer event).

        Args:
            args: the Trainer's ``TrainingArguments``.
            state: the Trainer's ``TrainerState``.
            control: the Trainer's ``TrainerControl``.
            **kwargs: the Trainer's other event keywords, unused.

        Example::

            >>> tracer.on_step_end(args, state, control)   # then the next logs carry attn/varlen_calls_per_step
        """
        self.release()
        traced, self._traced = self._traced, False
        if traced:  # global_step counts the step done
            self.session.log(self.core.report(state.global_step - 1, rank0=args.process_index == 0, unit="step"))

    def release(self) -> None:
        """Every patch and hook of ours off (idempotent).

        Example::

            >>> tracer.release()
        """
        super().release()
        self.core.release()
