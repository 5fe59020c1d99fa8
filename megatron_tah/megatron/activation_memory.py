"""Tensors saved for backward, stored in a few bits (AGoQ's LAAQ): ``--tah-activation-memory laaq``.

``install(place)`` wraps megatron-core's ``TransformerLayer.forward`` so that each layer's
forward pass runs under ``torch.autograd.graph.saved_tensors_hooks``:

* **pack**: a saved activation -- a plain ``torch.Tensor``, fp32, fp16 or bf16, of at least ``MIN_NUMEL``
  elements, not a parameter (or a view of one) and none of what ``keep_reason`` keeps -- is packed by
  ``pack`` into one uint8 buffer -- blockwise
  asymmetric quantization, one bf16 scale and zero per ``tah_laaq_block_size`` consecutive elements,
  no header (format: ``kernels/laaq.py``) -- at this pipeline stage's bit width
  (``laaq_stage_bits``: bits grow with the stage, since early stages of a 1F1B schedule
  hold more micro-batches). One fused launch on CUDA (``backend`` auto/triton), the torch reference
  (``codecs/core/common``'s quantizer, the same bytes) otherwise; no host sync either way. The
  full-precision tensor is then free to go: it is marked as used by the pack's stream
  (``record_stream``), since it may have been made on another one. Everything else is kept as it is.
* **kept at any size** (``keep_reason``; a few bits would cost accuracy and save little):
  per-token statistics -- 1-D tensors (Transformer Engine's and Apex's layer-norm mean and rsigma,
  ``[s * b]``) and tensors whose last dimension is 1 (torch's layer-norm / RMS-norm mean and rstd,
  ``[s, b, 1]``); tables broadcast over a dimension that need no gradient (the rotary cos/sin,
  ``[s, 1, 1, d]``); anything that is not a plain ``torch.Tensor`` (Transformer Engine's FP8 tensors
  report bf16 while holding bytes and scales, so a ``view`` of them is wrong).
* **CUDA graphs**: hooks are Python that a replayed graph does not run, so a layer whose config asks
  for megatron-core's CUDA graphs (``--cuda-graph-impl``, ``--enable-cuda-graph``,
  ``--external-cuda-graph``) is refused on its first call; a tensor saved while any other capture is
  under way is kept (one warning).
* **unpack** (in backward): one launch back to the original shape and dtype (contiguous).
* **attention's own tensors are kept**: the layer's ``self_attention.core_attention`` (whatever class
  the layer spec chose) runs under hooks that keep what it saves (query, key, value and, unless
  recomputed, the ``[b, heads, s, s]`` scores and probabilities) at full precision; so does
  ``_checkpointed_attention_forward``, where megatron-core's ``--recompute-granularity selective``
  saves only query, key, value and the mask and recomputes the rest in backward. That combination
  is the intended one: without it, the ``s x s`` tensors dominate what a layer saves at long
  sequences (``docs/PERFORMANCE.md``, LAAQ); a run without recomputation logs a warning once. Both
  wrappers are installed on the first layer call.
* Not applied while autograd recomputes inside backward (activation recomputation), or when
  gradients are off (nothing is saved).

Memory accounting (this rank), a counter per pack and per release, no host sync, no per-tensor
table: ``raw`` counts what the saved tensors span without LAAQ (``numel * element_size`` of every
tensor handed to autograd: a tensor saved by two operations counts twice, a view counts its own
elements), ``stored`` what is held (kept tensors so counted, plus the quantized buffers); parameters
are not counted. A release is counted when autograd drops the packed object. ``peaks(reset)``
returns the peaks since the last reset, and is the statistics' memory source
(``place.stats.memory_source``: ``saved_memory``). With ``place.state["quantize"] = False`` the hooks
only measure (used to compare with LAAQ off).
Not done: recomputing norms and activation functions instead of storing their inputs (AGoQ's other
memory saving); quantizing attention probabilities instead of recomputing them.
"""

from __future__ import annotations

import logging
import math
import threading

import torch

from ..codecs import Codec, CodecError, get_codec
from ..codecs.core import common
from ..codecs.core.errors import SUPPORTED_DTYPES
from ..config.fields import parsed
from ..kernels import HAVE_TRITON
from ..kernels import laaq as kernels
from .place_spec import PlaceSpec, direction

