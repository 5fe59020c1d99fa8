"""Fused ``tah`` (TAH-Quant) kernels; wire format and algorithm in ``codecs/tah.py``.

Encode (``TahCodec._encode_triton`` runs the steps):

1. ``tah_partials_kernel``: per tile, ``S = sum |x|`` and ``L = sum |x| log2 |x|`` (pairwise
   trees, ``common.log2_approx``): the input's first read. Skipped when no unit gets the low width.
2. torch, on the device (shared with the reference, no host sync): each unit's entropy from the
   partials, the fixed-ratio selection, the ``flags`` section, and the tables of high- and
   low-bit units in order.
3. ``tah_encode_kernel``, once per bit width over that width's tiles in wire order: outlier test,
   pivot swap (the two swapped values reloaded from L1), butterfly Hadamard, quantization and
   packing straight into the ``high`` or ``low`` section, plus scale, zero and meta. The
   input's second read; the codes are written once, contiguously.

Decode reads the flags, builds the same tables and runs ``tah_decode_kernel`` once per width
(unpack, dequantize, butterfly Hadamard, write); a rotated tile's two swapped elements are then
exchanged in the output (after a barrier, from L1/L2). Every fp32 operation is the torch
reference's, in its order: the bytes are identical.

The wire layout is here, beside the kernels (``tah_sections`` and its counts, ``TAH_EPS``: the codec takes
them from here); the launchers take those sections as uint8 tensors by name and the codec's options as
plain values.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .. import geometry, numerics
from . import tah_alloc
from .common import (
    HAVE_TRITON, as_kernel_input, as_kernel_output, as_units, block_flip, blocking, check_launch, index_is_64bit,
    launch, native_conversions, sections_nbytes, store_units, tl, triton,
)

TAH_EPS = 1e-8  # added to the second-largest magnitude in the outlier test
TAH_ALLOCATIONS = ("token", "tile")


def tah_low_units_per_group(s: int, tiles_per_token: int, high_ratio: float, allocation: str) -> int:
    """Low-bit units per selection group: of the ``s`` tokens of a sample, or of a token's tiles."""
    units = s if allocation == "token" else tiles_per_token
    return int(math.floor(units * (1.0 - high_ratio) + 1e-9))


def tah_tile_counts(shape: Sequence[int], tile_size: int, high_ratio: float, allocation: str
                    ) -> tuple[int, int, int]:
    """(all tiles, low-bit tiles, allocation units) of an ``[s, b, h]`` tensor."""
    s, b, h = (int(d) for d in shape)
    tiles_per_token = geometry.num_tiles(h, tile_size)
    total = s * b * tiles_per_token
    n_low = tah_low_units_per_group(s, tiles_per_token, high_ratio, allocation)
    if allocation == "token":
        return total, n_low * b * tiles_per_token, s * b
    return total, n_low * s * b, total


def tah_sections(shape: Sequence[int], tile_size: int, high_bits: int, low_bits: int, high_ratio: float,
                 allocation: str) -> list[tuple[str, int]]:
    """The ``tah`` wire sections of an ``[s, b, h]`` shape: the allocation's flags, a bf16 scale and zero and a
    meta byte per tile, then the high- and the low-bit codes."""
    total, low, units = tah_tile_counts(shape, tile_size, high_ratio, allocation)
    return [
        ("flags", geometry.flags_nbytes(units)),
        ("scale", 2 * total),
        ("zero", 2 * total),
        ("meta", total),
        ("high", geometry.packed_nbytes((total - low) * tile_size, high_bits)),
        ("low", geometry.packed_nbytes(low * tile_size, low_bits)),
    ]


