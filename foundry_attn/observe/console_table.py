"""The console table of what the attention probe recorded: one line per group of alike modules.

    print(format_table(records))     # records: foundry_attn.observe.probe.ModelInspector's

Core module: standard library only.
"""

from __future__ import annotations

from typing import Any

from foundry_attn.observe.probe import ATTENTION, LAYER, MODEL

_COLUMNS = ("level", "modules", "mask", "dtype", "shape", "hides", "real", "fill", "packed", "impl")


def _row(group: list[dict[str, Any]]) -> tuple[str, ...]:
    r = group[0]
    level = (
        r["level"]
        if r["level"] == MODEL
        else f"{r['level']} {group[0]['index']}" + (f"-{group[-1]['index']}" if len(group) > 1 else "")
    )
    if "error" in r:
        return (level, r["cls"], "error", r["error"], "", "", "", "", "", "")
    yes_no = {True: "yes", False: "no", None: "-"}
    return (
        level,
        r["cls"] + (f" x{len(group)}" if len(group) > 1 else ""),
        r["mask"],
        r["mask_dtype"] or "-",
        "x".join(map(str, r["mask_shape"])) if r["mask_shape"] else "-",
        r.get("mask_hides") or yes_no[r.get("has_zeros")],
        "-" if r["real_tokens"] is None else f"{r['real_tokens']}/{r['positions']}",
        "-" if r["fill_ratio"] is None else f"{r['fill_ratio']:.3f}",
        yes_no[r["packed_positions"]],
        r["attn_implementation"] or "-",
    )


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    keys = (
        "level",
        "cls",
        "mask",
        "mask_dtype",
        "mask_shape",
        "has_zeros",
        "window",
        "mask_hides",
        "real_tokens",
        "positions",
        "packed_positions",
        "attn_implementation",
        "error",
    )
    return all(a.get(k) == b.get(k) for k in keys)


def format_table(records: list[dict[str, Any]], title: str = "attention_inspector") -> str:
    """A compact text table; consecutive identical layers / attention modules share one row.

    Args:
        records: one forward's records (:meth:`~foundry_attn.observe.probe.ModelInspector.capture`'s).
        title: the table's first line.

    Returns:
        The title, the column names, one row per group of alike modules and a legend, joined by newlines.

    Example::

        >>> print(format_table(records))  # a Llama's [2, 8] batch, two padding tokens (4-D masks: 4.51 float, 5.x bool)
        attention_inspector
        level          modules               mask  dtype    shape    hides    real   fill   packed  impl
        model          LlamaForCausalLM      2-D   int64    2x8      padding  14/16  0.875  -       sdpa
        layer 0-1      LlamaDecoderLayer x2  4-D   ...      2x1x8x8  padding  14/16  0.875  no      sdpa
        attention 0-1  LlamaAttention x2     4-D   ...      2x1x8x8  padding  14/16  0.875  no      sdpa
        hides: what the mask hides beyond causality (padding, documents, other keys; window N: the model's sliding ...
    """
    order = {MODEL: 0, LAYER: 1, ATTENTION: 2}
    groups: list[list[dict[str, Any]]] = []
    for rec in sorted(records, key=lambda r: (order.get(r["level"], 3), r["index"])):
        if groups and _same(groups[-1][-1], rec) and rec["level"] != MODEL:
            groups[-1].append(rec)
        else:
            groups.append([rec])
    rows = [_COLUMNS, *(_row(g) for g in groups)]
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(_COLUMNS))]
    lines = [title] + ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.append(
        "hides: what the mask hides beyond causality (padding, documents, other keys; window N: the model's "
        "sliding window, on purpose); real: real tokens/positions at that level; packed: position_ids restart "
        "inside a row"
    )
    return "\n".join(lines)
