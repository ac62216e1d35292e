"""The user's options, declared once: each one's name, default, valid values, one line of doc, and its key on each
surface (``attach``'s keywords, LLM-Foundry's YAML, axolotl's YAML).

    OPTIONS["execution"].default                 # 'auto'
    OPTIONS["execution"].choices                 # ('auto', 'eager', 'compiled', 'graphed')
    OPTIONS["strict"].keys["axolotl"]            # 'foundry_attn_strict'

``attach`` (:mod:`foundry_attn.path.attach`), ``AttnKeys`` (:mod:`foundry_attn.integrations.llm_foundry.keys`) and
``FoundryAttnArgs`` (:mod:`foundry_attn.integrations.axolotl.args`) take their defaults from here, the "Fix:" of
every message its keys (:mod:`foundry_attn.selection.surfaces`); ``tests/selection/test_options.py`` checks that the
three surfaces list these options, defaults and valid values. A new option is one :class:`Option` line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from foundry_attn.attention.backends import EAGER, FA2, NAMES, SDPA, TORCH_VARLEN

AUTO = "auto"  # the backend's auto: the fastest of the fallback chain whose checks pass here
AUTO_PATH = "auto"  # flat where proven, else rows
#: the paths (flat/layout_cost.py's FLAT and ROWS, which a test checks: selection/ stays below flat/)
PATHS: tuple[str, ...] = (AUTO_PATH, "flat", "rows")
AUTO_STEP, EAGER_STEP, COMPILED, GRAPHED = "auto", "eager", "compiled", "graphed"
EXECUTIONS: tuple[str, ...] = (AUTO_STEP, EAGER_STEP, COMPILED, GRAPHED)
DEFAULT_FALLBACK: tuple[str, ...] = (FA2, TORCH_VARLEN, SDPA, EAGER)
PROOF_INTERVAL = 100  # training batches between proofs of the flat path
SURFACES = ("attach", "llm_foundry", "axolotl")


@dataclasses.dataclass(frozen=True)
class Option:
    """One option: its ``attach`` keyword, default, valid values (None: any of its type), doc, and its key on each
    surface (``absent``: why a surface has none)."""

    name: str
    default: Any
    doc: str
    keys: Mapping[str, str]
    choices: tuple[str, ...] | None = None
    absent: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: ``surface -> (default, why)`` where a surface's default is its own
    differs: Mapping[str, tuple[Any, str]] = dataclasses.field(default_factory=dict)

    def default_on(self, surface: str) -> Any:
        """The option's default on ``surface``.

        Args:
            surface: one of :data:`SURFACES`.

        Returns:
            The default there.

        Example::

            >>> OPTIONS["backend"].default_on("attach"), OPTIONS["backend"].default_on("llm_foundry")
            (None, 'auto')
        """
        return self.differs[surface][0] if surface in self.differs else self.default


def _keys(attach: str, llm_foundry: str | None, axolotl: str | None) -> dict[str, str]:
    given = {"attach": attach, "llm_foundry": llm_foundry, "axolotl": axolotl}
    return {surface: key for surface, key in given.items() if key is not None}


_CPU_ONLY = "the reference kernel runs FA2's code paths on a CPU in tests, never in a user's run"
_AXOLOTL_LOADS = "axolotl loads real weights before the plugin attaches: the proof always runs at attach"
_AXOLOTL_AUTOCAST = "axolotl's bf16/fp16 keys set the dtype attention computes in"
_AXOLOTL_STRICT = "foundry_attn_strict: true asks for the flat path (strict), false for flat where proven (auto)"
_AXOLOTL_CHAIN = "the chain is attach's, cut to the backends that run here (refusals.runs_here)"

#: every option, in ``attach``'s order
OPTIONS: Mapping[str, Option] = {
    o.name: o
    for o in (
        Option(
            "backend",
            AUTO,
            "auto (the fastest backend of the chain that runs here) or one backend",
            _keys("backend", "attn_implementation", "foundry_attn_backend"),
            (AUTO, *NAMES),
            differs={
                "attach": (None, "None: the backend the model runs now"),
                "axolotl": (None, "None: axolotl's own attn_implementation"),
            },
        ),
        Option(
            "path",
            AUTO_PATH,
            "flat where proven (auto), flat or fail (flat), or rows",
            _keys("path", "attn_path", None),
            PATHS,
            {"axolotl": _AXOLOTL_STRICT},
        ),
        Option(
            "fallback",
            DEFAULT_FALLBACK,
            "the chain auto walks, fastest first",
            _keys("fallback", "attn_fallback", None),
            absent={"axolotl": _AXOLOTL_CHAIN},
        ),
        Option(
            "compute_dtype",
            "auto",
            "the dtype attention computes in, for auto's checks",
            _keys("compute_dtype", "attn_compute_dtype", None),
            ("auto", "bf16", "fp16", "fp32"),
            {"axolotl": _AXOLOTL_AUTOCAST},
        ),
        Option(
            "fa2_reference",
            False,
            "FA2's code paths on the pure-PyTorch reference kernel (CPU tests)",
            _keys("fa2_reference", "fa2_reference_kernel", None),
            absent={"axolotl": _CPU_ONLY},
        ),
        Option("strict", False, "fail instead of falling back", _keys("strict", "attn_strict", "foundry_attn_strict")),
        Option(
            "interval",
            PROOF_INTERVAL,
            "re-prove the flat path every N training batches (0: first and changes)",
            _keys("interval", "attn_proof_interval", "foundry_attn_proof_interval"),
        ),
        Option(
            "prove_now",
            True,
            "prove at attach (False: on the first training batch)",
            _keys("prove_now", "attn_prove_at_build", None),
            absent={"axolotl": _AXOLOTL_LOADS},
        ),
        Option(
            "capacity",
            0,
            "pad each flat row to a few fixed shapes up to N tokens (0: its own length)",
            _keys("capacity", "attn_capacity", "foundry_attn_capacity"),
        ),
        Option(
            "execution",
            AUTO_STEP,
            "how the flat step runs: auto, eager, compiled or graphed",
            _keys("execution", "attn_execution", "foundry_attn_execution"),
            EXECUTIONS,
        ),
    )
}


def keys_of(surface: str) -> dict[str, str]:
    """Each option's key on ``surface``.

    Args:
        surface: one of :data:`SURFACES`.

    Returns:
        ``{option: key}`` for the options the surface has.

    Example::

        >>> keys_of("llm_foundry")["capacity"]
        'attn_capacity'
    """
    return {name: o.keys[surface] for name, o in OPTIONS.items() if surface in o.keys}
