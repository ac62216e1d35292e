"""``foundry_attn_causal_lm`` as a drop-in for stock ``hf_causal_lm``: the same seed gives the same model and RNG
state, the forward returns the batch's shape, and the weights load as often as stock loads them, errors included."""

from __future__ import annotations

import collections
import copy
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from foundry_attn.flat.packing import IGNORE_INDEX, PaddingCollator
from foundry_attn.selection.backend_checks import fa2_smoke_test, torch_varlen_smoke_test
from foundry_attn.selection.capability import flex_backward_error, probe

SEED = 17
STOCK, OURS = "hf_causal_lm", "foundry_attn_causal_lm"
LM_METRICS = ("LanguageCrossEntropy", "LanguagePerplexity", "TokenAccuracy")


def _rng_states() -> list[torch.Tensor]:
    """The global RNG: the CPU's, and every CUDA device's."""
    return [torch.get_rng_state(), *(torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [])]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _build(name: str, path: Path | str, tmp_path: Path, seed: int | None = SEED, **cfg: Any) -> Any:
    """A model by its registry name, as a YAML builds it (``pretrained: false`` unless given)."""
    from llmfoundry.utils.builders import build_composer_model

    cfg = {"pretrained_model_name_or_path": str(path), "pretrained": False, **cfg}
    if name == OURS:
        cfg.setdefault("events_dir", str(tmp_path / "events"))
    if seed is not None:
        torch.manual_seed(seed)
    return build_composer_model(name=name, cfg=cfg, tokenizer=None)


