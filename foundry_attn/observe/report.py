"""``foundry-attn report PATH -o DIR``: one self-contained ``report.html`` and the PNGs behind it.

    foundry-attn report runs/my-run/attn_events -o report/     # one run
    foundry-attn report runs/ -o report/                        # a tree: adds fallback frequency by device

Figures (matplotlib, headless): the fill ratio per step (``attn_inspect``), the unpad / varlen / dense calls per
step (``upad_trace``), the implementation per rank and launch (a rank x launch grid: a run launched three times
has three columns side by side, the newest marked ``latest``; fallbacks and failures coloured), and for more
than one run the fallback frequency by device class. Axes come from the data; a series of one point is drawn as
a marker with its value, on an axis around it. The HTML embeds each PNG as a data URI, so it opens anywhere
alone. Events are read as ``foundry-attn events`` reads them (broken lines skipped and counted). Core module:
standard library and matplotlib.
"""

from __future__ import annotations

import base64
import bisect
import collections
import html
import math
import re
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from foundry_attn.observe import fleet
from foundry_attn.observe.events import Skipped

CALLS = ("upad", "posids", "varlen", "dense", "pad")
#: series drawn per line figure (the rest are counted in the legend's title)
SERIES_LIMIT = 12
#: the grid's colours: as requested, fell back, failed
GREEN, ORANGE, RED = "#4caf50", "#ff9800", "#e53935"


def _series(events: list[dict], kind: str, value: Any, label: Any) -> dict[str, list[tuple[int, float]]]:
    """``{label(event): [(step, value), ...]}`` for events of ``kind`` that have a value."""
    out: dict[str, list[tuple[int, float]]] = collections.defaultdict(list)
    for e in events:
        if e.get("kind") == kind and e.get("step") is not None:
            v = value(e)
            if v is not None:
                out[label(e)].append((int(e["step"]), float(v)))
    return dict(out)


def _labeller(events: list[dict], columns: list[dict[str, Any]]) -> Any:
    """``run / rank r`` for an event, plus ``launch i of n`` when its run was launched more than once.

    The callbacks write their events without the launch id: an event belongs to the rank's newest launch that
    had decided (``attn_impl``) by the event's time, so a resumed run's steps never fold into the first launch's.
    """
    starts: dict[tuple[str, Any], list[tuple[float, str]]] = collections.defaultdict(list)
    for e in events:
        if e.get("kind") == "attn_impl" and e.get("launch"):
            starts[(e["run"], e.get("rank"))].append((float(e.get("time") or 0), str(e["launch"])))
    for found in starts.values():
        found.sort()
    where = {(c["run"], c["launch"]): c for c in columns}

    def label(e: dict) -> str:
        name = f"{e['run']} / rank {e.get('rank')}"
        launch = e.get("launch")
        if not launch:
            found = starts.get((e["run"], e.get("rank")), [])
            i = bisect.bisect_right(found, (float(e.get("time") or 0), "\uffff"))
            launch = found[i - 1][1] if i else None
        column = where.get((e["run"], launch))
        return f"{name} / launch {column['index']} of {column['of']}" if column and column["of"] > 1 else name

    return label


