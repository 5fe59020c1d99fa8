"""Shims that let megatron-core's pipeline schedules run on CPU (tests, the embedded default).

megatron-core assumes CUDA in four places that a CPU/gloo pipeline run reaches:

1. ``tensor_parallel.random.CudaRNGStatesTracker.add`` / ``.fork`` read and write the
   CUDA generator: replaced by versions that keep CPU generator states.
2. ``pipeline_parallel.schedules`` makes its token counter with
   ``torch.zeros(..., device="cuda")``: the module's ``torch`` is replaced by a proxy
   whose tensor factories map a CUDA device to the CPU.
3. ``pipeline_parallel.p2p_communication`` calls ``torch.cuda.current_device()`` and
   ``torch.cuda.synchronize()``: the same proxy answers ``"cpu"`` and does nothing.
4. ``utils.GlobalMemoryBuffer.get_tensor`` allocates on the current CUDA device:
   replaced by a version that allocates on the CPU.

``apply_cpu_shims()`` installs them only when ``torch.cuda.is_available()`` is False
(returns whether they are active); ``remove_cpu_shims()`` restores the originals
exactly. Both are idempotent. Nothing here runs at import time.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import operator
import types
from functools import reduce

import torch

logger = logging.getLogger(__name__)

_MARKER = "_megatron_tah_cpu_shim"
# (module or class, attribute name, original value), in the order they were applied.
_APPLIED: list[tuple[object, str, object]] = []

_CUDA_DEVICE_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange")


def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True  # a bare index means a CUDA device in torch's factories
    return torch.device(device).type == "cuda"


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` as seen by a shimmed module: current device is the CPU, synchronize is a no-op."""

    def __init__(self):
        super().__init__("torch.cuda (megatron_tah cpu shim)")

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return "cpu"

    @staticmethod
    def synchronize(device=None):
        return None


class _CpuTorch(types.ModuleType):
    """``torch`` as seen by a shimmed module: tensor factories put CUDA requests on the CPU."""

    def __init__(self):
        super().__init__("torch (megatron_tah cpu shim)")
        self.cuda = _CpuCuda()
        for name in _CUDA_DEVICE_FACTORIES:
            setattr(self, name, self._cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _cpu_factory(factory):
        def make(*args, **kwargs):
            if _is_cuda_device(kwargs.get("device")):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        make.__wrapped__ = factory
        return make


# ----- replacements for class methods ----------------------------------------------------
def _tracker_add(self, name, seed):
    """CudaRNGStatesTracker.add on CPU: the named state is a CPU generator state seeded with ``seed``."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise RuntimeError(f"rng seed {seed} already exists")
    if name in self.states_:
        raise RuntimeError(f"rng state {name!r} already exists")
    self.seeds_.add(seed)
    self.states_[name] = torch.Generator().manual_seed(int(seed)).get_state()


@contextlib.contextmanager
def _tracker_fork(self, name="model-parallel-rng"):
    """CudaRNGStatesTracker.fork on CPU: run the block with the CPU generator set to state ``name``."""
    if name not in self.states_:
        raise RuntimeError(f"rng state {name!r} is not added")
    outer = torch.get_rng_state()
    torch.set_rng_state(self.states_[name])
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer)


def _buffer_get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
    """GlobalMemoryBuffer.get_tensor on CPU: a view of a reused CPU buffer."""
    required = reduce(operator.mul, tensor_shape, 1)
    key = (name, dtype)
    if self.buffer.get(key) is None or self.buffer[key].numel() < required:
        self.buffer[key] = torch.empty(required, dtype=dtype, device="cpu", requires_grad=False)
    return self.buffer[key][0:required].view(*tensor_shape)


def _import(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ImportError as err:
        raise RuntimeError(f"megatron_tah cpu shims need {module_name} (megatron-core): {err}") from err


def _targets() -> list[tuple[object, str, object]]:
    """(owner, attribute, replacement) for every shim; raises naming a missing symbol."""
    random = _import("megatron.core.tensor_parallel.random")
    schedules = _import("megatron.core.pipeline_parallel.schedules")
    p2p = _import("megatron.core.pipeline_parallel.p2p_communication")
    utils = _import("megatron.core.utils")
    targets = [
        (getattr(random, "CudaRNGStatesTracker", None), "add", _tracker_add),
        (getattr(random, "CudaRNGStatesTracker", None), "fork", _tracker_fork),
        (schedules, "torch", _CpuTorch()),
        (p2p, "torch", _CpuTorch()),
        (getattr(utils, "GlobalMemoryBuffer", None), "get_tensor", _buffer_get_tensor),
    ]
    for owner, attr, _ in targets:
        if owner is None or not hasattr(owner, attr):
            where = getattr(owner, "__name__", owner)
            raise RuntimeError(f"megatron_tah cpu shims: megatron-core has no {where}.{attr}")
    return targets


def cpu_shims_active() -> bool:
    return bool(_APPLIED)


def apply_cpu_shims(force: bool = False) -> bool:
    """Install the CPU shims when CUDA is absent (or ``force``); returns whether they are active."""
    if _APPLIED:
        return True
    if torch.cuda.is_available() and not force:
        return False
    for owner, attr, replacement in _targets():
        original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        try:
            setattr(replacement, _MARKER, True)
            setattr(replacement, "__wrapped__", original)
        except AttributeError:
            pass  # bound-less functions accept attributes; the proxies too
        setattr(owner, attr, replacement)
        _APPLIED.append((owner, attr, original))
    logger.info("megatron_tah: CPU shims applied to megatron-core (no CUDA device)")
    return True


def remove_cpu_shims() -> None:
    """Restore every shimmed attribute to the exact original object (no-op when not applied)."""
    while _APPLIED:
        owner, attr, original = _APPLIED.pop()
        setattr(owner, attr, original)
