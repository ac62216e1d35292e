"""Shared fixtures: tiny offline assets made by our own code, and tiny Llama models per backend."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import types
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # imported where used: xdist's controller runs no test, and starts its workers 4 s sooner without it
    import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# inductor takes its CPU's vector ISA from /proc/cpuinfo, as it does once a probe has passed, without compiling and
# loading that probe in a fresh interpreter per ISA (about 15 s wherever a test first compiles with inductor)
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

REPO = Path(__file__).resolve().parents[1]
#: pytest-xdist's workers in this run (1 without ``-n``)
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def _share_the_cores() -> None:
    """Under ``pytest -n N`` (``make test``), each worker takes its share of the cores for torch's threads, its
    subprocesses' and inductor's C++ compiles (a worker with every core's threads would make N times as many as there
    are cores; at one, inductor compiles in the worker, without starting a pool of its own)."""
    if WORKERS > 1:
        import torch

        share = max(1, (os.cpu_count() or 1) // WORKERS)
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS"):
            os.environ[name] = str(share)
        torch.set_num_threads(share)


_share_the_cores()


@pytest.fixture(scope="session", autouse=True)
def _one_streaming_prefix_at_a_time() -> Iterator[None]:
    """Under ``pytest -n N``, two workers that build a ``StreamingDataset`` at once can pick the same shared-memory
    prefix (streaming looks for a free one, then creates it: ``FileExistsError: '/000012_locals'``); a lock across the
    workers (and runs) makes that pick and create one step. Restored at the end of the session."""
    if WORKERS < 2 or importlib.util.find_spec("streaming") is None:
        yield
        return
    import fcntl
    import tempfile

    import streaming.base.dataset as dataset

    pick = dataset.get_shm_prefix
    lock = Path(tempfile.gettempdir()) / "foundry_attn-streaming-prefix.lock"  # every test run on this machine

    def one_at_a_time(*args: Any, **kwargs: Any) -> Any:
        with lock.open("w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            return pick(*args, **kwargs)

    dataset.get_shm_prefix = one_at_a_time
    try:
        yield
    finally:
        dataset.get_shm_prefix = pick


#: the first package of the ``[foundry]`` extra that is missing (``make test-latest`` runs without them), or None
FOUNDRY_MISSING = next(
    (m for m in ("composer", "llmfoundry", "streaming") if importlib.util.find_spec(m) is None), None
)
#: tests whose fixtures are built with the [foundry] extra (MDS shards through ``streaming``)
FOUNDRY_FIXTURES = frozenset({"assets", "tokenizer"})
#: a CUDA device and flash-attn: transformers finds the real FA2 kernels here (on this CPU box it finds none)
REAL_FLASH_ATTN = (
    importlib.util.find_spec("flash_attn") is not None and importlib.import_module("torch").cuda.is_available()
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``foundry`` (or using its fixtures) need Composer / LLM-Foundry: skipped, saying why, without."""
    for item in items:
        if "foundry" not in item.keywords and FOUNDRY_FIXTURES.isdisjoint(getattr(item, "fixturenames", ())):
            continue
        item.add_marker(pytest.mark.foundry)
        if FOUNDRY_MISSING:
            item.add_marker(pytest.mark.skip(reason=f"needs the [foundry] extra ({FOUNDRY_MISSING} is not installed)"))


@pytest.fixture(scope="session")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """build_assets() output: tokenizer/, tiny-llama/, smollm2-135m/, text/{train,val}, finetune/*.jsonl."""
    from foundry_attn.integrations.llm_foundry.assets import build_assets

    return build_assets(tmp_path_factory.mktemp("assets"))


