"""The Composer callbacks attention_inspector, upad_tracer and attn_decision: construction (log_interval,
selector), logged keys against docs/callbacks.md, the LLM-Foundry registry, then real Composer Trainer runs."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import pytest
import torch

from foundry_attn.observe import flash_symbols as fs
from foundry_attn.observe.flash_symbols import UPAD, discover
from tests.conftest import assert_restored, snapshot, traced_attributes

# ---- construction -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, 1.5, "10", True])
@pytest.mark.foundry
def test_log_interval_must_be_a_positive_integer(bad: object) -> None:
    from foundry_attn.integrations.composer.attention_inspector import AttentionInspector
    from foundry_attn.integrations.composer.upad_tracer import UpadTracer

    for cls, name in ((AttentionInspector, "attention_inspector"), (UpadTracer, "upad_tracer")):
        with pytest.raises(ValueError, match=f"{name}: log_interval must be an integer >= 1"):
            cls(log_interval=bad)


@pytest.mark.parametrize("interval", [25, "25ba", "25BA", "time"])
@pytest.mark.foundry
def test_log_interval_takes_batches_as_an_integer_a_time_string_or_a_time(interval: object) -> None:
    from composer.core import Time, TimeUnit

    from foundry_attn.integrations.composer.attention_inspector import AttentionInspector
    from foundry_attn.integrations.composer.upad_tracer import UpadTracer

    value = Time(25, TimeUnit.BATCH) if interval == "time" else interval
    for cls in (AttentionInspector, UpadTracer):
        callback = cls(log_interval=value)
        assert callback.log_interval == 25 and type(callback.log_interval) is int


@pytest.mark.parametrize(
    ("bad", "unit"), [("2ep", "epoch ('ep')"), ("100tok", "token ('tok')"), ("0.5dur", "duration ('dur')")]
)
@pytest.mark.foundry
def test_log_interval_in_another_unit_says_what_is_accepted(bad: str, unit: str) -> None:
    from foundry_attn.integrations.composer.attention_inspector import AttentionInspector
    from foundry_attn.integrations.composer.upad_tracer import UpadTracer

    for cls, name in ((AttentionInspector, "attention_inspector"), (UpadTracer, "upad_tracer")):
        with pytest.raises(ValueError) as info:
            cls(log_interval=bad)
        message = str(info.value)
        assert message.startswith(f"{name}: log_interval must be an integer >= 1")
        assert "a time string in batches such as '25ba'" in message and "a composer Time in batches" in message
        assert f"got {bad!r}, whose unit is {unit}, not batches ('ba')" in message


@pytest.mark.foundry
def test_block_mask_attention_modules_are_counted() -> None:
    """A flex ``BlockMask`` at the attention modules: its own kind, its own metric, its shape in the table."""
    from torch.nn.attention.flex_attention import create_block_mask

    from foundry_attn.integrations.composer.attention_inspector import summarize
    from foundry_attn.observe.console_table import format_table
    from foundry_attn.observe.probe import ModelInspector

    class ToyAttention(torch.nn.Module):
        def forward(self, hidden_states: torch.Tensor, attention_mask: object = None) -> torch.Tensor:
            return hidden_states

    class ToyBlock(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn = ToyAttention()

        def forward(self, hidden_states: torch.Tensor, attention_mask: object = None) -> torch.Tensor:
            return self.self_attn(hidden_states, attention_mask=attention_mask)

    class Toy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([ToyBlock(), ToyBlock()])

        def forward(self, hidden_states: torch.Tensor, attention_mask: object = None) -> torch.Tensor:
            for layer in self.layers:
                hidden_states = layer(hidden_states, attention_mask)
            return hidden_states

    model = Toy()
    block = create_block_mask(lambda b, h, q, k: q >= k, 1, None, 8, 8, device="cpu")
    with ModelInspector(model).capture() as records:
        model(torch.zeros(1, 8, 4), block)
    attn = [r for r in records if r["level"] == "attention"]
    assert len(attn) == 2 and all(r["mask"] == "BlockMask" and r["mask_shape"] == [1, 1, 8, 8] for r in attn)
    metrics = summarize(records)
    assert metrics["attn/mask_block_modules"] == 2.0
    assert metrics["attn/mask_none_modules"] == metrics["attn/mask_2d_modules"] == metrics["attn/mask_4d_modules"] == 0
    assert metrics["attn/mask_with_zeros_modules"] == 0.0  # a BlockMask is not read
    assert "BlockMask" in format_table(records)


@pytest.mark.foundry
def test_docs_callbacks_md_lists_every_logged_key_of_each_callback() -> None:
    """docs/callbacks.md is the reference of the logged keys, one section per callback: none missing, none made up;
    the class docstring shows the YAML and the Trainer, names its arguments and points there."""
    import inspect
    import re

    from foundry_attn.integrations.composer import attention_inspector, attn_decision, document_verdict, upad_tracer
    from foundry_attn.observe import inspector, probe, tracer
    from foundry_attn.observe.flash_symbols import ROLES

    doc = (Path(__file__).resolve().parents[2] / "docs" / "callbacks.md").read_text()
    sections = dict(re.findall(r"^## (\w+)\n(.*?)(?=^## |\Z)", doc, re.MULTILINE | re.DOTALL))
    for name, modules, cls, computed in (  # the inspector's metrics are summed in the core (probe.summarize)
        (
            "attention_inspector",
            (attention_inspector, document_verdict, probe, inspector),
            attention_inspector.AttentionInspector,
            set(),
        ),
        ("attn_decision", (attn_decision,), attn_decision.AttnDecision, set()),
        ("upad_tracer", (upad_tracer, tracer), upad_tracer.UpadTracer, {f"attn/{r}_calls_per_step" for r in ROLES}),
    ):
        source = "".join(inspect.getsource(m) for m in modules)
        logged = set(re.findall(r'"(attn/[a-z0-9_]+)"', source)) | computed
        documented = set(re.findall(r"`(attn/[a-z0-9_]+)`", sections[name]))
        assert logged and logged == documented, (name, logged ^ documented)
        assert "from composer import Trainer" in cls.__doc__ and "callbacks:" in cls.__doc__
        assert f"docs/callbacks.md ({name})" in cls.__doc__
        assert "Args:" in cls.__doc__ and cls.__name__ in modules[0].__all__


@pytest.mark.foundry
def test_bad_selector_regex_fails_at_construction() -> None:
    from foundry_attn.integrations.composer.attention_inspector import AttentionInspector

    with pytest.raises(ValueError, match="not a valid regular expression"):
        AttentionInspector(attention_selector="(")


@pytest.mark.slow
@pytest.mark.foundry
def test_registered_as_llmfoundry_callbacks() -> None:
    from llmfoundry.registry import callbacks

    from foundry_attn.integrations.composer.attention_inspector import AttentionInspector
    from foundry_attn.integrations.composer.attn_decision import AttnDecision
    from foundry_attn.integrations.composer.upad_tracer import UpadTracer

    assert callbacks.get("attention_inspector") is AttentionInspector
    assert callbacks.get("upad_tracer") is UpadTracer
    assert callbacks.get("attn_decision") is AttnDecision


# ---- real Composer Trainer runs ---------------------------------------------------------------------------


class _Probe:
    """Counts hooks on the HF model at each microbatch's BEFORE_FORWARD / AFTER_FORWARD (runs after ours)."""

    def __new__(cls, *args: object, **kwargs: object):  # build the Callback subclass lazily (composer import)
        from composer.core import Callback

        class Probe(Callback):
            def __init__(self) -> None:
                self.before: list[tuple[int, int]] = []
                self.after: list[tuple[int, int]] = []

            def _count(self, state) -> tuple[int, int]:
                """(hooks on the HF model itself, pre-hooks on its submodules)."""
                hf = state.model.model
                inner = sum(len(m._forward_pre_hooks) for m in hf.modules() if m is not hf)
                return len(hf._forward_pre_hooks) + len(hf._forward_hooks), inner

            def before_forward(self, state, logger) -> None:
                self.before.append(self._count(state))

            def after_forward(self, state, logger) -> None:
                self.after.append(self._count(state))

        return Probe()