LAYER = "megatron.core.transformer.transformer_layer:TransformerLayer"
MIN_NUMEL = 4096  # smaller saved tensors are kept: a launch per tensor would cost more than it saves

logger = logging.getLogger(__name__)


# ----- the quantizer: one buffer per tensor -----------------------------------------------------------
def _use_triton(backend: str, device: torch.device) -> bool:
    if backend == "torch":
        return False
    if backend == "triton":
        return True
    return device.type == "cuda" and HAVE_TRITON


def pack(x: torch.Tensor, bits: int, block: int, backend: str = "auto") -> torch.Tensor:
    """``x`` (fp32/fp16/bf16, any layout) as a uint8 buffer of ``kernels.laaq.nbytes(x.numel(), bits, block)``
    bytes (format: ``kernels/laaq.py``). ``backend``: auto (Triton on CUDA), torch or triton."""
    x = x.detach().contiguous()
    if _use_triton(backend, x.device):
        return kernels.triton_laaq_pack(x, bits, block)
    tiles, bad = common.to_tiles(x.reshape(1, -1), block)
    codes, scale, zero = common.quantize_tiles(tiles, 2**bits - 1, bad)
    return torch.cat([scale.reshape(-1).view(torch.uint8), zero.reshape(-1).view(torch.uint8),
                      common.pack_bits(codes, bits)])


def unpack(buf: torch.Tensor, shape, dtype: torch.dtype, bits: int, block: int, backend: str = "auto") -> torch.Tensor:
    """Inverse of ``pack``: a new contiguous tensor of ``shape`` and ``dtype``."""
    if _use_triton(backend, buf.device):
        return kernels.triton_laaq_unpack(buf, shape, dtype, bits, block)
    numel = math.prod(shape)
    views = kernels.sections(buf, numel, bits, block)
    blocks = views["scale"].numel() // 2
    codes = common.unpack_bits(views["codes"], bits, blocks * block).reshape(blocks, block)
    values = common.dequantize_tiles(codes, views["scale"].view(torch.bfloat16), views["zero"].view(torch.bfloat16))
    return common.from_tiles(values, (1, numel), dtype).view(shape)


# ----- accounting ----------------------------------------------------------------------------------
class SavedTensorMemory:
    """Live and peak bytes of the tensors saved for backward inside transformer layers.

    ``peaks()`` reports the peak of what was held (``stored_bytes``) with its make-up at that
    moment -- ``kept_bytes`` (full-precision tensors) and ``quantized_raw_bytes`` /
    ``quantized_bytes`` (the quantized tensors before / after) -- and the peak of what would have
    been held without quantization (``raw_bytes``).
    """

    def __init__(self, bits: int = 0):
        self.bits = bits
        self._lock = threading.RLock()  # re-entrant: a garbage collection inside ``add`` may release a tensor
        self._kept = self._quantized_raw = self._quantized = 0
        self._at_peak = (0, 0, 0)  # (kept, quantized_raw, quantized) when stored peaked
        self._peak_raw = 0

    def add(self, kept: int, quantized_raw: int, quantized: int) -> None:
        with self._lock:
            self._kept += kept
            self._quantized_raw += quantized_raw
            self._quantized += quantized
            raw = self._kept + self._quantized_raw
            if raw > self._peak_raw:
                self._peak_raw = raw
            at = self._at_peak
            if self._kept + self._quantized > at[0] + at[2]:
                self._at_peak = (self._kept, self._quantized_raw, self._quantized)

    def remove(self, kept: int, quantized_raw: int, quantized: int) -> None:
        with self._lock:
            self._kept -= kept
            self._quantized_raw -= quantized_raw
            self._quantized -= quantized

    def peaks(self, reset: bool = True) -> dict:
        """``{"bits", "raw_bytes", "stored_bytes", "kept_bytes", "quantized_raw_bytes", "quantized_bytes"}``
        since the last reset (a reset restarts the peaks at the live values)."""
        with self._lock:
            kept, quantized_raw, quantized = self._at_peak
            result = {"bits": self.bits, "raw_bytes": self._peak_raw, "stored_bytes": kept + quantized,
                      "kept_bytes": kept, "quantized_raw_bytes": quantized_raw, "quantized_bytes": quantized}
            if reset:
                self._at_peak = (self._kept, self._quantized_raw, self._quantized)
                self._peak_raw = self._kept + self._quantized_raw
        return result


