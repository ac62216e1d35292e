"""How the documents of one flat row reach attention: the :class:`Documents` object, the keyword every attention
call carries it under (``foundry_documents``), the ``[1, 1, 1, 1]`` placeholder that stands in for the model's
L x L mask, and the errors raised when the documents do not arrive or the call carries what the flat row cannot
honour. :mod:`foundry_attn.path.forward` builds them; the functions of :mod:`foundry_attn.attention.functions` read
them. Core module: torch only.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch

from foundry_attn.attention.compiled_op import additive_mask
from foundry_attn.attention.length_groups import LengthGroups, groups_for

DOCS_KEY = "foundry_documents"


class Documents:
    """Where each document sits in the flat row of one forward.

    ``bounds = (0, l0, l0 + l1, ...)`` as Python ints for the eager paths, and the same bounds as int32 tensors
    made once per forward (:meth:`of`): ``device_bounds`` on the model's device (FA2's ``cu_seqlens``, flex),
    ``host_bounds`` on the CPU (:mod:`foundry_attn.attention.compiled_op` reads it without a device sync). One word,
    ``bounds``, in every form. Under ``torch.compile`` only the tensors
    are read, so a new layout is new data for the same graph, not a new graph. (A plain class, not a dataclass:
    Dynamo guards every field of a dataclass it meets, and only the attributes read of a plain object.)

    A row padded to a capacity (:mod:`foundry_attn.flat.capacity`) keeps its ``real`` documents first: ``bounds``
    are what the kernel reads (the padding one more document, then zero-length ones up to the document capacity),
    ``spans``, ``lengths`` and ``max_length`` the real documents only, and ``pinned`` the ``max_seqlen`` the kernel
    is given (the capacity: one shape for every batch of the bucket).
    """

    def __init__(
        self,
        bounds: tuple[int, ...],
        device_bounds: torch.Tensor | None = None,
        host_bounds: torch.Tensor | None = None,
        real: int | None = None,
        pinned: int | None = None,
    ) -> None:
        self.bounds, self.device_bounds, self.host_bounds = tuple(bounds), device_bounds, host_bounds
        self.real = len(self.bounds) - 1 if real is None else real  # the real documents, first in the row
        self.pinned = pinned  # the max_seqlen a kernel is given, where the row is padded to a capacity
        self.calls = 0  # attention calls that received these documents (uncompiled; the proof reads it)
        self._groups: dict[str, LengthGroups] = {}  # per kind of device (length_groups.groups_for)
        self._masks: dict[tuple, torch.Tensor] = {}  # eager's additive masks, per length, window, dtype and device

    def __repr__(self) -> str:
        return f"Documents(bounds={self.bounds})"

    @classmethod
    def of(
        cls,
        bounds: tuple[int, ...] | list[int],
        device: torch.device | str = "cpu",
        real: int | None = None,
        pinned: int | None = None,
    ) -> Documents:
        """The documents at ``bounds``, with their int32 bounds made once: on ``device`` and on the CPU.

        Args:
            bounds: where the documents start and end in the flat row, ``(0, l0, l0 + l1, ..., T)``.
            device: the model's device, for ``device_bounds``.
            real: how many documents are real, first in the row (None: all; a capacity pads the rest).
            pinned: the ``max_seqlen`` a kernel is given (None: the longest document).

        Returns:
            The :class:`Documents`, ``device_bounds`` on ``device`` and ``host_bounds`` on the CPU.

        Example::

            >>> docs = Documents.of([0, 17, 40])   # two documents, 17 and 23 tokens (on a GPU: device "cuda")
            >>> docs.device_bounds, docs.lengths
            (tensor([ 0, 17, 40], dtype=torch.int32), [17, 23])
        """
        host = torch.tensor(bounds, dtype=torch.int32)
        return cls(tuple(bounds), host.to(device, non_blocking=True), host, real, pinned)

    @functools.cached_property
    def spans(self) -> list[tuple[int, int]]:
        """Each real document's ``(start, end)`` in the flat row.

        Returns:
            One ``(start, end)`` pair per document.

        Example::

            >>> Documents.of([0, 17, 40]).spans
            [(0, 17), (17, 40)]
        """
        return list(itertools.pairwise(self.bounds[: self.real + 1]))

    @functools.cached_property
    def lengths(self) -> list[int]:
        """Each real document's length in tokens.

        Returns:
            One length per document.

        Example::

            >>> Documents.of([0, 17, 40]).lengths
            [17, 23]
        """
        return [e - s for s, e in self.spans]

    @functools.cached_property
    def max_length(self) -> int:
        """The longest real document's length (FA2's ``max_seqlen``, unless ``pinned``).

        Returns:
            The length in tokens; 0 without documents.

        Example::

            >>> Documents.of([0, 17, 40]).max_length
            23
        """
        return max(self.lengths, default=0)

    def groups(self, device: torch.device) -> LengthGroups:
        """The documents grouped by length for sdpa and eager on ``device``
        (:func:`~foundry_attn.attention.length_groups.groups_for`): made once per layout, with its gather and scatter
        indices, and read by every layer.

        Args:
            device: where the attention runs (``query.device``).

        Returns:
            The :class:`~foundry_attn.attention.length_groups.LengthGroups` of these documents.

        Example::

            >>> docs = Documents.of([0, 17, 40, 57])   # lengths 17, 23, 17
            >>> docs.groups(torch.device("cuda"))      # the two 17s in one batch, the 23 alone
            LengthGroups(shapes=((2, 17), (1, 23)))
            >>> docs.groups(torch.device("cpu"))       # the CPU: each alone (a group would not halve the calls)
            LengthGroups(shapes=((1, 17), (1, 23), (1, 17)))
        """
        if device.type not in self._groups:
            self._groups[device.type] = groups_for(tuple(self.lengths), device)
        return self._groups[device.type]

    def mask(self, n: int, window: int | None, like: torch.Tensor) -> torch.Tensor:
        """Eager's ``[n, n]`` additive causal (and windowed) mask in ``like``'s dtype and device
        (:func:`~foundry_attn.attention.compiled_op.additive_mask`), made once per layout for every layer.

        Args:
            n: the padded length of a batch of documents.
            window: how many keys a query sees, itself included (None: no window).
            like: a tensor whose dtype and device the mask takes.

        Returns:
            The mask (the same tensor for every layer that asks).

        Example::

            >>> docs = Documents.of([0, 3, 6])
            >>> docs.mask(3, None, q) is docs.mask(3, None, q)
            True
        """
        key = (n, window, like.dtype, like.get_device())  # the device's index (-1: the CPU), no device object made
        if key not in self._masks:
            self._masks[key] = additive_mask(n, window, like)
        return self._masks[key]

    def block_mask(self, window: int | None, like: torch.Tensor) -> torch.Tensor:
        """Eager's ``[T, T]`` additive mask over the whole row: causal (and windowed) within each document, every
        other document masked; in ``like``'s dtype and device, made once per layout for every layer (a short row
        runs in one call: :data:`~foundry_attn.attention.dense_functions.SHORT_ROW`).

        Args:
            window: how many keys a query sees, itself included (None: no window).
            like: a tensor whose dtype and device the mask takes.

        Returns:
            The mask (the same tensor for every layer that asks).

        Example::

            >>> Documents.of([0, 2, 3]).block_mask(None, q)[2].tolist()     # the third token: a document of its own
            [-3.4028234663852886e+38, -3.4028234663852886e+38, 0.0]
        """
        key = ("row", window, like.dtype, like.get_device())
        if key not in self._masks:
            count, tokens = len(self.lengths), self.bounds[self.real]
            doc = torch.repeat_interleave(torch.arange(count), torch.tensor(self.lengths), output_size=tokens)
            other = (doc[:, None] != doc[None, :]).to(like.device)
            self._masks[key] = additive_mask(tokens, window, like).masked_fill_(other, torch.finfo(like.dtype).min)
        return self._masks[key]

    def bounds_on(self, device: torch.device | str) -> torch.Tensor:
        """The bounds as an int32 tensor on ``device`` (the one made per forward where it is there).

        Args:
            device: where the bounds are wanted (``query.device`` for FA2's ``cu_seqlens``, ``"cpu"`` for the op).

        Returns:
            The int32 bounds ``[n + 1]`` on ``device``.

        Example::

            >>> docs = Documents.of([0, 17, 40], "meta")   # the model's device ("cuda" on a GPU)
            >>> docs.bounds_on("cpu") is docs.host_bounds, docs.bounds_on("meta") is docs.device_bounds
            (True, True)
        """
        device = torch.device(device)
        for made in (self.device_bounds, self.host_bounds):
            if made is not None and made.device == device:
                return made
        return torch.tensor(self.bounds, dtype=torch.int32, device=device)

    def document_ids(self, device: torch.device) -> torch.Tensor:
        """Which document each token of the flat row belongs to (flex's document mask).

        Args:
            device: where the ids are made.

        Returns:
            The ``[T]`` int64 document index of each token.

        Example::

            >>> Documents.of([0, 3, 5]).document_ids(torch.device("cpu"))
            tensor([0, 0, 0, 1, 1])
        """
        lengths = torch.tensor([e - s for s, e in itertools.pairwise(self.bounds)])
        return torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(device)

    def positions(self, device: torch.device) -> torch.Tensor:
        """Each token's position within its document (the ``position_ids`` FA2's varlen path takes).

        Args:
            device: where the positions are made.

        Returns:
            The ``[1, T]`` int64 positions, restarting at 0 with each document.

        Example::

            >>> Documents.of([0, 3, 5]).positions(torch.device("cpu"))
            tensor([[0, 1, 2, 0, 1]])
        """
        return torch.cat([torch.arange(e - s) for s, e in itertools.pairwise(self.bounds)]).to(device)[None]


def is_placeholder(mask: Any) -> bool:
    """The ``[1, 1, 1, 1]`` mask ``forward_documents`` hands the model: it masks nothing, and the model's own
    mask code (Gemma's sliding-window step included) passes it on without growing it to L x L.

    Args:
        mask: the ``attention_mask`` an attention function received (a tensor, None, a BlockMask, ...).

    Returns:
        True for a 4-D tensor whose last two dimensions are 1 x 1.

    Example::

        >>> is_placeholder(torch.ones(1, 1, 1, 1)), is_placeholder(torch.ones(1, 1, 40, 40)), is_placeholder(None)
        (True, False, False)
    """
    return isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[-2:] == (1, 1)


class DocumentsDropped(RuntimeError):
    """A layer called attention without our ``foundry_documents`` argument while the flat row was running."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.attention_class = type(module).__name__
        super().__init__(
            f"foundry_attn: the documents did not reach {self.attention_class}: the layer that calls it passed "
            f"no '{DOCS_KEY}' argument (it forwards no **kwargs to attention)"
        )


class FlatUnsupported(ValueError):
    """The attention call carries an argument the flat path does not honour (sinks, a position bias, ...)."""
