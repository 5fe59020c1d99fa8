"""Shape arithmetic and constants shared by the torch references and the Triton launchers.

Pure functions of ints and plain constants, no torch: how many tiles a tensor has, how many
of them get the low bit width, how large every wire section is, and the numbers every
implementation of a codec must use identically (thresholds, the Hadamard entry, the
polynomial of the entropy's log2, the stochastic-rounding hash). The codecs (``codecs/``)
and the kernels (``kernels/``) both import this module; it imports neither.
"""

from __future__ import annotations

import math
import struct
from typing import Sequence

TILE_SIZES = (8, 16, 32, 64, 128)

# Finite inputs up to this magnitude round-trip. A tile holding NaN, +-Inf or a larger magnitude
# decodes to all-NaN (its neighbours are unaffected): ranges and Hadamard sums stay inside fp32 below it.
MAX_ABS_VALUE = 1e36

# ----- tah -------------------------------------------------------------------------------------
TAH_EPS = 1e-8  # added to the second-largest magnitude in the outlier test
TAH_ALLOCATIONS = ("token", "tile")
TAH_LOW_BITS_FOR = ("low_entropy", "high_entropy")

# log2(1 + t) ~= t * (c1 + t * (c2 + t * (c3 + t * (c4 + t * c5)))) on [0, 1): |error| < 3.1e-5.
# Evaluated with separate fp32 multiplies and adds (no FMA) by every implementation, so the
# entropy, and with it the bit allocation, is the same on every device.
LOG2_POLY = (1.4414639472961426, -0.7052677869796753, 0.405079185962677, -0.1819089949131012,
             0.04063528776168823)

# ----- fp8 (TACO) ------------------------------------------------------------------------------
FP8_MAX = 448.0  # largest finite float8_e4m3fn
PRESCALE_MIN = 1e-3
PRESCALE_MAX = 1e3
RMS_EPS = 1e-3  # sqrt of the 1e-6 added to mean(x^2)

# ----- fp4 (mxfp4, nvfp4) ------------------------------------------------------------------------
E2M1_MAX = 6.0  # largest E2M1 magnitude; the grid is 0, 0.5, 1, 1.5, 2, 3, 4, 6
E2M1_EMAX = 2  # exponent of E2M1's largest binade (4..6): the OCP MX scale is 2^(floor(log2 amax) - 2)
MXFP4_BLOCK = 32  # values per shared E8M0 scale (OCP MX v1.0)
NVFP4_BLOCK = 16  # values per E4M3 scale (NVFP4)
E8M0_BIAS = 127  # an E8M0 byte e is the scale 2^(e - 127); 255 is NaN (a bad block)
E8M0_NAN = 0xFF
E4M3_NAN = 0x7F  # the NaN every nvfp4 encoder writes as a bad block's scale
NVFP4_GLOBAL_DIVISOR = E2M1_MAX * FP8_MAX  # per-tensor decode scale = global amax / (6 * 448)

# ----- stochastic rounding: a counter-based hash, identical in torch and Triton -----------------
# u(seed, i) = (lowbias32(i * HASH_STEP + seed) >> 8) * 2^-24, i the element's index in tile order
# (mod 2^32). lowbias32: x ^= x >> 16; x *= HASH_MUL1; x ^= x >> 15; x *= HASH_MUL2; x ^= x >> 16.
HASH_STEP = 0x9E3779B1
HASH_MUL1 = 0x7FEB352D
HASH_MUL2 = 0x846CA68B

# ----- exact fp32 tricks ------------------------------------------------------------------------
# x + RINT_MAGIC - RINT_MAGIC rounds fp32 x to the nearest integer, ties to even, for |x| < 2^22;
# the integer is also float_bits(x + RINT_MAGIC) - RINT_MAGIC_BITS.
RINT_MAGIC = 12582912.0  # 1.5 * 2^23
RINT_MAGIC_BITS = 0x4B400000
BF16_NAN_BITS = 0x7FC0  # the NaN every encoder writes into bf16 metadata (a bad tile's zero)
FP32_NAN_BITS = 0x7FC00000  # the NaN every encoder writes into fp32 metadata (a bad group's alpha)


def fp32(value: float) -> float:
    """``value`` rounded to the nearest fp32 (as a Python float)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def fp32_bits(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


MAX_ABS_BITS = fp32_bits(fp32(MAX_ABS_VALUE))  # |x| is bad iff bits(|x|) > this (NaN and Inf included)


def hadamard_entry(size: int) -> float:
    """The fp32 value of ``1 / sqrt(size)``: the normalisation after an unnormalised Walsh-Hadamard transform."""
    return fp32(1.0 / math.sqrt(size))


def check_power_of_two(size: int, what: str = "size") -> int:
    if size < 1 or size & (size - 1):
        raise ValueError(f"{what} must be a power of two, got {size}")
    return size


# ----- tiles ------------------------------------------------------------------------------------
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_tiles(h: int, tile_size: int) -> int:
    """Tiles of ``tile_size`` channels per token of ``h`` channels (the last one padded)."""
    return cdiv(h, tile_size)


def num_tokens(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape[:-1])


def total_tiles(shape: Sequence[int], tile_size: int) -> int:
    return num_tokens(shape) * num_tiles(int(shape[-1]), tile_size)


def packed_nbytes(count: int, bits: int) -> int:
    """Bytes of ``count`` codes packed at ``bits`` bits (``count`` a multiple of 8)."""
    return count * bits // 8


def flags_nbytes(count: int) -> int:
    return cdiv(count, 8)


# ----- fixedpoint ---------------------------------------------------------------------------------
def fixedpoint_sections(shape: Sequence[int], bits: int, tile_size: int) -> list[tuple[str, int]]:
    tiles = total_tiles(shape, tile_size)
    return [("scale", 2 * tiles), ("zero", 2 * tiles), ("codes", packed_nbytes(tiles * tile_size, bits))]


# ----- fp8 ------------------------------------------------------------------------------------------
def fp8_sections(shape: Sequence[int], group_size: int) -> list[tuple[str, int]]:
    groups = total_tiles(shape, group_size)
    return [("prescale", 4 * groups), ("postscale", 4 * groups), ("codes", groups * group_size)]


# ----- tah ------------------------------------------------------------------------------------------
def tah_low_units_per_group(s: int, tiles_per_token: int, high_ratio: float, allocation: str) -> int:
    """Low-bit units per selection group: of the ``s`` tokens of a sample, or of a token's tiles."""
    units = s if allocation == "token" else tiles_per_token
    return int(math.floor(units * (1.0 - high_ratio) + 1e-9))


