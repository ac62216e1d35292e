"""The model's two forwards, owned here: the one attach sets on it (packed batches from the ecosystem take the
proven path), and the model's own, which proofs and verdicts run.

    forwards = replace_forwards(hf_model, route=packed_model, backbone_route=packed_backbone)   # attach
    forwards.restore()                                   # a refused attach: the model's forwards as they were
    logits = own_forward(hf_model, input_ids=ids).logits # what stock computes, without what replaced forward

    restore = replace_block_forwards(blocks, compiled_forward_of)  # the compiled blocks (path/regions.py)

Nothing else in the package sets or takes off an instance's ``forward``. The routes are
:mod:`foundry_attn.path.forward`'s (what a packed call does), handed in by attach: this module knows only how a call
reaches them. Core module: torch and transformers only.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from foundry_attn.attention.documents import DOCS_KEY
from foundry_attn.flat.inputs import packed_call

#: what a packed call runs: (model, its class forward bound as a function, the batch, the call's other keywords)
Route = Callable[[Any, Callable[..., Any], dict[str, Any], dict[str, Any]], Any]
#: what is read of a plain call before the model's own forward runs it: (model, the call's keywords)
Plain = Callable[[Any, dict[str, Any]], None]


class FlattenedForward:
    """An attached model's ``forward``: a batch the ecosystem packed into one row (transformers'
    ``DataCollatorWithFlattening``, TRL's ``padding_free``: restarting ``position_ids``, ``cu_seq_lens_*``,
    ``seq_idx``; :func:`foundry_attn.flat.layout.flattened_lengths`) runs the proven path, flat or rows, with the
    proof, exactly as :func:`~foundry_attn.path.forward.forward_documents` runs ours; every other call (a 2-D mask,
    generation, our own flat inputs) runs the model's own ``forward`` unchanged, a plain one read first (``plain``:
    left-padded rows are said once).

        attach(model, "sdpa")
        SFTTrainer(model=model, args=SFTConfig(padding_free=True), ...)    # model(**batch) takes this path
    """

    def __init__(self, model: Any, route: Route, plain: Plain | None = None) -> None:
        self.model, self.route, self.plain = model, route, plain  # a deep copy of the model copies these too

    @property
    def __signature__(self) -> inspect.Signature:
        """The model's own (the Trainer reads it to keep the dataset's columns)."""
        return inspect.signature(type(self.model).forward.__get__(self.model))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model, forward = self.model, type(self.model).forward  # no bound method made: nothing for Dynamo to guard
        if args or DOCS_KEY in kwargs:  # ours (flat inputs) or a positional call: the model's own forward
            return forward(model, *args, **kwargs)
        packed = packed_call(kwargs)
        if packed is None:
            if self.plain is not None:
                self.plain(model, kwargs)
            return forward(model, **kwargs)
        return self.route(model, forward, *packed)


class FlattenedBackbone:
    """An attached model's base model ``forward``: a packed batch that reaches the backbone itself (TRL's fused LM
    head calls ``model.base_model`` and projects the hidden states in chunks, so the model's own ``forward`` never
    runs) takes the proven path too (its route); calls that carry our documents (the causal LM's own flat path), a
    mask, or no packed documents run the base model's forward unchanged."""

    def __init__(self, model: Any, route: Route) -> None:
        self.model, self.route = model, route  # the causal LM; its base model is model.base_model

    @property
    def __signature__(self) -> inspect.Signature:
        base = self.model.base_model
        return inspect.signature(type(base).forward.__get__(base))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        base = self.model.base_model
        forward = type(base).forward
        packed = None if args or DOCS_KEY in kwargs or torch.compiler.is_compiling() else packed_call(kwargs)
        if packed is None:
            return forward(base, *args, **kwargs)
        return self.route(self.model, forward, *packed)


@dataclasses.dataclass
class Forwards:
    """The instance ``forward`` of a model and of its base model before :func:`replace_forwards` (None: the class's)."""

    kept: list[tuple[Any, Any]]

    def restore(self) -> None:
        """Put them back (a refused attach leaves the model as it was).

        Example::

            >>> from foundry_attn.path.forward import packed_backbone, packed_model
            >>> forwards = replace_forwards(stock_model, packed_model, packed_backbone)
            >>> forwards.restore()
            >>> "forward" in vars(stock_model)
            False
        """
        for module, forward in self.kept:
            if forward is None:
                vars(module).pop("forward", None)
            else:
                module.forward = forward


def replace_forwards(hf: Any, route: Route, backbone_route: Route, plain: Plain | None = None) -> Forwards:
    """Set :class:`FlattenedForward` as ``hf``'s forward and :class:`FlattenedBackbone` as its base model's (once).

    Args:
        hf: the transformers causal LM (not a wrapper).
        route: what a packed call of the model runs (:func:`foundry_attn.path.forward.packed_model`).
        backbone_route: what a packed call of its base model runs (:func:`foundry_attn.path.forward.packed_backbone`).
        plain: what reads a plain call first (:func:`foundry_attn.path.forward.plain_call`), or None.

    Returns:
        The forwards they replaced, to :meth:`Forwards.restore`.

    Example::

        >>> from foundry_attn.path.forward import packed_backbone, packed_model
        >>> forwards = replace_forwards(stock_model, packed_model, packed_backbone)
        >>> type(vars(stock_model)["forward"]).__name__, type(vars(stock_model.model)["forward"]).__name__
        ('FlattenedForward', 'FlattenedBackbone')
    """
    base = getattr(hf, "base_model", hf)
    kept = Forwards([(m, vars(m).get("forward")) for m in (hf, base)])
    if not isinstance(vars(hf).get("forward"), FlattenedForward):
        hf.forward = FlattenedForward(hf, route, plain)
    if base is not hf and not isinstance(vars(base).get("forward"), FlattenedBackbone):
        base.forward = FlattenedBackbone(hf, backbone_route)
    return kept


def own_forward(hf: Any, **inputs: Any) -> Any:
    """``hf`` called with its class ``forward``: what stock computes, through the module's hooks (FSDP2 gathers its
    weights in one) but without what replaced the instance's ``forward`` (accelerate's mixed precision, TRL's fused
    head, :class:`FlattenedForward`), which is put back after. A check's forward runs inside the step's own call;
    calling accelerate's wrapper from there re-enters its one ``torch.autocast`` object, whose outer exit then leaves
    autocast on for the rest of the process. The precision is the caller's: the step's autocast, or
    :meth:`~foundry_attn.proof.forward_probe.ForwardProbe.context`.

    Args:
        hf: the transformers model (not a wrapper).
        **inputs: the forward's keywords.

    Returns:
        The model's output.

    Example::

        >>> own_forward(hf_model, input_ids=doc[None], use_cache=False).logits.shape
        torch.Size([1, 23, 64])
    """
    instance = vars(hf).pop("forward", None)
    try:
        return hf(**inputs)
    finally:
        if instance is not None:
            vars(hf)["forward"] = instance


def replace_block_forwards(
    modules: Sequence[torch.nn.Module], forward_of: Callable[[torch.nn.Module], Callable[..., Any]]
) -> Callable[[], None]:
    """Each module's ``forward`` replaced by ``forward_of(module)``; the function returned puts back what each had
    (an instance ``forward`` too).

    Args:
        modules: the modules (a model's decoder layers).
        forward_of: the forward each module runs from now on.

    Returns:
        The restore.

    Example::

        >>> restore = replace_block_forwards(model.model.layers, lambda layer: torch.compile(layer.forward))
        >>> restore()
        >>> "forward" in vars(model.model.layers[0])
        False
    """
    kept = [(module, vars(module).get("forward")) for module in modules]
    for module in modules:
        module.forward = forward_of(module)

    def restore() -> None:
        for module, own in kept:
            if own is None:
                vars(module).pop("forward", None)
            else:
                module.forward = own

    return restore
