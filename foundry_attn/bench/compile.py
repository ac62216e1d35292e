"""torch.compile with packed batches whose layout changes every step: graphs, warm-up and speed vs eager.

    foundry-attn bench compile --json               # CPU, sdpa: the tiny model and a SmolLM2-shaped 2-layer one
    foundry-attn bench compile --json --device cuda  # GPU: bf16
    foundry-attn bench compile --json --quick        # smoke run: the tiny model, 12 layouts

Workload per model: ``layouts`` (50) seeded packed batches, each a different set of documents laid end to end
(``PaddingCollator(mode="pack")``) so no two steps share a layout: the tiny demo model
(``foundry_attn.verify.llama_shapes``, vocab 64) with 8 documents of 10-60 tokens in rows of 128, and SmolLM2-135M's
layer shapes with 2 layers and vocab 8192 with 6 documents of 100-400 tokens in rows of 2048. A step is
``forward_documents`` + backward on the model attached to our sdpa function (fp32 on CPU, bf16 on CUDA), grads set to
None between steps.

Beside them (not under ``--quick``), the cold compile: SmolLM2-135M's shapes with all 30 layers, vocab 8192, three
documents (100, 60, 90 tokens), inductor's caches off; the seconds the first compiled step takes over the next, for
stock's ``torch.compile(model)`` on the documents as padded rows and for ours (``attach(..., execution="compiled")``:
the decoder layers compiled once per kind of layer, shared by all 30).

Two variants with identical weights: ``eager`` and ``compiled`` (``torch.compile(model)``, inductor). The first
``warmup`` layouts run on both untimed (``warmup_s``: the compiled variant's wall time for them, compiling
included); the rest are timed round-robin (``bench.timing.round_robin``: one layout a round, the order alternating
each round, GC off inside a step), and each compiled loss is checked against the eager one. ``graphs`` counts
graphs inductor compiled (all, and after warm-up), ``graph_breaks`` Dynamo's breaks; ``speedup`` = eager median
step / compiled median step (target >= 1.5 on CPU after warm-up).
Core module: torch and transformers only.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any, cast

import torch

from foundry_attn.attention.backends import SDPA
from foundry_attn.bench import machine, on_device, sync
from foundry_attn.bench.timing import median, round_robin
from foundry_attn.flat.packing import PaddingCollator
from foundry_attn.path.attach import attach
from foundry_attn.path.forward import forward_documents
from foundry_attn.verify.conformance import rows_inputs
from foundry_attn.verify.llama_shapes import SMOLLM2_135M_SHAPE, TINY_SHAPE, llama_config

COMMAND = "foundry-attn bench compile --json"
EOS = 0
#: model -> (vocab, shape, documents per batch, (shortest, longest) document, row width)
WORKLOADS = {
    "tiny": (64, TINY_SHAPE, 8, (10, 60), 128),
    "smollm2_2_layers": (8192, {**SMOLLM2_135M_SHAPE, "num_hidden_layers": 2}, 6, (100, 400), 2048),
}
TARGET = 1.5
#: the cold compile's documents (tokens each) and row width
COLD_DOCUMENTS, COLD_WIDTH = (100, 60, 90), 256


def batches(name: str, count: int, device: torch.device, seed: int = 0) -> list[dict[str, Any]]:
    vocab, _, docs, (low, high), width = WORKLOADS[name]
    rng = random.Random(seed)
    collate = PaddingCollator(EOS, EOS, width, mode="pack")
    out = []
    for _ in range(count):
        rows = [
            torch.tensor([*(rng.randrange(1, vocab) for _ in range(rng.randint(low, high) - 1)), EOS])
            for _ in range(docs)
        ]
        batch = collate(rows)
        out.append(on_device(batch, device))
    return out


def build(name: str, device: torch.device) -> torch.nn.Module:
    """The workload's model, attached to our sdpa function."""
    vocab, shape, *_ = WORKLOADS[name]
    model = _model(vocab, shape, device)
    attach(model, SDPA)
    return model


def _model(vocab: int, shape: dict[str, Any], device: torch.device) -> torch.nn.Module:
    """A seeded Llama of ``shape`` on stock sdpa, training (fp32 on a CPU, bf16 elsewhere): not attached."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    # to mypy, transformers' top-level classes are dummies (no nn.Module methods)
    config = llama_config(vocab, **shape, attn_implementation=SDPA, attention_dropout=0.0)
    model = cast(torch.nn.Module, LlamaForCausalLM(config))
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    return model.to(device=device, dtype=dtype).train()


def _timed(model: torch.nn.Module, loss: Callable[[], torch.Tensor], device: torch.device) -> float:
    """Seconds of one forward (``loss()``) + backward, ``model``'s grads set to None before."""
    model.zero_grad(set_to_none=True)
    sync(device)
    start = time.perf_counter()
    loss().backward()
    sync(device)
    return time.perf_counter() - start


def _documents_loss(runner: Any, batch: dict[str, Any]) -> Callable[[], torch.Tensor]:
    """The loss of ``forward_documents(runner, batch)``, as a step to time."""
    return lambda: forward_documents(runner, batch).loss


