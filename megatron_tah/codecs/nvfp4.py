"""``nvfp4``: NVFP4, E2M1 values with one E4M3 scale per block of 16 and one fp32 scale per tensor.

Reference-only (torch, no Triton kernel): ``backend="auto"`` always takes the torch path and
``backend="triton"`` raises. A 4-bit wire format;
its effect on training has not been measured.

Encode (blocks of ``B = 16`` consecutive elements of the last dim, ``h`` padded to whole blocks
with zeros as in ``mxfp4``; the optional ``hadamard=True`` rotates every block first, exactly as
``mxfp4`` does, with a 16-long sign pattern drawn from ``hadamard_seed``):

1. Per-tensor scale ``g = max|y| / (6 * 448)`` over the whole tensor (fp32, correctly rounded;
   bad values count as 0), so the largest block scale lands on E4M3's largest value 448.
2. Block scale ``s = e4m3(min(max|y_block| / (6 * g), 448))`` (round to nearest even; fp32
   ``6 * g`` and a correctly rounded division). The block's decode scale is ``S = s * g`` (fp32).
3. Elements ``q = e2m1(y / S)`` (correctly rounded division, then ``common.e2m1_round``: nearest,
   ties to even, saturated to +-6). ``S = 0`` (``g = 0``, or a block more than ~2^17 times smaller
   than the tensor's largest, whose scale rounds to 0 in E4M3) writes zero codes.

Decode: ``x = q * (s * g)`` (then ``fwht(.) * d`` with ``hadamard``), in fp32, cast to the output dtype.

Error, per block (rotated domain with ``hadamard``): an element within ``6S`` decodes within half a
grid step times ``S`` (``S/4`` below ``2S``, ``S/2`` below ``4S``, ``S`` above); as ``s`` is rounded
to 4 significant bits, ``max|y_block|`` may exceed ``6S`` by up to 1/16 and saturates there. Zeros
decode exactly, and so do values that are E2M1 values times a block's ``S``. Finite inputs up to
``MAX_ABS_VALUE`` never overflow; a tensor whose largest magnitude is below ~3e-35 has a subnormal
``g`` and loses precision. A block holding NaN, +-Inf or ``|x| > MAX_ABS_VALUE`` stores the E4M3
NaN (``0x7F``) as its scale and zero codes, and decodes to all-NaN; other blocks are unaffected
(the codecs' common rule).

Wire (T = rows * ceil(h / 16) blocks, row-major; sizes in ``nvfp4_sections``):
header | ``global_scale``: fp32[1] (``g``) | ``scale``: E4M3 bytes[T] | ``codes``: 4-bit E2M1 codes
packed two per byte as in ``mxfp4``. 4 + 8/16 = 4.5 bits per element (plus the 16-byte header,
the 4-byte ``g`` and the alignment of each section to 8 bytes).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .. import geometry, numerics
from .core import common
from .core.header import register_codec_id
from .mxfp4 import RotatedBlockCodec
from .mxfp4 import HADAMARD_OPTION
from .core.options import CodecDeclaration

DECLARATION = CodecDeclaration(kernel=False, options=(HADAMARD_OPTION,))

BLOCK_SIZE = 16  # values per E4M3 scale (NVFP4)
E4M3_NAN = 0x7F  # the NaN every nvfp4 encoder writes as a bad block's scale
GLOBAL_DIVISOR = numerics.E2M1_MAX * numerics.FP8_MAX  # per-tensor decode scale = global amax / (6 * 448)


def nvfp4_sections(shape: Sequence[int]) -> list[tuple[str, int]]:
    """The ``nvfp4`` wire sections of ``shape``: the fp32 per-tensor scale, an E4M3 byte per block, the 4-bit codes."""
    blocks = geometry.total_tiles(shape, BLOCK_SIZE)
    return [("global_scale", 4), ("scale", blocks), ("codes", geometry.packed_nbytes(blocks * BLOCK_SIZE, 4))]


def block_decode_scale(scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``S = s * g`` per block from E4M3 scale bytes and the fp32 per-tensor scale (NaN for ``0x7F``)."""
    return scale.view(torch.float8_e4m3fn).float() * global_scale


def nvfp4_encode_reference(blocks: torch.Tensor, bad: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 ``[T, 16]`` blocks (bad values zeroed) -> ``g`` fp32[1], E4M3 scale bytes uint8[T], codes uint8 ``[T, 16]``.

    A bad block is written as scale ``0x7F`` (NaN) and zero codes.
    """
    magnitude = blocks.abs()
    amax = magnitude.amax(dim=-1)
    global_scale = common.div_rn(amax.amax().reshape(1), GLOBAL_DIVISOR)
    denominator = global_scale * numerics.E2M1_MAX
    safe = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    ratio = common.div_rn(amax, safe).clamp_(0.0, numerics.FP8_MAX)
    scale = ratio.to(torch.float8_e4m3fn).view(torch.uint8)
    decode_scale = block_decode_scale(scale, global_scale)
    flat = ~(decode_scale > 0)
    scaled = common.div_rn(blocks, decode_scale.masked_fill(flat, 1.0)[:, None])
    codes = common.e2m1_codes(common.e2m1_round(scaled)).masked_fill_((flat | bad)[:, None], 0)
    return global_scale, scale.masked_fill(bad, E4M3_NAN), codes


def nvfp4_decode_reference(global_scale: torch.Tensor, scale: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Inverse of ``nvfp4_encode_reference``: fp32 ``[T, 16]``."""
    return common.e2m1_values(codes) * block_decode_scale(scale, global_scale)[:, None]


class NvFp4Codec(RotatedBlockCodec):
    name = "nvfp4"
    codec_id = 7
    block_size = BLOCK_SIZE

    def _sections(self, shape, dtype):
        return nvfp4_sections(shape)

    def _encode_torch(self, x, buf, layout):
        blocks, bad = self._to_blocks(x)
        global_scale, scale, codes = nvfp4_encode_reference(blocks, bad)
        layout.view(buf, "global_scale", torch.float32).copy_(global_scale)
        layout.view(buf, "scale").copy_(scale)
        self._store_codes(buf, layout, codes)

    def _decode_torch(self, buf, shape, dtype, layout, out=None):
        global_scale = layout.view(buf, "global_scale", torch.float32)
        values = nvfp4_decode_reference(global_scale, layout.view(buf, "scale"), self._load_codes(buf, layout, shape))
        return self._from_blocks(values, shape, dtype, out)


register_codec_id(NvFp4Codec.codec_id, NvFp4Codec.name)
