"""Count the calls into transformers' flash-attention helpers that :mod:`foundry_attn.observe.flash_symbols` finds.

    from foundry_attn.observe.flash_calls import FlashCallTracer

    with FlashCallTracer() as tracer:       # counts unpad / position-id / varlen / dense / pad calls
        model(input_ids=ids, attention_mask=mask)
    tracer.counts["upad"], tracer.first["varlen"]["cu_seqlens_q"]

The helpers are wrapped where the module looks them up at call time, as layers (:mod:`foundry_attn.patching`) that
sit above the FA2 reference kernel's replacements, so two tracers and the reference context nest in any order; the
originals come back when the last attach goes. Core module: torch, transformers and the standard library only.
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from foundry_attn.attention import fa2_reference
from foundry_attn.observe.flash_symbols import (
    DENSE,
    KERNEL_ROLES,
    LAZY_IMPORT,
    LAZY_LAYOUTS,
    PAD,
    POSIDS,
    ROLES,
    UPAD,
    VARLEN,
    FlashSymbols,
    discover,
    from_reference,
)
from foundry_attn.patching import Patch, patch_attribute
from foundry_attn.proof.proving import proving

_lock = threading.RLock()  # a tracer's attach depth


def _as_list(value: Any) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.detach().flatten().tolist()]  # host read: sampled calls only
    return [int(v) for v in value]


def _as_int(value: Any) -> int | None:
    if value is None:
        return None
    return int(value.item()) if isinstance(value, torch.Tensor) else int(value)


def _is_cu_pair(value: Any) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(t, torch.Tensor) and t.dim() == 1 and not t.is_floating_point() for t in value)
    )


def _seqlens_from_output(out: Any) -> dict[str, Any]:
    """``(cu_q, cu_k), (max_q, max_k)`` wherever they sit in an unpad/position-id helper's result."""
    items = list(out) if isinstance(out, tuple) else []
    for i, item in enumerate(items):
        if _is_cu_pair(item):
            rec: dict[str, Any] = {"cu_seqlens_q": _as_list(item[0]), "cu_seqlens_k": _as_list(item[1])}
            if i + 1 < len(items) and isinstance(items[i + 1], tuple) and len(items[i + 1]) == 2:
                rec["max_seqlen_q"], rec["max_seqlen_k"] = (_as_int(v) for v in items[i + 1])
            return rec
    return {}


def _describe_call(role: str, args: tuple, kwargs: dict, out: Any) -> dict[str, Any]:
    """What a traced call was given / gave back, as plain Python (reads device values: sampled calls only)."""
    if role == VARLEN:

        def arg(key: str, pos: int) -> Any:
            return kwargs[key] if key in kwargs else (args[pos] if len(args) > pos else None)

        return {
            "cu_seqlens_q": _as_list(arg("cu_seqlens_q", 3)),
            "cu_seqlens_k": _as_list(arg("cu_seqlens_k", 4)),
            "max_seqlen_q": _as_int(arg("max_seqlen_q", 5)),
            "max_seqlen_k": _as_int(arg("max_seqlen_k", 6)),
            "q_shape": list(q.shape) if isinstance(q := arg("q", 0), torch.Tensor) else None,
        }
    if role == DENSE:
        q = args[0] if args else kwargs.get("q")
        shape = list(q.shape) if isinstance(q, torch.Tensor) else None
        return {"q_shape": shape, "max_seqlen_q": shape[1] if shape else None}
    if role == PAD:
        return {"out_shape": list(out.shape) if isinstance(out, torch.Tensor) else None}
    return _seqlens_from_output(out)


