"""Fused ``fixedpoint`` encode/decode: one pass over the input, one over the wire buffer.

Each program takes ``BT`` whole tiles, computes min/max, the bf16 zero and
scale, the codes, and packs them straight into the buffer's ``codes``
section (wire format: ``codecs/fixedpoint.py``). Round to nearest gives the
reference's bytes exactly. Stochastic rounding draws its uniform noise
in-kernel (Philox, seeded per call by the caller), so its bytes differ from the
torch reference's but follow the same distribution and decode the same way.
"""

from __future__ import annotations

import torch

from ..codecs.base import MAX_ABS_VALUE, WireLayout
from .common import (
    HAVE_TRITON, as_kernel_input, as_kernel_output, bf16_nan_bits, cdiv, check_launch, num_warps_for,
    tile_geometry, tiles_per_program, tl, triton,
)

if HAVE_TRITON:
    from .common import (
        bf16_from_bits_kernel, dequantize_kernel, load_tiles_kernel, load_unpack_kernel, pack_store_kernel,
        quantize_kernel, rounding_noise_kernel, store_scale_zero_kernel, store_tiles_kernel,
    )

    @triton.jit
    def fixedpoint_encode_kernel(
        x_ptr, scale_ptr, zero_ptr, codes_ptr, n_tiles, h, tiles_per_token, seed, nan_bits,
        G: tl.constexpr, BITS: tl.constexpr, BT: tl.constexpr, STOCHASTIC: tl.constexpr,
        MAX_ABS: tl.constexpr, BF16_BITS: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        tmask = t < n_tiles
        v, bad = load_tiles_kernel(x_ptr, t, tmask, h, tiles_per_token, G, MAX_ABS, BF16_BITS)
        noise = v
        if STOCHASTIC:
            noise = rounding_noise_kernel(seed, t, G)
        levels = tl.zeros([BT], dtype=tl.float32) + ((1 << BITS) - 1)
        q, scale, zero = quantize_kernel(v, levels, noise, STOCHASTIC)
        store_scale_zero_kernel(scale_ptr, zero_ptr, t, tmask, scale, zero, bad, nan_bits)
        bits = tl.zeros([BT], dtype=tl.int64) + BITS
        pack_store_kernel(codes_ptr, t * (G * BITS // 8), q, bits, tmask, G // 8)

    @triton.jit
    def fixedpoint_decode_kernel(
        out_ptr, scale_ptr, zero_ptr, codes_ptr, n_tiles, h, tiles_per_token,
        G: tl.constexpr, BITS: tl.constexpr, BT: tl.constexpr, OUT_KIND: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        tmask = t < n_tiles
        scale = bf16_from_bits_kernel(tl.load(scale_ptr + t, mask=tmask, other=0))
        zero = bf16_from_bits_kernel(tl.load(zero_ptr + t, mask=tmask, other=0))
        bits = tl.zeros([BT], dtype=tl.int64) + BITS
        codes = load_unpack_kernel(codes_ptr, t * (G * BITS // 8), bits, tmask, G // 8)
        values = dequantize_kernel(codes, scale, zero)
        store_tiles_kernel(out_ptr, values, t, tmask, h, tiles_per_token, G, OUT_KIND)

else:  # pragma: no cover - without triton
    fixedpoint_encode_kernel = fixedpoint_decode_kernel = None


def triton_fixedpoint_encode(
    x: torch.Tensor, buf: torch.Tensor, layout: WireLayout, bits: int, tile_size: int,
    seed: int | None = None, tiles_per_prog: int | None = None,
) -> None:
    """Fill ``buf``'s ``scale``/``zero``/``codes`` sections from contiguous ``x``.

    ``seed`` (an int) switches to stochastic rounding with in-kernel Philox noise;
    ``None`` rounds to nearest (bytes identical to the torch reference).
    """
    check_launch(fixedpoint_encode_kernel, "triton_fixedpoint_encode", x, buf)
    if not x.is_contiguous():
        raise ValueError("triton_fixedpoint_encode needs a contiguous input")
    h, tiles_per_token, n_tiles = tile_geometry(x.shape, tile_size)
    bt = tiles_per_program(tile_size, fixedpoint_encode_kernel, tiles_per_prog)
    x_in, bf16_bits = as_kernel_input(x)
    fixedpoint_encode_kernel[(cdiv(n_tiles, bt),)](
        x_in, layout.view(buf, "scale", torch.int16), layout.view(buf, "zero", torch.int16),
        layout.view(buf, "codes"),
        n_tiles, h, tiles_per_token, 0 if seed is None else int(seed), bf16_nan_bits(x.device),
        G=tile_size, BITS=bits, BT=bt, STOCHASTIC=seed is not None, MAX_ABS=MAX_ABS_VALUE, BF16_BITS=bf16_bits,
        num_warps=num_warps_for(bt * tile_size),
    )


def triton_fixedpoint_decode(
    buf: torch.Tensor, shape, dtype: torch.dtype, layout: WireLayout, bits: int, tile_size: int,
    tiles_per_prog: int | None = None,
) -> torch.Tensor:
    """Decode a ``fixedpoint`` buffer into a new tensor of ``shape``/``dtype`` on buf's device."""
    check_launch(fixedpoint_decode_kernel, "triton_fixedpoint_decode", buf)
    h, tiles_per_token, n_tiles = tile_geometry(shape, tile_size)
    out = torch.empty(tuple(shape), dtype=dtype, device=buf.device)
    bt = tiles_per_program(tile_size, fixedpoint_decode_kernel, tiles_per_prog)
    out_view, out_kind = as_kernel_output(out)
    fixedpoint_decode_kernel[(cdiv(n_tiles, bt),)](
        out_view, layout.view(buf, "scale", torch.int16), layout.view(buf, "zero", torch.int16),
        layout.view(buf, "codes"),
        n_tiles, h, tiles_per_token,
        G=tile_size, BITS=bits, BT=bt, OUT_KIND=out_kind,
        num_warps=num_warps_for(bt * tile_size),
    )
    return out
