"""Fused ``fixedpoint`` encode/decode: one pass over the input, one over the wire buffer.

Each program takes ``BT`` whole tiles as a ``[H, BT, C, 8]`` block (``common``), finds
min and max, the bf16 zero and scale, the codes, and packs them straight into the
buffer's ``codes`` section (wire format: ``codecs/fixedpoint.py``). Bytes are the torch
reference's, round to nearest or stochastic (the same counter-based noise).

The wire layout is here, beside the kernels (``fixedpoint_sections``: the codec, ``aqsgd``'s deltas
and ``laaq`` take it from here); the launchers take those sections as uint8 tensors by name.
"""

from __future__ import annotations

import torch

from typing import Sequence

from .. import geometry, numerics
from .common import (
    HAVE_TRITON, as_kernel_input, as_kernel_output, as_units, block_flip, blocking, check_launch, index_is_64bit,
    launch, native_conversions, sections_nbytes, store_units, tl, triton,
)


def fixedpoint_sections(shape: Sequence[int], bits: int, tile_size: int) -> list[tuple[str, int]]:
    """The ``fixedpoint`` wire sections of ``shape``: a bf16 scale and zero per tile, then the packed codes."""
    tiles = geometry.total_tiles(shape, tile_size)
    return [("scale", 2 * tiles), ("zero", 2 * tiles), ("codes", geometry.packed_nbytes(tiles * tile_size, bits))]


if HAVE_TRITON:
    from .common import (
        bcast_kernel, bf16_bits_kernel, channels_kernel, hash_uniform_kernel, load_bf16_kernel, load_codes_kernel,
        load_fp32_kernel, magnitude_bits_kernel, quant_params_kernel, quantize_codes_kernel, store_codes_kernel,
        store_values_kernel, tile_ids_kernel, tile_max_kernel, tile_min_kernel,
    )

    @triton.jit
    def load_block_kernel(x_ptr, t, tmask, h, tiles_per_token, G: tl.constexpr, H: tl.constexpr,
                          C: tl.constexpr, EVEN: tl.constexpr, BF16_BITS: tl.constexpr, FLIP: tl.constexpr):
        """fp32 ``[H, BT, C, 8]`` block of tiles ``t``, as ``common.to_tiles`` lays them out (bad values kept).

        EVEN (``h % G == 0``): tiles are contiguous, every load a whole unmasked-by-column vector. Otherwise
        the ragged last tile of a token repeats the token's last channel.
        """
        j = channels_kernel(H, C)
        if EVEN:
            v = load_fp32_kernel(x_ptr + bcast_kernel(t * G) + j, bcast_kernel(tmask) & (j >= 0), BF16_BITS, FLIP)
        else:
            token = t // tiles_per_token
            col = bcast_kernel((t - token * tiles_per_token) * G) + j
            row = token * h
            valid = col < h
            v = load_fp32_kernel(x_ptr + bcast_kernel(row) + col, bcast_kernel(tmask) & valid, BF16_BITS, FLIP)
            last = load_fp32_kernel(x_ptr + row + h - 1, tmask, BF16_BITS)
            v = tl.where(valid, v, bcast_kernel(last))
        return v

    @triton.jit
    def store_block_kernel(out_ptr, v, t, tmask, h, tiles_per_token, G: tl.constexpr, H: tl.constexpr,
                           C: tl.constexpr, EVEN: tl.constexpr, OUT_KIND: tl.constexpr, NATIVE_BF16: tl.constexpr,
                           FLIP: tl.constexpr):
        """Write a decoded block to the output tensor, dropping padding (``common.from_tiles``)."""
        j = channels_kernel(H, C)
        if EVEN:
            store_values_kernel(out_ptr + bcast_kernel(t * G) + j, v, bcast_kernel(tmask) & (j >= 0), OUT_KIND,
                                NATIVE_BF16, FLIP)
        else:
            token = t // tiles_per_token
            col = bcast_kernel((t - token * tiles_per_token) * G) + j
            mask = bcast_kernel(tmask) & (col < h)
            store_values_kernel(out_ptr + bcast_kernel(token * h) + col, v, mask, OUT_KIND, NATIVE_BF16, FLIP)

    @triton.jit(do_not_specialize=["seed"])
    def fixedpoint_encode_kernel(
        x_ptr, scale_ptr, zero_ptr, codes_ptr, n_tiles, h, tiles_per_token, seed,
        G: tl.constexpr, BITS: tl.constexpr, H: tl.constexpr, BT: tl.constexpr, C: tl.constexpr,
        EVEN: tl.constexpr, INDEX64: tl.constexpr, STOCHASTIC: tl.constexpr, BF16_BITS: tl.constexpr,
        MAX_BITS: tl.constexpr, UNIT: tl.constexpr, NUNITS: tl.constexpr, FLIP: tl.constexpr,
    ):
        t = tile_ids_kernel(BT, INDEX64)
        tmask = t < n_tiles
        v = load_block_kernel(x_ptr, t, tmask, h, tiles_per_token, G, H, C, EVEN, BF16_BITS, FLIP)
        bad = tile_max_kernel(magnitude_bits_kernel(v)) > MAX_BITS
        levels: tl.constexpr = (1 << BITS) - 1
        scale, zero, inverse, flat = quant_params_kernel(tile_min_kernel(v), tile_max_kernel(v), levels, bad)
        noise = v
        if STOCHASTIC:
            noise = hash_uniform_kernel(bcast_kernel(t * G) + channels_kernel(H, C), seed)
        q = quantize_codes_kernel(v, zero, inverse, flat, levels, noise, STOCHASTIC)
        tl.store(scale_ptr + t, bf16_bits_kernel(scale).to(tl.int16), mask=tmask)
        tl.store(zero_ptr + t, tl.where(bad, 0x7FC0, bf16_bits_kernel(zero)).to(tl.int16), mask=tmask)
        store_codes_kernel(codes_ptr, q, t, tmask, G, BITS, H, C, UNIT, NUNITS, FLIP)

    @triton.jit
    def fixedpoint_decode_kernel(
        out_ptr, scale_ptr, zero_ptr, codes_ptr, n_tiles, h, tiles_per_token,
        G: tl.constexpr, BITS: tl.constexpr, H: tl.constexpr, BT: tl.constexpr, C: tl.constexpr,
        EVEN: tl.constexpr, INDEX64: tl.constexpr, OUT_KIND: tl.constexpr, NATIVE_BF16: tl.constexpr,
        UNIT: tl.constexpr, NUNITS: tl.constexpr, FLIP: tl.constexpr,
    ):
        t = tile_ids_kernel(BT, INDEX64)
        tmask = t < n_tiles
        scale = load_bf16_kernel(scale_ptr, t, tmask)
        zero = load_bf16_kernel(zero_ptr, t, tmask)
        codes = load_codes_kernel(codes_ptr, t, tmask, G, BITS, H, C, UNIT, NUNITS, FLIP)
        v = codes.to(tl.float32) * bcast_kernel(scale) + bcast_kernel(zero)  # exact product: FMA-safe
        store_block_kernel(out_ptr, v, t, tmask, h, tiles_per_token, G, H, C, EVEN, OUT_KIND, NATIVE_BF16, FLIP)