class _Quantized:
    """A packed saved tensor: its buffer, what ``unpack`` needs, and its bytes (released on deletion)."""

    __slots__ = ("buf", "shape", "dtype", "raw", "memory")

    def __init__(self, buf, shape, dtype, raw, memory):
        self.buf, self.shape, self.dtype, self.raw, self.memory = buf, shape, dtype, raw, memory
        memory.add(0, raw, buf.numel())

    def __del__(self):
        self.memory.remove(0, self.raw, self.buf.numel())


class _Kept:
    """A saved tensor kept as it is, counted while autograd holds it."""

    __slots__ = ("tensor", "nbytes", "memory")

    def __init__(self, tensor, memory):
        self.tensor, self.nbytes, self.memory = tensor, tensor.numel() * tensor.element_size(), memory
        memory.add(self.nbytes, 0, 0)

    def __del__(self):
        self.memory.remove(self.nbytes, 0, 0)


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


def keep_reason(t: torch.Tensor) -> str | None:
    """Why LAAQ keeps ``t`` (a saved tensor, not a parameter) at full precision, or None: it is packed.

    Decided from the tensor alone, so at every sequence length and batch size: statistics have as many
    elements as tokens (``MIN_NUMEL`` alone keeps them only while ``s * b`` is small)."""
    if type(t) is not torch.Tensor:
        return f"{type(t).__name__}: not a plain tensor (its dtype need not describe its bytes)"
    if t.dtype not in SUPPORTED_DTYPES:
        return f"{t.dtype}: not a floating-point activation"
    if t.numel() < MIN_NUMEL:
        return f"{t.numel()} elements < {MIN_NUMEL}"
    if t.dim() <= 1:
        return "1-D: per-token statistics (layer-norm mean/rsigma of Transformer Engine or Apex) or a bias"
    if t.shape[-1] == 1:
        return f"shape {tuple(t.shape)}: per-token statistics (torch's layer-norm / RMS-norm mean and rstd)"
    if not t.requires_grad and t.grad_fn is None and 1 in t.shape[:-1]:
        return f"shape {tuple(t.shape)}: a table broadcast over a dimension, no gradient (rotary cos/sin)"
    return None


def _capturing(t: torch.Tensor, place) -> bool:
    """Whether ``t``'s pack would be recorded into a CUDA graph (warned once per place): kept then."""
    if not t.is_cuda or not torch.cuda.is_current_stream_capturing():
        return False
    if not place.state.get("warned_capture"):
        place.state["warned_capture"] = True
        logger.warning("megatron_tah: LAAQ keeps tensors saved during a CUDA graph capture at full precision "
                       "(its hooks would run at capture only, not at each replay)")
    return True


def _hooks(place, quantize: bool):
    memory: SavedTensorMemory = place.state["memory"]
    bits, block, backend = memory.bits, place.config.tah_laaq_block_size, place.config.tah_backend

    def pack_hook(t):
        if _is_parameter(t):
            return t
        if quantize and keep_reason(t) is None and not _capturing(t, place):
            with torch.no_grad():
                if t.is_cuda:  # made on any stream, read by the pack on this one: not reused before that
                    t.record_stream(torch.cuda.current_stream(t.device))
                buf = pack(t, bits, block, backend)
            return _Quantized(buf, t.shape, t.dtype, t.numel() * t.element_size(), memory)
        return _Kept(t, memory)

    def unpack_hook(packed):
        if isinstance(packed, _Quantized):
            with torch.no_grad():
                return unpack(packed.buf, packed.shape, packed.dtype, bits, block, backend)
        if isinstance(packed, _Kept):
            return packed.tensor
        return packed

    return pack_hook, unpack_hook


def _stage_setup(place, layer) -> None:
    """This rank's pipeline stage's bits (on the first layer call: parallel state is up by then)."""
    if place.state.get("ready"):
        return
    from megatron.core import parallel_state

    _refuse_cuda_graphs(getattr(layer, "config", None))
    if getattr(getattr(layer, "config", None), "recompute_granularity", None) is None:
        logger.warning("megatron_tah: LAAQ keeps the core attention's saved tensors at full precision (with unfused "
                       "attention, [b, heads, s, s] each); --recompute-granularity selective recomputes them instead")

    stage, stages = 0, 1
    if parallel_state.model_parallel_is_initialized():
        stage = parallel_state.get_pipeline_model_parallel_rank()
        stages = parallel_state.get_pipeline_model_parallel_world_size()
    place.state["memory"].bits = laaq_stage_bits(place.config, stage, stages)
    place.state["ready"] = True


