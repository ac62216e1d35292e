"""How ``foundry-attn bench gpu`` judges and reports its numbers: the loss agreement, the targets, the text summary.

:func:`agreement`: every document-exact tier's loss against ``sdpa_per_document``'s; :func:`targets`: ours (the faster
ours tier that agrees) against ``padded_dense`` on ``a_report`` and ``b_no_padding``; :func:`summary`: the report
without ``--json``. The measuring is :mod:`foundry_attn.bench.gpu`'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

BASELINE, REFERENCE = "padded_dense", "sdpa_per_document"
OURS = ("ours_torch_varlen", "ours_torch_varlen_capacity", "ours_flash_attn")
TARGETS: dict[str, tuple[str, float]] = {
    "a_report": ("ours_vs_padded_dense_a_report", 3.0),
    "b_no_padding": ("ours_vs_padded_dense_b_no_padding", 0.97),
}


def agreement(losses: Mapping[str, float], exact: Mapping[str, bool], dtype: str) -> dict[str, Any]:
    """Every tier's loss against the reference tier's (relative); only document-exact tiers are checked."""
    tol = 1e-4 if dtype == "float32" else 2e-2
    ref = REFERENCE if REFERENCE in losses else next((n for n in losses if exact[n]), None)
    if ref is None:
        return {"ok": False, "reference": None, "tolerance": tol, "rel_diff": {}, "checked": []}
    rel = {n: abs(loss - losses[ref]) / max(abs(losses[ref]), 1e-12) for n, loss in losses.items()}
    checked = [n for n in losses if exact[n] and n != ref]
    return {
        "ok": all(math.isfinite(rel[n]) and rel[n] <= tol for n in checked) and math.isfinite(losses[ref]),
        "reference": ref,
        "tolerance": tol,
        "rel_diff": rel,
        "checked": checked,
        "not_checked": {
            n: "attends across documents in a row (stock 2-D mask / no mask)" for n in losses if not exact[n]
        },
    }


def targets(batches: Mapping[str, Any], gpu: bool) -> dict[str, Any]:
    """Ours (the faster ours tier that agrees) against padded_dense, with stock_unpad_per_layer and stock padding-free
    beside it."""
    out = {}
    for batch_name, (name, target) in TARGETS.items():
        batch = batches[batch_name]
        agree = batch["loss_agreement"]
        values = {t: batch["tiers"][t].get("ratio_vs_padded_dense") for t in OURS}
        ok = {
            t: v
            for t, v in values.items()
            if v is not None and t in agree["checked"] and agree["rel_diff"][t] <= agree["tolerance"]
        }
        best = max(ok, key=ok.__getitem__) if ok else None
        out[name] = {
            "target": target,
            "value": ok[best] if best else None,
            "tier": best,
            "values": values,
            "stock_unpad_per_layer": batch["tiers"]["stock_unpad_per_layer"].get("ratio_vs_padded_dense"),
            "stock_padding_free": batch["tiers"]["stock_padding_free"].get("ratio_vs_padded_dense"),
            "limit": batch["limit_vs_padded_dense"],
            "met": (best is not None and ok[best] >= target) if gpu else None,
        }
    return out


def summary(result: Mapping[str, Any]) -> str:
    """The human-readable report (without ``--json``)."""
    if "skipped" in result:
        return result["skipped"]
    m = result["machine"]
    s = result["settings"]
    lines = [
        f"foundry-attn bench gpu: {m['device_name']}, torch {result['torch']}, transformers "
        f"{result['transformers']}, {s['dtype']}, {s['layers']} layers, vocab {s['vocab']}, "
        f"{s['rounds']} rounds"
    ]
    if result["note"]:
        lines.append(f"NOTE: {result['note']}")
    for name, tier in result["tiers"].items():
        lines.append(f"  {name:<22} {tier['kernel'] if tier['runs'] else 'skipped: ' + tier['skipped']}")
    for batch in result["batches"].values():
        lines.append("")
        lines.append(
            f"{batch['title']}: {batch['real_tokens']} real tokens of {batch['positions']} "
            f"(fill {batch['fill']:.1%}, limit {batch['limit_vs_padded_dense']:.2f}x)"
        )
        lines.append(f"  {'tier':<22} {'tokens/s':>10} {'step ms':>9} {'peak MB':>9} {'vs padded':>9} {'loss':>9}")
        for name, r in batch["tiers"].items():
            if "skipped" in r:
                lines.append(f"  {name:<22} skipped: {r['skipped'][:100]}")
                continue
            ratio = r["ratio_vs_padded_dense"]
            shown = f"{ratio:>8.2f}x" if ratio is not None else f"{'n/a':>9}"
            lines.append(
                f"  {name:<22} {r['tokens_per_s']:>10.0f} {r['step_ms']:>9.1f} {r['peak_mem_mb']:>9.0f} "
                f"{shown} {r['loss']:>9.4f}{'' if r['document_exact'] else ' (cross-doc)'}"
            )
        agree = batch["loss_agreement"]
        worst = max((agree["rel_diff"][n] for n in agree["checked"]), default=0.0)
        lines.append(
            f"  losses vs {agree['reference']}: {'agree' if agree['ok'] else 'DISAGREE'} "
            f"(worst relative diff {worst:.1e}, tolerance {agree['tolerance']:g})"
        )
    lines.append("")
    for name, t in result["targets"].items():
        verdict = "n/a (not a GPU run)" if t["met"] is None else ("PASS" if t["met"] else "FAIL")
        value = f"{t['value']:.2f}x ({t['tier']})" if t["value"] is not None else "no ours tier agreed"
        stock = t["stock_unpad_per_layer"]
        lines.append(
            f"{name}: {value} >= {t['target']}x: {verdict}; stock_unpad_per_layer "
            f"{f'{stock:.2f}x' if stock is not None else 'n/a'}; limit {t['limit']:.2f}x"
        )
    return "\n".join(lines)
