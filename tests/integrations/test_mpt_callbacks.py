"""The callbacks on LLM-Foundry's own MPT (``mpt_causal_lm``): they name MPT's ``attn_impl`` (not the ``eager`` its
HF config carries) and ``upad_tracer`` counts MPT's direct flash-attn calls, on the pure-PyTorch reference kernel
installed as the ``flash_attn`` modules MPT imports at call time (CPU: no flash-attn, no CUDA)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import sys
import types
from pathlib import Path

import pytest
import torch

from foundry_attn.attention import fa2_reference as ref

pytestmark = [pytest.mark.foundry, pytest.mark.slow]

VOCAB, WIDTH, ROWS = 64, 12, 4


def _module(name: str, **attrs: object) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec works on it
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


@pytest.fixture
def reference_flash_attn_package(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The reference kernel where MPT's ``flash_attn_fn`` looks flash-attn up (hardware stand-in, undone after).

    ``flash_attn``, ``.flash_attn_interface`` (the kernels) and ``.bert_padding`` (MPT's unpad / pad helpers)
    in ``sys.modules``; ``modeling_mpt.bert_padding``, which MPT binds at import only when flash-attn is there;
    and MPT's input check without its ``is_cuda`` requirement (dtypes are still checked).
    """
    import llmfoundry.models.layers.attention as mpt_attention
    import llmfoundry.models.mpt.modeling_mpt as modeling_mpt  # imported before flash_attn appears

    if "flash_attn" in sys.modules or importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed: these tests stand in for it on CPU")
    interface = _module(
        "flash_attn.flash_attn_interface",
        flash_attn_varlen_func=ref.flash_attn_varlen_func,
        flash_attn_func=ref.flash_attn_func,
    )
    padding = _module(
        "flash_attn.bert_padding",
        pad_input=ref.pad_input,
        unpad_input=ref.unpad_input,
        index_first_axis=ref.index_first_axis,
    )
    package = _module("flash_attn", __version__="2.6.3", __path__=[], flash_attn_interface=interface)
    package.bert_padding = padding  # type: ignore[attr-defined]
    for module in (package, interface, padding):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(modeling_mpt, "bert_padding", padding, raising=False)

    def check_on_cpu(*tensors: torch.Tensor, valid_dtypes: list[torch.dtype] | None = None) -> None:
        allowed = valid_dtypes or [torch.float32, torch.float16, torch.bfloat16]
        bad = [t.dtype for t in tensors if t.dtype not in allowed]
        if bad:
            raise TypeError(f"{bad[0]=} must be in {allowed=}.")

    monkeypatch.setattr(mpt_attention, "check_valid_inputs", check_on_cpu)
    return interface


def _mpt(attn_impl: str):
    from llmfoundry.models.mpt import ComposerMPTCausalLM

    torch.manual_seed(0)
    return ComposerMPTCausalLM(
        tokenizer=None,
        use_train_metrics=False,
        loss_fn="torch_crossentropy",
        d_model=64,
        n_heads=4,
        n_layers=2,
        expansion_ratio=2,
        max_seq_len=32,
        vocab_size=VOCAB,
        attn_config={"attn_impl": attn_impl},
        init_device="cpu",
    )


def _loader(batches: int):
    """Right-padded rows (real lengths 12, 9, 7, 12, ...) with a 2-D mask: MPT's flash path unpads them."""
    from torch.utils.data import DataLoader

    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(ROWS * batches):
        real = (WIDTH, 9, 7, WIDTH)[i % ROWS]
        ids = torch.randint(1, VOCAB, (WIDTH,), generator=gen)
        mask = (torch.arange(WIDTH) < real).long()
        rows.append({"input_ids": ids * mask, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)})
    return DataLoader(rows, batch_size=ROWS)


def _trainer(model, callbacks: list, tmp_path: Path, batches: int = 2):
    from composer import Trainer
    from composer.loggers import InMemoryLogger

    memory = InMemoryLogger()
    trainer = Trainer(
        model=model,
        train_dataloader=_loader(batches),
        max_duration=f"{batches}ba",
        callbacks=callbacks,
        loggers=[memory],
        device="cpu",
        precision="fp32",
        progress_bar=False,
        log_to_console=False,
        optimizers=torch.optim.SGD(model.parameters(), lr=1e-3),
        run_name="mpt-cb",
        save_folder=None,
        seed=0,
    )
    return trainer, memory


def _series(memory, key: str) -> list[float]:
    return [float(v) for _, v in memory.data.get(key, [])]


def _traced(module: types.ModuleType) -> list[str]:
    return [name for name, value in vars(module).items() if hasattr(value, "__foundry_attn_traced__")]


