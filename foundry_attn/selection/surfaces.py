"""Where a user sets foundry_attn's options, and the key each option has there: every "Fix:" names the user's own key.

    with speaking(AXOLOTL):                 # the axolotl plugin, around attach
        attach(model, "flash_attention_2", path="flat", strict=True)
    AXOLOTL.fix("strict", False)            # 'set foundry_attn_strict: false'
    LLM_FOUNDRY.fix("path", "auto")         # 'set attn_path: auto'
    ATTACH.fix("backend", "auto")           # 'call attach(model, "auto")'

Three surfaces: ``attach``'s keywords in Python (the default), LLM-Foundry's YAML keys and axolotl's, each option's
key read from its one declaration (:mod:`foundry_attn.selection.options`). A message builder reads :func:`spoken` (or
the surface its :class:`~foundry_attn.path.state.PathState` kept at attach).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from foundry_attn.selection.options import keys_of


def _python(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(_python, value)) + "]"
    return repr(value)


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(_yaml, value)) + "]"
    return str(value)


@dataclasses.dataclass(frozen=True, eq=False)  # one of three, by identity
class Surface:
    """One place options are set: its name, each option's key (None: the surface has none), and how a value is
    written (Python keywords of ``attach`` or YAML)."""

    name: str
    keys: Mapping[str, str | None]
    python: bool = False
    #: ``(option, value) -> (option, value)`` where the surface spells a setting through another key
    aliases: Mapping[tuple[str, Any], tuple[str, Any]] = dataclasses.field(default_factory=dict)
    #: ``option -> the whole fix`` where a value is not what the user changes (``half``)
    fixed: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def key(self, option: str) -> str | None:
        """The key ``option`` has here.

        Args:
            option: one of :data:`~foundry_attn.selection.options.OPTIONS` (or ``half``).

        Returns:
            The key, or None where this surface has none.

        Example::

            >>> AXOLOTL.key("strict"), LLM_FOUNDRY.key("backend")
            ('foundry_attn_strict', 'attn_implementation')
        """
        return self.keys.get(option)

    def setting(self, option: str, value: Any) -> str:
        """``option`` set to ``value`` as the user writes it here.

        Args:
            option: one of :data:`~foundry_attn.selection.options.OPTIONS` (or ``half``).
            value: its value.

        Returns:
            The setting (``attn_path: flat``, ``foundry_attn_strict: true``, ``path="flat"``).

        Example::

            >>> AXOLOTL.setting("path", "flat"), ATTACH.setting("path", "flat")
            ('foundry_attn_strict: true', 'path="flat"')
        """
        option, value = self.aliases.get((option, value), (option, value))
        key = self.keys.get(option) or option
        if self.python:
            return f"{key}={_python(value)}" if option != "backend" else f"attach(model, {_python(value)})"
        return f"{key}: {_yaml(value)}"

    def fix(self, option: str, value: Any = None) -> str:
        """What to do: set ``option`` to ``value`` here, in words.

        Args:
            option: one of :data:`~foundry_attn.selection.options.OPTIONS` (or ``half``).
            value: its value (unused for an option in ``fixed``).

        Returns:
            The fix (``set attn_strict: false``, ``call attach(model, "auto")``, ``pass strict=False to attach``).

        Example::

            >>> AXOLOTL.fix("strict", False), ATTACH.fix("backend", "auto"), LLM_FOUNDRY.fix("half")
            ('set foundry_attn_strict: false', 'call attach(model, "auto")', 'set precision: amp_bf16')
        """
        if option in self.fixed:
            return self.fixed[option]
        text = self.setting(option, value)
        if not self.python:
            return f"set {text}"
        return f"call {text}" if text.startswith("attach(") else f"pass {text} to attach"

    def fix_choice(self, option: str, values: list[str]) -> str:
        """What to do: set ``option`` to one of ``values`` here, in words.

        Args:
            option: one of :data:`~foundry_attn.selection.options.OPTIONS` (or ``half``).
            values: the values that work.

        Returns:
            The fix.

        Example::

            >>> AXOLOTL.fix_choice("backend", ["sdpa", "eager"])
            'set foundry_attn_backend to one of sdpa, eager'
        """
        if len(values) == 1:
            return self.fix(option, values[0])
        if self.python and option == "backend":
            return f"call attach(model, backend) with one of {', '.join(map(_python, values))}"
        return f"{'pass' if self.python else 'set'} {self.key(option) or option} to one of {', '.join(values)}"


ATTACH = Surface(
    "attach",
    {**keys_of("attach"), "backend": "attach"},  # attach's second argument: its messages open "attach: sdpa ..."
    python=True,
    fixed={"half": "load the model in bf16 (or train under bf16 autocast)"},
)
LLM_FOUNDRY = Surface(
    "LLM-Foundry YAML",
    keys_of("llm_foundry"),
    fixed={"half": "set precision: amp_bf16"},
)
AXOLOTL = Surface(
    "axolotl YAML",
    keys_of("axolotl"),
    aliases={("path", "flat"): ("strict", True), ("path", "auto"): ("strict", False)},
    fixed={"half": "set bf16: true"},
)
_SPOKEN: contextvars.ContextVar[Surface] = contextvars.ContextVar("foundry_attn_surface", default=ATTACH)


def spoken() -> Surface:
    """The surface the current call came from (:func:`speaking`); ``attach``'s keywords by default.

    Returns:
        The :class:`Surface`.

    Example::

        >>> spoken().name
        'attach'
    """
    return _SPOKEN.get()


@contextlib.contextmanager
def speaking(surface: Surface) -> Iterator[Surface]:
    """Every message built inside the block names ``surface``'s keys (an integration, around its calls).

    Args:
        surface: :data:`ATTACH`, :data:`LLM_FOUNDRY` or :data:`AXOLOTL`.

    Returns:
        A context manager whose value is ``surface``.

    Example::

        >>> with speaking(LLM_FOUNDRY):
        ...     spoken().key("path")
        'attn_path'
    """
    token = _SPOKEN.set(surface)
    try:
        yield surface
    finally:
        _SPOKEN.reset(token)
