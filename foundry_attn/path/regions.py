"""Regional compilation: the model's repeated blocks (its decoder layers) compiled once per kind, so identical layers
share one graph, and a second model of the same shapes in one process reuses it (``torch.compile`` caches on the
class ``forward``'s code; parameters are inputs of the graph, not constants).

    regions = Regions.of(hf_model, backend="inductor", mode=None)   # one compiled forward per layer class
    with regions.active():                                           # the blocks run compiled in this forward
        out = hf_model(**inputs)
    out.loss.backward()                                              # a checkpoint's recompute runs as its forward did
    regions.kinds                                                    # {'LlamaDecoderLayer': 30}

Only the blocks are compiled (as torchtitan compiles one transformer block at a time); the embedding, the final norm,
the head and the loss run eagerly around them. Outside :meth:`Regions.active` the blocks run the model's own code: a
proof's forwards and the observers' run eagerly. A block recomputed in the backward (activation checkpointing, HF's or
``checkpoint_wrapper``'s) runs as its last forward ran, compiled or not, so the recompute saves what the forward saved.
Each block's input row is marked dynamic along the tokens, so one graph serves every layout. Core module: torch only.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from foundry_attn.flat.model_forward import replace_block_forwards


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
    longest: list[torch.nn.Module] = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > len(longest):
            longest = list(module)
    return longest


def _mark_tokens(tokens: int, values: Any) -> None:
    """Mark the token dimension dynamic in the tensors of ``values`` (the row's length varies): the first one of
    ``tokens`` entries after the batch's (a vector's only one), never a second that happens to be as long."""
    for value in values:
        if isinstance(value, (tuple, list)):
            _mark_tokens(tokens, value)
        elif isinstance(value, torch.Tensor) and value.dim():
            dims = range(1, value.dim()) if value.dim() > 1 else range(1)
            dim = next((d for d in dims if value.shape[d] == tokens), None)
            if dim is not None:
                torch._dynamo.maybe_mark_dynamic(value, dim)


class _BlockForward:
    """A block's ``forward`` while its regions are installed: compiled inside :meth:`Regions.active`, the class's own
    outside; in the backward (a checkpoint's recompute), as the block's last forward ran."""

    def __init__(self, regions: Regions, block: torch.nn.Module, compiled: Callable[..., Any]) -> None:
        self.regions, self.block, self.compiled = regions, block, compiled
        self.compiled_last = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch._C._current_graph_task_id() == -1:  # a forward, not a recompute inside the backward
            self.compiled_last = self.regions.on
        if not self.compiled_last:
            return type(self.block).forward(self.block, *args, **kwargs)
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and hidden.dim() >= 2:
            _mark_tokens(hidden.shape[-2], (*args, *kwargs.values()))
        return self.compiled(self.block, *args, **kwargs)


class Regions:
    """The model's blocks with one compiled ``forward`` per block class (:func:`repeated_blocks`), installed at once
    (each block's own code runs until :meth:`active`) and kept until :meth:`remove`.

    Args:
        blocks: the blocks to compile.
        compile_forward: compiles a class ``forward`` (``torch.compile`` with the step's backend and mode).
    """

    def __init__(self, blocks: list[torch.nn.Module], compile_forward: Callable[[Callable[..., Any]], Any]) -> None:
        self.blocks = blocks
        self.on = False
        self._compiled = {kind: compile_forward(kind.forward) for kind in {type(b) for b in blocks}}
        self._restore: Callable[[], None] | None = replace_block_forwards(
            blocks, lambda block: _BlockForward(self, block, self._compiled[type(block)])
        )

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

            >>> regions.kinds      # a Llama of 2 layers
            {'LlamaDecoderLayer': 2}
        """
        counts: dict[str, int] = {}
        for block in self.blocks:
            counts[type(block).__name__] = counts.get(type(block).__name__, 0) + 1
        return counts

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The blocks run compiled in the forward inside (their own code again after, even when it raises).

        Returns:
            The context.

        Example::

            >>> with regions.active():      # the blocks run compiled in a forward here: out = model(**inputs)
            ...     regions.on
            True
            >>> regions.on
            False
        """
        self.on = True
        try:
            # a layer's own ints (its layer_idx) as inputs, not constants: one graph for layers that differ only there
            with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True):
                yield
        finally:
            self.on = False

    def remove(self) -> None:
        """The blocks' own ``forward`` back (a compile that failed).

        Example::

            >>> regions.remove()
        """
        if self._restore is not None:
            self._restore()
            self._restore = None


def _compiled_forward(forward: Callable[..., Any], backend: Any, mode: str | None) -> Any:
    """``torch.compile`` of a class ``forward`` (cached on its code: every block of the class, every model)."""
    return torch.compile(forward, backend=backend, mode=mode)