def _refuse_cuda_graphs(config) -> None:
    """megatron-core's CUDA graphs replay a layer without running Python: LAAQ's hooks would pack at capture
    only (and count memory once). Refused, naming the flags."""
    impl = getattr(config, "cuda_graph_impl", "none") or "none"
    asked = [f"--cuda-graph-impl {impl}"] if impl != "none" else []
    asked += [f"--{name.replace('_', '-')}" for name in ("enable_cuda_graph", "external_cuda_graph")
              if getattr(config, name, False)]
    if asked:
        raise ValueError(f"--tah-activation-memory laaq cannot run with megatron-core's CUDA graphs "
                         f"({', '.join(asked)}): its saved-tensor hooks run in Python at each forward, "
                         "which a replayed graph skips")


def _saving(place, quantize):
    """A wrapper factory: run ``forward`` under the hooks (``quantize`` a callable: read per call)."""
    def make(original):
        def forward(self, *args, **kwargs):
            if not torch.is_grad_enabled() or direction() == "backward":
                return original(self, *args, **kwargs)
            _stage_setup(place, self)
            if quantize():
                attention = getattr(self, "self_attention", None)
                core = getattr(attention, "core_attention", None)
                if core is not None:  # once per class (marker)
                    place.patches.wrap(type(core), "forward", _saving(place, lambda: False),
                                       why="the attention core keeps its inputs as they are (LAAQ)")
                if hasattr(attention, "_checkpointed_attention_forward"):
                    place.patches.wrap(type(attention), "_checkpointed_attention_forward",
                                       _saving(place, lambda: False),
                                       why="recomputed attention keeps its inputs as they are (LAAQ)")
            pack_hook, unpack_hook = _hooks(place, quantize=quantize())
            with torch.autograd.graph.saved_tensors_hooks(pack_hook, unpack_hook):
                return original(self, *args, **kwargs)

        return forward

    return make


def install(place) -> None:
    """Store what transformer layers save for backward in ``laaq`` form, and measure it."""
    place.state.setdefault("quantize", True)
    place.state["memory"] = SavedTensorMemory()
    place.patches.wrap(LAYER, "forward", _saving(place, lambda: place.state["quantize"]),
                       why="store what the layer saves for backward in low-bit blocks (LAAQ)")
    place.stats.memory_source = place.state["memory"].peaks


def uninstall(place) -> None:
    place.stats.memory_source = None


def settings(config) -> str:
    """The settings every rank must share: ``laaq(bits=..., block_size=...)``."""
    return f"{config.tah_activation_memory}(bits={config.tah_laaq_bits}, block_size={config.tah_laaq_block_size})"


def laaq_stage_bits(config, stage: int, stages: int) -> int:
    """Bits of stored activations on pipeline stage ``stage`` of ``stages``: entry floor(stage * n / stages) of
    the n in ``tah_laaq_bits``."""
    bits = parsed(config, "tah_laaq_bits")
    return bits[stage * len(bits) // stages]


def laaq_codec(config, stage: int, stages: int) -> Codec:
    """A codec storing as stage ``stage`` of ``stages`` stores saved tensors (fixed point, one block per tile: the
    options ``check`` validates)."""
    return get_codec("fixedpoint", bits=laaq_stage_bits(config, stage, stages), tile_size=config.tah_laaq_block_size,
                     backend=config.tah_backend, checksum=False)


def check(config) -> None:
    """``ValueError`` naming ``tah_laaq_block_size`` when the quantizer cannot take it (the place on or off)."""
    try:
        laaq_codec(config, 0, 1)
    except CodecError as err:
        raise ValueError(f"tah_laaq_block_size = {config.tah_laaq_block_size}: {err}") from None


PLACE = PlaceSpec(name="activation_memory", option="tah_activation_memory", install=install, settings=settings,
                  uninstall=uninstall, check=check)
