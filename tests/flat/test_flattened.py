"""The ecosystem's packed batches on an attached model: ``model(**batch)`` with a batch from transformers'
``DataCollatorWithFlattening`` (what TRL's ``padding_free=True`` builds on) trains exactly, as each document alone,
where stock padding-free does not (sinks, SSM state); any other call runs the model's own forward."""

from __future__ import annotations

import copy
import functools
import inspect
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import DataCollatorWithFlattening

from foundry_attn.attention.backends import SDPA, load_name
from foundry_attn.flat.layout import flattened_lengths
from foundry_attn.flat.model_forward import FlattenedForward
from foundry_attn.path.attach import attach
from foundry_attn.proof.runs import alone_inputs
from foundry_attn.proof.synthetic import synthetic_documents
from foundry_attn.verify import conformance, sweep, zoo

LENGTHS = (5, 11, 3, 9)
COLLATOR_KEYS = set(inspect.signature(DataCollatorWithFlattening.__init__).parameters)


def _truth(stock: torch.nn.Module, docs: list[torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    """Stock on each document alone: the mean loss over every target and its parameter gradients."""
    stock.zero_grad(set_to_none=True)
    targets = sum(d.numel() - 1 for d in docs)
    loss = sum(F.cross_entropy(stock(input_ids=d[None]).logits[0, :-1].float(), d[1:], reduction="sum") for d in docs)
    (loss / targets).backward()
    return (loss / targets).item(), {n: p.grad.clone() for n, p in stock.named_parameters() if p.grad is not None}


def _collate(docs: list[torch.Tensor], **options: bool) -> dict:
    return DataCollatorWithFlattening(**options)([{"input_ids": d.tolist()} for d in docs])


def _grad_err(model: torch.nn.Module, want: dict[str, torch.Tensor]) -> float:
    return max(
        ((p.grad - want[n]).norm() / want[n].norm().clamp_min(1e-12)).item()
        for n, p in model.named_parameters()
        if n in want
    )


@pytest.mark.parametrize("options", ["position_ids", "cu_seq_lens", "seq_idx"])
def test_a_flattened_batch_trains_as_each_document_alone_and_is_proven(options: str) -> None:
    wanted = {"cu_seq_lens": "return_flash_attn_kwargs", "seq_idx": "return_seq_idx"}.get(options)
    if wanted is not None and wanted not in COLLATOR_KEYS:
        pytest.skip(f"DataCollatorWithFlattening has no {wanted} in transformers {transformers.__version__}")
    model = conformance.build("llama", "sdpa")
    stock = copy.deepcopy(model)
    docs = conformance.sample_documents()
    state = attach(model, "sdpa")
    batch = _collate(docs, **({wanted: True} if wanted else {}))
    assert flattened_lengths(batch) == [d.numel() for d in docs]
    out = model(**batch)
    out.loss.backward()
    loss, grads = _truth(stock, docs)
    assert abs(out.loss.item() - loss) <= conformance.LOSS_TOL and _grad_err(model, grads) <= conformance.GRAD_TOL
    assert out.logits.shape[:2] == batch["input_ids"].shape
    assert [at for at, _ in state.proofs] == ["attach", "batch 1 (the first training batch)"]
    assert state.path == "flat" and all(p.ok for _, p in state.proofs)


def _leaky_family(model_type: str, backend: str) -> tuple[torch.nn.Module, torch.nn.Module, list, dict]:
    """The zoo's tiny ``model_type`` in training mode, a stock copy, the documents and their flattened batch."""
    if model_type not in zoo.model_types():
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    config, model_class = zoo.tiny(model_type)
    torch.manual_seed(0)
    model = zoo.build(config, model_class, backend).train()
    docs = synthetic_documents(model.config, LENGTHS, torch.device("cpu"))
    return model, copy.deepcopy(model), docs, _collate(docs)


@pytest.mark.parametrize(("model_type", "backend"), [("gpt_oss", "eager"), ("jamba", "sdpa"), ("jamba", "eager")])
def test_families_whose_stock_padding_free_leaks_train_exactly_attached(model_type: str, backend: str) -> None:
    """gpt-oss's sinks and Jamba's SSM state cross documents in stock padding-free batches; attached, the flat
    proof fails and the documents run one per row: exact."""
    model, stock, docs, batch = _leaky_family(model_type, backend)
    loss, grads = _truth(stock, docs)
    with torch.no_grad():
        leak = abs(stock(**batch).loss.item() - loss)
    assert leak > conformance.LOSS_TOL, leak  # stock padding-free: documents see each other
    attach(model, backend)
    out = model(**batch)
    out.loss.backward()
    assert abs(out.loss.item() - loss) <= conformance.LOSS_TOL and _grad_err(model, grads) <= conformance.GRAD_TOL


def test_other_calls_run_the_models_own_forward() -> None:
    """A 2-D mask, plain ids, and a deep copy: the model's own forward, its signature kept for the Trainer."""
    model = conformance.build("llama", "sdpa")
    stock = copy.deepcopy(model).eval()
    attach(model, "sdpa")
    model.eval()
    ids = torch.randint(1, conformance.VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    with torch.no_grad():
        assert torch.equal(
            model(input_ids=ids, attention_mask=mask).logits, stock(input_ids=ids, attention_mask=mask).logits
        )
        assert torch.equal(model(input_ids=ids[:1]).logits, stock(input_ids=ids[:1]).logits)
    assert isinstance(vars(model)["forward"], FlattenedForward)
    assert "labels" in inspect.signature(model.forward).parameters
    copied = copy.deepcopy(model)
    assert copied.forward.model is copied


TRAINER_DOC = Path(__file__).parents[2] / "docs" / "trainer.md"


#: stock's packed logits this far from each document alone are a leak (fp32 noise of exact families: <= 2e-7)
LEAK_LOGITS = 1e-5


@functools.cache
def _documented() -> dict[str, tuple[str, str]]:
    """``docs/trainer.md``'s table for this transformers: model type -> (stock padding-free, attached), each the
    outcome its cell opens with."""
    section = TRAINER_DOC.read_text().split(f"### transformers {transformers.__version__},", 1)
    assert len(section) == 2, f"docs/trainer.md has no section for transformers {transformers.__version__}"
    rows = [line for line in section[1].split("\n### ", 1)[0].splitlines() if line.startswith("| ")][2:]
    opens = [[re.sub(r"\*\*", "", c.strip()).split(":", 1)[0] for c in line.strip("|").split("|")] for line in rows]
    return {cells[0]: (cells[2], cells[3]) for cells in opens}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", zoo.model_types())
def test_every_model_type_trains_padding_free_exactly_attached(model_type: str) -> None:
    """``foundry-attn conformance --padding-free``, cell by cell: attached, never wrong and never a crash; stock's
    leak and ours as docs/trainer.md says (regenerate it when this moves)."""
    cell = sweep.padding_free_cell(model_type)
    assert cell.status in ("exact", "refused", "stock differs", "unbuildable", "stock fails"), cell
    stock, ours = sweep.padding_free_labels(cell)
    assert _documented().get(model_type) == (stock, ours), (model_type, stock, ours, cell.detail)
    # our callbacks' verdict on stock's own run agrees with stock's packed logits against each document alone: a
    # leak however small (exact families stay within 2e-7 in fp32), and never a leak where there is none
    if cell.stock_logits_err is not None:
        leaks = cell.stock_logits_err > LEAK_LOGITS
        assert cell.verdict == ("leaks" if leaks else "isolated"), (model_type, cell.verdict, cell.stock_logits_err)


@pytest.mark.parametrize(
    ("model_type", "backend"), [("llama", "sdpa"), ("mistral", "sdpa"), ("gpt_oss", "eager"), ("jamba", "sdpa")]
)
def test_the_backbone_called_alone_takes_the_proven_path(model_type: str, backend: str) -> None:
    """TRL's fused LM head calls ``model.base_model`` with the packed batch: attached, its hidden states are each
    document's alone (stock's backbone on each), on the path proven on that first training call."""
    model, stock, docs, batch = _leaky_family(model_type, backend)
    packed = {k: batch[k] for k in ("input_ids", "position_ids")}
    with torch.no_grad():
        alone = torch.cat([stock.base_model(input_ids=d[None]).last_hidden_state for d in docs], dim=1)
    state = attach(model, backend)
    ours = model.base_model(**packed, use_cache=False).last_hidden_state.detach()  # a training call: proven first
    assert ours.shape == alone.shape and (ours - alone).abs().max().item() <= 1e-5 * max(1.0, alone.abs().max().item())
    assert [at for at, _ in state.proofs][-1].endswith("batch 1 (the first training batch)"), state.proofs


@pytest.mark.slow
@pytest.mark.parametrize("model_type", zoo.model_types())
def test_every_model_types_backbone_takes_the_packed_batch_exactly_attached(model_type: str) -> None:
    """What TRL's fused LM head runs (``model.base_model`` on the padding-free batch), type by type: where
    docs/trainer.md says the attached model trains exactly, its backbone's hidden states are each document's alone."""
    attached = _documented().get(model_type, ("", ""))[1]
    if not attached.startswith("exact"):
        pytest.skip(f"{model_type}: attached is {attached!r} in docs/trainer.md")
    config, model_class = zoo.tiny(model_type)
    backend = load_name(SDPA, model_class=model_class)
    model, stock = (sweep._zoo_model(config, model_class, backend) for _ in range(2))
    if getattr(model, "base_model", model) is model:
        pytest.skip(f"{model_type}: the causal LM is its own base model")
    docs = synthetic_documents(config, LENGTHS, torch.device("cpu"))
    batch = _collate(docs)
    no_cache = {"use_cache": False} if "use_cache" in inspect.signature(stock.base_model.forward).parameters else {}
    with torch.no_grad():
        outs = [stock.base_model(**alone_inputs(d[None]), **no_cache) for d in docs]
    if not all(hasattr(out, "last_hidden_state") for out in outs):
        pytest.skip(f"{model_type}: its base model is not a backbone ({type(outs[0]).__name__})")
    alone = torch.cat([out.last_hidden_state for out in outs], 1)
    attach(model, backend)
    model.train()
    ours = model.base_model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], **no_cache)
    ours = ours.last_hidden_state.detach()
    assert ours.shape == alone.shape
    assert (ours - alone).abs().max().item() <= 1e-4 * max(1.0, alone.abs().max().item())


def test_malformed_packed_batches_raise_naming_the_fields() -> None:
    """Labels that do not match input_ids (an empty example in DataCollatorWithFlattening), and cu_seq_lens whose
    documents the restarting position_ids do not mark, are errors attached as they are stock (never a silent
    loss); the batch is read once, so positions mean the same on the flat path, the rows path and in the proof."""
    model = conformance.build("gpt2", "sdpa")
    stock = copy.deepcopy(model)
    docs = conformance.sample_documents()
    attach(model, "sdpa")
    examples = [{"input_ids": d.tolist()} for d in docs]
    empty = DataCollatorWithFlattening()([*examples[:1], {"input_ids": []}, *examples[1:]])
    assert empty["labels"].shape[1] == empty["input_ids"].shape[1] + 1
    with pytest.raises(ValueError, match="batch_size"):
        stock(**empty)
    with pytest.raises(ValueError, match=r"packed batch: labels \[1, \d+\] do not match input_ids \[1, \d+\]"):
        model(**empty)
    if "return_flash_attn_kwargs" not in COLLATOR_KEYS:
        return
    batch = _collate(docs, return_flash_attn_kwargs=True)
    batch["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None]  # absolute positions, documents in cu
    with pytest.raises(ValueError, match=r"cu_seq_lens_q puts documents at \[0, \d+.*position_ids restart at \[0\]"):
        model(**batch)
    with pytest.raises(ValueError, match="position_ids restart"):
        flattened_lengths(batch)


def test_gpt2_under_the_fa2_reference_in_fp32_trains_exactly_or_says_why() -> None:
    """transformers' FA2 takes an fp32 input's half dtype from the attention module's first nn.Linear, which GPT-2's
    Conv1D attention has not: stock raises a bare StopIteration, on each document alone too, so no proof can run.
    Our FA2 function's rows run a training step here, so attach keeps them, saying where the StopIteration came from
    and that the rows are not proven (a backend whose training forward fails too is refused at attach); the packed
    batch trains as each document alone."""
    model = conformance.build("gpt2", "sdpa")
    stock = copy.deepcopy(model)
    docs = conformance.sample_documents()
    state = attach(model, "flash_attention_2", fa2_reference=True)
    assert state.path == "rows" and "StopIteration (raised in" in state.reason, state.reason
    assert any("not proven" in note for note in state.notes), state.notes
    loss = model(**_collate(docs)).loss
    assert abs(loss.item() - _truth(stock, docs)[0]) <= conformance.LOSS_TOL
