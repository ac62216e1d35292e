"""The checks a key goes through where it is parsed: one wording everywhere, what is accepted in the error.

    check_interval("upad_tracer", "log_interval", 50)                          # 50
    check_interval("foundry_attn_causal_lm", "attn_proof_interval", 0, minimum=0)   # 0: first batch and changes only
    check_choice("attn_path", "flatt", ("auto", "flat", "rows"))   # attn_path: unknown value 'flatt'; valid values: ...
    short(starts)                                                  # a long list in an error: '[0, 10, ...] (10)'

Core module: standard library only.
"""

from __future__ import annotations

from collections.abc import Iterable


def check_interval(owner: str, key: str, value: object, *, minimum: int = 1, accepted: str = "") -> int:
    """``value`` as an interval: an integer (not a bool) >= ``minimum``, else a ValueError that names ``owner``,
    ``key``, what is accepted (``accepted``, default "an integer >= minimum") and the value given.

    Args:
        owner: who reads the key (``attention_inspector``, ``foundry_attn_causal_lm``, ...).
        key: the key's name as the user wrote it.
        value: what the user gave, already parsed from any unit (Composer's ``'25ba'`` is 25).
        minimum: the smallest value that means something (0 where 0 switches a repetition off).
        accepted: the whole "what is accepted" text, where more forms than an integer are.

    Returns:
        ``value``, an ``int``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: {key} must be {accepted or f'an integer >= {minimum}'}; got {value!r}")
    return value


def check_choice(key: str, value: object, valid: Iterable[str]) -> str:
    """``value`` if it is one of ``valid``, else the one ValueError every unknown name gets:
    ``<key>: unknown value 'x'; valid values: a, b``.

    Args:
        key: the key (or what is named: ``attention backend``) as the user knows it.
        value: what the user gave.
        valid: every accepted value, in the order the error lists them.

    Returns:
        ``value``, a ``str``.

    Example::

        >>> check_choice("attn_path", "rows", ("auto", "flat", "rows"))
        'rows'
    """
    names = tuple(valid)
    if not isinstance(value, str) or value not in names:
        raise ValueError(f"{key}: unknown value {value!r}; valid values: {', '.join(names)}")
    return value


def short(values: list[int], keep: int = 6) -> str:
    """``[0, 5, 16, ...]`` with the count when long.

    Args:
        values: the list to show.
        keep: how many values a long list shows.

    Returns:
        The list as text.

    Example::

        >>> short(list(range(0, 100, 10)))
        '[0, 10, 20, 30, 40, 50, ...] (10)'
    """
    return str(values) if len(values) <= keep else f"[{', '.join(map(str, values[:keep]))}, ...] ({len(values)})"
