"""``PathState`` changes only through its own transitions (move to rows, to stock's mask, keep, what was learned, how
the step runs), all in ``path/state.py``: no other module of the package assigns its fields."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from foundry_attn.path.state import PathState

PACKAGE = Path(__file__).resolve().parents[2] / "foundry_attn"
FIELDS = {f.name for f in dataclasses.fields(PathState)}
#: the names a PathState goes by in the package's code
HOLDERS = {"state", "attn_state", "path_state"}


def _holder(node: ast.expr) -> bool:
    """``state``, ``self.state``, ``self.attn_state`` or ``path_of(...)``."""
    if isinstance(node, ast.Name):
        return node.id in HOLDERS
    if isinstance(node, ast.Attribute):
        return node.attr in HOLDERS
    return isinstance(node, ast.Call) and getattr(node.func, "id", None) == "path_of"


def _assigned(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args:
            if _holder(node.args[0]):
                found.append((node.lineno, "setattr"))
        for target in targets:
            for part in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(part, ast.Attribute) and part.attr in FIELDS and _holder(part.value):
                    found.append((node.lineno, part.attr))
    return found


def test_path_states_fields_are_assigned_in_one_module() -> None:
    owner = PACKAGE / "path" / "state.py"
    elsewhere = [
        f"{path.relative_to(PACKAGE)}:{line} {field}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != owner
        for line, field in _assigned(ast.parse(path.read_text()))
    ]
    assert not elsewhere, elsewhere


def test_the_check_sees_an_assignment() -> None:
    code = "state.path, state.reason = 'rows', 'why'\nself.attn_state.capacity = 0\npath_of(m).notes = []\n"
    assert [field for _, field in _assigned(ast.parse(code))] == ["path", "reason", "capacity", "notes"]
