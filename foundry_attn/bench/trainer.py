"""TRL ``SFTTrainer(padding_free=True)``, stock against attached: speed, exactness, and the callbacks' cost.

    foundry-attn bench trainer --json           # make test-latest's stack (transformers 5.x + TRL), CPU, ~3 min
    foundry-attn bench trainer --json --quick   # smoke run: the tiny Llama, one repeat

``speed``: SmolLM2-135M's layer shapes cut to 4 layers, vocab 8192, fp32, the blog mix (six documents, 1395 real
tokens a step), seeded; each variant is its own ``SFTTrainer`` run of ``WARMUP + TIMED`` steps, the variants
interleaved ``REPEATS`` times; a step is timed from ``on_step_begin`` to ``on_step_end`` (forward, backward,
optimizer) and the warm-up steps (attach's proof, the first batch's proof) are left out: ``stock`` (no attach),
``ours`` (``attach(model, "sdpa")``), ``ours_inspect`` (:func:`foundry_attn.hf.callbacks`, every step inspected,
no verdict) and ``ours_verdict`` (every step a verdict). The callbacks' share of a step at their default intervals
(inspect every 50, verdict every 100) is each one's extra time over ``ours``, divided by its interval.
``families``: one step per family (the zoo's tiny configs), stock and attached: the step's next-token loss against
stock on each document alone (the truth), stock's leak where it leaks. Needs TRL (``pip install
'foundry-attn[hf]'``). Core module plus TRL.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F

from foundry_attn.bench import machine
from foundry_attn.bench.timing import median
from foundry_attn.shapes import BLOG_LENGTHS, SMOLLM2_135M_SHAPE, TINY_SHAPE, llama_config

COMMAND = "foundry-attn bench trainer --json"
WARMUP, TIMED, REPEATS = 2, 6, 2
VOCAB = 8192
LOSS_TOL = 1e-5
#: (model type, backend): stock exact on 5.x (Llama, Qwen3, Mistral with its window, Gemma2 eager), and the two whose
#: stock padding-free leaks (gpt-oss's sinks, Jamba's SSM state)
FAMILIES = (
    ("llama", "sdpa"),
    ("qwen3", "sdpa"),
    ("mistral", "sdpa"),
    ("gemma2", "eager"),
    ("gpt_oss", "eager"),
    ("jamba", "sdpa"),
)
#: the callbacks' default intervals (foundry_attn.hf.callbacks)
INSPECT_EVERY, VERDICT_EVERY = 50, 100


def _documents(vocab: int, lengths: tuple[int, ...], steps: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for _ in range(steps) for n in lengths]


class _StepClock:
    """Each step's wall time and the real tokens of its first forward."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        clock = self

        class Callback(TrainerCallback):
            def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
                clock.start = time.perf_counter()

            def on_step_end(self, *args: Any, **kwargs: Any) -> None:
                clock.seconds.append(time.perf_counter() - clock.start)

        self.start = 0.0
        self.seconds: list[float] = []
        self.callback = Callback()


