"""Fused ``fp8`` (TACO-style E4M3) encode/decode; wire format in ``codecs/fp8.py``.

One program handles ``BT`` groups as a ``[H, BT, C, 8]`` block (``common``): pre-scale (a
pairwise tree sum of squares), the butterfly Hadamard, post-scale and the E4M3 cast in
registers, then one write of codes and two fp32 scales per group. Every step is the torch
reference's fp32 operation in the reference's order, so the bytes are the same. The E4M3
conversion is the hardware's on sm_89 and later (round to nearest even after the clamp to
+-448, like torch's cast) and a bit-exact software version elsewhere and in the interpreter.
The wire layout and the pre-scale's constants are here, beside the kernels (``fp8_sections``,
``PRESCALE_MIN`` ...: the codec takes them from here); the launchers take those sections as uint8
tensors by name.
"""

from __future__ import annotations

import torch

from typing import Sequence

from .. import geometry, numerics
from .common import (
    HAVE_TRITON, as_kernel_input, as_kernel_output, block_flip, blocking, check_launch, index_is_64bit, launch,
    native_conversions, sections_nbytes, tl, triton,
)

PRESCALE_MIN = 1e-3  # the pre-scale alpha's range
PRESCALE_MAX = 1e3
RMS_EPS = 1e-3  # sqrt of the 1e-6 added to mean(x^2)
FP32_NAN_BITS = 0x7FC00000  # the NaN every encoder writes as a bad group's alpha


def fp8_sections(shape: Sequence[int], group_size: int) -> list[tuple[str, int]]:
    """The ``fp8`` wire sections of ``shape``: fp32 pre- and post-scales per group, then an E4M3 byte per value."""
    groups = geometry.total_tiles(shape, group_size)
    return [("prescale", 4 * groups), ("postscale", 4 * groups), ("codes", groups * group_size)]


