"""The public API is what ``foundry_attn/__init__.py`` says, on both stacks, and its worked examples run."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import foundry_attn
from tests.conftest import make_llama


def test_the_public_names_import_from_the_package_and_nothing_else_does() -> None:
    from foundry_attn import PaddingCollator, attach, forward_documents, install

    assert all(callable(x) for x in (PaddingCollator, attach, forward_documents, install))
    assert sorted(dir(foundry_attn)) == sorted(foundry_attn.__all__)
    with pytest.raises(AttributeError, match="public names: PaddingCollator, __version__, attach"):
        foundry_attn.paths  # noqa: B018


def test_importing_the_package_imports_nothing() -> None:
    """``foundry_attn_guard.pth`` imports the package at every interpreter start: the API is lazy (PEP 562)."""
    code = "import sys, foundry_attn\nprint(sorted(m for m in sys.modules if m.startswith(('foundry_attn', 'torch'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() in ("['foundry_attn']", "['foundry_attn', 'foundry_attn.guard']"), out


def test_the_worked_examples_run() -> None:
    """The docstrings' examples: collate packed documents, attach, train the batch; the documents stay apart."""
    from foundry_attn import PaddingCollator, attach, forward_documents

    collate = PaddingCollator(pad_id=0, eos_id=2, max_seq_len=8, mode="pack")
    batch = collate([torch.tensor([5, 6, 2, 7, 8, 9, 2]), torch.tensor([4, 4, 2])])
    assert batch["doc_lens"] == [[3, 4], [3]]

    model = make_llama("sdpa")
    state = attach(model, "auto")
    assert state.decision is not None and state.backend == state.decision.chosen
    assert state.decision.reason.startswith("flash_attention_2: ")  # why the faster one was passed over here
    state = attach(model, "sdpa")
    assert (state.path, state.reason.split(":")[0]) == ("flat", "proven at attach")
    model.train()
    out = forward_documents(model, batch)
    out.loss.backward()
    alone = model(input_ids=torch.tensor([[7, 8, 9, 2]]), labels=torch.tensor([[-100, 8, 9, 2]]), use_cache=False)
    assert torch.isfinite(out.loss) and torch.isfinite(alone.loss)
