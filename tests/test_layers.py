"""The core imports with neither Composer nor LLM-Foundry importable (a bare GPU box, a plain HF user)."""

from __future__ import annotations

import subprocess
import sys

CORE = ["capability", "policy", "loading", "packing", "layout", "forward", "adapters", "document_op", "isolation",
        "conformance", "patching", "fa2_reference", "flash_symbols", "events", "fleet", "report", "shapes", "cli",
        "bench.padding", "bench.isolation", "bench.compile", "bench.events"]  # benches run on bare GPU boxes


def test_core_imports_without_composer_or_llmfoundry() -> None:
    code = ("import sys\nsys.modules['composer'] = None\nsys.modules['llmfoundry'] = None\n"
            + "".join(f"import foundry_attn.{name}\n" for name in CORE))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_doctor_json_runs_without_composer() -> None:
    code = ("import sys\nsys.modules['composer'] = None\nsys.modules['llmfoundry'] = None\n"
            "from foundry_attn.cli import main\nsys.exit(main(['doctor', '--json']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert '"chosen": "sdpa"' in proc.stdout and '"candidates"' in proc.stdout
