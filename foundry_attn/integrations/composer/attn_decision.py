"""``attn_decision``: each rank's attention decision in the run's loggers (MLflow, W&B, ...).

See :class:`AttnDecision`.
"""

from __future__ import annotations

from typing import Any

from composer.core import Callback, State
from composer.loggers import Logger

from foundry_attn.flat.unwrap import find_hf_model
from foundry_attn.integrations.composer.common import foundry_model
from foundry_attn.observe.discovery import attn_implementation, mpt_attn_impl
from foundry_attn.observe.path_watch import PathWatch

__all__ = ["AttnDecision", "decision_hparams", "stock_hparams"]


def stock_hparams(model: Any) -> dict[str, Any]:
    """``attn/chosen`` and ``attn/reason`` of a model that made no decision of ours: the implementation that runs
    (:func:`foundry_attn.observe.discovery.attn_implementation`) and where it was read; empty without a model.

    Args:
        model: what Composer trains (``state.model``), wrapped or not; None gives ``{}``.

    Returns:
        ``{"attn/chosen": ..., "attn/reason": ...}``, or ``{}`` without a model.

    Example::

        >>> hparams = stock_hparams(state.model)      # LLM-Foundry's mpt_causal_lm, attn_impl: torch
        >>> hparams["attn/chosen"], hparams["attn/reason"]
        ('torch', "set by the model, not chosen by foundry_attn (MPT's attn_config['attn_impl'])")
    """
    found = find_hf_model(model)
    hf = found[1] if found is not None else model
    impl = attn_implementation(hf)
    if impl is None:
        return {}
    if mpt_attn_impl(hf) is not None:
        source = "MPT's attn_config['attn_impl']"
    elif impl.startswith("unknown"):
        source = "no attention setting found on the model"
    else:
        source = "the model's config._attn_implementation"
    return {"attn/chosen": impl, "attn/reason": f"set by the model, not chosen by foundry_attn ({source})"}


def decision_hparams(model: Any) -> dict[str, Any]:
    """``attn/*`` hyperparameters of a ``foundry_attn_causal_lm`` (through DDP); empty for other models. The
    summary is the one the model gathered from every rank when it was built (no second gather).

    Args:
        model: what Composer trains (``state.model``), or the ``foundry_attn_causal_lm`` itself.

    Returns:
        ``attn/requested``, ``attn/chosen``, ``attn/fell_back``, ``attn/reason``, ``attn/compute_dtype``,
        ``attn/path``, ``attn/path_reason``, ``attn/layout``, ``attn/layout_reason``, ``attn/execution``,
        ``attn/execution_reason`` and ``attn/summary``; ``{}`` for
        other models.

    Example::

        >>> hparams = decision_hparams(state.model)      # attn_implementation: auto, flash-attn not installed
        >>> hparams["attn/chosen"], hparams["attn/fell_back"], hparams["attn/path"]
        ('sdpa', True, 'flat')
    """
    ours = foundry_model(model)
    if ours is None:
        return {}
    decision = ours.attn_decision
    return {
        "attn/requested": decision.requested,
        "attn/chosen": decision.chosen,
        "attn/fell_back": decision.fell_back,
        "attn/reason": decision.reason,
        "attn/compute_dtype": decision.compute_dtype,
        "attn/path": decision.path,
        "attn/path_reason": decision.path_reason,
        "attn/layout": decision.layout,
        "attn/layout_reason": decision.layout_reason,
        "attn/execution": decision.execution,
        "attn/execution_reason": decision.execution_reason,
        "attn/summary": ours.attn_summary,
    }


