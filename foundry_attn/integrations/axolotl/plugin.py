"""``FoundryAttnPlugin``: foundry_attn in an axolotl run, from one line of YAML (docs/axolotl.md); without axolotl
the module still imports and the class derives from ``object``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

from transformers import TrainerCallback
from typing_extensions import override

from foundry_attn.integrations.axolotl.batches import document_targets, read_packed, shaped_back
from foundry_attn.integrations.axolotl.refusals import refusal, runs_here
from foundry_attn.integrations.hf_trainer import install
from foundry_attn.path.attach import attach
from foundry_attn.path.state import AUTO_PATH, FLAT
from foundry_attn.selection.surfaces import AXOLOTL, speaking


def _axolotl_base() -> type:
    """axolotl's ``BasePlugin`` (its hooks' defaults), or ``object`` where axolotl is not installed."""
    try:
        from axolotl.integrations.base import BasePlugin
    except ImportError:
        return object
    return BasePlugin


#: under axolotl's namespace: axolotl's log filter shows ``axolotl.*`` at INFO and other loggers from WARNING only
LOG = logging.getLogger("axolotl.integrations.foundry_attn")
ENTRY = "foundry_attn.integrations.axolotl.FoundryAttnPlugin"


def _given(cfg: Any, key: str) -> Any:
    """``cfg``'s value of one of our keys, or its one declared default (:class:`~.args.FoundryAttnArgs`)."""
    from foundry_attn.integrations.axolotl.args import FoundryAttnArgs

    value = cfg.get(key)
    return FoundryAttnArgs.model_fields[key].default if value is None else value


