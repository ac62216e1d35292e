"""Renamed keys keep working: the old name is read, with a warning that names the new one.

    attn_prove_at_build = renamed_key("foundry_attn_causal_lm", "attn_isolation_check", "attn_prove_at_build",
                                      kwargs.pop("attn_isolation_check", None), attn_prove_at_build, True)

Core module: standard library only.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

log = logging.getLogger(__name__)


def renamed_key(owner: str, old: str, new: str, old_value: Any, new_value: Any, default: Any) -> Any:
    """The value of key ``new``: ``old_value`` when the user wrote the old name (a FutureWarning, and the log says
    it too), else ``new_value``. Both written: a ValueError, as nothing says which one was meant."""
    if old_value is None:
        return new_value
    if new_value != default:
        raise ValueError(f"{owner}: {old} was renamed {new}, and both are set; keep {new} only")
    message = f"{owner}: {old} is renamed {new}; {old} still works for now, write {new}: {old_value!r}"
    warnings.warn(message, FutureWarning, stacklevel=3)
    log.warning(message)
    return old_value
