"""Shape arithmetic shared by several codecs, or by a codec layer and the kernel layer alike.

Pure functions of ints and plain constants, no torch: the tile sizes, how many tiles a tensor has, how many bytes
codes of a bit width pack into. The numbers every implementation must use identically (the input bound, float
formats, the shared log2, the stochastic-rounding hash, exact fp32 tricks) are ``numerics.py``'s. The codecs
(``codecs/``) and the kernels (``kernels/``) both import this module; it imports neither.

A codec's own wire layout (its ``*_sections``, its counts, the constants only it uses) is not here: it
sits beside the codec, one stem per codec across the layers. A codec with a Triton kernel keeps it in
its kernel module (``kernels/<stem>.py``: the launchers take those sections by name, the kernels use
those constants) and imports it from there; a codec without one keeps it in its own file
(``codecs/<stem>.py``). Adding a codec adds nothing here.
"""

from __future__ import annotations

import math
from typing import Sequence

TILE_SIZES = (8, 16, 32, 64, 128)


# ----- tiles -----------------------------------------------------------------------------------
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
