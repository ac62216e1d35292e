"""Regional compilation: the model's repeated blocks (its decoder layers) compiled once per kind, so identical layers
share one graph, and a second model of the same shapes in one process reuses it (``torch.compile`` caches on the
class ``forward``'s code; parameters are inputs of the graph, not constants).

    regions = Regions.of(hf_model, backend="inductor", mode=None)   # one compiled forward per layer class
    with regions.active():                                           # the blocks' forward compiled for this call
        out = hf_model(**inputs)
    regions.kinds                                                    # {'LlamaDecoderLayer': 30}

Only the blocks are compiled (as torchtitan compiles one transformer block at a time); the embedding, the final norm,
the head and the loss run eagerly around them. Outside :meth:`Regions.active` the blocks are the model's own: a proof's
forwards and the observers' run eagerly. Each block's input row is marked dynamic along the tokens, so one graph
serves every layout. A block that checkpoints itself (``checkpoint_wrapper``) is compiled with its checkpoint.
Core module: torch only.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from foundry_attn.flat.model_forward import forwards_replaced


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: the children of its longest ``nn.ModuleList`` (its decoder layers).

    Args:
        model: a transformers model (or any ``nn.Module``).

    Returns:
        The blocks, in order (empty where the model has no ``ModuleList``).

    Example::

        >>> [type(b).__name__ for b in repeated_blocks(llama)][:2]
        ['LlamaDecoderLayer', 'LlamaDecoderLayer']
    """
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    return list(max(lists, key=len)) if lists else []


def _mark_tokens(tokens: int, values: Any) -> None:
    """Mark every dimension of ``tokens`` entries dynamic in the tensors of ``values`` (the row's length varies)."""
    for value in values:
        if isinstance(value, (tuple, list)):
            _mark_tokens(tokens, value)
        elif isinstance(value, torch.Tensor):
            for dim, size in enumerate(value.shape):
                if size == tokens:
                    torch._dynamo.maybe_mark_dynamic(value, dim)


class Regions:
    """The model's blocks with one compiled ``forward`` per block class (:func:`repeated_blocks`).

    Args:
        blocks: the blocks to compile.
        compile_forward: compiles a class ``forward`` (``torch.compile`` with the step's backend and mode).
    """

    def __init__(self, blocks: list[torch.nn.Module], compile_forward: Callable[[Callable[..., Any]], Any]) -> None:
        self.blocks = blocks
        self._compiled = {kind: compile_forward(kind.forward) for kind in {type(b) for b in blocks}}

    @classmethod
    def of(cls, model: torch.nn.Module, backend: Any, mode: str | None) -> Regions:
        """The regions of ``model``, compiled with ``backend`` and ``mode`` on first use.

        Args:
            model: the transformers model.
            backend: ``torch.compile``'s backend.
            mode: ``torch.compile``'s mode (``"reduce-overhead"``: CUDA graphs).

        Returns:
            The :class:`Regions`.

        Example::

            >>> Regions.of(llama, "inductor", None).kinds
            {'LlamaDecoderLayer': 2}
        """
        return cls(repeated_blocks(model), functools.partial(_compiled_forward, backend=backend, mode=mode))

    @property
    def kinds(self) -> dict[str, int]:
        """Blocks per class: one compiled graph each.

        Returns:
            ``{class name: blocks}``.

        Example::

            >>> regions.kinds
            {'LlamaDecoderLayer': 30}
        """
        counts: dict[str, int] = {}
        for block in self.blocks:
            counts[type(block).__name__] = counts.get(type(block).__name__, 0) + 1
        return counts

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The blocks run their compiled ``forward`` inside; their own again after, even when the forward raises.

        Returns:
            The context.

        Example::

            >>> with regions.active():
            ...     out = model(**inputs)
        """
        # a layer's own ints (its layer_idx) as inputs, not constants: one graph for layers that differ only there
        with (
            forwards_replaced(
                self.blocks, lambda block: functools.partial(_marked, self._compiled[type(block)], block)
            ),
            torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True),
        ):
            yield


def _compiled_forward(forward: Callable[..., Any], backend: Any, mode: str | None) -> Any:
    """``torch.compile`` of a class ``forward`` (cached on its code: every block of the class, every model)."""
    return torch.compile(forward, backend=backend, mode=mode)


def _marked(compiled: Callable[..., Any], block: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``compiled(block, ...)``, the row's tokens marked dynamic in every tensor argument."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    if isinstance(hidden, torch.Tensor) and hidden.dim() >= 2:
        _mark_tokens(hidden.shape[-2], (*args, *kwargs.values()))
    return compiled(block, *args, **kwargs)