if HAVE_TRITON:
    from .common import (
        bcast_kernel, channels_kernel, fwht_kernel, load_block_raw_kernel, load_fp32_kernel, magnitude_bits_kernel,
        store_block_raw_kernel, store_values_kernel, tile_ids_kernel, tile_max_kernel, tile_tree_sum_kernel,
    )

    @triton.jit
    def e4m3_bits_kernel(v):
        """E4M3FN byte (int32) of fp32 ``v`` with ``|v| <= 448``, round to nearest even."""
        sign = (v.to(tl.int32, bitcast=True) >> 31) & 1
        a = tl.abs(v)
        # Subnormals (and zero): multiples of 2^-9; q = 8 is 2^-6, the smallest normal, same byte.
        sub = ((a * 512.0 + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000)
        bits = a.to(tl.int32, bitcast=True)
        normal = ((bits + (0x7FFFF + ((bits >> 20) & 1))) >> 20) - ((127 - 7) << 3)
        code = tl.where(a < 0.015625, sub, normal)
        return code | (sign << 7)

    @triton.jit
    def e4m3_value_kernel(code):
        """fp32 value of E4M3FN bytes (int32); 0x7F / 0xFF are NaN."""
        exp = (code >> 3) & 15
        man = code & 7
        normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
        value = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)
        value = tl.where((code & 0x7F) == 0x7F, float("nan"), value)
        return tl.where((code & 0x80) != 0, -value, value)

    @triton.jit
    def hypot_kernel(a, b):
        """``codecs.fp8.hypot_reference``: ``sqrt(a^2 + b^2)`` for ``a, b >= 0`` without overflow."""
        big = tl.maximum(a, b)
        small = tl.minimum(a, b)
        ratio = tl.math.div_rn(small, tl.where(big > 0, big, 1.0))
        return big * tl.math.sqrt_rn(1.0 + ratio * ratio)

    @triton.jit
    def group_offsets_kernel(t, h, groups_per_token, G: tl.constexpr, H: tl.constexpr, C: tl.constexpr,
                             EVEN: tl.constexpr):
        """Element offsets of the groups' channels in the ``[..., h]`` tensor and their validity (padding)."""
        j = channels_kernel(H, C)
        if EVEN:
            offsets = bcast_kernel(t * G) + j
            valid = j >= 0
        else:
            token = t // groups_per_token
            col = bcast_kernel((t - token * groups_per_token) * G) + j
            offsets = bcast_kernel(token * h) + col
            valid = col < h
        return offsets, valid

    @triton.jit
    def fp8_encode_kernel(
        x_ptr, pre_ptr, post_ptr, codes_ptr, n_groups, h, groups_per_token,
        G: tl.constexpr, H: tl.constexpr, BT: tl.constexpr, C: tl.constexpr, EVEN: tl.constexpr,
        INDEX64: tl.constexpr, BF16_BITS: tl.constexpr, MAX_BITS: tl.constexpr, ENTRY: tl.constexpr,
        FMAX: tl.constexpr, RMS_FLOOR: tl.constexpr, PRE_MIN: tl.constexpr, PRE_MAX: tl.constexpr,
        HW_FP8: tl.constexpr, FLIP: tl.constexpr,
    ):
        t = tile_ids_kernel(BT, INDEX64)
        tmask = t < n_groups
        offsets, valid = group_offsets_kernel(t, h, groups_per_token, G, H, C, EVEN)
        x = load_fp32_kernel(x_ptr + offsets, bcast_kernel(tmask) & valid, BF16_BITS, FLIP)  # zero padding
        peak_bits = tile_max_kernel(magnitude_bits_kernel(x))
        bad = peak_bits > MAX_BITS
        peak = peak_bits.to(tl.float32, bitcast=True)
        safe_peak = tl.where(peak > 0, peak, 1.0)
        r = x * bcast_kernel(tl.math.div_rn(1.0, safe_peak))
        rms = safe_peak * tl.math.sqrt_rn(tile_tree_sum_kernel(r * r, H, BT, C) * (1.0 / G))
        alpha = tl.math.div_rn(tl.full(rms.shape, FMAX, tl.float32), hypot_kernel(rms, RMS_FLOOR))
        alpha = tl.minimum(tl.maximum(alpha, PRE_MIN), PRE_MAX)
        y = fwht_kernel(x * bcast_kernel(alpha), H, BT, C, ENTRY)
        post = tl.math.div_rn(tile_max_kernel(magnitude_bits_kernel(y)).to(tl.float32, bitcast=True), FMAX)
        inverse = tl.math.div_rn(1.0, tl.where(post >= 1.1754943508222875e-38, post, 1.0))
        scaled = y * bcast_kernel(inverse)
        scaled = tl.minimum(tl.maximum(scaled, -FMAX), FMAX)
        if HW_FP8:
            code = scaled.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            code = e4m3_bits_kernel(scaled).to(tl.uint8)
        code = tl.where(bcast_kernel(bad), 0, code)
        tl.store(pre_ptr + t, tl.where(bad, 0x7FC00000, alpha.to(tl.int32, bitcast=True)), mask=tmask)
        tl.store(post_ptr + t, tl.where(bad, 0.0, post), mask=tmask)
        j = channels_kernel(H, C)
        store_block_raw_kernel(codes_ptr + bcast_kernel(t * G) + j, code, bcast_kernel(tmask) & (j >= 0), FLIP)

    @triton.jit
    def fp8_decode_kernel(
        out_ptr, pre_ptr, post_ptr, codes_ptr, n_groups, h, groups_per_token,
        G: tl.constexpr, H: tl.constexpr, BT: tl.constexpr, C: tl.constexpr, EVEN: tl.constexpr,
        INDEX64: tl.constexpr, OUT_KIND: tl.constexpr, NATIVE_BF16: tl.constexpr, ENTRY: tl.constexpr,
        HW_FP8: tl.constexpr, FLIP: tl.constexpr,
    ):
        t = tile_ids_kernel(BT, INDEX64)
        tmask = t < n_groups
        alpha = tl.load(pre_ptr + t, mask=tmask, other=1.0)
        post = tl.load(post_ptr + t, mask=tmask, other=0.0)
        j = channels_kernel(H, C)
        raw = load_block_raw_kernel(codes_ptr + bcast_kernel(t * G) + j, bcast_kernel(tmask) & (j >= 0), 0, FLIP)
        if HW_FP8:
            q = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            q = e4m3_value_kernel(raw.to(tl.int32))
        y = fwht_kernel(q * bcast_kernel(post), H, BT, C, ENTRY)
        x = y * bcast_kernel(tl.math.div_rn(1.0, alpha))
        offsets, valid = group_offsets_kernel(t, h, groups_per_token, G, H, C, EVEN)
        store_values_kernel(out_ptr + offsets, x, bcast_kernel(tmask) & valid, OUT_KIND, NATIVE_BF16, FLIP)

