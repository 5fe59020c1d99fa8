"""Fused ``channel`` encode/decode: a per-channel range pass, then one pass that quantizes and packs.

Encode (wire format and algorithm: ``codecs/channel.py``; its layout, ``channel_sections``, is below and
the codec takes it from here):

1. ``channel_range_kernel``: a grid over blocks of ``BC`` channels (and, for enough programs on a
   large message, ``splits`` ranges of rows); each program loops over its rows ``BR`` at a time,
   keeping an elementwise running min, max and largest magnitude (bad values, NaN included, count
   as 0 in the range, as ``to_channels`` zeroes them) and reducing across rows once at the end. With
   one split it writes the bf16 ``scale`` and ``zero`` itself; with several it writes per-split
   partials and ``channel_merge_kernel`` combines them (min and max are exact in any order).
2. ``channel_encode_kernel``: a grid over (row blocks, channel blocks). A program holds ``BR`` rows
   of ``G`` channels as a ``[H, BR, C, 8]`` block (``common``'s tile block with rows for tiles: a lane
   holds ``E = 8 H`` consecutive channels of a row), loads the block's bf16 scale and zero once,
   and packs each lane's groups of 8 codes straight into the ``codes`` section, which is row-major
   (``h % 8 == 0``: a group never crosses a row). Otherwise (``RAGGED``) it walks the flat element
   order in tiles of ``G`` like the tile codecs, gathering every element's scale and zero.

Decode (``channel_decode_kernel``) is step 2 in reverse. Every fp32 operation is the reference's
(``common.quantize_tiles``: directed bf16 rounding, correctly rounded divisions, reciprocal
multiplies, no fused multiply-adds; stochastic rounding's noise is ``hash_uniform`` of the element's
row-major index), so the bytes are the torch reference's, compiled or interpreted.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .. import geometry, numerics
from .common import (
    DEFAULT_WARPS, HAVE_TRITON, Blocking, as_kernel_input, as_kernel_output, as_units, block_flip, blocking,
    check_launch, index_is_64bit, is_interpreted, launch, native_conversions, next_power_of_2, recording_active,
    sections_nbytes, store_units, tl, triton,
)

RANGE_ROWS, RANGE_CHANNELS = 32, 64  # the range pass's [BR, BC] block per loop iteration (compiled)
CODE_CHANNELS, CODE_ELEMENTS = 256, 8192  # the code pass: G channels per block, elements per program (compiled)
TARGET_PROGRAMS = 512  # the range pass splits rows until it has about this many programs (H100: 132 SMs)
MIN_SPLIT_ROWS = 256  # ... each looping over at least this many rows
INTERPRETED_ELEMENTS = 1 << 16  # under the interpreter a program's cost is its count: few large programs


def channel_code_count(shape: Sequence[int]) -> int:
    """Codes the ``channel`` codec packs for ``shape``: every element, padded with zero codes to a multiple of 8."""
    return geometry.cdiv(geometry.num_tokens(shape) * int(shape[-1]), 8) * 8


def channel_outliers(shape: Sequence[int], outlier_tokens: int) -> int:
    """Rows the ``channel`` codec sends apart for ``shape``: ``outlier_tokens`` per sequence, a message
    ``[s, b, ..., h]`` holding ``b * ...`` sequences (a 2-D one, one), at most ``rows - 1`` (one stays on the grids)."""
    sequences = math.prod(int(d) for d in shape[1:-1])
    return max(0, min(int(outlier_tokens) * sequences, geometry.num_tokens(shape) - 1))


def channel_sections(shape: Sequence[int], bits: int, outlier_tokens: int = 0) -> list[tuple[str, int]]:
    """The ``channel`` wire sections of ``shape``: a bf16 scale and zero per channel, the packed codes, then the
    outlier rows' indices and values (with ``outlier_tokens``)."""
    h, k = int(shape[-1]), channel_outliers(shape, outlier_tokens)
    sections = [("scale", 2 * h), ("zero", 2 * h), ("codes", geometry.packed_nbytes(channel_code_count(shape), bits))]
    return sections + ([("outlier_index", 4 * k), ("outlier_rows", 2 * k * h)] if k else [])


