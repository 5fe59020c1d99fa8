"""Fused ``hadint`` encode/decode: sign flip, in-register Walsh-Hadamard, symmetric codes, packing.

Each program takes ``BT`` whole tiles as a ``[H, BT, C, 8]`` block (``common``): zero padding of a
ragged last tile (as the reference pads), bad values zeroed, ``x * d`` then the butterflies of
``common.fwht`` in the reference's order, the bf16 scale from the rotated tile's largest magnitude,
the codes (to nearest, or ``floor(. + u)`` with the reference's counter-hash noise) packed straight
into the ``codes`` section. Decode is the same in reverse. Bytes and decodes are the torch
reference's (wire format: ``codecs/hadint.py``). The wire layout is here, beside the kernels
(``hadint_sections``: the codec, and ``lowrank`` for its residual, take it from here); the launchers
take those sections as uint8 tensors by name.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .. import geometry, numerics
from .common import (
    HAVE_TRITON, as_kernel_input, as_kernel_output, as_units, block_flip, blocking, check_launch, launch,
    native_conversions, sections_nbytes, store_units, tl, triton,
)
from .fixedpoint import _common_args


def hadint_sections(shape: Sequence[int], bits: int, tile_size: int) -> list[tuple[str, int]]:
    """The ``hadint`` wire sections of ``shape``: a bf16 scale per tile, then the packed codes."""
    tiles = geometry.total_tiles(shape, tile_size)
    return [("scale", 2 * tiles), ("codes", geometry.packed_nbytes(tiles * tile_size, bits))]


if HAVE_TRITON:
    from .common import (
        bcast_kernel, bf16_bits_kernel, channels_kernel, fwht_kernel, hash_uniform_kernel, load_bf16_kernel,
        load_codes_kernel, load_fp32_kernel, magnitude_bits_kernel, rint_int_kernel, round_bf16_kernel,
        store_codes_kernel, tile_ids_kernel, tile_max_kernel,
    )
    from .fixedpoint import store_block_kernel

    @triton.jit
    def load_zero_padded_kernel(x_ptr, t, tmask, h, tiles_per_token, G: tl.constexpr, H: tl.constexpr,
                                C: tl.constexpr, EVEN: tl.constexpr, BF16_BITS: tl.constexpr, FLIP: tl.constexpr):
        """fp32 ``[H, BT, C, 8]`` block of tiles ``t``, a ragged last tile padded with zeros."""
        j = channels_kernel(H, C)
        if EVEN:
            return load_fp32_kernel(x_ptr + bcast_kernel(t * G) + j, bcast_kernel(tmask) & (j >= 0), BF16_BITS, FLIP)
        else:
            token = t // tiles_per_token
            col = bcast_kernel((t - token * tiles_per_token) * G) + j
            return load_fp32_kernel(x_ptr + bcast_kernel(token * h) + col, bcast_kernel(tmask) & (col < h),
                                    BF16_BITS, FLIP)

    @triton.jit(do_not_specialize=["seed"])
    def hadint_encode_kernel(
        x_ptr, signs_ptr, scale_ptr, codes_ptr, n_tiles, h, tiles_per_token, seed,
        G: tl.constexpr, BITS: tl.constexpr, H: tl.constexpr, BT: tl.constexpr, C: tl.constexpr,
        EVEN: tl.constexpr, INDEX64: tl.constexpr, HADAMARD: tl.constexpr, ENTRY: tl.constexpr,
        STOCHASTIC: tl.constexpr, BF16_BITS: tl.constexpr, MAX_BITS: tl.constexpr, UNIT: tl.constexpr,
        NUNITS: tl.constexpr, FLIP: tl.constexpr,
    ):
        t = tile_ids_kernel(BT, INDEX64)
        tmask = t < n_tiles
        v = load_zero_padded_kernel(x_ptr, t, tmask, h, tiles_per_token, G, H, C, EVEN, BF16_BITS, FLIP)
        bad_value = magnitude_bits_kernel(v) > MAX_BITS
        bad = tile_max_kernel(bad_value.to(tl.int32)) > 0
        v = tl.where(bad_value, 0.0, v)
        if HADAMARD:
            v = fwht_kernel(v * tl.load(signs_ptr + channels_kernel(H, C)), H, BT, C, ENTRY)
        limit: tl.constexpr = (1 << (BITS - 1)) - 1
        amax = tile_max_kernel(tl.abs(v))
        scale = round_bf16_kernel(tl.math.div_rn(amax, tl.full(amax.shape, limit, tl.float32)), True) + 0.0
        flat = ~(scale >= 1.1754943508222875e-38) | bad
        inverse = tl.math.div_rn(1.0, tl.where(flat, 1.0, scale))
        scaled = v * bcast_kernel(inverse)
        if STOCHASTIC:
            noise = hash_uniform_kernel(bcast_kernel(t * G) + channels_kernel(H, C), seed)
            q = tl.floor(scaled + noise).to(tl.int32)
        else:
            q = rint_int_kernel(scaled)  # (exact for |scaled| < 2^22, either sign)
        q = tl.minimum(tl.maximum(q, -limit), limit)
        q = tl.where(bcast_kernel(flat), 0, q) + limit
        tl.store(scale_ptr + t, tl.where(bad, 0x7FC0, bf16_bits_kernel(scale)).to(tl.int16), mask=tmask)
        store_codes_kernel(codes_ptr, q, t, tmask, G, BITS, H, C, UNIT, NUNITS, FLIP)

    @triton.jit
    def hadint_decode_kernel(
        out_ptr, signs_ptr, scale_ptr, codes_ptr, n_tiles, h, tiles_per_token,
        G: tl.constexpr, BITS: tl.constexpr, H: tl.constexpr, BT: tl.constexpr, C: tl.constexpr,
        EVEN: tl.constexpr, INDEX64: tl.constexpr, HADAMARD: tl.constexpr, ENTRY: tl.constexpr,
        OUT_KIND: tl.constexpr, NATIVE_BF16: tl.constexpr, UNIT: tl.constexpr, NUNITS: tl.constexpr,
        FLIP: tl.constexpr,
    ):
        t = tile_ids_kernel(BT, INDEX64)
        tmask = t < n_tiles
        scale = load_bf16_kernel(scale_ptr, t, tmask)
        limit: tl.constexpr = (1 << (BITS - 1)) - 1
        codes = load_codes_kernel(codes_ptr, t, tmask, G, BITS, H, C, UNIT, NUNITS, FLIP)
        v = (codes - limit).to(tl.float32) * bcast_kernel(scale)
        if HADAMARD:
            v = fwht_kernel(v, H, BT, C, ENTRY) * tl.load(signs_ptr + channels_kernel(H, C)) + 0.0
        store_block_kernel(out_ptr, v, t, tmask, h, tiles_per_token, G, H, C, EVEN, OUT_KIND, NATIVE_BF16, FLIP)

else:  # pragma: no cover - without triton
    hadint_encode_kernel = hadint_decode_kernel = None


def _signs(signs: torch.Tensor | None, tile_size: int, device) -> torch.Tensor:
    return torch.ones(tile_size, device=device) if signs is None else signs.to(device=device, dtype=torch.float32)


def triton_hadint_encode(
    x: torch.Tensor, sections: dict[str, torch.Tensor], bits: int, tile_size: int, signs: torch.Tensor | None,
    seed: int | None = None, per_lane: int | None = None, tiles_per_prog: int | None = None,
) -> None:
    """Fill the ``scale``/``codes`` sections (uint8 tensors) from contiguous ``x``; ``signs`` (fp32 [G]) is
    the codec's sign flip, None without the transform; ``seed`` switches to stochastic rounding."""
    check_launch(hadint_encode_kernel, "triton_hadint_encode", x, *sections.values())
    if not x.is_contiguous():
        raise ValueError("triton_hadint_encode needs a contiguous input")
    h, tiles_per_token, n_tiles, index64 = _common_args(x.shape, tile_size, sections_nbytes(sections))
    blk = blocking(hadint_encode_kernel, tile_size, per_lane, tiles_per_prog, widest=tile_size)
    unit, nunits = store_units(bits)
    x_in, bf16_bits = as_kernel_input(x)
    launch(
        f"hadint_encode G{tile_size} b{bits}{' SR' if seed is not None else ''}",
        hadint_encode_kernel, (blk.programs(n_tiles),),
        (x_in, _signs(signs, tile_size, x.device), as_units(sections["scale"], 2), as_units(sections["codes"], unit),
         n_tiles, h, tiles_per_token, 0 if seed is None else int(seed)),
        dict(G=tile_size, BITS=bits, H=blk.per_lane // 8, BT=blk.tiles, C=blk.lanes, EVEN=h % tile_size == 0,
             INDEX64=index64, HADAMARD=signs is not None, ENTRY=numerics.hadamard_entry(tile_size),
             STOCHASTIC=seed is not None, BF16_BITS=bf16_bits, MAX_BITS=numerics.MAX_ABS_BITS, UNIT=unit,
             NUNITS=nunits, FLIP=block_flip(), num_warps=blk.num_warps, enable_fp_fusion=False),
        blk.elements,
    )


