"""The plugin's YAML keys, merged into axolotl's config before it is validated (``BasePlugin.get_input_args``): this
class joins axolotl's pydantic config as a base, so its validator sees the whole config and refuses what cannot work.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationInfo, field_validator, model_validator

from foundry_attn.attention.backends import NAMES
from foundry_attn.checks import check_choice, check_interval
from foundry_attn.integrations.axolotl.refusals import refusal
from foundry_attn.path.execution import AUTO_STEP, EXECUTIONS
from foundry_attn.path.schedule import PROOF_INTERVAL
from foundry_attn.selection.policy import AUTO

#: what ``foundry_attn_backend`` accepts: ``auto`` (the fallback chain) or one backend
BACKEND_CHOICES: tuple[str, ...] = (AUTO, *NAMES)
OWNER = "foundry_attn (axolotl plugin)"


class FoundryAttnArgs(BaseModel):
    """The ``foundry_attn_*`` keys of an axolotl YAML, every one optional (docs/axolotl.md, "The keys").

        foundry_attn_backend: auto          # auto | flash_attention_2 | torch_varlen | flex_attention | sdpa | eager
        foundry_attn_strict: false
        foundry_attn_proof_interval: 100
        foundry_attn_capacity: 0            # N: flat rows padded to a few fixed shapes (flash_attention_2, ...)
        foundry_attn_execution: auto        # auto | eager | compiled | graphed (CUDA graphs: CUDA and a capacity)
        foundry_attn_events_dir: ./out/attn_events
        foundry_attn_log_interval: 50
        foundry_attn_verdict_interval: 100

    Attributes:
        foundry_attn_backend: ``auto`` (the fallback chain, on each rank) or one backend; default: axolotl's
            ``attn_implementation``.
        foundry_attn_strict: a named backend that cannot run, or a flat path not proven, stops the run.
        foundry_attn_proof_interval: re-prove every N training batches (0: the first batch and changes only).
        foundry_attn_capacity: flat rows padded to a few fixed shapes up to N tokens (0: each at its own length).
        foundry_attn_execution: ``auto``, ``eager``, ``compiled`` or ``graphed`` (:mod:`foundry_attn.path.execution`).
        foundry_attn_events_dir: the folder of ``events-rank<r>.jsonl`` (default ``<output_dir>/attn_events``).
        foundry_attn_log_interval: optimizer steps between inspected steps (the first is always inspected).
        foundry_attn_verdict_interval: optimizer steps between verdicts on packed documents.
    """

    foundry_attn_backend: str | None = None
    foundry_attn_strict: bool = False
    foundry_attn_proof_interval: int = PROOF_INTERVAL
    foundry_attn_capacity: int = 0
    foundry_attn_execution: str = AUTO_STEP
    foundry_attn_events_dir: str | None = None
    foundry_attn_log_interval: int = 50
    foundry_attn_verdict_interval: int = 100

    @model_validator(mode="before")
    @classmethod
    def _honoured(cls, data: Any) -> Any:
        """axolotl's whole config, as given: what the plugin cannot honour is refused (:func:`.refusals.refusal`)."""
        why = refusal(data) if isinstance(data, dict) else None
        if why is not None:
            raise ValueError(f"{OWNER}: {why}")
        return data

    @field_validator("foundry_attn_backend")
    @classmethod
    def _backend(cls, value: str | None) -> str | None:
        return None if value is None else check_choice("foundry_attn_backend", value, BACKEND_CHOICES)

    @field_validator("foundry_attn_proof_interval")
    @classmethod
    def _proof_interval(cls, value: int) -> int:
        return check_interval(OWNER, "foundry_attn_proof_interval", value, minimum=0)

    @field_validator("foundry_attn_capacity")
    @classmethod
    def _capacity(cls, value: int) -> int:
        return check_interval(OWNER, "foundry_attn_capacity", value, minimum=0)

    @field_validator("foundry_attn_execution")
    @classmethod
    def _execution(cls, value: str) -> str:
        return check_choice("foundry_attn_execution", value, EXECUTIONS)

    @field_validator("foundry_attn_log_interval", "foundry_attn_verdict_interval")
    @classmethod
    def _interval(cls, value: int, info: ValidationInfo) -> int:
        return check_interval(OWNER, str(info.field_name), value)
