"""How ``foundry-attn bench gpu`` judges and reports its numbers: the loss agreement, the targets, the text summary.

:func:`agreement`: every document-exact tier's loss against ``sdpa_per_document``'s; :func:`targets`: ours at its
best (the fastest of our tiers whose loss agrees) against padded dense at its best (the fastest padded tier: eager,
compiled, graphed) and stock padding-free, and its GPU busy share (:data:`TARGETS`); :func:`summary`: the report
without ``--json``. The measuring is :mod:`foundry_attn.bench.gpu`'s. Core module: no imports beyond the standard
library.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

BASELINE, REFERENCE, STOCK_PADDING_FREE = "padded_dense", "sdpa_per_document", "stock_padding_free"
PADDED = (BASELINE, "padded_dense_compiled", "padded_dense_graphed")
DEFAULT, OURS_EAGER = "ours_default", "ours_torch_varlen"
OURS = (
    DEFAULT,
    "ours_torch_varlen",
    "ours_torch_varlen_capacity",
    "ours_torch_varlen_compiled",
    "ours_torch_varlen_graphed",
    "ours_flash_attn",
)
#: target -> (batch, ours: "best" (the fastest of OURS whose loss agrees) or a tier, what it is measured against:
#: "padded" at its best, a tier, "gpu_busy_share", or "warmup:<tier>" (its warm-up seconds over ours', at least), the
#: least ratio); SmolLM2-135M's shapes, the default
TARGETS: dict[str, tuple[str, str, str, float]] = {
    "ours_best_vs_padded_best_a_report": ("a_report", "best", "padded", 5.0),
    "ours_default_vs_padded_best_a_report": ("a_report", DEFAULT, "padded", 3.0),
    "ours_eager_vs_padded_eager_a_report": ("a_report", OURS_EAGER, BASELINE, 1.0),
    "ours_best_vs_stock_padding_free_a_report": ("a_report", "best", STOCK_PADDING_FREE, 1.0),
    "ours_default_vs_padded_best_b_no_padding": ("b_no_padding", DEFAULT, "padded", 0.95),
    "ours_default_warmup_vs_padded_graphed_a_report": ("a_report", DEFAULT, "warmup:padded_dense_graphed", 1.0),
    "ours_best_gpu_busy_share_a_report": ("a_report", "best", "gpu_busy_share", 0.70),
}
#: per ``--shape``: Llama-3.2-1B's, where the GPU sets the pace and unpadding's 8.8x less work should show
TARGETS_BY_SHAPE: dict[str, dict[str, tuple[str, str, str, float]]] = {
    "smollm2-135m": TARGETS,
    "llama-3.2-1b": {
        "ours_default_vs_padded_best_a_report": ("a_report", DEFAULT, "padded", 5.0),
        "ours_eager_vs_padded_eager_a_report": ("a_report", OURS_EAGER, BASELINE, 2.5),
        "ours_default_vs_padded_best_b_no_padding": ("b_no_padding", DEFAULT, "padded", 0.95),
    },
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


def agreeing(batch: Mapping[str, Any], names: tuple[str, ...], checked: bool) -> dict[str, float]:
    """Real tokens/s of the tiers of ``names`` that ran on ``batch`` and agree with the reference (``checked``: only
    those whose loss was checked; else those not found to disagree)."""
    agree = batch["loss_agreement"]
    out = {}
    for name in names:
        result = batch["tiers"].get(name, {})
        if "tokens_per_s" not in result:
            continue
        was_checked = name in agree["checked"] or name == agree["reference"]
        if (checked and not was_checked) or (was_checked and agree["rel_diff"][name] > agree["tolerance"]):
            continue
        out[name] = result["tokens_per_s"]
    return out


def best(batch: Mapping[str, Any], names: tuple[str, ...], checked: bool) -> str | None:
    """The fastest of :func:`agreeing`, or None."""
    fast = agreeing(batch, names, checked)
    return max(fast, key=fast.__getitem__) if fast else None


def targets(batches: Mapping[str, Any], gpu: bool, shape: str = "smollm2-135m") -> dict[str, Any]:
    """Each target of ``shape`` (:data:`TARGETS_BY_SHAPE`): ours at its best (the fastest of our tiers whose loss
    agrees) or one of our tiers, against padded dense at its best (the fastest padded tier not found to disagree), a
    tier, its step's GPU busy share, or a tier's warm-up seconds. A target whose tiers did not run is not judged."""
    out = {}
    for name, (batch_name, ours_name, against, target) in TARGETS_BY_SHAPE[shape].items():
        batch = batches.get(batch_name)
        if batch is None:
            out[name] = {"target": target, "batch": batch_name, "tier": None, "value": None, "met": None}
            continue
        ours = agreeing(batch, OURS, checked=True)
        if ours_name != "best":
            ours = {ours_name: ours[ours_name]} if ours_name in ours else {}
        top = max(ours, key=ours.__getitem__) if ours else None
        entry: dict[str, Any] = {"target": target, "batch": batch_name, "tier": top}
        if against == "gpu_busy_share":
            entry["values"] = {t: batch["tiers"][t].get("gpu_busy_share") for t in ours}
            value = entry["values"][top] if top else None
        elif against.startswith("warmup:"):
            other = against.removeprefix("warmup:")
            theirs = batch["tiers"].get(other, {}).get("compile_warmup_s")
            entry["against"] = other
            entry["values"] = {t: theirs / batch["tiers"][t]["compile_warmup_s"] for t in ours if theirs}
            value = entry["values"].get(top) if top else None
        else:
            vs = best(batch, PADDED, checked=False) if against == "padded" else against
            base = batch["tiers"].get(vs or "", {}).get("tokens_per_s")
            entry["against"] = vs
            entry["values"] = {t: v / base for t, v in ours.items()} if base else {}
            value = entry["values"].get(top) if top else None
            padded = batch["tiers"].get(best(batch, PADDED, checked=False) or "", {}).get("tokens_per_s")
            entry["stock_vs_padded_best"] = {
                t: batch["tiers"][t]["tokens_per_s"] / padded
                for t in ("stock_unpad_per_layer", STOCK_PADDING_FREE)
                if padded and "tokens_per_s" in batch["tiers"].get(t, {})
            }
            entry["limit"] = batch["limit_vs_padded_dense"]
        entry["value"] = value
        needed = [t for t in (ours_name, entry.get("against")) if t not in (None, "best")]
        ran = all("tokens_per_s" in batch["tiers"].get(t, {}) for t in needed)
        entry["met"] = (value is not None and value >= target) if gpu and ran else None
        if gpu and not ran:
            entry["not_judged"] = f"not measured in this run: {', '.join(needed)}"
        out[name] = entry
    return out


def _share(value: float | None) -> str:
    return f"{value:>6.0%}" if value is not None else f"{'n/a':>6}"


def _mb(value: float | None) -> str:
    return f"{'n/a':>9}" if value is None else f"{value:>9.0f}"


def _batch_lines(batch: Mapping[str, Any]) -> list[str]:
    lines = [
        "",
        f"{batch['title']}: {batch['real_tokens']} real tokens of {batch['positions']} "
        f"(fill {batch['fill']:.1%}, limit {batch['limit_vs_padded_dense']:.2f}x)",
        f"  {'tier':<28} {'tokens/s':>10} {'step ms':>9} {'peak MB':>9} {'vs padded':>9} {'busy':>6} "
        f"{'launches':>8} {'warm-up s':>9} {'loss':>9}",
    ]
    for name, r in batch["tiers"].items():
        if "skipped" in r:
            lines.append(f"  {name:<28} skipped: {r['skipped'][:100]}")
            continue
        ratio = r["ratio_vs_padded_dense"]
        launches = r.get("launches_per_step")
        lines.append(
            f"  {name:<28} {r['tokens_per_s']:>10.0f} {r['step_ms']:>9.1f} {_mb(r['peak_mem_mb'])} "
            + (f"{ratio:>8.2f}x" if ratio is not None else f"{'n/a':>9}")
            + f" {_share(r.get('gpu_busy_share'))} {launches if launches is not None else 'n/a':>8} "
            f"{r.get('compile_warmup_s', 0.0):>9.1f} {r['loss']:>9.4f}{'' if r['document_exact'] else ' (cross-doc)'}"
        )
    agree = batch["loss_agreement"]
    worst = max((agree["rel_diff"][n] for n in agree["checked"]), default=0.0)
    lines.append(
        f"  losses vs {agree['reference']}: {'agree' if agree['ok'] else 'DISAGREE'} "
        f"(worst relative diff {worst:.1e}, tolerance {agree['tolerance']:g})"
    )
    return lines


def _equal_memory_lines(section: Mapping[str, Any]) -> list[str]:
    if "skipped" in section:
        return ["", f"equal memory: skipped: {section['skipped']}"]
    lines = [
        "",
        f"equal memory: k x {section['batch']} in {section['budget_mb']:.0f} MB (k <= {section['cap']}, "
        f"{section['rounds']} rounds)",
        f"  {'tier':<28} {'k':>3} {'peak MB':>9} {'tokens/s':>10} {'vs padded':>9}",
    ]
    for name, r in section["tiers"].items():
        if "skipped" in r:
            lines.append(f"  {name:<28} skipped: {r['skipped'][:100]}")
            continue
        ratio = r.get("ratio_vs_padded_dense")
        lines.append(
            f"  {name:<28} {r['k']:>3} {_mb(r['peak_mem_mb'])} {r['tokens_per_s']:>10.0f} "
            + (f"{ratio:>8.2f}x" if ratio is not None else f"{'n/a':>9}")
            + (f" (stopped: {r['stopped']})" if r.get("stopped") else "")
        )
    return lines


def summary(result: Mapping[str, Any]) -> str:
    """The human-readable report (without ``--json``)."""
    if "skipped" in result:
        return result["skipped"]
    m = result["machine"]
    s = result["settings"]
    lines = [
        f"foundry-attn bench gpu: {m['device_name']}, torch {result['torch']}, transformers "
        f"{result['transformers']}, {s['dtype']}, {s['layers']} layers, vocab {s['vocab']}, "
        f"{s['rounds']} rounds, {result['elapsed_s']:.0f} s"
    ]
    if result["note"]:
        lines.append(f"NOTE: {result['note']}")
    for name, tier in result["tiers"].items():
        runs = f"{tier['kernel']}; {tier['execution']}" if tier["runs"] else f"skipped: {tier['skipped']}"
        lines.append(f"  {name:<28} {runs}")
    for batch in result["batches"].values():
        lines.extend(_batch_lines(batch))
    lines.extend(_equal_memory_lines(result["equal_memory"]))
    lines.append("")
    for name, t in result["targets"].items():
        verdict = t.get("not_judged") or "n/a (not a GPU run)" if t["met"] is None else ("PASS" if t["met"] else "FAIL")
        if t["value"] is None:
            value = "no ours tier agreed" if t["tier"] is None else "not measured"
        elif "against" in t:
            value = f"{t['value']:.2f}x ({t['tier']} vs {t['against']})"
            value += " (warm-up seconds)" if name.endswith("_warmup_vs_padded_graphed_a_report") else ""
        else:
            value = f"{t['value']:.0%} ({t['tier']})"
        stock = ", ".join(f"{k} {v:.2f}x" for k, v in t.get("stock_vs_padded_best", {}).items())
        lines.append(f"{name}: {value} >= {t['target']:g}: {verdict}" + (f"; vs padded best: {stock}" if stock else ""))
    return "\n".join(lines)
