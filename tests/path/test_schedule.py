"""The proof schedule's code fingerprint, read per batch: what the flat path's exactness rests on changes it (a
forward patched on an instance or on a class, HF checkpointing switched on or off, a module's class swapped, a
function behind the dispatch replaced); anything else set on a module does not."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from foundry_attn.path.attach import attach
from foundry_attn.verify import conformance


def _patch_instance(model: Any) -> None:
    layer = model.model.layers[0].mlp
    layer.forward = lambda x: type(layer).forward(layer, x)


def _patch_class(model: Any) -> None:
    klass = type(model.model.layers[0].mlp)
    original = klass.forward
    klass.forward = lambda self, x: original(self, x)
    _RESTORE.append(lambda: setattr(klass, "forward", original))


def _checkpointing(model: Any) -> None:
    model.gradient_checkpointing_enable()


def _checkpointing_off(model: Any) -> None:
    model.gradient_checkpointing_disable()


def _class_swap(model: Any) -> None:
    norm = model.model.norm
    norm.__class__ = type("Swapped", (type(norm),), {})


def _dispatch(model: Any) -> None:
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface._global_mapping["sdpa"] = lambda *a, **k: None


_RESTORE: list[Callable[[], Any]] = []

CHANGES: dict[str, Callable[[Any], None]] = {
    "an instance forward": _patch_instance,
    "a class forward": _patch_class,
    "HF checkpointing on": _checkpointing,
    "HF checkpointing off": _checkpointing_off,
    "a class swap": _class_swap,
    "the dispatch": _dispatch,
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_what_exactness_rests_on_changes_the_fingerprint(change: str) -> None:
    from transformers.modeling_utils import AttentionInterface

    model = conformance.build("llama", "sdpa")
    if change == "HF checkpointing off":
        model.gradient_checkpointing_enable()
    state = attach(model, "sdpa", prove_now=False)
    state.schedule.watch(model, state.names)
    before = state.schedule.fingerprint(state.names)
    saved = dict(AttentionInterface._global_mapping)
    try:
        CHANGES[change](model)
        assert state.schedule.fingerprint(state.names) != before, change
    finally:
        AttentionInterface._global_mapping.clear()
        AttentionInterface._global_mapping.update(saved)
        while _RESTORE:
            _RESTORE.pop()()


def test_other_attributes_and_a_training_step_leave_it() -> None:
    model = conformance.build("llama", "sdpa")
    state = attach(model, "sdpa", prove_now=False)
    state.schedule.watch(model, state.names)
    before = state.schedule.fingerprint(state.names)
    model.model.layers[0].note = "a user's attribute"
    model.eval()
    model.train()
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    assert state.schedule.fingerprint(state.names) == before
