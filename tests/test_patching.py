"""The patch layers under the tracer and the reference kernel: wrappers over replacements, exact restore."""

from __future__ import annotations

import types

import pytest

from foundry_attn.patching import patch_attribute


def test_patch_layers_restore_exactly_and_reject_bad_use() -> None:
    mod = types.ModuleType("m")
    mod.f = lambda: "orig"
    f = mod.f
    wrap = patch_attribute(mod, "f", wrap=lambda inner: lambda: "w(" + inner() + ")")
    rep = patch_attribute(mod, "f", replace=lambda: "ref")
    assert mod.f() == "w(ref)"  # a replacement always lies beneath a wrapper
    absent = patch_attribute(mod, "g", wrap=lambda inner: inner)
    assert not hasattr(mod, "g")  # a wrapper over nothing stays dormant
    wrap.remove()
    assert mod.f() == "ref"
    rep.remove()
    rep.remove()  # idempotent
    absent.remove()
    assert mod.f is f and not hasattr(mod, "g")
    with pytest.raises(ValueError, match="exactly one"):
        patch_attribute(mod, "f")