def _natural(label: str) -> list[Any]:
    """Sort key: ``rank 2`` before ``rank 10``, ``launch 1 of 2`` before ``launch 2 of 2``."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", label)]


def span(values: Sequence[float], natural: tuple[float, float] = (-math.inf, math.inf)) -> tuple[float, float]:
    """Axis limits from the data: 5% of its range either side; one value (or all equal): value +- max(10%, 1).

    ``natural``: the range the quantity lives in (``(0, 1)`` for ratios, ``(0, inf)`` for counts). The axis
    spans it wherever the data stay inside, and leaves it only as far as the data do.

    Args:
        values: the data along the axis (at least one value).
        natural: the range the quantity lives in.

    Returns:
        ``(low, high)``.

    Example::

        >>> span([0.5, 0.9], natural=(0.0, 1.0)), span([5])
        ((0.0, 1.0), (4.0, 6.0))
    """
    lo, hi = min(values), max(values)
    bottom, top = natural
    inside_bottom, inside_top = math.isfinite(bottom) and lo >= bottom, math.isfinite(top) and hi <= top
    if hi == lo:
        pad = max(abs(lo) * 0.1, 1.0)
    else:  # 5% of what the axis will span
        pad = 0.05 * ((top if inside_top else hi) - (bottom if inside_bottom else lo))
    low = bottom if inside_bottom else lo - pad
    high = top if inside_top else hi + pad
    edge = 0.03 * (high - low)  # a point on the natural edge keeps its marker off the frame
    return (low - edge if lo == low else low), (high + edge if hi == high else high)


def _figure(title: str, ylabel: str, size: tuple[float, float] = (9, 3.6)) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=size, dpi=100)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    return fig, ax


def _save(fig: Any, path: Path) -> None:
    from matplotlib import pyplot as plt

    fig.savefig(path, bbox_inches="tight")  # "tight": the legend outside the axes stays in the PNG
    plt.close(fig)


def _lines(
    path: Path,
    title: str,
    ylabel: str,
    series: dict[str, list[tuple[int, float]]],
    y: str = "value",
    empty: str = "no events of this kind",
) -> dict[str, Any]:
    """One line per series, markers on every point; ``y`` is ``ratio`` (axis 0..1), ``count`` (from 0, whole
    numbers) or ``value`` (from the data). A series of one point is a large marker labelled with its value.
    Returns the axis limits and what was drawn."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = _figure(title, ylabel)
    shown = sorted(series.items(), key=lambda item: _natural(item[0]))[:SERIES_LIMIT]
    singles = 0
    labelled: set[tuple[int, float]] = set()
    for label, points in shown:
        points.sort()
        xs, ys = [s for s, _ in points], [v for _, v in points]
        if len(points) == 1:
            singles += 1
            ax.plot(xs, ys, linestyle="none", marker="o", markersize=8, label=label)
            if points[0] not in labelled and len(labelled) < 6:  # the value, once per spot
                labelled.add(points[0])
                ax.annotate(
                    f"{ys[0]:.4g}",
                    points[0],
                    xytext=(7, 7),
                    textcoords="offset points",
                    fontsize="small",
                    bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "alpha": 0.8, "linewidth": 0},
                )
        else:
            ax.plot(xs, ys, marker="o", markersize=3 if len(points) <= 100 else 0, linewidth=1.2, label=label)
    limits: dict[str, Any] = {"series": len(shown), "single_points": singles, "x": None, "y": None}
    if not shown:
        ax.text(0.5, 0.5, textwrap.fill(empty, 80), ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
    else:
        steps = [s for _, points in shown for s, _ in points]
        values = [v for _, points in shown for _, v in points]
        limits["x"] = span(steps)
        limits["y"] = {
            "ratio": span(values, natural=(0.0, 1.0)),
            "count": span(values, natural=(0.0, math.inf)),
        }.get(y) or span(values)
        ax.set_xlim(*limits["x"])
        ax.set_ylim(*limits["y"])
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if y == "count":
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        more = f"first {len(shown)} of {len(series)} series" if len(series) > len(shown) else None
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), title=more, title_fontsize="small")
        ax.grid(True, alpha=0.3)
    ax.set_xlabel("step")
    _save(fig, path)
    return limits


def launches(decided: list[dict]) -> list[dict[str, Any]]:
    """One column per (run, launch): a run's launches oldest first, the newest marked ``latest``, with each rank's
    outcome (``chosen``, ``fell back`` or ``failed``).

    Args:
        decided: every rank's decision (:func:`foundry_attn.observe.fleet.decisions`).

    Returns:
        One dict per column: ``run``, ``launch``, ``index`` of ``of`` (the run's launches, from 1), ``latest``, and
        ``ranks`` (per rank its ``chosen`` and ``outcome``).

    Example::

        >>> [(c["launch"], c["index"], c["of"], c["latest"]) for c in launches(decided)]  # runs/my-run: launched twice
        [('5f0c2a9e81d3', 1, 2, False), ('b7e41d06c9a2', 2, 2, True)]
        >>> launches(decided)[0]["ranks"][3]  # a Tesla T4 at the first launch
        {'chosen': 'sdpa', 'outcome': 'fell back'}
    """
    first: dict[tuple[str, str | None], float] = {}
    for d in decided:
        key = (d["run"], d.get("launch"))
        first[key] = min(first.get(key, math.inf), float(d.get("time") or 0))
    per_run: dict[str, list[str | None]] = collections.defaultdict(list)
    for run, launch in sorted(first, key=lambda k: (k[0], first[k], str(k[1]))):
        per_run[run].append(launch)
    columns = []
    for run in sorted(per_run):
        ids = per_run[run]
        for i, launch in enumerate(ids):
            ranks = {}
            for d in decided:
                if d["run"] == run and d.get("launch") == launch:
                    failed = fleet.failed(d)
                    outcome = "failed" if failed else "fell back" if fleet.unmet(d) else "as requested"
                    ranks[int(d.get("rank") or 0)] = {
                        "chosen": "failed" + (" (strict)" if d.get("strict") else "") if failed else d.get("chosen"),
                        "outcome": outcome,
                    }
            columns.append(
                {
                    "run": run,
                    "launch": launch,
                    "index": i + 1,
                    "of": len(ids),
                    "latest": i == len(ids) - 1,
                    "ranks": dict(sorted(ranks.items())),
                }
            )
    return columns


