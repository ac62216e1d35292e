"""Flat where proven, one document per row where not: :func:`attach` and the path it keeps on the model.

    from foundry_attn.flat.attach import attach
    state = attach(hf_model, "sdpa")                 # proves the flat path against stock at once
    state.path, state.reason                         # "flat" | "rows", and why
    out = forward_documents(hf_model, batch)         # proves again on the first training batch, and after

    model:
      name: foundry_attn_causal_lm
      attn_path: auto              # auto | flat | rows; flat + attn_strict: true fails when flat is not proven
      attn_proof_interval: 100     # re-prove every N training batches (0: first batch and changes only)

**flat** (unpad once, the documents as an argument of every attention call) is used only while the proof
(:mod:`foundry_attn.flat.proof`: the flat row that trains against stock on each document alone, logits and gradients)
holds: at attach on two synthetic documents; on a training batch before it trains: the first, any batch longer than
every length proven so far (the flat row beyond the next power of two of the longest proven, or a document beyond
that of the longest proven document: the number of such proofs grows with the log of the lengths), and whenever a
function behind the dispatch, a kernel the flat path calls or a module's ``forward`` changes (an identity check per
batch); and every ``interval`` batches, forward only. **rows** (the stock backend, one document per row, a 2-D mask)
is used otherwise: a failed proof moves the run there, from the batch it failed on, with one warning (or, binding,
raises with the reason and the batch). Core module: torch and transformers only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import torch

from foundry_attn.attention.backends import (
    BACKENDS,
    EAGER,
    FA2,
    FA2_REFERENCE,
    FLEX,
    NAMES,
    PREFIX,
    REGISTERED,
    SDPA,
    TORCH_VARLEN,
    backend_of,
    set_implementation,
)
from foundry_attn.attention.documents import DOCS_KEY, Documents
from foundry_attn.attention.functions import point
from foundry_attn.flat.comparison import HeadCall, embeddings, head_calls
from foundry_attn.flat.forward import FLAT, PATH_ATTR, ROWS, flat_inputs, path_state, takes_flattened_batches
from foundry_attn.flat.layout import Layout
from foundry_attn.flat.proof import (
    Proof,
    proof_lengths,
    prove_flat,
    prove_rows,
    prove_step,
    step_blocker,
    synthetic_documents,
)
from foundry_attn.flat.unwrap import unwrapped
from foundry_attn.selection.policy import (
    AttentionUnavailableError,
    ModelTraits,
    model_check,
)

log = logging.getLogger(__name__)

AUTO = "auto"
PATHS = (AUTO, FLAT, ROWS)
PROOF_INTERVAL = 100
#: the stock backend each of ours is proven against (torch_varlen: sdpa's window convention; flex: the exact
#: eager math, as stock flex cannot run everywhere) and the stock name its rows path runs
TRUTH = {FA2: FA2, TORCH_VARLEN: SDPA, SDPA: SDPA, EAGER: EAGER, FLEX: EAGER}
ROWS_NAME = {FA2: FA2, TORCH_VARLEN: SDPA, SDPA: SDPA, EAGER: EAGER, FLEX: FLEX}


def ceil2(n: int) -> int:
    """The next power of two of ``n`` (``n`` itself when it is one)."""
    return 1 << max(0, int(n) - 1).bit_length()


def _agreed(lengths: tuple[int, int], hf: Any) -> tuple[int, int]:
    """The longest ``lengths`` over the ranks of a sharded model (FSDP2: its parameters are DTensors), so every rank
    proves the same batches and all-gathers as often as the others; this rank's own elsewhere (DDP's proofs run
    the inner module, with no collective)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return lengths
    from torch.distributed.tensor import DTensor

    param = next(hf.parameters())
    if not isinstance(param, DTensor):
        return lengths
    values = torch.tensor(lengths, dtype=torch.long, device=param.to_local().device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return int(values[0]), int(values[1])


def kernels() -> tuple:
    """The kernels the flat path calls, by identity: transformers' ``_flash_attention_forward`` and the flash
    symbols it looks up at call time, torch's SDPA, varlen and flex functions. A patch on any of them is a change."""
    from torch.nn.attention import flex_attention as flex
    from transformers import modeling_flash_attention_utils as fa_utils

    from foundry_attn.attention.torch_varlen import torch_varlen_kernel

    return (
        torch.nn.functional.scaled_dot_product_attention,
        fa_utils._flash_attention_forward,
        *(getattr(fa_utils, n, None) for n in ("flash_attn_varlen_func", "flash_attn_func", "_flash_varlen_fn")),
        torch_varlen_kernel(),
        getattr(flex, "flex_attention", None),
    )


class FlatPathError(AttentionUnavailableError):
    """``attn_path: flat`` with ``attn_strict: true`` on a model whose flat path is not proven."""


def check_path(path: str) -> str:
    if path not in PATHS:
        raise ValueError(f"attn_path: unknown value {path!r}; valid values: {', '.join(PATHS)}")
    return path


@dataclasses.dataclass
class PathState:
    """The path a model runs and why, kept on the HF model (``model.foundry_path``) by :func:`attach`."""

    backend: str
    path: str
    reason: str
    flat_name: str  # ours, in config._attn_implementation while flat
    rows_name: str  # stock, in config._attn_implementation while rows
    reference: bool = False  # FA2 on the pure-PyTorch reference kernel
    binding: bool = False  # attn_path: flat + strict: a failed proof raises
    interval: int = PROOF_INTERVAL
    proofs: list[tuple[str, Proof]] = dataclasses.field(default_factory=list)
    batches: int = 0
    proven_on_batch: bool = False
    covered: tuple[int, int] = (0, 0)  # (flat row, document) lengths proven, each up to its next power of two
    notes: list[str] = dataclasses.field(default_factory=list)
    listeners: list[Callable[[PathState], None]] = dataclasses.field(default_factory=list)
    _fingerprint: tuple = ()
    _modules: tuple = ()

    def __deepcopy__(self, memo: dict) -> PathState:
        """A copied model (``copy.deepcopy``) keeps its path but proves again on its first batch, and tells nobody
        who listened to the original."""
        return dataclasses.replace(
            self, proofs=list(self.proofs), notes=list(self.notes), listeners=[], proven_on_batch=False, _modules=()
        )

    # ---- the proof --------------------------------------------------------------------------------------
    def prove(
        self,
        model: Any,
        inputs: Mapping[str, Any],
        at: str,
        *,
        grads: bool = True,
        own_positions: bool = False,
    ) -> Proof:
        """Prove the flat path on ``inputs`` (:func:`foundry_attn.flat.forward.flat_inputs`); a failure moves to rows
        (or raises, binding)."""
        hf = unwrapped(model)
        set_implementation(hf, self.flat_name)
        proof = prove_flat(
            hf,
            inputs,
            TRUTH[self.backend],
            reference=self.reference,
            grads=grads,
            own_positions=own_positions,
        )
        return self._judge(hf, inputs, at, proof, grads, own_positions)

    def _judge(
        self, hf: Any, inputs: Mapping[str, Any], at: str, proof: Proof, grads: bool, own_positions: bool
    ) -> Proof:
        """Keep ``proof`` of the flat path: proven lengths and code, or rows from now on (proven there too)."""
        self.proofs.append((at, proof))
        self._modules = tuple(hf.modules())
        self._fingerprint = self.fingerprint()
        if not proof.ok:
            self.refuse(hf, f"proof at {at} {proof.describe()}", check="proof")
            self.prove_rows(hf, inputs, at, grads=grads, own_positions=own_positions)
            return proof
        self._cover(inputs[DOCS_KEY])
        if self.path == FLAT:
            self.reason = f"proven at {at}: {proof.describe()}"
        return proof

    def prove_rows(
        self, model: Any, inputs: Mapping[str, Any], at: str, *, grads: bool = True, own_positions: bool = False
    ) -> Proof:
        """Prove the rows path on the documents of ``inputs`` (:func:`foundry_attn.flat.proof.prove_rows`). A failure is
        said, once, and not refused: stock's own padded batches train the same (never worse than stock)."""
        hf = unwrapped(model)
        proof = prove_rows(
            hf,
            inputs,
            self.rows_name,
            TRUTH[self.backend],
            reference=self.reference,
            grads=grads,
            own_positions=own_positions,
        )
        self.proofs.append((f"rows at {at}", proof))
        docs: Documents = inputs[DOCS_KEY]
        if proof.ok:
            self._cover(docs)
            self.reason = self.reason.split("; rows proven at ")[0] + f"; rows proven at {at}: {proof.describe()}"
            return proof
        note = f"rows at {at} {proof.describe()}"
        said = any(n.startswith("rows at ") for n in self.notes)
        self.notes.append(note)
        (log.info if said else log.warning)("foundry_attn: %s %s", type(hf).__name__, note)  # one warning a run
        return proof

    def _cover(self, docs: Documents) -> None:
        """Lengths up to the next power of two of this row's and its longest document's are proven."""
        self.covered = max(self.covered[0], ceil2(docs.bounds[-1])), max(self.covered[1], ceil2(docs.max_length))

    def fingerprint(self) -> tuple:
        """What the flat path's exactness rests on, by identity: the dispatch entries of our name and the stock
        one, the kernels the flat path calls (:func:`kernels`), every module's ``forward`` (class and instance) and
        HF checkpointing. Costs microseconds (measured in ``bench proof``)."""
        from transformers.modeling_utils import AttentionInterface

        table = AttentionInterface._global_mapping
        return (
            table.get(self.flat_name),
            table.get(self.rows_name),
            *kernels(),
            # a module's forward (class, instance) and HF gradient checkpointing switched on or off
            *(
                (type(m).forward, m.__dict__.get("forward"), m.__dict__.get("gradient_checkpointing"))
                for m in self._modules
            ),
        )

    def due(self, hf: Any, tokens: int, longest: int) -> tuple[str, bool] | None:
        """Why a proof is due on a training batch of ``tokens`` real tokens whose longest document is ``longest``,
        and whether it compares gradients."""
        if not self.proven_on_batch:
            return "the first training batch", True
        if self.fingerprint() != self._fingerprint:
            return "a change of the attention code", True
        tokens, longest = _agreed((tokens, longest), hf)
        if tokens > self.covered[0] or longest > self.covered[1]:
            return f"a longer batch: {tokens} tokens, documents up to {longest}; proven up to {self.covered}", True
        if self.interval and self.batches % self.interval == 0:
            return f"the {self.interval}-batch interval", False
        return None

    def before_batch(
        self, model: Any, inputs: Mapping[str, Any], own_positions: bool, in_step: bool = False
    ) -> bool | StepProof:
        """Called by ``forward_documents`` with the flat inputs of every batch: proves them when due (training
        batches). Whether the batch runs them (False: the proof moved the run to rows); with ``in_step`` (the
        caller runs the forward itself, uncompiled) a :class:`StepProof` that takes the batch's own training forward
        as its packed side, where :func:`foundry_attn.flat.proof.step_blocker` allows."""
        hf = unwrapped(model)
        if not (hf.training and torch.is_grad_enabled()):
            return True
        self.batches += 1
        docs: Documents = inputs[DOCS_KEY]
        due = self.due(hf, docs.bounds[-1], docs.max_length)
        if due is None:
            return True
        self.proven_on_batch = True
        at = f"batch {self.batches} ({due[0]})"
        if in_step and step_blocker(hf) is None:
            return StepProof(self, hf, inputs, at, due[1], own_positions)
        self.prove(model, inputs, at, grads=due[1], own_positions=own_positions)
        return self.path == FLAT

    def before_rows_batch(
        self,
        model: Any,
        tokens: int,
        longest: int,
        flat: Callable[[], Mapping[str, Any]],
        own_positions: bool,
    ) -> None:
        """Called by ``forward_documents`` on every batch the rows path trains: proves rows when due, as
        :meth:`before_batch` proves flat (the first batch, a change, a longer batch, the interval); ``flat`` builds
        the batch's flat inputs, whose documents the proof lays out one per row."""
        hf = unwrapped(model)
        if not (hf.training and torch.is_grad_enabled()):
            return
        self.batches += 1
        due = self.due(hf, tokens, longest)
        if due is None:
            return
        self.proven_on_batch = True
        self._modules = tuple(hf.modules())
        self.prove_rows(hf, flat(), f"batch {self.batches} ({due[0]})", grads=due[1], own_positions=own_positions)
        self._fingerprint = self.fingerprint()

    # ---- moving to rows ---------------------------------------------------------------------------------
    def refuse(self, hf: Any, reason: str, check: str = "proof") -> None:
        """Flat is refused for this model: rows from now on, one warning; binding: the error."""
        if self.binding:
            raise FlatPathError(
                f"attn_path: flat cannot run {type(hf).__name__} with {self.backend}: check '{check}' failed: "
                f"{reason}. Fix: set attn_path: auto (one document per row where flat is not exact)"
            )
        self.path, self.reason = ROWS, reason
        set_implementation(hf, self.rows_name)
        log.warning("foundry_attn: %s runs one document per row (%s): %s", type(hf).__name__, self.rows_name, reason)
        for listener in self.listeners:
            listener(self)


@dataclasses.dataclass
class StepProof:
    """A proof due on a training batch that takes the batch's own forward as its packed side, so the flat row runs
    once: :func:`foundry_attn.flat.forward.forward_documents` runs the forward inside :meth:`capturing`, then
    :meth:`settle`. A difference there is judged again by the full proof (its own forward in eval mode): it decides,
    and a difference only training mode shows moves the run to rows too. A training forward that raises on the flat
    row (a model's own loss reading the mask, a layer refusing an argument) moves the run to rows, where the batch
    runs again: never worse than stock."""

    state: PathState
    hf: Any
    inputs: Mapping[str, Any]
    at: str
    grads: bool
    own_positions: bool
    captured: list[torch.Tensor] = dataclasses.field(default_factory=list)
    head: list[HeadCall] = dataclasses.field(default_factory=list)

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Around the training forward: its input embeddings and output layer's calls, for the gradient part."""
        with embeddings(self.hf, self.grads) as captured, head_calls(self.hf, self.grads) as head:
            self.captured, self.head = captured, head
            yield

    def settle(self, out: Any, error: BaseException | None = None) -> bool:
        """Prove on the forward's ``out`` (or the ``error`` it raised); whether the batch's flat forward stands
        (False: the run is on rows now and the batch runs again there)."""
        state, hf = self.state, self.hf
        if error is not None:
            text = str(error).strip().splitlines()
            reason = f"the flat row does not run in training: {type(error).__name__}: {text[0] if text else ''}"
            failed = Proof(False, reason=reason[:300], tokens=self.inputs[DOCS_KEY].bounds[-1])
            state._judge(hf, self.inputs, self.at, failed, self.grads, self.own_positions)
            return state.path == FLAT
        proof = None
        if out is not None:
            proof = prove_step(
                hf,
                self.inputs,
                out,
                self.captured,
                TRUTH[state.backend],
                head=self.head,
                reference=state.reference,
                grads=self.grads,
                own_positions=self.own_positions,
            )
        if proof is not None and proof.ok:
            state._judge(hf, self.inputs, self.at, proof, self.grads, self.own_positions)
            return True
        full = state.prove(hf, self.inputs, self.at, grads=self.grads, own_positions=self.own_positions)
        if full.ok and proof is not None:  # eval mode holds, the training forward does not: never run silently
            state._judge(hf, self.inputs, f"{self.at}, in training mode", proof, self.grads, self.own_positions)
        return state.path == FLAT


def _bypassed(backend: str) -> str | None:
    """A function a user registered under the stock name that our dispatch bypasses, named."""
    from transformers.modeling_utils import AttentionInterface

    stock = {
        SDPA: ("transformers.integrations.sdpa_attention", "sdpa_attention_forward"),
        FA2: ("transformers.integrations.flash_attention", "flash_attention_forward"),
        FLEX: ("transformers.integrations.flex_attention", "flex_attention_forward"),
    }.get(backend)
    registered = AttentionInterface._global_mapping.get(backend)
    if stock is None or registered is None:
        return None
    original = getattr(importlib.import_module(stock[0]), stock[1], None)
    if registered is original:
        return None
    name = getattr(registered, "__qualname__", repr(registered))
    module = getattr(registered, "__module__", "?")
    return (
        f"{module}.{name} is registered as '{backend}'; the flat path runs foundry_{backend} instead and bypasses "
        "it (attn_path: rows runs it)"
    )


def attach(
    model: Any,
    backend: str | None = None,
    path: str = AUTO,
    *,
    fa2_reference: bool = False,
    strict: bool = False,
    interval: int = PROOF_INTERVAL,
    prove_now: bool = True,
) -> PathState:
    """Point ``model``'s attention at our function for ``backend`` (default: its current one) and prove the flat
    path against stock on two synthetic documents; a model it does not hold for runs rows, with the reason.

    ``path``: ``auto`` (flat where proven), ``flat`` (binding with ``strict``: a failed proof raises
    :class:`FlatPathError`), ``rows``. ``prove_now=False`` leaves the proof to the first training batch (weights
    not materialised yet, or a kernel this device cannot run). Returns the :class:`PathState`.
    """
    check_path(path)
    hf = unwrapped(model)
    before = getattr(hf, PATH_ATTR, None)
    built = before.rows_name if before is not None else hf.config._attn_implementation
    backend = backend or backend_of(built) or EAGER
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; valid: {', '.join(BACKENDS)}")
    _refuse_unsupported(hf, backend, fa2_reference)
    takes_flattened_batches(hf)  # the ecosystem's packed batches (DataCollatorWithFlattening) take the proven path
    rows_name = built if backend_of(built) == backend and built not in REGISTERED else ROWS_NAME[backend]
    if backend == FA2 and fa2_reference and built != FA2:  # our function's stock branch installs the reference
        rows_name = PREFIX + FA2_REFERENCE
    if backend == FLEX and next(hf.parameters()).device.type == "cpu":  # stock flex compiles: no CPU training
        rows_name = EAGER
    state = PathState(
        backend,
        FLAT,
        "proven flat",
        point(hf, backend, fa2_reference),
        rows_name,
        reference=fa2_reference,
        binding=strict and path == FLAT,
        interval=interval,
    )
    setattr(hf, PATH_ATTR, state)
    bypassed = _bypassed(backend)
    if bypassed:
        state.notes.append(bypassed)
        log.warning("foundry_attn: %s", bypassed)
    if path == ROWS:
        state.path, state.reason = ROWS, "attn_path: rows"
        set_implementation(hf, rows_name)
    if prove_now:
        device = next(hf.parameters()).device
        docs = synthetic_documents(hf.config, proof_lengths(hf.config), device)
        layout = Layout((tuple(int(d.numel()) for d in docs),), sum(int(d.numel()) for d in docs))
        ids = torch.cat(docs)[None]
        inputs, _ = flat_inputs(hf, ids, layout.position_ids(device), None, layout)
        if path == ROWS:
            state.prove_rows(hf, inputs, "attach")
        else:
            state.prove(hf, inputs, "attach")
    elif path != ROWS:
        state.reason = "flat, proven on the first training batch"
    return state


def _refuse_unsupported(hf: Any, backend: str, reference: bool = False) -> None:
    """The policy's model checks (:func:`foundry_attn.selection.policy.model_check`), before anything is pointed: a
    backend the class does not declare (stock refuses it at load) or whose kernel cannot honour the config (a softcap
    under sdpa, ALiBi under FA2) runs neither path exactly, so it is refused with the backends that do run the model."""
    from transformers import PreTrainedModel

    owner: Any = next((m for m in hf.modules() if isinstance(m, PreTrainedModel)), hf)  # the model inside PEFT
    traits = ModelTraits.from_model_class(type(owner), owner.config)
    failed = model_check(backend, traits, reference)
    if failed is None:
        return
    check, refused = failed
    runs = [name for name in NAMES if model_check(name, traits, reference) is None]
    raise AttentionUnavailableError(
        f"attach: {backend} cannot run {traits.class_name} exactly: check '{check}' failed: {refused}. Fix: attach "
        f"with one of {runs} (stock transformers refuses this pair at load too)"
    )


def path_of(model: Any) -> PathState | None:
    """The :class:`PathState` of ``model`` (or of the HF model inside a wrapper), or None if never attached."""
    return cast("PathState | None", path_state(model))
