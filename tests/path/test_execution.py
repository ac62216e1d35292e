"""The user's switch for how the flat step runs (``attach(..., execution=)``, ``attn_execution``): ``auto`` by default,
eager on a CPU with the reason, graphed or compiled by the device and backend, eager where a compile fails; compiled,
the step is exact against the uncompiled one on every layout, the decoder layers in one graph (every layer, a second
model too) with no graph break; graphed where it cannot apply (no CUDA, no capacity) runs compiled and says why; a
batch with a proof due, and rows, run eagerly, said once; the choice reaches the decision's fields, and the observers
step aside."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from foundry_attn.bench.gpu import reference_torch_varlen
from foundry_attn.integrations.llm_foundry.keys import AttnKeys
from foundry_attn.path import execution
from foundry_attn.path.attach import attach
from foundry_attn.path.execution import AUTO_STEP, COMPILED, EAGER_STEP, GRAPHED, PROOF_DUE, ROWS_BATCH, execution_for
from foundry_attn.path.forward import forward_documents
from foundry_attn.path.proven import refuse
from foundry_attn.path.state import compiled_by
from foundry_attn.verify import conformance


@pytest.fixture
def graphs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The graphs the step compiles (aot_eager: inductor's traced graph and autograd, without its codegen)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    made: list[int] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        made.append(len(gm.graph.nodes))
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    monkeypatch.setattr(execution, "BACKEND", counting)
    yield made
    torch._dynamo.reset()


def _layouts(count: int, seed: int = 0) -> Iterator[dict]:
    """``count`` packed batches, each a different set of documents."""
    rng = random.Random(seed)
    for _ in range(count):
        docs = [torch.randint(1, conformance.VOCAB, (rng.randint(2, 12),)) for _ in range(rng.randint(2, 5))]
        yield conformance.collated(docs, "pack")


def _twins(family: str, backend: str, **attached: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The model attached with ``attached`` and an uncompiled copy with the same weights."""
    model = conformance.build(family, backend)
    twin = conformance.build(family, backend)
    twin.load_state_dict(model.state_dict())
    plain = {k: v for k, v in attached.items() if k != "execution"}
    attach(model, backend, **attached)
    attach(twin, backend, **plain)
    return model, twin


def _steps_agree(model: torch.nn.Module, twin: torch.nn.Module, batches: Iterator[dict]) -> int:
    """Each batch's loss and every gradient equal on both; the number of batches."""
    count = 0
    for batch in batches:
        results = []
        for runner in (model, twin):
            runner.zero_grad(set_to_none=True)
            loss = forward_documents(runner, batch).loss
            loss.backward()
            results.append((loss.detach(), conformance.grads_of(runner)))
        (loss, grad), (want_loss, want_grad) = results
        torch.testing.assert_close(loss, want_loss, atol=conformance.LOSS_TOL, rtol=0)
        assert ((grad - want_grad).norm() / want_grad.norm()).item() <= conformance.GRAD_TOL
        count += 1
    return count


@pytest.mark.parametrize(
    ("family", "backend", "layouts", "made"),
    # Qwen2's attention reads its layer_idx on transformers 4.51: the first layer's graph holds it constant, the next
    # takes it as an input (5.x reads none: one graph)
    [("llama", "sdpa", 50, 1), ("qwen2", "eager", 12, 2), ("llama", "torch_varlen", 12, 1)],
)
def test_a_compiled_step_is_exact_in_one_graph_over_every_layout(
    graphs: list[int], family: str, backend: str, layouts: int, made: int
) -> None:
    """Every layout exact against the uncompiled twin, every decoder layer in the same graph, and a second model of
    the same shapes (other weights) compiles nothing new."""
    from torch._dynamo.utils import counters

    capacity = 128 * (backend == "torch_varlen")
    with reference_torch_varlen():  # torch's varlen kernel is CUDA's: its pure-PyTorch reference here
        model, twin = _twins(family, backend, capacity=capacity, execution=COMPILED)
        assert _steps_agree(model, twin, _layouts(layouts)) == layouts
        made_by_one = len(graphs)
        second = conformance.build(family, backend, seed=1)
        attach(second, backend, capacity=capacity, execution=COMPILED)
        for batch in _layouts(2, seed=1):  # the first batch's proof runs eagerly, the second compiled
            forward_documents(second, batch).loss.backward()
    state = model.foundry_path
    assert 1 <= len(graphs) <= made and not counters["graph_break"], (graphs, dict(counters["graph_break"]))
    assert len(graphs) == made_by_one, graphs  # the second model: no new graph
    assert state.execution.runs == COMPILED and state.execution.eager == {PROOF_DUE: 1}  # the first batch's proof
    assert compiled_by(model).startswith("attn_execution compiled (compiled: ") and compiled_by(twin) is None
    layer = type(model.model.layers[0]).__name__
    assert state.execution.compiled.kinds == {layer: len(model.model.layers)} and state.execution.compile_s > 0
    assert not state.execution.compiled.on  # outside the step the layers run their own code


