"""attention_inspector, upad_tracer and the flash-attention symbols they rest on: units, then real Trainer runs."""

from __future__ import annotations

import importlib
import logging
import types
from pathlib import Path

import pytest
import torch

from foundry_attn import flash_symbols as fs
from foundry_attn.fa2_reference import reference_flash_attn
from foundry_attn.flash_symbols import DENSE, PAD, POSIDS, UPAD, VARLEN, FlashCallTracer, discover
from foundry_attn.patching import patch_attribute

FA_MODULES = ("transformers.modeling_flash_attention_utils", "transformers.modeling_utils", "transformers.utils",
              "transformers.utils.import_utils")


def snapshot() -> dict[str, dict[str, object]]:
    return {name: dict(vars(importlib.import_module(name))) for name in FA_MODULES}


def assert_restored(before: dict[str, dict[str, object]]) -> None:
    after = snapshot()
    for name in FA_MODULES:
        assert before[name].keys() <= after[name].keys(), name
        added = [k for k in after[name].keys() - before[name].keys()
                 if not isinstance(after[name][k], types.ModuleType)]
        assert not added, (name, added)  # (lazily imported submodules may appear)
        assert not [k for k in before[name] if after[name][k] is not before[name][k]], name
    assert not list(fs.iter_traced())


# ---- symbol discovery --------------------------------------------------------------------------------------


def test_discover_the_installed_transformers_names() -> None:
    """The real names of both stacks we test on: 4.51 (pinned by LLM-Foundry) and 5.x (`make test-latest`)."""
    import transformers

    syms = discover()
    if transformers.__version__.startswith("4.51"):
        assert syms.found == {UPAD: "_upad_input", POSIDS: "prepare_fa2_from_position_ids",
                              VARLEN: "flash_attn_varlen_func", DENSE: "flash_attn_func", PAD: "pad_input"}
        assert syms.lazy_import is None
    else:
        lazy = "lazy_import_flash_attention()"
        assert syms.found == {UPAD: "_upad_input", POSIDS: "_prepare_from_posids", VARLEN: f"{lazy}[1]",
                              DENSE: f"{lazy}[0]", PAD: f"{lazy}[-2]"}
        assert syms.lazy_import == "lazy_import_flash_attention"
    assert syms.missing == {} and syms.describe_missing() == []


def _fake_5x_module() -> types.ModuleType:
    """A module shaped like later transformers: renamed helpers, kernels handed out by a lazy importer."""
    src = '''
import torch
_calls = []
def _upad_input(q, k, v, mask, qlen, unpad_fn):
    cu = torch.tensor([0, 2, 3], dtype=torch.int32)
    return q, k, v, None, (cu, cu), (2, 2)
def _prepare_from_posids(q, k, v, position_ids):
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    return q, k, v, (cu, cu), (2, 2)
def _flash(q, k, v, **kw):
    return q
def _varlen(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, **kw):
    return q
def _pad(x, idx, b, s):
    return x
_pad_fn = None
def lazy_import_flash_attention(implementation):
    global _pad_fn
    _pad_fn = _pad
    return (_flash, _varlen, _pad_fn, None), dict
def _flash_attention_forward(q, k, v, attention_mask, query_length, position_ids=None, impl=None):
    (flash_fn, varlen_fn, pad_fn, unpad_fn), process = lazy_import_flash_attention(impl)
    if attention_mask is not None:
        q, k, v, idx, (cq, ck), (mq, mk) = _upad_input(q, k, v, attention_mask, query_length, unpad_fn)
        return pad_fn(varlen_fn(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq, max_seqlen_k=mk), idx, 1, 1)
    if position_ids is not None:
        q, k, v, (cq, ck), (mq, mk) = _prepare_from_posids(q, k, v, position_ids)
        return varlen_fn(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq, max_seqlen_k=mk)
    return flash_fn(q, k, v)
'''
    mod = types.ModuleType("fake_fa_utils_5x")
    exec(compile(src, "fake_fa_utils_5x", "exec"), mod.__dict__)  # a fixture module
    return mod


