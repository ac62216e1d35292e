"""What the examples of ``foundry_attn/proof/`` use: the tiny Llama attached on sdpa and, made from it, the subject a
proof runs (``subject``), the path's state (``state``), a flat row of documents ``[28, 13, 1]`` as the proof at attach
lays them out (``inputs``), its run (``packed_run``) and its first two documents' runs alone (``alone_runs``), one
13-token document (``doc``, ``alone``, ``run_alone``), a step proof due on a training batch (``step``); a tiny CPM-Ant.

Every name of a block that needs the model reads the same one (``hf_model`` is :func:`tests.examples.common.attached`,
made once per block), so ``subject``, ``state``, ``step`` and ``hf_model`` are one model's. The harness makes
each name its block's source mentions, comments and strings included: names here are none of a module path's words."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.examples import common

#: the flat row's documents, as the proof at attach lays them out: 28 + 13 + 1 tokens
LENGTHS = (28, 13, 1)
#: the documents a flat proof compares there (:func:`foundry_attn.proof.prove.pick`): the first two
SPANS = ((0, 28), (28, 41))


_model = common.attached  # one per block


@functools.lru_cache(maxsize=1)
def _inputs(tmp: Path) -> dict[str, Any]:
    """The flat row of documents :data:`LENGTHS` (``[1, 42]``, labels the ids), as ``flat_inputs`` makes it."""
    from foundry_attn.flat.inputs import flat_inputs
    from foundry_attn.flat.layout import Layout

    ids = torch.randint(3, 64, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(0))
    layout = Layout.from_batch({"input_ids": ids, "doc_lens": [list(LENGTHS)]})
    return flat_inputs(common.tiny_llama(), ids, ids.clone(), layout)[0]


def subject(tmp: Path) -> Any:
    """The attached model as a proof runs it (``subject_of``)."""
    from foundry_attn.path.proven import subject_of

    return subject_of(_model(tmp))


def state(tmp: Path) -> Any:
    """The attached model's path state (``path_of``): flat, proven at attach."""
    from foundry_attn.path.state import path_of

    return path_of(_model(tmp))


def doc(tmp: Path) -> torch.Tensor:
    """One document of 13 token ids ``[13]``."""
    return torch.randint(3, 64, (13,), generator=torch.Generator().manual_seed(1))


def alone(tmp: Path) -> dict[str, Any]:
    """``doc`` as stock runs it alone (``alone_inputs``)."""
    from foundry_attn.proof.runs import alone_inputs

    return alone_inputs(doc(tmp)[None])


def _alone_run(tmp: Path, inputs: dict[str, Any]) -> Any:
    """The attached model's run of one document alone under stock sdpa, with gradients."""
    from foundry_attn.proof.runs import run

    sub = subject(tmp)
    with sub.running("sdpa"):
        return run(sub, inputs, [(0, inputs["input_ids"].shape[1])], grads=True)


def run_alone(tmp: Path) -> Any:
    """``alone``'s :class:`~foundry_attn.proof.runs.Run` under stock sdpa, with gradients."""
    return _alone_run(tmp, alone(tmp))


def alone_runs(tmp: Path) -> list[Any]:
    """The compared documents of ``inputs`` (:data:`SPANS`), each run alone under stock sdpa, with gradients."""
    from foundry_attn.proof.runs import alone_inputs

    ids = _inputs(tmp)["input_ids"]
    return [_alone_run(tmp, alone_inputs(ids[:, s:e])) for s, e in SPANS]


def packed_run(tmp: Path) -> Any:
    """The flat row's run (``flat_side``): logits ``[42, 64]``, the compared documents' gradients."""
    from foundry_attn.proof.sides import flat_side

    run_, why = flat_side(_inputs(tmp))(subject(tmp), SPANS, True)
    assert run_ is not None, why
    return run_


def step(tmp: Path) -> Any:
    """The proof due on a training batch of ``inputs`` that takes its forward (as ``prove_plan`` makes it)."""
    import functools

    from foundry_attn.path.proven import keep_proof, prove, subject_of
    from foundry_attn.proof.step_proof import StepProof

    keep, again = functools.partial(keep_proof, state(tmp)), functools.partial(prove, state(tmp))
    at = "batch 1 (the first training batch)"
    return StepProof(state(tmp), keep, again, subject_of(_model(tmp)), _inputs(tmp), at, True, None)


def cpmant(tmp: Path) -> torch.nn.Module:
    """A tiny CPM-Ant on eager (its loss reads each token's own label), eval mode."""
    from foundry_attn.verify import zoo

    config, model_class = zoo.tiny("cpmant")
    return zoo.build(config, model_class, "eager").eval()


def _subject_of(tmp: Path) -> Callable[[Any], Any]:
    from foundry_attn.path.proven import subject_of

    return subject_of


def _limits(tmp: Path) -> Any:
    from foundry_attn.proof.tolerance import Limits

    return Limits()


NAMES: dict[str, Callable[[Path], Any]] = {
    "hf_model": _model,
    "model": _model,
    "llama_model": _model,
    "subject": subject,
    "subject_of": _subject_of,
    "state": state,
    "inputs": _inputs,
    "doc": doc,
    "alone": alone,
    "run_alone": run_alone,
    "alone_runs": alone_runs,
    "packed_run": packed_run,
    "limits": _limits,
    "step": step,
    "cpmant": cpmant,
}
