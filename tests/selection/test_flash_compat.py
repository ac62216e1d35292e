"""flash-attn's API across releases and the preflight, with installed versions faked at the
``importlib.metadata`` level (nothing is installed)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import sys
import types
from typing import Any

import pytest
import torch

from foundry_attn.attention.backends import FA2, SDPA
from foundry_attn.selection import flash_compat
from foundry_attn.selection.capability import Capability
from foundry_attn.selection.policy import AttentionUnavailableError, choose
from foundry_attn.selection.traits import ModelTraits

A100 = Capability(
    cuda=True,
    device_name="NVIDIA A100-SXM4-80GB",
    compute_capability=(8, 0),
    torch_version="2.7.0+cu126",
    transformers_version="4.51.3",
    flash_attn_version="2.6.3",
    flash_attn_error=None,
    transformer_engine_version=None,
    host="node-1",
)


def installed(monkeypatch: pytest.MonkeyPatch, **versions: str) -> None:
    """Pretend these distributions are installed (``flash_attn`` -> ``flash-attn``); everything else is real."""
    real = importlib.metadata.version
    fake = {k.replace("_", "-"): v for k, v in versions.items()}

    def version(name: str) -> str:
        if name.replace("_", "-") in fake:
            return fake[name.replace("_", "-")]
        if name.replace("_", "-") in ("flash-attn", "transformer-engine", "flash-attn-3"):
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)


def test_keywords_fit_the_release() -> None:
    assert flash_compat.keywords("2.5.9", causal=True, softcap=0.0) == {"causal": True}  # default dropped
    assert flash_compat.keywords("2.6.0", softcap=30.0) == {"softcap": 30.0}
    with pytest.raises(flash_compat.FlashAttnFeatureError, match=r"no softcap= \(added in 2.6.0\).*flash-attn>=2.6.0"):
        flash_compat.keywords("2.5.9", softcap=30.0)
    with pytest.raises(flash_compat.FlashAttnFeatureError, match="deterministic"):
        flash_compat.keywords("2.4.0", deterministic=True)


def test_call_is_keywords_only(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, dict[str, Any]]] = []
    fake = types.ModuleType("flash_attn")
    fake.__version__ = "2.5.8"  # type: ignore[attr-defined]
    fake.flash_attn_func = lambda *a, **kw: seen.append((len(a), kw)) or a[0]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    q = torch.zeros(1, 2, 1, 8)
    flash_compat.call("flash_attn_func", q, q, q, causal=True, softcap=0.0, window_size=(-1, -1))
    assert seen == [(3, {"causal": True, "window_size": (-1, -1)})]
    with pytest.raises(TypeError, match="by keyword"):
        flash_compat.call("flash_attn_func", q, q, q, 0.0)
    with pytest.raises(ValueError, match="valid values: flash_attn_func, flash_attn_varlen_func"):
        flash_compat.call("flash_attn_with_kvcache", q)


@pytest.mark.parametrize(
    ("te", "fa", "raises", "named"),
    [  # the releases not on PyPI (TE 1.6-1.8, 2.0), and the rows between: test_real_installs.py has the rest
        ("1.6.0", "2.5.8", True, "block_table"),
        ("1.6.0", "2.7.4.post1", True, "Unknown keyword argument 'window_size'"),
        ("1.6.0", "2.4.2", None, ""),
        ("1.8.0", "2.6.3", True, "maximum version 2.5.8"),
        ("1.12.0", "2.6.0.post1", True, "softcap"),
        ("1.12.0", "2.5.6", None, ""),
        ("2.0.0", "2.7.3", None, ""),
        ("2.0.0", "2.7.4", False, "up to 2.7.3"),
        ("2.4.0", "2.7.4.post1", None, ""),
        ("2.8.0", "2.8.3", False, "up to 2.8.1"),
        ("2.19.0", "2.8.4", False, "before 2.8.4"),
    ],
)
def test_transformer_engine_pairs(
    monkeypatch: pytest.MonkeyPatch, te: str, fa: str, raises: bool | None, named: str
) -> None:
    installed(monkeypatch, transformer_engine=te, flash_attn=fa)
    problems = flash_compat.preflight(A100)
    assert (problems == []) == (raises is None), problems
    if raises is not None:
        [problem] = problems
        assert problem.check == "TransformerEngine x flash-attn" and named in problem.reason
        assert (problem.rejects == FA2) == raises and problem.te_attention


def test_strict_fails_before_training_where_te_attention_breaks(monkeypatch: pytest.MonkeyPatch) -> None:
    installed(monkeypatch, transformer_engine="1.13.0", flash_attn="2.6.3")
    te_model = ModelTraits("TEModel", 64, frozenset({FA2, SDPA}), te_attention=True)
    traits_free = choose(FA2, [FA2, SDPA], A100, torch.bfloat16, te_model, smoke_test=None)
    rejected = traits_free.candidates[0]
    assert traits_free.chosen == SDPA and rejected.check == "TransformerEngine x flash-attn"
    assert "softcap" in rejected.reason and "transformer-engine>=2.1" in rejected.fix
    with pytest.raises(
        AttentionUnavailableError,
        match=r"on NVIDIA A100-SXM4-80GB \(sm80\) on node-1: check "
        r"'TransformerEngine x flash-attn' failed.*"
        r"Fix: pip install 'flash-attn==2.5.6'",
    ):
        choose(FA2, [FA2, SDPA], A100, torch.bfloat16, te_model, strict=True, smoke_test=None)
    kept = choose(FA2, [FA2, SDPA], A100, torch.bfloat16, strict=True, smoke_test=None)  # no TE attention: kept
    assert kept.chosen == FA2 and "softcap" in kept.warning and kept.as_dict()["warning"] == kept.warning


def test_transformers_minimum_and_fa3(monkeypatch: pytest.MonkeyPatch) -> None:
    installed(monkeypatch, flash_attn="2.3.0", transformers="5.23.0", flash_attn_3="3.0.0b1")
    checks = {p.check: p for p in flash_compat.preflight(A100)}
    assert "needs flash-attn >= 2.3.3" in checks["flash-attn version"].reason
    assert checks["FA3 on this GPU"].rejects is None and "not Hopper" in checks["FA3 on this GPU"].reason
    assert "FA3 on this GPU" not in {
        p.check for p in flash_compat.preflight(dataclasses.replace(A100, compute_capability=(9, 0)))
    }


def test_doctor_reports_the_preflight(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    import json

    from foundry_attn.cli import main

    installed(monkeypatch, transformer_engine="1.13.0", flash_attn="2.6.3")
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [p["check"] for p in report["preflight"]] == ["TransformerEngine x flash-attn"]
    assert main(["doctor"]) == 0
    assert "preflight: TransformerEngine x flash-attn" in capsys.readouterr().out
