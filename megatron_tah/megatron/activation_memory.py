"""Tensors saved for backward, stored in a few bits (AGoQ's LAAQ): ``--tah-activation-memory laaq``.

``install(place)`` wraps megatron-core's ``TransformerLayer.forward`` so that each layer's
forward pass runs under ``torch.autograd.graph.saved_tensors_hooks``:

* **pack**: a floating-point tensor of at least ``MIN_NUMEL`` elements that is not a parameter
  (or a view of one) is flattened and encoded with the ``fixedpoint`` codec -- asymmetric
  blockwise quantization, one bf16 scale and zero per block of ``tah_laaq_block_size``
  consecutive elements -- at this pipeline stage's bit width (``TahConfig.laaq_stage_bits``:
  bits grow with the stage, since early stages of a 1F1B schedule hold more micro-batches);
  the full-precision tensor is then free to go. Everything else is kept as it is.
* **unpack** (in backward): decodes to the original shape and dtype.
* **attention inputs are kept**: the layer's ``self_attention.core_attention`` (whatever class the
  layer spec chose) runs under hooks that keep its saved tensors (query, key, value, scores,
  probabilities) at full precision. Its class's ``forward`` is wrapped on the first layer call.
* Not applied while autograd recomputes a layer inside backward (activation recomputation), or
  when gradients are off (nothing is saved).

Memory accounting (this rank): every tensor the hooks hand to autograd is tracked until autograd
drops it. ``raw`` counts what would have been held without LAAQ (distinct storages of kept
tensors, ``numel * element_size`` of quantized ones), ``stored`` what is held (kept storages plus
the codec buffers); parameters are not counted. ``peaks(reset)`` returns the peaks since the last
reset, and is the statistics' memory source (``place.stats.memory_source``: ``saved_memory``). With
``place.state["quantize"] = False`` the hooks only measure (used to compare with LAAQ off).
Not done: recomputing norms and activation functions instead of storing their inputs (AGoQ's
other memory saving), Triton kernels for this path (it uses the codec's; ``fixedpoint`` has them).
"""

from __future__ import annotations

import math
import threading
import weakref

import torch

from ..codecs.base import SUPPORTED_DTYPES
from .places import direction

LAYER = "megatron.core.transformer.transformer_layer:TransformerLayer"
MIN_NUMEL = 4096  # smaller saved tensors (norm statistics, masks) are kept