if HAVE_TRITON:
    from .common import (
        bcast_kernel, bf16_bits_kernel, bf16_from_bits_kernel, channels_kernel, group_index_kernel,
        hash_uniform_kernel, load_fp32_kernel, load_groups_kernel, magnitude_bits_kernel, pack_groups_kernel,
        quant_params_kernel, rint_int_kernel, store_groups_kernel, store_values_kernel, tile_ids_kernel,
        unpack_groups_kernel,
    )

    @triton.jit
    def store_params_kernel(scale_ptr, zero_ptr, col, cmask, lo, hi, worst, LEVELS: tl.constexpr,
                            MAX_BITS: tl.constexpr):
        """Write the channels' bf16 scale and zero from their range (``common.quantize_tiles``; a channel whose
        largest magnitude bits exceed MAX_BITS is bad: scale 0, zero NaN)."""
        bad = worst > MAX_BITS
        scale, zero, inverse, flat = quant_params_kernel(lo, hi, LEVELS, bad)
        tl.store(scale_ptr + col, bf16_bits_kernel(scale).to(tl.int16), mask=cmask)
        tl.store(zero_ptr + col, tl.where(bad, 0x7FC0, bf16_bits_kernel(zero)).to(tl.int16), mask=cmask)

    @triton.jit
    def channel_range_kernel(
        x_ptr, scale_ptr, zero_ptr, lo_ptr, hi_ptr, worst_ptr, rows, h, rows_per_split,
        BR: tl.constexpr, BC: tl.constexpr, LEVELS: tl.constexpr, INDEX64: tl.constexpr, BF16_BITS: tl.constexpr,
        MAX_BITS: tl.constexpr, FINAL: tl.constexpr,
    ):
        """Per channel of block ``program_id(0)``, over the rows of split ``program_id(1)``: min and max of the
        good values and the largest magnitude's bits; FINAL: the scale and zero, else the split's partials."""
        col = tl.program_id(0) * BC + tl.arange(0, BC)
        cmask = col < h
        split = tl.program_id(1)
        if INDEX64:
            split = split.to(tl.int64)
        first = split * rows_per_split
        last = tl.minimum(first + rows_per_split, rows)
        # Rows past the split's last read the last one again (a repeated value leaves a range unchanged): the
        # loop's only mask is the channels' (those past h are not stored).
        mask = cmask[None, :]
        lo = tl.full([BR, BC], float("inf"), tl.float32)
        hi = tl.full([BR, BC], float("-inf"), tl.float32)
        worst = tl.zeros([BR, BC], tl.int32)
        for start in range(first, last, BR):
            row = tl.minimum(start + tl.arange(0, BR), last - 1)
            v = load_fp32_kernel(x_ptr + (row * h)[:, None] + col[None, :], mask, BF16_BITS)
            magnitude = magnitude_bits_kernel(v)
            worst = tl.maximum(worst, magnitude)
            v = tl.where(magnitude > MAX_BITS, 0.0, v)
            lo = tl.minimum(lo, v)
            hi = tl.maximum(hi, v)
        lo = tl.min(lo, axis=0)
        hi = tl.max(hi, axis=0)
        worst = tl.max(worst, axis=0)
        if FINAL:
            store_params_kernel(scale_ptr, zero_ptr, col, cmask, lo, hi, worst, LEVELS, MAX_BITS)
        else:
            at = split * h + col
            tl.store(lo_ptr + at, lo, mask=cmask)
            tl.store(hi_ptr + at, hi, mask=cmask)
            tl.store(worst_ptr + at, worst, mask=cmask)

    @triton.jit
    def channel_merge_kernel(scale_ptr, zero_ptr, lo_ptr, hi_ptr, worst_ptr, h, splits, BC: tl.constexpr,
                             LEVELS: tl.constexpr, MAX_BITS: tl.constexpr):
        """Combine the ``splits`` partial ranges of every channel of block ``program_id(0)`` into scale and zero."""
        col = tl.program_id(0) * BC + tl.arange(0, BC)
        cmask = col < h
        lo = tl.load(lo_ptr + col, mask=cmask, other=0.0)
        hi = tl.load(hi_ptr + col, mask=cmask, other=0.0)
        worst = tl.load(worst_ptr + col, mask=cmask, other=0)
        for split in range(1, splits):
            at = split * h + col
            lo = tl.minimum(lo, tl.load(lo_ptr + at, mask=cmask, other=0.0))
            hi = tl.maximum(hi, tl.load(hi_ptr + at, mask=cmask, other=0.0))
            worst = tl.maximum(worst, tl.load(worst_ptr + at, mask=cmask, other=0))
        store_params_kernel(scale_ptr, zero_ptr, col, cmask, lo, hi, worst, LEVELS, MAX_BITS)

    @triton.jit
    def load_params_kernel(scale_ptr, zero_ptr, col, mask, FLIP: tl.constexpr):
        """fp32 scale and zero of the channels ``col`` (a block, or the ``[H, 1, C, 8]`` channels of a block)."""
        return load_fp32_kernel(scale_ptr + col, mask, True, FLIP), load_fp32_kernel(zero_ptr + col, mask, True, FLIP)

    @triton.jit
    def quantize_kernel(v, scale, zero, index, seed, LEVELS: tl.constexpr, STOCHASTIC: tl.constexpr):
        """int32 codes of ``v`` on its channels' grids (``common.quantize_tiles``): 0 on flat or bad channels
        (scale below the smallest normal fp32, 0 for a bad one); ``index``: the elements' row-major indices."""
        flat = ~(scale >= 1.1754943508222875e-38)
        inverse = tl.math.div_rn(1.0, tl.where(flat, 1.0, scale))
        scaled = (v - zero) * inverse  # >= 0: zero is the channel's min rounded down
        if STOCHASTIC:
            q = tl.where(flat, 0.0, scaled + hash_uniform_kernel(index, seed)).to(tl.int32)  # truncation: floor
        else:
            q = rint_int_kernel(scaled)
        return tl.where(flat, 0, tl.minimum(q, LEVELS))

    @triton.jit
    def row_groups_kernel(r, rmask, h, cb, G: tl.constexpr, H: tl.constexpr, C: tl.constexpr):
        """Index of each group of 8 codes of rows ``r`` and channel block ``cb`` (``[H, BR, C]``, h % 8 == 0) and
        whether it is in the tensor."""
        first = cb * G + tl.arange(0, C)[None, None, :] * (H * 8) + tl.arange(0, H)[:, None, None] * 8
        group = r[None, :, None] * (h // 8) + first // 8
        return group, rmask[None, :, None] & (first < h)

    @triton.jit(do_not_specialize=["seed"])
    def channel_encode_kernel(
        x_ptr, scale_ptr, zero_ptr, codes_ptr, rows, h, n, seed,
        BITS: tl.constexpr, G: tl.constexpr, H: tl.constexpr, BR: tl.constexpr, C: tl.constexpr,
        RAGGED: tl.constexpr, INDEX64: tl.constexpr, STOCHASTIC: tl.constexpr, BF16_BITS: tl.constexpr,
        UNIT: tl.constexpr, NUNITS: tl.constexpr, FLIP: tl.constexpr,
    ):
        levels: tl.constexpr = (1 << BITS) - 1
        r = tile_ids_kernel(BR, INDEX64)  # rows; RAGGED: tiles of G elements in row-major order
        if RAGGED:
            index = bcast_kernel(r * G) + channels_kernel(H, C)
            mask = index < n
            scale, zero = load_params_kernel(scale_ptr, zero_ptr, index % h, mask, FLIP)
            v = load_fp32_kernel(x_ptr + index, mask, BF16_BITS, FLIP)
            q = tl.where(mask, quantize_kernel(v, scale, zero, index, seed, levels, STOCHASTIC), 0)
            group = group_index_kernel(r, G, H, C)
            gmask = group < (n + 7) // 8  # the last group's padding: zero codes
        else:
            rmask = r < rows
            cb = tl.program_id(1)
            col = cb * G + channels_kernel(H, C)  # [H, 1, C, 8]
            scale, zero = load_params_kernel(scale_ptr, zero_ptr, col, col < h, FLIP)
            index = bcast_kernel(r * h) + col
            v = load_fp32_kernel(x_ptr + index, bcast_kernel(rmask) & (col < h), BF16_BITS, FLIP)
            q = quantize_kernel(v, scale, zero, index, seed, levels, STOCHASTIC)
            group, gmask = row_groups_kernel(r, rmask, h, cb, G, H, C)
        lo, hi = pack_groups_kernel(q, BITS)
        store_groups_kernel(codes_ptr, group, lo, hi, gmask, UNIT, NUNITS, FLIP)

    @triton.jit
    def channel_decode_kernel(
        out_ptr, scale_ptr, zero_ptr, codes_ptr, rows, h, n,
        BITS: tl.constexpr, G: tl.constexpr, H: tl.constexpr, BR: tl.constexpr, C: tl.constexpr,
        RAGGED: tl.constexpr, INDEX64: tl.constexpr, OUT_KIND: tl.constexpr, NATIVE_BF16: tl.constexpr,
        UNIT: tl.constexpr, NUNITS: tl.constexpr, FLIP: tl.constexpr,
    ):
        r = tile_ids_kernel(BR, INDEX64)
        if RAGGED:
            index = bcast_kernel(r * G) + channels_kernel(H, C)
            mask = index < n
            scale, zero = load_params_kernel(scale_ptr, zero_ptr, index % h, mask, FLIP)
            group = group_index_kernel(r, G, H, C)
            gmask = group < (n + 7) // 8
        else:
            rmask = r < rows
            cb = tl.program_id(1)
            col = cb * G + channels_kernel(H, C)
            scale, zero = load_params_kernel(scale_ptr, zero_ptr, col, col < h, FLIP)
            index = bcast_kernel(r * h) + col
            mask = bcast_kernel(rmask) & (col < h)
            group, gmask = row_groups_kernel(r, rmask, h, cb, G, H, C)
        lo, hi = load_groups_kernel(codes_ptr, group, gmask, UNIT, NUNITS, FLIP)
        v = unpack_groups_kernel(lo, hi, BITS).to(tl.float32) * scale + zero  # exact product: FMA-safe
        store_values_kernel(out_ptr + index, v, mask, OUT_KIND, NATIVE_BF16, FLIP)

else:  # pragma: no cover - without triton
    channel_range_kernel = channel_merge_kernel = channel_encode_kernel = channel_decode_kernel = None


# ----- blocking ---------------------------------------------------------------------------------------
def _interpreted(kernel) -> bool:
    return is_interpreted(kernel) and not recording_active()


def range_blocking(rows: int, h: int, rows_per_iteration: int | None = None, channels: int | None = None,
                   splits: int | None = None) -> tuple[int, int, int, int]:
    """(BR, BC, splits, rows per split) of the range pass; the arguments override the defaults."""
    if _interpreted(channel_range_kernel):
        bc = channels or min(next_power_of_2(h), 1024)
        br = rows_per_iteration or min(next_power_of_2(rows), max(1, INTERPRETED_ELEMENTS // bc))
        splits = splits or 1
    else:
        bc = channels or RANGE_CHANNELS
        br = rows_per_iteration or RANGE_ROWS
        if splits is None:
            splits = max(1, min(geometry.cdiv(rows, MIN_SPLIT_ROWS), geometry.cdiv(TARGET_PROGRAMS, geometry.cdiv(h, bc))))
    per_split = geometry.cdiv(geometry.cdiv(rows, splits), br) * br
    return br, bc, geometry.cdiv(rows, per_split), per_split


def code_blocking(kernel, h: int, per_lane: int | None = None, rows_per_prog: int | None = None) -> Blocking:
    """The code pass's block: ``G`` channels (``per_lane`` each in ``G / per_lane`` lanes) of ``tiles`` rows;
    with ``h % 8 != 0``, ``tiles`` tiles of ``G`` elements in row-major order (``common.blocking``)."""
    if h % 8:  # (every element gathers its scale and zero and divides: 16 per lane keeps registers below 128)
        return blocking(kernel, 64, per_lane or 16, rows_per_prog)
    g = max(8, min(next_power_of_2(h), 1024 if _interpreted(kernel) else CODE_CHANNELS))
    e = per_lane or (g if _interpreted(kernel) else 8)
    if e < 8 or g % e or e & (e - 1):
        raise ValueError(f"channels per lane must be a power of two in [8, {g}], got {e}")
    elements = INTERPRETED_ELEMENTS if _interpreted(kernel) else CODE_ELEMENTS
    rows = rows_per_prog or max(1, elements // g)
    if rows & (rows - 1):
        raise ValueError(f"rows per program must be a power of two, got {rows}")
    return Blocking(g, e, rows, DEFAULT_WARPS)


def _code_grid(blk: Blocking, rows: int, h: int) -> tuple[int, ...]:
    if h % 8:
        return (blk.programs(geometry.cdiv(rows * h, blk.tile_size)),)
    return (blk.programs(rows), geometry.cdiv(h, blk.tile_size))


def _code_kwargs(blk: Blocking, h: int, bits: int, index64: bool) -> dict:
    unit, nunits = store_units(bits)
    return dict(BITS=bits, G=blk.tile_size, H=blk.per_lane // 8, BR=blk.tiles, C=blk.lanes, RAGGED=h % 8 != 0,
                INDEX64=index64, UNIT=unit, NUNITS=nunits, FLIP=block_flip(), num_warps=blk.num_warps)


def _shape_args(shape, sections: dict[str, torch.Tensor]) -> tuple[int, int, int, bool]:
    h = int(shape[-1])
    rows = geometry.num_tokens(shape)
    return rows, h, rows * h, index_is_64bit(rows * h, sections_nbytes(sections))


# ----- launchers ---------------------------------------------------------------------------------------
def triton_channel_range(x: torch.Tensor, sections: dict[str, torch.Tensor], bits: int,
                         rows_per_iteration: int | None = None, channels: int | None = None,
                         splits: int | None = None) -> None:
    """Fill the ``scale``/``zero`` sections (uint8 tensors) from contiguous ``x``: the channels' ranges over
    the rows, in one launch, or two with several splits of the rows (the arguments override the blocking)."""
    check_launch(channel_range_kernel, "triton_channel_range", x, *sections.values())
    rows, h, _, index64 = _shape_args(x.shape, sections)
    br, bc, splits, per_split = range_blocking(rows, h, rows_per_iteration, channels, splits)
    x_in, bf16_bits = as_kernel_input(x)
    scale, zero = as_units(sections["scale"], 2), as_units(sections["zero"], 2)
    levels, final = 2**bits - 1, splits == 1
    if final:
        lo = hi = worst = scale  # (not read: the kernel writes scale and zero itself)
    else:
        partials = torch.empty((3, splits * h), dtype=torch.int32, device=x.device)
        lo, hi, worst = partials[0].view(torch.float32), partials[1].view(torch.float32), partials[2]
    launch(
        f"channel_range b{bits}{'' if final else ' split'}", channel_range_kernel,
        (geometry.cdiv(h, bc), splits),
        (x_in, scale, zero, lo, hi, worst, rows, h, per_split),
        dict(BR=br, BC=bc, LEVELS=levels, INDEX64=index64, BF16_BITS=bf16_bits, MAX_BITS=numerics.MAX_ABS_BITS,
             FINAL=final, num_warps=DEFAULT_WARPS, enable_fp_fusion=False),
        br * bc, loops=True,
    )
    if not final:
        merge = 1024 if _interpreted(channel_merge_kernel) else 512
        launch(
            f"channel_merge b{bits}", channel_merge_kernel, (geometry.cdiv(h, merge),),
            (scale, zero, lo, hi, worst, h, splits),
            dict(BC=merge, LEVELS=levels, MAX_BITS=numerics.MAX_ABS_BITS, num_warps=DEFAULT_WARPS,
                 enable_fp_fusion=False),
            0,
        )


def triton_channel_encode(
    x: torch.Tensor, sections: dict[str, torch.Tensor], bits: int, seed: int | None = None,
    per_lane: int | None = None, rows_per_prog: int | None = None, splits: int | None = None,
) -> None:
    """Fill the ``scale``/``zero``/``codes`` sections (uint8 tensors) from contiguous ``x``.

    ``seed`` (a uint32, from ``common.RoundingNoise``) switches to stochastic rounding; the bytes are the
    reference's either way. ``per_lane``/``rows_per_prog`` override the code pass's blocking, ``splits`` the
    range pass's split of the rows.
    """
    check_launch(channel_encode_kernel, "triton_channel_encode", x, *sections.values())
    if not x.is_contiguous():
        raise ValueError("triton_channel_encode needs a contiguous input")
    triton_channel_range(x, sections, bits, splits=splits)
    rows, h, n, index64 = _shape_args(x.shape, sections)
    blk = code_blocking(channel_encode_kernel, h, per_lane, rows_per_prog)
    unit, _ = store_units(bits)
    x_in, bf16_bits = as_kernel_input(x)
    launch(
        f"channel_encode b{bits}{' ragged' if h % 8 else ''}{' SR' if seed is not None else ''}",
        channel_encode_kernel, _code_grid(blk, rows, h),
        (x_in, as_units(sections["scale"], 2), as_units(sections["zero"], 2), as_units(sections["codes"], unit),
         rows, h, n, 0 if seed is None else int(seed)),
        dict(_code_kwargs(blk, h, bits, index64), STOCHASTIC=seed is not None, BF16_BITS=bf16_bits,
             enable_fp_fusion=False),
        blk.elements,
    )


def triton_channel_decode(
    sections: dict[str, torch.Tensor], shape, dtype: torch.dtype, bits: int, out: torch.Tensor | None = None,
    per_lane: int | None = None, rows_per_prog: int | None = None,
) -> torch.Tensor:
    """Decode ``channel`` sections into ``out`` (contiguous, ``shape``/``dtype``) or a new tensor."""
    codes = sections["codes"]
    check_launch(channel_decode_kernel, "triton_channel_decode", codes)
    if out is None:
        out = torch.empty(tuple(shape), dtype=dtype, device=codes.device)
    rows, h, n, index64 = _shape_args(shape, sections)
    blk = code_blocking(channel_decode_kernel, h, per_lane, rows_per_prog)
    unit, _ = store_units(bits)
    out_view, out_kind = as_kernel_output(out)
    native_bf16, _ = native_conversions(channel_decode_kernel, codes.device)
    launch(
        f"channel_decode b{bits}{' ragged' if h % 8 else ''} ->{str(dtype).removeprefix('torch.')}",
        channel_decode_kernel, _code_grid(blk, rows, h),
        (out_view, as_units(sections["scale"], 2), as_units(sections["zero"], 2), as_units(codes, unit), rows, h, n),
        dict(_code_kwargs(blk, h, bits, index64), OUT_KIND=out_kind, NATIVE_BF16=native_bf16),
        blk.elements,
    )
    return out
