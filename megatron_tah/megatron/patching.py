"""The one helper behind every attribute megatron_tah replaces (transports, flags, log, shims).

A :class:`Patches` object belongs to one installer -- each place (``place_spec.Place.patches``), the
flags, the log, the plugin and the CPU shims (``registry.REGISTRY``) -- and records what it
replaced, so that ``restore()`` puts back exactly the original objects, newest first::

    patches = Patches()
    patches.wrap("megatron.training.training", "training_log", make_wrapper)   # wrapper(original)
    patches.replace(torch.Tensor, "cuda", cpu_cuda)                             # plain replacement
    patches.kernel("mm", mm_in_fp32)                                            # torch's CPU kernel of aten::mm
    patches.restore()

Each call says why in one line (``why=``); ``entries()`` lists what is replaced, with that line, the module that
made the replacement and whether it wraps or replaces: ``scripts/write_patches.py`` writes docs/PATCHES.md from the
installers' entries. Every replacement carries the marker attribute ``_megatron_tah`` and the original in
``__wrapped__`` where it accepts attributes; ``wrap`` leaves an attribute that already carries the
marker alone (installing twice is a no-op). A class attribute that was inherited (absent from the
class's own ``__dict__``) is deleted again on restore, so the inherited one shows through.
Owners named by a string are imported on first use; a missing module or attribute raises
``RuntimeError`` naming it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Callable

MARKER = "_megatron_tah"
_INHERITED = object()  # the original lived on a base class: delete on restore


def resolve(owner: Any) -> Any:
    """A module given by name (imported), a ``"module:Class"`` string, or the object itself."""
    if not isinstance(owner, str):
        return owner
    module_name, _, qualname = owner.partition(":")
    try:
        target = importlib.import_module(module_name)
    except ImportError as err:
        raise RuntimeError(f"megatron_tah needs {module_name} (megatron-core / megatron.training): {err}") from err
    for part in filter(None, qualname.split(".")):
        if not hasattr(target, part):
            raise RuntimeError(f"megatron_tah: {module_name} has no {qualname}; this megatron-core is not supported")
        target = getattr(target, part)
    return target


def is_ours(value: Any) -> bool:
    return bool(getattr(value, MARKER, False))


def _mark(value: Any, original: Any) -> None:
    try:
        setattr(value, MARKER, True)
        value.__wrapped__ = original
    except (AttributeError, TypeError):
        pass  # e.g. a bound method; the Patches record is what restores it


def qualified_name(owner: Any) -> str:
    """``megatron.core.x`` for a module, ``megatron.core.x.Class`` for a class (where it is defined)."""
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return getattr(owner, "__name__", repr(owner))


@dataclasses.dataclass(frozen=True)
class Entry:
    """One replaced attribute: ``target`` (``owner.attribute``), ``how`` ("wraps" or "replaces"), ``why`` (the
    call's line) and ``by`` (the module of megatron_tah that made the replacement)."""

    target: str
    how: str
    why: str
    by: str


def _maker_module(value: Any) -> str:
    return getattr(value, "__module__", None) or type(value).__module__


class Patches:
    """Attributes replaced by one installer, restorable exactly and in reverse order."""

    def __init__(self):
        self._applied: list[tuple[Any, str, Any]] = []
        self._entries: list[Entry] = []
        self._kernels: Any = None  # the torch.library.Library of ``kernel``'s registrations

    def __bool__(self) -> bool:
        return bool(self._applied) or self._kernels is not None

    def entries(self) -> list[Entry]:
        """What is replaced now, in the order it was (empty after ``restore``)."""
        return list(self._entries)

    def original(self, owner: Any, attribute: str) -> Any:
        owner = resolve(owner)
        if not hasattr(owner, attribute):
            name = getattr(owner, "__name__", repr(owner))
            raise RuntimeError(f"megatron_tah: {name}.{attribute} not found; this megatron-core is not supported")
        return getattr(owner, attribute)

    def replace(self, owner: Any, attribute: str, replacement: Any, why: str = "") -> None:
        """Set ``owner.attribute = replacement`` and remember what was there; ``why``: its line on the patch page."""
        self._set(resolve(owner), attribute, replacement, Entry("", "replaces", why, _maker_module(replacement)))

    def wrap(self, owner: Any, attribute: str, make_wrapper: Callable[[Callable], Callable], why: str = "") -> None:
        """Replace a function by ``make_wrapper(original)`` (``functools.wraps``-ed); no-op when ours; ``why``: its
        line on the patch page."""
        owner = resolve(owner)
        original = self.original(owner, attribute)
        if is_ours(original):
            return
        self._set(owner, attribute, functools.wraps(original)(make_wrapper(original)),
                  Entry("", "wraps", why, _maker_module(make_wrapper)))

    def kernel(self, operator: str, function: Callable, dispatch_key: str = "CPU", why: str = "") -> None:
        """Run ``function`` as torch's ``aten::<operator>`` kernel for ``dispatch_key`` (``torch.library``; the
        operator's other overloads, e.g. ``<operator>.out``, keep torch's kernels); ``why``: its line on the patch
        page."""
        import warnings

        import torch

        if self._kernels is None:
            self._kernels = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # torch says once that it overrides a registered kernel: that is the point
            warnings.simplefilter("ignore", UserWarning)
            self._kernels.impl(operator, function, dispatch_key)
        self._entries.append(Entry(f"torch aten::{operator} ({dispatch_key} kernel)", "replaces", why,
                                   _maker_module(function)))

    def _set(self, owner: Any, attribute: str, replacement: Any, entry: Entry) -> None:
        current = self.original(owner, attribute)
        if isinstance(owner, type) and attribute not in owner.__dict__:
            saved = _INHERITED
        else:
            saved = owner.__dict__[attribute] if isinstance(owner, type) else current
        _mark(replacement, current)
        setattr(owner, attribute, replacement)
        self._applied.append((owner, attribute, saved))
        self._entries.append(dataclasses.replace(entry, target=f"{qualified_name(owner)}.{attribute}"))

    def restore(self) -> None:
        """Put every replaced attribute back (no-op when nothing is replaced)."""
        self._entries.clear()
        if self._kernels is not None:
            self._kernels._destroy()  # torch's own kernels are back
            self._kernels = None
        while self._applied:
            owner, attribute, saved = self._applied.pop()
            if saved is _INHERITED:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, saved)