def sdpa_varlen_on() -> bool:
    """Whether axolotl's ``patch_sdpa_varlen`` re-registered ``sdpa`` for the whole process.

    Returns:
        True where the registered ``sdpa`` is axolotl's wrapper.

    Example::

        >>> sdpa_varlen_on()
        False
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return hasattr(ALL_ATTENTION_FUNCTIONS.get("sdpa"), "_axolotl_sdpa_original")


def what_ran(state: Any, varlen: bool | None = None) -> str:
    """The attention that really runs the training batches, in words.

    Args:
        state: the model's :class:`~foundry_attn.path.state.PathState`.
        varlen: whether axolotl's sdpa_varlen patch is on (default: read it now, :func:`sdpa_varlen_on`).

    Returns:
        A line such as ``foundry_sdpa (foundry_attn's sdpa, documents passed to every call); flat row``.

    Example::

        >>> what_ran(attach(model, "sdpa"))
        "foundry_sdpa (foundry_attn's sdpa per document, the documents an argument of every call); one flat row"
    """
    varlen = sdpa_varlen_on() if varlen is None else varlen
    if state.path == FLAT:
        line = (
            f"{state.flat_name} (foundry_attn's {state.backend} per document, the documents an argument of every "
            "call); one flat row"
        )
        if varlen and state.backend == "sdpa":
            line += "; axolotl's sdpa_varlen wrapper, registered as 'sdpa', is bypassed"
        return line
    line = f"{state.rows_name} (stock), one document per row with a 2-D mask"
    if varlen and state.rows_name == "sdpa":
        line += " (axolotl's sdpa_varlen wrapper is registered as 'sdpa' and hands masked rows to stock sdpa)"
    return line


class BatchReader:
    """Hooks on the model the Trainer calls: an axolotl packed batch becomes the one flat row the attached model
    takes (:func:`~foundry_attn.integrations.axolotl.batches.read_packed`), the logits go back to the batch's shape.

        reader = BatchReader(trainer.model)    # post_trainer_create
        reader.remove()                        # after trainer.train returns or raises (undone_after_train)
    """

    def __init__(self, model: Any) -> None:
        self.calls = self.flattened = self.masks = 0
        self._shapes: dict[int, tuple[int, int]] = {}
        self._handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.register_forward_hook(self._after, with_kwargs=True),
        ]

    def _before(self, _: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        read = read_packed(kwargs)
        if read is None:
            return None
        out, shape = read
        self.calls += 1
        self.masks += "attention_mask" in kwargs
        if shape is not None:
            self.flattened += 1
            self._shapes[id(out["input_ids"])] = shape
        return args, out

    def _after(self, _: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        shape = self._shapes.pop(id(kwargs.get("input_ids")), None)
        return output if shape is None else shaped_back(output, shape)

    def remove(self) -> None:
        """Take the hooks off (idempotent).

        Example::

            >>> reader.remove()
        """
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()


def _counts(reader: BatchReader | None) -> tuple[int, int, int]:
    return (0, 0, 0) if reader is None else (reader.calls, reader.flattened, reader.masks)


def count_documents_targets(trainer: Any) -> Callable[[], None] | None:
    """Make the Trainer's ``num_items_in_batch`` count each document's own targets, as the attached path trains.

    Args:
        trainer: the transformers ``Trainer`` axolotl built.

    Returns:
        What undoes it, or None where this transformers has no ``_get_num_items_in_batch`` (nothing changed).

    Example::

        >>> undo = count_documents_targets(trainer)
        >>> undo()                  # the Trainer's own count again
    """
    original: Callable[..., Any] | None = getattr(trainer, "_get_num_items_in_batch", None)
    if original is None:
        return None
    own = vars(trainer).get("_get_num_items_in_batch")  # an instance's own, put back as it was

    def counted(batch_samples: list, device: Any) -> Any:
        return original([document_targets(b) for b in batch_samples], device)

    def undo() -> None:
        if own is None:
            vars(trainer).pop("_get_num_items_in_batch", None)
        else:
            trainer._get_num_items_in_batch = own

    trainer._get_num_items_in_batch = counted
    return undo


def undone_after_train(trainer: Any, undo: Callable[[], None]) -> None:
    """``trainer.train`` calls ``undo`` when it returns or raises, then is the Trainer's own again.

    Args:
        trainer: the transformers ``Trainer`` axolotl built.
        undo: takes off what the plugin put on (the batch reader's hooks, the target count).

    Example::

        >>> undone_after_train(trainer, reader.remove)
        >>> trainer.train()         # the reader's hooks are off after it, even when it raises
    """
    train = trainer.train

    def train_then_undo(*args: Any, **kwargs: Any) -> Any:
        try:
            return train(*args, **kwargs)
        finally:
            vars(trainer).pop("train", None)
            undo()

    trainer.train = train_then_undo


class RunReport(TrainerCallback):
    """After the callbacks of :func:`~foundry_attn.integrations.hf_trainer.install`: an ``attn_axolotl`` event at train
    begin and, after the first step, the proof on the training batch in axolotl's log."""

    def __init__(self, plugin: FoundryAttnPlugin, session: Any) -> None:
        self.plugin, self.session = plugin, session
        self._said = False

    @override
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Write the ``attn_axolotl`` event."""
        events = getattr(self.session, "events", None)
        if events is not None:
            events.append("attn_axolotl", **self.plugin.summary())

    @override
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """After the first step, say what the proof on the training batch found."""
        path = self.plugin.state
        if self._said or path is None:
            return
        self._said = True
        proof = path.proofs[-1][1].describe() if path.proofs else "none"
        LOG.info(
            "foundry_attn: step %d: path %s, proven on the training batch: %s; last proof: %s; packed batches read: %d "
            "(%d flattened from several rows, %d with a document mask)",
            state.global_step,
            path.path,
            self.plugin.proven_in_training(),
            proof,
            *_counts(self.plugin.reader),
        )
        events = getattr(self.session, "events", None)
        if events is not None:
            events.append("attn_axolotl", at="first_step", **self.plugin.summary())


class FoundryAttnPlugin(_axolotl_base()):  # type: ignore[misc]  # a base chosen at import
    """foundry_attn for axolotl: the fallback chain and its reason per rank, the flat path proven on the batch that
    trains, axolotl's packed batches read as they are, and the Trainer callbacks (``attn/*`` in every logger, the
    inspector's verdict, the events file). axolotl calls ``register``, ``pre_model_load`` (refusals),
    ``post_model_load`` (``attach``, after LoRA), ``post_trainer_create`` (callbacks, batch reader, target count) and
    ``post_train``; lines go to axolotl's log (``axolotl.integrations.foundry_attn``, at its INFO level).

        plugins:
          - foundry_attn.integrations.axolotl.FoundryAttnPlugin
        foundry_attn_backend: auto      # keys: foundry_attn.integrations.axolotl.args.FoundryAttnArgs
    """

    def __init__(self) -> None:
        super().__init__()
        self.state: Any = None
        self.attach_proofs = 0
        self.varlen = False  # axolotl's sdpa_varlen patch was on when the model was attached
        self.reader: BatchReader | None = None
        self.counted = self.reported = False
        self.cfg: Any = None

    @override
    def get_input_args(self) -> str:
        """The dotted path of the pydantic model of the plugin's YAML keys (:class:`~.args.FoundryAttnArgs`)."""
        return "foundry_attn.integrations.axolotl.args.FoundryAttnArgs"

    @override
    def register(self, cfg: dict) -> None:
        """Say the plugin loaded (axolotl skips a plugin whose module fails to import with only an error line)."""
        LOG.info("foundry_attn %s: axolotl plugin loaded (%s)", version("foundry-attn"), ENTRY)

    @override
    def pre_model_load(self, cfg: Any) -> None:
        """Refuse again what ``FoundryAttnArgs`` refuses, for a config that skipped axolotl's validation."""
        self.cfg = cfg
        why = refusal(cfg)
        if why is not None:
            raise ValueError(f"foundry_attn (axolotl plugin): {why}")

    @override
    def post_model_load(self, cfg: Any, model: Any) -> None:
        """``attach`` the loaded model (LoRA included), the backend named checked first; say what runs."""
        self.cfg = cfg
        backend = cfg.get("foundry_attn_backend") or cfg.get("attn_implementation")
        strict = bool(cfg.get("foundry_attn_strict"))
        attached, chain = runs_here(model, backend, strict)  # install, device, dtype: before any proof
        with speaking(AXOLOTL):  # every "Fix:" names axolotl's keys, the path's state keeps them for later proofs
            self.state = attach(
                model,
                attached,
                path=FLAT if strict else AUTO_PATH,
                fallback=chain,
                strict=strict,
                interval=int(_given(cfg, "foundry_attn_proof_interval")),
                capacity=int(_given(cfg, "foundry_attn_capacity")),
                execution=str(_given(cfg, "foundry_attn_execution")),
            )
        self.attach_proofs = len(self.state.proofs)
        self.varlen = sdpa_varlen_on()
        decision = self.state.decision
        LOG.log(
            logging.WARNING if decision is not None and decision.fell_back else logging.INFO,
            "foundry_attn: attention %s (asked %s%s); path %s (%s)",
            self.state.backend,
            backend or "the model's own",
            f"; {decision.reason}" if decision is not None and decision.reason else "",
            self.state.path,
            self.state.reason,
        )
        LOG.info(
            "foundry_attn: axolotl attn_implementation %s, sdpa_varlen patch %s; what runs: %s",
            cfg.get("attn_implementation"),
            "on" if self.varlen else "off",
            what_ran(self.state, self.varlen),
        )

    @override
    def post_trainer_create(self, cfg: Any, trainer: Any) -> None:
        """The Trainer callbacks, the packed-batch reader and the Trainer's target count, undone after train."""
        options = {key: cfg.get(f"foundry_attn_{key}") for key in ("events_dir", "log_interval", "verdict_interval")}
        added = install(trainer, **{k: v for k, v in options.items() if v is not None})  # else install's defaults
        trainer.add_callback(RunReport(self, getattr(added[0], "session", None)))
        if self.state is not None:
            reader = self.reader = BatchReader(trainer.model)
            uncount = count_documents_targets(trainer)
            self.counted = uncount is not None
            if uncount is None:
                LOG.warning(
                    "foundry_attn: this transformers has no Trainer._get_num_items_in_batch; the loss divides by "
                    "axolotl's target count, which counts each document's first token as a target"
                )

            def undo() -> None:
                reader.remove()
                if uncount is not None:
                    uncount()

            undone_after_train(trainer, undo)

    @override
    def post_train(self, cfg: Any, model: Any) -> None:
        """Take the reader off and say what ran (once)."""
        if self.reader is not None:
            self.reader.remove()
        if self.state is not None and not self.reported:  # axolotl may call post_train twice
            self.reported = True
            LOG.info("foundry_attn: trained with %s; %s", what_ran(self.state, self.varlen), self.summary()["proof"])

    def proven_in_training(self) -> bool:
        """Whether every proof since ``attach`` passed, and there is one (the path proven on a training batch).

        Returns:
            True once a proof ran on a batch that trains and every one of them held.

        Example::

            >>> plugin.proven_in_training()     # after the first step
            True
        """
        proofs = [] if self.state is None else self.state.proofs[self.attach_proofs :]
        return bool(proofs) and all(proof.ok for _, proof in proofs)

    def summary(self) -> dict[str, Any]:
        """What the ``attn_axolotl`` event records.

        Returns:
            axolotl's settings, sdpa_varlen, the backend, path and proof, what runs, the batches read.

        Example::

            >>> plugin.summary()["ran"]
            "foundry_sdpa (foundry_attn's sdpa per document, ...); one flat row"
        """
        import axolotl

        cfg, state = self.cfg or {}, self.state
        read, flattened, masks = _counts(self.reader)
        return {
            "axolotl": getattr(axolotl, "__version__", "?"),
            "attn_implementation": cfg.get("attn_implementation"),
            "foundry_attn_backend": cfg.get("foundry_attn_backend"),
            "sample_packing": bool(cfg.get("sample_packing")),
            "sdpa_varlen": self.varlen,
            "backend": None if state is None else state.backend,
            "path": None if state is None else state.path,
            "ran": None if state is None else what_ran(state, self.varlen),
            "proven_on_batch": self.proven_in_training(),
            "proof": "no proof" if state is None or not state.proofs else state.proofs[-1][1].describe(),
            "packed_batches": read,
            "flattened": flattened,
            "document_masks": masks,
            "targets_counted_per_document": self.counted,
        }
