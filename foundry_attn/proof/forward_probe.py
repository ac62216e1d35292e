"""What one training forward really ran, read inside it: its autocast and its input embeddings.

    probe = ForwardProbe(hf_model)
    out = model(**batch)
    judge(hf_model, batch, out, context=probe.context(), embeds=probe.embeds)
    probe.remove()

Core module: torch only.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from foundry_attn.proof.proving import proving


class ForwardProbe:
    """What one forward of ``hf`` really ran, read inside it by hooks on its input embeddings: its autocast
    (accelerate's mixed precision wraps the model's ``forward`` itself, so code outside that forward sees fp32 while
    the layers run in bf16; :meth:`context` repeats it for a judgement's own forwards) and, in a training forward,
    the input ``embeds`` as a tensor the verdict differentiates against (a frozen embedding's output becomes a leaf
    that requires grad: the same values, the same graph above it). A user's ``torch.autocast`` and Composer's
    precision context are read the same way.

        probe = ForwardProbe(hf)
        out = model(**batch)
        judge(hf, batch, out, context=probe.context(), embeds=probe.embeds)
        probe.remove()
    """

    def __init__(self, hf: Any) -> None:
        self.autocast: tuple[str, torch.dtype] | None = None  # (device type, dtype) of the forward read
        self.embeds: torch.Tensor | None = None
        inner = hf.get_input_embeddings() if hasattr(hf, "get_input_embeddings") else None
        inner = inner if isinstance(inner, torch.nn.Module) else hf
        self._handles: list[Any] = [inner.register_forward_pre_hook(self._read)]
        if inner is not hf:
            self._handles.append(inner.register_forward_hook(self._keep))

    def _read(self, module: torch.nn.Module, args: Any) -> None:
        if proving():  # a proof's forward inside the step's call, before the step's own
            return
        param = next(module.parameters(), None)
        device = param.device.type if param is not None else "cpu"
        if torch.is_autocast_enabled(device):
            self.autocast = (device, torch.get_autocast_dtype(device))
        self._handles[0].remove()

    def _keep(self, module: torch.nn.Module, args: Any, out: Any) -> Any:
        """The last training forward's (a batch that moved to rows runs again: its second forward is the one that
        returns), until :meth:`remove`."""
        if proving() or not (looked_up(args) and isinstance(out, torch.Tensor) and out.is_floating_point()):
            return None
        if not torch.is_grad_enabled():
            return None
        if not out.requires_grad:
            out = out.detach().requires_grad_()
        self.embeds = out
        return out

    def remove(self) -> None:
        """Take the probe's hooks off the model; what it read (``autocast``, ``embeds``) stays.

        Example::

            >>> probe = ForwardProbe(hf_model)
            >>> logits = hf_model(input_ids=ids).logits
            >>> probe.remove()     # after the judgement: what it read stays
            >>> probe.embeds.shape, probe.autocast
            (torch.Size([2, 8, 32]), None)
        """
        for handle in self._handles:
            handle.remove()

    def context(self) -> contextlib.AbstractContextManager:
        """The forward's autocast again (nothing when it ran without).

        Returns:
            A context manager: ``torch.autocast`` with the device type and dtype read, else a null context.

        Example::

            >>> probe = ForwardProbe(hf_model)
            >>> with torch.autocast("cpu", torch.bfloat16):     # the batch's forward, as accelerate's bf16 runs it
            ...     logits = hf_model(input_ids=ids).logits
            >>> with probe.context():     # a judgement's own forwards run under the same autocast
            ...     torch.is_autocast_enabled("cpu"), probe.autocast
            (True, ('cpu', torch.bfloat16))
        """
        return torch.autocast(*self.autocast) if self.autocast else contextlib.nullcontext()


def looked_up(args: Any) -> bool:
    """Whether an embedding module's call looks token ids up (an integer input), not a shared embedding used as the
    output layer (MPT's ``wte(hidden, unembed=True)``).

    Args:
        args: the embedding module's positional call arguments (a forward hook's ``args``).

    Returns:
        True where the first argument is an integer tensor.

    Example::

        >>> looked_up((ids,)), looked_up((torch.zeros(2, 8, 32),))     # token ids; hidden states (MPT's unembed)
        (True, False)
    """
    return bool(args) and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point()
