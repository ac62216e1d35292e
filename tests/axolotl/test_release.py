"""What the plugin puts on the model and the Trainer for a run (the batch reader's hooks, the Trainer's target count)
comes off when ``trainer.train`` returns or raises. Runs without axolotl: the plugin's module imports without it."""

from __future__ import annotations

import pytest
import torch

from foundry_attn.integrations.axolotl.plugin import BatchReader, undone_after_train


class Raises:
    """Stands in for nothing of the stack: just an object whose ``train`` raises, as a run that fails does."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def train(self) -> None:
        raise RuntimeError("out of memory")


def test_the_reader_comes_off_when_training_raises() -> None:
    model = torch.nn.Linear(2, 2)
    trainer = Raises(model)
    reader = BatchReader(model)
    assert model._forward_pre_hooks and model._forward_hooks
    undone_after_train(trainer, reader.remove)
    with pytest.raises(RuntimeError, match="out of memory"):
        trainer.train()
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert "train" not in vars(trainer)  # the Trainer's own train again
