"""What our callbacks share: finding the models inside ``state.model``, events, one-time notices.

Composer glue; the attention-specific probes live in ``inspector``, ``upad_tracer`` and ``decision``.
"""

from __future__ import annotations

import logging
from typing import Any

from composer.core import Callback, State
from composer.utils import dist
from torch import nn

from foundry_attn.adapters import backend_of
from foundry_attn.events import EventLog, default_events_dir

log = logging.getLogger(__name__)
_WRAPPER_SEGMENTS = frozenset({"module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def foundry_model(model: Any) -> Any:
    """The ``foundry_attn_causal_lm`` inside ``state.model`` (also through DDP's ``.module``), or None."""
    for candidate in (model, getattr(model, "module", None)):
        if candidate is not None and getattr(candidate, "attn_decision", None) is not None:
            return candidate
    return None


def clean_name(name: str) -> str:
    """A module path without DDP / FSDP / checkpoint / compile wrapper segments (``module.``, ...)."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_SEGMENTS)


def check_log_interval(owner: str, log_interval: Any) -> int:
    """``log_interval`` must be an integer >= 1 (batches)."""
    if isinstance(log_interval, bool) or not isinstance(log_interval, int) or log_interval < 1:
        raise ValueError(f"{owner}: log_interval must be an integer >= 1 (batches between samples; the first "
                         f"batch is always sampled), got {log_interval!r}")
    return log_interval


def open_event_log(state: State, events_dir: str | None) -> EventLog:
    """The callback's event log: ``events_dir`` if set, else the registered model's own events folder
    (``foundry_attn_causal_lm``'s ``events_dir``), else ``default_events_dir(run_name)``."""
    ours = foundry_model(state.model)
    if ours is not None and not ours.attn_events.bound:  # the model's log waited for the run's name
        ours.attn_events.bind(default_events_dir(state.run_name), run=state.run_name)
    directory = events_dir or (ours.attn_events.directory if ours is not None else default_events_dir(state.run_name))
    return EventLog(directory, dist.get_global_rank(), ours.attn_capability if ours is not None else None)


def _is_hf_model(module: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(module, PreTrainedModel)


def find_hf_model(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The outermost Hugging Face ``PreTrainedModel`` inside ``model`` (Composer, DDP, FSDP wrappers)."""
    for name, module in model.named_modules():
        if _is_hf_model(module):
            return clean_name(name), module
    return None


def attn_implementation(module: nn.Module | None) -> str | None:
    """The attention backend of a Hugging Face model (``sdpa`` for our ``foundry_sdpa``), or None."""
    config = getattr(module, "config", None)
    return backend_of(getattr(config, "_attn_implementation", None))



def compiled(model: Any) -> bool:
    """Whether ``model`` runs under ``torch.compile``: wrapped (``torch.compile(model)``) or with its forward
    compiled in place (what Composer does for ``compile_config``)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(model, OptimizedModule) or hasattr(getattr(model, "forward", None), "_torchdynamo_orig_callable")


COMPILED = ("{owner}: the model runs under torch.compile (compile_config); per-call hooks and patches inside a "
            "compiled graph would break or change it, so {owner} steps aside for this run; training goes on")


def say_once(said: set[str], key: str, message: str) -> bool:
    """Log ``message`` (and print it on rank 0) the first time ``key`` comes; True when it was said now."""
    if key in said:
        return False
    said.add(key)
    log.warning(message)
    if dist.get_global_rank() == 0:
        print(message, flush=True)
    return True


class ReleasingCallback(Callback):
    """A callback whose hooks/patches are undone at ``FIT_END``, at ``close`` and after it, even when training
    raised (Composer calls ``close`` then). Subclasses implement ``release``, idempotently."""

    def release(self) -> None:
        raise NotImplementedError

    def fit_end(self, state: State, logger: Any) -> None:
        self.release()

    def close(self, state: State, logger: Any) -> None:
        self.release()

    def post_close(self) -> None:
        self.release()
