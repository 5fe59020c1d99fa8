"""Shared Triton building blocks and the launch machinery of the codec kernels.

**Tile blocks.** A program holds ``BT`` tiles of ``G`` channels as a ``[H, BT, C, 8]`` block:
the tile's channel ``j = c * E + h * 8 + l`` sits in lane ``c`` of the tile's ``C = G / E``
lanes, in that lane's register vector ``h`` (``H = E / 8`` vectors of 8). The load's pointer
arithmetic alone makes Triton give every lane ``E`` channels of one tile as ``E / 8`` 16-byte
vectors (the fastest dim, ``l``, is contiguous; lanes go to ``c`` first, then to tiles), so a
tile's reductions, butterflies and bit packing stay in registers, with ``log2(C)``
cross-lane steps at most. ``E = G`` (one lane per tile) is the default up to ``G = 64``.

**Exactness.** Every helper performs the fp32 operations of its torch twin in
``codecs/core/common.py`` in the same order: sums as explicit pairwise trees (never ``tl.sum``,
whose order differs between the compiler and the interpreter), rounding to integers by the
``1.5 * 2^23`` trick (ties to even), reciprocal multiplies, no fused multiply-adds (the
launchers pass ``enable_fp_fusion=False``; where a product is exact an FMA is harmless).
So the kernels write the reference's bytes, compiled or interpreted.

**Launches.** Launchers call ``launch``; inside ``recording()`` nothing runs and every launch
(kernel, grid, arguments, constexprs, elements per program) is recorded instead, which is how
``scripts/kernel_report.py`` compiles exactly what the launchers would run, on meta tensors and
without a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import torch

from .. import geometry

try:  # pragma: no cover - exercised by the import itself
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAVE_TRITON = False

INDEX32_LIMIT = 2**31 - 2**20  # offsets below this stay in int32 (with headroom for in-kernel sums)
DEFAULT_WARPS = 4


def require_triton(what: str) -> None:
    """Raise ``RuntimeError`` naming ``what`` when Triton cannot be imported."""
    if not HAVE_TRITON:
        raise RuntimeError(f"{what} needs triton (pip install triton), which is not importable here")


def is_interpreted(kernel) -> bool:
    """True when ``kernel`` runs through Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(kernel).__name__ == "InterpretedFunction"


def _probe():  # the smallest function triton.jit accepts, to ask which kind of kernel it builds
    pass


@functools.cache
def interpreter_active() -> bool:
    """True when Triton was imported with TRITON_INTERPRET=1 (kernels then run on CPU tensors)."""
    if not HAVE_TRITON:
        return False
    return is_interpreted(triton.jit(_probe))


def kernel_device() -> str | None:
    """Device the kernels can run on here: "cpu" (interpreter), "cuda", or None (then see ``why_no_kernels``)."""
    if interpreter_active():
        return "cpu"
    if HAVE_TRITON and torch.cuda.is_available():
        return "cuda"
    return None


def why_no_kernels() -> str:
    """Why ``kernel_device()`` is None, for skip messages."""
    if not HAVE_TRITON:
        return "triton is not installed"
    return "Triton kernels need a CUDA GPU, or TRITON_INTERPRET=1 set before triton is imported (make test sets it)"


# ----- launching and recording ---------------------------------------------------------------------
@dataclasses.dataclass
class Launch:
    """One kernel launch as a launcher builds it."""

    label: str
    kernel: object
    grid: tuple
    args: tuple
    kwargs: dict
    elements: int  # tensor elements one program handles (for instructions per element); with loops, one iteration's
    loops: bool = False  # the kernel loops over its elements by design (its count per element is its loop body's)


@dataclasses.dataclass
class _Recorder:
    capability: int
    launches: list


_RECORDER: _Recorder | None = None


@contextlib.contextmanager
def recording(capability: int = 90):
    """Record launches instead of running them, as if on a GPU of compute ``capability`` (e.g. 90, 80).

    Yields the list the launches are appended to. Launchers then accept tensors on any device
    (``meta`` included); nothing is read or written.
    """
    global _RECORDER
    previous, _RECORDER = _RECORDER, _Recorder(capability, [])
    try:
        yield _RECORDER.launches
    finally:
        _RECORDER = previous


