"""Shared Triton building blocks: the kernel twins of ``codecs/common.py``.

Tiles are handled as ``[BT, G // 8, 8]`` blocks (``BT`` tiles per program, each
tile's ``G`` channels split into groups of 8 codes) so bit packing is a sum of
shifted codes over the last axis, exactly ``common.pack_bits``' little-endian
64-bit word per group of 8 codes. Every helper reproduces the reference's fp32
operations in the same order (precise division ``div_rn``, round half to even,
directed rounding to bf16 on the raw bits), so encoders write identical bytes.

bf16 metadata is written and read as raw int16 bits. A bad tile's NaN zero
gets the bit pattern torch's own fp32 -> bf16 cast writes on that device
(``bf16_nan_bits``: ``0xFFFF`` on CPU), so both paths write identical bytes.
"""

from __future__ import annotations

import functools
import math

import torch

try:  # pragma: no cover - exercised by the import itself
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAVE_TRITON = False

_NAN_BITS: dict[str, int] = {}
# fp32 tl.dot precision for the Hadamard: "ieee" (fp32 FMA) is exact fp32 arithmetic on every GPU
# and in the interpreter; "tf32x3" would use tensor cores at nearly fp32 accuracy.
DOT_PRECISION = "ieee"


def require_triton(what: str) -> None:
    """Raise ``RuntimeError`` naming ``what`` when Triton cannot be imported."""
    if not HAVE_TRITON:
        raise RuntimeError(f"{what} needs triton (pip install triton), which is not importable here")


def bf16_nan_bits(device: torch.device) -> int:
    """int16 bit pattern torch writes for NaN when casting an fp32 tensor to bf16 on ``device``."""
    key = str(device)
    if key not in _NAN_BITS:
        nan = torch.full((8,), float("nan"), device=device).to(torch.bfloat16).view(torch.int16)
        _NAN_BITS[key] = int(nan[0].item())
    return _NAN_BITS[key]


def philox_seed(noise_fn) -> int | None:
    """Seed for in-kernel stochastic rounding, drawn from a codec's own seeded noise generator.

    ``noise_fn(like)`` is the codec's rounding-noise function (uniform [0, 1) like ``like``,
    or None when it rounds to nearest); it is called on a 2-element CPU tensor, so no device sync.
    """
    u = noise_fn(torch.empty(2))
    if u is None:
        return None
    return int(u[0] * (1 << 24)) | int(u[1] * (1 << 24)) << 24


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


def check_launch(kernel, what: str, *tensors) -> None:
    """Raise unless the tensors can be handed to ``kernel``: CUDA tensors, or any tensor under the interpreter."""
    require_triton(what)
    if is_interpreted(kernel):
        return
    for tensor in tensors:
        if tensor.device.type != "cuda":
            raise RuntimeError(
                f"{what}: the Triton path needs CUDA tensors (got {tensor.device}); set TRITON_INTERPRET=1 "
                "before importing triton to run it on CPU, or use backend='torch'"
            )


