"""A proof's result: what the path reads back.

    proof = prove_flat(hf_model, inputs, stock="sdpa")     # foundry_attn.proof.prove
    proof.ok, proof.describe()                             # "passed in 41 ms (documents [28, 13] of ...)"

Core module: torch only.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Proof:
    """One proof: ``ok`` with the worst differences, or the reason it failed (and which documents)."""

    ok: bool
    worst: float = 0.0  # logits
    reason: str = ""
    ms: float = 0.0
    lengths: tuple[int, ...] = ()  # the documents compared, alone
    compared: tuple[int, ...] = ()  # their indices in the flat row
    tokens: int = 0  # the flat row's length
    worst_grad: float | None = None  # gradients (None: forward only)
    ran: bool = True  # both sides ran (False: the reason is that one could not)
    judged: bool = True  # stock computed each document alone (False: nothing was judged, the reason says why)
    rows: bool = False  # a proof of one document per row (else of the flat row)

    def describe(self) -> str:
        """The proof in words, for the state's reason or a refusal.

        Returns:
            ``passed in ... ms (...)`` with the worst differences, or ``failed (...): <reason>``.

        Example::

            >>> at, proof = state.proofs[-1]     # the path's last proof: the one at attach
            >>> at, proof.describe()
            ('attach', 'passed in ... ms (documents [28, 13] of a 42-token row, worst |diff| ..., gradients ...)')
        """
        grads = "" if self.worst_grad is None else f", gradients {self.worst_grad:.1e}"
        docs = f"documents {list(self.lengths)} of a {self.tokens}-token row"
        if self.ok:
            return f"passed in {self.ms:.0f} ms ({docs}, worst |diff| {self.worst:.1e}{grads})"
        return f"failed ({docs}): {self.reason}"


NO_CALLS = "no attention call received the documents: this model's attention bypasses transformers' interface"


class NotRun(str):
    """A proof's reason that says one side could not run at all (``Proof.ran`` is False)."""


class StockFailed(NotRun):
    """A proof's reason that says stock could not compute a document alone: nothing was judged
    (``Proof.judged`` is False), so the run keeps the decision of the last proof that could judge."""
