"""``UpadTracer`` for transformers' ``Trainer``: transformers' flash-attention unpad, varlen and dense calls of a
sampled step (the Composer twin's core, :class:`foundry_attn.observe.tracer.TracerCore`).
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from foundry_attn.integrations.hf_trainer.common import SampledCallback, Session
from foundry_attn.observe.tracer import TracerCore

__all__ = ["UpadTracer"]


class UpadTracer(SampledCallback):
    """On sampled steps where the model runs transformers' flash-attention code, its unpad, position-ids, varlen,
    dense and pad calls in the first forward, the first ``cu_seqlens`` and ``max_seqlen``, patched for that forward
    only. Other implementations: said once, nothing traced.

        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=hf_trainer.callbacks())

    Logged keys and events: docs/trainer.md, "Logged keys".

    Args:
        session: the :class:`~foundry_attn.integrations.hf_trainer.common.Session` shared with the other callbacks.
        log_interval: optimizer steps between traced steps, an integer >= 1 (the first is always traced).
        print_counts: print the counts on the console (rank 0).
    """

    owner = "upad_tracer"

    def __init__(self, session: Session | None = None, log_interval: int = 50, print_counts: bool = True) -> None:
        super().__init__(session, log_interval)
        self.core = TracerCore(print_counts)
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

    @override
    def begin(self, args: Any) -> None:
        """Whether there is anything to trace (:meth:`~foundry_attn.observe.tracer.TracerCore.resolve`)."""
        self.core.events = self.events
        self.core.resolve(self._model, self._hf)

    @override
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Patch for the first forward of a sampled step."""
        if state.global_step % self.log_interval or not self.core.start():
            return
        self._traced = True
        self.one_forward(self._model, lambda _: self.core.attach(), lambda _, __: self.core.detach())

    @override
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Report the traced step."""
        self.release()
        traced, self._traced = self._traced, False
        if traced:  # global_step counts the step done
            self.session.log(self.core.report(state.global_step - 1, rank0=args.process_index == 0, unit="step"))

    @override
    def release(self) -> None:
        """Every patch and hook of ours off (idempotent)."""
        super().release()
        self.core.release()