@pytest.fixture(scope="session")
def tokenizer(assets: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(assets / "tokenizer")


def make_llama(impl: str = "sdpa", seed: int = 0, **shape: int) -> torch.nn.Module:
    """A tiny random LlamaForCausalLM in fp32, eval mode, running ``impl`` (FA2: set on the config,
    as 4.51 allows; run it under ``reference_flash_attn()`` on CPU)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attention_dropout=0.0,
    )
    cfg.update(shape)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg, attn_implementation="eager" if impl == "flash_attention_2" else impl))
    model.config._attn_implementation = impl
    return model.eval()


def skip_unless_flex_trains(backend: str) -> None:
    """Flex training tests run where the policy lets flex train on the CPU they train on, a CUDA box's too
    (torch 2.7); elsewhere it refuses flex with this reason, which tests/verify/test_conformance.py and
    tests/selection/test_policy.py assert."""
    from foundry_attn.selection.capability import flex_backward_error

    why = flex_backward_error("cpu") if backend == "flex_attention" else None
    if why:
        pytest.skip(f"the policy refuses flex_attention here: {why}")


@pytest.fixture
def llama():
    return make_llama


# ---- the globals reference_flash_attn() and FlashCallTracer patch, restored exactly -------------------------

#: every module whose globals ``reference_flash_attn()`` and ``FlashCallTracer`` patch
PATCHED_MODULES = (
    "transformers.modeling_flash_attention_utils",
    "transformers.modeling_utils",
    "transformers.utils",
    "transformers.utils.import_utils",
)


def snapshot() -> dict[str, dict[str, object]]:
    """Every global of the patched modules, by identity."""
    return {name: dict(vars(importlib.import_module(name))) for name in PATCHED_MODULES}


def assert_restored(before: dict[str, dict[str, object]], *, traced: bool = False) -> None:
    """Every global of ``before`` is back, by identity, and none was added.

    ``traced``: tracers (and models) ran meanwhile, so submodules imported lazily may have appeared; no other
    global may, and no tracer may be left on the flash-attention module.
    """
    after = snapshot()
    for name in PATCHED_MODULES:
        if traced:
            assert before[name].keys() <= after[name].keys(), name
            added = [
                k for k in after[name].keys() - before[name].keys() if not isinstance(after[name][k], types.ModuleType)
            ]
            assert not added, (name, added)  # (lazily imported submodules may appear)
        else:
            assert after[name].keys() == before[name].keys(), name
        changed = [k for k in before[name] if after[name][k] is not before[name][k]]
        assert not changed, (name, changed)
    if traced:
        assert not traced_attributes()


def leaky_attention(genuine=None, threshold: int = 0):
    """What third-party kernel patches do: plain causal attention over the whole packed row (the documents taken
    and ignored) for rows longer than ``threshold``; shorter ones go to ``genuine``."""
    from foundry_attn.attention.documents import DOCS_KEY
    from foundry_attn.attention.functions import FUNCTIONS

    def leaky(module, query, key, value, attention_mask, **kwargs):
        docs = kwargs.pop(DOCS_KEY, None)
        if docs is not None:
            docs.calls += 1
        if query.shape[2] <= threshold:
            if docs is not None:
                kwargs[DOCS_KEY] = docs
            return genuine(module, query, key, value, attention_mask, **kwargs)
        return FUNCTIONS["sdpa"](module, query, key, value, None, **kwargs)  # no documents, no mask: causal row

    return leaky


@contextlib.contextmanager
def registered_attention(name: str, wrap):
    """The attention function registered under ``name`` replaced by ``wrap(genuine)`` for the block, restored after."""
    from transformers.modeling_utils import AttentionInterface

    from foundry_attn.attention.functions import register

    register()
    table = AttentionInterface._global_mapping
    genuine = table[name]
    table[name] = wrap(genuine)
    try:
        yield
    finally:
        table[name] = genuine


def read_events(directory, kind: str | None = None) -> list[dict]:
    """Every event in ``directory`` (every rank, rank 0 first), optionally of one ``kind``."""
    from foundry_attn.observe.events import event_files, iter_events

    return list(iter_events(event_files(directory), kind))


def traced_attributes(module=None) -> list[tuple[str, str]]:
    """``(attribute, role)`` of every attribute the flash tracer wraps in the flash-attention module now."""
    from foundry_attn.observe import flash_symbols

    mod = module if module is not None else importlib.import_module(flash_symbols.FA_UTILS)
    return [(n, r) for n, v in list(vars(mod).items()) if (r := getattr(v, "__foundry_attn_traced__", None))]
