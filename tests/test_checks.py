"""One interval check, the same wording wherever a key is parsed: the core's, the model's keys, attach."""

from __future__ import annotations

import pytest

from foundry_attn.checks import check_interval
from foundry_attn.integrations.llm_foundry.keys import AttnKeys
from foundry_attn.path.attach import attach
from tests.conftest import make_llama


@pytest.mark.parametrize("bad", [0, -3, 2.5, "10", True, None])
def test_an_interval_is_an_integer_at_least_its_minimum(bad: object) -> None:
    with pytest.raises(ValueError, match=rf"owner: key must be an integer >= 1; got {bad!r}"):
        check_interval("owner", "key", bad)
    assert check_interval("owner", "key", 7) == 7 and check_interval("owner", "key", 0, minimum=0) == 0


@pytest.mark.parametrize("bad", [-1, 1.5, "100", False])
def test_attn_proof_interval_is_checked_where_the_keys_are_parsed(bad: object) -> None:
    with pytest.raises(ValueError, match="foundry_attn_causal_lm: attn_proof_interval must be an integer >= 0"):
        AttnKeys.parse(0, attn_proof_interval=bad)  # type: ignore[arg-type]
    assert AttnKeys.parse(0, attn_proof_interval=0).proof_interval == 0


@pytest.mark.parametrize("bad", [-1, 1.5, "4096", False])
def test_attn_capacity_is_checked_where_the_keys_are_parsed(bad: object) -> None:
    with pytest.raises(ValueError, match="foundry_attn_causal_lm: attn_capacity must be an integer >= 0"):
        AttnKeys.parse(0, attn_capacity=bad)  # type: ignore[arg-type]
    assert AttnKeys.parse(0, attn_capacity=4096).capacity == 4096 and AttnKeys.parse(0).capacity == 0


def test_attach_checks_its_interval_before_it_points_anything() -> None:
    model = make_llama("sdpa")
    with pytest.raises(ValueError, match="attach: interval must be an integer >= 0; got -5"):
        attach(model, "sdpa", interval=-5)
    assert model.config._attn_implementation == "sdpa" and not hasattr(model, "foundry_path")
