"""``fixedpoint``: tile-wise uniform b-bit quantization, no transform ("direct quantization").

The naive baseline of the AQ-SGD paper and the default backward codec (tile 32,
6 bits). Each tile of ``tile_size`` channels of one token is quantized
asymmetrically (``common.quantize_tiles``): every element decodes within half
a step (``scale / 2``) of its input.

Wire (T = tokens * ceil(h / tile_size), h padded to whole tiles by repeating the last channel; sizes in
``kernels/fixedpoint.py``, ``fixedpoint_sections``):
header | ``scale``: bf16[T] | ``zero``: bf16[T] | ``codes``: T*tile_size codes of
``bits`` bits packed by ``common.pack_bits``. At tile 32, 6 bits: 7 bits/element.
"""

from __future__ import annotations

import torch

from .. import geometry
from ..kernels.fixedpoint import fixedpoint_sections
from .core import common
from .core.base import CHECKSUM_DEFAULT, Codec
from .core.header import register_codec_id
from .core.options import CodecDeclaration

DECLARATION = CodecDeclaration(takes=("bits", "tile_size", "stochastic_rounding"), kernel=True)


class FixedPointCodec(Codec):
    name = "fixedpoint"
    codec_id = 1

    def __init__(self, bits: int = 6, tile_size: int = 32, stochastic_rounding: bool = False,
                 seed: int = 0, backend: str = "auto", checksum: bool = CHECKSUM_DEFAULT):
        super().__init__(backend, checksum)
        self.bits = common.check_bits(bits)
        self.tile_size = common.check_tile_size(tile_size)
        self.stochastic_rounding = bool(stochastic_rounding)
        self.seed = int(seed)
        self.rounding_noise = common.RoundingNoise(self.stochastic_rounding, self.seed)

    def code_sections(self) -> dict[str, int]:
        return {"codes": self.bits}

    def config(self) -> dict:
        return {"bits": self.bits, "tile_size": self.tile_size, "stochastic_rounding": self.stochastic_rounding}

    def num_tiles(self, shape) -> int:
        return geometry.total_tiles(shape, self.tile_size)

    def _sections(self, shape, dtype):
        return fixedpoint_sections(shape, self.bits, self.tile_size)

    def _encode_torch(self, x, buf, layout):
        tiles, bad = common.to_tiles(x, self.tile_size)
        seed = self.rounding_noise.next_seed()
        noise = None if seed is None else common.hash_uniform(seed, tiles.numel(), tiles.device).reshape(tiles.shape)
        codes, scale, zero = common.quantize_tiles(tiles, 2**self.bits - 1, bad, noise)
        layout.view(buf, "scale", torch.int16).copy_(scale.reshape(-1))
        layout.view(buf, "zero", torch.int16).copy_(zero.reshape(-1))
        layout.view(buf, "codes").copy_(common.pack_bits(codes, self.bits))

    def _decode_torch(self, buf, shape, dtype, layout, out=None):
        tiles = self.num_tiles(shape)
        scale = layout.view(buf, "scale", torch.bfloat16)
        zero = layout.view(buf, "zero", torch.bfloat16)
        codes = common.unpack_bits(layout.view(buf, "codes"), self.bits, tiles * self.tile_size)
        return common.from_tiles(common.dequantize_tiles(codes.reshape(tiles, self.tile_size), scale, zero),
                                 shape, dtype, out)

    def _encode_triton(self, x, buf, layout):
        from ..kernels.fixedpoint import triton_fixedpoint_encode

        triton_fixedpoint_encode(x, layout.sections(buf), self.bits, self.tile_size,
                                 seed=self.rounding_noise.next_seed())

    def _decode_triton(self, buf, shape, dtype, layout, out=None):
        from ..kernels.fixedpoint import triton_fixedpoint_decode

        return triton_fixedpoint_decode(layout.sections(buf), shape, dtype, self.bits, self.tile_size, out=out)


register_codec_id(FixedPointCodec.codec_id, FixedPointCodec.name)