else:  # pragma: no cover - without triton
    fp8_encode_kernel = fp8_decode_kernel = None


def _common_args(shape, group_size: int, nbytes: int):
    h = int(shape[-1])
    n_groups = geometry.total_tiles(shape, group_size)
    return h, geometry.num_tiles(h, group_size), n_groups, index_is_64bit(n_groups * group_size, nbytes)


def triton_fp8_encode(x: torch.Tensor, sections: dict[str, torch.Tensor], group_size: int,
                      per_lane: int | None = None, groups_per_prog: int | None = None) -> None:
    """Fill the ``prescale``/``postscale``/``codes`` sections (uint8 tensors) from contiguous ``x``."""
    check_launch(fp8_encode_kernel, "triton_fp8_encode", x, *sections.values())
    if not x.is_contiguous():
        raise ValueError("triton_fp8_encode needs a contiguous input")
    h, groups_per_token, n_groups, index64 = _common_args(x.shape, group_size, sections_nbytes(sections))
    blk = blocking(fp8_encode_kernel, group_size, per_lane, groups_per_prog)
    x_in, bf16_bits = as_kernel_input(x)
    _, hw_fp8 = native_conversions(fp8_encode_kernel, x.device)
    launch(
        f"fp8_encode G{group_size}", fp8_encode_kernel, (blk.programs(n_groups),),
        (x_in, sections["prescale"].view(torch.int32), sections["postscale"].view(torch.float32),
         sections["codes"], n_groups, h, groups_per_token),
        dict(G=group_size, H=blk.per_lane // 8, BT=blk.tiles, C=blk.lanes, EVEN=h % group_size == 0,
             INDEX64=index64, BF16_BITS=bf16_bits, MAX_BITS=numerics.MAX_ABS_BITS,
             ENTRY=numerics.hadamard_entry(group_size), FMAX=numerics.FP8_MAX, RMS_FLOOR=RMS_EPS,
             PRE_MIN=PRESCALE_MIN, PRE_MAX=PRESCALE_MAX, HW_FP8=hw_fp8, FLIP=block_flip(),
             num_warps=blk.num_warps, enable_fp_fusion=False),
        blk.elements,
    )


def triton_fp8_decode(sections: dict[str, torch.Tensor], shape, dtype: torch.dtype, group_size: int,
                      out: torch.Tensor | None = None, per_lane: int | None = None,
                      groups_per_prog: int | None = None) -> torch.Tensor:
    """Decode ``fp8`` sections into ``out`` (contiguous, ``shape``/``dtype``) or a new tensor."""
    codes = sections["codes"]
    check_launch(fp8_decode_kernel, "triton_fp8_decode", codes)
    if out is None:
        out = torch.empty(tuple(shape), dtype=dtype, device=codes.device)
    h, groups_per_token, n_groups, index64 = _common_args(shape, group_size, sections_nbytes(sections))
    blk = blocking(fp8_decode_kernel, group_size, per_lane, groups_per_prog)
    out_view, out_kind = as_kernel_output(out)
    native_bf16, hw_fp8 = native_conversions(fp8_decode_kernel, codes.device)
    launch(
        f"fp8_decode G{group_size} ->{str(dtype).removeprefix('torch.')}", fp8_decode_kernel,
        (blk.programs(n_groups),),
        (out_view, sections["prescale"].view(torch.float32), sections["postscale"].view(torch.float32), codes,
         n_groups, h, groups_per_token),
        dict(G=group_size, H=blk.per_lane // 8, BT=blk.tiles, C=blk.lanes, EVEN=h % group_size == 0,
             INDEX64=index64, OUT_KIND=out_kind, NATIVE_BF16=native_bf16,
             ENTRY=numerics.hadamard_entry(group_size), HW_FP8=hw_fp8, FLIP=block_flip(), num_warps=blk.num_warps,
             enable_fp_fusion=False),
        blk.elements,
    )
    return out
