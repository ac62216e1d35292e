"""Every causal-LM type transformers ships on this stack (``foundry-attn conformance --zoo``): under ``auto`` and
under each backend with strict on, through ``attach`` + ``forward_documents`` on packed documents, exact against
stock on each document alone (flat or rows), or refused with a reason; never wrong, never a raw crash, and ``auto``
trains wherever stock trains."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
import torch
import transformers

from foundry_attn.verify import sweep, zoo

#: outcomes that are not ours to train: stock cannot build or run the pair here, or stock's own padded rows differ
#: from each document alone (rows then equals stock's padded training exactly; conformance checks that)
NOT_OURS = ("unbuildable", "stock fails", "stock differs")
ZOO_DOC = Path(__file__).parents[2] / "docs" / "zoo.md"


@functools.cache
def documented() -> dict[tuple[str, str], str]:
    """``docs/zoo.md``'s table for this transformers: (model type, column) -> the outcome the cell opens with."""
    text = ZOO_DOC.read_text()
    section = text.split(f"## transformers {transformers.__version__},", 1)
    assert len(section) == 2, f"docs/zoo.md has no section for transformers {transformers.__version__}"
    table = [line for line in section[1].split("\n## ", 1)[0].splitlines() if line.startswith("| ")]
    columns = [c.strip() for c in table[0].strip("|").split("|")]
    cells = {}
    for line in table[1:]:
        values = [c.strip() for c in line.strip("|").split("|")]
        for column, value in zip(columns[1:], values[1:], strict=False):
            label = re.sub(r"\*\*|\s*\(.*?\)$", "", value.split(":", 1)[0]).strip()
            cells[values[0], column] = label
    return cells


def _as_documented(cell: sweep.ZooCell) -> None:
    """The computed cell opens as ``docs/zoo.md`` says (path included): regenerate the doc when this moves."""
    want = documented().get((cell.model_type, cell.requested))
    assert sweep.zoo_label(cell) == want, (
        f"{cell.model_type} / {cell.requested}: computed {sweep.zoo_label(cell)!r} ({cell.detail}), "
        f"docs/zoo.md says {want!r}; regenerate it with foundry-attn conformance --zoo --markdown"
    )


@pytest.mark.slow
@pytest.mark.parametrize("model_type", zoo.model_types())
def test_every_model_type_is_exact_or_refused(model_type: str) -> None:
    """Each type as the registered model meets it (``auto``: never refused where stock trains; each backend, strict)
    and as a core user attaches it, built as ``from_pretrained`` builds it (``attach(model, backend)``: refused only
    where stock cannot train the pair either): exact or refused, never wrong, never a crash. One test per type: its
    cells share stock's truth per backend."""
    for requested in sweep.ZOO_BACKENDS:
        cell = sweep.zoo_cell(model_type, requested)
        assert cell.status in ("exact", "refused", *NOT_OURS), cell
        if requested == "auto":
            assert cell.status != "refused", cell  # auto never fails to train what stock trains
        if cell.status == "exact":
            assert cell.path in ("flat", "rows") and cell.detail, cell
        if cell.status == "refused":
            assert cell.detail, cell
        _as_documented(cell)
    for backend in sweep.CORE_BACKENDS:
        cell = sweep.core_cell(model_type, backend)
        assert cell.status in ("exact", "refused", *NOT_OURS), cell
        if cell.status == "exact":
            assert cell.path in ("flat", "rows") and cell.detail, cell
        _as_documented(cell)


def test_an_exception_raised_in_our_code_is_ours() -> None:
    """The zoo files what our code raises as a crash (here: the reference kernel refusing dropout), what stock raises
    as stock's."""
    from foundry_attn.attention.fa2_reference import flash_attn_func

    q = torch.zeros(1, 2, 1, 4)
    try:
        flash_attn_func(q, q, q, dropout_p=0.1)
    except NotImplementedError as exc:
        assert sweep.raised_by_us(exc)
    try:
        torch.zeros(2).view(3)
    except RuntimeError as exc:
        assert not sweep.raised_by_us(exc)
