"""The one door between the path and the proof: the model a proof runs, handed over with the two ways of running it.

    subject = Subject(hf_model, forward=..., running=...)   # foundry_attn.path.proven.subject_of(hf_model)
    with subject.running("sdpa"):                           # a stock implementation for the block
        logits = subject.forward(input_ids=ids).logits      # the model's own forward, not what attach set on it
    prove_flat(subject, inputs, "sdpa")

The path builds it (it owns the model's forwards and implementation name); the proof runs it and reads the model's
modules and parameters through ``subject.model``. Core module: torch and transformers only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any


@dataclasses.dataclass(frozen=True)
class Subject:
    """A model as a proof runs it: ``model`` (the transformers model: its modules, parameters and config),
    ``forward(**inputs)`` (its own forward, whatever attach set on the instance) and ``running(name)`` (a context in
    which it runs the stock implementation ``name``, its own restored after)."""

    model: Any
    forward: Callable[..., Any]
    running: Callable[[str], AbstractContextManager[None]]