if HAVE_TRITON:
    from .common import (
        bcast_kernel, bf16_bits_kernel, channels_kernel, fwht_kernel, hash_uniform_kernel, load_bf16_kernel,
        load_codes_kernel, load_fp32_kernel, log2_approx_kernel, magnitude_bits_kernel, quant_params_kernel,
        quantize_codes_kernel, store_codes_kernel, store_values_kernel, tile_ids_kernel, tile_max_kernel,
        tile_min_kernel, tile_tree_sum_kernel,
    )
    from .fixedpoint import load_block_kernel
    from .tah_alloc import entropy_kernel

    @triton.jit
    def tah_partials_kernel(
        x_ptr, out_ptr, n_tiles, h, tiles_per_token,
        G: tl.constexpr, H: tl.constexpr, BT: tl.constexpr, C: tl.constexpr, EVEN: tl.constexpr,
        INDEX64: tl.constexpr, BF16_BITS: tl.constexpr, MAX_BITS: tl.constexpr,
        C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr, C5: tl.constexpr,
        FLIP: tl.constexpr, ENTROPY: tl.constexpr,
    ):
        """``TahCodec.tile_partials``: (S, L) of every tile into ``out[0, t]``, ``out[1, t]``; or, with
        ENTROPY (tile allocation: a tile is its own unit), the tile's entropy into ``out[t]``."""
        t = tile_ids_kernel(BT, INDEX64)
        tmask = t < n_tiles
        v = load_block_kernel(x_ptr, t, tmask, h, tiles_per_token, G, H, C, EVEN, BF16_BITS, FLIP)
        bits = magnitude_bits_kernel(v)
        m = tl.where(bits > MAX_BITS, 0, bits).to(tl.float32, bitcast=True)  # bad values count as 0
        if not EVEN:  # padding channels too
            token = t // tiles_per_token
            col = bcast_kernel((t - token * tiles_per_token) * G) + channels_kernel(H, C)
            m = tl.where(col < h, m, 0.0)
        weighted = m * log2_approx_kernel(m, C1, C2, C3, C4, C5)
        total = tile_tree_sum_kernel(m, H, BT, C)
        weighted = tile_tree_sum_kernel(weighted, H, BT, C)
        if ENTROPY:
            tl.store(out_ptr + t, entropy_kernel(total, weighted, C1, C2, C3, C4, C5), mask=tmask)
        else:
            tl.store(out_ptr + t, total, mask=tmask)
            tl.store(out_ptr + n_tiles + t, weighted, mask=tmask)

    @triton.jit
    def tile_index_kernel(r, rmask, table_ptr, tiles_per_unit, n_units, INDEX64: tl.constexpr):
        """Tile index of the ``r``-th tile of one bit width (wire order): tile ``r % tpu`` of unit ``table[r // tpu]``.

        The unit is clamped to ``[0, n_units)``: tables built from corrupt flags stay inside the tensor.
        """
        unit = r // tiles_per_unit
        u = tl.load(table_ptr + unit, mask=rmask, other=0)
        u = tl.minimum(tl.maximum(u, 0), n_units - 1)
        if INDEX64:
            u = u.to(tl.int64)
        return u * tiles_per_unit + (r - unit * tiles_per_unit)

    @triton.jit(do_not_specialize=["seed"])
    def tah_encode_kernel(
        x_ptr, scale_ptr, zero_ptr, meta_ptr, codes_ptr, table_ptr, rotated_ptr,
        n_rank, h, tiles_per_token, tiles_per_unit, n_units, first_slot, seed,
        G: tl.constexpr, BITS: tl.constexpr, H: tl.constexpr, BT: tl.constexpr, C: tl.constexpr,
        EVEN: tl.constexpr, INDEX64: tl.constexpr, STOCHASTIC: tl.constexpr, BF16_BITS: tl.constexpr,
        MAX_BITS: tl.constexpr, TAU: tl.constexpr, EPSILON: tl.constexpr, ALWAYS: tl.constexpr,
        NEVER: tl.constexpr, ENTRY: tl.constexpr, UNIT: tl.constexpr, NUNITS: tl.constexpr, FLIP: tl.constexpr,
    ):
        r = tile_ids_kernel(BT, INDEX64)  # rank among this width's tiles = position in its section
        rmask = r < n_rank
        t = tile_index_kernel(r, rmask, table_ptr, tiles_per_unit, n_units, INDEX64)
        v = load_block_kernel(x_ptr, t, rmask, h, tiles_per_token, G, H, C, EVEN, BF16_BITS, FLIP)
        j = channels_kernel(H, C)
        bits = magnitude_bits_kernel(v)
        top = tile_max_kernel(bits)
        bad = top > MAX_BITS
        if NEVER:
            rotate = bad & False
            pivot = top * 0
        else:
            pivot = tile_min_kernel(tl.where(bits == bcast_kernel(top), j, G))  # the first maximum
            if ALWAYS:
                rotate = ~bad
            else:
                second = tile_max_kernel(tl.where(j == bcast_kernel(pivot), 0, bits))  # top again on a tie
                a1 = top.to(tl.float32, bitcast=True)
                a2 = second.to(tl.float32, bitcast=True)
                rotate = (~bad) & (a1 > (a2 + EPSILON) * TAU)
            rotate = rotate & rmask
            pivot = tl.where(rotate, pivot, 0)
            # Swap element 0 and the pivot: both reloaded (from L1) at their place in the input.
            if EVEN:
                start = t * G
            else:
                token = t // tiles_per_token
                start = token * h + (t - token * tiles_per_token) * G
            first = load_fp32_kernel(x_ptr + start, rotate, BF16_BITS)
            at_pivot = load_fp32_kernel(x_ptr + start + pivot, rotate, BF16_BITS)
            swapped = tl.where(j == 0, bcast_kernel(at_pivot), tl.where(j == bcast_kernel(pivot), bcast_kernel(first), v))
            v = tl.where(bcast_kernel(rotate), fwht_kernel(swapped, H, BT, C, ENTRY), v)
        # Rotated tiles of this program in its own slot (summed when the statistic is read: no atomics).
        tl.store(rotated_ptr + first_slot + tl.program_id(0), tl.sum(rotate.to(tl.int32), axis=0))
        levels: tl.constexpr = (1 << BITS) - 1
        scale, zero, inverse, flat = quant_params_kernel(tile_min_kernel(v), tile_max_kernel(v), levels, bad)
        noise = v
        if STOCHASTIC:
            noise = hash_uniform_kernel(bcast_kernel(t * G) + j, seed)
        q = quantize_codes_kernel(v, zero, inverse, flat, levels, noise, STOCHASTIC)
        tl.store(scale_ptr + t, bf16_bits_kernel(scale).to(tl.int16), mask=rmask)
        tl.store(zero_ptr + t, tl.where(bad, 0x7FC0, bf16_bits_kernel(zero)).to(tl.int16), mask=rmask)
        tl.store(meta_ptr + t, ((rotate.to(tl.int32) << 7) | pivot).to(tl.uint8), mask=rmask)
        store_codes_kernel(codes_ptr, q, r, rmask, G, BITS, H, C, UNIT, NUNITS, FLIP)

    @triton.jit
    def tah_decode_kernel(
        out_ptr, scale_ptr, zero_ptr, meta_ptr, codes_ptr, table_ptr, error_ptr,
        n_rank, h, tiles_per_token, tiles_per_unit, n_units,
        G: tl.constexpr, BITS: tl.constexpr, H: tl.constexpr, BT: tl.constexpr, C: tl.constexpr,
        EVEN: tl.constexpr, INDEX64: tl.constexpr, OUT_KIND: tl.constexpr, NATIVE_BF16: tl.constexpr,
        ENTRY: tl.constexpr, UNIT: tl.constexpr, NUNITS: tl.constexpr, ROTATES: tl.constexpr, FLIP: tl.constexpr,
    ):
        r = tile_ids_kernel(BT, INDEX64)
        rmask = r < n_rank
        t = tile_index_kernel(r, rmask, table_ptr, tiles_per_unit, n_units, INDEX64)
        scale = load_bf16_kernel(scale_ptr, t, rmask)
        zero = load_bf16_kernel(zero_ptr, t, rmask)
        codes = load_codes_kernel(codes_ptr, r, rmask, G, BITS, H, C, UNIT, NUNITS, FLIP)
        v = tl.fma(codes.to(tl.float32), bcast_kernel(scale), bcast_kernel(zero))  # exact product
        j = channels_kernel(H, C)
        if EVEN:
            start = t * G
            valid = j >= 0
            limit = t * 0 + G
        else:
            token = t // tiles_per_token
            col0 = (t - token * tiles_per_token) * G
            start = token * h + col0
            valid = bcast_kernel(col0) + j < h
            limit = h - col0
        if ROTATES:
            meta = tl.load(meta_ptr + t, mask=rmask, other=0).to(tl.int32)
            rotate = (meta >> 7) != 0
            pivot = meta & (G - 1)
            corrupt = tl.sum(((meta & 0x7F) >= G).to(tl.int32), axis=0)  # pivots outside the tile
            tl.atomic_add(error_ptr, corrupt, mask=corrupt > 0)
            v = tl.where(bcast_kernel(rotate), fwht_kernel(v, H, BT, C, ENTRY), v)
        store_values_kernel(out_ptr + bcast_kernel(start) + j, v, bcast_kernel(rmask) & valid, OUT_KIND, NATIVE_BF16,
                            FLIP)
        if ROTATES:
            # Undo the pivot swap in the output: elements 0 and ``pivot`` of every rotated tile.
            tl.debug_barrier()
            swap = rmask & rotate & (pivot > 0) & (pivot < limit)
            first = tl.load(out_ptr + start, mask=swap)
            at_pivot = tl.load(out_ptr + start + pivot, mask=swap)
            tl.store(out_ptr + start, at_pivot, mask=swap)
            tl.store(out_ptr + start + pivot, first, mask=swap)

