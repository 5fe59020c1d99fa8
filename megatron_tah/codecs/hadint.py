"""``hadint``: a seeded random-sign Hadamard on every tile, then symmetric b-bit integers, one bf16 scale per tile.

Torch reference and a fused Triton kernel (``kernels/hadint.py``) writing the same bytes.
A codec with no pivot, no outlier test and cheaper
metadata: TAH-Quant rotates a tile only when its largest magnitude stands out and spends a
bf16 scale *and* a bf16 zero per tile; here every tile is rotated (which makes it roughly
symmetric around 0, so no zero is sent) and the bits saved go to values.

Encode, per tile of ``G = tile_size`` consecutive elements of the last dim (``h`` padded to whole
tiles with zeros, dropped on decode):

1. ``y = fwht(x * d)`` (``common.signed_fwht``): Walsh-Hadamard transform normalised by
   ``1/sqrt(G)`` after a sign flip ``d`` (+-1 per position, the same for every tile, drawn from
   ``hadamard_seed`` by ``common.random_signs``; sender and receiver derive it from their
   configuration, nothing is sent; ``hadamard=False`` skips the transform, for ablations).
2. Scale ``s = max|y| / Q`` rounded *up* to bf16, ``Q = 2^(bits-1) - 1``, so ``|y| <= Q*s``.
3. Codes ``q = round(y * (1/s))`` (ties to even; ``floor(y * (1/s) + u)`` with ``u`` uniform in
   [0, 1) from ``common.RoundingNoise`` when ``stochastic_rounding``), clamped to ``[-Q, Q]``, sent
   as ``q + Q`` in ``bits`` bits (the code ``2^bits - 1`` is never used).

Decode: ``x = fwht((code - Q) * s) * d`` in fp32, cast to the output dtype.

Error: every rotated element decodes within ``s/2`` of its input (``s`` with stochastic rounding,
then unbiased), so a tile's L2 error is at most ``sqrt(G) * s / 2`` in either domain (the transform
is orthonormal). Zeros decode exactly. A tile whose scale is below the smallest normal fp32 decodes
to zeros. A tile holding NaN, +-Inf or ``|x| > MAX_ABS_VALUE`` is written as a NaN scale
(``BF16_NAN_BITS``) and codes ``Q`` and decodes to all-NaN; other tiles are unaffected (the codecs'
common rule).

Wire (T = rows * ceil(h / G) tiles, row-major; sizes in ``kernels/hadint.py``, ``hadint_sections``):
header | ``scale``: bf16[T] | ``codes``: T*G codes of ``bits`` bits packed by ``common.pack_bits``.
``bits + 16/G`` bits per element: 4.25 at 4 bits, tile 64 (plus the 16-byte header and the
alignment of the codes to 8 bytes).
"""

from __future__ import annotations

import torch

from ..kernels.hadint import hadint_sections
from .core import common
from .core.base import CHECKSUM_DEFAULT
from .core.errors import CodecError
from .core.header import register_codec_id
from .mxfp4 import RotatedBlockCodec
from .core.options import CodecDeclaration

DECLARATION = CodecDeclaration(takes=("bits", "tile_size", "stochastic_rounding"), kernel=True)


def hadint_encode_reference(blocks: torch.Tensor, bad: torch.Tensor, bits: int,
                            noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``[T, G]`` (rotated) blocks -> int16 bits of the bf16 scales ``[T]`` and codes uint8 ``[T, G]``."""
    limit = float(2 ** (bits - 1) - 1)
    scale = common.round_bf16(common.div_rn(blocks.abs().amax(dim=-1), limit), +1) + 0.0
    flat = ~(scale >= common.FLAT_SCALE) | bad
    inverse = common.div_rn(1.0, scale.masked_fill(flat, 1.0))
    scaled = blocks * inverse[:, None]
    scaled = scaled.add_(noise).floor_() if noise is not None else scaled.round_()
    codes = scaled.clamp_(-limit, limit).masked_fill_(flat[:, None], 0.0).add_(limit)
    return common.bf16_bits(scale, nan=bad), codes.to(torch.uint8)


def hadint_decode_reference(scale: torch.Tensor, codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``hadint_encode_reference`` (before the inverse transform): fp32 ``[T, G]``."""
    return (codes.float() - float(2 ** (bits - 1) - 1)) * scale.float()[:, None]


class HadIntCodec(RotatedBlockCodec):
    name = "hadint"
    codec_id = 8

    def __init__(self, bits: int = 4, tile_size: int = 64, hadamard: bool = True, hadamard_seed: int = 0,
                 stochastic_rounding: bool = False, seed: int = 0, backend: str = "auto",
                 checksum: bool = CHECKSUM_DEFAULT):
        super().__init__(hadamard=hadamard, hadamard_seed=hadamard_seed, backend=backend, checksum=checksum)
        self.bits = common.check_bits(bits, low=3)
        self.block_size = self.tile_size = common.check_tile_size(tile_size)
        if not isinstance(stochastic_rounding, bool):
            raise CodecError(f"stochastic_rounding must be True or False, got {stochastic_rounding!r}")
        self.stochastic_rounding = stochastic_rounding
        self.seed = int(seed)
        self.rounding_noise = common.RoundingNoise(self.stochastic_rounding, self.seed)

    def config(self) -> dict:
        return {**super().config(), "bits": self.bits, "tile_size": self.tile_size,
                "stochastic_rounding": self.stochastic_rounding}

    @property
    def code_bits(self) -> int:
        return self.bits

    def _sections(self, shape, dtype):
        return hadint_sections(shape, self.bits, self.tile_size)

    def _encode_torch(self, x, buf, layout):
        blocks, bad = self._to_blocks(x)
        seed = self.rounding_noise.next_seed()
        noise = None if seed is None else common.hash_uniform(seed, blocks.numel(), blocks.device).reshape(blocks.shape)
        scale, codes = hadint_encode_reference(blocks, bad, self.bits, noise)
        layout.view(buf, "scale", torch.int16).copy_(scale)
        self._store_codes(buf, layout, codes)

    def _decode_torch(self, buf, shape, dtype, layout, out=None):
        scale = layout.view(buf, "scale", torch.bfloat16)
        values = hadint_decode_reference(scale, self._load_codes(buf, layout, shape), self.bits)
        return self._from_blocks(values, shape, dtype, out)

    def _encode_triton(self, x, buf, layout):
        from ..kernels.hadint import triton_hadint_encode

        triton_hadint_encode(x, layout.sections(buf), self.bits, self.tile_size, self.signs(x.device),
                             seed=self.rounding_noise.next_seed())

    def _decode_triton(self, buf, shape, dtype, layout, out=None):
        from ..kernels.hadint import triton_hadint_decode

        return triton_hadint_decode(layout.sections(buf), shape, dtype, self.bits, self.tile_size,
                                    self.signs(buf.device), out=out)


register_codec_id(HadIntCodec.codec_id, HadIntCodec.name)