def test_discover_and_trace_5x_successors_through_the_lazy_importer() -> None:
    mod = _fake_5x_module()
    syms = discover(mod)
    assert syms.found == {UPAD: "_upad_input", POSIDS: "_prepare_from_posids",
                          VARLEN: "lazy_import_flash_attention()[1]", DENSE: "lazy_import_flash_attention()[0]",
                          PAD: "lazy_import_flash_attention()[-2]"}
    q = torch.zeros(3, 1, 1)
    originals = dict(vars(mod))
    with FlashCallTracer(syms, module=mod) as tracer:
        mod._flash_attention_forward(q, q, q, torch.ones(1, 3), 3)
        mod._flash_attention_forward(q, q, q, None, 3, position_ids=torch.tensor([[0, 0, 1]]))
        mod._flash_attention_forward(q, q, q, None, 3)
    assert tracer.counts == {UPAD: 1, POSIDS: 1, VARLEN: 2, DENSE: 1, PAD: 1}
    assert tracer.first[UPAD]["cu_seqlens_q"] == [0, 2, 3] and tracer.first[POSIDS]["cu_seqlens_k"] == [0, 1, 3]
    assert tracer.first[VARLEN]["cu_seqlens_q"] == [0, 2, 3] and tracer.entry == VARLEN
    assert all(vars(mod)[k] is v for k, v in originals.items() if k != "_pad_fn")  # (set by the fake importer)


def test_missing_symbols_are_named_with_the_version() -> None:
    mod = types.ModuleType("bare_fa_utils")
    exec("def _flash_attention_forward(q):\n    return flash_attn_func(q)\n", mod.__dict__)
    syms = discover(mod)
    assert syms.found == {DENSE: "flash_attn_func"}
    lines = syms.describe_missing()
    assert any("_upad_input" in line and "prepare_fa_kwargs_from_attn_mask" in line for line in lines)
    assert all(line.startswith(f"transformers {syms.transformers_version} has none of") for line in lines)


# ---- layered patches: tracers and the reference kernel nest in any order ----------------------------------


@pytest.mark.parametrize("order", ["tracer_first", "reference_first", "interleaved"])
def test_tracer_and_reference_compose_in_any_order(order: str, llama) -> None:
    model = llama("flash_attention_2", seed=1)
    ids = torch.randint(1, 64, (2, 8))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    before = snapshot()
    tracer = FlashCallTracer()
    ref = reference_flash_attn()
    with torch.no_grad():
        if order == "tracer_first":
            tracer.attach()
            with ref:
                model(input_ids=ids, attention_mask=mask)
            tracer.detach()
        elif order == "reference_first":
            with ref:
                tracer.attach()
                model(input_ids=ids, attention_mask=mask)
                tracer.detach()
        else:  # the tracer outlives the reference context that it entered inside of
            ref.__enter__()
            tracer.attach()
            model(input_ids=ids, attention_mask=mask)
            ref.__exit__(None, None, None)
            fa_utils = importlib.import_module(FA_MODULES[0])
            assert "flash_attn_varlen_func" not in vars(fa_utils)  # reference gone; the tracer is dormant there
            assert fs.original(fa_utils, "_upad_input") is not fa_utils._upad_input  # and still traces the rest
            tracer.detach()
    assert tracer.counts[UPAD] == tracer.counts[VARLEN] == tracer.counts[PAD] == 2
    assert tracer.first[VARLEN]["cu_seqlens_q"] == [0, 8, 13]
    assert_restored(before)


def test_two_tracers_nest_and_leave_out_of_order(llama) -> None:
    model = llama("flash_attention_2", seed=2)
    ids = torch.randint(1, 64, (1, 6))
    before = snapshot()
    outer, inner = FlashCallTracer(), FlashCallTracer()
    with torch.no_grad(), reference_flash_attn():
        outer.attach()
        inner.attach()
        model(input_ids=ids)
        outer.detach()  # the first one leaves first
        model(input_ids=ids)
        inner.detach()
    assert outer.counts[DENSE] == 2 and inner.counts[DENSE] == 4  # two layers per forward
    assert outer.entry == inner.entry == DENSE
    assert_restored(before)


