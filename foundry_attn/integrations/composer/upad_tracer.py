"""``upad_tracer``: how often transformers' flash-attention path unpads, and what reaches the kernel."""

from __future__ import annotations

from typing import Any

from composer.core import State, Time
from composer.loggers import Logger
from composer.utils import dist
from torch import nn
from typing_extensions import override

from foundry_attn.flat.unwrap import find_hf_model
from foundry_attn.integrations.composer.common import ReleasingCallback, check_log_interval
from foundry_attn.observe.tracer import TracerCore

__all__ = ["UpadTracer"]


class UpadTracer(ReleasingCallback):
    """Counts transformers' flash-attention unpad / varlen / dense calls per sampled step.

    On the first batch, then every ``log_interval``-th, it wraps the helpers of transformers' flash-attention path
    (``_upad_input``, ``flash_attn_varlen_func``, ``flash_attn_func``, ...; for LLM-Foundry's MPT, the flash-attn
    functions it calls) for that step's forward only, counts their calls and records the first call's
    ``cu_seqlens`` and ``max_seqlen``. A run that does not use flash attention, or runs under ``torch.compile``, is
    told once that there is nothing to trace. Every key it logs, and when: docs/callbacks.md (upad_tracer).

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

        trainer = Trainer(model=model, train_dataloader=train_dataloader, max_duration="1ep",
                          callbacks=[UpadTracer(log_interval="50ba")])

    Args:
        log_interval (int | str | Time, optional): Batches between traced batches: ``50``, ``'50ba'`` or a
            :class:`.Time` in batches. Default: ``50``.
        events_dir (str, optional): Folder of the events. Default: the model's ``events_dir``, else the run's.
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
    def implementation(self) -> str | None:
        """The attention implementation the model runs, read at FIT_START (HF's, or MPT's ``attn_impl``).

        Returns:
            Its name; None before FIT_START or without a Hugging Face model.

        Example::

            >>> tracer.implementation      # LLM-Foundry's MPT with attn_impl: flash
            'flash'
        """
        return self.core.implementation

    @property
    def last_summary(self) -> dict[str, Any]:
        """The last traced batch's trace, as in its ``upad_trace`` event (``{}`` before one).

        Returns:
            ``counts``, ``entry``, ``max_seqlen``, ``cu_seqlens``, ``first`` (each helper's first call), ``symbols``.

        Example::

            >>> tracer.last_summary["first"]["varlen"]["cu_seqlens_q"]
            [0, 12, 21, 28, 40]
        """
        return self.core.last_summary

    @property
    def last_metrics(self) -> dict[str, float]:
        """The metrics the last traced batch logged (``{}`` before one).

        Returns:
            ``attn/<role>_calls_per_step`` and ``attn/max_seqlen``.

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
        """The forward hooks off the model and every wrapper undone (idempotent).

        Example::

            >>> tracer.release()
        """
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        self.core.release()

    @override
    def fit_start(self, state: State, logger: Logger) -> None:
        """At FIT_START: the event log opened and what there is to trace found (said once when nothing)."""
        self._open_events(state)
        self._resolve(state)

    @override
    def batch_start(self, state: State, logger: Logger) -> None:
        """At BATCH_START of a sampled batch: counts from zero, hooks that wrap the model's forward."""
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

    @override
    def batch_end(self, state: State, logger: Logger) -> None:
        """At BATCH_END of a traced batch: its attn/* metrics logged, its ``upad_trace`` event, a console line."""
        traced = bool(self._handles)
        self.release()
        if traced and self.core.tracer is not None:
            logger.log_metrics(self.core.report(self._step, rank0=dist.get_global_rank() == 0))
