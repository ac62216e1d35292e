"""The house rules, held by folder: who may import whom, and which folders may import Composer and its kin.

    attention < selection < flat < proof < path < observe < verify < integrations   (a folder imports only leftwards)
    guard, patching: importable by all; cli and bench (the tools) import anything but are imported by nothing

Only ``integrations/`` (and the benches that measure it) import Composer, LLM-Foundry, accelerate, TRL, PEFT or
axolotl: the rest runs on a bare GPU box or for a plain transformers user.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "foundry_attn"
#: the folders by job, lowest first: each may import the ones before it
FOLDERS = ("attention", "selection", "flat", "proof", "path", "observe", "verify", "integrations")
BASE = frozenset({"guard", "patching", "checks"})  # importable by every folder; they import nothing of ours
TOOLS = frozenset({"cli", "bench"})  # entry points: import anything, imported by nothing of the runtime
TOP_LEVEL = BASE | {"__init__", "cli"}
GLUE = frozenset({"composer", "llmfoundry", "accelerate", "trl", "peft", "streaming", "omegaconf", "axolotl"})


def _modules() -> list[tuple[str, Path]]:
    """Every module of the package, dotted under ``foundry_attn``."""
    return [
        (".".join(p.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__"), p)
        for p in sorted(PACKAGE.rglob("*.py"))
    ]


def _imports(path: Path) -> list[str]:
    """Every module ``path`` imports, at the top or inside a function, absolute."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            found += [base, *(f"{base}.{a.name}" for a in node.names)] if base == "foundry_attn" else [base]
    return found


def _home(dotted: str) -> str:
    """The folder (or top-level module) a dotted module name under ``foundry_attn`` lives in."""
    return dotted.split(".")[0]


def test_the_package_has_at_most_eight_top_level_modules_beside_its_folders() -> None:
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert modules <= TOP_LEVEL and len(modules) <= 8, modules
    assert folders == {*FOLDERS, "bench"}, folders


def test_each_folder_says_what_it_owns_and_what_it_may_import() -> None:
    import importlib

    for folder in FOLDERS:
        doc = importlib.import_module(f"foundry_attn.{folder}").__doc__ or ""
        assert doc.strip() and "May import" in doc, folder


def test_each_folder_imports_only_the_folders_below_it() -> None:
    """A call goes downward: no folder imports one after it in ``FOLDERS`` (lazily neither), and nothing of the
    runtime imports the tools."""
    wrong = []
    for name, path in _modules():
        home = _home(name)
        for target in _imports(path):
            if not target.startswith("foundry_attn.") or home in TOOLS:
                continue
            other = _home(target.removeprefix("foundry_attn."))
            if other in BASE or other == "__init__" or other == home:
                continue
            if home in BASE or other in TOOLS or other not in FOLDERS or home not in FOLDERS:
                wrong.append(f"{name} imports {target}")
            elif FOLDERS.index(other) > FOLDERS.index(home):
                wrong.append(f"{name} imports {target} (upward)")
    assert not wrong, wrong


def test_only_the_integrations_and_their_benches_import_composer_llmfoundry_accelerate_or_trl() -> None:
    wrong = [
        f"{name} imports {target}"
        for name, path in _modules()
        if _home(name) not in ("integrations", "bench")
        for target in _imports(path)
        if target.split(".")[0] in GLUE
    ]
    assert not wrong, wrong


#: transformers-free: policy reads the backend table (no kernel code), the probe imports transformers only when it
#: looks for a model
NO_TRANSFORMERS = (
    "selection.policy",
    "selection.traits",
    "selection.backend_checks",
    "attention.backends",
    "attention.config_values",
    "observe.probe",
    "observe.discovery",
    "attention.documents",
    "attention.block_masks",
    "flat.unwrap",
)


@pytest.mark.slow
def test_a_box_without_composer_imports_all_but_the_integrations_and_runs_doctor() -> None:
    """A bare GPU box (no Composer, no LLM-Foundry) imports the core, the tools and every bench, and its
    ``foundry-attn doctor --json`` runs; before them, the policy and the probe import without transformers. One
    interpreter for all three (each start imports torch and transformers again)."""
    names = [name for name, _ in _modules() if _home(name) != "integrations" and name != "__init__"]
    code = (
        "import sys\nsys.modules['transformers'] = None\n"
        + "".join(f"import foundry_attn.{name}\n" for name in NO_TRANSFORMERS)
        + "del sys.modules['transformers']\nsys.modules['composer'] = None\nsys.modules['llmfoundry'] = None\n"
        + "".join(f"import foundry_attn.{name}\n" for name in names)
        + "from foundry_attn.cli import main\nsys.exit(main(['doctor', '--json']))"
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
    found = []
    for path in [*sorted(PACKAGE.rglob("*.py")), *sorted((REPO / "tests").rglob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("foundry_attn"):
                found += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not found, found


RUNTIME = ("attention", "selection", "flat", "proof", "path", "observe", "integrations")


def _lines_outside(owner: str, pattern: str, allowed: str = "") -> list[str]:
    """The code lines (comments left out) of the runtime folders, but ``owner``, that match ``pattern``."""
    import re

    found = re.compile(pattern)
    return [
        f"{p.relative_to(PACKAGE)}: {line.strip()}"
        for folder in RUNTIME
        for p in sorted((PACKAGE / folder).rglob("*.py"))
        if str(p.relative_to(PACKAGE)) != owner
        for line in p.read_text().splitlines()
        if found.search(line.split("#")[0]) and not (allowed and allowed in line)
    ]


def test_one_module_sets_which_implementation_a_model_runs() -> None:
    """``config._attn_implementation`` of a model is written only by ``flat/implementation.py`` (the backend table
    probes what a config accepts on a deep copy of it: ``config_refusals``)."""
    found = _lines_outside("flat/implementation.py", r"\._attn_implementation\s*=[^=]", "probe._attn_implementation")
    assert not found, found


def test_one_module_sets_and_takes_off_a_models_forward() -> None:
    """The forward attach installs and the model's own forward a check runs live in ``flat/model_forward.py``: no other
    runtime module assigns or pops an instance's ``forward``."""
    pattern = r"\.forward\s*=[^=]|vars\([^)]*\)\.pop\(\"forward\"|vars\([^)]*\)\[\"forward\"\]\s*="
    found = _lines_outside("flat/model_forward.py", pattern)
    assert not found, found
