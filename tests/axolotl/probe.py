"""A test's own axolotl plugin (real axolotl, no stand-in): it records the first training step as the Trainer runs it.

    plugins:
      - tests.axolotl.probe.FirstStepProbe        # first: its pre_model_load runs before foundry_attn's
      - foundry_attn.integrations.axolotl.FoundryAttnPlugin

``FOUNDRY_ATTN_PROBE_OUT``: where the record goes (``torch.save``: the batch the Trainer handed ``compute_loss``, the
loss it returned, every parameter's gradient before the optimizer step). ``FOUNDRY_ATTN_PROBE_SDPA_VARLEN=1``: apply
axolotl's own ``patch_sdpa_varlen`` before the model loads (axolotl applies it by itself only on CUDA with fp16/bf16;
on a CPU its wrapper falls back to stock sdpa with its block-diagonal mask, as it does on a GPU for fp32).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from axolotl.integrations.base import BasePlugin
from transformers import TrainerCallback


class _Grads(TrainerCallback):
    def __init__(self, record: dict[str, Any], model: Any) -> None:
        self.record, self.model = record, model

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if "grads" in self.record:
            return
        self.record["grads"] = {
            name: p.grad.detach().clone() for name, p in self.model.named_parameters() if p.grad is not None
        }
        torch.save(self.record, os.environ["FOUNDRY_ATTN_PROBE_OUT"])


class FirstStepProbe(BasePlugin):  # type: ignore[misc]
    """Records the first training step (see the module)."""

    def pre_model_load(self, cfg: Any) -> None:
        if os.environ.get("FOUNDRY_ATTN_PROBE_SDPA_VARLEN") == "1":
            from axolotl.monkeypatch.attention.sdpa_varlen import patch_sdpa_varlen

            assert patch_sdpa_varlen()

    def post_trainer_create(self, cfg: Any, trainer: Any) -> None:
        record: dict[str, Any] = {}
        original = trainer.compute_loss

        def compute_loss(model: Any, inputs: dict, *args: Any, **kwargs: Any) -> Any:
            first = "loss" not in record and model.training
            batch = {k: v.detach().clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
            out = original(model, inputs, *args, **kwargs)
            if first:
                loss = out[0] if isinstance(out, tuple) else out
                record.update(batch=batch, loss=loss.item(), num_items=kwargs.get("num_items_in_batch"))
            return out

        trainer.compute_loss = compute_loss
        trainer.add_callback(_Grads(record, trainer.model))