def test_patch_layers_restore_exactly_and_reject_bad_use() -> None:
    mod = types.ModuleType("m")
    mod.f = lambda: "orig"
    f = mod.f
    wrap = patch_attribute(mod, "f", wrap=lambda inner: (lambda: "w(" + inner() + ")"))
    rep = patch_attribute(mod, "f", replace=lambda: "ref")
    assert mod.f() == "w(ref)"  # a replacement always lies beneath a wrapper
    absent = patch_attribute(mod, "g", wrap=lambda inner: inner)
    assert not hasattr(mod, "g")  # a wrapper over nothing stays dormant
    wrap.remove()
    assert mod.f() == "ref"
    rep.remove()
    rep.remove()  # idempotent
    absent.remove()
    assert mod.f is f and not hasattr(mod, "g")
    with pytest.raises(ValueError, match="exactly one"):
        patch_attribute(mod, "f")


# ---- module discovery across architectures -------------------------------------------------------------


def _tiny(arch: str) -> torch.nn.Module:
    import transformers as tf

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    cfg = {
        "llama": lambda: tf.LlamaConfig(**common, num_key_value_heads=2),
        "mistral": lambda: tf.MistralConfig(**common, num_key_value_heads=2, sliding_window=None),
        "qwen2": lambda: tf.Qwen2Config(**common, num_key_value_heads=2),
        "gpt_neox": lambda: tf.GPTNeoXConfig(**common),
    }[arch]()
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg).eval()


class _DDPLike(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "gpt_neox"])
def test_inspector_finds_layers_and_attention_generically(arch: str) -> None:
    from foundry_attn.inspection import ModelInspector, discover_modules, find_hf_model

    model = _tiny(arch)
    name, hf = find_hf_model(_DDPLike(model))
    assert hf is model and name == ""
    mods = discover_modules(model)
    assert len(mods.layers) == 2 and len(mods.attention) == 2
    assert all(not n.startswith("module.") for n, _ in mods.layers + mods.attention)
    assert all("Attention" in type(m).__name__ for _, m in mods.attention)
    ids = torch.randint(1, 64, (2, 8))
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    with torch.no_grad(), ModelInspector(model).capture() as records:
        model(input_ids=ids, attention_mask=mask)
    assert [r["level"] for r in records].count("attention") == 2
    attn = [r for r in records if r["level"] == "attention"]
    assert all(r["mask"] == "4-D" and r["has_zeros"] and r["attn_implementation"] == "eager" for r in attn)
    model_rec = records[0]
    assert model_rec["level"] == "model" and model_rec["real_tokens"] == 14 and model_rec["fill_ratio"] == 14 / 16
    assert not model._forward_pre_hooks and not model._forward_hooks


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_inspector_sees_the_flat_row(llama, impl: str) -> None:
    """Unpadded once: one flat row of real tokens, no mask, one restart per document boundary."""
    from foundry_attn.adapters import attach
    from foundry_attn.forward import forward_documents
    from foundry_attn.inspection import BatchInfo, ModelInspector

    model = llama(impl)
    attach(model)
    batch = {"input_ids": torch.randint(1, 64, (2, 8)), "doc_lens": [[3, 5], [4]], "total_tokens": [8, 4]}
    with torch.no_grad(), ModelInspector(model).capture(BatchInfo.from_batch(batch)) as records:
        forward_documents(model, batch)
    attn = [r for r in records if r["level"] == "attention"]
    assert attn and all(r["mask"] == "none" and r["attn_implementation"] == impl for r in attn)
    assert records[0]["packed_positions"] and records[0]["position_restarts"] == 2


