"""The proof due on a training batch that takes the batch's own forward as its packed side, and when it may.

    blocked = step_blocker(hf_model)     # None: training mode computes what eval mode does; the flat row runs once
    with proof.capturing():                     # forward_documents, around the batch's forward
        out = model(**inputs)
    stands = proof.settle(out)                  # False: the batch runs again where the state is now (rows)

Core module: torch and transformers only.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch

from foundry_attn.attention.backends import BACKENDS
from foundry_attn.attention.documents import DOCS_KEY
from foundry_attn.flat.layout import Truth
from foundry_attn.flat.unwrap import unwrapped
from foundry_attn.proof.prove import prove_step
from foundry_attn.proof.result import Proof
from foundry_attn.proof.runs import HeadCall, embeddings, head_calls
from foundry_attn.proof.sides import checkpointing, passes_kwargs
from foundry_attn.proof.subject import Subject
from foundry_attn.proof.tolerance import training_noise


def step_blocker(model: Any) -> str | None:
    """Why a proof cannot take the training forward as its packed side (:func:`prove_step`), or None: dropout or
    router noise (training mode would differ from the eval-mode truth), checkpointing (recomputation under
    ``torch.autograd.grad``), sharded parameters (FSDP2's backward hooks would run for the proof), no embedding
    module to differentiate against.

    Args:
        model: the model, or a wrapper of one (DDP, FSDP, ``torch.compile``).

    Returns:
        What keeps the proof from the training forward, named, or None.

    Example::

        >>> hf_model.gradient_checkpointing_enable()
        >>> step_blocker(hf_model)
        'HF gradient checkpointing'
    """
    hf = getattr(unwrapped(model), "_orig_mod", unwrapped(model))
    if checkpointing(hf):
        return "HF gradient checkpointing"
    if not passes_kwargs(hf):  # the documents cannot reach attention: the proof says so without a training forward
        return "its base model's forward takes no **kwargs"
    if not hasattr(hf, "get_input_embeddings") or hf.get_input_embeddings() is None:
        return "no input embedding module"
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.tensor import DTensor

    if isinstance(next(hf.parameters()), DTensor):
        return "sharded parameters (FSDP2)"
    wrapped = next((name for name, m in hf.named_modules() if isinstance(m, CheckpointWrapper)), None)
    if wrapped is not None:
        return f"activation checkpointing ({wrapped})"
    return training_noise(hf)


class Keeper(Protocol):
    """What a step proof reads of the path's state (:class:`foundry_attn.path.state.PathState`, handed in, never
    imported); the proof's outcome goes back through the two calls a :class:`StepProof` is given."""

    backend: str
    reference: bool
    stock_mask: bool

    @property
    def is_flat(self) -> bool:
        """Whether the run is on the flat path now.

        Returns:
            ``path == "flat"``.

        Example::

            >>> state.is_flat
            True
        """
        ...


#: keep a proof's outcome: ``(hf, inputs, at, proof, grads, truth) -> the proof that stands``
#: (:func:`foundry_attn.path.proven.keep_proof`)
Keep = Callable[[Any, Mapping[str, Any], str, Proof, bool, "Truth | None"], Proof]
#: prove the flat path again with its own forward: ``(hf, inputs, at, *, grads, truth) -> the proof that stands``
#: (:func:`foundry_attn.path.proven.prove`)
ProveAgain = Callable[..., Proof]


@dataclasses.dataclass
class StepProof:
    """A proof due on a training batch that takes the batch's own forward as its packed side, so the flat row runs
    once: :func:`foundry_attn.path.forward.forward_documents` runs the forward inside :meth:`capturing`, then
    :meth:`settle`. A difference there is judged again by the full proof (its own forward in eval mode): it decides,
    and a difference only training mode shows moves the run to rows too. A training forward that raises on the flat
    row (a model's own loss reading the mask, a layer refusing an argument) moves the run to rows, where the batch
    runs again: never worse than stock."""

    state: Keeper
    keep: Keep
    again: ProveAgain
    subject: Subject
    inputs: Mapping[str, Any]
    at: str
    grads: bool
    truth: Truth | None
    captured: list[torch.Tensor] = dataclasses.field(default_factory=list)
    head: list[HeadCall] = dataclasses.field(default_factory=list)

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Around the training forward: its input embeddings and output layer's calls, for the gradient part.

        Returns:
            A context manager.

        Example::

            >>> with step.capturing():     # forward_documents, around the batch's forward
            ...     out = hf_model(**inputs)
            >>> len(step.captured), len(step.head)     # its input embeddings, its output layer's call
            (1, 1)
        """
        hf = self.subject.model
        with embeddings(hf, self.grads) as captured, head_calls(hf, self.grads) as head:
            self.captured, self.head = captured, head
            yield

    def settle(self, out: Any, error: BaseException | None = None) -> bool:
        """Prove on the forward's ``out`` (or the ``error`` it raised); whether the batch's flat forward stands
        (False: the run is on rows now, or on the flat row with stock's packed mask, and the batch runs again
        there).

        Args:
            out: what the training forward returned (None where it raised).
            error: the exception the forward raised, or None.

        Returns:
            True where the batch's flat forward stands; False: the batch runs again where the state is now.

        Example::

            >>> with step.capturing():
            ...     out = hf_model(**inputs)
            >>> step.settle(out)     # forward_documents, after the batch's forward; step.settle(None, exc) on a raise
            True
        """
        state, hf = self.state, self.subject.model
        if error is not None:
            text = str(error).strip().splitlines()
            reason = f"the flat row does not run in training: {type(error).__name__}: {text[0] if text else ''}"
            failed = Proof(False, reason=reason[:300], tokens=self.inputs[DOCS_KEY].bounds[-1], ran=False)
            self.keep(hf, self.inputs, self.at, failed, self.grads, self.truth)
            return False
        proof = None
        if out is not None:
            proof = prove_step(
                self.subject,
                self.inputs,
                out,
                self.captured,
                BACKENDS[state.backend].truth,
                head=self.head,
                reference=state.reference,
                grads=self.grads,
                truth=self.truth,
            )
        if proof is not None and proof.ok:
            self.keep(hf, self.inputs, self.at, proof, self.grads, self.truth)
            return True
        mask = state.stock_mask
        full = self.again(hf, self.inputs, self.at, grads=self.grads, truth=self.truth)
        if state.stock_mask != mask:  # the flat row moved to stock's packed mask: the batch runs again there
            return False
        if full.ok and proof is not None:  # eval mode holds, the training forward does not: never run silently
            self.keep(hf, self.inputs, f"{self.at}, in training mode", proof, self.grads, self.truth)
        return state.is_flat
