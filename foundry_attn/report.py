"""``foundry-attn report PATH -o DIR``: one self-contained ``report.html`` and the PNGs behind it.

    foundry-attn report runs/my-run/attn_events -o report/     # one run
    foundry-attn report runs/ -o report/                        # a tree: adds fallback frequency by device

Figures (matplotlib, headless): the fill ratio per step (``attn_inspect``), the unpad / varlen / dense calls per
step (``upad_trace``), the implementation per rank (a rank x run grid, fallbacks marked), and for more than one
run the fallback frequency by device class. The HTML embeds each PNG as a data URI, so it opens anywhere alone.
Events are read as ``foundry-attn events`` reads them (broken lines skipped and counted). Core module:
standard library and matplotlib.
"""

from __future__ import annotations

import base64
import collections
import html
from pathlib import Path
from typing import Any

from foundry_attn import fleet
from foundry_attn.events import Skipped

CALLS = ("upad", "posids", "varlen", "dense", "pad")


def _series(events: list[dict], kind: str, value: Any) -> dict[str, list[tuple[int, float]]]:
    """``{"run/rank r": [(step, value), ...]}`` for events of ``kind`` that have a value."""
    out: dict[str, list[tuple[int, float]]] = collections.defaultdict(list)
    for e in events:
        if e.get("kind") == kind and e.get("step") is not None:
            v = value(e)
            if v is not None:
                out[f"{e['run']} / rank {e.get('rank')}"].append((int(e["step"]), float(v)))
    return dict(out)


def _figure(title: str, ylabel: str) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=100)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    return fig, ax


def _lines(path: Path, title: str, ylabel: str, series: dict[str, list[tuple[int, float]]], limit: int = 12) -> None:
    fig, ax = _figure(title, ylabel)
    for label, points in list(series.items())[:limit]:
        points.sort()
        ax.plot([s for s, _ in points], [v for _, v in points], marker=".", label=label)
    if not series:
        ax.text(0.5, 0.5, "no events of this kind", ha="center", va="center", transform=ax.transAxes)
    elif len(series) > 1:
        ax.legend(fontsize="small", loc="best")
    ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path)
    fig.clf()


def _grid(path: Path, decided: list[dict]) -> None:
    """Rank x run, coloured: green = got what it asked for, orange = fell back, red = failed."""
    from matplotlib.colors import ListedColormap

    runs = sorted({d["run"] for d in decided})
    ranks = sorted({int(d.get("rank") or 0) for d in decided})
    cells = [[float("nan")] * len(runs) for _ in ranks]
    labels = [[""] * len(runs) for _ in ranks]
    for d in decided:
        r, c = ranks.index(int(d.get("rank") or 0)), runs.index(d["run"])
        cells[r][c] = 2 if fleet.failed(d) else 1 if fleet.fell(d) else 0
        labels[r][c] = str(d.get("chosen") or "failed")
    fig, ax = _figure("implementation per rank (orange: fell back, red: failed)", "rank")
    ax.imshow(cells, cmap=ListedColormap(["#4caf50", "#ff9800", "#e53935"]), vmin=0, vmax=2, aspect="auto")
    ax.set_xticks(range(len(runs)), runs, rotation=45, ha="right", fontsize="small")
    ax.set_yticks(range(len(ranks)), [str(r) for r in ranks])
    if len(runs) * len(ranks) <= 64:
        for r in range(len(ranks)):
            for c in range(len(runs)):
                ax.text(c, r, labels[r][c], ha="center", va="center", fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path)
    fig.clf()


def _devices(path: Path, summary: dict[str, Any]) -> None:
    fig, ax = _figure("fallback frequency by device class", "ranks that fell back")
    names = list(summary["by_device"])
    ax.bar(range(len(names)), [summary["by_device"][n]["rate"] for n in names], color="#ff9800")
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize="small")
    ax.set_ylim(0, 1)
    fig.tight_layout()
    fig.savefig(path)
    fig.clf()


def build_report(path: str | Path, out: str | Path) -> dict[str, Any]:
    """Write the PNGs and ``report.html`` into ``out``; returns what was written and what was skipped."""
    skipped = Skipped()
    events = list(fleet.events(fleet.files(path), skipped=skipped))
    if not events:
        raise fleet.EventsError(f"{path}: no events in it")
    decided = fleet.decisions(events)
    summary = fleet.summary(decided)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figures: list[tuple[str, str]] = []

    def fill(e: dict) -> float | None:
        return (e.get("batch") or {}).get("fill_ratio")

    _lines(
        out / "fill_ratio.png",
        "batch fill ratio per step (real tokens / positions)",
        "fill ratio",
        _series(events, "attn_inspect", fill),
    )
    figures.append(("fill_ratio.png", "Fill ratio per step"))
    calls = {}
    for role in CALLS:
        per_rank = _series(events, "upad_trace", lambda e, r=role: (e.get("counts") or {}).get(r))
        calls.update({f"{label} {role}": points for label, points in per_rank.items() if any(v for _, v in points)})
    _lines(out / "calls.png", "flash-attention calls per step (upad_tracer)", "calls", calls)
    figures.append(("calls.png", "Unpad / varlen / dense calls per step"))
    _grid(out / "ranks.png", decided)
    figures.append(("ranks.png", "Implementation per rank"))
    if summary["runs"] > 1:
        _devices(out / "devices.png", summary)
        figures.append(("devices.png", "Fallback frequency by device class"))
    rows = "".join(
        f"<tr>{''.join(f'<td>{html.escape(str(r.get(c)))}</td>' for c in fleet.FELL_BACK_COLUMNS)}</tr>"
        for r in fleet.fell_back(decided)
    )
    head = "".join(f"<th>{c}</th>" for c in fleet.FELL_BACK_COLUMNS)
    images = "".join(
        f'<h2>{html.escape(title)}</h2><img alt="{html.escape(title)}" src="data:image/png;base64,'
        f'{base64.b64encode((out / name).read_bytes()).decode()}">'
        for name, title in figures
    )
    note = fleet.report_skipped(skipped)
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>foundry_attn report</title><style>"
        "body{font-family:sans-serif;margin:2em;max-width:60em} img{max-width:100%} "
        "td,th{padding:.2em .6em;border-bottom:1px solid #ddd;text-align:left}</style></head><body>"
        f"<h1>foundry_attn report</h1><p>{html.escape(str(path))}: {summary['runs']} run(s), "
        f"{summary['ranks']} rank decision(s), {summary['fell_back']} fell back."
        f"{' ' + html.escape(note) + '.' if note else ''}</p>"
        f"<h2>Ranks that fell back</h2><table><tr>{head}</tr>{rows or '<tr><td>none</td></tr>'}</table>"
        f"{images}</body></html>"
    )
    (out / "report.html").write_text(page)
    return {
        "html": str(out / "report.html"),
        "figures": [str(out / n) for n, _ in figures],
        "skipped_lines": skipped.lines,
    }
