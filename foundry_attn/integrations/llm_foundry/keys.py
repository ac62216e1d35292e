"""The attention keys of ``foundry_attn_causal_lm`` (``attn_implementation``, ``attn_fallback``, ...), checked once
at build, each error naming the valid values; in a YAML: :class:`~.model.FoundryAttnCausalLM`."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping, Sequence

from foundry_attn.attention.backends import FA2
from foundry_attn.checks import check_choice, check_interval
from foundry_attn.path.execution import AUTO_STEP, check_execution
from foundry_attn.path.schedule import PROOF_INTERVAL
from foundry_attn.path.state import AUTO_PATH, check_path
from foundry_attn.selection.decision import COMPUTE_DTYPES
from foundry_attn.selection.policy import AUTO, DEFAULT_FALLBACK, validate_names

RANK_OVERRIDABLE = ("attn_implementation", "attn_fallback", "attn_strict", "attn_compute_dtype")
OWNER = "foundry_attn_causal_lm"


def rank_override(overrides: Mapping | None, rank: int) -> dict:
    """This rank's entry of ``attn_rank_overrides``, checked against :data:`RANK_OVERRIDABLE` (else a ValueError).

    Args:
        overrides: the model's ``attn_rank_overrides`` (rank keys as ints or strings), or None.
        rank: this process's global rank.

    Returns:
        The entry's keys; empty where the rank has none.

    Example::

        >>> rank_override({1: {"attn_implementation": "sdpa"}}, 1)
        {'attn_implementation': 'sdpa'}
    """
    entry = (overrides or {}).get(rank, (overrides or {}).get(str(rank))) or {}
    unknown = sorted(set(entry) - set(RANK_OVERRIDABLE))
    if unknown:
        raise ValueError(
            f"attn_rank_overrides[{rank}]: unknown key(s) {', '.join(unknown)}; valid keys: "
            f"{', '.join(RANK_OVERRIDABLE)}"
        )
    return dict(entry)


@dataclasses.dataclass(frozen=True)
class AttnKeys:
    """This rank's attention keys, validated, with its ``attn_rank_overrides`` entry applied."""

    requested: str = AUTO
    fallback: tuple[str, ...] = DEFAULT_FALLBACK
    strict: bool = False
    compute_dtype: str = "auto"
    path: str = AUTO_PATH
    proof_interval: int = PROOF_INTERVAL
    prove_at_build: bool = True
    fa2_reference: bool = False
    capacity: int = 0
    execution: str = AUTO_STEP

    @classmethod
    def parse(
        cls,
        rank: int,
        attn_implementation: str | None = AUTO,
        attn_fallback: Sequence[str] = DEFAULT_FALLBACK,
        attn_strict: bool = False,
        attn_compute_dtype: str = "auto",
        attn_path: str = AUTO_PATH,
        attn_proof_interval: int = PROOF_INTERVAL,
        attn_prove_at_build: bool = True,
        attn_capacity: int = 0,
        attn_execution: str = AUTO_STEP,
        fa2_reference_kernel: bool = False,
        attn_rank_overrides: Mapping | None = None,
        use_flash_attention_2: bool = False,
    ) -> AttnKeys:
        """The keys as the model got them, validated (a ValueError names the valid values); :data:`KEYS` names them.

        Args:
            rank: this process's global rank (picks its ``attn_rank_overrides`` entry).
            attn_implementation: ``auto`` or a backend name (None: ``auto``).
            attn_fallback: the chain ``auto`` walks, fastest first.
            attn_strict: fail instead of falling back.
            attn_compute_dtype: ``auto``, ``bf16``, ``fp16`` or ``fp32``.
            attn_path: ``auto``, ``flat`` or ``rows``.
            attn_proof_interval: re-prove every N training batches (0: first batch and changes only).
            attn_prove_at_build: prove at build (False: on the first training batch).
            attn_capacity: pad each flat row to a few fixed shapes up to this many tokens (0: off).
            attn_execution: ``auto``, ``eager``, ``compiled`` or ``graphed`` (:mod:`foundry_attn.path.execution`).
            fa2_reference_kernel: run FA2 on the pure-PyTorch reference kernel.
            attn_rank_overrides: per rank, the keys it sets otherwise (:func:`rank_override`).
            use_flash_attention_2: LLM-Foundry's old key; under ``auto``, asks for ``flash_attention_2``.

        Returns:
            The validated keys.

        Example::

            >>> AttnKeys.parse(1, attn_rank_overrides={1: {"attn_implementation": "sdpa"}}).requested
            'sdpa'
        """
        override = rank_override(attn_rank_overrides, rank)
        requested = override.get("attn_implementation", attn_implementation) or AUTO
        if use_flash_attention_2 and requested == AUTO:
            requested = FA2
        requested, fallback = validate_names(requested, list(override.get("attn_fallback", attn_fallback)))
        return cls(
            requested,
            tuple(fallback),
            bool(override.get("attn_strict", attn_strict)),
            check_choice(
                "attn_compute_dtype", str(override.get("attn_compute_dtype", attn_compute_dtype)), COMPUTE_DTYPES
            ),
            check_path(attn_path),
            check_interval(OWNER, "attn_proof_interval", attn_proof_interval, minimum=0),
            bool(attn_prove_at_build),
            bool(fa2_reference_kernel),
            check_interval(OWNER, "attn_capacity", attn_capacity, minimum=0),
            check_execution(attn_execution),
        )


#: the model keys :meth:`AttnKeys.parse` takes (every other key of the model goes on to ``hf_causal_lm``)
KEYS: tuple[str, ...] = tuple(inspect.signature(AttnKeys.parse).parameters)[1:]