# ---- bad input ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, 1.5, "10", True])
@pytest.mark.foundry
def test_log_interval_must_be_a_positive_integer(bad: object) -> None:
    from foundry_attn.callbacks.attention_inspector import AttentionInspector
    from foundry_attn.callbacks.upad_tracer import UpadTracer

    for cls, name in ((AttentionInspector, "attention_inspector"), (UpadTracer, "upad_tracer")):
        with pytest.raises(ValueError, match=f"{name}: log_interval must be an integer >= 1"):
            cls(log_interval=bad)


@pytest.mark.parametrize("interval", [25, "25ba", "25BA", "time"])
@pytest.mark.foundry
def test_log_interval_takes_batches_as_an_integer_a_time_string_or_a_time(interval: object) -> None:
    from composer.core import Time, TimeUnit

    from foundry_attn.callbacks.attention_inspector import AttentionInspector
    from foundry_attn.callbacks.upad_tracer import UpadTracer

    value = Time(25, TimeUnit.BATCH) if interval == "time" else interval
    for cls in (AttentionInspector, UpadTracer):
        callback = cls(log_interval=value)
        assert callback.log_interval == 25 and type(callback.log_interval) is int


@pytest.mark.parametrize(("bad", "unit"), [("2ep", "epoch ('ep')"), ("100tok", "token ('tok')"),
                                           ("0.5dur", "duration ('dur')")])
@pytest.mark.foundry
def test_log_interval_in_another_unit_says_what_is_accepted(bad: str, unit: str) -> None:
    from foundry_attn.callbacks.attention_inspector import AttentionInspector
    from foundry_attn.callbacks.upad_tracer import UpadTracer

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

    from foundry_attn.callbacks.attention_inspector import summarize
    from foundry_attn.inspection import ModelInspector, format_table

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
    assert metrics["attn/mask_block_layers"] == 2.0
    assert metrics["attn/mask_none_layers"] == metrics["attn/mask_2d_layers"] == metrics["attn/mask_4d_layers"] == 0
    assert metrics["attn/mask_with_zeros_layers"] == 0.0  # a BlockMask is not read
    assert "BlockMask" in format_table(records)


@pytest.mark.foundry
def test_every_logged_key_is_in_its_callback_docstring() -> None:
    """The class docstrings are the reference of the logged keys: none missing, none made up."""
    import inspect
    import re

    from foundry_attn.callbacks import attention_inspector, attn_decision, upad_tracer
    from foundry_attn.flash_symbols import ROLES

    for module, cls, computed in ((attention_inspector, attention_inspector.AttentionInspector, set()),
                                  (attn_decision, attn_decision.AttnDecisionLogger, set()),
                                  (upad_tracer, upad_tracer.UpadTracer, {f"attn/{r}_calls_per_step" for r in ROLES})):
        logged = set(re.findall(r'"(attn/[a-z0-9_]+)"', inspect.getsource(module))) | computed
        documented = set(re.findall(r"``(attn/[a-z0-9_]+)``", cls.__doc__))
        assert logged and logged == documented, (cls.__name__, logged ^ documented)
        assert "from composer import Trainer" in cls.__doc__ and "callbacks:" in cls.__doc__
        assert "Args:" in cls.__doc__ and cls.__name__ in module.__all__


@pytest.mark.foundry
def test_bad_selector_regex_fails_at_construction() -> None:
    from foundry_attn.callbacks.attention_inspector import AttentionInspector

    with pytest.raises(ValueError, match="not a valid regular expression"):
        AttentionInspector(attention_selector="(")


@pytest.mark.foundry
def test_registered_as_llmfoundry_callbacks() -> None:
    from llmfoundry.registry import callbacks

    from foundry_attn.callbacks.attention_inspector import AttentionInspector
    from foundry_attn.callbacks.attn_decision import AttnDecisionLogger
    from foundry_attn.callbacks.upad_tracer import UpadTracer

    assert callbacks.get("attention_inspector") is AttentionInspector
    assert callbacks.get("upad_tracer") is UpadTracer
    assert callbacks.get("attn_decision") is AttnDecisionLogger


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


