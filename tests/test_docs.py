"""The docs tell what the code does: the fallback chain everywhere it is named is ``DEFAULT_FALLBACK``."""

from __future__ import annotations

import re
from pathlib import Path

from foundry_attn.selection.policy import DEFAULT_FALLBACK

REPO = Path(__file__).resolve().parents[1]
ALIASES = {"fa2": "flash_attention_2", "sdpa": "sdpa", "eager": "eager", "torch_varlen": "torch_varlen"}
NAMES = "|".join(["flash_attention_2", "torch_varlen", "sdpa", "eager", "flex_attention", "FA2", "SDPA"])
ARROW = re.compile(rf"(?:(?:{NAMES})\s*(?:->|→)\s*)+(?:{NAMES})")
LISTED = re.compile(r"attn_fallback:\s*\[([^\]]*)\]")


def _files() -> list[Path]:
    out = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "yamls").glob("*.yaml"))]
    return out + sorted((REPO / "foundry_attn").rglob("*.py"))


def _chains(text: str) -> list[list[str]]:
    found = [re.split(r"\s*(?:->|→)\s*", m.group(0)) for m in ARROW.finditer(text)]
    found += [[n.strip() for n in m.group(1).split(",") if n.strip()] for m in LISTED.finditer(text)]
    return [[ALIASES.get(n.lower(), n) for n in chain] for chain in found if len(chain) >= 3]


def test_every_chain_the_docs_and_yamls_name_is_the_default() -> None:
    wrong = [
        f"{path.relative_to(REPO)}: {' -> '.join(chain)}"
        for path in _files()
        for chain in _chains(path.read_text())
        if chain != list(DEFAULT_FALLBACK)
    ]
    assert not wrong, f"the chain is {' -> '.join(DEFAULT_FALLBACK)} (policy.DEFAULT_FALLBACK); these differ: {wrong}"


def test_the_chain_is_found_where_it_is_named() -> None:
    assert _chains((REPO / "README.md").read_text()), "README names the chain"
    assert all(_chains(p.read_text()) for p in sorted((REPO / "yamls").glob("*.yaml")))