def test_graphed_needs_cuda_and_a_capacity_else_it_runs_compiled_and_says_why(graphs: list[int]) -> None:
    with reference_torch_varlen():
        model, twin = _twins("llama", "torch_varlen", capacity=128, execution=GRAPHED)
        state = model.foundry_path
        assert state.execution.runs == GRAPHED  # the device is read on the first flat batch
        _steps_agree(model, twin, _layouts(3))
    assert state.execution.runs == COMPILED
    assert "CUDA graphs need a CUDA device (the batch is on cpu)" in state.execution.reason
    fields = state.decision_now().as_dict()
    assert (fields["execution"], fields["execution_reason"]) == (COMPILED, state.execution.reason)
    no_capacity = attach(conformance.build("llama", "sdpa"), "sdpa", execution=GRAPHED).execution
    assert no_capacity.runs == COMPILED and "graphed not applied: sdpa has no capacity" in no_capacity.reason


def test_rows_run_eagerly_and_the_callers_compile_runs_its_own(graphs: list[int]) -> None:
    model, twin = _twins("llama", "sdpa", execution=COMPILED)
    refuse(model.foundry_path, model, "a test moves the run to rows")  # after attach: compiled, rows each batch
    refuse(twin.foundry_path, twin, "a test moves the run to rows")
    _steps_agree(model, twin, _layouts(3))
    assert model.foundry_path.execution.eager == {ROWS_BATCH: 3} and not graphs
    on_rows = attach(conformance.build("llama", "sdpa"), "sdpa", path="rows", execution=COMPILED).execution
    assert on_rows.runs == EAGER_STEP and on_rows.reason == f"eager: the run is on {ROWS_BATCH}"
    wrapped = attach(torch.compile(conformance.build("llama", "sdpa")), "sdpa", execution=COMPILED).execution
    assert wrapped.runs == EAGER_STEP and "compiled already" in wrapped.reason


def test_an_unknown_execution_lists_the_valid_ones() -> None:
    valid = "attn_execution: unknown value 'graph'; valid values: auto, eager, compiled, graphed"
    with pytest.raises(ValueError, match=valid):
        attach(conformance.build("llama", "sdpa"), "sdpa", execution="graph")
    assert AttnKeys.parse(0, attn_execution="graphed").execution == GRAPHED and AttnKeys.parse(0).execution == AUTO_STEP
    with pytest.raises(ValueError, match="attn_execution: unknown value"):
        AttnKeys.parse(0, attn_execution="fast")


@pytest.mark.slow  # inductor's codegen: 14 kernels, a g++ run each (its header precompiled: pch_g++.py)
def test_the_default_inductor_step_is_exact() -> None:
    torch._dynamo.reset()
    model, twin = _twins("llama", "sdpa", execution=COMPILED)
    # torch 2.7 parses inductor's header in every kernel's compile; 2.8 on precompiles it (cpp_cache_precompile_headers)
    own = hasattr(torch._inductor.config, "cpp_cache_precompile_headers")
    cxx = {} if own else {"cpp.cxx": (None, str(Path(__file__).with_name("pch_g++.py")))}
    with torch._inductor.config.patch(cxx):
        assert _steps_agree(model, twin, _layouts(4)) == 4
    assert model.foundry_path.execution.compiled is not None


def test_the_yaml_key_reaches_the_composer_model_and_its_events(graphs: list[int], assets, tmp_path) -> None:
    """``attn_execution: graphed`` on sdpa (no capacity): the model runs compiled, says why in ``attn/execution*``,
    and a packed batch trains through the compiled step."""
    from foundry_attn.integrations.composer.attn_decision import decision_hparams
    from foundry_attn.integrations.llm_foundry.model import FoundryAttnCausalLM

    model = FoundryAttnCausalLM(
        tokenizer=None,
        pretrained_model_name_or_path=str(assets / "tiny-llama"),
        pretrained=False,
        events_dir=str(tmp_path),
        attn_implementation="sdpa",
        attn_execution=GRAPHED,
    )
    hparams = decision_hparams(model)
    assert hparams["attn/execution"] == COMPILED and "sdpa has no capacity" in hparams["attn/execution_reason"]
    model.train()
    for batch in _layouts(3):
        model(batch).loss.backward()
    assert len(graphs) == 1 and model.attn_state.execution.eager == {PROOF_DUE: 1}


def test_the_observers_step_aside_under_a_compiled_execution_and_say_why(caplog: pytest.LogCaptureFixture) -> None:
    from foundry_attn.observe.tracer import TracerCore

    model = conformance.build("llama", "sdpa")
    attach(model, "sdpa", execution=COMPILED)
    core = TracerCore(print_counts=False)
    with caplog.at_level("WARNING"):
        core.resolve(model, model)
    assert core.idle_reason.startswith("the model runs under attn_execution compiled (compiled: torch.compile")
    assert any("upad_tracer: the model runs under attn_execution compiled" in r.message for r in caplog.records)