def _trainer(assets: Path, tokenizer, tmp_path: Path, callbacks: list, impl: str = "flash_attention_2",
             padding: str = "pack", batches: int = 3, rows: int = 8):
    from composer import Trainer
    from composer.loggers import InMemoryLogger
    from torch.utils.data import DataLoader

    from foundry_attn.foundry.model import FoundryAttnCausalLM
    from foundry_attn.packing import PaddingCollator

    model = FoundryAttnCausalLM(tokenizer=tokenizer, pretrained_model_name_or_path=str(assets / "tiny-llama"),
                                pretrained=False, attn_implementation=impl,
                                fa2_reference_kernel=impl == "flash_attention_2", events_dir=str(tmp_path / "ev"))
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(2, len(tokenizer), (int(n),), generator=gen).tolist() + [tokenizer.eos_token_id]
            for n in torch.randint(5, 20, (rows * batches * 2,), generator=gen)]
    collate = PaddingCollator(tokenizer.pad_token_id, tokenizer.eos_token_id, 48, mode=padding)
    loader = DataLoader(docs, batch_size=rows, collate_fn=lambda ex: collate([torch.tensor(e) for e in ex]))
    memory = InMemoryLogger()
    trainer = Trainer(model=model, train_dataloader=loader, max_duration=f"{batches}ba", callbacks=callbacks,
                      loggers=[memory], device="cpu", precision="fp32", progress_bar=False, log_to_console=False,
                      optimizers=torch.optim.SGD(model.parameters(), lr=1e-3), run_name="cb-test", seed=0)
    return trainer, memory


def _series(memory, key: str) -> list[float]:
    return [float(v) for _, v in memory.data.get(key, [])]


def test_trainer_fa2_reference_both_callbacks(assets: Path, tokenizer, tmp_path: Path, capsys) -> None:
    from foundry_attn.callbacks.attention_inspector import AttentionInspector
    from foundry_attn.callbacks.upad_tracer import UpadTracer
    from foundry_attn.events import read_events

    before = snapshot()
    events = tmp_path / "cb-events"
    inspector = AttentionInspector(log_interval=2, events_dir=str(events))
    tracer = UpadTracer(log_interval=2, events_dir=str(events))
    probe = _Probe()
    trainer, memory = _trainer(assets, tokenizer, tmp_path, [inspector, tracer, probe], padding="mask")
    trainer.fit()
    assert_restored(before)
    # sampled batches 0 and 2 only; hooks exist from BEFORE_FORWARD to the end of that forward, never otherwise
    # (inspector: model pre + post, tracer: model pre + post; inspector: 2 layers + 2 attention modules)
    assert probe.before == [(4, 4), (0, 0), (4, 4)]
    assert probe.after == [(2, 0), (0, 0), (2, 0)]  # the tracer's stay on the model until BATCH_END
    # our unpad-once FA2 path: no per-layer unpad, one varlen call per layer, no mask at attention level
    assert _series(memory, "attn/upad_calls_per_step") == [0.0, 0.0]
    assert _series(memory, "attn/varlen_calls_per_step") == [2.0, 2.0]
    assert _series(memory, "attn/dense_calls_per_step") == [0.0, 0.0]
    assert _series(memory, "attn/mask_none_layers") == [2.0, 2.0]
    fill = _series(memory, "attn/fill_ratio")
    assert len(fill) == 2 and all(0 < f < 1 for f in fill) and _series(memory, "attn/compute_fill_ratio") == [1, 1]
    traces = read_events(events, "upad_trace")
    assert [e["step"] for e in traces] == [0, 2] and traces[0]["kernel"].startswith("fa2-reference")
    cu = traces[0]["first"]["varlen"]["cu_seqlens_q"]
    assert cu[0] == 0 and cu == sorted(cu)
    assert traces[0]["max_seqlen"] == max(b - a for a, b in zip(cu, cu[1:], strict=False))
    assert [e["step"] for e in read_events(events, "attn_inspect")] == [0, 2]
    out = capsys.readouterr().out
    assert out.count("attention_inspector: batch 0") == 1 and "LlamaAttention x2" in out  # the table, once
    assert "upad_tracer: batch 0: calls this step: _upad_input 0" in out and "kernel: fa2-reference" in out
    trainer.close()


