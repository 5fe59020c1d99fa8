"""Fused ``tah`` (TAH-Quant) encode/decode; wire format in ``codecs/tah.py``.

Encode is two kernels with a small torch step between them:

1. ``tah_entropy_kernel``: entropy of every allocation unit (token, or tile): two
   passes over each unit (sum of magnitudes, then entropy; the second mostly from
   cache), fp32 ``[units]`` scratch. Skipped when no unit gets the low bit width.
2. torch: per-group stable sort of the entropies (the fixed-ratio selection of
   low-bit units), the ``flags`` section, and an exclusive prefix count of low
   units (int32 ``[units]``) that tells every tile where its codes go.
3. ``tah_encode_kernel``: per tile, outlier test, pivot swap, Hadamard (``tl.dot``
   with the ``+-1/sqrt(G)`` matrix built in registers), asymmetric quantization
   and bit packing straight into the ``high`` or ``low`` section.

Decode reads the flags back the same way and runs ``tah_decode_kernel``
(unpack, dequantize, Hadamard, swap back). Quantization and packing are the
reference's exact fp32 operations; the entropy and the Hadamard sum in another
order than torch, so rotated tiles may differ from the reference by an ulp before
quantization (a code may then move by one step).
"""

from __future__ import annotations

import torch

from ..codecs import common as ref_common
from ..codecs.base import MAX_ABS_VALUE, CodecError, WireLayout
from ..codecs.tah import EPS
from .common import (
    DOT_PRECISION, HAVE_TRITON, as_kernel_input, as_kernel_output, bf16_nan_bits, cdiv, check_launch,
    hadamard_entry, num_warps_for, tiles_per_program, tl, triton,
)

