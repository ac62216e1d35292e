"""Proven, not assumed: a leaking attention is caught before it trains a batch, wherever and whenever it appears.

A leak is what third-party kernel patches do: plain causal attention over the whole packed row. It is put at four
places (the dispatch entry of our flat function, the dispatch entry of the stock name, the attention class's
``forward``, torch's SDPA), before ``attach``, after it, or mid-run, and it leaks always or only on rows longer
than the build-time proof's. Every batch must train exactly as its documents alone through stock (the leak caught,
the run moved to rows), or the leak must be harmless to that path (torch's SDPA is called per document).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from foundry_attn.attention.documents import DOCS_KEY
from foundry_attn.flat.inputs import stock_splits_packed_rows
from foundry_attn.path.attach import attach
from foundry_attn.path.forward import forward_documents
from foundry_attn.path.state import FlatPathError, path_of
from foundry_attn.proof.synthetic import proof_lengths, shortest_window
from foundry_attn.selection.policy import AttentionUnavailableError
from foundry_attn.verify import conformance
from tests.conftest import leaky_attention, registered_attention

LONG = 45  # "only on long rows": longer than the synthetic proof row at attach (42 tokens), shorter than a batch row
LENGTHS = ([13, 29, 18], [7, 22, 9, 20])  # two packed rows of 60 and 58 tokens


def _batch(seed: int) -> dict:
    return _rows_batch([list(r) for r in LENGTHS], seed)


def _truth(stock: torch.nn.Module, batch: dict) -> float:
    """Stock sdpa on each document alone: the mean loss over every target."""
    total, targets = 0.0, 0
    with torch.no_grad():
        for r, row in enumerate(batch["doc_lens"]):
            start = 0
            for n in row:
                doc = batch["input_ids"][r, start : start + n]
                logits = stock(input_ids=doc[None]).logits[0, :-1]
                total += F.cross_entropy(logits, doc[1:], reduction="sum").item()
                targets += n - 1
                start += n
    return total / targets


@contextlib.contextmanager
def _leak(place: str, threshold: int) -> Iterator[None]:
    from transformers.models.llama import modeling_llama

    if place in ("dispatch_ours", "dispatch_stock"):
        name = "foundry_sdpa" if place == "dispatch_ours" else "sdpa"
        with registered_attention(name, lambda genuine: leaky_attention(genuine, threshold)):
            yield
    elif place == "class_forward":
        genuine_forward = modeling_llama.LlamaAttention.forward

        def forward(self, *args, **kwargs):
            if kwargs["hidden_states"].shape[1] > threshold:  # an Unsloth-style forward: its own mask, no documents
                kwargs.pop(DOCS_KEY, None)
                kwargs["attention_mask"] = None
            return genuine_forward(self, *args, **kwargs)

        modeling_llama.LlamaAttention.forward = forward
        try:
            yield
        finally:
            modeling_llama.LlamaAttention.forward = genuine_forward
    else:  # torch's SDPA: ignores the mask, causal over whatever it is given
        genuine_sdpa = torch.nn.functional.scaled_dot_product_attention

        def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
            if q.shape[-2] > threshold:
                attn_mask, is_causal = None, True
            return genuine_sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

        torch.nn.functional.scaled_dot_product_attention = sdpa
        try:
            yield
        finally:
            torch.nn.functional.scaled_dot_product_attention = genuine_sdpa


PLACES = ("dispatch_ours", "dispatch_stock", "class_forward", "torch_sdpa")
WHEN = ("before_attach", "after_attach", "mid_run")


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("kind", ["always", "long_rows"])
def test_a_leak_is_caught_before_it_trains_a_batch(place: str, when: str, kind: str) -> None:
    window = shortest_window(conformance.build("llama", "sdpa").config)
    assert sum(proof_lengths(window)) < LONG < min(sum(r) for r in LENGTHS)
    threshold = 1 if kind == "always" else LONG
    model = conformance.build("llama", "sdpa")
    stock = copy.deepcopy(model).eval()  # no optimizer step: the weights stay those of the truth
    truths = [_truth(stock, _batch(seed)) for seed in range(4)]
    leak_at = {"before_attach": -1, "after_attach": 0, "mid_run": 2}[when]
    with contextlib.ExitStack() as stack:
        if leak_at < 0:
            stack.enter_context(_leak(place, threshold))
        state = attach(model, "sdpa")
        for step in range(4):
            if step == leak_at:
                stack.enter_context(_leak(place, threshold))
            out = forward_documents(model, _batch(step))
            out.loss.backward()
            where = f"{place}/{when}/{kind} step {step}: {state.path} {state.reason}"
            assert abs(out.loss.item() - truths[step]) <= conformance.LOSS_TOL, where
    if place in ("torch_sdpa", "dispatch_stock"):  # our flat path calls neither with more than one document
        assert state.path == "flat", where
        if place == "dispatch_stock" and leak_at < 0:
            assert "bypasses it" in " ".join(state.notes)
        return
    assert state.path == "rows", where
    caught = "attach" if (leak_at < 0 and kind == "always") else f"batch {max(leak_at, 0) + 1}"
    assert f"proof at {caught}" in state.reason, where
    assert model.config._attn_implementation == "sdpa"


def test_flat_insisted_on_fails_with_the_cause_and_the_batch() -> None:
    model = conformance.build("llama", "sdpa")
    attach(model, "sdpa", "flat", strict=True)
    forward_documents(model, _batch(0))
    with _leak("dispatch_ours", 1), pytest.raises(FlatPathError, match=r"proof at batch 2 \(a change of the attention"):
        forward_documents(model, _batch(1))


def test_the_interval_proves_again() -> None:
    model = conformance.build("llama", "sdpa")
    state = attach(model, "sdpa", interval=2)
    for step in range(5):
        forward_documents(model, _batch(step))
    assert [at for at, _ in state.proofs] == [
        "attach",
        "batch 1 (the first training batch)",
        "batch 2 (the 2-batch interval)",
        "batch 4 (the 2-batch interval)",
    ]
    assert all(v.ok for _, v in state.proofs) and state.path == "flat"


def test_eval_batches_are_not_proven_and_rows_is_asked_for() -> None:
    model = conformance.build("llama", "sdpa")
    state = attach(model, "sdpa", "rows")
    assert state.path == "rows" and model.config._attn_implementation == "sdpa"
    assert [at for at, _ in state.proofs] == ["rows at attach"]  # rows is proven, flat is not tried
    model = conformance.build("llama", "sdpa")
    state = attach(model, "sdpa")
    model.eval()
    with torch.no_grad():
        forward_documents(model, _batch(0))
    assert [at for at, _ in state.proofs] == ["attach"]


def test_an_unknown_path_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid values: auto, flat, rows"):
        attach(conformance.build("llama", "sdpa"), "sdpa", "flattish")


def test_an_unattached_model_runs_rows_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    from foundry_attn.flat.implementation import point
    from foundry_attn.path import plan

    plan._say_unproven.cache_clear()  # said once per class and process
    model = conformance.build("llama", "sdpa")
    point(model, "sdpa")  # our name, never proven
    out = forward_documents(model, _batch(0))
    assert path_of(model) is None and out.logits.shape[0] == sum(len(r) for r in LENGTHS)  # one row per document
    assert "never attached" in caplog.text and "rows path" in caplog.text


def test_doctor_says_which_path_each_candidate_gets(tmp_path, capsys: pytest.CaptureFixture) -> None:
    import json

    from foundry_attn.cli import main
    from foundry_attn.verify import zoo

    # GPT-J computes attention in its own code: our documents never reach it; transformers 5.x splits the packed row
    # itself, and that is proven (the flat row on stock's packed mask), 4.51 does not (rows)
    gptj = "flat" if stock_splits_packed_rows() else "rows"
    for model_type, path in (("llama", "flat"), ("gptj", gptj)):
        config, _ = zoo.tiny(model_type)
        config.save_pretrained(tmp_path / model_type)
        assert main(["doctor", "--json", "--model-config", str(tmp_path / model_type)]) == 0
        report = json.loads(capsys.readouterr().out)
        ran = [c for c in report["candidates"] if c["available"]]
        assert ran and all(c["path"] == path and c["path_reason"] for c in ran), report["candidates"]
    assert main(["doctor", "--model-config", str(tmp_path / "gptj")]) == 0
    said = "path flat: stock's packed mask" if gptj == "flat" else "path rows: proof at attach failed"
    assert said in capsys.readouterr().out


def test_a_config_switched_after_attach_runs_rows_unproven() -> None:
    """Someone sets ``config._attn_implementation`` after ``attach``: the proof no longer covers what runs, so the
    batch runs rows with that implementation (nothing is proven or re-pointed behind the user's back)."""
    model = conformance.build("llama", "sdpa")
    state = attach(model, "sdpa")
    model.config._attn_implementation = "eager"
    out = forward_documents(model, _batch(0))
    assert out.logits.shape[0] == sum(len(r) for r in LENGTHS) and state.path == "flat"
    assert [at for at, _ in state.proofs] == ["attach"] and model.config._attn_implementation == "eager"


# ---- what a proof on logits alone, on the first batch's length, or on one row would miss ----------------------


def _rows_batch(rows: list[list[int]], seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    width = max(sum(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for r, row in enumerate(rows):
        n = sum(row)
        ids[r, :n] = torch.randint(1, conformance.VOCAB, (n,), generator=gen)
        labels[r, :n] = ids[r, :n]
    return {"input_ids": ids, "labels": labels, "doc_lens": [list(r) for r in rows]}


def _truth_grads(stock: torch.nn.Module, batch: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """Stock sdpa on each document alone: the mean loss over every target, and its parameter gradients (computed
    without any of our code: an independent truth)."""
    stock.zero_grad(set_to_none=True)
    docs = [
        batch["input_ids"][r, start : start + n]
        for r, row in enumerate(batch["doc_lens"])
        for start, n in zip([sum(row[:i]) for i in range(len(row))], row, strict=True)
    ]
    targets = sum(d.numel() - 1 for d in docs)
    loss = sum(F.cross_entropy(stock(input_ids=d[None]).logits[0, :-1], d[1:], reduction="sum") for d in docs)
    (loss / targets).backward()
    grads = {n: p.grad.clone() for n, p in stock.named_parameters() if p.grad is not None}
    return (loss / targets).item(), grads


def _backward_leak(genuine):
    """Right in the forward, wrong in the backward: the value of ``genuine``, the gradient of plain causal attention
    over the whole packed row (a real class of kernel bug)."""
    leaky = leaky_attention(genuine)

    def attention(module, query, key, value, attention_mask, **kwargs):
        good, _ = genuine(module, query, key, value, attention_mask, **kwargs)
        bad, _ = leaky(module, query, key, value, attention_mask, **kwargs)
        return bad + (good - bad).detach(), None

    return attention


def _train(model, stock, batches, leak=None, leak_at=0) -> list[tuple[float, float]]:
    """Each batch through forward_documents (the leak applied from ``leak_at``): its loss and relative gradient
    error against stock on each document alone."""
    errors = []
    with contextlib.ExitStack() as stack:
        for step, batch in enumerate(batches):
            if leak is not None and step == leak_at:
                stack.enter_context(leak())
            model.zero_grad(set_to_none=True)
            out = forward_documents(model, batch)
            out.loss.backward()
            truth, grads = _truth_grads(stock, batch)
            worst = max(
                ((p.grad - grads[n]).norm() / grads[n].norm().clamp_min(1e-12)).item()
                for n, p in model.named_parameters()
                if n in grads
            )
            errors.append((abs(out.loss.item() - truth), worst))
    return errors


def _exact(errors: list[tuple[float, float]]) -> bool:
    return all(loss <= conformance.LOSS_TOL and grad <= conformance.GRAD_TOL for loss, grad in errors)


@pytest.mark.parametrize("leak_at", [0, 2])
def test_a_backward_only_leak_is_caught_on_its_first_batch(leak_at: int) -> None:
    model = conformance.build("llama", "sdpa")
    stock = copy.deepcopy(model).train()
    batches = [_batch(seed) for seed in range(4)]
    state = attach(model, "sdpa")
    assert state.proofs[-1][1].worst_grad is not None  # attach compares gradients too

    def leak():
        return registered_attention("foundry_sdpa", _backward_leak)

    errors = _train(model, stock, batches, leak, leak_at)
    assert _exact(errors), errors
    assert state.path == "rows" and f"proof at batch {leak_at + 1}" in state.reason, state.reason
    assert "gradients" in state.reason


def test_a_leak_that_appears_only_at_a_longer_length_is_caught_on_the_batch_that_reaches_it() -> None:
    """The first batches are 118 tokens flat; a later one is 300: the kernel goes wrong above 200 tokens."""
    model = conformance.build("llama", "sdpa")
    stock = copy.deepcopy(model).train()
    batches = [_batch(0), _batch(1), _rows_batch([[90, 60], [70, 80]], 2), _rows_batch([[90, 60], [70, 80]], 3)]
    state = attach(model, "sdpa")

    def leak():
        return registered_attention("foundry_sdpa", lambda genuine: leaky_attention(genuine, 200))

    errors = _train(model, stock, batches, leak, 0)
    assert _exact(errors), errors
    assert state.path == "rows" and "proof at batch 3 (a longer batch: 300 tokens" in state.reason, state.reason


def test_a_leak_above_the_rows_length_but_below_the_flattened_length_is_caught() -> None:
    """Rows of 60 and 58 tokens train as one flat row of 118: a kernel that goes wrong above 100 tokens is caught
    on the first batch, which the proof runs at its flattened length."""
    model = conformance.build("llama", "sdpa")
    stock = copy.deepcopy(model).train()
    state = attach(model, "sdpa")

    def leak():
        return registered_attention("foundry_sdpa", lambda genuine: leaky_attention(genuine, 100))

    errors = _train(model, stock, [_batch(0), _batch(1)], leak, 0)
    assert _exact(errors), errors
    assert state.path == "rows" and "proof at batch 1" in state.reason and "118-token row" in state.reason


def test_lengths_are_proven_a_logarithmic_number_of_times() -> None:
    """A mix whose lengths grow batch after batch: a proof each time a length passes the next power of two."""
    model = conformance.build("llama", "sdpa")
    state = attach(model, "sdpa", interval=0)
    for step, n in enumerate(range(20, 260, 10)):
        batch = _rows_batch([[n // 2, n - n // 2]], step)
        forward_documents(model, batch).loss.backward()
    longer = [at for at, _ in state.proofs if "longer batch" in at]
    assert 2 <= len(longer) <= 4, [at for at, _ in state.proofs]  # 24 batches from 20 to 250 tokens
    assert all(v.ok for _, v in state.proofs) and state.path == "flat"


def test_a_patched_kernel_the_flat_path_calls_is_a_change() -> None:
    """A patch on a kernel (here torch's SDPA, called per document) is noticed on the next batch and proven."""
    model = conformance.build("llama", "sdpa")
    state = attach(model, "sdpa", interval=0)
    forward_documents(model, _batch(0))
    with _leak("torch_sdpa", 10_000):  # patched, harmless: the identity changed, the math did not
        forward_documents(model, _batch(1))
    assert [at for at, _ in state.proofs][-1] == "batch 2 (a change of the attention code)"
    assert state.path == "flat"


def test_rows_is_proven_too_when_the_run_moves_there() -> None:
    """A flat proof that fails moves the run to rows, and rows is proven on the same documents, with gradients."""
    model = conformance.build("llama", "sdpa")
    with registered_attention("foundry_sdpa", lambda genuine: leaky_attention(genuine, 0)):
        state = attach(model, "sdpa")
    assert state.path == "rows"
    at, verdict = state.proofs[-1]
    assert at == "rows at attach" and verdict.ok and verdict.worst_grad is not None, verdict.describe()
    assert "rows proven at attach: passed" in state.reason


def test_a_model_no_layout_computes_exactly_is_refused_with_each_cause() -> None:
    """A model whose padded rows differ from its documents alone (here a final norm that mixes the rows of a
    batch, as a batch statistic would), right- or left-padded, and whose flat row is not attached: never trained off
    its documents alone (never a warning followed by training worse than stock): refused at attach, saying why."""
    model = conformance.build("llama", "sdpa")
    model.model.norm.register_forward_hook(lambda _m, _i, out: out + out.mean(0, keepdim=True))
    with pytest.raises(AttentionUnavailableError, match=r"neither path trains LlamaForCausalLM") as raised:
        attach(model, "sdpa", path="rows")
    assert "one document per row (right- and left-padded)" in str(raised.value)
    assert "one per row (sdpa) differ from stock sdpa" in str(raised.value)


def test_rows_is_proven_on_its_first_batch_and_each_longer_one() -> None:
    """The rows path gets the flat path's schedule: attach, the first training batch, a longer batch; not every
    batch. Every batch trains as stock on each document alone."""
    model = conformance.build("llama", "sdpa")
    stock = copy.deepcopy(model).train()
    state = attach(model, "sdpa", path="rows")
    batches = [_rows_batch([[13, 29, 18]], 0), _rows_batch([[13, 29, 18]], 1), _rows_batch([[90, 40, 70]], 2)]
    errors = _train(model, stock, batches)
    assert _exact(errors), errors
    assert [at for at, _ in state.proofs] == [
        "rows at attach",
        "rows at batch 1 (the first training batch)",
        "rows at batch 3 (a longer batch: 200 tokens, documents up to 90; proven up to (64, 32))",
    ]
    assert all(v.ok and v.worst_grad is not None for _, v in state.proofs) and state.path == "rows"


def _forwards(model) -> list[bool]:
    """Each forward of the base model from now on: whether it was a proof's (``proving()``) or the batch's."""
    from foundry_attn.proof.proving import proving

    seen: list[bool] = []
    model.model.register_forward_pre_hook(lambda _m, _a: seen.append(proving()))
    return seen


def test_a_full_proof_on_a_batch_takes_the_batchs_own_forward() -> None:
    """The first batch's proof is paid without a second flat forward: the training forward is its packed side
    (logits, and the documents' gradient through the training graph); only the two documents alone run besides."""
    model = conformance.build("llama", "sdpa")
    state = attach(model, "sdpa")
    seen = _forwards(model)
    forward_documents(model, _batch(0)).loss.backward()
    assert seen == [False, True, True], seen
    at, verdict = state.proofs[-1]
    assert at == "batch 1 (the first training batch)" and verdict.ok and verdict.worst_grad is not None


def test_where_training_differs_from_eval_the_proof_runs_its_own_forward() -> None:
    """Dropout makes the training forward random: the proof runs its own (eval-mode) flat forward, and says why."""
    from foundry_attn.proof.step_proof import step_blocker

    model = conformance.build("llama", "sdpa")
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    assert step_blocker(model) == "attention_dropout=0.1 in model.layers.0.self_attn"
    state = attach(model, "sdpa")
    seen = _forwards(model)
    forward_documents(model, _batch(0))
    assert seen == [True, True, True, False], seen  # the flat row and two documents alone, then the batch
    assert state.path == "flat"


def test_a_leak_only_training_mode_shows_is_caught_on_its_batch() -> None:
    """An attention that leaks only in training mode: the eval-mode proof alone would pass it; the proof on the
    training forward catches it, the run moves to rows, and every batch trains exactly."""
    model = conformance.build("llama", "sdpa")
    stock = copy.deepcopy(model).train()
    state = attach(model, "sdpa")

    def training_only(genuine):
        leaky = leaky_attention(genuine)
        return lambda module, *args, **kwargs: (leaky if module.training else genuine)(module, *args, **kwargs)

    def leak():
        return registered_attention("foundry_sdpa", training_only)

    errors = _train(model, stock, [_batch(0), _batch(1)], leak, 0)
    assert _exact(errors), errors
    assert state.path == "rows" and "proof at batch 1 (the first training batch), in training mode" in state.reason


def test_a_flat_row_that_raises_in_training_moves_the_batch_to_rows() -> None:
    """A model whose training forward fails on the flat row (as Gemma3's own loss does, reading the mask): the
    batch runs again on rows, exactly, and the run stays there."""
    from foundry_attn.attention.documents import is_placeholder

    model = conformance.build("llama", "sdpa")
    stock = copy.deepcopy(model).train()
    state = attach(model, "sdpa")

    def refuse_flat_in_training(module, args, kwargs):
        if module.training and is_placeholder(kwargs.get("attention_mask")):
            raise IndexError("too many indices for tensor of dimension 3")

    model.model.register_forward_pre_hook(refuse_flat_in_training, with_kwargs=True)
    errors = _train(model, stock, [_batch(0), _batch(1)])
    assert _exact(errors), errors
    assert "does not run in training: IndexError" in state.reason, state.reason
    # transformers 5.x: the flat row on stock's own packed mask (no placeholder), proven; 4.51: rows
    assert state.path == ("flat" if state.stock_mask else "rows") and state.stock_mask == stock_splits_packed_rows()