def test_the_package_docstring_names_every_folder_and_top_level_module() -> None:
    """``foundry_attn/__init__.py`` maps the package; a folder or module added at its top is named there too."""
    import foundry_attn

    package = REPO / "foundry_attn"
    named = set(re.findall(r"``(\w+)``", foundry_attn.__doc__ or ""))
    tops = {p.stem for p in package.glob("*.py")} | {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    assert tops - {"__init__"} <= named, sorted(tops - {"__init__"} - named)


def test_docs_point_at_files_that_exist() -> None:
    """Relative links in README.md and docs/ name files that are there."""
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
            assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which does not exist"


def _docs() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_module_paths_the_docs_and_code_name_exist() -> None:
    """``foundry_attn/x.py`` paths in the docs, and dotted ``foundry_attn.x`` names in docs and docstrings, name
    modules (or their attributes) that are there: a renamed module leaves no stale name behind."""
    for doc in _files():
        text = doc.read_text()
        for path in re.findall(r"\bfoundry_attn/[\w/]+\.py\b", text):
            assert (REPO / path).exists(), f"{doc.name} names {path}, which does not exist"
        for dotted in set(re.findall(r"\bfoundry_attn(?:\.\w+)+", text)):
            assert _exists(dotted.split(".")), f"{doc.relative_to(REPO)} names {dotted}, which does not exist"


def _exists(parts: list[str]) -> bool:
    """The longest prefix of ``parts`` that is a module file of the repo has the rest as attributes (read from its
    source where the module cannot import on this stack: the Composer glue on the 5.x stack)."""
    import importlib

    for cut in range(len(parts), 0, -1):
        path = REPO.joinpath(*parts[:cut])
        file = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        if not file.exists():
            continue
        rest = parts[cut:]
        try:
            module = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            pattern = rf"^(class|def) {rest[0]}\b|^{rest[0]}\s*[:=]" if rest else ""
            return not rest or re.search(pattern, file.read_text(), re.MULTILINE) is not None
        return _has_path(module, rest)
    return False


def _has_path(obj: object, attrs: list[str]) -> bool:
    for attr in attrs:
        if not hasattr(obj, attr):
            return False
        obj = getattr(obj, attr)
    return True


def test_the_readme_tree_names_every_module_under_its_folder() -> None:
    """The module tree in README.md names each module of the package (``__init__.py`` aside) under its own folder,
    and nothing else."""
    tree = (REPO / "README.md").read_text().split("foundry_attn/                the package", 1)[1].split("```", 1)[0]
    named: set[str] = set()
    folders: list[tuple[int, str]] = [(0, "")]  # (indent, folder) of the lines above
    for line in tree.splitlines():
        indent = len(line) - len(line.lstrip())
        first = line.strip().split(" ", 1)[0]
        if not first:
            continue
        while folders[-1][0] >= indent and len(folders) > 1:
            folders.pop()
        if first.endswith("/") and not first.endswith(".py/"):
            folders.append((indent, folders[-1][1] + first))
            first = line.strip().split(" ", 1)[1] if " " in line.strip() else ""
        words = re.findall(r"\b(\w+\.py)\b", line.split("`", 1)[0] if "`" in line else line)
        named |= {folders[-1][1] + w for w in words}
    files = {p.relative_to(REPO / "foundry_attn").as_posix() for p in (REPO / "foundry_attn").rglob("*.py")}
    modules = {f for f in files if not f.endswith("__init__.py")}
    assert named <= files, sorted(named - files)
    assert modules <= named, sorted(modules - named)


def _doc_names(text: str) -> tuple[set[str], set[str]]:
    """The dotted names (`foundry_attn.x.y`, `flat.layout.Layout`) and the file paths (`path/forward.py`) a doc
    gives of the package and its tests."""
    folders = "|".join(p.name for p in (REPO / "foundry_attn").iterdir() if p.is_dir() and not p.name.startswith("_"))
    dotted = set(re.findall(rf"`((?:foundry_attn\.)?(?:{folders})\.[A-Za-z_][\w.]*)", text))
    files = set(re.findall(rf"\b((?:tests/)?(?:{folders})/[\w/]+\.py)\b", text))
    return {d.rstrip(".") for d in dotted}, files


def test_the_maps_name_what_exists() -> None:
    """Every module, function or class the README and docs/ name by its dotted path exists, and every file they
    name by its path (``path/forward.py``, ``tests/flat/test_capacity.py``) is there."""
    import importlib

    missing: list[str] = []
    for doc in _docs():
        dotted, files = _doc_names(doc.read_text())
        for name in sorted(dotted):
            parts = name.removeprefix("foundry_attn.").split(".")
            for cut in range(len(parts), 0, -1):  # the longest importable module, then its attributes
                try:
                    obj: object = importlib.import_module("foundry_attn." + ".".join(parts[:cut]))
                except ImportError:
                    continue
                if not _has_path(obj, parts[cut:]):
                    missing.append(f"{doc.name}: {name}")
                break
            else:
                missing.append(f"{doc.name}: {name}")
        for file in sorted(files):
            here = [REPO / file, REPO / "foundry_attn" / file, REPO / "tests" / file]
            if not any(p.is_file() for p in here):
                missing.append(f"{doc.name}: {file}")
    assert not missing, "\n".join(missing)


def test_commands_the_docs_name_exist() -> None:
    """``foundry-attn <command>``, ``foundry-attn bench <name>`` and ``make <target>`` in the docs are real."""
    from foundry_attn.bench import BENCHES

    cli = (REPO / "foundry_attn" / "cli.py").read_text()
    commands = set(re.findall(r'sub\.add_parser\("([\w-]+)"', cli))
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.MULTILINE))
    for doc in _docs():
        text = doc.read_text()
        for command in re.findall(r"foundry-attn (\w[\w-]*)", text):
            assert command in commands, f"{doc.name}: foundry-attn {command} is not a command ({commands})"
        for bench in re.findall(r"foundry-attn bench (\w[\w-]*)", text):
            assert bench in BENCHES, f"{doc.name}: foundry-attn bench {bench} is not a benchmark ({BENCHES})"
        for target in re.findall(r"`make ([\w-]+)", text):
            assert target in targets, f"{doc.name}: make {target} is not a Makefile target"


def test_every_public_function_of_the_core_and_the_glues_says_its_args_returns_and_an_example() -> None:
    """Every public function and method of ``attention/``, ``selection/``, ``flat/``, ``proof/``, ``path/``,
    ``integrations/`` and ``observe/`` has an ``Args:`` section (when it takes parameters), ``Returns:`` (when it
    returns something) and an ``Example``. A method marked ``@override`` (a framework's hook: Composer's
    ``Callback`` events, transformers' ``TrainerCallback.on_*``, axolotl's plugin hooks; or a base class's method) is
    documented where it is declared: its docstring says in one line what it does here."""
    import ast

    lacking: list[str] = []
    for folder in ("attention", "selection", "flat", "proof", "path", "integrations", "observe"):
        for path in sorted((REPO / "foundry_attn" / folder).rglob("*.py")):

            def visit(body: list[ast.stmt], owner: str = "", path: Path = path) -> None:
                for node in body:
                    if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                        visit(node.body, f"{node.name}.")
                    if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                        continue
                    doc = ast.get_docstring(node) or ""
                    if any(ast.unparse(d) in ("override", "typing_extensions.override") for d in node.decorator_list):
                        if not doc:
                            lacking.append(f"{path.relative_to(REPO)}:{node.lineno} {owner}{node.name}: no docstring")
                        continue
                    args = node.args
                    takes = [
                        a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs) if a.arg not in ("self", "cls")
                    ]
                    takes += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
                    returns = node.returns is not None and not (
                        isinstance(node.returns, ast.Constant) and node.returns.value is None
                    )
                    wanted = [("Args:", bool(takes)), ("Returns:", returns), ("Example", True)]
                    missing = [word for word, needed in wanted if needed and word not in doc]
                    if missing:
                        lacking.append(f"{path.relative_to(REPO)}:{node.lineno} {owner}{node.name}: {missing}")

            visit(ast.parse(path.read_text()).body)
    assert not lacking, "\n".join(lacking)