def tah_tile_counts(shape: Sequence[int], tile_size: int, high_ratio: float, allocation: str
                    ) -> tuple[int, int, int]:
    """(all tiles, low-bit tiles, allocation units) of an ``[s, b, h]`` tensor."""
    s, b, h = (int(d) for d in shape)
    tiles_per_token = num_tiles(h, tile_size)
    total = s * b * tiles_per_token
    n_low = tah_low_units_per_group(s, tiles_per_token, high_ratio, allocation)
    if allocation == "token":
        return total, n_low * b * tiles_per_token, s * b
    return total, n_low * s * b, total


def tah_sections(shape: Sequence[int], tile_size: int, high_bits: int, low_bits: int, high_ratio: float,
                 allocation: str) -> list[tuple[str, int]]:
    total, low, units = tah_tile_counts(shape, tile_size, high_ratio, allocation)
    return [
        ("flags", flags_nbytes(units)),
        ("scale", 2 * total),
        ("zero", 2 * total),
        ("meta", total),
        ("high", packed_nbytes((total - low) * tile_size, high_bits)),
        ("low", packed_nbytes(low * tile_size, low_bits)),
    ]


# ----- fp4 ------------------------------------------------------------------------------------------
def mxfp4_sections(shape: Sequence[int]) -> list[tuple[str, int]]:
    blocks = total_tiles(shape, MXFP4_BLOCK)
    return [("scale", blocks), ("codes", packed_nbytes(blocks * MXFP4_BLOCK, 4))]


def nvfp4_sections(shape: Sequence[int]) -> list[tuple[str, int]]:
    blocks = total_tiles(shape, NVFP4_BLOCK)
    return [("global_scale", 4), ("scale", blocks), ("codes", packed_nbytes(blocks * NVFP4_BLOCK, 4))]


# ----- hadint -------------------------------------------------------------------------------------
def hadint_sections(shape: Sequence[int], bits: int, tile_size: int) -> list[tuple[str, int]]:
    tiles = total_tiles(shape, tile_size)
    return [("scale", 2 * tiles), ("codes", packed_nbytes(tiles * tile_size, bits))]


# ----- channel ------------------------------------------------------------------------------------
def channel_code_count(shape: Sequence[int]) -> int:
    """Codes the ``channel`` codec packs for ``shape``: every element, padded with zero codes to a multiple of 8."""
    return cdiv(num_tokens(shape) * int(shape[-1]), 8) * 8


def channel_outliers(shape: Sequence[int], outlier_tokens: int) -> int:
    """Rows the ``channel`` codec sends apart for ``shape``: ``outlier_tokens`` per sequence, a message
    ``[s, b, ..., h]`` holding ``b * ...`` sequences (a 2-D one, one), at most ``rows - 1`` (one stays on the grids)."""
    sequences = math.prod(int(d) for d in shape[1:-1])
    return max(0, min(int(outlier_tokens) * sequences, num_tokens(shape) - 1))


def channel_sections(shape: Sequence[int], bits: int, outlier_tokens: int = 0) -> list[tuple[str, int]]:
    h, k = int(shape[-1]), channel_outliers(shape, outlier_tokens)
    sections = [("scale", 2 * h), ("zero", 2 * h), ("codes", packed_nbytes(channel_code_count(shape), bits))]
    return sections + ([("outlier_index", 4 * k), ("outlier_rows", 2 * k * h)] if k else [])


# ----- lowrank ------------------------------------------------------------------------------------
def lowrank_rank(h: int, rank: int) -> int:
    """Directions the lowrank codec sends for a last dim of ``h``: ``min(rank, h)``."""
    return min(int(rank), int(h))


def lowrank_sections(shape: Sequence[int], bits: int, tile_size: int, rank: int,
                     coef_bits: int) -> list[tuple[str, int]]:
    h, rows = int(shape[-1]), num_tokens(shape)
    k = lowrank_rank(h, rank)
    coefs = cdiv(rows * k, 8) * 8  # packed in groups of 8 codes, the last group padded with zero codes
    return [("basis_scale", 2 * k), ("basis", k * h), ("coef_scale", 2 * rows),
            ("coef", packed_nbytes(coefs, coef_bits))] + hadint_sections(shape, bits, tile_size)