def _tick(column: dict[str, Any], wide: bool) -> str:
    """``run`` for a run launched once; else the run, ``launch i of n`` (the newest: ``, latest``) and its id."""
    if column["of"] == 1:
        return str(column["run"])
    which = f"launch {column['index']} of {column['of']}" + (", latest" if column["latest"] else "")
    launch = str(column["launch"] or "?")[:8]
    return f"{column['run']} · {which} {launch}" if wide else f"{column['run']}\n{which}\n{launch}"


def _grid(path: Path, columns: list[dict[str, Any]]) -> None:
    """Rank x launch, coloured: green = got what it asked for, orange = fell back, red = failed; a run's
    launches sit side by side between thick separators."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    ranks = sorted({r for c in columns for r in c["ranks"]})
    code = {"as requested": 0, "fell back": 1, "failed": 2}
    cells = [[float("nan")] * len(columns) for _ in ranks]
    for j, c in enumerate(columns):
        for rank, cell in c["ranks"].items():
            cells[ranks.index(rank)][j] = code[cell["outcome"]]
    wide = len(columns) > 8  # many columns: one-line labels, slanted
    height = min(10.0, max(2.6, 1.6 + 0.45 * len(ranks)))
    fig, ax = _figure("implementation per rank and launch", "rank", size=(9.0, height))
    ax.imshow(cells, cmap=ListedColormap([GREEN, ORANGE, RED]), vmin=0, vmax=2, aspect="auto")
    fig.canvas.draw()  # the axes' size in pixels: what fits in a cell
    box = ax.get_window_extent()
    cell_w, cell_h = box.width / len(columns), box.height / len(ranks)
    every = math.ceil(len(columns) / (box.width / (14 if wide else 90)))  # a tick label each, while they fit
    shown = range(0, len(columns), every)
    ax.set_xticks(list(shown), [_tick(columns[j], wide) for j in shown], fontsize="small")
    if wide:
        ax.tick_params(axis="x", labelrotation=45)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    rows = range(0, len(ranks), math.ceil(len(ranks) / (box.height / 14)))
    ax.set_yticks(list(rows), [str(ranks[i]) for i in rows])
    for j in range(1, len(columns)):  # white lines between cells; thicker ones between runs
        same_run = columns[j]["run"] == columns[j - 1]["run"]
        ax.axvline(j - 0.5, color="white", linewidth=min(1.0, cell_w / 20) if same_run else min(4.0, cell_w / 8))
    for i in range(1, len(ranks)):
        ax.axhline(i - 0.5, color="white", linewidth=min(1.0, cell_h / 20))

    def fitting(texts: list[str]) -> float | None:
        """The largest of these font sizes (points) at which every text fits its cell; None: none does."""
        longest = max(map(len, texts), default=0)
        sizes = (9.0, 7.5, 6.5)
        return next((p for p in sizes if longest * p * 0.86 <= 0.92 * cell_w and p * 2 <= cell_h), None)

    # every cell names its implementation where that fits; else only the ranks that fell back or failed do
    labelled = [(j, rank, cell) for j, c in enumerate(columns) for rank, cell in c["ranks"].items()]
    points = fitting([str(cell["chosen"]) for _, _, cell in labelled])
    if points is None:
        labelled = [
            (j, r, {**cell, "chosen": cell["outcome"] if cell["outcome"] == "failed" else cell["chosen"]})
            for j, r, cell in labelled
            if cell["outcome"] != "as requested"
        ]
        points = fitting([str(cell["chosen"]) for _, _, cell in labelled])
    for j, rank, cell in labelled if points is not None else []:
        ax.text(
            j,
            ranks.index(rank),
            str(cell["chosen"]),
            ha="center",
            va="center",
            fontsize=points,
            color="white" if cell["outcome"] == "failed" else "black",
        )
    ax.legend(
        handles=[
            Patch(color=GREEN, label="as requested"),
            Patch(color=ORANGE, label="fell back"),
            Patch(color=RED, label="failed"),
        ],
        fontsize="small",
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
    )
    _save(fig, path)


def _devices(path: Path, summary: dict[str, Any]) -> None:
    fig, ax = _figure("fallback frequency by device class", "share of ranks that fell back")
    names = list(summary["by_device"])
    rates = [summary["by_device"][n]["rate"] for n in names]
    ax.bar(range(len(names)), rates, color=ORANGE, width=0.6)
    for i, n in enumerate(names):
        counts = summary["by_device"][n]
        ax.annotate(
            f"{counts['fell_back']} of {counts['ranks']}",
            (i, rates[i]),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            fontsize="small",
        )
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize="small")
    extra = max(0.0, (3 - len(names)) / 2)  # one or two bars stay bar-wide, centred
    ax.set_xlim(-0.5 - extra, len(names) - 0.5 + extra)
    ax.set_ylim(0, 1.1)
    ax.set_yticks([0, 0.25, 0.5, 0.75, 1.0])
    _save(fig, path)


def build_report(path: str | Path, out: str | Path) -> dict[str, Any]:
    """Write the PNGs and ``report.html`` into ``out``; returns what was written (the axes of the line figures,
    the grid's launch columns) and what was skipped.

    Args:
        path: an event file, a run's folder, or a tree of runs.
        out: the folder to write into (made if missing).

    Returns:
        ``html`` (the page's path), ``figures`` (the PNGs' paths), ``axes`` (each line figure's limits),
        ``launches`` (the grid's columns) and ``skipped_lines``.

    Raises:
        EventsError: ``path`` holds no event file, or no event.

    Example::

        >>> written = build_report(runs / "my-run" / "attn_events", "report")
        >>> written["html"], [Path(p).name for p in written["figures"]]
        ('report/report.html', ['fill_ratio.png', 'calls.png', 'ranks.png'])
    """
    skipped = Skipped()
    events = list(fleet.events(fleet.files(path), skipped=skipped))
    if not events:
        raise fleet.EventsError(f"{path}: no events in it")
    decided = fleet.decisions(events)
    summary = fleet.summary(decided)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figures: list[tuple[str, str]] = []
    axes: dict[str, Any] = {}

    def fill(e: dict) -> float | None:
        return (e.get("batch") or {}).get("fill_ratio")

    columns = launches(decided)
    label = _labeller(events, columns)

    axes["fill_ratio.png"] = _lines(
        out / "fill_ratio.png",
        "batch fill ratio per step (real tokens / positions)",
        "fill ratio",
        _series(events, "attn_inspect", fill, label),
        y="ratio",
    )
    figures.append(("fill_ratio.png", "Fill ratio per step"))
    calls = {}
    for role in CALLS:
        per_rank = _series(events, "upad_trace", lambda e, r=role: (e.get("counts") or {}).get(r), label)
        calls.update({f"{label} / {role}": points for label, points in per_rank.items() if any(v for _, v in points)})
    idle = next((str(e["message"]) for e in events if e.get("kind") == "upad_trace_idle" and e.get("message")), None)
    axes["calls.png"] = _lines(
        out / "calls.png",
        "flash-attention calls per step (upad_tracer)",
        "calls",
        calls,
        y="count",
        empty=f"no upad_trace events; {idle}" if idle else "no upad_trace events (upad_tracer not in the run?)",
    )
    figures.append(("calls.png", "Unpad / varlen / dense calls per step"))
    if columns:
        _grid(out / "ranks.png", columns)
        figures.append(("ranks.png", "Implementation per rank and launch"))
    if summary["runs"] > 1:
        _devices(out / "devices.png", summary)
        figures.append(("devices.png", "Fallback frequency by device class"))

    def cell(row: dict, column: str) -> str:
        value = row.get(column)
        if column == "chosen" and value is None:
            return "none (failed)"
        return "-" if value is None else str(value)

    rows = "".join(
        f"<tr>{''.join(f'<td>{html.escape(cell(r, c))}</td>' for c in fleet.FELL_BACK_COLUMNS)}</tr>"
        for r in fleet.fell_back(decided)
    )
    head = "".join(f"<th>{c}</th>" for c in fleet.FELL_BACK_COLUMNS)
    images = "".join(
        f'<h2>{html.escape(title)}</h2><img alt="{html.escape(title)}" src="data:image/png;base64,'
        f'{base64.b64encode((out / name).read_bytes()).decode()}">'
        for name, title in figures
    )
    note = fleet.report_skipped(skipped)
    relaunched = sum(1 for c in columns if c["index"] == 2)
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>foundry_attn report</title><style>"
        "body{font-family:sans-serif;margin:2em;max-width:60em} img{max-width:100%} "
        "table{border-collapse:collapse} "
        "td,th{padding:.2em .6em;border-bottom:1px solid #ddd;text-align:left;vertical-align:top}</style></head>"
        f"<body><h1>foundry_attn report</h1><p>{html.escape(str(path))}: {summary['runs']} run(s), "
        f"{len(columns)} launch(es){f' ({relaunched} run(s) launched more than once)' if relaunched else ''}, "
        f"{summary['ranks']} rank decision(s) (one per rank per launch), {summary['fell_back']} fell back."
        f"{' ' + html.escape(note) + '.' if note else ''}</p>"
        f"<h2>Ranks that fell back or failed</h2><table><tr>{head}</tr>{rows or '<tr><td>none</td></tr>'}</table>"
        f"{images}</body></html>"
    )
    (out / "report.html").write_text(page)
    return {
        "html": str(out / "report.html"),
        "figures": [str(out / n) for n, _ in figures],
        "axes": axes,
        "launches": columns,
        "skipped_lines": skipped.lines,
    }
