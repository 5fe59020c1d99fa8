"""Fused ``fp8`` (TACO-style E4M3) encode/decode; wire format in ``codecs/fp8.py``.

One program handles ``BT`` groups: pre-scale, Hadamard (``tl.dot``), post-scale and
the E4M3 cast in registers, then one write of codes and two fp32 scales per group.
The E4M3 conversion is done on the fp32 bits (round to nearest even; inputs are
already clamped to +-448), so it is the same on every GPU (no native fp8 type
needed) and in the interpreter. The mean, hypot and Hadamard sum in another
order than torch, so scales may differ from the reference by ulps and a code
by one E4M3 step.
"""

from __future__ import annotations

import torch

from ..codecs.base import MAX_ABS_VALUE, WireLayout
from ..codecs.fp8 import FP8_MAX, PRESCALE_MAX, PRESCALE_MIN, RMS_EPS
from .common import (
    DOT_PRECISION, HAVE_TRITON, as_kernel_input, as_kernel_output, cdiv, check_launch, hadamard_entry,
    num_warps_for, tile_geometry, tiles_per_program, tl, triton,
)

FP32_NAN_BITS = 0x7FC00000  # what torch writes for float("nan") in an fp32 tensor

if HAVE_TRITON:
    from .common import (
        hadamard_kernel, load_tiles_kernel, rint_kernel, store_tiles_kernel, tile_columns_kernel,
    )

    @triton.jit
    def e4m3_bits_kernel(v):
        """E4M3FN byte (int32) of fp32 ``v`` with ``|v| <= 448``, round to nearest even."""
        sign = (v.to(tl.int32, bitcast=True) >> 31) & 1
        a = tl.abs(v)
        # Subnormals (and zero): multiples of 2^-9; q = 8 is 2^-6, the smallest normal, same byte.
        sub = rint_kernel(a * 512.0).to(tl.int32)
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
        """``sqrt(a^2 + b^2)`` for ``a, b >= 0`` without overflow."""
        big = tl.maximum(a, b)
        small = tl.minimum(a, b)
        ratio = tl.math.div_rn(small, tl.where(big > 0, big, 1.0))
        return big * tl.math.sqrt_rn(1.0 + ratio * ratio)

    @triton.jit
    def fp8_encode_kernel(
        x_ptr, pre_ptr, post_ptr, codes_ptr, n_groups, h, groups_per_token,
        G: tl.constexpr, BT: tl.constexpr, BF16_BITS: tl.constexpr, MAX_ABS: tl.constexpr,
        ENTRY: tl.constexpr, PRECISION: tl.constexpr, FMAX: tl.constexpr, RMS_FLOOR: tl.constexpr,
        PRE_MIN: tl.constexpr, PRE_MAX: tl.constexpr, NAN_BITS: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        tmask = t < n_groups
        v, bad = load_tiles_kernel(x_ptr, t, tmask, h, groups_per_token, G, MAX_ABS, BF16_BITS)
        _, col = tile_columns_kernel(t, groups_per_token, G)
        x = tl.reshape(tl.where(col < h, v, 0.0), [BT, G])  # zero padding (not the repeated channel)
        # Pre-scale: 448 / hypot(rms, 1e-3), rms = peak * sqrt(mean((x / peak)^2)), clamped.
        peak = tl.max(tl.abs(x), axis=1)
        safe_peak = tl.where(peak > 0, peak, 1.0)
        r = tl.math.div_rn(x, safe_peak[:, None])
        rms = safe_peak * tl.math.sqrt_rn(tl.math.div_rn(tl.sum(r * r, axis=1), G * 1.0))
        alpha = tl.math.div_rn(FMAX, hypot_kernel(rms, RMS_FLOOR))
        alpha = tl.minimum(tl.maximum(alpha, PRE_MIN), PRE_MAX)
        y = hadamard_kernel(x * alpha[:, None], G, ENTRY, PRECISION)
        post = tl.math.div_rn(tl.max(tl.abs(y), axis=1), FMAX)
        safe_post = tl.where(post > 0, post, 1.0)
        scaled = tl.math.div_rn(y, safe_post[:, None])
        scaled = tl.minimum(tl.maximum(scaled, -FMAX), FMAX)
        alpha_bits = tl.where(bad, NAN_BITS, alpha.to(tl.int32, bitcast=True))
        tl.store(pre_ptr + t, alpha_bits, mask=tmask)
        tl.store(post_ptr + t, post, mask=tmask)
        j = tl.arange(0, G)
        tl.store(codes_ptr + t[:, None] * G + j[None, :], e4m3_bits_kernel(scaled).to(tl.uint8),
                 mask=tmask[:, None])

    @triton.jit
    def fp8_decode_kernel(
        out_ptr, pre_ptr, post_ptr, codes_ptr, n_groups, h, groups_per_token,
        G: tl.constexpr, BT: tl.constexpr, OUT_KIND: tl.constexpr, ENTRY: tl.constexpr, PRECISION: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        tmask = t < n_groups
        alpha = tl.load(pre_ptr + t, mask=tmask, other=1.0)
        post = tl.load(post_ptr + t, mask=tmask, other=0.0)
        j = tl.arange(0, G)
        code = tl.load(codes_ptr + t[:, None] * G + j[None, :], mask=tmask[:, None], other=0).to(tl.int32)
        y = hadamard_kernel(e4m3_value_kernel(code) * post[:, None], G, ENTRY, PRECISION)
        x = tl.math.div_rn(y, alpha[:, None])
        store_tiles_kernel(out_ptr, tl.reshape(x, [BT, G // 8, 8]), t, tmask, h, groups_per_token, G, OUT_KIND)

else:  # pragma: no cover - without triton
    fp8_encode_kernel = fp8_decode_kernel = None


def _block(group_size: int, kernel, groups_per_prog: int | None) -> int:
    return max(16, tiles_per_program(group_size, kernel, groups_per_prog))  # tl.dot needs >= 16 rows


def triton_fp8_encode(x: torch.Tensor, buf: torch.Tensor, layout: WireLayout, group_size: int,
                      groups_per_prog: int | None = None) -> None:
    """Fill ``buf``'s ``prescale``/``postscale``/``codes`` sections from contiguous ``x``."""
    check_launch(fp8_encode_kernel, "triton_fp8_encode", x, buf)
    if not x.is_contiguous():
        raise ValueError("triton_fp8_encode needs a contiguous input")
    h, groups_per_token, n_groups = tile_geometry(x.shape, group_size)
    bt = _block(group_size, fp8_encode_kernel, groups_per_prog)
    x_in, bf16_bits = as_kernel_input(x)
    fp8_encode_kernel[(cdiv(n_groups, bt),)](
        x_in, layout.view(buf, "prescale", torch.int32), layout.view(buf, "postscale", torch.float32),
        layout.view(buf, "codes"), n_groups, h, groups_per_token,
        G=group_size, BT=bt, BF16_BITS=bf16_bits, MAX_ABS=MAX_ABS_VALUE, ENTRY=hadamard_entry(group_size),
        PRECISION=DOT_PRECISION, FMAX=FP8_MAX, RMS_FLOOR=RMS_EPS, PRE_MIN=PRESCALE_MIN, PRE_MAX=PRESCALE_MAX,
        NAN_BITS=FP32_NAN_BITS, num_warps=num_warps_for(bt * group_size),
    )


def triton_fp8_decode(buf: torch.Tensor, shape, dtype: torch.dtype, layout: WireLayout, group_size: int,
                      groups_per_prog: int | None = None) -> torch.Tensor:
    """Decode an ``fp8`` buffer into a new tensor of ``shape``/``dtype`` on buf's device."""
    check_launch(fp8_decode_kernel, "triton_fp8_decode", buf)
    h, groups_per_token, n_groups = tile_geometry(shape, group_size)
    out = torch.empty(tuple(shape), dtype=dtype, device=buf.device)
    out_view, out_kind = as_kernel_output(out)
    bt = _block(group_size, fp8_decode_kernel, groups_per_prog)
    fp8_decode_kernel[(cdiv(n_groups, bt),)](
        out_view, layout.view(buf, "prescale", torch.float32), layout.view(buf, "postscale", torch.float32),
        layout.view(buf, "codes"), n_groups, h, groups_per_token,
        G=group_size, BT=bt, OUT_KIND=out_kind, ENTRY=hadamard_entry(group_size), PRECISION=DOT_PRECISION,
        num_warps=num_warps_for(bt * group_size),
    )
    return out
