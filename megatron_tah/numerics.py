"""The numbers every implementation of a codec must use identically, in torch and in Triton alike.

Plain constants and pure functions, no torch: the input bound, the float formats more than one codec writes, the
polynomial of the shared log2, the stochastic-rounding hash and the exact fp32 tricks. The codecs (``codecs/``) and
the kernels (``kernels/``) both import this module (a Triton kernel may spell a constant out, as its comment says);
it imports neither. Shapes, tiles and byte counts are ``geometry.py``'s.
"""

from __future__ import annotations

import math
import struct

# Finite inputs up to this magnitude round-trip. A tile holding NaN, +-Inf or a larger magnitude
# decodes to all-NaN (its neighbours are unaffected): ranges and Hadamard sums stay inside fp32 below it.
MAX_ABS_VALUE = 1e36

# ----- the shared log2 (codecs/core/common.log2_approx, kernels/common.log2_approx_kernel) ----------
# log2(1 + t) ~= t * (c1 + t * (c2 + t * (c3 + t * (c4 + t * c5)))) on [0, 1): |error| < 3.1e-5.
# Evaluated with separate fp32 multiplies and adds (no FMA) by every implementation, so the
# entropy, and with it the bit allocation, is the same on every device.
LOG2_POLY = (1.4414639472961426, -0.7052677869796753, 0.405079185962677, -0.1819089949131012,
             0.04063528776168823)

# ----- float formats more than one codec writes ------------------------------------------------
FP8_MAX = 448.0  # largest finite float8_e4m3fn (fp8's codes, nvfp4's block scales)
E2M1_MAX = 6.0  # largest E2M1 magnitude (mxfp4, nvfp4); the grid is 0, 0.5, 1, 1.5, 2, 3, 4, 6

# ----- stochastic rounding: a counter-based hash, identical in torch and Triton ----------------
# u(seed, i) = (lowbias32(i * HASH_STEP + seed) >> 8) * 2^-24, i the element's index in tile order
# (mod 2^32). lowbias32: x ^= x >> 16; x *= HASH_MUL1; x ^= x >> 15; x *= HASH_MUL2; x ^= x >> 16.
HASH_STEP = 0x9E3779B1
HASH_MUL1 = 0x7FEB352D
HASH_MUL2 = 0x846CA68B

# ----- exact fp32 tricks -----------------------------------------------------------------------
# x + RINT_MAGIC - RINT_MAGIC rounds fp32 x to the nearest integer, ties to even, for |x| < 2^22;
# the integer is also float_bits(x + RINT_MAGIC) - RINT_MAGIC_BITS.
RINT_MAGIC = 12582912.0  # 1.5 * 2^23
RINT_MAGIC_BITS = 0x4B400000
BF16_NAN_BITS = 0x7FC0  # the NaN every encoder writes into bf16 metadata (a bad tile's zero)


def fp32(value: float) -> float:
    """``value`` rounded to the nearest fp32 (as a Python float)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def fp32_bits(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


MAX_ABS_BITS = fp32_bits(fp32(MAX_ABS_VALUE))  # |x| is bad iff bits(|x|) > this (NaN and Inf included)


def hadamard_entry(size: int) -> float:
    """The fp32 value of ``1 / sqrt(size)``: the normalisation after an unnormalised Walsh-Hadamard transform."""
    return fp32(1.0 / math.sqrt(size))
