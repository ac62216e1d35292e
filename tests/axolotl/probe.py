"""A test's own axolotl plugin (real axolotl, no stand-in): it records the first training step as the Trainer runs it.

    plugins:
      - tests.axolotl.probe.FirstStepProbe        # first: its pre_model_load runs before foundry_attn's
      - foundry_attn.integrations.axolotl.FoundryAttnPlugin

``FOUNDRY_ATTN_PROBE_OUT``: where the record goes (``torch.save``: the batch the Trainer handed ``compute_loss``, the
loss it returned, every parameter's gradient before the optimizer step; at train end, each step's seconds, real
tokens, positions and CPU seconds, and the process's peak RSS during training, read from ``/proc`` after resetting it).
``FOUNDRY_ATTN_PROBE_SDPA_VARLEN=1``: apply axolotl's own ``patch_sdpa_varlen`` before the model loads (axolotl
applies it by itself only on CUDA with fp16/bf16; on a CPU its wrapper falls back to stock sdpa with its
block-diagonal mask, as it does on a GPU for fp32).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from axolotl.integrations.base import BasePlugin
from transformers import TrainerCallback

from foundry_attn.flat.layout import padding_spans


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


def _status(field: str) -> float | None:
    """``/proc/self/status``'s ``field`` (``VmRSS``, ``VmHWM``) in MiB, or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) / 1024


class _Steps(TrainerCallback):
    """Each step's wall and CPU time, and the process's peak RSS over training (the peak is reset at train begin)."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record
        self.began = self.cpu = 0.0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        except OSError:
            pass
        self.record.update(steps=[], rss_at_train_begin_mib=_status("VmRSS"))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.began, self.cpu = time.perf_counter(), time.process_time()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        tokens = self.record.pop("step_tokens", (0, 0))
        self.record["steps"].append((time.perf_counter() - self.began, *tokens, time.process_time() - self.cpu))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.record["peak_rss_mib"] = _status("VmHWM")
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
            real, positions = record.get("step_tokens", (0, 0))
            pads = sum(e - s for _, s, e in padding_spans(batch))
            record["step_tokens"] = (real + batch["input_ids"].numel() - pads, positions + batch["input_ids"].numel())
            out = original(model, inputs, *args, **kwargs)
            if first:
                loss = out[0] if isinstance(out, tuple) else out
                record.update(batch=batch, loss=loss.item(), num_items=kwargs.get("num_items_in_batch"))
            return out

        trainer.compute_loss = compute_loss
        trainer.add_callback(_Grads(record, trainer.model))
        trainer.add_callback(_Steps(record))