class SavedTensorMemory:
    """Live and peak bytes of the tensors saved for backward inside transformer layers.

    ``peaks()`` reports the peak of what was held (``stored_bytes``) with its make-up at that
    moment -- ``kept_bytes`` (full-precision storages) and ``quantized_raw_bytes`` /
    ``quantized_bytes`` (the quantized tensors before / after) -- and the peak of what would have
    been held without quantization (``raw_bytes``).
    """

    def __init__(self, bits: int = 0):
        self.bits = bits
        self._lock = threading.Lock()
        self._storages: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self._live = {"kept": 0, "quantized_raw": 0, "quantized": 0}
        self._at_peak = dict(self._live)
        self._peak_raw = 0

    def _change(self, sign: int, kept: int = 0, quantized_raw: int = 0, quantized: int = 0) -> None:
        with self._lock:
            live = self._live
            live["kept"] += sign * kept
            live["quantized_raw"] += sign * quantized_raw
            live["quantized"] += sign * quantized
            if sign > 0:
                self._peak_raw = max(self._peak_raw, live["kept"] + live["quantized_raw"])
                if live["kept"] + live["quantized"] > self._at_peak["kept"] + self._at_peak["quantized"]:
                    self._at_peak = dict(live)

    def track_quantized(self, packed, raw: int, stored: int) -> None:
        self._change(+1, quantized_raw=raw, quantized=stored)
        weakref.finalize(packed, self._change, -1, 0, raw, stored)

    def track_kept(self, packed, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        with self._lock:
            entry = self._storages.setdefault(key, [0, nbytes])
            entry[0] += 1
            first = entry[0] == 1
        if first:
            self._change(+1, kept=nbytes)
        weakref.finalize(packed, self._release, key)

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._storages[key]
            entry[0] -= 1
            if entry[0]:
                return
            del self._storages[key]
        self._change(-1, kept=entry[1])

    def peaks(self, reset: bool = True) -> dict:
        """``{"bits", "raw_bytes", "stored_bytes", "kept_bytes", "quantized_raw_bytes", "quantized_bytes"}``
        since the last reset (a reset restarts the peaks at the live values)."""
        with self._lock:
            at = self._at_peak
            result = {"bits": self.bits, "raw_bytes": self._peak_raw, "stored_bytes": at["kept"] + at["quantized"],
                      "kept_bytes": at["kept"], "quantized_raw_bytes": at["quantized_raw"],
                      "quantized_bytes": at["quantized"]}
            if reset:
                self._at_peak = dict(self._live)
                self._peak_raw = self._live["kept"] + self._live["quantized_raw"]
        return result


class _Quantized:
    __slots__ = ("buf", "shape", "dtype", "__weakref__")

    def __init__(self, buf, shape, dtype):
        self.buf, self.shape, self.dtype = buf, shape, dtype


class _Kept:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


def _hooks(place, quantize: bool):
    memory: SavedTensorMemory = place.state["memory"]
    codec = place.state["codec"]

    def pack(t):
        if _is_parameter(t):
            return t
        if quantize and t.dtype in SUPPORTED_DTYPES and t.numel() >= MIN_NUMEL:
            with torch.no_grad():
                packed = _Quantized(codec.encode(t.detach().reshape(-1)), t.shape, t.dtype)
            memory.track_quantized(packed, t.numel() * t.element_size(), packed.buf.numel())
            return packed
        packed = _Kept(t)
        memory.track_kept(packed, t)
        return packed

    def unpack(packed):
        if isinstance(packed, _Quantized):
            with torch.no_grad():
                return codec.decode(packed.buf, (math.prod(packed.shape),), packed.dtype).view(packed.shape)
        if isinstance(packed, _Kept):
            return packed.tensor
        return packed

    return pack, unpack


def _stage_setup(place) -> None:
    """Bits and codec for this rank's pipeline stage (on the first layer call: parallel state is up by then)."""
    if "codec" in place.state:
        return
    from megatron.core import parallel_state

    stage, stages = 0, 1
    if parallel_state.model_parallel_is_initialized():
        stage = parallel_state.get_pipeline_model_parallel_rank()
        stages = parallel_state.get_pipeline_model_parallel_world_size()
    place.state["codec"] = place.config.laaq_codec(stage, stages)
    place.state["memory"].bits = place.config.laaq_stage_bits(stage, stages)


def _keeping(place):
    def make(original):
        def forward(self, *args, **kwargs):
            pack, unpack = _hooks(place, quantize=False)
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return original(self, *args, **kwargs)

        return forward

    return make


def _quantizing(place):
    def make(original):
        def forward(self, *args, **kwargs):
            if not torch.is_grad_enabled() or direction() == "backward":
                return original(self, *args, **kwargs)
            _stage_setup(place)
            core = getattr(getattr(self, "self_attention", None), "core_attention", None)
            if core is not None:
                place.patches.wrap(type(core), "forward", _keeping(place))  # once per class (marker)
            pack, unpack = _hooks(place, quantize=place.state["quantize"])
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return original(self, *args, **kwargs)

        return forward

    return make


def install(place) -> None:
    """Store what transformer layers save for backward in ``laaq`` form, and measure it."""
    place.state.setdefault("quantize", True)
    place.state["memory"] = SavedTensorMemory()
    place.patches.wrap(LAYER, "forward", _quantizing(place))
    place.stats.memory_source = place.state["memory"].peaks


def uninstall(place) -> None:
    place.stats.memory_source = None