def test_mpt_torch_is_named_torch_by_every_callback(tmp_path: Path, caplog) -> None:
    from foundry_attn.integrations.composer.attention_inspector import AttentionInspector
    from foundry_attn.integrations.composer.attn_decision import AttnDecision
    from foundry_attn.integrations.composer.upad_tracer import UpadTracer
    from foundry_attn.observe.discovery import attn_implementation

    model = _mpt("torch")
    assert model.model.config._attn_implementation == "eager"  # what the HF config says, and does not run
    assert attn_implementation(model.model) == "torch"
    tracer = UpadTracer(log_interval=1, events_dir=str(tmp_path / "ev"))
    inspector = AttentionInspector(log_interval=1, events_dir=str(tmp_path / "ev"), print_table=False)
    trainer, memory = _trainer(model, [tracer, inspector, AttnDecision()], tmp_path)
    with caplog.at_level(logging.WARNING):
        trainer.fit()
    said = [r.getMessage() for r in caplog.records if "upad_tracer: nothing to trace" in r.getMessage()]
    assert len(said) == 1 and "'torch' (MPT's attn_config['attn_impl'])" in said[0] and "eager" not in said[0]
    assert tracer.implementation == "torch" and not _series(memory, "attn/varlen_calls_per_step")
    assert memory.hyperparameters["attn/chosen"] == "torch"
    assert "MPT's attn_config['attn_impl']" in memory.hyperparameters["attn/reason"]
    assert inspector.last_records and {r.get("attn_implementation") for r in inspector.last_records} == {"torch"}
    trainer.close()


def test_upad_tracer_counts_mpt_flash_calls_on_the_reference_kernel(
    reference_flash_attn_package: types.ModuleType, tmp_path: Path, capsys
) -> None:
    from foundry_attn.integrations.composer.upad_tracer import UpadTracer
    from tests.conftest import read_events

    interface = reference_flash_attn_package
    padding = sys.modules["flash_attn.bert_padding"]
    tracer = UpadTracer(log_interval=1, events_dir=str(tmp_path / "ev"))
    trainer, memory = _trainer(_mpt("flash"), [tracer], tmp_path)
    trainer.fit()
    assert (
        tracer.implementation == "flash"
        and tracer.core.symbols is not None
        and tracer.core.symbols.library == "flash-attn"
    )
    # MPT unpads once per forward, then one varlen kernel call and one pad_input per layer; no dense call
    assert _series(memory, "attn/varlen_calls_per_step") == [2.0, 2.0]
    assert _series(memory, "attn/pad_calls_per_step") == [2.0, 2.0]
    assert _series(memory, "attn/dense_calls_per_step") == [0.0, 0.0]
    assert _series(memory, "attn/upad_calls_per_step") == [0.0, 0.0]
    assert _series(memory, "attn/max_seqlen") == [float(WIDTH)] * 2
    first = tracer.last_summary["first"]["varlen"]
    assert first["cu_seqlens_q"] == [0, 12, 21, 28, 40] and first["q_shape"] == [40, 4, 16]
    traces = read_events(tmp_path / "ev", "upad_trace")
    assert [e["step"] for e in traces] == [0, 1] and traces[0]["kernel"] == ref.REFERENCE_NAME
    assert traces[0]["attn_implementation"] == "flash"
    out = capsys.readouterr().out
    assert "calls this step: flash_attn_varlen_func 2, flash_attn_func 0, pad_input 2" in out
    assert "_upad_input" not in out and f"kernel: {ref.REFERENCE_NAME}" in out
    assert interface.flash_attn_varlen_func is ref.flash_attn_varlen_func and padding.pad_input is ref.pad_input
    assert not _traced(interface) and not _traced(padding)
    trainer.close()


def test_mpt_flash_patches_undone_when_training_raises(
    reference_flash_attn_package: types.ModuleType, tmp_path: Path
) -> None:
    from foundry_attn.integrations.composer.upad_tracer import UpadTracer

    interface = reference_flash_attn_package
    tracer = UpadTracer(log_interval=1, events_dir=str(tmp_path / "ev"))
    model = _mpt("flash")
    trainer, _ = _trainer(model, [tracer], tmp_path)
    block = model.model.transformer.blocks[1]
    real_forward, calls = block.forward, {"n": 0}

    def failing_forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the second batch, inside the traced forward
            assert _traced(interface) == ["flash_attn_varlen_func", "flash_attn_func"]
            raise RuntimeError("boom in block 1")
        return real_forward(*args, **kwargs)

    block.forward = failing_forward
    with pytest.raises(RuntimeError, match="boom in block 1"):
        trainer.fit()
    assert not _traced(interface) and interface.flash_attn_varlen_func is ref.flash_attn_varlen_func
    assert not _traced(sys.modules["flash_attn.bert_padding"])
    trainer.close()
