"""The path a model runs, flat or rows, and the one per-batch plan: which layout, and whether a proof is due.

    state = path_of(hf_model)                        # kept on the HF model by attach (foundry_attn.flat.attach)
    state.path, state.reason                         # "flat" | "rows", and why
    plan = state.plan(hf_model, tokens, longest, in_step=True)   # what forward_documents does with a batch

**flat** (unpad once, the documents as an argument of every attention call) is used only while the proof
(:mod:`foundry_attn.flat.proof`: the flat row that trains against stock on each document alone, logits and gradients)
holds: at attach on two synthetic documents; on a training batch before it trains: the first, any batch longer than
every length proven so far (the flat row beyond the next power of two of the longest proven, or a document beyond
that of the longest proven document: the number of such proofs grows with the log of the lengths), and whenever a
function behind the dispatch, a kernel the flat path calls or a module's ``forward`` changes (an identity check per
batch); and every ``interval`` batches, forward only. **rows** (the stock backend, one document per row, a 2-D mask)
is used otherwise: a failed proof moves the run there, from the batch it failed on, with one warning (or, binding,
raises with the reason and the batch). :mod:`foundry_attn.flat.forward` asks :meth:`PathState.plan` once per batch
and acts on the answer; nothing here calls back up. Core module: torch and transformers only.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from foundry_attn.attention.backends import BACKENDS, EAGER, SDPA
from foundry_attn.attention.documents import DOCS_KEY, Documents
from foundry_attn.checks import check_choice
from foundry_attn.flat.implementation import current, use
from foundry_attn.flat.inputs import stock_splits_packed_rows
from foundry_attn.flat.layout import Truth
from foundry_attn.flat.layout_cost import MOST_FORWARDS, ModelShape, cheapest, free_memory, row_groups
from foundry_attn.flat.proof import (
    Proof,
    prove_flat,
    prove_packed,
    prove_rows,
    rows_train_error,
)
from foundry_attn.flat.step_proof import StepProof, step_blocker
from foundry_attn.flat.unwrap import unwrapped
from foundry_attn.selection.policy import AttentionUnavailableError, Decision

log = logging.getLogger(__name__)

FLAT, ROWS = "flat", "rows"
PATH_ATTR = "foundry_path"  # the PathState :func:`foundry_attn.flat.attach.attach` keeps on the HF model

AUTO_PATH = "auto"  # flat where proven, else rows (attn_path: auto); the backend's "auto" is policy.AUTO


PATHS = (AUTO_PATH, FLAT, ROWS)


PROOF_INTERVAL = 100


def ceil2(n: int) -> int:
    """The next power of two of ``n`` (``n`` itself when it is one).

    Args:
        n: a length in tokens.

    Returns:
        The smallest power of two >= ``n`` (1 for ``n <= 1``).

    Example::

        >>> ceil2(41), ceil2(64)
        (64, 64)
    """
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


def _world() -> int:
    """The processes of this run (1 without torch.distributed)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _sharded(hf: Any) -> bool:
    """The model's parameters are sharded (FSDP2's DTensors, FSDP1's wrapped modules or flat parameters): its
    forwards all-gather, so a rank's forwards pair with the others' one by one."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    param = next(hf.parameters(), None)
    if param is None or isinstance(param, DTensor) or getattr(param, "_is_flat_param", False):
        return True
    return any(isinstance(m, FullyShardedDataParallel) for m in hf.modules())


def _fewest(count: int, hf: Any) -> int:
    """The fewest ``count`` over the ranks (one all-reduce, on the parameters' device)."""
    import torch.distributed as dist

    value = torch.tensor([count], dtype=torch.long, device=next(hf.parameters()).device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return int(value[0])


def kernels() -> tuple:
    """The kernels the flat path calls, by identity: transformers' ``_flash_attention_forward`` and the flash
    symbols it looks up at call time, torch's SDPA, varlen and flex functions. A patch on any of them is a change.

    Returns:
        The seven functions (None for a flash symbol, the varlen kernel or flex this install lacks).

    Example::

        >>> kernels()[0] is torch.nn.functional.scaled_dot_product_attention
        True
    """
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


class NoExactPath(AttentionUnavailableError):
    """Neither path trains the model as each document alone here (the flat row and one document per row, right- and
    left-padded, each failed its proof, or cannot run): refused at attach, or on the batch that shows it."""


class FlatPathError(AttentionUnavailableError):
    """``attn_path: flat`` with ``attn_strict: true`` on a model whose flat path is not proven."""


def check_path(path: str) -> str:
    """``path`` if it is one of :data:`PATHS`, else the ValueError that lists them.

    Args:
        path: ``attn_path`` as the user gave it.

    Returns:
        ``path``.

    Example::

        >>> check_path("flatt")
        ValueError: attn_path: unknown value 'flatt'; valid values: auto, flat, rows
    """
    return check_choice("attn_path", path, PATHS)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a batch runs (:meth:`PathState.plan`): its ``path``, and the proof due on it, if any: why (``at``),
    with gradients or forward only, and whether it takes the batch's own forward (``in_step``); on rows, the
    documents of each forward where they run in several by width (``groups``:
    :func:`~foundry_attn.flat.layout_cost.row_groups`)."""

    path: str
    at: str | None = None
    grads: bool = True
    in_step: bool = False
    groups: tuple[tuple[int, ...], ...] = ()  # rows in several forwards: each one's documents (empty: one forward)


@dataclasses.dataclass(frozen=True)
class PathChange:
    """The run moved to ``path`` on training batch ``batch`` (0: at attach), and why: an event of the
    :class:`PathState` (``state.changes``) that the glues read after a batch and log."""

    batch: int
    path: str
    reason: str


@dataclasses.dataclass
class PathState:
    """The path a model runs and why, kept on the HF model (``model.foundry_path``) by :func:`attach`."""

    backend: str
    path: str
    reason: str
    flat_name: str  # ours, in config._attn_implementation while flat
    rows_name: str  # stock, in config._attn_implementation while rows
    reference: bool = False  # FA2 on the pure-PyTorch reference kernel
    rows_left: bool = False  # the rows path pads on the left (a model that assumes it: CPM-Ant)
    first_targets: bool = False  # the model's loss does not shift its labels: each first token is a target (CPM-Ant)
    stock_mask: bool = False  # the flat row runs stock's own packed mask (rows_name), not our documents
    binding: bool = False  # attn_path: flat + strict: a failed proof raises
    interval: int = PROOF_INTERVAL
    proofs: list[tuple[str, Proof]] = dataclasses.field(default_factory=list)
    batches: int = 0
    proven_on_batch: bool = False
    covered: tuple[int, int] = (0, 0)  # (flat row, document) lengths proven, each up to its next power of two
    notes: list[str] = dataclasses.field(default_factory=list)
    decision: Decision | None = None  # what attach ran: the chain and why not each (auto, the builder), or the name
    changes: list[PathChange] = dataclasses.field(default_factory=list)  # every move to rows, in order: the glues read
    rows_proven: bool = False  # one document per row is proven too, a candidate while the flat row is stock's mask
    rows_covered: tuple[int, int] = (0, 0)  # as ``covered``, for one document per row as a candidate
    rows_on_batch: bool = False  # one document per row has been proven on a training batch
    most_forwards: int = MOST_FORWARDS  # the most forwards a batch's rows run in by width (1: padded to the longest)
    layout: str = ""  # what the last batch ran, "flat" or "rows" (:mod:`foundry_attn.flat.layout_cost` chose it)
    layout_reason: str = ""
    padding_read: bool = False  # a plain padded call's side was read (forward.plain_call: left-padded rows said once)
    _shape: ModelShape | None = None
    _fingerprint: tuple = ()
    _modules: tuple = ()

    def __deepcopy__(self, memo: dict) -> PathState:
        """A copied model (``copy.deepcopy``) keeps its path but proves again on its first batch."""
        return dataclasses.replace(
            self,
            proofs=list(self.proofs),
            notes=list(self.notes),
            changes=list(self.changes),
            proven_on_batch=False,
            rows_on_batch=False,
            _modules=(),
        )

    @property
    def is_flat(self) -> bool:
        """Whether the run is on the flat path now.

        Returns:
            ``path == "flat"``.

        Example::

            >>> attach(model, "sdpa").is_flat
            True
        """
        return self.path == FLAT

    def decision_now(self) -> Decision | None:
        """What attach decided, with the path, its reason and the last proof as they are now: the one source of the
        ``attn_impl`` fields (:meth:`~foundry_attn.selection.policy.Decision.as_dict`).

        Returns:
            The decision (None for a state made without one).

        Example::

            >>> path_of(model).decision_now().as_dict()["path"]
            'flat'
        """
        if self.decision is None:
            return None
        proof = self.proofs[-1][1].describe() if self.proofs else self.decision.proof
        return dataclasses.replace(
            self.decision,
            proof=proof,
            path=self.path,
            path_reason=self.reason,
            layout=self.layout or self.path,
            layout_reason=self.layout_reason,
        )

    # ---- the proof --------------------------------------------------------------------------------------
    def prove(
        self,
        model: Any,
        inputs: Mapping[str, Any],
        at: str,
        *,
        grads: bool = True,
        truth: Truth | None = None,
    ) -> Proof:
        """Prove the flat path on ``inputs`` (:func:`foundry_attn.flat.inputs.flat_inputs`); a failure moves to rows
        (or raises, binding).

        Args:
            model: the transformers model, or a wrapper of one.
            inputs: the flat row's inputs, the documents under ``DOCS_KEY``.
            at: where the proof runs, for the reason (``"attach"``, ``"batch 1 (the first training batch)"``).
            grads: compare gradients too (False: forward only, the interval's proof).
            truth: the documents' positions and labels, read from the batch (None: the model's own).

        Returns:
            The :class:`~foundry_attn.flat.proof.Proof` that stands (stock's packed mask's where it took over).

        Raises:
            FlatPathError: the proof failed and the path is binding (``attn_path: flat``, strict).
            NoExactPath: the proof failed and the rows path is not exact either.

        Example::

            >>> state.prove(hf_model, inputs, "attach").describe()
            'passed in 41 ms (documents [28, 13] of a 41-token row, worst |diff| 0.0e+00, gradients 1.8e-07)'
        """
        hf = unwrapped(model)
        use(hf, self.flat_name)
        prove = prove_packed if self.stock_mask else prove_flat
        proof = prove(
            hf,
            inputs,
            BACKENDS[self.backend].truth,
            reference=self.reference,
            grads=grads,
            truth=truth,
        )
        return self.keep_proof(hf, inputs, at, proof, grads, truth)

    def keep_proof(
        self, hf: Any, inputs: Mapping[str, Any], at: str, proof: Proof, grads: bool, truth: Truth | None
    ) -> Proof:
        """Keep ``proof`` of the flat path: proven lengths and code, or rows from now on (proven there too).

        Args:
            hf: the transformers model.
            inputs: the flat row's inputs the proof ran.
            at: where the proof ran, for the reason.
            proof: the flat proof's result.
            grads: it compared gradients.
            truth: the documents' positions and labels, read from the batch (None: the model's own).

        Returns:
            ``proof``, or the proof of stock's packed mask where that holds in its place.

        Example::

            >>> state.keep_proof(hf_model, inputs, "batch 1 (the first training batch)", proof, True, None)
        """
        self.proofs.append((at, proof))
        self._modules = tuple(hf.modules())
        self._fingerprint = self.fingerprint()
        if self._unjudged(hf, at, proof):
            return proof
        if not proof.ok and (packed := self._stock_mask_holds(hf, inputs, at, proof, grads, truth)):
            return packed
        if not proof.ok:
            self.refuse(hf, f"proof at {at} {proof.describe()}", check="proof")
            self.prove_rows(hf, inputs, at, grads=grads, truth=truth)
            return proof
        self._cover(inputs[DOCS_KEY])
        if self.path == FLAT:
            mask = f"stock's packed mask ({self.rows_name}) " if self.stock_mask else ""
            self.reason = f"{mask}proven at {at}: {proof.describe()}"
        return proof

    def _stock_mask_holds(
        self, hf: Any, inputs: Mapping[str, Any], at: str, failed: Proof, grads: bool, truth: Truth | None
    ) -> Proof | None:
        """Where our flat row cannot run (the documents never reach attention: GPT-J's own attention code, a layer
        that drops ``**kwargs``; an argument or a mask content we cannot honour: ``indices``, sinks, Doge's bias),
        the flat row with stock's own packed mask (transformers 5.x splits a packed row at restarting
        ``position_ids``), proven the same way; the run stays flat on it (no padding), or None. Where ours ran and
        computed something else, the run goes to rows as before."""
        if (
            failed.ran
            or not failed.judged
            or self.stock_mask
            or self.backend not in (SDPA, EAGER)
            or not stock_splits_packed_rows()
        ):
            return None  # ours ran and computed otherwise (a leak, a window only the mask knows): rows
        proof = prove_packed(hf, inputs, self.rows_name, reference=self.reference, grads=grads, truth=truth)
        self.proofs.append((f"stock's packed mask at {at}", proof))
        if not proof.ok:
            return None
        self.stock_mask, self.flat_name = True, self.rows_name
        use(hf, self.rows_name)
        self._cover(inputs[DOCS_KEY])
        self._fingerprint = self.fingerprint()
        self.reason = (
            f"stock's packed mask ({self.rows_name}) proven at {at}: {proof.describe()} (ours: {failed.reason})"
        )
        log.info("foundry_attn: %s runs its flat rows on %s", type(hf).__name__, self.reason)
        self._rows_candidate(hf, inputs, at, grads, truth)
        return proof

    def _rows_candidate(
        self,
        hf: Any,
        inputs: Mapping[str, Any],
        at: str,
        grads: bool,
        truth: Truth | None,
        groups: tuple[tuple[int, ...], ...] = (),
    ) -> bool:
        """Prove one document per row as a second exact layout beside the flat row on stock's packed mask (whose
        attention scores the whole row): the cheaper of the two runs each batch. A failure leaves the flat row."""
        try:
            proof = self.prove_rows(hf, inputs, at, grads=grads, truth=truth, groups=groups)
        except NoExactPath as exc:
            proof = Proof(False, reason=str(exc), rows=True)
        self.rows_proven = proof.ok
        if not proof.ok:
            self._note(hf, f"rows at {at} not a candidate beside the flat row: {proof.describe()}")
        return proof.ok

    def prove_rows(
        self,
        model: Any,
        inputs: Mapping[str, Any],
        at: str,
        *,
        grads: bool = True,
        truth: Truth | None = None,
        groups: tuple[tuple[int, ...], ...] = (),
    ) -> Proof:
        """Prove the rows path on the documents of ``inputs`` (:func:`foundry_attn.flat.proof.prove_rows`):
        right-padded rows, and where they differ from each document alone, left-padded ones (the run pads on the
        left from then on). Where neither is exact the model is refused (never trained off its documents alone):
        :class:`~foundry_attn.selection.policy.AttentionUnavailableError` with each path's cause.

        Args:
            model: the transformers model, or a wrapper of one.
            inputs: the flat row's inputs, whose documents are laid out one per row.
            at: where the proof runs, for the reason.
            grads: compare gradients too (False: forward only).
            truth: the documents' positions and labels, read from the batch (None: the model's own).
            groups: the documents of each forward where the batch's rows run in several by width (each compared
                document is laid out as wide as its forward's rows).

        Returns:
            The rows proof (the left-padded one where that is the exact one).

        Raises:
            NoExactPath: neither right- nor left-padded rows train as each document alone.

        Example::

            >>> state.prove_rows(hf_model, inputs, "attach").ok
            True
        """
        hf = unwrapped(model)

        def proof_of(left: bool) -> Proof:
            return prove_rows(
                hf,
                inputs,
                self.rows_name,
                BACKENDS[self.backend].truth,
                reference=self.reference,
                grads=grads,
                truth=truth,
                left=left,
                groups=groups,
            )

        proof = proof_of(self.rows_left)
        self.proofs.append((f"rows at {at}", proof))
        if self._unjudged(hf, f"rows at {at}", proof):
            return proof
        if not proof.ok and not self.rows_left and proof.ran:  # the rows ran and differ: the other side may not
            left = proof_of(True)
            self.proofs.append((f"rows left-padded at {at}", left))
            if left.ok:
                self.rows_left = True
                right = f"rows at {at}: right-padded rows {proof.describe()}"
                self._note(hf, f"{right}; left-padded rows are exact: rows pad left")
                proof = left
        docs: Documents = inputs[DOCS_KEY]
        if proof.ok:
            self._cover(docs, rows=self.path == FLAT)
            self.reason = self.reason.split("; rows proven at ")[0] + f"; rows proven at {at}: {proof.describe()}"
            return proof
        if not proof.ran and not rows_train_error(hf, inputs, self.rows_name, self.reference, self.rows_left):
            # the proof's own forwards cannot run (Reformer: no backward in eval mode) but training does: rows, as
            # stock's padded batches, kept in the notes: unproven, never silent
            self._note(hf, f"rows at {at} not proven: {proof.describe()}; one document per row trains here")
            return proof
        flat = "" if self.path == ROWS and self.reason.startswith("attn_path: rows") else f"flat: {self.reason}; "
        sides = "right- and left-padded" if proof.ran else "it does not run here"
        raise NoExactPath(
            f"foundry_attn: neither path trains {type(hf).__name__} with {self.backend} as each document alone: "
            f'{flat}one document per row ({sides}): {proof.describe()}. Fix: attach(model, "auto") (the fastest '
            "backend that runs here), another backend, or train without packing"
        )

    def _unjudged(self, hf: Any, at: str, proof: Proof) -> bool:
        """A proof that judged nothing (stock could not compute a document alone: a nan, an error) after one of the
        same path that did: the run keeps the decision of the last proof that judged, and says so. At attach, or
        with no such proof, False: nothing stands, so the proof's failure is the reason."""
        if proof.ok or proof.judged:
            return False
        earlier = [p for _, p in self.proofs[:-1] if p.ok and p.judged and p.rows == proof.rows]
        if not earlier:
            return False
        label = at if proof.rows else f"proof at {at}"
        note = f"{label} judged nothing: {proof.reason}; the decision of the last proof that judged stands"
        self.notes.append(note)
        log.warning("foundry_attn: %s %s", type(hf).__name__, note)
        return True

    def _note(self, hf: Any, note: str) -> None:
        """What the rows path does that the reason does not say, kept in the notes; the first said as a warning."""
        said = any(n.startswith("rows at ") for n in self.notes)
        self.notes.append(note)
        (log.info if said else log.warning)("foundry_attn: %s %s", type(hf).__name__, note)

    def _cover(self, docs: Documents, rows: bool = False) -> None:
        """Lengths up to the next power of two of this row's and its longest document's are proven (``rows``: for one
        document per row as a candidate beside the flat row)."""
        before = self.rows_covered if rows else self.covered
        after = max(before[0], ceil2(docs.bounds[-1])), max(before[1], ceil2(docs.max_length))
        if rows:
            self.rows_covered = after
        else:
            self.covered = after

    def fingerprint(self) -> tuple:
        """What the flat path's exactness rests on, by identity: the dispatch entries of our name and the stock
        one, the kernels the flat path calls (:func:`kernels`), every module's ``forward`` (class and instance) and
        HF checkpointing. Costs microseconds (measured in ``bench proof``).

        Returns:
            A tuple of the functions and flags above, compared by ``==`` per batch.

        Example::

            >>> before = state.fingerprint()
            >>> before == state.fingerprint()      # False once sdpa or a module's forward is patched
            True
        """
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

    def due(self, hf: Any, tokens: int, longest: int, rows: bool = False) -> tuple[str, bool] | None:
        """Why a proof is due on a training batch of ``tokens`` real tokens whose longest document is ``longest``,
        and whether it compares gradients (``rows``: of one document per row as a candidate beside the flat row).

        Args:
            hf: the transformers model (its parameters tell a sharded run, whose ranks agree on the lengths).
            tokens: the batch's real tokens (the flat row's length).
            longest: its longest document.
            rows: the batch runs one document per row while the run is flat.

        Returns:
            ``(why, grads)``, or None when no proof is due.

        Example::

            >>> state.due(hf_model, 41, 28)
            ('the first training batch', True)
        """
        if not (self.rows_on_batch if rows else self.proven_on_batch):
            return "the first training batch" + (" on one document per row" if rows else ""), True
        if self.fingerprint() != self._fingerprint:
            return "a change of the attention code", True
        tokens, longest = _agreed((tokens, longest), hf)
        covered = self.rows_covered if rows else self.covered
        if tokens > covered[0] or longest > covered[1]:
            return f"a longer batch: {tokens} tokens, documents up to {longest}; proven up to {covered}", True
        if self.interval and self.batches % self.interval == 0:
            return f"the {self.interval}-batch interval", False
        return None

    def shape(self, hf: Any) -> ModelShape:
        """What a layout's cost reads of the model, read once.

        Args:
            hf: the transformers model.

        Returns:
            Its :class:`~foundry_attn.flat.layout_cost.ModelShape`.

        Example::

            >>> state.shape(hf_model).layers
            2
        """
        if self._shape is None:
            self._shape = ModelShape.of(hf)
        return self._shape

    def forwards(self, hf: Any, lengths: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        """The documents of each forward a batch's rows run in, where several by width cost less than one
        (:func:`~foundry_attn.flat.layout_cost.row_groups`); empty for one forward. One forward where the model adds
        a loss over all its tokens (a router's load-balancing loss); ``state.most_forwards = 1`` keeps one. With
        several processes, :meth:`plan` agrees on the number across the ranks.

        Args:
            hf: the transformers model.
            lengths: every document's length in the batch.

        Returns:
            The documents (indices in batch order) of each forward, widest first; empty: one forward.

        Example::

            >>> state.forwards(gptj, [2048] + [32] * 64)
            ((0,), (1, 2, ..., 64))
        """
        return self._groups(hf, lengths) if self.splits(hf) else ()

    def _groups(self, hf: Any, lengths: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        """:meth:`forwards` where :meth:`splits` already said yes."""
        if not lengths:
            return ()
        groups = row_groups(tuple(lengths), self.most_forwards, self.shape(hf).forward_positions)
        return groups if len(groups) > 1 else ()

    def splits(self, hf: Any, training: bool = True) -> bool:
        """Whether a batch's rows may run in several forwards: not where the model adds a loss over all a forward's
        tokens (a router's), nor with ``most_forwards`` 1; with several processes, only for a training batch of a
        model whose parameters are not sharded (DDP: the ranks agree on the number, :meth:`plan`; FSDP's
        all-gathers are left to one forward). The same answer on every rank.

        Args:
            hf: the transformers model.
            training: the batch trains (gradients on).

        Returns:
            True where :meth:`forwards` may split.

        Example::

            >>> state.splits(hf_model)
            True
        """
        if self.most_forwards < 2 or getattr(hf.config, "output_router_logits", False):
            return False
        return _world() == 1 or (training and not _sharded(hf))

    def _agreed(self, hf: Any, lengths: Sequence[int], layout: str, groups: tuple) -> tuple[str, tuple]:
        """The layout and forwards every rank of a multi-process run can pair up: the fewest forwards any rank
        would run (one all-reduce, every training batch, on every rank), this rank's rows regrouped into that many;
        where that is one, the layout chosen again for rows in one forward."""
        fewest = _fewest(max(1, len(groups)), hf)
        if fewest >= max(1, len(groups)):
            return layout, groups
        if fewest == 1:
            return self.choose_layout(hf, lengths), ()
        return layout, row_groups(tuple(lengths), fewest, self.shape(hf).forward_positions)

    def choose_layout(self, hf: Any, lengths: Sequence[int], grouped: bool = False) -> str:
        """The layout a batch of documents of ``lengths`` runs: the run's path, or, where one document per row is
        proven beside the flat row on stock's packed mask, the cheaper of the two within the free memory
        (:func:`foundry_attn.flat.layout_cost.cheapest`), kept with its reason as ``layout``/``layout_reason``.

        Args:
            hf: the transformers model.
            lengths: every document's length in the batch.
            grouped: the rows may run in several forwards by width (:meth:`forwards`).

        Returns:
            ``"flat"`` or ``"rows"``.

        Example::

            >>> state.choose_layout(gptj, [256] * 16)     # flat on stock's packed mask, rows proven too
            'rows'
        """
        if not (self.path == FLAT and self.stock_mask and self.rows_proven and lengths):
            self.layout, self.layout_reason = self.path, ""
            return self.path
        free = free_memory(next(hf.parameters()).device)
        most = self.most_forwards if grouped else 1
        choice = cheapest(self.shape(hf), lengths, (FLAT, ROWS), stock_mask=True, free=free, forwards=most)
        if choice.layout != self.layout:
            log.info("foundry_attn: %s runs %s", type(hf).__name__, choice.reason)
        self.layout, self.layout_reason = choice.layout, choice.reason
        return choice.layout

    def plan(
        self,
        hf: Any,
        tokens: int,
        longest: int,
        in_step: bool = False,
        lengths: Sequence[int] = (),
        grouped: bool = False,
    ) -> Plan:
        """The one per-batch plan, for a batch of ``tokens`` real tokens whose longest document is ``longest``:
        its layout (flat while proven and in place, else rows), and for a training batch the proof due on it, if
        any (counted here: this is called once per batch). ``in_step``: the caller runs the forward itself,
        uncompiled, so a flat proof may take that forward as its packed side where
        :func:`foundry_attn.flat.step_proof.step_blocker` allows.

        Args:
            hf: the transformers model.
            tokens: the batch's real tokens.
            longest: its longest document.
            in_step: the caller runs the forward itself, uncompiled.
            lengths: every document's length, for the choice of layout (:meth:`choose_layout`; empty: the path).
            grouped: the caller runs rows in several forwards by width where that costs less (:meth:`forwards`).

        Returns:
            The batch's :class:`Plan`.

        Example::

            >>> state.plan(hf_model, layout.real_tokens, layout.max_length, in_step=True)
            Plan(path='flat', at='batch 1 (the first training batch)', grads=True, in_step=True)
        """
        if self.path == FLAT and current(hf) != self.flat_name:
            return Plan(ROWS)  # someone set another implementation: stock runs it, one document per row
        training = hf.training and torch.is_grad_enabled()
        grouped = grouped and self.splits(hf, training)
        layout = self.choose_layout(hf, lengths, grouped)
        groups = self._groups(hf, lengths) if grouped and layout == ROWS else ()
        if grouped and _world() > 1:  # every rank runs as many forwards (DDP broadcasts its buffers in each)
            layout, groups = self._agreed(hf, lengths, layout, groups)
        if not training:
            return Plan(layout, groups=groups)
        self.batches += 1
        candidate = layout == ROWS and self.path == FLAT
        due = self.due(hf, tokens, longest, rows=candidate)
        if due is None:
            return Plan(layout, groups=groups)
        if candidate:
            self.rows_on_batch = True
        else:
            self.proven_on_batch = True
        at = f"batch {self.batches} ({due[0]})"
        in_step = in_step and layout == FLAT and not self.stock_mask and step_blocker(hf) is None
        return Plan(layout, at, due[1], in_step, groups)

    def prove_batch(self, hf: Any, inputs: Mapping[str, Any], plan: Plan, truth: Truth | None) -> str:
        """Prove ``plan``'s path on this batch's flat ``inputs`` (whose documents the rows proof lays out one per
        row); the path the batch runs after (a failed flat proof: rows).

        Args:
            hf: the transformers model.
            inputs: the batch's flat inputs.
            plan: this batch's :class:`Plan`, with a proof due (``plan.at``).
            truth: the documents' positions and labels, read from the batch (None: the model's own).

        Returns:
            ``"flat"`` or ``"rows"``.

        Example::

            >>> state.prove_batch(hf_model, inputs, plan, truth=None)
            'flat'
        """
        assert plan.at is not None
        if plan.path == FLAT:
            self.prove(hf, inputs, plan.at, grads=plan.grads, truth=truth)
            return self.path
        self._modules = tuple(hf.modules())
        if self.path == FLAT:  # one document per row as the cheaper candidate: a failure leaves the flat row
            runs = self._rows_candidate(hf, inputs, plan.at, plan.grads, truth, plan.groups)
            self._fingerprint = self.fingerprint()
            if not runs:
                self.layout, self.layout_reason = FLAT, f"one document per row failed its proof at {plan.at}"
            return ROWS if runs else FLAT
        self.prove_rows(hf, inputs, plan.at, grads=plan.grads, truth=truth, groups=plan.groups)
        self._fingerprint = self.fingerprint()
        return ROWS

    def step_proof(self, hf: Any, inputs: Mapping[str, Any], plan: Plan, truth: Truth | None) -> StepProof:
        """The proof ``plan`` calls for on the batch's own forward (``plan.in_step``).

        Args:
            hf: the transformers model.
            inputs: the batch's flat inputs.
            plan: this batch's :class:`Plan`, with ``in_step``.
            truth: the documents' positions and labels, read from the batch (None: the model's own).

        Returns:
            The :class:`~foundry_attn.flat.step_proof.StepProof` to run the forward in.

        Example::

            >>> proof = state.step_proof(hf_model, inputs, plan, truth=None)
        """
        assert plan.at is not None
        return StepProof(self, hf, inputs, plan.at, plan.grads, truth)

    # ---- moving to rows ---------------------------------------------------------------------------------
    def refuse(self, hf: Any, reason: str, check: str = "proof") -> None:
        """Flat is refused for this model: rows from now on, one warning; binding: the error.

        Args:
            hf: the transformers model.
            reason: why, kept as ``state.reason`` and in ``state.changes``.
            check: the failed check, named in the binding error.

        Raises:
            FlatPathError: the path is binding (``attn_path: flat``, strict).

        Example::

            >>> state.refuse(hf_model, "proof at attach failed (documents [28, 13] of a 41-token row): ...")
            >>> state.path
            'rows'
        """
        if self.binding:
            raise FlatPathError(
                f"attn_path: flat cannot run {type(hf).__name__} with {self.backend}: check '{check}' failed: "
                f"{reason}. Fix: set attn_path: auto (one document per row where flat is not exact)"
            )
        self.path, self.reason = ROWS, reason
        use(hf, self.rows_name)
        log.warning("foundry_attn: %s runs one document per row (%s): %s", type(hf).__name__, self.rows_name, reason)
        self.changes.append(PathChange(self.batches, ROWS, reason))


def path_of(model: Any) -> PathState | None:
    """The :class:`PathState` of ``model`` (or of the HF model inside a wrapper), or None if never attached.

    Args:
        model: a transformers model, or a wrapper of one (DDP, FSDP, ``torch.compile``, PEFT).

    Returns:
        The state :func:`~foundry_attn.flat.attach.attach` kept on it, or None.

    Example::

        >>> path_of(model).path, path_of(model).reason
        ('flat', 'proven at attach: passed in 41 ms (...)')
    """
    return getattr(unwrapped(model), PATH_ATTR, None)