else:  # pragma: no cover - without triton
    tah_partials_kernel = tah_encode_kernel = tah_decode_kernel = None


def _widest(tile_size: int) -> int:
    """Channels per lane by default: a whole tile up to G=64; at G=128 a lane holding 64 channels would keep
    two copies (the tile and its rotation) plus the butterflies' temporaries live: ~255 registers."""
    return 64 if tile_size <= 64 else 32


def _unit_geometry(shape, tile_size: int, allocation: str) -> tuple[int, int, int, int]:
    """(h, tiles per token, tiles per allocation unit, allocation units) of an ``[s, b, h]`` tensor."""
    s, b, h = (int(d) for d in shape)
    tiles_per_token = geometry.num_tiles(h, tile_size)
    if allocation == "token":
        return h, tiles_per_token, tiles_per_token, s * b
    return h, tiles_per_token, 1, s * b * tiles_per_token


def _low_units(shape, allocation: str, low_per_group: int) -> int:
    """Low-bit units in all: ``low_per_group`` per sample (token allocation) or per token (tile)."""
    s, b, _ = shape
    return low_per_group * (b if allocation == "token" else s * b)


def triton_tah_partials(x: torch.Tensor, tile_size: int, entropy: bool = False, per_lane: int | None = None,
                        tiles_per_prog: int | None = None) -> torch.Tensor:
    """fp32 ``[2, T]``: ``S = sum |x|`` and ``L = sum |x| log2 |x|`` of every tile of contiguous ``[s, b, h]`` ``x``;
    with ``entropy``, fp32 ``[T]``: each tile's entropy (``TahCodec.unit_entropy`` with tile allocation)."""
    check_launch(tah_partials_kernel, "triton_tah_partials", x)
    h = int(x.shape[-1])
    n_tiles = geometry.total_tiles(x.shape, tile_size)
    out = torch.empty((n_tiles,) if entropy else (2, n_tiles), dtype=torch.float32, device=x.device)
    blk = blocking(tah_partials_kernel, tile_size, per_lane, tiles_per_prog)
    x_in, bf16_bits = as_kernel_input(x)
    c1, c2, c3, c4, c5 = numerics.LOG2_POLY
    launch(
        f"tah_partials G{tile_size}{' entropy' if entropy else ''}", tah_partials_kernel, (blk.programs(n_tiles),),
        (x_in, out, n_tiles, h, geometry.num_tiles(h, tile_size)),
        dict(G=tile_size, H=blk.per_lane // 8, BT=blk.tiles, C=blk.lanes, EVEN=h % tile_size == 0,
             INDEX64=index_is_64bit(n_tiles * tile_size), BF16_BITS=bf16_bits, MAX_BITS=numerics.MAX_ABS_BITS,
             C1=c1, C2=c2, C3=c3, C4=c4, C5=c5, FLIP=block_flip(), ENTROPY=entropy, num_warps=blk.num_warps,
             enable_fp_fusion=False),
        blk.elements,
    )
    return out


