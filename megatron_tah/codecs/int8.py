"""``int8``: symmetric blockwise 8-bit integers, one fp32 scale per block (AGoQ's QuanGrad format).

Meant for gradients (data-parallel reduction; usable for pipeline activation gradients too).
Encode, per block of ``B = block_size`` consecutive elements of the last dim (a 1-D gradient
bucket is one row; ``h`` is padded to whole blocks by repeating the last element, which leaves
``max|x|`` unchanged; ``B`` a power of two, 32..1024):

1. ``scale = max|x| / 127`` (fp32);
2. ``q = clamp(round(x / scale), -127, 127)`` as int8 (round half to even); a zero block stores
   ``scale = 0`` and ``q = 0``.

Decode: ``x = q * scale`` (fp32, then cast to the output dtype).

Error: every element decodes within ``scale / 2 = max|x_block| / 254`` of its input (plus the
fp32 rounding of the product and the cast to the output dtype); zeros, signs and the block's
largest magnitude survive exactly up to that rounding, so a zero gradient stays exactly zero.
A block holding NaN, +-Inf or ``|x| > MAX_ABS_VALUE`` stores ``scale = NaN`` and decodes to
all-NaN (so a non-finite gradient is still seen after the reduction); other blocks are unaffected.

Wire (T = rows * ceil(h / B) blocks, row-major):
header | ``scale``: fp32[T] | ``codes``: int8[T * B]. At B=128: 8.25 bits per element.
"""

from __future__ import annotations

import math

import torch

from .core import common
from .core.base import CHECKSUM_DEFAULT, Codec
from .core.errors import CodecError
from .core.header import register_codec_id
from .core.options import CodecDeclaration, Option

BLOCK_SIZES = (32, 64, 128, 256, 512, 1024)
QMAX = 127

DECLARATION = CodecDeclaration(
    kernel=False,
    options=(Option("tah_int8_block_size", "block_size", int, 128, "Elements per fp32 scale of the int8 codec "
                    "(data-parallel gradients, or a pipeline direction).", choices=BLOCK_SIZES),),
)


def check_block_size(block_size: int) -> int:
    if block_size not in BLOCK_SIZES:
        raise CodecError(f"block_size must be one of {BLOCK_SIZES}, got {block_size!r}")
    return block_size


def int8_encode_reference(blocks: torch.Tensor, bad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``[T, B]`` blocks (bad ones zeroed) -> ``scale`` fp32[T] (NaN for bad blocks), codes int8 ``[T, B]``."""
    scale = blocks.abs().amax(dim=-1) / QMAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (blocks / safe[:, None]).round_().clamp_(-QMAX, QMAX).to(torch.int8)
    scale = torch.where(bad, torch.full_like(scale, float("nan")), scale)
    return scale, codes


def int8_decode_reference(scale: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Inverse of ``int8_encode_reference``: fp32 ``[T, B]``."""
    return codes.float() * scale[:, None]


class Int8Codec(Codec):
    name = "int8"
    codec_id = 5

    def __init__(self, block_size: int = 128, backend: str = "auto", checksum: bool = CHECKSUM_DEFAULT):
        super().__init__(backend, checksum)
        self.block_size = check_block_size(block_size)

    def config(self) -> dict:
        return {"block_size": self.block_size}

    def num_blocks(self, shape) -> int:
        return math.prod(shape[:-1]) * common.num_tiles(shape[-1], self.block_size)

    def _sections(self, shape, dtype):
        blocks = self.num_blocks(shape)
        return [("scale", 4 * blocks), ("codes", blocks * self.block_size)]

    def _encode_torch(self, x, buf, layout):
        blocks, bad = common.to_tiles(x, self.block_size)
        scale, codes = int8_encode_reference(blocks.reshape(-1, self.block_size), bad.reshape(-1))
        layout.view(buf, "scale", torch.float32).copy_(scale)
        layout.view(buf, "codes", torch.int8).copy_(codes.reshape(-1))

    def _decode_torch(self, buf, shape, dtype, layout, out=None):
        scale = layout.view(buf, "scale", torch.float32)
        codes = layout.view(buf, "codes", torch.int8).reshape(-1, self.block_size)
        return common.from_tiles(int8_decode_reference(scale, codes), shape, dtype, out)


register_codec_id(Int8Codec.codec_id, Int8Codec.name)
