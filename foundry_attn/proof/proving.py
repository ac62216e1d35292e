"""Whose forward this is: the batch's, or a check's (a proof, a verdict, stock's noise), which the callbacks' hooks
and tracers leave out of what they report.

    with hidden():              # a proof's forwards
        assert proving()

Core module: standard library only.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_PROVING = contextvars.ContextVar("foundry_attn_proving", default=False)


def proving() -> bool:
    """True inside a proof's forwards: the callbacks' hooks and tracers leave them out of what they report.

    Returns:
        Whether the running forward is a check's.

    Example::

        >>> calls = []
        >>> _ = hf_model.register_forward_pre_hook(lambda m, a: None if proving() else calls.append(a))
        >>> with hidden():     # a check's forward: left out
        ...     logits = hf_model(input_ids=ids).logits
        >>> logits = hf_model(input_ids=ids).logits
        >>> len(calls)
        1
    """
    return _PROVING.get()


@contextlib.contextmanager
def hidden() -> Iterator[None]:
    """Forwards in this block are a check's, not the batch's: :func:`proving` is True inside it.

    Returns:
        A context manager.

    Example::

        >>> with hidden():
        ...     proving()
        True
        >>> proving()
        False
    """
    token = _PROVING.set(True)
    try:
        yield
    finally:
        _PROVING.reset(token)
