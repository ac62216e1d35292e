"""What the examples of ``foundry_attn/observe`` use: a stock tiny Llama, a padded batch and what a forward of it
recorded, a flash-attention model run on the reference kernel, and a run's event logs written into the block's folder.

``llama_model`` here is the tiny Llama as transformers builds it (sdpa, not attached: the verdict's "stock sdpa");
``hf_model`` / ``model`` stay ``common``'s attached one.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from foundry_attn.attention import fa2_reference
from tests.examples import common

#: the run the fleet and report examples read: 8 ranks launched twice; in the first launch ranks 3 and 7 ran on
#: Tesla T4s and fell back to sdpa, in the second every rank ran flash_attention_2 on an A100
RUN, RANKS = "my-run", 8
LAUNCHES = (("5f0c2a9e81d3", "2026-11-21T22:00:00"), ("b7e41d06c9a2", "2026-11-22T06:00:00"))
T4_RANKS = (3, 7)


def stock(tmp: Path) -> torch.nn.Module:
    """The tiny Llama on sdpa, as transformers builds it (not attached)."""
    return common.tiny_llama()


def mask(tmp: Path) -> torch.Tensor:
    """``[2, 8]`` attention mask: row 1 ends in two padding tokens (14 real tokens)."""
    out = torch.ones(2, 8, dtype=torch.long)
    out[1, 6:] = 0
    return out


def padded(tmp: Path) -> dict[str, torch.Tensor]:
    """``common``'s ``ids`` with :func:`mask`: rows of 8 and 6 real tokens."""
    return {"input_ids": common.ids(tmp), "attention_mask": mask(tmp)}


def records(tmp: Path) -> list[dict[str, Any]]:
    """What :class:`~foundry_attn.observe.probe.ModelInspector` recorded of the stock Llama's forward of
    :func:`padded`."""
    from foundry_attn.observe.probe import BatchInfo, ModelInspector

    model, batch = stock(tmp), padded(tmp)
    with torch.no_grad(), ModelInspector(model).capture(BatchInfo.from_batch(batch)) as out:
        model(**batch)
    return out


def fa2_model(tmp: Path) -> torch.nn.Module:
    """The tiny Llama on ``flash_attention_2`` (set on its config); on a CPU it runs under ``reference_flash_attn()``
    only."""
    return common.tiny_llama("flash_attention_2")


def tracer(tmp: Path) -> Any:
    """A :class:`~foundry_attn.observe.flash_calls.FlashCallTracer` after :func:`fa2_model`'s forward of
    :func:`padded` on the reference kernel (detached)."""
    from foundry_attn.observe.flash_calls import FlashCallTracer

    model = fa2_model(tmp)
    with FlashCallTracer() as out, fa2_reference.reference_flash_attn(), torch.no_grad():
        model(**padded(tmp))
    return out


def mpt_model(tmp: Path) -> torch.nn.Module:
    """What :func:`~foundry_attn.observe.discovery.mpt_attn_impl` reads of LLM-Foundry's MPT: a config whose
    ``attn_config`` says ``attn_impl: flash`` (MPT itself comes with the ``[foundry]`` extra, not on 5.x's stack)."""
    from transformers import PretrainedConfig

    model = torch.nn.Module()
    model.config = PretrainedConfig(attn_config={"attn_impl": "flash", "attn_uses_sequence_id": False})
    return model


def dropout_llama(tmp: Path) -> torch.nn.Module:
    """The tiny Llama with ``attention_dropout=0.1``."""
    from tests.conftest import make_llama

    return make_llama("sdpa", 0, attention_dropout=0.1)


def _capability(device: str, sm: tuple[int, int], host: str) -> Any:
    from foundry_attn.selection.capability import Capability

    return Capability(True, device, sm, "2.7.0", "4.51.3", "2.7.4", None, None, host, "2.7.4")


def runs(tmp: Path) -> Path:
    """``Path("runs")``, a tree of runs in the block's folder: ``runs/my-run/attn_events`` holds :data:`RANKS` ranks'
    event logs over the :data:`LAUNCHES` (written once per block)."""
    from foundry_attn.observe.events import EventLog

    folder = tmp / "runs" / RUN / "attn_events"
    if folder.exists():
        return Path("runs")
    for i, (launch, at) in enumerate(LAUNCHES):
        start = datetime.datetime.fromisoformat(at).replace(tzinfo=datetime.UTC).timestamp()
        for rank in range(RANKS):
            fell_back = i == 0 and rank in T4_RANKS
            device = ("Tesla T4", (7, 5)) if fell_back else ("NVIDIA A100-SXM4-80GB", (8, 0))
            cap = _capability(*device, host=f"node-{rank // 4}")
            log = EventLog(folder, rank, cap=cap, run=RUN, launch=launch)
            log.append(
                "attn_impl",
                requested="flash_attention_2",
                chosen="sdpa" if fell_back else "flash_attention_2",
                fell_back=fell_back,
                reason=f"flash_attention_2: {cap.device_name} {cap.sm} < 8.0"
                if fell_back
                else f"flash-attn 2.7.4 on {cap.device_name} {cap.sm}",
                time=start + rank / 10,
            )
            if i == 1 and rank == 0:
                batch = {"shape": [8, 2048], "real_tokens": 15565, "fill_ratio": 0.95}
                log.append("attn_inspect", step=0, batch=batch, time=start + 30)
                log.append("attn_verdict", step=0, state="isolated", time=start + 31)
                counts = {"upad": 0, "posids": 0, "varlen": 24, "dense": 0, "pad": 0}
                log.append("upad_trace", step=0, counts=counts, entry="varlen", time=start + 32)
    return Path("runs")


def decided(tmp: Path) -> list[dict[str, Any]]:
    """Every rank's decision of every launch of :func:`runs` (:func:`~foundry_attn.observe.fleet.decisions`)."""
    from foundry_attn.observe import fleet

    runs(tmp)
    return fleet.decisions(fleet.events(fleet.files(tmp / "runs" / RUN)))


def inspector(tmp: Path) -> Any:
    """The Trainer's ``attention_inspector`` after one inspected step of :func:`padded` on the stock Llama."""
    from foundry_attn.integrations.hf_trainer.attention_inspector import AttentionInspector
    from foundry_attn.observe.probe import BatchInfo
    from foundry_attn.observe.verdict import fix_for, judge

    out = AttentionInspector(print_table=False)
    model, batch = stock(tmp), padded(tmp)
    out.core.inspected(0, records(tmp), BatchInfo.from_batch(batch), "model", "sdpa")
    out.core.judged(0, judge(model, batch, None), fix_for(model))
    return out


NAMES: dict[str, Callable[[Path], Any]] = {
    "llama_model": stock,
    "mask": mask,
    "padded": padded,
    "records": records,
    "fa2_model": fa2_model,
    "reference_flash_attn": lambda tmp: fa2_reference.reference_flash_attn,
    "tracer": tracer,
    "mpt_model": mpt_model,
    "dropout_llama": dropout_llama,
    "runs": runs,
    "decided": decided,
    "inspector": inspector,
}