class FlashCallTracer:
    """Counts calls into transformers' flash-attention helpers while attached.

    ``counts[role]`` (calls since :meth:`reset`), ``first[role]`` (cu_seqlens / max_seqlen / shapes of the
    first call of each role, only while ``record`` is true), ``entry`` (the first kernel that ran: ``varlen``
    or ``dense``). ``attach``/``detach`` nest (a depth count); ``with tracer:`` attaches for the block.
    """

    def __init__(self, symbols: FlashSymbols | None = None, record: bool = True, module: ModuleType | None = None):
        self.symbols = symbols if symbols is not None else discover(module)
        self._module = module
        self.record = record
        self.counts: dict[str, int] = dict.fromkeys(ROLES, 0)
        self.first: dict[str, dict[str, Any]] = {}
        self.order: list[str] = []
        #: a flash kernel ran under the reference (not flash-attn) since :meth:`reset`; None: no kernel ran
        self.ran_reference: bool | None = None
        self._patches: list[Patch] = []
        self._depth = 0

    # -- lifecycle
    def reset(self, record: bool | None = None) -> None:
        """Counts from zero, first calls and the entry forgotten: a new forward is coming.

        Args:
            record: whether the first call of each role is recorded from now; None: as before.

        Example::

            >>> tracer.counts["varlen"], tracer.entry  # after a forward
            (2, 'varlen')
            >>> tracer.reset(record=True)
            >>> tracer.counts["varlen"], tracer.entry, tracer.first
            (0, None, {})
        """
        self.counts = dict.fromkeys(ROLES, 0)
        self.first, self.order, self.ran_reference = {}, [], None
        if record is not None:
            self.record = record

    @property
    def attached(self) -> bool:
        """Whether the tracer's patches are on (more :meth:`attach` calls than :meth:`detach` calls so far).

        Returns:
            True while attached.

        Example::

            >>> with FlashCallTracer() as tracer:
            ...     tracer.attached
            True
        """
        return self._depth > 0

    def attach(self) -> None:
        """Wrap every symbol found (module attributes, and the kernels the lazy importer hands out); a nested call
        only counts, and a patch that fails undoes the others.

        Example::

            >>> tracer = FlashCallTracer()
            >>> tracer.attach()
            >>> try:  # FA2 on a CPU: the reference kernel (foundry_attn.attention.fa2_reference)
            ...     with reference_flash_attn(), torch.no_grad():
            ...         out = fa2_model(input_ids=ids)
            ... finally:
            ...     tracer.detach()  # also when the forward raised
            >>> tracer.counts["dense"]  # one call per layer: rows without padding
            2
        """
        with _lock:
            self._depth += 1
            if self._depth > 1:
                return
            try:
                mod = self._module if self._module is not None else importlib.import_module(self.symbols.module)
                lazy_roles = []
                for role, name in self.symbols.found.items():
                    if name.startswith(LAZY_IMPORT):
                        lazy_roles.append(role)
                    else:
                        home = mod
                        if self._module is None and self.symbols.module_of(role) != self.symbols.module:
                            home = importlib.import_module(self.symbols.module_of(role))
                        self._patches.append(patch_attribute(home, name, wrap=functools.partial(self._wrap, role)))
                if lazy_roles and self.symbols.lazy_import:
                    factory = functools.partial(self._wrap_lazy, tuple(lazy_roles))
                    self._patches.append(patch_attribute(mod, self.symbols.lazy_import, wrap=factory))
            except BaseException:
                self._depth = 1
                self.detach()
                raise

    def detach(self, force: bool = False) -> None:
        """Undo one :meth:`attach` (all of them with ``force``); originals come back when the last goes.

        Args:
            force: undo every :meth:`attach` at once.

        Example::

            >>> tracer.attach()
            >>> tracer.attach()  # nested: one more to undo
            >>> tracer.detach(force=True)
            >>> tracer.attached
            False
        """
        with _lock:
            if self._depth == 0:
                return
            self._depth = 0 if force else self._depth - 1
            if self._depth == 0:
                patches, self._patches = self._patches, []
                for patch in reversed(patches):
                    patch.remove()

    def __enter__(self) -> FlashCallTracer:
        self.attach()
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # -- wrappers
    def _seen(self, role: str, args: tuple, kwargs: dict, out: Any) -> None:
        if self.record and role not in self.first:
            try:
                self.first[role] = _describe_call(role, args, kwargs, out)
            except Exception as exc:  # tracing never breaks the forward
                self.first[role] = {"error": f"{type(exc).__name__}: {exc}"}

    def _wrap(self, role: str, inner: Callable) -> Callable:
        @functools.wraps(inner)
        def traced(*args: Any, **kwargs: Any) -> Any:
            if proving():  # the flat-path proof's own forwards are not the step's
                return inner(*args, **kwargs)
            self.counts[role] += 1
            if role not in self.order:
                self.order.append(role)
            if role in KERNEL_ROLES:  # what ran, not what the module holds after: 5.x hands kernels out lazily
                self.ran_reference = bool(self.ran_reference) or fa2_reference.active() or from_reference(inner)
            out = inner(*args, **kwargs)
            self._seen(role, args, kwargs, out)
            return out

        traced.__foundry_attn_traced__ = role  # type: ignore[attr-defined]
        return traced

    def _wrap_lazy(self, roles: tuple[str, ...], inner: Callable) -> Callable:
        """``lazy_import_flash_attention`` -> the same result with its kernels wrapped (cached per kernel)."""
        cache: dict[int, Callable] = {}

        @functools.wraps(inner)
        def traced_lazy(*args: Any, **kwargs: Any) -> Any:
            result = inner(*args, **kwargs)
            try:
                kernels, rest = result[0], result[1:]
                kernels = list(kernels)
            except (TypeError, IndexError, KeyError):
                return result
            layout = LAZY_LAYOUTS.get(len(kernels), {})
            for role in roles:
                i = layout.get(role, len(kernels))
                if i < len(kernels) and callable(kernels[i]):
                    fn = kernels[i]
                    if id(fn) not in cache:
                        cache[id(fn)] = self._wrap(role, fn)
                    kernels[i] = cache[id(fn)]
            return (tuple(kernels), *rest)

        return traced_lazy

    # -- results
    @property
    def entry(self) -> str | None:
        """The first flash kernel that ran since :meth:`reset`: ``varlen`` or ``dense`` (None if neither).

        Returns:
            The role, or None.

        Example::

            >>> tracer.entry  # a padded batch under flash_attention_2
            'varlen'
        """
        return next((r for r in self.order if r in KERNEL_ROLES), None)

    @property
    def max_seqlen(self) -> int | None:
        """The ``max_seqlen`` of the first recorded call that gives one: the entry kernel's, else varlen's, dense's,
        the unpad's or the position-id helper's.

        Returns:
            The length in tokens, or None (nothing recorded).

        Example::

            >>> tracer.max_seqlen  # rows of 8 and 6 real tokens
            8
        """
        for role in (self.entry, VARLEN, DENSE, UPAD, POSIDS):
            if role and role in self.first and self.first[role].get("max_seqlen_q") is not None:
                return self.first[role]["max_seqlen_q"]
        return None

    @property
    def cu_seqlens(self) -> list[int] | None:
        """cu_seqlens_q of the first varlen call (else of the first unpad / position-id call).

        Returns:
            The cumulative lengths, or None (nothing recorded).

        Example::

            >>> tracer.cu_seqlens  # rows of 8 and 6 real tokens
            [0, 8, 14]
        """
        for role in (VARLEN, UPAD, POSIDS):
            if self.first.get(role, {}).get("cu_seqlens_q") is not None:
                return self.first[role]["cu_seqlens_q"]
        return None

    def summary(self) -> dict[str, Any]:
        """What the tracer saw since :meth:`reset`, as plain data (the ``upad_trace`` event's fields).

        Returns:
            ``counts``, ``entry``, ``max_seqlen``, ``cu_seqlens``, ``first`` (per role) and ``symbols`` (the names
            found).

        Example::

            >>> FlashCallTracer().summary()["counts"]
            {'upad': 0, 'posids': 0, 'varlen': 0, 'dense': 0, 'pad': 0}
        """
        return {
            "counts": dict(self.counts),
            "entry": self.entry,
            "max_seqlen": self.max_seqlen,
            "cu_seqlens": self.cu_seqlens,
            "first": {k: dict(v) for k, v in self.first.items()},
            "symbols": dict(self.symbols.found),
        }