def _padded_batch(vocab: int, lengths: tuple[int, ...] = (12, 7, 16), width: int = 16) -> dict[str, torch.Tensor]:
    """What LLM-Foundry's stock loaders give: rows right-padded, a 2-D mask, labels -100 at padding."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (len(lengths), width), generator=gen)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)}


# ---- 1. the same seed, the same model ---------------------------------------------------------------------------


def test_probe_and_smoke_calls_leave_the_global_rng_alone() -> None:  # core only: also without Composer
    flex_backward_error.cache_clear()  # the flex probe runs once per process: run it again here
    before = _rng_states()
    probe()
    assert _same(_rng_states(), before)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for smoke in (fa2_smoke_test, torch_varlen_smoke_test):  # on this CPU they fail after drawing their inputs
        smoke(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
        assert _same(_rng_states(), before), smoke.__name__


@pytest.mark.slow
@pytest.mark.foundry
@pytest.mark.parametrize("impl", ["auto", "sdpa"])
def test_same_seed_same_weights_rng_and_first_loss(assets: Path, tmp_path: Path, impl: str) -> None:
    """Stock (its default attention for ``auto``) and ours under one seed: the same weights, the same RNG state
    after the build, the same loss on the first training batch."""
    path = assets / "tiny-llama"
    stock = _build(STOCK, path, tmp_path, **({} if impl == "auto" else {"attn_implementation": impl}))
    stock_rng = _rng_states()
    ours = _build(OURS, path, tmp_path, attn_implementation=impl)
    assert _same(_rng_states(), stock_rng)
    theirs, mine = stock.model.state_dict(), ours.model.state_dict()
    assert theirs.keys() == mine.keys()
    assert all(torch.equal(theirs[k], mine[k]) for k in theirs)
    batch = _padded_batch(stock.config.vocab_size)
    losses = []
    for model in (stock, ours):
        model.train()
        losses.append(model.loss(model(dict(batch)), batch))
    assert losses[1].item() == pytest.approx(losses[0].item(), abs=1e-6)


# ---- 2. the same outputs ----------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.foundry
@pytest.mark.parametrize("attn_path", ["auto", "rows"])
def test_forward_returns_the_batch_shape_and_metrics_equal_stock(assets: Path, tmp_path: Path, attn_path: str) -> None:
    path = assets / "tiny-llama"
    stock = _build(STOCK, path, tmp_path, attn_implementation="sdpa")
    ours = _build(OURS, path, tmp_path, attn_implementation="sdpa", attn_path=attn_path)
    assert ours.attn_decision.path == ("flat" if attn_path == "auto" else "rows")
    vocab = stock.config.vocab_size
    batch = _padded_batch(vocab)
    real = batch["attention_mask"].bool()
    stock.eval()
    ours.eval()
    with torch.no_grad():
        theirs, mine = stock(dict(batch)), ours(dict(batch))
    assert mine.logits.shape == theirs.logits.shape == (*batch["input_ids"].shape, vocab)
    torch.testing.assert_close(mine.logits[real], theirs.logits[real], rtol=1e-5, atol=1e-5)
    assert not mine.logits[~real].any()  # padding: zeros (every metric ignores it)
    torch.testing.assert_close(mine.loss, theirs.loss, rtol=1e-6, atol=1e-6)
    computed = []
    for model in (stock, ours):
        metrics = {k: v for k, v in model.get_metrics(is_train=False).items() if k in LM_METRICS}
        with torch.no_grad():
            fresh = {k: v.clone() for k, v in batch.items()}  # eval_forward shifts the labels in place
            outputs = model.eval_forward(fresh)
            for metric in metrics.values():
                model.update_metric(fresh, outputs, metric)
        computed.append({name: float(m.compute()) for name, m in metrics.items()})
    assert computed[1].keys() == computed[0].keys() == set(LM_METRICS)
    for name, value in computed[0].items():
        assert computed[1][name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


@pytest.mark.slow
@pytest.mark.foundry
@pytest.mark.parametrize("mode", ["pack", "mask"])
def test_our_collated_batches_come_back_in_their_shape(assets: Path, tmp_path: Path, mode: str) -> None:
    ours = _build(OURS, assets / "tiny-llama", tmp_path, attn_implementation="sdpa")
    vocab = ours.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    rows = []
    for lengths in LENGTHS:  # documents end with EOS (0); padding after
        row = torch.zeros(16, dtype=torch.long)
        at = 0
        for n in lengths:
            row[at : at + n - 1] = torch.randint(1, vocab, (n - 1,), generator=gen)
            at += n
        rows.append(row)
    batch = PaddingCollator(0, 0, 16, mode=mode)(rows)
    # the truth, without the collator: stock on each document alone (pack), each row's real tokens alone (mask)
    stock = copy.deepcopy(ours.model)
    del stock.foundry_path
    stock.config._attn_implementation = "sdpa"
    if mode == "pack":
        pieces = [row[at - n : at] for row, lengths in zip(rows, LENGTHS, strict=True) for at, n in _ends(lengths)]
    else:
        pieces = [row[: sum(lengths)] for row, lengths in zip(rows, LENGTHS, strict=True)]
    with torch.no_grad():
        total = sum(F.cross_entropy(stock(input_ids=p[None]).logits[0, :-1], p[1:], reduction="sum") for p in pieces)
    want = float(total) / sum(p.numel() - 1 for p in pieces)
    out = ours(batch)
    assert out.logits.shape == (*batch["input_ids"].shape, vocab)
    assert abs(out.loss.item() - want) <= 1e-5, (out.loss.item(), want)
    out.loss.backward()  # the loss is the one computed on the layout, connected to the weights
    assert next(ours.parameters()).grad is not None


LENGTHS = ((9, 5), (12,), (3, 4, 6))


def _ends(lengths: tuple[int, ...]) -> list[tuple[int, int]]:
    """(end, length) of each document of a row."""
    return [(sum(lengths[: i + 1]), n) for i, n in enumerate(lengths)]


# ---- 3. one load, and errors as stock raises them ---------------------------------------------------------------


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> Iterator[collections.Counter]:
    """Counts ``from_pretrained`` / ``from_config`` calls, model constructions and checkpoint reads."""
    from transformers import AutoModelForCausalLM, PreTrainedModel

    counts: collections.Counter = collections.Counter()

    def counted(name: str, method: Any) -> Any:
        def call(cls: type, *args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return method(cls, *args, **kwargs)

        return classmethod(call)

    for owner, name in [
        (AutoModelForCausalLM, "from_pretrained"),
        (AutoModelForCausalLM, "from_config"),
        (PreTrainedModel, "_load_pretrained_model"),
    ]:
        monkeypatch.setattr(owner, name, counted(name, getattr(owner, name).__func__))
    init = PreTrainedModel.__init__

    def counted_init(self: Any, *args: Any, **kwargs: Any) -> None:
        if type(self).__name__.endswith("ForCausalLM"):  # the model, not the base model it builds inside
            counts["model_init"] += 1
        init(self, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "__init__", counted_init)
    yield counts


def _saved(tmp_path: Path, model_type: str) -> Path:
    """A tiny model of ``model_type`` saved with its weights (random, seeded): ``pretrained: true`` loads them."""
    from foundry_attn.verify import zoo

    config, model_class = zoo.tiny(model_type)
    folder = tmp_path / f"{model_type}-weights"
    zoo.build(config, model_class, "eager").save_pretrained(folder)
    return folder


def _counted_build(loads: collections.Counter, *args: Any, **kwargs: Any) -> tuple[Any, dict[str, int]]:
    loads.clear()
    model = _build(*args, **kwargs)
    return model, dict(loads)


@pytest.mark.slow
@pytest.mark.foundry
@pytest.mark.parametrize(
    ("model_type", "request_"),
    [
        ("llama", {"attn_implementation": "auto"}),  # a normal build
        ("llama", {"attn_implementation": "sdpa"}),
        ("opt", {"attn_implementation": "flex_attention", "attn_fallback": ["sdpa"]}),  # OPT has no flex
        ("llama", {"attn_implementation": "flash_attention_2", "attn_fallback": ["sdpa"]}),  # without flash-attn
    ],
)
def test_weights_load_as_often_as_stock(
    tmp_path: Path, loads: collections.Counter, model_type: str, request_: dict
) -> None:
    """A pretrained build loads as stock's sdpa build loads, also when the first candidate is refused."""
    from foundry_attn.verify import zoo

    if request_["attn_implementation"] == "flash_attention_2" and probe().flash_attn_version:
        pytest.skip("flash-attn is installed: FA2 is not refused here")
    if request_["attn_implementation"] == "flex_attention" and zoo.tiny(model_type)[1]._supports_flex_attn:
        pytest.skip(f"{model_type} supports flex_attention in this transformers")
    folder = _saved(tmp_path, model_type)
    _, stock = _counted_build(loads, STOCK, folder, tmp_path, pretrained=True, attn_implementation="sdpa")
    model, ours = _counted_build(loads, OURS, folder, tmp_path, pretrained=True, **request_)
    assert stock["_load_pretrained_model"] >= 1
    assert ours == stock
    if request_["attn_implementation"] != "auto":  # refused before the load, by our checks and transformers'
        assert model.attn_decision.chosen == "sdpa"