def _trainer(
    assets: Path,
    tokenizer,
    tmp_path: Path,
    callbacks: list,
    impl: str = "flash_attention_2",
    padding: str = "pack",
    batches: int = 3,
    rows: int = 8,
):
    from composer import Trainer
    from composer.loggers import InMemoryLogger
    from torch.utils.data import DataLoader

    from foundry_attn.flat.packing import PaddingCollator
    from foundry_attn.integrations.llm_foundry.model import FoundryAttnCausalLM

    model = FoundryAttnCausalLM(
        tokenizer=tokenizer,
        pretrained_model_name_or_path=str(assets / "tiny-llama"),
        pretrained=False,
        attn_implementation=impl,
        fa2_reference_kernel=impl == "flash_attention_2",
        events_dir=str(tmp_path / "ev"),
    )
    gen = torch.Generator().manual_seed(0)
    docs = [
        [*torch.randint(2, len(tokenizer), (int(n),), generator=gen).tolist(), tokenizer.eos_token_id]
        for n in torch.randint(5, 20, (rows * batches * 2,), generator=gen)
    ]
    collate = PaddingCollator(tokenizer.pad_token_id, tokenizer.eos_token_id, 48, mode=padding)
    loader = DataLoader(docs, batch_size=rows, collate_fn=lambda ex: collate([torch.tensor(e) for e in ex]))
    memory = InMemoryLogger()
    trainer = Trainer(
        model=model,
        train_dataloader=loader,
        max_duration=f"{batches}ba",
        callbacks=callbacks,
        loggers=[memory],
        device="cpu",
        precision="fp32",
        progress_bar=False,
        log_to_console=False,
        optimizers=torch.optim.SGD(model.parameters(), lr=1e-3),
        run_name="cb-test",
        seed=0,
    )
    return trainer, memory


