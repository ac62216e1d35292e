"""Packed against alone for the whole model: every parameter's gradient (the documents' alone summed), and how far
each document's gradient reaches into the others (the proof's :mod:`foundry_attn.proof.prove`, the inspector's
verdict :mod:`foundry_attn.observe.verdict`).

    worst, wrong = params_differ(packed.params, summed(alone), limits)   # "" where every parameter trains as alone
    influence(packed.grad, spans).leaks                                  # a document's loss moves another's tokens

A run (:mod:`foundry_attn.proof.runs`) is one forward's logits and, with grads, the gradient of its documents'
next-token loss with respect to the input embeddings and every parameter; each document's logits and input gradients
against its run alone, and what exact means, are :mod:`foundry_attn.proof.tolerance`'s. Core module: torch and
transformers only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from foundry_attn.proof.runs import ParamGrads, Run
from foundry_attn.proof.tolerance import PARAM_FLOOR, PARAM_RTOL, Limits, worse


def summed(runs: Sequence[Run]) -> ParamGrads | None:
    """The parameter gradients of ``runs`` added up (the truth of documents run alone); None where one has none.

    Args:
        runs: the documents' runs alone.

    Returns:
        Each parameter's gradient summed over ``runs`` (None where none reaches it), or None.

    Example::

        >>> summed(alone_runs)["model.norm.weight"].shape
        torch.Size([32])
    """
    if not runs or any(r.params is None for r in runs):
        return None
    total: ParamGrads = {}
    for r in runs:
        assert r.params is not None
        for name, g in r.params.items():
            have = total.get(name)
            total[name] = g if have is None else have if g is None else have + g
    return total


def params_differ(packed: ParamGrads, truth: ParamGrads, limits: Limits) -> tuple[float, str]:
    """Every parameter the truth gives a gradient must get one, within the limits (fp32: :data:`PARAM_RTOL` of its
    own largest, floored at :data:`PARAM_FLOOR` of the largest of any; half precision: present). The worst relative
    difference, and what is wrong (empty when nothing is), the parameters named.

    Args:
        packed: the packed side's parameter gradients.
        truth: the documents' gradients alone, summed (:func:`summed`).
        limits: the proof's limits (``fp32`` is read).

    Returns:
        The worst relative difference and the failure ("" where every parameter holds).

    Example::

        >>> params_differ(packed_run.params, summed(alone_runs), limits)     # every parameter
        (..., '')
    """
    largest = {n: (g.float().abs().max().item() if g is not None and g.numel() else 0.0) for n, g in truth.items()}
    floor = PARAM_FLOOR * max(largest.values(), default=0.0)
    worst, missing, off = 0.0, [], []
    for name, want in truth.items():
        scale = max(largest[name], floor)
        if scale == 0.0:
            continue
        got = packed.get(name)
        if got is None or (largest[name] > floor and not bool(got.any())):
            if largest[name] > floor:
                missing.append(f"{name} ({largest[name]:.1e} alone)")
            continue
        if not limits.fp32 or want is None:
            continue
        diff = (got.float() - want.float()).abs().max().item() / scale
        worst = worse(worst, diff)
        if not diff <= PARAM_RTOL:
            off.append(f"{name} ({diff:.1e} of its largest)")
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        named = f"{', '.join(missing[:3])}{more}"
        return worst, f"parameter(s) {named} get no gradient on this path (each document alone gives them one)"
    if off:
        more = f" and {len(off) - 3} more" if len(off) > 3 else ""
        return worst, f"parameter gradient(s) differ from each document alone: {', '.join(off[:3])}{more}"
    return worst, ""


@dataclasses.dataclass(frozen=True)
class Influence:
    """How far some documents' loss reaches the input embeddings of the other documents of their row: ``reach`` the
    largest |gradient| there, ``own`` the largest on their own tokens. Isolated documents give exactly zero at any
    precision (a masked score is an exact zero; so is its gradient); attention across the boundary, an SSM or
    convolution state, a token shift give a non-zero block. No noise floor, no limit."""

    reach: float
    own: float

    @property
    def leaks(self) -> bool:
        """Whether the loss reaches the other documents at all (a nan does too).

        Returns:
            True where ``reach`` is not exactly zero.

        Example::

            >>> influence(packed_run.grad, [(0, 28), (28, 41)]).leaks     # the 1-token document at 41 gets none
            False
        """
        return not self.reach == 0.0  # nan leaks too

    def describe(self) -> str:
        """The verdict in words, for a proof's or the inspector's reason.

        Returns:
            One clause: exactly zero, or how far the loss reaches.

        Example::

            >>> Influence(0.0, 5.26).describe()
            "its loss has exactly zero gradient on the other documents' embeddings"
        """
        if not self.leaks:
            return "its loss has exactly zero gradient on the other documents' embeddings"
        share = self.reach / self.own if self.own > 0 else math.inf
        return (
            f"its loss reaches the other documents' embeddings: gradient {self.reach:.2e} ({share:.1e} of its largest "
            "on its own)"
        )


def influence(grad: torch.Tensor, own: Sequence[tuple[int, int]], row: tuple[int, int] | None = None) -> Influence:
    """:class:`Influence` of a loss whose gradient with respect to one row's embeddings is ``grad`` ``[tokens,
    hidden]``: its own documents at ``own``, the others every other token of ``row`` (default: the whole row).

    Args:
        grad: the loss's gradient with respect to the row's input embeddings ``[tokens, hidden]``.
        own: the ``(start, end)`` of the documents whose loss it is.
        row: the ``(start, end)`` of the row within ``grad`` (None: all of it).

    Returns:
        An :class:`Influence`: the largest |gradient| on the other documents' tokens and on their own.

    Example::

        >>> influence(packed_run.grad, [(0, 28), (28, 41)])     # the loss of the first two of a 42-token row
        Influence(reach=0.0, own=...)
    """
    start, end = row or (0, grad.shape[0])
    inside = torch.zeros(grad.shape[0], dtype=torch.bool, device=grad.device)
    for s, e in own:
        inside[s:e] = True
    others = ~inside
    others[:start] = False
    others[end:] = False
    mine = grad[inside].float().abs()
    theirs = grad[others].float().abs()
    return Influence(
        theirs.max().item() if theirs.numel() else 0.0,
        mine.max().item() if mine.numel() else 0.0,
    )