def tiles_per_program(tile_size: int, kernel, requested: int | None = None) -> int:
    """Tiles handled by one program: ``requested``, or ~2K elements on a GPU and ~64K under the interpreter."""
    if requested is not None:
        if requested < 1 or requested & (requested - 1):
            raise ValueError(f"tiles_per_program must be a power of two, got {requested}")
        return requested
    elements = 1 << 16 if is_interpreted(kernel) else 1 << 11
    return max(1, elements // tile_size)


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


def hadamard_entry(tile_size: int) -> float:
    """The reference matrix's entry ``1/sqrt(G)`` (``codecs.common.hadamard_matrix``) as its exact fp32 value."""
    from ..codecs.common import hadamard_matrix

    return float(hadamard_matrix(tile_size)[0, 0])


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tile_geometry(shape, tile_size: int) -> tuple[int, int, int]:
    """(h, tiles per token, all tiles) of a tensor of ``shape`` cut into tiles along its last dim."""
    h = int(shape[-1])
    tokens = 1
    for d in shape[:-1]:
        tokens *= int(d)
    tiles_per_token = cdiv(h, tile_size)
    return h, tiles_per_token, tokens * tiles_per_token


def num_warps_for(block_elements: int) -> int:
    return int(min(8, max(1, 2 ** round(math.log2(max(block_elements, 32) / 256)))))


if HAVE_TRITON:

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
    def bf16_bits_kernel(x):
        """int16 bit pattern of a bf16-representable fp32 ``x``."""
        return (x.to(tl.int32, bitcast=True) >> 16).to(tl.int16)

    @triton.jit
    def bf16_from_bits_kernel(bits):
        """fp32 value of bf16 bit patterns (int16)."""
        return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def bf16_rne_bits_kernel(x):
        """int16 bits of fp32 ``x`` rounded to nearest-even bf16 (NaN -> 0x7FC0), computed on the bits.

        The interpreter's own fp32 -> bf16 cast truncates, so kernels never rely on it.
        """
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        return tl.where(x != x, 0x7FC0, rounded).to(tl.int16)

    @triton.jit
    def load_as_fp32_kernel(ptr, mask, BF16_BITS: tl.constexpr):
        """Load fp32/fp16 values, or bf16 values stored behind an int16 pointer (``BF16_BITS``), as fp32."""
        raw = tl.load(ptr, mask=mask, other=0)
        if BF16_BITS:
            return bf16_from_bits_kernel(raw)
        else:
            return raw.to(tl.float32)

    @triton.jit
    def rint_kernel(v):
        """Round half to even (``torch.round``), exact for |v| < 2**23 (larger values are clamped later)."""
        r = tl.floor(v + 0.5)
        half = r * 0.5
        odd = tl.floor(half) != half
        return tl.where(((r - v) == 0.5) & odd, r - 1.0, r)

    @triton.jit
    def tile_columns_kernel(t, tiles_per_token, G: tl.constexpr):
        """Token index ``[BT]`` and channel index ``[BT, G//8, 8]`` of the elements of tiles ``t``."""
        token = t // tiles_per_token
        col0 = (t % tiles_per_token) * G
        group = tl.arange(0, G // 8) * 8
        lane = tl.arange(0, 8)
        col = col0[:, None, None] + group[None, :, None] + lane[None, None, :]
        return token, col

    @triton.jit
    def load_tiles_kernel(x_ptr, t, tmask, h, tiles_per_token, G: tl.constexpr, MAX_ABS: tl.constexpr,
                          BF16_BITS: tl.constexpr):
        """fp32 tiles ``[BT, G//8, 8]`` and the bad-tile mask, as ``common.to_tiles``.

        Padding past ``h`` repeats the token's last channel; bad elements become 0.
        """
        token, col = tile_columns_kernel(t, tiles_per_token, G)
        col = tl.minimum(col, h - 1)
        mask = tmask[:, None, None] & (col >= 0)
        v = load_as_fp32_kernel(x_ptr + token[:, None, None] * h + col, mask, BF16_BITS)
        bad_elem = (tl.abs(v) > MAX_ABS) | (v != v)
        v = tl.where(bad_elem, 0.0, v)
        bad = tl.max(tl.max(bad_elem.to(tl.int32), axis=2), axis=1) > 0
        return v, bad

    @triton.jit
    def store_values_kernel(ptr, v, mask, OUT_KIND: tl.constexpr):
        """Store fp32 ``v`` as the output dtype: OUT_KIND 0 fp32, 1 fp16 (clamped to its range), 2 bf16 bits (int16)."""
        if OUT_KIND == 2:
            tl.store(ptr, bf16_rne_bits_kernel(v), mask=mask)
        elif OUT_KIND == 1:
            # where() keeps NaN (bad tiles), unlike a min/max clamp on the GPU.
            v = tl.where(v > 65504.0, 65504.0, tl.where(v < -65504.0, -65504.0, v))
            tl.store(ptr, v.to(tl.float16), mask=mask)
        else:
            tl.store(ptr, v, mask=mask)

    @triton.jit
    def store_tiles_kernel(out_ptr, v, t, tmask, h, tiles_per_token, G: tl.constexpr, OUT_KIND: tl.constexpr):
        """Write fp32 tiles to the output tensor (dropping padding), as ``common.from_tiles``."""
        token, col = tile_columns_kernel(t, tiles_per_token, G)
        mask = tmask[:, None, None] & (col < h)
        store_values_kernel(out_ptr + token[:, None, None] * h + col, v, mask, OUT_KIND)

    @triton.jit
    def rounding_noise_kernel(seed, t, G: tl.constexpr):
        """Uniform [0, 1) Philox noise ``[BT, G//8, 8]`` for the elements of tiles ``t`` (stochastic rounding)."""
        elem = t[:, None, None] * G + tl.arange(0, G // 8)[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
        return tl.rand(seed, elem.to(tl.int32))

    @triton.jit
    def quantize_kernel(v, levels, noise, STOCHASTIC: tl.constexpr):
        """Asymmetric per-tile quantizer, as ``common.quantize_tiles`` (bad tiles are handled by the caller).

        ``v``: fp32 ``[BT, G//8, 8]``; ``levels``: fp32 ``[BT]`` (``2**bits - 1``); ``noise``: uniform
        [0, 1) like ``v`` when STOCHASTIC. Returns int32 codes, fp32 ``scale`` and ``zero`` (bf16 values).
        """
        lo = tl.min(tl.min(v, axis=2), axis=1)
        hi = tl.max(tl.max(v, axis=2), axis=1)
        zero = round_bf16_kernel(lo, False)
        scale = round_bf16_kernel(tl.math.div_rn(hi, levels) - tl.math.div_rn(zero, levels), True)
        safe = tl.where(scale > 0, scale, 1.0)
        scaled = tl.math.div_rn(v - zero[:, None, None], safe[:, None, None])
        if STOCHASTIC:
            q = tl.floor(scaled + noise)
        else:
            q = rint_kernel(scaled)
        q = tl.minimum(tl.maximum(q, 0.0), levels[:, None, None])
        q = tl.where(scale[:, None, None] > 0, q, 0.0)
        return q.to(tl.int32), scale, zero

    @triton.jit
    def store_scale_zero_kernel(scale_ptr, zero_ptr, t, tmask, scale, zero, bad, nan_bits):
        """Write bf16 scale and zero (int16 bit views); a bad tile's zero is NaN (bits ``nan_bits``)."""
        tl.store(scale_ptr + t, bf16_bits_kernel(scale), mask=tmask)
        zero_bits = tl.where(bad, nan_bits, bf16_bits_kernel(zero).to(tl.int32)).to(tl.int16)
        tl.store(zero_ptr + t, zero_bits, mask=tmask)

    @triton.jit
    def pack_store_kernel(ptr, byte_off, q, bits, tmask, NG: tl.constexpr):
        """Pack codes ``q`` ``[BT, NG, 8]`` of ``bits[BT]`` bits at ``ptr + byte_off[BT]``, as ``common.pack_bits``."""
        lane = tl.arange(0, 8)
        nbits = bits.to(tl.int64)[:, None, None]
        word = tl.sum(q.to(tl.int64) << (lane[None, None, :] * nbits), axis=2)
        byte = (word[:, :, None] >> (lane[None, None, :] * 8)) & 0xFF
        group = tl.arange(0, NG)
        off = byte_off[:, None, None] + group[None, :, None] * nbits + lane[None, None, :]
        mask = tmask[:, None, None] & (lane[None, None, :] < nbits)
        tl.store(ptr + off, byte.to(tl.uint8), mask=mask)

    @triton.jit
    def load_unpack_kernel(ptr, byte_off, bits, tmask, NG: tl.constexpr):
        """Inverse of ``pack_store_kernel``: int32 codes ``[BT, NG, 8]``."""
        lane = tl.arange(0, 8)
        nbits = bits.to(tl.int64)[:, None, None]
        group = tl.arange(0, NG)
        off = byte_off[:, None, None] + group[None, :, None] * nbits + lane[None, None, :]
        mask = tmask[:, None, None] & (lane[None, None, :] < nbits)
        byte = tl.load(ptr + off, mask=mask, other=0).to(tl.int64)
        word = tl.sum(byte << (lane[None, None, :] * 8), axis=2)
        codes = (word[:, :, None] >> (lane[None, None, :] * nbits)) & ((1 << nbits) - 1)
        return codes.to(tl.int32)

    @triton.jit
    def hadamard_kernel(x, G: tl.constexpr, ENTRY: tl.constexpr, PRECISION: tl.constexpr):
        """``x [BT, G] @ (H_G * ENTRY)``, ENTRY the fp32 value of 1/sqrt(G); signs from the parity of ``i & j``.

        ``tl.dot`` for G >= 16 (BT must be >= 16), a broadcast product for G = 8.
        """
        i = tl.arange(0, G)
        a = i[:, None] & i[None, :]
        a = a ^ (a >> 4)
        a = a ^ (a >> 2)
        a = a ^ (a >> 1)
        h = tl.where((a & 1) == 1, -ENTRY, ENTRY)
        if G >= 16:
            y = tl.dot(x, h, input_precision=PRECISION)
        else:
            y = tl.sum(x[:, :, None] * h[None, :, :], axis=1)
        return y

    @triton.jit
    def dequantize_kernel(codes, scale, zero):
        """``codes * scale + zero`` in fp32 (the product is exact, so FMA contraction cannot change it)."""
        return codes.to(tl.float32) * scale[:, None, None] + zero[:, None, None]