else:  # pragma: no cover - without triton
    fixedpoint_encode_kernel = fixedpoint_decode_kernel = None


def _common_args(shape, tile_size: int, nbytes: int):
    h = int(shape[-1])
    tiles_per_token = geometry.num_tiles(h, tile_size)
    n_tiles = geometry.total_tiles(shape, tile_size)
    index64 = index_is_64bit(n_tiles * tile_size, nbytes)
    return h, tiles_per_token, n_tiles, index64


def triton_fixedpoint_encode(
    x: torch.Tensor, sections: dict[str, torch.Tensor], bits: int, tile_size: int,
    seed: int | None = None, per_lane: int | None = None, tiles_per_prog: int | None = None,
) -> None:
    """Fill the ``scale``/``zero``/``codes`` sections (uint8 tensors) from contiguous ``x``.

    ``seed`` (a uint32, from ``common.RoundingNoise``) switches to stochastic rounding; the
    bytes are the reference's either way. ``per_lane``/``tiles_per_prog`` override the blocking.
    """
    check_launch(fixedpoint_encode_kernel, "triton_fixedpoint_encode", x, *sections.values())
    if not x.is_contiguous():
        raise ValueError("triton_fixedpoint_encode needs a contiguous input")
    h, tiles_per_token, n_tiles, index64 = _common_args(x.shape, tile_size, sections_nbytes(sections))
    blk = blocking(fixedpoint_encode_kernel, tile_size, per_lane, tiles_per_prog)
    unit, nunits = store_units(bits)
    x_in, bf16_bits = as_kernel_input(x)
    launch(
        f"fixedpoint_encode G{tile_size} b{bits}{' SR' if seed is not None else ''}",
        fixedpoint_encode_kernel, (blk.programs(n_tiles),),
        (x_in, as_units(sections["scale"], 2), as_units(sections["zero"], 2), as_units(sections["codes"], unit),
         n_tiles, h, tiles_per_token, 0 if seed is None else int(seed)),
        dict(G=tile_size, BITS=bits, H=blk.per_lane // 8, BT=blk.tiles, C=blk.lanes, EVEN=h % tile_size == 0,
             INDEX64=index64, STOCHASTIC=seed is not None, BF16_BITS=bf16_bits, MAX_BITS=numerics.MAX_ABS_BITS,
             UNIT=unit, NUNITS=nunits, FLIP=block_flip(), num_warps=blk.num_warps,
             enable_fp_fusion=False),
        blk.elements,
    )


def triton_fixedpoint_decode(
    sections: dict[str, torch.Tensor], shape, dtype: torch.dtype, bits: int, tile_size: int,
    out: torch.Tensor | None = None, per_lane: int | None = None, tiles_per_prog: int | None = None,
) -> torch.Tensor:
    """Decode ``fixedpoint`` sections into ``out`` (contiguous, ``shape``/``dtype``) or a new tensor."""
    codes = sections["codes"]
    check_launch(fixedpoint_decode_kernel, "triton_fixedpoint_decode", codes)
    if out is None:
        out = torch.empty(tuple(shape), dtype=dtype, device=codes.device)
    h, tiles_per_token, n_tiles, index64 = _common_args(shape, tile_size, sections_nbytes(sections))
    blk = blocking(fixedpoint_decode_kernel, tile_size, per_lane, tiles_per_prog)
    unit, nunits = store_units(bits)
    out_view, out_kind = as_kernel_output(out)
    native_bf16, _ = native_conversions(fixedpoint_decode_kernel, codes.device)
    launch(
        f"fixedpoint_decode G{tile_size} b{bits} ->{str(dtype).removeprefix('torch.')}",
        fixedpoint_decode_kernel, (blk.programs(n_tiles),),
        (out_view, as_units(sections["scale"], 2), as_units(sections["zero"], 2), as_units(codes, unit),
         n_tiles, h, tiles_per_token),
        dict(G=tile_size, BITS=bits, H=blk.per_lane // 8, BT=blk.tiles, C=blk.lanes, EVEN=h % tile_size == 0,
             INDEX64=index64, OUT_KIND=out_kind, NATIVE_BF16=native_bf16, UNIT=unit, NUNITS=nunits, FLIP=block_flip(),
             num_warps=blk.num_warps),
        blk.elements,
    )
    return out
