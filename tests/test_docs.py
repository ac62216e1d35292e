"""The docs tell what the code does: the fallback chain everywhere it is named is ``DEFAULT_FALLBACK``."""

from __future__ import annotations

import re
from pathlib import Path

from foundry_attn.policy import DEFAULT_FALLBACK

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


def test_the_package_docstring_names_every_core_module() -> None:
    """``foundry_attn/__init__.py`` lists the core; a module added to the package is listed there too."""
    import foundry_attn

    named = set(re.findall(r"``(\w+)``", foundry_attn.__doc__ or ""))
    modules = {p.stem for p in (REPO / "foundry_attn").glob("*.py") if p.stem != "__init__"} | {"bench"}
    assert modules <= named, sorted(modules - named)


def test_docs_point_at_files_that_exist() -> None:
    """Relative links in README.md and docs/ name files that are there."""
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
            assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which does not exist"