def _series(memory, key: str) -> list[float]:
    return [float(v) for _, v in memory.data.get(key, [])]


@pytest.mark.slow
def test_trainer_fa2_reference_both_callbacks(assets: Path, tokenizer, tmp_path: Path, capsys) -> None:
    from foundry_attn.integrations.composer.attention_inspector import AttentionInspector
    from foundry_attn.integrations.composer.upad_tracer import UpadTracer
    from tests.conftest import read_events

    before = snapshot()
    events = tmp_path / "cb-events"
    inspector = AttentionInspector(log_interval=2, events_dir=str(events))
    tracer = UpadTracer(log_interval=2, events_dir=str(events))
    probe = _Probe()
    trainer, memory = _trainer(assets, tokenizer, tmp_path, [inspector, tracer, probe], padding="mask")
    trainer.fit()
    assert_restored(before, traced=True)
    # sampled batches 0 and 2 only; hooks exist from BEFORE_FORWARD to the end of that forward, never otherwise
    # (inspector: model pre + post, tracer: model pre + post; inspector: 2 layers + 2 attention modules; batch 0's
    # verdict: the forward's input embeddings, read by a pre-hook and a hook on the embedding module)
    assert probe.before == [(4, 5), (0, 0), (4, 4)]
    assert probe.after == [(2, 0), (0, 0), (2, 0)]  # the tracer's stay on the model until BATCH_END
    # our unpad-once FA2 path: no per-layer unpad, one varlen call per layer, no mask at attention level
    assert _series(memory, "attn/upad_calls_per_step") == [0.0, 0.0]
    assert _series(memory, "attn/varlen_calls_per_step") == [2.0, 2.0]
    assert _series(memory, "attn/dense_calls_per_step") == [0.0, 0.0]
    assert _series(memory, "attn/mask_none_modules") == [2.0, 2.0]
    fill = _series(memory, "attn/fill_ratio")
    assert len(fill) == 2 and all(0 < f < 1 for f in fill) and _series(memory, "attn/compute_fill_ratio") == [1, 1]
    traces = read_events(events, "upad_trace")
    assert [e["step"] for e in traces] == [0, 2] and traces[0]["kernel"].startswith("fa2-reference")
    cu = traces[0]["first"]["varlen"]["cu_seqlens_q"]
    assert cu[0] == 0 and cu == sorted(cu)
    assert traces[0]["max_seqlen"] == max(b - a for a, b in itertools.pairwise(cu))
    assert [e["step"] for e in read_events(events, "attn_inspect")] == [0, 2]
    out = capsys.readouterr().out
    assert out.count("attention_inspector: batch 0") == 1 and "LlamaAttention x2" in out  # the table, once
    assert "upad_tracer: batch 0: calls this step: _upad_input 0" in out and "kernel: fa2-reference" in out
    trainer.close()


@pytest.mark.slow
def test_trainer_not_fa2_says_nothing_to_trace_once(assets: Path, tokenizer, tmp_path: Path, caplog) -> None:
    from foundry_attn.integrations.composer.upad_tracer import UpadTracer

    tracer = UpadTracer(log_interval=1, events_dir=str(tmp_path / "ev"))
    trainer, memory = _trainer(assets, tokenizer, tmp_path, [tracer], impl="sdpa", batches=2)
    with caplog.at_level(logging.WARNING):
        trainer.fit()
        trainer.fit(duration="1ba")
    said = [r.getMessage() for r in caplog.records if "upad_tracer: nothing to trace" in r.getMessage()]
    assert len(said) == 1 and "'sdpa'" in said[0]  # once, through logging only (not printed as well)
    assert not _series(memory, "attn/upad_calls_per_step")
    trainer.close()


