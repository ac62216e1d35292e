"""``foundry_attn_causal_lm``: LLM-Foundry's ``hf_causal_lm`` with an attention fallback that says why, and packed
documents trained as each alone."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from composer.utils import dist
from llmfoundry.models.hf import ComposerHFCausalLM
from llmfoundry.utils.config_utils import set_config_overrides
from transformers import AutoConfig
from typing_extensions import override

from foundry_attn.attention.backends import FA2, backend_of, load_name
from foundry_attn.flat.unwrap import compiled
from foundry_attn.integrations.llm_foundry.keys import KEYS, AttnKeys
from foundry_attn.observe.events import ENV_EVENTS_DIR, EventLog, default_events_dir, run_from_env
from foundry_attn.observe.path_watch import PathWatch
from foundry_attn.observe.ranks import announce, launch_id
from foundry_attn.path.attach import attach_decision, with_step
from foundry_attn.path.forward import Prepared, finish_documents, has_layout, prepare_documents, run_prepared
from foundry_attn.selection.capability import probe
from foundry_attn.selection.decision import decide, model_class_for
from foundry_attn.selection.policy import AttentionUnavailableError, Decision
from foundry_attn.selection.surfaces import LLM_FOUNDRY, speaking

log = logging.getLogger(__name__)


class FoundryAttnCausalLM(ComposerHFCausalLM):
    """A ``ComposerHFCausalLM`` whose attention implementation is chosen by checks, per rank.

    Every other ``hf_causal_lm`` key works unchanged. The forward honours ``foundry_attn`` batches (``doc_lens``)
    and 2-D masks under every backend, on one of two paths (``foundry_attn.path.attach``): **flat** (one row of real
    tokens, unpadded once, the documents passed to every attention call) where it is proven against stock, **rows**
    (the stock backend, one document per row, a 2-D mask) where it is not. The outputs come back in the batch's
    shape, as stock's do; with ``pretrained: false`` and one seed the weights and the RNG state after the build are
    stock's.

    Example, in an LLM-Foundry YAML:

    .. code-block:: yaml

        model:
          name: foundry_attn_causal_lm
          pretrained_model_name_or_path: ./build/tiny/tiny-llama
          pretrained: false
          attn_implementation: auto            # auto | flash_attention_2 | flex_attention | sdpa | eager
          attn_fallback: [flash_attention_2, torch_varlen, sdpa, eager]
          attn_strict: false                   # true: fail if the request cannot run, naming the check
          attn_compute_dtype: auto             # bf16 | fp16 | fp32; auto = bf16 on CUDA (amp_bf16), fp32 on CPU
          events_dir: runs/${run_name}/attn_events  # default: $FOUNDRY_ATTN_EVENTS_DIR, else ./<run_name>/attn_events
          fa2_reference_kernel: false          # CPU diagnosis: FA2 code paths on a pure-PyTorch kernel
          attn_path: auto                      # auto | flat | rows: flat where proven exact, else one document per row
          attn_proof_interval: 100             # prove flat again every N batches, the first and on change (0: not)
          attn_prove_at_build: true            # the proof at build on two synthetic documents (false: first batch)
          attn_capacity: 0                     # N: each flat row padded to a few fixed shapes up to N tokens (varlen)
          attn_execution: auto                 # graphed on CUDA where it can be, else compiled; eager on a CPU
          attn_rank_overrides:                 # one rank asks for something else (a node under test, a repro)
            1: {attn_implementation: flash_attention_2, attn_fallback: [sdpa]}
        callbacks:
          attn_decision: {}                    # logs attn/requested, attn/chosen, ... to your loggers
    """

    def __init__(
        self,
        tokenizer: Any,
        pretrained_model_name_or_path: str,
        events_dir: str | None = None,
        **kwargs: Any,
    ) -> None:
        rank = dist.get_global_rank()
        # the attention keys (foundry.keys.KEYS, their defaults there) parsed once; the rest is hf_causal_lm's
        keys = AttnKeys.parse(rank, **{key: kwargs.pop(key) for key in KEYS if key in kwargs})
        self.attn_keys = keys
        cap = probe()
        launch = launch_id()  # one id for every rank of this launch: rank 0's
        # an explicit folder is checked now; the default waits for the run's name (our callbacks bind it at
        # FIT_START to ./<run_name>/attn_events; without them, the first forward binds the fallback folder)
        known = events_dir or (default_events_dir() if os.environ.get(ENV_EVENTS_DIR) or run_from_env() else None)
        self.attn_events = EventLog(known, rank, cap, launch=launch)
        config = AutoConfig.from_pretrained(
            pretrained_model_name_or_path, trust_remote_code=kwargs.get("trust_remote_code", True)
        )
        set_config_overrides(config, kwargs.get("config_overrides") or {})  # a bad key fails here, not as attention
        try:
            with speaking(LLM_FOUNDRY):  # every "Fix:" names this YAML's keys
                decision = decide(
                    pretrained_model_name_or_path,
                    keys.requested,
                    keys.fallback,
                    keys.strict,
                    keys.compute_dtype,
                    cap,
                    fa2_reference=keys.fa2_reference,
                    config=config,
                )
            self._build(tokenizer, pretrained_model_name_or_path, config, decision, keys.fa2_reference, kwargs)
            self._attach(decision, keys.fa2_reference, keys.prove_at_build)
        except AttentionUnavailableError as exc:  # the log says which rank failed, and why, before the raise
            self.attn_events.append(
                "attn_impl",
                requested=keys.requested,
                chosen=None,
                fallback=True,
                failed=True,
                strict=keys.strict,
                reason=str(exc),
            )
            if not self.attn_events.bound:  # no run will start: write it where the run's folder would be
                self.attn_events.bind(default_events_dir())
            raise
        self.attn_capability = cap
        self._dtype_checked = False
        #: every rank's choice in one line, gathered once here (``attn_decision`` logs it as ``attn/summary``)
        self.attn_summary = announce(
            self.attn_decision.as_dict(), self.attn_events, rank, log, device_name=cap.device_name, sm=cap.sm
        )

    def _build(self, tokenizer: Any, path: str, config: Any, decision: Decision, reference: bool, kwargs: dict) -> None:
        """Build once, as stock builds: ``decide`` already ran transformers' attention check on the config, so an error
        here is the build's own (no retry, no second load); a later fallback switches the loaded model."""
        super().__init__(
            tokenizer=tokenizer,
            pretrained_model_name_or_path=path,
            attn_implementation=load_name(decision.chosen, reference, model_class_for(config)),
            **kwargs,
        )

    def _attach(self, decision: Decision, reference: bool, at_build: bool) -> None:
        """Prove the flat path for the choice (:func:`foundry_attn.path.attach.attach_decision`, the chain walk
        ``attach(model, "auto")`` takes too); rows where it does not hold, the next backend where neither path runs.
        The decision is kept on the model's :class:`~foundry_attn.path.state.PathState`."""
        keys = self.attn_keys
        with speaking(LLM_FOUNDRY):  # the path's state keeps it for the errors of later proofs
            _, self.attn_state = attach_decision(
                self.model,
                decision,
                keys.path,
                fa2_reference=reference,
                strict=keys.strict,
                interval=keys.proof_interval,
                prove_now=at_build,
            )
        with_step(self.attn_state, self.model, keys.capacity, keys.execution)
        self._watch = PathWatch(self.attn_state)

    @property
    def attn_decision(self) -> Decision:
        """What attach decided for this rank, with the path and proof as they are now.

        Returns:
            The :class:`~foundry_attn.selection.policy.Decision`.

        Example::

            >>> model.attn_decision.chosen, model.attn_decision.path
            ('sdpa', 'flat')
        """
        decision = self.attn_state.decision_now()
        assert decision is not None  # attach_decision always records one
        return decision

    @torch.compiler.disable  # host-side bookkeeping: its watch's fields would be guards of a compiled forward
    def _path_changed(self) -> None:
        """After a batch: a proof that moved the run to rows (the state's :class:`~foundry_attn.path.state.PathChange`),
        or the first batch's device that changed the execution (graphed without CUDA), is an ``attn_impl`` event."""
        for what in (w for w in self._watch.changed() if w != "layout"):
            self.attn_events.append("attn_impl", **self.attn_decision.as_dict(), at=what)

    @property
    def attn_implementation(self) -> str:
        """The backend attention runs (``sdpa``, not our registered ``foundry_sdpa``).

        Returns:
            The backend's name.

        Example::

            >>> model.attn_implementation, model.model.config._attn_implementation
            ('sdpa', 'foundry_sdpa')
        """
        return backend_of(self.model.config._attn_implementation)

    def _check_fa2_dtype(self, device: torch.device) -> None:
        """First forward only: FA2 with fp32 weights and no autocast fails inside flash-attn; fall back now."""
        self._dtype_checked = True
        if self.attn_implementation != FA2 or self.attn_state.reference or device.type != "cuda":
            return
        if torch.is_autocast_enabled(device.type) or self.model.dtype in (torch.float16, torch.bfloat16):
            return
        reason = "fp32 weights without autocast at the first forward (FA2 needs fp16/bf16)"
        decision = self.attn_decision.with_rejection(  # strict: raises, naming check, device and fix
            FA2, reason, check="dtype", fix="train with precision: amp_bf16 (or amp_fp16)"
        )
        self._attach(decision, reference=False, at_build=False)  # the first batch proves
        log.warning("attention: switching to %s: %s", self.attn_decision.chosen, reason)
        self.attn_events.append("attn_impl", **self.attn_decision.as_dict(), at="first_forward")

    @override
    def forward(self, batch: Mapping) -> Any:
        """The batch on the proven path where it has our layout (``doc_lens``, a 2-D mask), else stock's forward."""
        routed = self._route(batch)
        if routed is None:
            return super().forward(batch)  # Composer passes on only the keys the HF forward names
        out, routed = run_prepared(lambda inputs: self.model(**inputs, use_cache=False), self.model, routed)
        self._path_changed()
        return finish_documents(out, routed.placed, routed.no_targets, shaped=True)  # [rows, width, vocab] logits

    @torch.compiler.disable
    def _route(self, batch: Mapping) -> Prepared | None:
        """Host-side work before the model runs, never traced (``compile_config`` compiles ``forward``): the
        first-forward dtype check, and our layout's inputs, or None for a batch that keeps the stock path."""
        if not self._dtype_checked:
            self._check_fa2_dtype(batch["input_ids"].device)
            if not self.attn_events.bound:  # none of our callbacks named the run's folder
                self.attn_events.bind(default_events_dir())
        return prepare_documents(self.model, batch, in_step=not compiled(self)) if has_layout(batch) else None