def measure(name: str, device: torch.device, layouts: int, warmup: int) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled_graphs: list[int] = []

    def inductor(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        compiled_graphs.append(len(gm.graph.nodes))
        return torch._dynamo.lookup_backend("inductor")(gm, example_inputs)

    eager_model, compiled_model = build(name, device), build(name, device)
    compiled = torch.compile(compiled_model, backend=inductor)
    data = batches(name, layouts, device)
    warmup_s = 0.0
    for batch in data[:warmup]:
        _timed(eager_model, _documents_loss(eager_model, batch), device)
        warmup_s += _timed(compiled_model, _documents_loss(compiled, batch), device)
    after_warmup = len(compiled_graphs)
    models = {"eager": eager_model, "compiled": compiled_model}

    def steps(runner: Any) -> Callable[[], torch.Tensor]:
        timed = iter(data[warmup:])  # each variant is called once a round: round i steps on layout warmup + i

        def step() -> torch.Tensor:
            loss = forward_documents(runner, next(timed)).loss
            loss.backward()
            return loss.detach()

        return step

    times = round_robin(
        {"eager": steps(eager_model), "compiled": steps(compiled)},
        len(data) - warmup,
        device=device,
        before=lambda variant: models[variant].zero_grad(set_to_none=True),
    )
    worst = max(
        (abs(c.item() - e.item()) for c, e in zip(times.values["compiled"], times.values["eager"], strict=True)),
        default=0.0,
    )
    eager_ms = median(times.seconds["eager"]) * 1e3
    compiled_ms = median(times.seconds["compiled"]) * 1e3
    tolerance = 1e-4 if device.type == "cpu" else 5e-2
    return {
        "model": name,
        "layouts": layouts,
        "distinct_layouts": len({str(b["doc_lens"]) for b in data}),
        "graphs": len(compiled_graphs),
        "graphs_after_warmup": len(compiled_graphs) - after_warmup,
        "graph_breaks": sum(counters["graph_break"].values()),
        "warmup_s": warmup_s,
        "eager_step_ms": eager_ms,
        "compiled_step_ms": compiled_ms,
        "speedup": eager_ms / compiled_ms,
        "max_loss_diff": worst,
        "losses_agree": worst <= tolerance,
        "real_tokens_per_step": statistics.mean(sum(b["total_tokens"]) for b in data),
    }


def cold_compile(device: torch.device, layers: int = SMOLLM2_135M_SHAPE["num_hidden_layers"]) -> dict[str, Any]:
    """The seconds the first compiled step takes over the next, inductor's caches off: stock's ``torch.compile`` of
    the whole model against ours (the decoder layers, one graph per kind); ours first (alone in a process, it pays
    inductor's first start too). ``layers``: SmolLM2-135M's 30 unless given.

    Example::

        >>> cold_compile(torch.device("cpu"), layers=2)["ours_compiled_kinds"]   # 30 layers: 3.4-6.5x less time
        {'LlamaDecoderLayer': 2}
    """
    import torch._inductor.config as inductor_config

    vocab = WORKLOADS["smollm2_2_layers"][0]  # SmolLM2-135M's shapes at the workloads' vocab
    generator = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, vocab, (n,), generator=generator) for n in COLD_DOCUMENTS]
    packed = PaddingCollator(EOS, EOS, COLD_WIDTH, mode="pack")([{"input_ids": d.tolist()} for d in docs])
    packed = on_device(packed, device)
    rows = on_device(rows_inputs(docs, EOS), device)

    def first_over_next(model: torch.nn.Module, loss: Callable[[], torch.Tensor]) -> float:
        return _timed(model, loss, device) - _timed(model, loss, device)

    shape = {**SMOLLM2_135M_SHAPE, "num_hidden_layers": layers}
    with inductor_config.patch(force_disable_caches=True):
        torch._dynamo.reset()
        ours = _model(vocab, shape, device)
        state = attach(ours, SDPA, execution="compiled")
        forward_documents(ours, packed).loss.backward()  # the first batch: its proof runs eagerly
        ours_s = first_over_next(ours, _documents_loss(ours, packed))
        kinds = state.execution.compiled.kinds if state.execution.compiled else {}
        torch._dynamo.reset()
        stock = _model(vocab, shape, device)
        compiled = torch.compile(stock)
        stock_s = first_over_next(stock, lambda: compiled(**rows).loss)
    return {
        "layers": layers,
        "ours_compiled_kinds": kinds,
        "stock_compile_s": stock_s,
        "ours_compile_s": ours_s,
        "stock_over_ours": stock_s / ours_s,
    }


def run(quick: bool = False, device: str | None = None) -> dict[str, Any]:
    """Every workload over ``layouts`` changing layouts; ``quick``: the tiny model, 12 layouts."""
    dev = torch.device(device or "cpu")
    layouts, warmup, models = (12, 5, ("tiny",)) if quick else (50, 5, tuple(WORKLOADS))
    started = time.perf_counter()
    rows = [measure(m, dev, layouts, warmup) for m in models]
    cold = None if quick else cold_compile(dev)
    return {
        "command": COMMAND + (" --quick" if quick else ""),
        "device": str(dev),
        **machine(),
        "warmup_layouts": warmup,
        "target_speedup": TARGET,
        "rows": rows,
        "correct": all(r["losses_agree"] for r in rows),
        "all_targets_met": all(
            r["speedup"] >= TARGET and r["losses_agree"] and r["graphs_after_warmup"] == 0 for r in rows
        ),
        "cold_compile": cold,
        "elapsed_s": time.perf_counter() - started,
    }