def recording_active() -> bool:
    """True inside ``recording()``: launchers then block for the compiled kernels even under the interpreter."""
    return _RECORDER is not None


def launch(label: str, kernel, grid: tuple, args: tuple, kwargs: dict, elements: int, loops: bool = False) -> None:
    """Run ``kernel[grid](*args, **kwargs)``, or record it inside ``recording()`` (``elements``: what one program
    handles, or one iteration of its loop when it ``loops`` over its elements)."""
    if _RECORDER is not None:
        _RECORDER.launches.append(Launch(label, kernel, tuple(grid), tuple(args), dict(kwargs), int(elements),
                                         bool(loops)))
        return
    if is_interpreted(kernel):
        import numpy as np

        # Bad tiles (NaN, Inf) make NaN on the way; their results are masked, as on a GPU, where
        # nothing warns. numpy would warn for every one.
        with np.errstate(all="ignore"):
            kernel[grid](*args, **kwargs)
        return
    kernel[grid](*args, **kwargs)


def check_launch(kernel, what: str, *tensors) -> None:
    """Raise unless the tensors can be handed to ``kernel``: CUDA tensors, or any tensor under the interpreter."""
    require_triton(what)
    if _RECORDER is not None or is_interpreted(kernel):
        return
    for tensor in tensors:
        if tensor.device.type != "cuda":
            raise RuntimeError(
                f"{what}: the Triton path needs CUDA tensors (got {tensor.device}); set TRITON_INTERPRET=1 "
                "before importing triton to run it on CPU, or use backend='torch'"
            )


def native_conversions(kernel, device: torch.device) -> tuple[bool, bool]:
    """(hardware fp32->bf16 rounding, hardware fp8 E4M3 conversions) for launches on ``device``.

    The interpreter's bf16 cast truncates and it has no fp8, so it gets the bit-exact software
    versions; compiled kernels round in hardware (ties to even, like torch), fp8 from sm_89.
    """
    if _RECORDER is not None:
        return True, _RECORDER.capability >= 89
    if is_interpreted(kernel):
        return False, False
    major, minor = torch.cuda.get_device_capability(device)
    return True, major * 10 + minor >= 89


@dataclasses.dataclass(frozen=True)
class Blocking:
    """How a launch cuts tiles into programs: ``[H, BT, C, 8]`` blocks (see the module docstring)."""

    tile_size: int  # G
    per_lane: int  # E, channels of a tile in one lane
    tiles: int  # BT, tiles per program
    num_warps: int

    @property
    def lanes(self) -> int:
        return self.tile_size // self.per_lane

    @property
    def elements(self) -> int:
        return self.tiles * self.tile_size

    def programs(self, n_tiles: int) -> int:
        return geometry.cdiv(n_tiles, self.tiles)


