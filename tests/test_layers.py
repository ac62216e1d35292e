"""The core imports with neither Composer nor LLM-Foundry importable (a bare GPU box, a plain HF user)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CORE = [
    "guard",
    "capability",
    "policy",
    "loading",
    "packing",
    "layout",
    "forward",
    "adapters",
    "backends",
    "documents",
    "block_masks",
    "torch_varlen",
    "unwrap",
    "reference_kernels",
    "document_op",
    "comparison",
    "proof",
    "verdict",
    "deprecation",
    "paths",
    "zoo",
    "conformance",
    "sweep",
    "patching",
    "fa2_reference",
    "flash_symbols",
    "flash_compat",
    "events",
    "fleet",
    "report",
    "shapes",
    "cli",
    "inspection",
    "discovery",
    "console_table",
    "hf",
    "bench.timing",
    "bench.padding",
    "bench.proof",
    "bench.compile",
    "bench.events",
    "bench.gpu",
]  # benches run on bare GPU boxes


@pytest.mark.slow
def test_core_imports_without_composer_or_llmfoundry() -> None:
    code = "import sys\nsys.modules['composer'] = None\nsys.modules['llmfoundry'] = None\n" + "".join(
        f"import foundry_attn.{name}\n" for name in CORE
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.slow
def test_policy_and_the_probe_import_without_transformers() -> None:
    """policy.py says it is transformers-free (it reads the backend table, which holds no kernel code), and the
    probe in inspection.py imports transformers only when it looks for a model."""
    modules = ("policy", "backends", "inspection", "discovery", "documents", "block_masks", "unwrap")
    code = "import sys\nsys.modules['transformers'] = None\n" + "".join(f"import foundry_attn.{m}\n" for m in modules)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_core_list_names_every_module_directly_under_foundry_attn() -> None:
    """A new core module joins CORE (and so the import check above) on purpose, not by luck."""
    package = Path(__file__).resolve().parents[1] / "foundry_attn"
    modules = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    assert modules == {name for name in CORE if "." not in name}


@pytest.mark.slow
def test_doctor_json_runs_without_composer() -> None:
    code = (
        "import sys\nsys.modules['composer'] = None\nsys.modules['llmfoundry'] = None\n"
        "from foundry_attn.cli import main\nsys.exit(main(['doctor', '--json']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert '"candidates"' in proc.stdout
    report = json.loads(proc.stdout)  # the same keys on the pinned stack and on transformers 5.x
    if torch.cuda.is_available():  # a GPU box: one of the candidates it found available (test_gpu.py: which)
        assert report["environment"]["cuda"]
        assert report["chosen"] in {c["name"] for c in report["candidates"] if c["available"]}
    else:
        assert '"chosen": "sdpa"' in proc.stdout
    assert {"flash_kernel", "flash_symbols", "environment"} <= report.keys() and not report["flash_symbols"]["missing"]


def test_no_module_imports_a_private_name_of_another() -> None:
    """``from foundry_attn.x import _y`` nowhere, in the package or its tests: what another module needs is public."""
    import ast

    root = Path(__file__).resolve().parents[1]
    found = []
    for path in [*sorted((root / "foundry_attn").rglob("*.py")), *sorted((root / "tests").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("foundry_attn"):
                found += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not found, found
