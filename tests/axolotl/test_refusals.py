"""Settings the plugin cannot honour are refused by its own config validation: ``load_cfg``, axolotl's validation of
a YAML, fails with the plugin's reason and a fix in axolotl's keys, before axolotl sets anything up (axolotl's own
validators, or its set-up, used to speak first: ``tensor_parallel_size: 2`` died in its set-up on ``RANK``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("axolotl", reason="needs axolotl (make test-axolotl installs it in .venv-axolotl)")
os.environ.setdefault("AXOLOTL_DO_NOT_TRACK", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

PLUGIN = "foundry_attn.integrations.axolotl.FoundryAttnPlugin"
OWNER = "foundry_attn (axolotl plugin): "


@pytest.fixture(scope="module")
def axolotl_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.axolotl.runs import write_assets

    return write_assets(tmp_path_factory.mktemp("assets"), documents=8)


def load(axolotl_assets: Path, tmp_path: Path, **setting: Any) -> Any:
    """axolotl's ``load_cfg`` on the tests' config with the plugin and ``setting`` (what ``axolotl train`` does
    first)."""
    from axolotl.cli.config import load_cfg
    from axolotl.integrations.base import PluginManager
    from axolotl.utils.dict import DictDefault

    from tests.axolotl.runs import config

    cfg = config(axolotl_assets, tmp_path / "out", "sdpa", True, None)
    cfg["plugins"] = [PLUGIN]
    cfg.update(setting)
    PluginManager.get_instance().plugins.clear()
    try:
        return load_cfg(DictDefault({k: v for k, v in cfg.items() if v is not None}))
    finally:
        PluginManager.get_instance().plugins.clear()


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (
            {"tensor_parallel_size": 2},
            "tensor_parallel_size: 2 shards every layer's weights across ranks, and foundry_attn's proof runs each "
            "document alone on one rank, which sharded weights cannot do. Fix: set tensor_parallel_size: 1, or take "
            "foundry_attn out of plugins:",
        ),
        (
            {"sequence_parallel_degree": 2},
            "sequence_parallel_degree: 2 splits each packed row across ranks (ring attention), and foundry_attn "
            "proves whole rows only. Fix: set sequence_parallel_degree: 1",
        ),
        ({"context_parallel_size": 4}, "context_parallel_size: 4 splits each packed row across ranks"),
        (
            {"s2_attention": True},
            "s2_attention: true: shifted sparse attention mixes token groups across documents. Fix: set "
            "s2_attention: false",
        ),
        (
            {"attn_implementation": "xformers"},
            "attn_implementation: xformers is axolotl's own attention patch or kernel, which foundry_attn cannot "
            "prove or replace. Fix: set attn_implementation: sdpa, eager, flash_attention_2 or flex_attention "
            "(foundry_attn_backend: auto then picks among them)",
        ),
        ({"attn_implementation": None, "sage_attention": True}, "attn_implementation: sage is axolotl's own"),
        ({"attn_implementation": "flash_attention_3"}, "attn_implementation: flash_attention_3 is axolotl's own"),
        (
            {"large_head_attention": "auto"},
            "large_head_attention: auto: routes attention through axolotl's Triton flash kernel, which foundry_attn "
            "cannot prove or replace. Fix: set large_head_attention: sdpa",
        ),
        ({"flash_optimum": True}, "flash_optimum: true: BetterTransformer replaces the attention modules"),
    ],
)
def test_axolotls_validation_refuses_with_the_plugins_reason(
    axolotl_assets: Path, tmp_path: Path, setting: dict, message: str
) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as caught:
        load(axolotl_assets, tmp_path, **setting)
    assert OWNER + message in str(caught.value), str(caught.value)[:2000]


def test_what_the_plugin_honours_is_accepted(axolotl_assets: Path, tmp_path: Path) -> None:
    cfg = load(axolotl_assets, tmp_path, tensor_parallel_size=1, context_parallel_size=1, large_head_attention="sdpa")
    assert cfg.attn_implementation == "sdpa" and cfg.foundry_attn_strict is False


def test_the_keys_alone_validate_without_axolotls_config() -> None:
    """``FoundryAttnArgs`` by itself (no axolotl keys) still validates as before."""
    from foundry_attn.integrations.axolotl.args import FoundryAttnArgs

    assert FoundryAttnArgs(foundry_attn_backend="sdpa").foundry_attn_backend == "sdpa"
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 2 shards"):
        FoundryAttnArgs.model_validate({"tensor_parallel_size": 2})
