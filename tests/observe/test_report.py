"""`foundry-attn report`: a self-contained HTML whose every image loads (headless Chromium where it exists)."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from foundry_attn.bench.events import generate
from foundry_attn.cli import main
from foundry_attn.observe.events import EventLog
from foundry_attn.observe.report import build_report, span


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sweep")
    generate(root / "runs", runs=3, ranks=10, per_rank=40)
    assert main(["report", str(root / "runs"), "-o", str(root / "out")]) == 0
    return root / "out" / "report.html"


def test_report_embeds_every_figure_as_a_png(report: Path) -> None:
    page = report.read_text()
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == 4  # fill ratio, calls, ranks, devices (a tree of 3 runs)
    assert all(base64.b64decode(img)[:8] == b"\x89PNG\r\n\x1a\n" for img in images)
    assert {p.name for p in report.parent.glob("*.png")} == {"fill_ratio.png", "calls.png", "ranks.png", "devices.png"}
    assert "Tesla T4" in page and "fell back" in page  # the fell-back table names the T4 ranks


def test_every_image_loads_in_headless_chromium(report: Path, tmp_path: Path) -> None:
    browser = next(
        (shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None
    )
    if browser is None:
        pytest.skip("no Chromium on this machine (Debian: apt-get install chromium); the PNG checks above ran")
    probe = tmp_path / "probe.html"
    probe.write_text(
        report.read_text().replace(
            "</body>",
            "<script>window.onload=()=>{const bad=[...document.images].filter(i=>!i.complete||"
            "!i.naturalWidth).length;document.title='images:'+document.images.length+' broken:'+bad;}"
            "</script></body>",
        )
    )
    out = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--virtual-time-budget=5000",
            "--dump-dom",
            probe.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "<title>images:4 broken:0</title>" in out.stdout, out.stderr[-2000:]


def test_without_matplotlib_the_report_says_which_extra_to_install(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """matplotlib is the ``report`` extra, not a dependency of the package."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["report", str(tmp_path), "-o", str(tmp_path / "out")]) == 2
    assert "pip install 'foundry-attn[report]'" in capsys.readouterr().err


def test_a_path_without_events_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["report", str(tmp_path / "nothing"), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "no such file or folder" in err and err.count("\n") == 1


def _impl(log: EventLog, time: float, chosen: str | None, **extra: object) -> None:
    """An ``attn_impl`` decision as the model writes it (a strict failure has ``chosen=None, failed=True``)."""
    log.append(
        "attn_impl",
        time=time,
        requested="flash_attention_2",
        chosen=chosen,
        fallback=chosen != "flash_attention_2",
        reason="requested" if chosen else "attn_strict: flash_attention_2 failed check 'compute capability'",
        **extra,
    )


def _steps(log: EventLog, time: float, steps: range, fill: float = 0.768, varlen: int = 2) -> None:
    """What the callbacks write per step: no launch id on these (their EventLog has none)."""
    for i, step in enumerate(steps):
        log.append("attn_inspect", time=time + i, step=step, batch={"fill_ratio": fill})
        counts = {"upad": 0, "posids": 0, "varlen": varlen, "dense": 0, "pad": 0}
        log.append("upad_trace", time=time + i, step=step, counts=counts)


def test_a_one_point_series_is_a_marker_on_an_axis_around_its_value(tmp_path: Path) -> None:
    folder = tmp_path / "one-step" / "attn_events"
    _impl(EventLog(folder, 0, launch="L1"), 100.0, "flash_attention_2")
    _steps(EventLog(folder, 0), 101.0, range(1))
    result = build_report(tmp_path, tmp_path / "out")
    fill, calls = result["axes"]["fill_ratio.png"], result["axes"]["calls.png"]
    assert (fill["series"], fill["single_points"], calls["series"], calls["single_points"]) == (1, 1, 1, 1)
    assert fill["x"] == calls["x"] == (-1.0, 1.0)  # step 0 +- 1, not matplotlib's -0.04..0.04
    assert fill["y"] == (0.0, 1.0)  # a ratio: its natural 0..1
    assert calls["y"] == (0.0, 3.0)  # a count: from 0, past 2 + max(10%, 1)
    # any series: the axis follows the data with a margin; one value gets value +- max(10% of it, 1)
    assert span([5.0]) == (4.0, 6.0) and span([1000.0]) == (900.0, 1100.0) and span([0.0]) == (-1.0, 1.0)
    assert span([3.0, 7.0]) == pytest.approx((2.8, 7.2))
    low, high = span([0.5, 1.0], natural=(0.0, 1.0))
    assert low == 0.0 and 1.0 < high < 1.05  # a point on the edge of 0..1 stays off the frame


def test_every_launch_of_a_run_keeps_its_own_cell(tmp_path: Path) -> None:
    """Two launches that trained, then a third where rank 1 failed (attn_strict): three columns, none folded."""
    folder = tmp_path / "resumed" / "attn_events"
    for n, launch in enumerate(["L1", "L2", "L3"]):
        start = 1000.0 * (n + 1)
        for rank in (0, 1):
            failed = launch == "L3" and rank == 1
            model = EventLog(folder, rank, run="resumed", launch=launch)
            _impl(
                model,
                start,
                None if failed else "flash_attention_2",
                **({"failed": True, "strict": True} if failed else {}),
            )
            if launch != "L3":
                _steps(EventLog(folder, rank, run="resumed"), start + 1, range(10 * n, 10 * n + 3), varlen=24)
    result = build_report(tmp_path, tmp_path / "out")
    columns = result["launches"]
    assert [(c["launch"], c["index"], c["of"], c["latest"]) for c in columns] == [
        ("L1", 1, 3, False),
        ("L2", 2, 3, False),
        ("L3", 3, 3, True),
    ]
    outcomes = [{rank: cell["outcome"] for rank, cell in c["ranks"].items()} for c in columns]
    assert outcomes[0] == outcomes[1] == {0: "as requested", 1: "as requested"}
    assert outcomes[2] == {0: "as requested", 1: "failed"} and columns[2]["ranks"][1]["chosen"] == "failed (strict)"
    # the callbacks' steps (written without a launch id) stay with their launch: 2 ranks x 2 launches
    assert result["axes"]["fill_ratio.png"]["series"] == result["axes"]["calls.png"]["series"] == 4
    page = Path(result["html"]).read_text()
    assert "1 run(s), 3 launch(es)" in page and "none (failed)" in page