def test_trainer_not_fa2_says_nothing_to_trace_once(assets: Path, tokenizer, tmp_path: Path, capsys) -> None:
    from foundry_attn.callbacks.upad_tracer import UpadTracer

    tracer = UpadTracer(log_interval=1, events_dir=str(tmp_path / "ev"))
    trainer, memory = _trainer(assets, tokenizer, tmp_path, [tracer], impl="sdpa", batches=2)
    trainer.fit()
    trainer.fit(duration="1ba")
    out = capsys.readouterr().out
    assert out.count("upad_tracer: nothing to trace") == 1 and "'sdpa'" in out
    assert not _series(memory, "attn/upad_calls_per_step")
    trainer.close()


def test_trainer_selector_matching_nothing_warns_once(assets: Path, tokenizer, tmp_path: Path, caplog) -> None:
    from foundry_attn.callbacks.attention_inspector import AttentionInspector
    from foundry_attn.events import read_events

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


def test_originals_restored_when_training_raises(assets: Path, tokenizer, tmp_path: Path) -> None:
    from foundry_attn.callbacks.attention_inspector import AttentionInspector
    from foundry_attn.callbacks.upad_tracer import UpadTracer

    before = snapshot()
    tracer = UpadTracer(log_interval=1, events_dir=str(tmp_path / "ev"))
    inspector = AttentionInspector(log_interval=1, events_dir=str(tmp_path / "ev"), print_table=False)
    trainer, _ = _trainer(assets, tokenizer, tmp_path, [inspector, tracer])
    hf = trainer.state.model.model
    layer = hf.model.layers[1]
    calls = {"n": 0}
    real_forward = layer.forward

    def failing_forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the second batch, in the middle of the traced forward
            import transformers.modeling_flash_attention_utils as fa_utils

            assert list(fs.iter_traced(fa_utils))  # the tracer really is installed at this point
            raise RuntimeError("boom in layer 1")
        return real_forward(*args, **kwargs)

    layer.forward = failing_forward
    with pytest.raises(RuntimeError, match="boom in layer 1"):
        trainer.fit()
    assert_restored(before)  # at once, by the always-call forward hook: no close() needed
    trainer.close()
    assert not hf._forward_hooks and not hf._forward_pre_hooks
    assert all(not m._forward_pre_hooks for m in hf.modules())


def test_trainer_missing_symbol_said_once_and_training_goes_on(assets: Path, tokenizer, tmp_path: Path, capsys,
                                                               monkeypatch) -> None:
    import foundry_attn.callbacks.upad_tracer as upad_module
    from foundry_attn.callbacks.upad_tracer import UpadTracer

    real = discover()
    found = {k: v for k, v in real.found.items() if k != UPAD}
    fake = fs.FlashSymbols("9.9.9", real.module, found, {UPAD: fs.CANDIDATES[UPAD]})
    monkeypatch.setattr(upad_module, "discover", lambda: fake)
    tracer = UpadTracer(log_interval=1, events_dir=str(tmp_path / "ev"))
    trainer, memory = _trainer(assets, tokenizer, tmp_path, [tracer], batches=2)
    trainer.fit()
    out = capsys.readouterr().out
    assert out.count("transformers 9.9.9 has none of _upad_input, prepare_fa_kwargs_from_attn_mask") == 1
    assert "training continues" in out
    assert _series(memory, "attn/varlen_calls_per_step") == [2.0, 2.0]  # the rest is still traced
    assert _series(memory, "attn/upad_calls_per_step") == [0.0, 0.0]
    trainer.close()