def test_auto_is_the_default_eager_on_a_cpu_and_says_why() -> None:
    model = conformance.build("llama", "sdpa")
    state = attach(model, "sdpa")
    want = "auto: eager on cpu (compiled and graphed steps pay on a CUDA device"
    assert state.execution.asked == AUTO_STEP and state.execution.runs == EAGER_STEP
    assert state.execution.reason.startswith(want)
    forward_documents(model, next(_layouts(1))).loss.backward()  # the first flat batch reads the device: the same
    assert state.execution.runs == EAGER_STEP and state.execution.reason.startswith(want) and state.capacity == 0
    assert state.decision_now().as_dict()["execution_reason"].startswith(want)


def test_auto_on_cuda_graphs_a_backend_with_bounds_on_the_device_at_the_first_batchs_rows_x_width(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda = torch.device("cuda")
    varlen = execution_for(AUTO_STEP, False, "torch_varlen", 0, False, False, cuda)
    assert varlen.runs == GRAPHED and varlen.by_device
    assert varlen.settle(cuda, 0, 12288) == 12288 and varlen.runs == GRAPHED
    assert varlen.reason.endswith("at capacity 12288 (the first flat batch's rows x width)")
    given = execution_for(AUTO_STEP, False, "torch_varlen", 4096, False, False, cuda)
    assert given.settle(cuda, 4096, 12288) == 4096 and given.reason.endswith("at capacity 4096")
    why = "sdpa reads the documents' lengths on the host"
    sdpa = execution_for(AUTO_STEP, False, "sdpa", 0, False, False, cuda, why)
    assert sdpa.runs == COMPILED and sdpa.reason.endswith(f"graphed not applied: {why}")
    moved = execution_for(AUTO_STEP, False, "torch_varlen", 0, False, False, cuda)  # built on CUDA, trained on a CPU
    assert moved.settle(torch.device("cpu"), 0, 12288) == 0 and moved.runs == EAGER_STEP
    copied = moved.fresh()  # a copy of the model may train elsewhere: under auto its first batch's device decides
    assert not copied.settled and copied.settle(cuda, 0, 12288) == 12288 and copied.runs == GRAPHED
    asked = execution_for(COMPILED, False, "torch_varlen", 0, False, False, cuda)
    asked.settle(cuda, 0, 12288)
    assert asked.fresh().settled  # what the user named stays named
    fsdp = execution_for(AUTO_STEP, False, "torch_varlen", 0, False, False, cuda)
    monkeypatch.setattr(execution, "sharded", lambda hf: True)
    assert fsdp.settle(cuda, 0, 12288, conformance.build("llama", "sdpa")) == 0 and fsdp.runs == COMPILED
    assert fsdp.reason.endswith(f"graphed not applied: {execution.SHARDED}")
    caller = execution_for(AUTO_STEP, True, "torch_varlen", 0, False, False, cuda)
    assert caller.runs == EAGER_STEP and not caller.by_device and "compiled already" in caller.reason


def test_a_compile_that_fails_under_auto_leaves_the_step_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        raise RuntimeError("no compiler here")

    torch._dynamo.reset()
    monkeypatch.setattr(execution, "BACKEND", failing)
    model, twin = _twins("llama", "sdpa", execution="eager")
    state = model.foundry_path
    state.execution = execution_for(AUTO_STEP, False, "sdpa", 0, False, False, torch.device("cuda"), "a test")
    state.execution.settled = True  # as on CUDA: compiled
    try:
        _steps_agree(model, twin, _layouts(3))
    finally:
        torch._dynamo.reset()
    assert state.execution.runs == EAGER_STEP and "the compiled step failed here" in state.execution.reason
    assert all("forward" not in vars(layer) for layer in model.model.layers)  # the layers' own forward back


@pytest.mark.parametrize("checkpointing", ["hf_non_reentrant", "hf_reentrant", "checkpoint_wrapper"])
def test_a_checkpointed_layer_recomputes_as_its_forward_ran(graphs: list[int], checkpointing: str) -> None:
    """Compiled layers under activation checkpointing: the backward's recompute runs compiled where the forward did
    (a proof's eager forward, eagerly), so what it saves matches; every step exact. A reentrant checkpoint runs the
    forward without grad and the recompute with it: a graph each."""
    model, twin = _twins("llama", "sdpa", execution=COMPILED)
    for runner in (model, twin):
        conformance.enable_checkpointing(runner, checkpointing)
    assert _steps_agree(model, twin, _layouts(4)) == 4
    assert 1 <= len(graphs) <= (2 if checkpointing == "hf_reentrant" else 1), graphs
    assert model.foundry_path.execution.compile_s is not None