if HAVE_TRITON:
    from .common import (
        bf16_from_bits_kernel, dequantize_kernel, hadamard_kernel, load_as_fp32_kernel, load_tiles_kernel,
        load_unpack_kernel, pack_store_kernel, quantize_kernel, rounding_noise_kernel, store_scale_zero_kernel,
        store_tiles_kernel,
    )

    @triton.jit
    def swap_kernel(x, pivot, G: tl.constexpr):
        """Swap element 0 and element ``pivot[BT]`` of every row of ``x [BT, G]`` (exact, an involution).

        An element is picked by summing it with ``-0.0`` fillers: exact for every value, -0.0 and NaN
        included (a max-reduction would drop NaN on the GPU).
        """
        j = tl.arange(0, G)[None, :]
        first = tl.sum(tl.where(j == 0, x, -0.0), axis=1)
        at_pivot = tl.sum(tl.where(j == pivot[:, None], x, -0.0), axis=1)
        return tl.where(j == 0, at_pivot[:, None], tl.where(j == pivot[:, None], first[:, None], x))

    @triton.jit
    def magnitudes_kernel(x_ptr, base, cols, rmask, limit, BF16_BITS: tl.constexpr, MAX_ABS: tl.constexpr):
        """``|x|`` at ``base[R] + cols[1, C]`` for columns below ``limit[R]``; 0 elsewhere and for bad elements."""
        mask = rmask[:, None] & (cols < limit[:, None])
        v = load_as_fp32_kernel(x_ptr + base[:, None] + cols, mask, BF16_BITS)
        m = tl.abs(v)
        return tl.where((m > MAX_ABS) | (v != v), 0.0, m)

    @triton.jit
    def tah_entropy_kernel(
        x_ptr, ent_ptr, n_rows, h, rows_per_token, row_len,
        TR: tl.constexpr, CH: tl.constexpr, STEPS: tl.constexpr, BF16_BITS: tl.constexpr, MAX_ABS: tl.constexpr,
        EPSILON: tl.constexpr,
    ):
        """Entropy of ``TR`` rows (tokens, or tiles of ``row_len`` channels) per program, ``CH`` channels a step.

        ``STEPS = ceil(row_len / CH)`` is a compile-time constant (Triton 3.6's interpreter cannot loop to
        a runtime bound).
        """
        r = tl.program_id(0).to(tl.int64) * TR + tl.arange(0, TR)
        rmask = r < n_rows
        token = r // rows_per_token
        start = (r % rows_per_token) * row_len
        limit = tl.minimum(h - start, row_len)
        base = token * h + start
        c = tl.arange(0, CH)[None, :]
        total = tl.zeros([TR], dtype=tl.float32)
        for step in range(STEPS):
            m = magnitudes_kernel(x_ptr, base, step * CH + c, rmask, limit, BF16_BITS, MAX_ABS)
            total += tl.sum(m, axis=1)
        denom = total + EPSILON
        ent = tl.zeros([TR], dtype=tl.float32)
        for step in range(STEPS):
            m = magnitudes_kernel(x_ptr, base, step * CH + c, rmask, limit, BF16_BITS, MAX_ABS)
            p = tl.math.div_rn(m, denom[:, None])
            ent += tl.sum(p * tl.log(p + EPSILON), axis=1)
        tl.store(ent_ptr + r, -ent, mask=rmask)

    @triton.jit
    def tile_ranks_kernel(t, tmask, low_ptr, before_ptr, tiles_per_unit):
        """Per tile: low flag, and its index among the high-bit and among the low-bit tiles."""
        unit = t // tiles_per_unit
        sub = t % tiles_per_unit
        low = tl.load(low_ptr + unit, mask=tmask, other=0) != 0
        before = tl.load(before_ptr + unit, mask=tmask, other=0).to(tl.int64)
        low_rank = before * tiles_per_unit + sub
        high_rank = (unit - before) * tiles_per_unit + sub
        return low, low_rank, high_rank

    @triton.jit
    def tah_encode_kernel(
        x_ptr, buf_ptr, scale_ptr, zero_ptr, meta_ptr, low_ptr, before_ptr,
        n_tiles, h, tiles_per_token, tiles_per_unit, high_start, low_start, tau, seed, nan_bits,
        G: tl.constexpr, HIGH_BITS: tl.constexpr, LOW_BITS: tl.constexpr, BT: tl.constexpr,
        ALWAYS_ROTATE: tl.constexpr, STOCHASTIC: tl.constexpr, BF16_BITS: tl.constexpr,
        MAX_ABS: tl.constexpr, EPSILON: tl.constexpr, ENTRY: tl.constexpr, PRECISION: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        tmask = t < n_tiles
        v, bad = load_tiles_kernel(x_ptr, t, tmask, h, tiles_per_token, G, MAX_ABS, BF16_BITS)
        x = tl.reshape(v, [BT, G])
        # Outlier test: |a1| / (|a2| + eps), a2 the largest magnitude after removing the first maximum.
        j = tl.arange(0, G)[None, :]
        mag = tl.abs(x)
        a1 = tl.max(mag, axis=1)
        pivot = tl.min(tl.where(mag == a1[:, None], j, G), axis=1)
        a2 = tl.max(tl.where(j == pivot[:, None], -1.0, mag), axis=1)
        if ALWAYS_ROTATE:
            rotate = a1 == a1
        else:
            rotate = tl.math.div_rn(a1, a2 + EPSILON) > tau
        pivot = tl.where(rotate, pivot, 0)
        rotated = hadamard_kernel(swap_kernel(x, pivot, G), G, ENTRY, PRECISION)
        x = tl.where(rotate[:, None], rotated, x)
        v = tl.reshape(x, [BT, G // 8, 8])

        low, low_rank, high_rank = tile_ranks_kernel(t, tmask, low_ptr, before_ptr, tiles_per_unit)
        levels = tl.where(low, (1 << LOW_BITS) - 1, (1 << HIGH_BITS) - 1).to(tl.float32)
        noise = v
        if STOCHASTIC:
            noise = rounding_noise_kernel(seed, t, G)
        q, scale, zero = quantize_kernel(v, levels, noise, STOCHASTIC)
        store_scale_zero_kernel(scale_ptr, zero_ptr, t, tmask, scale, zero, bad, nan_bits)
        meta = (rotate.to(tl.int32) << 7) | pivot.to(tl.int32)
        tl.store(meta_ptr + t, meta.to(tl.uint8), mask=tmask)
        bits = tl.where(low, LOW_BITS, HIGH_BITS)
        byte_off = tl.where(low, low_start + low_rank * (G * LOW_BITS // 8),
                            high_start + high_rank * (G * HIGH_BITS // 8))
        pack_store_kernel(buf_ptr, byte_off, q, bits, tmask, G // 8)

    @triton.jit
    def tah_decode_kernel(
        out_ptr, buf_ptr, scale_ptr, zero_ptr, meta_ptr, low_ptr, before_ptr,
        n_tiles, h, tiles_per_token, tiles_per_unit, high_start, low_start,
        G: tl.constexpr, HIGH_BITS: tl.constexpr, LOW_BITS: tl.constexpr, BT: tl.constexpr,
        OUT_KIND: tl.constexpr, ENTRY: tl.constexpr, PRECISION: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        tmask = t < n_tiles
        low, low_rank, high_rank = tile_ranks_kernel(t, tmask, low_ptr, before_ptr, tiles_per_unit)
        bits = tl.where(low, LOW_BITS, HIGH_BITS)
        byte_off = tl.where(low, low_start + low_rank * (G * LOW_BITS // 8),
                            high_start + high_rank * (G * HIGH_BITS // 8))
        codes = load_unpack_kernel(buf_ptr, byte_off, bits, tmask, G // 8)
        scale = bf16_from_bits_kernel(tl.load(scale_ptr + t, mask=tmask, other=0))
        zero = bf16_from_bits_kernel(tl.load(zero_ptr + t, mask=tmask, other=0))
        meta = tl.load(meta_ptr + t, mask=tmask, other=0).to(tl.int32)
        rotate = (meta >> 7) != 0
        pivot = meta & (G - 1)
        x = tl.reshape(dequantize_kernel(codes, scale, zero), [BT, G])
        back = swap_kernel(hadamard_kernel(x, G, ENTRY, PRECISION), pivot, G)
        x = tl.where(rotate[:, None], back, x)
        store_tiles_kernel(out_ptr, tl.reshape(x, [BT, G // 8, 8]), t, tmask, h, tiles_per_token, G, OUT_KIND)

else:  # pragma: no cover - without triton
    tah_entropy_kernel = tah_encode_kernel = tah_decode_kernel = None


def _unit_geometry(codec, shape) -> tuple[int, int, int, int]:
    """(tiles per token, all tiles, allocation units, tiles per unit)."""
    s, b, h = codec._dims(tuple(shape))
    tiles_per_token = ref_common.num_tiles(h, codec.tile_size)
    total, _, units = codec.tile_counts(shape)
    return tiles_per_token, total, units, tiles_per_token if codec.allocation == "token" else 1


def _tile_block(codec, kernel, tiles_per_prog):
    # tl.dot needs at least 16 rows.
    return max(16, tiles_per_program(codec.tile_size, kernel, tiles_per_prog))


def triton_tah_entropy(codec, x: torch.Tensor, rows_per_prog: int | None = None) -> torch.Tensor:
    """fp32 entropy per allocation unit of ``x`` (``[s*b]`` tokens or ``[s*b*n_tiles]`` tiles)."""
    check_launch(tah_entropy_kernel, "triton_tah_entropy", x)
    s, b, h = x.shape
    tiles_per_token, total, units, _ = _unit_geometry(codec, x.shape)
    if codec.allocation == "token":
        rows_per_token, row_len = 1, h
    else:
        rows_per_token, row_len = tiles_per_token, codec.tile_size
    chunk = min(triton.next_power_of_2(row_len), 1024)
    rows = tiles_per_program(chunk, tah_entropy_kernel, rows_per_prog)  # rows of one chunk, like tiles
    ent = torch.empty(units, dtype=torch.float32, device=x.device)
    x_in, bf16_bits = as_kernel_input(x)
    tah_entropy_kernel[(cdiv(units, rows),)](
        x_in, ent, units, h, rows_per_token, row_len,
        TR=rows, CH=chunk, STEPS=cdiv(row_len, chunk), BF16_BITS=bf16_bits, MAX_ABS=MAX_ABS_VALUE, EPSILON=EPS,
        num_warps=num_warps_for(rows * chunk),
    )
    return ent


def select_low_units(codec, entropy: torch.Tensor, shape) -> torch.Tensor:
    """Bool per unit: the ``low_units_per_group`` lowest-entropy units of each group (stable: lower index first;
    the highest-entropy ones with ``low_bits_for="high_entropy"``)."""
    s, b, _ = shape
    n_low = codec.low_units_per_group(shape)
    groups = entropy.reshape(s, b).t() if codec.allocation == "token" else entropy.reshape(s * b, -1)
    order = torch.sort(codec.selection_key(groups), dim=1, stable=True).indices[:, :n_low]
    low = torch.zeros(groups.shape, dtype=torch.bool, device=entropy.device).scatter_(1, order, True)
    return low.t().reshape(-1) if codec.allocation == "token" else low.reshape(-1)


def _low_counts(low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(low flag as uint8, number of low units before each unit as int32)."""
    low_u8 = low.to(torch.uint8)
    before = torch.cumsum(low_u8, 0, dtype=torch.int32) - low_u8
    return low_u8, before


def triton_tah_encode(codec, x: torch.Tensor, buf: torch.Tensor, layout: WireLayout, seed: int | None = None,
                      tiles_per_prog: int | None = None, rows_per_prog: int | None = None) -> torch.Tensor:
    """Fill ``buf``'s sections from contiguous ``[s, b, h]`` ``x`` for ``codec`` (a ``TahCodec``).

    Returns the rotated fraction as a 0-d fp32 tensor (no host sync). ``seed`` (an int)
    switches to stochastic rounding with in-kernel Philox noise. ``tiles_per_prog`` and
    ``rows_per_prog`` override the block sizes of the encode and entropy kernels.
    """
    check_launch(tah_encode_kernel, "triton_tah_encode", x, buf)
    shape = codec._dims(tuple(x.shape))
    h = shape[2]
    tiles_per_token, total, units, tiles_per_unit = _unit_geometry(codec, shape)
    if codec.low_units_per_group(shape) == 0:
        low = torch.zeros(units, dtype=torch.bool, device=x.device)
    else:
        low = select_low_units(codec, triton_tah_entropy(codec, x, rows_per_prog), shape)
    layout.view(buf, "flags").copy_(ref_common.pack_flags(low))
    low_u8, before = _low_counts(low)
    bt = _tile_block(codec, tah_encode_kernel, tiles_per_prog)
    x_in, bf16_bits = as_kernel_input(x)
    meta = layout.view(buf, "meta")
    tah_encode_kernel[(cdiv(total, bt),)](
        x_in, buf, layout.view(buf, "scale", torch.int16), layout.view(buf, "zero", torch.int16), meta,
        low_u8, before, total, h, tiles_per_token, tiles_per_unit,
        layout.offsets["high"][0], layout.offsets["low"][0], codec.outlier_threshold,
        0 if seed is None else int(seed), bf16_nan_bits(x.device),
        G=codec.tile_size, HIGH_BITS=codec.high_bits, LOW_BITS=codec.low_bits, BT=bt,
        ALWAYS_ROTATE=codec.outlier_threshold == 0, STOCHASTIC=seed is not None, BF16_BITS=bf16_bits,
        MAX_ABS=MAX_ABS_VALUE, EPSILON=EPS, ENTRY=hadamard_entry(codec.tile_size), PRECISION=DOT_PRECISION,
        num_warps=num_warps_for(bt * codec.tile_size),
    )
    return (meta >> 7).float().mean()


def triton_tah_decode(codec, buf: torch.Tensor, shape, dtype: torch.dtype, layout: WireLayout,
                      tiles_per_prog: int | None = None) -> torch.Tensor:
    """Decode a ``tah`` buffer into a new tensor; ``CodecError`` on corrupt flags or pivots, as the reference."""
    check_launch(tah_decode_kernel, "triton_tah_decode", buf)
    shape = codec._dims(tuple(shape))
    h = shape[2]
    tiles_per_token, total, units, tiles_per_unit = _unit_geometry(codec, shape)
    _, n_low, _ = codec.tile_counts(shape)
    low = ref_common.unpack_flags(layout.view(buf, "flags"), units)
    meta = layout.view(buf, "meta")
    # One host sync for both checks; they keep a corrupt buffer from reading outside its sections.
    low_tiles, max_pivot = torch.stack([low.sum() * tiles_per_unit, (meta & 0x7F).max().long()]).tolist()
    if low_tiles != n_low:
        raise CodecError(f"corrupt tah buffer: {low_tiles} low-bit tiles flagged, {n_low} expected")
    if max_pivot >= codec.tile_size:
        raise CodecError(f"corrupt tah buffer: pivot index {max_pivot} outside a tile of {codec.tile_size}")
    low_u8, before = _low_counts(low)
    out = torch.empty(shape, dtype=dtype, device=buf.device)
    out_view, out_kind = as_kernel_output(out)
    bt = _tile_block(codec, tah_decode_kernel, tiles_per_prog)
    tah_decode_kernel[(cdiv(total, bt),)](
        out_view, buf, layout.view(buf, "scale", torch.int16), layout.view(buf, "zero", torch.int16), meta,
        low_u8, before, total, h, tiles_per_token, tiles_per_unit,
        layout.offsets["high"][0], layout.offsets["low"][0],
        G=codec.tile_size, HIGH_BITS=codec.high_bits, LOW_BITS=codec.low_bits, BT=bt,
        OUT_KIND=out_kind, ENTRY=hadamard_entry(codec.tile_size), PRECISION=DOT_PRECISION,
        num_warps=num_warps_for(bt * codec.tile_size),
    )
    return out
