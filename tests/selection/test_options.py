"""The user's options are declared once (:mod:`foundry_attn.selection.options`): ``attach``'s keywords, LLM-Foundry's
``attn_*`` keys and axolotl's ``foundry_attn_*`` keys list the same options, defaults and valid values, each
surface's "Fix:" names its own key, and a key a surface adds is one the declaration knows of."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from foundry_attn.integrations.llm_foundry.keys import KEYS, AttnKeys
from foundry_attn.path.attach import attach
from foundry_attn.selection.decision import COMPUTE_DTYPES
from foundry_attn.selection.options import OPTIONS, SURFACES, Option, keys_of
from foundry_attn.selection.surfaces import ATTACH, AXOLOTL, LLM_FOUNDRY

#: keys a surface has beyond the options: LLM-Foundry's per-rank overrides and its old FA2 switch; the callbacks'
#: settings on axolotl (the Trainer's ``install`` takes them as keywords)
EXTRA = {
    "llm_foundry": {"attn_rank_overrides", "use_flash_attention_2"},
    "axolotl": {"foundry_attn_events_dir", "foundry_attn_log_interval", "foundry_attn_verdict_interval"},
}


def _defaults(surface: str) -> dict[str, Any]:
    """What each key of ``surface`` defaults to, read from the surface's own code."""
    if surface == "attach":
        params = inspect.signature(attach).parameters
        return {name: p.default for name, p in params.items() if name != "model"}
    if surface == "llm_foundry":
        params = inspect.signature(AttnKeys.parse).parameters
        return {name: params[name].default for name in KEYS}
    args = pytest.importorskip("foundry_attn.integrations.axolotl.args")
    return {name: field.default for name, field in args.FoundryAttnArgs.model_fields.items()}


@pytest.mark.parametrize("surface", SURFACES)
def test_each_surface_lists_the_declared_options_with_their_defaults(surface: str) -> None:
    defaults = _defaults(surface)
    keys = keys_of(surface)
    for name, option in OPTIONS.items():
        if name not in keys:
            assert option.absent.get(surface), f"{name}: no key on {surface} and no reason why"
            continue
        assert keys[name] in defaults, f"{name}: {surface} has no key {keys[name]}"
        got, want = defaults[keys[name]], option.default_on(surface)
        assert tuple(got) == tuple(want) if isinstance(want, tuple) else got == want, (surface, name, got, want)
    # nothing else: a key a surface adds is an option, or one of its own listed here
    assert set(defaults) - set(keys.values()) == EXTRA.get(surface, set())


def test_attach_takes_every_option() -> None:
    assert set(keys_of("attach")) == set(OPTIONS)


def _refused(option: Option, surface: str, value: Any) -> bool:
    """Whether ``surface`` refuses ``value`` for ``option`` at its door, naming the valid values."""
    key = option.keys[surface]
    try:
        if surface == "llm_foundry":
            AttnKeys.parse(0, **{key: value})
        else:
            args = pytest.importorskip("foundry_attn.integrations.axolotl.args")
            args.FoundryAttnArgs(**{key: value})
    except ValueError as exc:
        assert all(c in str(exc) for c in option.choices or ()), exc
        return True
    return False


@pytest.mark.parametrize("surface", ["llm_foundry", "axolotl"])
def test_each_surface_takes_the_declared_values_and_refuses_others(surface: str) -> None:
    for option in OPTIONS.values():
        if option.choices is None or surface not in option.keys:
            continue
        for value in option.choices:
            assert not _refused(option, surface, value), (surface, option.name, value)
        assert _refused(option, surface, "no-such-value"), (surface, option.name)


def test_the_owners_checks_take_the_declared_values() -> None:
    from foundry_attn.flat.layout_cost import FLAT, ROWS
    from foundry_attn.path.execution import EXECUTIONS
    from foundry_attn.path.state import AUTO_PATH, PATHS

    assert EXECUTIONS == OPTIONS["execution"].choices and PATHS == OPTIONS["path"].choices == (AUTO_PATH, FLAT, ROWS)
    assert tuple(COMPUTE_DTYPES) == OPTIONS["compute_dtype"].choices


def test_each_fix_names_the_declared_key() -> None:
    for surface, spoken in (("attach", ATTACH), ("llm_foundry", LLM_FOUNDRY), ("axolotl", AXOLOTL)):
        for name in OPTIONS:
            want = "attach" if (surface, name) == ("attach", "backend") else OPTIONS[name].keys.get(surface)
            assert spoken.key(name) == want, (surface, name)  # attach's backend: the call, attach(model, "sdpa")
