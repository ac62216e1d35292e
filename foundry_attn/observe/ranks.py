"""Every rank's attention, said once for both glues: one launch id for all ranks, each rank's decision in its
event log and its log line, every rank's gathered into one line on rank 0.

    launch = launch_id()                                   # rank 0's, broadcast: the same on every rank
    summary = announce(decision_of(hf), events, rank, log) # the attn_impl event, the rank's line, the all-rank line

Collectives run only where ``torch.distributed`` is initialized (Composer's launcher and the Trainer's both
initialize it); a single process is rank 0 of 1. Core module: torch only.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from foundry_attn.attention.fa2_reference import REFERENCE_NAME
from foundry_attn.observe.events import EventLog


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def launch_id() -> str:
    """One id for every rank of this launch: rank 0's, broadcast (a collective: every rank calls it).

    Returns:
        12 hex digits.

    Example::

        >>> log = EventLog("attn_events", rank=0, launch=launch_id())  # every rank calls launch_id()
        >>> len(log.append("attn_impl", chosen="sdpa")["launch"])
        12
    """
    launch = [uuid.uuid4().hex[:12]]
    if _distributed():
        torch.distributed.broadcast_object_list(launch, src=0)
    return launch[0]


def gather(info: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``info``, in rank order (a collective: every rank calls it).

    Args:
        info: this rank's, picklable.

    Returns:
        One per rank; ``[info]`` in a single process.

    Example::

        >>> gather({"rank": 0, "chosen": "sdpa"})
        [{'rank': 0, 'chosen': 'sdpa'}]
    """
    if not _distributed():
        return [info]
    everyone: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, info)
    return everyone


def announce(info: dict[str, Any], events: EventLog, rank: int, log: logging.Logger, **about: Any) -> str:
    """Say this rank's decision (the ``attn_impl`` event and a log line, a warning where it fell back, runs the
    reference kernel or carries a warning), gather every rank's, and log one line for all on rank 0 (a warning where
    any fell back).

    Args:
        info: ``Decision.as_dict()`` of this rank (:func:`foundry_attn.observe.discovery.decision_of`).
        events: this rank's event log.
        rank: this rank's global rank.
        log: the glue's logger (its records keep the glue's name).
        **about: gathered beside the decision (``device_name``, ``sm``).

    Returns:
        The one line over every rank (:func:`summarize_ranks`), the same on every rank.

    Example::

        >>> from foundry_attn.observe.discovery import decision_of
        >>> events = EventLog("attn_events", rank=0)
        >>> announce(decision_of(hf_model), events, rank=0, log=logging.getLogger("my_glue"))  # attached on sdpa
        'attention: 1/1 ranks sdpa; path flat'
    """
    reference = info["reason"].startswith(REFERENCE_NAME)
    where = f" on {about['device_name']} ({about['sm']})" if "device_name" in about and "sm" in about else ""
    log.log(
        logging.WARNING if info["fell_back"] or reference else logging.INFO,
        "attention rank %d%s: requested %s, chose %s (%s); path %s (%s)",
        rank,
        where,
        info["requested"],
        info["chosen"],
        info["reason"],
        info["path"] or "-",
        info["path_reason"] or "-",
    )
    if info.get("warning"):
        log.warning("attention rank %d: %s kept, but: %s", rank, info["chosen"], info["warning"])
    if reference:
        log.warning(
            "attention: flash_attention_2 runs on the pure-PyTorch REFERENCE kernel, not flash-attn "
            "(fa2_reference_kernel: true). Use it for tests and diagnosis only."
        )
    events.append("attn_impl", **info)
    gathered = gather({"rank": rank, **about, **info})
    summary = summarize_ranks(gathered)
    if rank == 0:
        loud = any(d["fell_back"] for d in gathered) or REFERENCE_NAME in summary
        log.log(logging.WARNING if loud else logging.INFO, summary)
    return summary


def summarize_ranks(decisions: Sequence[dict]) -> str:
    """One line over every rank's decision, for rank 0.

    Args:
        decisions: ``Decision.as_dict()`` results with a ``rank`` key, one per rank (:func:`gather`).

    Returns:
        The line: the implementations by count, the ranks that fell back and why, the path.

    Example::

        >>> a100 = {"chosen": "flash_attention_2", "fell_back": False, "reason": "flash-attn 2.7.4 on NVIDIA A100 sm80"}
        >>> t4 = {"chosen": "sdpa", "fell_back": True, "reason": "flash_attention_2: Tesla T4 sm75 < 8.0"}
        >>> summarize_ranks([{"rank": r, **(t4 if r in (3, 7) else a100)} for r in range(8)])  # gather()'s, on 8 ranks
        'attention: 6/8 ranks flash_attention_2, 2/8 sdpa; 2/8 fell back (rank 3, rank 7: Tesla T4 sm75 < 8.0)'
    """
    n = len(decisions)
    counts: dict[str, int] = {}
    reasons: dict[str, list[int]] = {}
    for d in sorted(decisions, key=lambda d: d["rank"]):
        counts[d["chosen"]] = counts.get(d["chosen"], 0) + 1
        if d["fell_back"]:
            reasons.setdefault(d["reason"].split(": ", 1)[-1], []).append(d["rank"])
        elif d["reason"].startswith(REFERENCE_NAME):  # never let the reference kernel pass for flash-attn
            reasons.setdefault(REFERENCE_NAME, []).append(d["rank"])
    parts = [
        f"{c}/{n} {'ranks ' if i == 0 else ''}{impl}"
        for i, (impl, c) in enumerate(sorted(counts.items(), key=lambda kv: -kv[1]))
    ]
    fell = sum(1 for d in decisions if d["fell_back"])
    detail = "; ".join(f"{', '.join(f'rank {r}' for r in ranks)}: {why}" for why, ranks in reasons.items())
    rows = sorted(d["rank"] for d in decisions if d.get("path") == "rows")
    path = (
        f"; path rows on {len(rows)}/{n} ({', '.join(f'rank {r}' for r in rows[:8])}: one document per row)"
        if rows
        else "; path flat"
        if any(d.get("path") == "flat" for d in decisions)
        else ""
    )
    return (
        f"attention: {', '.join(parts)}"
        + (f"; {fell}/{n} fell back" if fell else "")
        + (f" ({detail})" if detail else "")
        + path
    )
