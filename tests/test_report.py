"""`foundry-attn report`: a self-contained HTML whose every image loads (headless Chromium where it exists)."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from foundry_attn.bench.events import generate
from foundry_attn.cli import main


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


def test_a_path_without_events_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["report", str(tmp_path / "nothing"), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "no such file or folder" in err and err.count("\n") == 1