@pytest.mark.slow
@pytest.mark.foundry
@pytest.mark.parametrize(
    "error_cfg",
    [
        # raised after the model is built: "PEFT is not installed" without peft, "Only LORA is supported" with it
        {"pretrained": True, "peft_config": {"peft_type": "PREFIX_TUNING", "task_type": "CAUSAL_LM"}},
        {"pretrained": True, "config_overrides": {"no_such_key": 1}},  # before anything is built
    ],
    ids=["peft_config", "config_overrides"],
)
def test_errors_not_about_attention_surface_unchanged(
    tmp_path: Path, loads: collections.Counter, caplog: pytest.LogCaptureFixture, error_cfg: dict
) -> None:
    folder = _saved(tmp_path, "llama")
    raised, counts = [], []
    for name in (STOCK, OURS):
        loads.clear()
        caplog.clear()
        with caplog.at_level(logging.INFO), pytest.raises(Exception) as info:
            _build(name, folder, tmp_path, attn_implementation="sdpa", **error_cfg)
        raised.append((type(info.value), str(info.value)))
        counts.append(dict(loads))
    assert raised[1] == raised[0]  # the same type, the same text
    assert counts[1] == counts[0]  # no retry: no load beyond stock's
    blamed = [r.getMessage() for r in caplog.records if r.name.startswith("foundry_attn")]
    assert not [m for m in blamed if raised[0][1][:30] in m], blamed  # no log line puts it on attention
