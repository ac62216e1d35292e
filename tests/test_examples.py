"""The docstrings' examples run: every ``Example::`` block of the runtime folders, as doctest runs it, with the
names of ``tests/examples/<folder>.py``, in a fresh working directory.

A block that cannot run on this machine marks its lines ``# doctest: +SKIP`` and says why in the docstring
(``not run here:``); at least 80% of the runtime folders' blocks run in full.
``FOUNDRY_ATTN_EXAMPLES=flat,path pytest tests/test_examples.py`` runs those folders' blocks only.
"""

from __future__ import annotations

import doctest
import importlib
import io
import os
import pkgutil
import re
import tokenize
from pathlib import Path
from typing import Any

import pytest

#: the runtime folders: torch and transformers only (integrations/ and bench/ need Composer or a GPU box)
RUNTIME = ("attention", "flat", "observe", "path", "proof", "selection", "verify")
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
#: the least share of the runtime folders' example blocks that run in full
LEAST_RUN = 0.8
#: what a docstring says of a block it does not run
NOT_RUN = "not run here:"


def _modules() -> list[Any]:
    out = []
    for folder in os.environ.get("FOUNDRY_ATTN_EXAMPLES", ",".join(RUNTIME)).split(","):
        package = importlib.import_module(f"foundry_attn.{folder}")
        out.append(package)
        for info in pkgutil.iter_modules(package.__path__, f"{package.__name__}."):
            out.append(importlib.import_module(info.name))
    return out


def _blocks() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    found = []
    for module in _modules():
        for test in finder.find(module, module.__name__):
            if test.docstring and "Example::" in test.docstring and test.examples:
                found.append(test)
    return sorted(found, key=lambda t: t.name)


BLOCKS = _blocks()


def _runs(test: doctest.DocTest) -> bool:
    return not any(e.options.get(doctest.SKIP) for e in test.examples)


def _names_read(source: str) -> set[str]:
    """The names in an example's code (not in its comments or strings)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return set(re.findall(r"[A-Za-z_]\w*", source))
    return {t.string for t in tokens if t.type == tokenize.NAME}


def _names(folder: str, test: doctest.DocTest, tmp: Path) -> dict[str, Any]:
    """The names of ``common`` and the folder's module that the block's source mentions, each factory run once."""
    from tests.examples import common

    factories = dict(common.NAMES)
    try:
        factories.update(importlib.import_module(f"tests.examples.{folder}").NAMES)
    except ModuleNotFoundError as exc:
        if exc.name != f"tests.examples.{folder}":
            raise
    used = {name for example in test.examples for name in _names_read(example.source)}
    made: dict[Any, Any] = {}
    for name, factory in factories.items():
        if name in used and factory not in made:
            made[factory] = factory(tmp)
    return {name: made[factory] for name, factory in factories.items() if factory in made}


@pytest.mark.parametrize("test", BLOCKS, ids=[t.name.removeprefix("foundry_attn.") for t in BLOCKS])
def test_the_example_runs(test: doctest.DocTest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not _runs(test):
        assert NOT_RUN in (test.docstring or ""), f"{test.name} skips an example without saying why ({NOT_RUN!r})"
        why = re.split(r"\.(?:\s|$)", (test.docstring or "").split(NOT_RUN, 1)[1], maxsplit=1)[0]
        pytest.skip(f"{test.name}: {' '.join(why.split())}")
    monkeypatch.chdir(tmp_path)
    folder = test.name.split(".")[1]
    test.globs = {**test.globs, **_names(folder, test, tmp_path)}
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    failures: list[str] = []

    runner.report_failure = lambda out, t, e, got: failures.append(f"{e.source.strip()}\n  want: {e.want}  got: {got}")
    runner.report_unexpected_exception = lambda out, t, e, exc: failures.append(
        f"{e.source.strip()}\n  raised {exc[0].__name__}: {exc[1]}"
    )
    runner.run(test, out=lambda _: None, clear_globs=False)
    assert not failures, f"{test.name} (line {test.lineno}):\n" + "\n".join(failures)


def test_most_examples_run_in_full() -> None:
    """At least 80% of the runtime folders' example blocks run (the rest say why not)."""
    ran = sum(_runs(t) for t in BLOCKS)
    assert BLOCKS
    assert ran / len(BLOCKS) >= LEAST_RUN, f"{ran} of {len(BLOCKS)} example blocks run; at least {LEAST_RUN:.0%}"