class AttnDecision(Callback):
    """Logs the attention decision of a ``foundry_attn_causal_lm`` as run hyperparameters.

    At :attr:`.Event.INIT` this callback reads the decision the model made when it was built (which attention
    implementation was asked for, which one runs, and why), gathers every rank's choice and logs them with
    :meth:`.Logger.log_hyperparameters`, so that a fallback on some ranks is visible in MLflow, W&B or any
    other Composer logger. For other models (stock ``hf_causal_lm``, LLM-Foundry's ``mpt_causal_lm``, ...) it
    logs only ``attn/chosen`` and ``attn/reason``: the implementation that really runs, read from the model
    (HF's ``_attn_implementation``, MPT's ``attn_impl``, else ``unknown (class X)``).

    Example, in an LLM-Foundry YAML:

    .. code-block:: yaml

        callbacks:
          attn_decision: {}

    Example, with Composer's Trainer:

    .. code-block:: python

        from composer import Trainer
        from foundry_attn.integrations.composer.attn_decision import AttnDecision

        trainer = Trainer(
            model=model,  # a foundry_attn.integrations.llm_foundry.model.FoundryAttnCausalLM
            train_dataloader=train_dataloader,
            max_duration="1ep",
            callbacks=[AttnDecision()],
        )

    The hyperparameters are logged once, at :attr:`.Event.INIT`: all of them when the model is a
    ``foundry_attn_causal_lm``, those marked "every model" otherwise (this callback logs no metrics):

    .. list-table::
        :header-rows: 1
        :widths: 25 55 20

        * - Key
          - Logged data
          - When
        * - ``attn/requested``
          - The ``attn_implementation`` asked for (``auto``, ``flash_attention_2``, ``flex_attention``, ``sdpa``,
            ``eager``), this rank.
          - ``INIT``.
        * - ``attn/chosen``
          - The implementation that runs on this rank (other models: read from the model, e.g. MPT's ``torch``).
          - ``INIT``, every model.
        * - ``attn/fell_back``
          - ``True`` when this rank does not run what was asked for (for ``auto``: not the chain's first).
          - ``INIT``.
        * - ``attn/reason``
          - Why: the first rejected candidate and its failed check on a fallback, else why the chosen one runs
            (other models: that the model set it, and where it was read).
          - ``INIT``, every model.
        * - ``attn/compute_dtype``
          - The compute dtype the decision was made for (``bfloat16``, ``float32``, ...), this rank.
          - ``INIT``.
        * - ``attn/path``
          - ``flat`` (unpadded once, the documents an argument of every attention call; proven against stock) or
            ``rows`` (the stock backend, one document per row, a 2-D mask), this rank.
          - ``INIT``, and again at ``BATCH_END`` of a batch whose proof moved the run to ``rows``.
        * - ``attn/path_reason``
          - Why: the proof that holds (where, on which documents, the worst difference), or the one that failed.
          - With ``attn/path``.
        * - ``attn/layout``
          - What the last batch ran, ``flat`` or ``rows``: where both are proven (the flat row on stock's packed
            mask), the cheaper for the batch (``foundry_attn.flat.layout_cost``), this rank.
          - ``INIT``, and again at ``BATCH_END`` when it changes.
        * - ``attn/layout_reason``
          - Why: each candidate's work and memory for the batch.
          - With ``attn/layout``.
        * - ``attn/execution``
          - How the flat step runs, ``eager``, ``compiled`` or ``graphed`` (``attn_execution``), this rank.
          - ``INIT``, and again at ``BATCH_END`` when the first batch's device changes it (no CUDA: ``compiled``).
        * - ``attn/execution_reason``
          - Why: what was asked, and why the next one runs where it could not apply.
          - With ``attn/execution``.
        * - ``attn/summary``
          - One line over all ranks, e.g. ``attention: 6/8 ranks flash_attention_2, 2/8 sdpa; 2/8 fell back
            (rank 3, rank 7: ...)`` (the same on every rank).
          - ``INIT``.

    Args:
        (none): ``AttnDecision()`` takes no arguments (``attn_decision: {}`` in YAML).
    """

    def __init__(self) -> None:
        self._ours: Any = None
        self._watch: PathWatch | None = None

    def init(self, state: State, logger: Logger) -> None:
        """At ``INIT``: log the model's decision (:func:`decision_hparams`), else :func:`stock_hparams`.

        Args:
            state: Composer's training state (its model).
            logger: Composer's logger; the hyperparameters go to every logger of the run.

        Example::

            >>> callback.init(state, logger)      # Composer calls it at INIT; MLflow shows attn/chosen, ...
        """
        hparams = decision_hparams(state.model)
        if not hparams:
            stock = stock_hparams(state.model)
            if stock:
                logger.log_hyperparameters(stock)
            return
        logger.log_hyperparameters(hparams)
        self._ours = foundry_model(state.model)
        self._watch = PathWatch(self._ours.attn_state)

    def batch_end(self, state: State, logger: Logger) -> None:
        """A proof on a training batch that moved the run to rows (the state's event), another layout than the last
        batch's, or another execution (graphed on a CPU batch): log the path, the layout or the execution again.

        Args:
            state: Composer's training state.
            logger: Composer's logger; ``attn/path*`` or ``attn/layout*`` are logged again.

        Example::

            >>> callback.batch_end(state, logger)      # Composer calls it at BATCH_END
        """
        changed = () if self._watch is None else self._watch.changed()
        if not changed:
            return
        keys = tuple(f"attn/{what}" for what in changed)
        logger.log_hyperparameters({k: v for k, v in decision_hparams(self._ours).items() if k.startswith(keys)})
