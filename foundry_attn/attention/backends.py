"""The backend table: each backend's name, the name its document-aware function is registered under, and what
that function honours per layer; what a model's config asks of it, and the refusal when the two do not meet.

    refusal("sdpa", ModelNeeds.of("Gemma2ForCausalLM", config))   # "sdpa cannot apply ... softcap (50.0) ..."
    backend_of("foundry_sdpa")                                    # "sdpa"

The policy (:mod:`foundry_attn.selection.policy`) reads this table; the functions themselves live in
:mod:`foundry_attn.attention.functions` and refuse, at call time, exactly what the table says they cannot honour.
Core module: torch only (no kernel code, no transformers).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable
from typing import Any

from foundry_attn.attention.config_values import config_value
from foundry_attn.attention.torch_varlen import torch_varlen_kernel, varlen_parameters

PREFIX = "foundry_"
FA2, FLEX, SDPA, EAGER = "flash_attention_2", "flex_attention", "sdpa", "eager"
TORCH_VARLEN = "torch_varlen"  # torch's own varlen flash kernel (>= 2.10, CUDA): FA2's layout without flash-attn
FA2_REFERENCE = "fa2_reference"  # registered as foundry_fa2_reference: FA2 code paths on the CPU reference kernel


@dataclasses.dataclass(frozen=True)
class Backend:
    """What one backend's document-aware function can honour, per layer (causal and grouped KV heads: all), and
    the stock backends that stand in for it: ``truth``, what its proof compares against (each document alone), and
    ``rows``, what runs one document per row where the flat path does not. ``regroups``: its function regroups the
    flat row's documents in every layer (sdpa, eager), so documents of one length run as even rows instead.
    ``static``: its kernel reads the documents' bounds on the device (varlen), so a flat row padded to a capacity
    runs in a few fixed shapes with no host sync (:mod:`foundry_attn.flat.capacity`)."""

    name: str
    softcap: bool
    dropout: bool
    truth: str
    rows: str
    window: bool = True
    regroups: bool = False
    static: bool = False


#: every backend, in the order the fallback chain prefers them (the one list of backend names: :data:`NAMES`), and
#: the one table of stock stand-ins: torch_varlen is proven against sdpa (its window convention) and runs sdpa's rows;
#: flex is proven against eager (the exact math: stock flex cannot run everywhere) and runs stock flex's rows
BACKENDS: dict[str, Backend] = {
    FA2: Backend(FA2, softcap=True, dropout=True, truth=FA2, rows=FA2, static=True),
    # torch.nn.attention.varlen.varlen_attn: causal only, no softcap, no dropout; windows from torch 2.11
    TORCH_VARLEN: Backend(
        TORCH_VARLEN,
        softcap=False,
        dropout=False,
        truth=SDPA,
        rows=SDPA,
        window="window_size" in varlen_parameters(torch_varlen_kernel()),
        static=True,
    ),
    # softcap as a flex score_mod gives nan gradients under non-reentrant checkpoint recompute (eager flex,
    # torch 2.7): refused until it is proven exact
    FLEX: Backend(FLEX, softcap=False, dropout=False, truth=EAGER, rows=FLEX),
    SDPA: Backend(SDPA, softcap=False, dropout=True, truth=SDPA, rows=SDPA, regroups=True),
    EAGER: Backend(EAGER, softcap=True, dropout=True, truth=EAGER, rows=EAGER, regroups=True),
}
NAMES: tuple[str, ...] = tuple(BACKENDS)
#: registered name -> backend (or fa2_reference): every name :func:`foundry_attn.attention.functions.register` registers
REGISTERED = {PREFIX + name: name for name in (*BACKENDS, FA2_REFERENCE)}


def backend_of(impl: str | None) -> str | None:
    """``foundry_sdpa`` -> ``sdpa``; ``foundry_fa2_reference`` -> ``flash_attention_2``; stock names unchanged.

    Args:
        impl: an attention implementation name (``config._attn_implementation``), or None.

    Returns:
        The backend it runs, ``impl`` itself for a name we did not register.

    Example::

        >>> backend_of("foundry_sdpa"), backend_of("foundry_fa2_reference"), backend_of("eager")
        ('sdpa', 'flash_attention_2', 'eager')
    """
    name = REGISTERED.get(impl or "", impl)
    return FA2 if name == FA2_REFERENCE else name


def rows_name(backend: str, built: str, reference: bool = False, cpu: bool = False) -> str:
    """The stock implementation that runs ``backend``'s documents one per row: the one the model was built with
    where it is ``backend``'s own (a user's registered stock function stays), else the table's ``rows``; FA2 on the
    reference kernel runs ``foundry_fa2_reference`` (its stock branch), flex on a CPU runs eager (stock flex
    compiles, and does not train there).

    Args:
        backend: ours (``sdpa``, ``flash_attention_2``, ...).
        built: ``config._attn_implementation`` before attach.
        reference: FA2 runs on the pure-PyTorch reference kernel.
        cpu: the weights are on a CPU.

    Returns:
        The name ``config._attn_implementation`` holds while the run is on rows.

    Example::

        >>> rows_name("torch_varlen", "sdpa"), rows_name("flex_attention", "eager", cpu=True)
        ('sdpa', 'eager')
    """
    if backend == FA2 and reference and built != FA2:
        return PREFIX + FA2_REFERENCE
    if backend == FLEX and cpu:
        return EAGER
    return built if backend_of(built) == backend and built not in REGISTERED else BACKENDS[backend].rows


def load_name(chosen: str, fa2_reference: bool = False, model_class: type | None = None) -> str:
    """The implementation transformers builds the model with for ``chosen``: its rows stand-in (torch_varlen loads
    as sdpa; FA2 on the reference kernel too), eager where ``model_class`` has no sdpa (GPT-J in 4.51); attach
    points ours after.

    Args:
        chosen: the backend the decision chose.
        fa2_reference: FA2 runs on the reference kernel (transformers cannot load that name).
        model_class: the class that will be built (None: assume it has sdpa).

    Returns:
        A name ``from_pretrained(attn_implementation=...)`` accepts.

    Example::

        >>> from transformers import GPTJForCausalLM   # a class without sdpa (_supports_sdpa unset)
        >>> load_name("torch_varlen"), load_name("flash_attention_2", fa2_reference=True, model_class=GPTJForCausalLM)
        ('sdpa', 'eager')
    """
    name = SDPA if chosen == FA2 and fa2_reference else BACKENDS[chosen].rows
    if name == SDPA and model_class is not None and not getattr(model_class, "_supports_sdpa", False):
        return EAGER
    return name


def config_refusals(config: Any, names: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """The names the config itself refuses, with its words: a 5.x config may validate the name it is set to
    (HRM-text with ``prefix_lm`` refuses flash attention), as stock does at load. Asked of one copy; torch_varlen
    as flash.

    Args:
        config: the model config (not changed: a deep copy is set).
        names: the backends to try (torch_varlen is tried as ``flash_attention_2``).

    Returns:
        ``(name, first line of the config's error)`` for each name it refuses; empty when it takes them all.

    Example::

        >>> from transformers import LlamaConfig
        >>> config_refusals(LlamaConfig(), ["flash_attention_2", "sdpa"])
        ()
    """
    probe, refused = copy.deepcopy(config), []
    for name in names:
        try:
            probe._attn_implementation = FA2 if name == TORCH_VARLEN else name
        except ValueError as exc:
            refused.append((name, str(exc).splitlines()[0]))
    return tuple(refused)


@dataclasses.dataclass(frozen=True)
class ModelNeeds:
    """What a model's attention asks of a kernel beyond causal/window/GQA, read from its config."""

    class_name: str = "?"
    softcap: float | None = None
    dropout: float = 0.0
    window: int | None = None
    alibi: bool = False  # an ALiBi position bias switched on in the config (Falcon's ``alibi``)

    @classmethod
    def of(cls, class_name: str, config: Any) -> ModelNeeds:
        """What ``config`` asks of attention: softcap, dropout, the shortest sliding window, ALiBi.

        Args:
            class_name: the model class's name, for refusal messages.
            config: the model config.

        Returns:
            The needs, read from the config.

        Example::

            >>> from transformers import Gemma2Config
            >>> ModelNeeds.of("Gemma2ForCausalLM", Gemma2Config())
            ModelNeeds(class_name='Gemma2ForCausalLM', softcap=50.0, dropout=0.0, window=4096, alibi=False)
        """
        dropout = max(float(config_value(config, n, 0.0) or 0.0) for n in ("attention_dropout", "attn_pdrop"))
        windowed = config_value(config, "use_sliding_window", True)
        window = config_value(config, "sliding_window", None, min) if windowed else None
        softcap = config_value(config, "attn_logit_softcapping") or None
        return cls(class_name, softcap, dropout, window or None, config_value(config, "alibi", False) is True)


def refusal(backend: str, needs: ModelNeeds, fa2_version: str | None = None) -> str | None:
    """Why ``backend`` cannot run this model's documents exactly, or None when it can.

    Args:
        backend: a backend name (``sdpa``, ``flash_attention_2``, ...).
        needs: what the model asks (:meth:`ModelNeeds.of`).
        fa2_version: the installed flash-attn version, for FA2's softcap minimum (None: not checked).

    Returns:
        The refusal, naming what the backend cannot apply, or None.

    Example::

        >>> from transformers import Gemma2Config
        >>> refusal("sdpa", ModelNeeds.of("Gemma2ForCausalLM", Gemma2Config()))
        "sdpa cannot apply Gemma2ForCausalLM's attention logit softcap (50.0) per document"
        >>> refusal("eager", ModelNeeds.of("Gemma2ForCausalLM", Gemma2Config())) is None
        True
    """
    caps = BACKENDS[backend]
    if needs.alibi and backend in (FA2, TORCH_VARLEN):  # varlen kernels take no bias; stock's FA2 class raises
        return f"{backend} cannot apply {needs.class_name}'s ALiBi position bias (alibi: true); use sdpa or eager"
    if needs.softcap and not caps.softcap:
        return f"{backend} cannot apply {needs.class_name}'s attention logit softcap ({needs.softcap}) per document"
    if needs.window and not caps.window:
        return f"{backend} cannot apply {needs.class_name}'s sliding window ({needs.window}) with this torch"
    if needs.dropout and not caps.dropout:
        return f"{backend} cannot apply attention dropout ({needs.dropout}); set attention_dropout: 0 or use sdpa"
    if backend == FA2 and needs.softcap and fa2_version is not None:
        from packaging.version import Version

        if Version(fa2_version) < Version("2.6.0"):
            return f"flash-attn {fa2_version} has no softcap (needs >= 2.6.0) for {needs.class_name}"
    return None