@pytest.mark.slow
def test_trainer_selector_matching_nothing_warns_once(assets: Path, tokenizer, tmp_path: Path, caplog) -> None:
    from foundry_attn.integrations.composer.attention_inspector import AttentionInspector
    from tests.conftest import read_events

    inspector = AttentionInspector(log_interval=1, attention_selector="NoSuchAttn", print_table=False)
    trainer, memory = _trainer(assets, tokenizer, tmp_path, [inspector], impl="sdpa", batches=2)
    with caplog.at_level(logging.WARNING):
        trainer.fit()
    warnings = [r.message for r in caplog.records if "matched no module" in r.message]
    assert len(warnings) == 1 and "LlamaAttention x2" in warnings[0]
    assert _series(memory, "attn/inspected_modules") == [3.0, 3.0]  # the model and its two layers still
    # no events_dir given: the events join the model's own (its events_dir), one per sampled batch
    inspected = read_events(tmp_path / "ev", "attn_inspect")
    assert [e["step"] for e in inspected] == [0, 1] and inspected[0]["attn_implementation"] == "sdpa"
    trainer.close()


@pytest.mark.slow
def test_originals_restored_when_training_raises(assets: Path, tokenizer, tmp_path: Path) -> None:
    from foundry_attn.integrations.composer.attention_inspector import AttentionInspector
    from foundry_attn.integrations.composer.upad_tracer import UpadTracer

    before = snapshot()
    tracer = UpadTracer(log_interval=1, events_dir=str(tmp_path / "ev"))
    inspector = AttentionInspector(log_interval=1, events_dir=str(tmp_path / "ev"), print_table=False)
    trainer, _ = _trainer(assets, tokenizer, tmp_path, [inspector, tracer])
    hf = trainer.state.model.model
    layer = hf.model.layers[1]
    calls = {"n": 0}
    real_forward = layer.forward

    def failing_forward(*args, **kwargs):
        from foundry_attn.proof.proving import proving

        if proving():  # the flat-path proof on the first batch (not traced, not inspected)
            return real_forward(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 2:  # the second batch, in the middle of the traced forward
            import transformers.modeling_flash_attention_utils as fa_utils

            assert traced_attributes(fa_utils)  # the tracer really is installed at this point
            raise RuntimeError("boom in layer 1")
        return real_forward(*args, **kwargs)

    layer.forward = failing_forward
    with pytest.raises(RuntimeError, match="boom in layer 1"):
        trainer.fit()
    assert_restored(before, traced=True)  # at once, by the always-call forward hook: no close() needed
    trainer.close()
    assert not hf._forward_hooks and not hf._forward_pre_hooks
    assert all(not m._forward_pre_hooks for m in hf.modules())


@pytest.mark.slow
def test_trainer_missing_symbol_said_once_and_training_goes_on(
    assets: Path, tokenizer, tmp_path: Path, caplog, monkeypatch
) -> None:
    import foundry_attn.observe.tracer as tracer_module
    from foundry_attn.integrations.composer.upad_tracer import UpadTracer

    real = discover()
    found = {k: v for k, v in real.found.items() if k != UPAD}
    fake = fs.FlashSymbols("9.9.9", real.module, found, {UPAD: fs.CANDIDATES[UPAD]})
    monkeypatch.setattr(tracer_module, "discover", lambda: fake)
    tracer = UpadTracer(log_interval=1, events_dir=str(tmp_path / "ev"))
    trainer, memory = _trainer(assets, tokenizer, tmp_path, [tracer], batches=2)
    with caplog.at_level(logging.WARNING):
        trainer.fit()
    said = [
        r.getMessage()
        for r in caplog.records
        if "transformers 9.9.9 has none of _upad_input, prepare_fa_kwargs_from_attn_mask" in r.getMessage()
    ]
    assert len(said) == 1 and "training continues" in said[0]
    assert _series(memory, "attn/varlen_calls_per_step") == [2.0, 2.0]  # the rest is still traced
    assert _series(memory, "attn/upad_calls_per_step") == [0.0, 0.0]
    trainer.close()