def blocking(kernel, tile_size: int, per_lane: int | None = None, tiles: int | None = None,
             num_warps: int = DEFAULT_WARPS, widest: int = 64) -> Blocking:
    """The block shape for ``kernel``: ``per_lane`` channels per lane (default ``min(G, widest)``) and
    one tile per ``G / per_lane`` lanes, or ``tiles`` per program (a power of two) when given.
    Under the interpreter, where a program's cost is its count, ~64K elements per program."""
    e = min(tile_size, widest) if per_lane is None else per_lane
    if e < 8 or tile_size % e or e & (e - 1):
        raise ValueError(f"channels per lane must be a power of two in [8, {tile_size}], got {e}")
    if tiles is None:
        if is_interpreted(kernel) and _RECORDER is None:
            tiles = max(1, (1 << 16) // tile_size)
        else:
            tiles = 32 * num_warps * e // tile_size
    if tiles < 1 or tiles & (tiles - 1):
        raise ValueError(f"tiles per program must be a power of two, got {tiles}")
    return Blocking(tile_size, e, tiles, num_warps)


@functools.cache
def block_flip() -> bool:
    """Which arrangement of a block's pointers makes Triton give every lane ``E`` channels of one tile.

    Triton's coalescing orders dims of equal contiguity by index, ascending up to 3.6 and descending
    from 3.7 (checked by compiling both): the kernels build ``[H, BT, C, 8]`` pointers for the
    latter, ``[C, BT, H, 8]`` (FLIP) for the former, and compute on ``[H, BT, C, 8]`` either way.
    """
    if not HAVE_TRITON:
        return False
    major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    return (major, minor) < (3, 7)


def index_is_64bit(*counts: int) -> bool:
    """True when offsets up to ``max(counts)`` (elements or bytes) do not fit the kernels' int32 math."""
    return max(counts) >= INDEX32_LIMIT


def as_kernel_input(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``x`` as the kernels load it: bf16 behind an int16 view (converted on the bits), else itself."""
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16), True
    return x, False


def as_kernel_output(out: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``out`` as the kernels store it, and its OUT_KIND (0 fp32, 1 fp16, 2 bf16 as int16 bits)."""
    if out.dtype == torch.bfloat16:
        return out.view(torch.int16), 2
    if out.dtype == torch.float16:
        return out, 1
    if out.dtype == torch.float32:
        return out, 0
    raise ValueError(f"kernels write float32, float16 or bfloat16, got {out.dtype}")


def store_units(bits: int) -> tuple[int, int]:  # (at most 7 pieces: the kernels unroll up to 7)
    """(bytes per store, stores per group of 8 codes) for codes packed at ``bits`` bits."""
    unit = 4 if bits % 4 == 0 else 2 if bits % 2 == 0 else 1
    return unit, bits // unit


def int_dtype(nbytes: int) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32}[nbytes]


def as_units(section: torch.Tensor, unit: int) -> torch.Tensor:
    """A wire section (1-D uint8, 8-byte aligned) viewed as ``unit``-byte integers."""
    return section.view(int_dtype(unit))


def sections_nbytes(sections: dict[str, torch.Tensor]) -> int:
    """Bytes of the largest section: the kernels index each section from its own start."""
    return max(s.numel() for s in sections.values())


def next_power_of_2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def check_header(buf: torch.Tensor, expected: torch.Tensor, errors: torch.Tensor) -> None:
    """Add 1 to ``errors`` (int32, 0-d) when ``buf`` does not start with the 16 bytes ``expected``; no host sync."""
    check_launch(header_check_kernel, "check_header", buf)
    launch("header_check", header_check_kernel, (1,), (buf, expected, errors), dict(N=int(expected.numel())), 0)


if HAVE_TRITON:

    @triton.jit
    def header_check_kernel(buf_ptr, expected_ptr, errors_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        differ = tl.max((tl.load(buf_ptr + i) != tl.load(expected_ptr + i)).to(tl.int32), axis=0)
        tl.atomic_add(errors_ptr, differ, mask=differ > 0)

    # ----- block geometry ------------------------------------------------------------------------
    @triton.jit
    def channels_kernel(H: tl.constexpr, C: tl.constexpr):
        """Channel index ``j = c * E + h * 8 + l`` of each element of a ``[H, 1, C, 8]`` block."""
        h = tl.arange(0, H)[:, None, None, None]
        c = tl.arange(0, C)[None, None, :, None]
        lane = tl.arange(0, 8)[None, None, None, :]
        return c * (H * 8) + h * 8 + lane

    @triton.jit
    def tile_ids_kernel(BT: tl.constexpr, INDEX64: tl.constexpr):
        """The ``BT`` tile indices of this program (int64 when INDEX64)."""
        pid = tl.program_id(0)
        if INDEX64:
            pid = pid.to(tl.int64)
        return pid * BT + tl.arange(0, BT)

    @triton.jit
    def arrange_kernel(x, FLIP: tl.constexpr):
        """Swap the first and third dims of a block (``[H, BT, C, 8]`` <-> ``[C, BT, H, 8]``, or the 3-D
        ``[H, BT, C]`` of groups) when FLIP: the order loads and stores are laid out in (see ``block_flip``)."""
        if FLIP:
            if len(x.shape) == 4:
                return tl.permute(x, [2, 1, 0, 3])
            else:
                return tl.permute(x, [2, 1, 0])
        else:
            return x

    @triton.jit
    def load_block_raw_kernel(ptr, mask, other, FLIP: tl.constexpr):
        """``tl.load`` of a block, its pointers laid out so that Triton gives each lane a tile's channels."""
        return arrange_kernel(tl.load(arrange_kernel(ptr, FLIP), mask=arrange_kernel(mask, FLIP), other=other), FLIP)

    @triton.jit
    def store_block_raw_kernel(ptr, value, mask, FLIP: tl.constexpr):
        tl.store(arrange_kernel(ptr, FLIP), arrange_kernel(value, FLIP), mask=arrange_kernel(mask, FLIP))

    @triton.jit
    def bcast_kernel(v):
        """A per-tile ``[BT]`` value broadcast against a ``[H, BT, C, 8]`` block."""
        return v[None, :, None, None]

    @triton.jit
    def tile_max_kernel(x):
        return tl.max(tl.max(tl.max(x, axis=3), axis=0), axis=1)

    @triton.jit
    def tile_min_kernel(x):
        return tl.min(tl.min(tl.min(x, axis=3), axis=0), axis=1)

    @triton.jit
    def halve_h_kernel(x, N: tl.constexpr, BT: tl.constexpr, C: tl.constexpr):
        """``[N, BT, C]`` -> ``[N/2, BT, C]``: sum of register vectors ``2i`` and ``2i + 1``."""
        a, b = tl.split(tl.permute(tl.reshape(x, [N // 2, 2, BT, C]), [0, 2, 3, 1]))
        return a + b

    @triton.jit
    def halve_c_kernel(x, N: tl.constexpr, BT: tl.constexpr):
        """``[BT, N]`` -> ``[BT, N/2]``: sum of lanes ``2i`` and ``2i + 1``."""
        a, b = tl.split(tl.reshape(x, [BT, N // 2, 2]))
        return a + b

    @triton.jit
    def tile_tree_sum_kernel(x, H: tl.constexpr, BT: tl.constexpr, C: tl.constexpr):
        """Per-tile sum of a ``[H, BT, C, 8]`` block in ``common.tree_sum``'s order (channel bit 0 first)."""
        a, b = tl.split(tl.reshape(x, [H, BT, C, 4, 2]))
        x = a + b
        a, b = tl.split(tl.reshape(x, [H, BT, C, 2, 2]))
        x = a + b
        a, b = tl.split(x)  # [H, BT, C]
        x = a + b
        if H >= 16:
            x = halve_h_kernel(x, 16, BT, C)
        if H >= 8:
            x = halve_h_kernel(x, 8, BT, C)
        if H >= 4:
            x = halve_h_kernel(x, 4, BT, C)
        if H >= 2:
            x = halve_h_kernel(x, 2, BT, C)
        x = tl.reshape(x, [BT, C])
        if C >= 16:
            x = halve_c_kernel(x, 16, BT)
        if C >= 8:
            x = halve_c_kernel(x, 8, BT)
        if C >= 4:
            x = halve_c_kernel(x, 4, BT)
        if C >= 2:
            x = halve_c_kernel(x, 2, BT)
        return tl.reshape(x, [BT])

    # ----- the Walsh-Hadamard transform ----------------------------------------------------------
    @triton.jit
    def butterfly_l_kernel(x, S: tl.constexpr, H: tl.constexpr, BT: tl.constexpr, C: tl.constexpr):
        """Butterfly of stride S (1, 2, 4) within the 8-vectors: ``(a, b) -> (a + b, a - b)``."""
        y = tl.permute(tl.reshape(x, [H, BT, C, 8 // (2 * S), 2, S]), [0, 1, 2, 3, 5, 4])
        a, b = tl.split(y)
        y = tl.permute(tl.join(a + b, a - b), [0, 1, 2, 3, 5, 4])
        return tl.reshape(y, [H, BT, C, 8])

    @triton.jit
    def butterfly_h_kernel(x, S: tl.constexpr, H: tl.constexpr, BT: tl.constexpr, C: tl.constexpr):
        """Butterfly of stride ``8 * S`` across a lane's register vectors."""
        y = tl.permute(tl.reshape(x, [H // (2 * S), 2, S, BT, C, 8]), [0, 2, 3, 4, 5, 1])
        a, b = tl.split(y)
        y = tl.permute(tl.join(a + b, a - b), [0, 5, 1, 2, 3, 4])
        return tl.reshape(y, [H, BT, C, 8])

    @triton.jit
    def butterfly_c_kernel(x, S: tl.constexpr, H: tl.constexpr, BT: tl.constexpr, C: tl.constexpr):
        """Butterfly of stride ``E * S`` across the lanes of a tile."""
        y = tl.permute(tl.reshape(x, [H, BT, C // (2 * S), 2, S, 8]), [0, 1, 2, 4, 5, 3])
        a, b = tl.split(y)
        y = tl.permute(tl.join(a + b, a - b), [0, 1, 2, 5, 3, 4])
        return tl.reshape(y, [H, BT, C, 8])

    @triton.jit
    def fwht_kernel(x, H: tl.constexpr, BT: tl.constexpr, C: tl.constexpr, ENTRY: tl.constexpr):
        """``common.fwht`` of every tile of a ``[H, BT, C, 8]`` block: strides 1, 2, ..., G/2, then * ENTRY."""
        x = butterfly_l_kernel(x, 1, H, BT, C)
        x = butterfly_l_kernel(x, 2, H, BT, C)
        x = butterfly_l_kernel(x, 4, H, BT, C)
        if H >= 2:
            x = butterfly_h_kernel(x, 1, H, BT, C)
        if H >= 4:
            x = butterfly_h_kernel(x, 2, H, BT, C)
        if H >= 8:
            x = butterfly_h_kernel(x, 4, H, BT, C)
        if H >= 16:
            x = butterfly_h_kernel(x, 8, H, BT, C)
        if C >= 2:
            x = butterfly_c_kernel(x, 1, H, BT, C)
        if C >= 4:
            x = butterfly_c_kernel(x, 2, H, BT, C)
        if C >= 8:
            x = butterfly_c_kernel(x, 4, H, BT, C)
        if C >= 16:
            x = butterfly_c_kernel(x, 8, H, BT, C)
        return x * ENTRY

    # ----- loads, stores and conversions ---------------------------------------------------------
    @triton.jit
    def bf16_from_bits_kernel(bits):
        """fp32 value of bf16 bit patterns (int16)."""
        return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def load_fp32_kernel(ptr, mask, BF16_BITS: tl.constexpr, FLIP: tl.constexpr = False):
        """Load fp32/fp16 values, or bf16 values stored behind an int16 pointer (``BF16_BITS``), as fp32.

        A block (4-D) is loaded in the FLIP arrangement; per-tile values (1-D) as they are.
        """
        if len(ptr.shape) == 4:
            raw = load_block_raw_kernel(ptr, mask, 0, FLIP)
        else:
            raw = tl.load(ptr, mask=mask, other=0)
        if BF16_BITS:
            return bf16_from_bits_kernel(raw)
        else:
            return raw.to(tl.float32)

    @triton.jit
    def magnitude_bits_kernel(v):
        """int32 bits of ``|v|``: ordered like the magnitudes; NaN > Inf > every finite value."""
        return v.to(tl.int32, bitcast=True) & 0x7FFFFFFF

    @triton.jit
    def bf16_rne_bits_kernel(x):
        """int16 bits of fp32 ``x`` rounded to nearest-even bf16 (NaN -> 0x7FC0), computed on the bits."""
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        return tl.where(x != x, 0x7FC0, rounded).to(tl.int16)

    @triton.jit
    def store_values_kernel(ptr, v, mask, OUT_KIND: tl.constexpr, NATIVE_BF16: tl.constexpr, FLIP: tl.constexpr):
        """Store a block of fp32 ``v`` as the output dtype: OUT_KIND 0 fp32, 1 fp16 (clamped to its range),
        2 bf16 bits (int16)."""
        if OUT_KIND == 2:
            if NATIVE_BF16:
                value = v.to(tl.bfloat16).to(tl.int16, bitcast=True)
            else:
                value = bf16_rne_bits_kernel(v)
        elif OUT_KIND == 1:
            # where() keeps NaN (bad tiles), unlike a min/max clamp on the GPU.
            value = tl.where(v > 65504.0, 65504.0, tl.where(v < -65504.0, -65504.0, v)).to(tl.float16)
        else:
            value = v
        store_block_raw_kernel(ptr, value, mask, FLIP)

    # ----- rounding ------------------------------------------------------------------------------
    @triton.jit
    def round_bf16_kernel(x, UP: tl.constexpr):
        """fp32 ``x`` rounded to a bf16-representable fp32, up (UP) or down; as ``common.round_bf16``."""
        bits = x.to(tl.int32, bitcast=True)
        truncated = bits & -65536
        inexact = (bits & 0xFFFF) != 0
        if UP:
            away = x > 0
        else:
            away = x < 0
        rounded = tl.where(inexact & away, truncated + 65536, truncated)
        return rounded.to(tl.float32, bitcast=True)

    @triton.jit
    def rint_int_kernel(v):
        """``round(v)`` (ties to even) as int32, for ``0 <= v < 2^22``: the bits of ``v + 1.5 * 2^23``."""
        return (v + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000

    @triton.jit
    def hash_uniform_kernel(index, seed):
        """``common.hash_uniform``: uniform [0, 1) fp32 from the element index and the call's seed."""
        x = index.to(tl.uint32) * tl.full([], 0x9E3779B1, tl.uint32) + seed.to(tl.uint32)
        x = x ^ (x >> 16)
        x = x * tl.full([], 0x7FEB352D, tl.uint32)
        x = x ^ (x >> 15)
        x = x * tl.full([], 0x846CA68B, tl.uint32)
        x = x ^ (x >> 16)
        return (x >> 8).to(tl.int32).to(tl.float32) * 5.9604644775390625e-08

    @triton.jit
    def log2_approx_kernel(x, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
                           C5: tl.constexpr):
        """``common.log2_approx``: exponent from the bits plus a degree-5 polynomial of the mantissa."""
        bits = x.to(tl.int32, bitcast=True)
        exponent = ((bits >> 23) - 127).to(tl.float32)
        t = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True) - 1.0
        p = C5 * t + C4
        p = p * t + C3
        p = p * t + C2
        p = p * t + C1
        return exponent + p * t

    # ----- the asymmetric quantizer --------------------------------------------------------------
    @triton.jit
    def quant_params_kernel(lo, hi, LEVELS: tl.constexpr, bad):
        """``common.quantize_tiles``' per-tile numbers: (scale, zero, 1/scale, flat) from min, max, LEVELS."""
        zero = round_bf16_kernel(lo, False) + 0.0
        scale = round_bf16_kernel(tl.math.div_rn(hi - zero, tl.full(lo.shape, LEVELS, tl.float32)), True) + 0.0
        scale = tl.where(bad, 0.0, scale)
        flat = ~(scale >= 1.1754943508222875e-38)
        inverse = tl.math.div_rn(1.0, tl.where(flat, 1.0, scale))
        return scale, zero, inverse, flat

    @triton.jit
    def quantize_codes_kernel(v, zero, inverse, flat, LEVELS: tl.constexpr, noise, STOCHASTIC: tl.constexpr):
        """int32 codes of a block: ``round((v - zero) * inverse)`` clamped to LEVELS, 0 on flat tiles."""
        scaled = (v - bcast_kernel(zero)) * bcast_kernel(inverse)
        if STOCHASTIC:
            q = tl.where(bcast_kernel(flat), 0.0, scaled + noise).to(tl.int32)  # truncation is floor: >= 0
        else:
            q = rint_int_kernel(scaled)
        q = tl.minimum(q, LEVELS)
        return tl.where(bcast_kernel(flat), 0, q)

    @triton.jit
    def bf16_bits_kernel(x):
        """int32 holding the bf16 bits of a bf16-representable fp32 ``x``."""
        return x.to(tl.int32, bitcast=True) >> 16

    # ----- bit packing ---------------------------------------------------------------------------
    @triton.jit
    def pack_groups_kernel(q, BITS: tl.constexpr):
        """Pack the groups of 8 codes along the last dim: (low, high) uint32 words of the 64-bit group word."""
        lane = tl.arange(0, 8)
        shift = lane * BITS
        shift = tl.reshape(shift, [1, 1, 1, 8])
        qu = q.to(tl.uint32)
        lo = tl.where(shift < 32, qu << (shift & 31), 0)
        hi_part = tl.where(shift >= 32, qu << ((shift - 32) & 31), qu >> ((32 - shift) & 31))
        hi = tl.where(shift + BITS > 32, hi_part, 0)
        return tl.sum(lo, axis=3), tl.sum(hi, axis=3)

    @triton.jit
    def unit_value_kernel(lo, hi, K: tl.constexpr, UNIT: tl.constexpr):
        """The ``K``-th ``UNIT``-byte piece of the 64-bit group words (``lo``, ``hi``), as the store dtype."""
        if K * UNIT < 4:
            word = lo >> (K * UNIT * 8)
        else:
            word = hi >> ((K * UNIT - 4) * 8)
        if UNIT == 4:
            return word.to(tl.int32, bitcast=True)
        elif UNIT == 2:
            return (word & 0xFFFF).to(tl.int16)
        else:
            return (word & 0xFF).to(tl.uint8)

    @triton.jit
    def store_groups_kernel(ptr, group, lo, hi, mask, UNIT: tl.constexpr, NUNITS: tl.constexpr,
                            FLIP: tl.constexpr):
        """Store each group's bytes (``lo``, ``hi`` words) at group index ``group`` as ``NUNITS`` pieces of
        ``UNIT`` bytes (``ptr`` points at ``UNIT``-byte integers). One store per piece and group."""
        base = ptr + group * NUNITS
        store_block_raw_kernel(base, unit_value_kernel(lo, hi, 0, UNIT), mask, FLIP)
        if NUNITS > 1:
            store_block_raw_kernel(base + 1, unit_value_kernel(lo, hi, 1, UNIT), mask, FLIP)
        if NUNITS > 2:
            store_block_raw_kernel(base + 2, unit_value_kernel(lo, hi, 2, UNIT), mask, FLIP)
        if NUNITS > 3:
            store_block_raw_kernel(base + 3, unit_value_kernel(lo, hi, 3, UNIT), mask, FLIP)
        if NUNITS > 4:
            store_block_raw_kernel(base + 4, unit_value_kernel(lo, hi, 4, UNIT), mask, FLIP)
        if NUNITS > 5:
            store_block_raw_kernel(base + 5, unit_value_kernel(lo, hi, 5, UNIT), mask, FLIP)
        if NUNITS > 6:
            store_block_raw_kernel(base + 6, unit_value_kernel(lo, hi, 6, UNIT), mask, FLIP)

    @triton.jit
    def load_unit_kernel(ptr, mask, K: tl.constexpr, UNIT: tl.constexpr, FLIP: tl.constexpr):
        """Piece ``K`` of every group, shifted to its place in the 64-bit group word: (low, high) parts."""
        raw = load_block_raw_kernel(ptr + K, mask, 0, FLIP)
        if UNIT == 4:
            word = raw.to(tl.uint32, bitcast=True)
        elif UNIT == 2:
            word = raw.to(tl.uint16, bitcast=True).to(tl.uint32)
        else:
            word = raw.to(tl.uint32)
        if K * UNIT < 4:
            return word << (K * UNIT * 8), word * 0
        else:
            return word * 0, word << ((K * UNIT - 4) * 8)

    @triton.jit
    def load_groups_kernel(ptr, group, mask, UNIT: tl.constexpr, NUNITS: tl.constexpr, FLIP: tl.constexpr):
        """Inverse of ``store_groups_kernel``: the (low, high) uint32 words of every group."""
        base = ptr + group * NUNITS
        lo, hi = load_unit_kernel(base, mask, 0, UNIT, FLIP)
        if NUNITS > 1:
            a, b = load_unit_kernel(base, mask, 1, UNIT, FLIP)
            lo = lo | a
            hi = hi | b
        if NUNITS > 2:
            a, b = load_unit_kernel(base, mask, 2, UNIT, FLIP)
            lo = lo | a
            hi = hi | b
        if NUNITS > 3:
            a, b = load_unit_kernel(base, mask, 3, UNIT, FLIP)
            lo = lo | a
            hi = hi | b
        if NUNITS > 4:
            a, b = load_unit_kernel(base, mask, 4, UNIT, FLIP)
            lo = lo | a
            hi = hi | b
        if NUNITS > 5:
            a, b = load_unit_kernel(base, mask, 5, UNIT, FLIP)
            lo = lo | a
            hi = hi | b
        if NUNITS > 6:
            a, b = load_unit_kernel(base, mask, 6, UNIT, FLIP)
            lo = lo | a
            hi = hi | b
        return lo, hi

    @triton.jit
    def unpack_groups_kernel(lo, hi, BITS: tl.constexpr):
        """int32 codes ``[..., 8]`` of groups packed as (low, high) words."""
        shift = tl.reshape(tl.arange(0, 8) * BITS, [1, 1, 1, 8])
        lo4 = lo[:, :, :, None]
        hi4 = hi[:, :, :, None]
        from_lo = lo4 >> (shift & 31)
        from_hi = tl.where(shift >= 32, hi4 >> ((shift - 32) & 31), hi4 << ((32 - shift) & 31))
        word = tl.where(shift < 32, from_lo, 0) | tl.where(shift + BITS > 32, from_hi, 0)
        return (word & ((1 << BITS) - 1)).to(tl.int32)

    # ----- the codes section of the tile codecs (fixedpoint, tah, hadint) -----------------------------
    @triton.jit
    def group_index_kernel(t, G: tl.constexpr, H: tl.constexpr, C: tl.constexpr):
        """Index of every group of 8 codes of a block, counted from tile 0 (``[H, BT, C]``)."""
        h = tl.arange(0, H)[:, None, None]
        c = tl.arange(0, C)[None, None, :]
        return t[None, :, None] * (G // 8) + c * H + h

    @triton.jit
    def store_codes_kernel(codes_ptr, q, t, tmask, G: tl.constexpr, BITS: tl.constexpr, H: tl.constexpr,
                           C: tl.constexpr, UNIT: tl.constexpr, NUNITS: tl.constexpr, FLIP: tl.constexpr):
        """Pack the ``BITS``-bit codes ``q`` (``[H, BT, C, 8]``) of tiles ``t`` into the ``codes`` section."""
        lo, hi = pack_groups_kernel(q, BITS)
        store_groups_kernel(codes_ptr, group_index_kernel(t, G, H, C), lo, hi,
                            tl.broadcast_to(tmask[None, :, None], lo.shape), UNIT, NUNITS, FLIP)

    @triton.jit
    def load_codes_kernel(codes_ptr, t, tmask, G: tl.constexpr, BITS: tl.constexpr, H: tl.constexpr,
                          C: tl.constexpr, UNIT: tl.constexpr, NUNITS: tl.constexpr, FLIP: tl.constexpr):
        """Inverse of ``store_codes_kernel``: the int32 codes ``[H, BT, C, 8]`` of tiles ``t``."""
        group = group_index_kernel(t, G, H, C)
        lo, hi = load_groups_kernel(codes_ptr, group, tl.broadcast_to(tmask[None, :, None], group.shape), UNIT, NUNITS,
                                    FLIP)
        return unpack_groups_kernel(lo, hi, BITS)

    @triton.jit
    def load_bf16_kernel(ptr, t, tmask):
        """The bf16 metadata (stored as int16 bits) of tiles ``t``, as fp32; 0 for masked tiles."""
        return bf16_from_bits_kernel(tl.load(ptr + t, mask=tmask, other=0))