def triton_hadint_decode(
    sections: dict[str, torch.Tensor], shape, dtype: torch.dtype, bits: int, tile_size: int,
    signs: torch.Tensor | None, out: torch.Tensor | None = None, per_lane: int | None = None,
    tiles_per_prog: int | None = None,
) -> torch.Tensor:
    """Decode ``hadint`` sections into ``out`` (contiguous, ``shape``/``dtype``) or a new tensor."""
    codes = sections["codes"]
    check_launch(hadint_decode_kernel, "triton_hadint_decode", codes)
    if out is None:
        out = torch.empty(tuple(shape), dtype=dtype, device=codes.device)
    h, tiles_per_token, n_tiles, index64 = _common_args(shape, tile_size, sections_nbytes(sections))
    blk = blocking(hadint_decode_kernel, tile_size, per_lane, tiles_per_prog, widest=tile_size)
    unit, nunits = store_units(bits)
    out_view, out_kind = as_kernel_output(out)
    native_bf16, _ = native_conversions(hadint_decode_kernel, codes.device)
    launch(
        f"hadint_decode G{tile_size} b{bits} ->{str(dtype).removeprefix('torch.')}",
        hadint_decode_kernel, (blk.programs(n_tiles),),
        (out_view, _signs(signs, tile_size, codes.device), as_units(sections["scale"], 2), as_units(codes, unit),
         n_tiles, h, tiles_per_token),
        dict(G=tile_size, BITS=bits, H=blk.per_lane // 8, BT=blk.tiles, C=blk.lanes, EVEN=h % tile_size == 0,
             INDEX64=index64, HADAMARD=signs is not None, ENTRY=numerics.hadamard_entry(tile_size),
             OUT_KIND=out_kind, NATIVE_BF16=native_bf16, UNIT=unit, NUNITS=nunits, FLIP=block_flip(),
             num_warps=blk.num_warps, enable_fp_fusion=False),
        blk.elements,
    )
    return out