def triton_tah_allocate(x: torch.Tensor, flags: torch.Tensor, *, tile_size: int, allocation: str,
                        low_per_group: int, invert: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The bit allocation of contiguous ``[s, b, h]`` ``x`` on the device: writes the ``flags`` section and
    returns the int32 tables of high- and low-bit units in order (``TahCodec.unit_tables``).

    ``flags``: the section followed by its zero padding to a multiple of 4 bytes (uint8; tile allocation
    ors int32 words into it). ``low_per_group``: low-bit units per sample (token allocation) or per token
    (tile); ``invert`` gives them to the highest entropies instead of the lowest.
    """
    shape = tuple(int(d) for d in x.shape)
    s, b, h = shape
    _, tiles_per_token, _, units = _unit_geometry(shape, tile_size, allocation)
    n_low = _low_units(shape, allocation, low_per_group)
    if not low_per_group:
        low = torch.zeros(units, dtype=torch.uint8, device=x.device)
    elif allocation == "token":
        entropy = tah_alloc.token_entropy(triton_tah_partials(x, tile_size), s * b, tiles_per_token)
        low = tah_alloc.rank_low(entropy, b, s, low_per_group, 1, b, invert)
    else:
        entropy = triton_tah_partials(x, tile_size, entropy=True)
        low = tah_alloc.rank_low(entropy, s * b, tiles_per_token, low_per_group, tiles_per_token, 1, invert)
    return tah_alloc.unit_tables(low, flags, shape, tile_size, allocation, n_low)


def triton_tah_tables(flags: torch.Tensor, shape, error: torch.Tensor, *, tile_size: int, allocation: str,
                      low_per_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The unit tables from a buffer's ``flags`` section (uint8); corrupt flags add to ``error`` (int32, 0-d)."""
    shape = tuple(int(d) for d in shape)
    return tah_alloc.unit_tables(None, flags, shape, tile_size, allocation,
                                 _low_units(shape, allocation, low_per_group), error=error)


def _widths(high_bits: int, low_bits: int, tiles_per_unit: int, high_units, low_units):
    """(bits, section, tiles, table, label) for each bit width that has tiles."""
    widths = [(high_bits, "high", high_units.numel() * tiles_per_unit, high_units, "high"),
              (low_bits, "low", low_units.numel() * tiles_per_unit, low_units, "low")]
    return [w for w in widths if w[2] > 0]


def triton_tah_encode(x: torch.Tensor, sections: dict[str, torch.Tensor], high_units: torch.Tensor,
                      low_units: torch.Tensor, *, tile_size: int, high_bits: int, low_bits: int, allocation: str,
                      outlier_threshold: float, seed: int | None = None, per_lane: int | None = None,
                      tiles_per_prog: int | None = None) -> torch.Tensor:
    """Fill the scale/zero/meta/high/low sections (uint8 tensors, ``tah_sections``) from contiguous
    ``[s, b, h]`` ``x``.

    ``high_units``/``low_units``: int32 unit indices of each width in order (``triton_tah_allocate``);
    ``seed`` (uint32) switches to stochastic rounding. The ``flags`` section is the allocation's. Returns
    int32 counts of rotated tiles, one per program (their sum is the number of rotated tiles).
    """
    check_launch(tah_encode_kernel, "triton_tah_encode", x, *sections.values())
    g = tile_size
    h, tiles_per_token, tiles_per_unit, units = _unit_geometry(x.shape, g, allocation)
    index64 = index_is_64bit(geometry.total_tiles(x.shape, g) * g, sections_nbytes(sections))
    blk = blocking(tah_encode_kernel, g, per_lane, tiles_per_prog, widest=_widest(g))
    x_in, bf16_bits = as_kernel_input(x)
    tau = outlier_threshold
    widths = _widths(high_bits, low_bits, tiles_per_unit, high_units, low_units)
    rotated = torch.empty(sum(blk.programs(w[2]) for w in widths), dtype=torch.int32, device=x.device)
    first_slot = 0
    for bits, name, n_rank, table, label in widths:
        unit, nunits = store_units(bits)
        launch(
            f"tah_encode G{g} {label} b{bits} {allocation}{' SR' if seed is not None else ''}"
            f"{' tau=inf' if tau == math.inf else ' tau=0' if tau == 0 else ''}",
            tah_encode_kernel, (blk.programs(n_rank),),
            (x_in, as_units(sections["scale"], 2), as_units(sections["zero"], 2), sections["meta"],
             as_units(sections[name], unit), table, rotated, n_rank, h, tiles_per_token, tiles_per_unit, units,
             first_slot, 0 if seed is None else int(seed)),
            dict(G=g, BITS=bits, H=blk.per_lane // 8, BT=blk.tiles, C=blk.lanes, EVEN=h % g == 0, INDEX64=index64,
                 STOCHASTIC=seed is not None, BF16_BITS=bf16_bits, MAX_BITS=numerics.MAX_ABS_BITS,
                 TAU=tau if math.isfinite(tau) else 0.0, EPSILON=TAH_EPS, ALWAYS=tau == 0,
                 NEVER=tau == math.inf, ENTRY=numerics.hadamard_entry(g), UNIT=unit, NUNITS=nunits,
                 FLIP=block_flip(), num_warps=blk.num_warps, enable_fp_fusion=False),
            blk.elements,
        )
        first_slot += blk.programs(n_rank)
    return rotated


def triton_tah_decode(sections: dict[str, torch.Tensor], shape, dtype: torch.dtype, high_units: torch.Tensor,
                      low_units: torch.Tensor, error: torch.Tensor, *, tile_size: int, high_bits: int, low_bits: int,
                      allocation: str, rotates: bool, out: torch.Tensor | None = None, per_lane: int | None = None,
                      tiles_per_prog: int | None = None) -> torch.Tensor:
    """Decode ``tah`` sections into ``out`` (contiguous) or a new tensor; tables from ``triton_tah_tables``;
    ``rotates``: whether any tile can be rotated (a finite outlier threshold); pivots outside the tile add
    to ``error`` (int32, 0-d)."""
    meta = sections["meta"]
    check_launch(tah_decode_kernel, "triton_tah_decode", meta)
    shape = tuple(int(d) for d in shape)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=meta.device)
    g = tile_size
    h, tiles_per_token, tiles_per_unit, units = _unit_geometry(shape, g, allocation)
    index64 = index_is_64bit(geometry.total_tiles(shape, g) * g, sections_nbytes(sections))
    blk = blocking(tah_decode_kernel, g, per_lane, tiles_per_prog, widest=_widest(g))
    out_view, out_kind = as_kernel_output(out)
    native_bf16, _ = native_conversions(tah_decode_kernel, meta.device)
    for bits, name, n_rank, table, label in _widths(high_bits, low_bits, tiles_per_unit, high_units, low_units):
        unit, nunits = store_units(bits)
        launch(
            f"tah_decode G{g} {label} b{bits} {allocation} ->{str(dtype).removeprefix('torch.')}",
            tah_decode_kernel, (blk.programs(n_rank),),
            (out_view, as_units(sections["scale"], 2), as_units(sections["zero"], 2), meta,
             as_units(sections[name], unit), table, error, n_rank, h, tiles_per_token, tiles_per_unit, units),
            dict(G=g, BITS=bits, H=blk.per_lane // 8, BT=blk.tiles, C=blk.lanes, EVEN=h % g == 0, INDEX64=index64,
                 OUT_KIND=out_kind, NATIVE_BF16=native_bf16, ENTRY=numerics.hadamard_entry(g), UNIT=unit,
                 NUNITS=nunits, ROTATES=rotates, FLIP=block_flip(), num_warps=blk.num_warps,
                 enable_fp_fusion=False),
            blk.elements,
        )
    return out