class _FirstStep:
    """The first training forward's next-token loss (TRL's fused head: ``log_probs``) and its documents."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.loss: float | None = None
        self.docs: list[torch.Tensor] = []
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, _: Any, __: Any, kwargs: dict, out: Any) -> None:
        if self.loss is not None or getattr(out, "loss", None) is None:
            return
        targets = (kwargs["labels"][:, 1:] != -100).sum()
        log_probs = getattr(out, "log_probs", None)
        self.loss = out.loss.item() if log_probs is None else (-log_probs.sum() / targets).item()
        ids, starts = kwargs["input_ids"][0], (kwargs["position_ids"][0] == 0).nonzero()[:, 0].tolist()
        self.docs = [ids[a:b] for a, b in zip(starts, [*starts[1:], ids.numel()], strict=True)]
        self.handle.remove()


def _truth(stock: torch.nn.Module, docs: list[torch.Tensor]) -> float:
    with torch.no_grad():
        logits = [stock(input_ids=d[None]).logits[0, :-1].float() for d in docs]
        total = sum(float(F.cross_entropy(x, d[1:], reduction="sum")) for x, d in zip(logits, docs, strict=True))
    return total / sum(d.numel() - 1 for d in docs)


def _train(model: Any, data: list[list[int]], batch: int, steps: int, callbacks: list, out: str) -> Any:
    import datasets
    import trl

    from foundry_attn.foundry.assets import build_tokenizer

    args = trl.SFTConfig(
        output_dir=out,
        padding_free=True,
        max_length=None,
        bf16=False,  # fp32: exactness is judged at 1e-5
        gradient_checkpointing=False,
        per_device_train_batch_size=batch,
        max_steps=steps,
        logging_steps=10**6,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        train_sampling_strategy="sequential",  # every step the blog mix, in order
        disable_tqdm=True,
    )
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list([{"input_ids": d} for d in data]),
        processing_class=build_tokenizer(Path(out) / "tokenizer"),
        callbacks=callbacks,
    )
    with contextlib.redirect_stdout(io.StringIO()):  # the Trainer's and the inspector's console lines: not the JSON
        trainer.train()
    return trainer


def _speed_model(quick: bool) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    shape = TINY_SHAPE if quick else {**SMOLLM2_135M_SHAPE, "num_hidden_layers": 4}
    config = llama_config(VOCAB, **shape, attn_implementation="sdpa", attention_dropout=0.0)
    torch.manual_seed(0)
    return cast(torch.nn.Module, LlamaForCausalLM(config)).train()  # to mypy, transformers' classes are dummies


def speed(quick: bool) -> dict[str, Any]:
    from foundry_attn import hf
    from foundry_attn.paths import attach

    repeats, timed = (1, 2) if quick else (REPEATS, TIMED)
    steps = WARMUP + timed
    data = _documents(VOCAB, BLOG_LENGTHS, steps)
    never = 10**9
    variants: dict[str, dict[str, Any]] = {
        "stock": {},
        "ours": {"attach": True},
        "ours_inspect": {"attach": True, "hf": {"log_interval": 1, "verdict_interval": never}},
        "ours_verdict": {"attach": True, "hf": {"log_interval": never, "verdict_interval": 1}},
    }
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, how in variants.items():
            model = _speed_model(quick)
            if how.get("attach"):
                attach(model, "sdpa")
            clock = _StepClock()
            with tempfile.TemporaryDirectory() as out:
                extra = hf.callbacks(**how["hf"]) if "hf" in how else []
                _train(model, data, len(BLOG_LENGTHS), steps, [clock.callback, *extra], out)
            seconds[name] += clock.seconds[WARMUP:]
    step = {name: median(values) for name, values in seconds.items()}
    tokens = sum(BLOG_LENGTHS)
    inspect_share = (step["ours_inspect"] - step["ours"]) / step["ours"] / INSPECT_EVERY
    verdict_share = (step["ours_verdict"] - step["ours"]) / step["ours"] / VERDICT_EVERY
    return {
        "model": "tiny llama" if quick else "SmolLM2-135M shapes, 4 layers, vocab 8192",
        "tokens_per_step": tokens,
        "step_ms": {name: s * 1e3 for name, s in step.items()},
        "tokens_per_s": {name: tokens / s for name, s in step.items()},
        "ours_vs_stock": step["stock"] / step["ours"],
        "callbacks_share_at_defaults": max(0.0, inspect_share) + max(0.0, verdict_share),
        "inspect_share_at_defaults": inspect_share,
        "verdict_share_at_defaults": verdict_share,
    }


def family(model_type: str, backend: str) -> dict[str, Any]:
    """One step of stock and of attached on the same padding-free batch: each against the per-document truth."""
    from foundry_attn import zoo
    from foundry_attn.paths import attach

    if model_type not in zoo.model_types():
        return {"model_type": model_type, "backend": backend, "skipped": "not in this transformers"}
    config, model_class = zoo.tiny(model_type)
    out: dict[str, Any] = {"model_type": model_type, "backend": backend}
    for attached in (False, True):
        torch.manual_seed(0)
        model = zoo.build(config, model_class, backend).train()
        stock = copy.deepcopy(model)
        if attached:
            out["path"] = attach(model, backend).path
        first = _FirstStep(model)
        with tempfile.TemporaryDirectory() as tmp:
            _train(model, _documents(int(config.vocab_size), (5, 11, 3, 9), 1), 4, 1, [], tmp)
        assert first.loss is not None
        out["ours" if attached else "stock"] = first.loss - _truth(stock, first.docs)
    out["exact"] = abs(out["ours"]) <= LOSS_TOL
    out["stock_leaks"] = abs(out["stock"]) > LOSS_TOL
    return out


def run(quick: bool = False, device: str | None = None) -> dict[str, Any]:
    if device not in (None, "cpu"):
        raise SystemExit("foundry-attn bench trainer: CPU only (the Trainer's use_cpu)")
    if importlib.util.find_spec("trl") is None:
        return {
            "command": COMMAND,
            "skipped": "TRL is not installed (pip install 'foundry-attn[hf]'; make test-latest's stack has it)",
            "correct": None,
            "all_targets_met": None,
        }
    families = [family(t, b) for t, b in (FAMILIES[:1] if quick else FAMILIES)]
    ran = [f for f in families if "skipped" not in f]
    result = {"command": COMMAND + (" --quick" if quick else ""), **machine(), "speed": speed(quick)}
    stock_exact = next((not f["stock_leaks"] for f in ran if f["model_type"] == "llama"), False)
    result.update(
        families=families,
        correct=all(f["exact"] for f in ran),
        targets={
            "ours_vs_stock": {
                "value": result["speed"]["ours_vs_stock"],
                "target": ">= 0.95 (where stock is exact)",
                "met": result["speed"]["ours_vs_stock"] >= 0.95 if stock_exact else None,
            },
            "callbacks_share_at_defaults": {
                "value": result["speed"]["callbacks_share_at_defaults"],
                "target": "< 0.02",
                "met": result["speed"]["callbacks_share_at_defaults"] < 0.02,
            },
        },
    )
    result["all_targets_met"] = None if quick else all(t["met"] is not False for t in result["targets"].values())
    return result
