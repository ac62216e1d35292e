"""A proof's result and the documents it compares: what the path reads back.

    proof = prove_flat(hf_model, inputs, stock="sdpa")     # foundry_attn.proof.prove
    proof.ok, proof.describe()                             # "passed in 41 ms (documents [28, 13] of ...)"
    pick(docs)                                             # the two documents a proof runs alone

Core module: torch only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from foundry_attn.attention.documents import Documents
from foundry_attn.proof.runs import (
    Run,
)


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

            >>> proof.describe()
            'passed in 591 ms (documents [28, 13] of a 41-token row, worst |diff| 0.0e+00, gradients 1.3e-07)'
        """
        grads = "" if self.worst_grad is None else f", gradients {self.worst_grad:.1e}"
        docs = f"documents {list(self.lengths)} of a {self.tokens}-token row"
        if self.ok:
            return f"passed in {self.ms:.0f} ms ({docs}, worst |diff| {self.worst:.1e}{grads})"
        return f"failed ({docs}): {self.reason}"


def pick(docs: Documents) -> tuple[int, int]:
    """The two documents of a flat row to run alone: the longest (the length a kernel picks its code path by,
    past a window where any document is) and the last of two tokens or more (the most exposed to what precedes it,
    with targets: a 1-token document has no next-token loss); where that is the longest, the shortest other of two
    tokens or more (another place in the row, at the least cost). A row of one document runs it twice: always two
    forwards alone, so FSDP ranks proving the same batch all-gather the same number of times.

    Args:
        docs: the flat row's :class:`~foundry_attn.attention.documents.Documents`.

    Returns:
        The two documents' indices in the row (``(0, 0)`` for a row of one).

    Example::

        >>> pick(Documents((0, 13, 42, 60)))     # lengths [13, 29, 18]: the longest and the last
        (1, 2)
    """
    lengths = docs.lengths
    if len(lengths) == 1:
        return 0, 0
    last = max((i for i, n in enumerate(lengths) if n > 1), default=len(lengths) - 1)
    longest = max(range(len(lengths)), key=lambda i: (lengths[i], i))
    if longest != last:
        return longest, last
    rest = [i for i in range(len(lengths)) if i != last]
    others = [i for i in rest if lengths[i] > 1] or rest
    return min(others, key=lambda i: lengths[i]), last


def pick_rows(docs: Documents) -> tuple[int, int]:
    """The two documents a rows proof lays out one per row: the longest (no padding) and the shortest (the most
    padding, where a model that is not padding-invariant shows it); rows do not see each other, so the place in
    the row does not matter. A row of one document runs it twice, as :func:`pick`.

    Args:
        docs: the flat row's :class:`~foundry_attn.attention.documents.Documents`.

    Returns:
        The two documents' indices in the row.

    Example::

        >>> pick_rows(Documents((0, 13, 42, 60)))     # lengths [13, 29, 18]: the longest and the shortest
        (1, 0)
    """
    lengths = docs.lengths
    longest = max(range(len(lengths)), key=lambda i: (lengths[i], i))
    shortest = min(range(len(lengths)), key=lambda i: (lengths[i], -i))
    return (longest, shortest) if shortest != longest else pick(docs)


NO_CALLS = "no attention call received the documents: this model's attention bypasses transformers' interface"


class NotRun(str):
    """A proof's reason that says one side could not run at all (``Proof.ran`` is False)."""


class StockFailed(NotRun):
    """A proof's reason that says stock could not compute a document alone: nothing was judged
    (``Proof.judged`` is False), so the run keeps the decision of the last proof that could judge."""


def undefined_values(runs: Sequence[Run], spans: Sequence[tuple[int, int]], packed: bool = False) -> str:
    """Where runs are not finite (a fully masked score row, a softmax over nothing), in words; "" where they are.

    Args:
        runs: one run per span, or with ``packed`` one run of the whole row.
        spans: the documents' ``(start, end)`` in the row.
        packed: read the one run at each span (else each run whole).

    Returns:
        Each document with non-finite logits or gradients, and at how many tokens; "" where every value is finite.

    Example::

        >>> undefined_values([Run(logits)], [(0, 3), (3, 5)], packed=True)     # a nan at token 3
        'document of 2 tokens: nan or inf logits at 1 of its 2 tokens'
    """
    bad = []
    for i, (s, e) in enumerate(spans):
        mine = runs[0] if packed else runs[i]
        logits = mine.logits[s:e] if packed else mine.logits
        tokens = int((~torch.isfinite(logits.float())).any(-1).sum())
        grads = mine.grad is not None and not bool(torch.isfinite(mine.grad[s:e] if packed else mine.grad).all())
        if tokens or grads:
            what = f"nan or inf logits at {tokens} of its {e - s} tokens" if tokens else "nan or inf gradients"
            bad.append(f"document of {e - s} tokens: {what}")
    return "; ".join(bad)
