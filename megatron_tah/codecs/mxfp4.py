"""``mxfp4``: OCP MX FP4, E2M1 values with one shared power-of-two (E8M0) scale per block of 32.

Reference-only (torch, no Triton kernel): ``backend="auto"`` always takes the torch path and
``backend="triton"`` raises. A 4-bit wire format;
its effect on training has not been measured.

Encode, per block of ``B = 32`` consecutive elements of the last dim (``h`` padded to whole
blocks with zeros, which change neither a block's largest magnitude nor, with ``hadamard``,
its energy; the padding is dropped on decode):

0. Optional ``hadamard=True``: ``y = fwht(x * d)`` (``common.signed_fwht``), a Walsh-Hadamard
   transform normalised by ``1/sqrt(B)`` after a fixed sign flip ``d`` (+-1 per position, the same
   for every block, drawn from ``hadamard_seed`` by ``common.random_signs``: sender and receiver
   derive it from their config, nothing is sent). It spreads an outlier over its block.
1. Shared scale (OCP MX v1.0, section 6.3): ``e = floor(log2(max|y|)) - 2`` (2 is E2M1's emax), read
   from the fp32 exponent bits of ``max|y|`` and clamped to E8M0's ``[-127, 127]`` (an all-zero block
   gets ``e = -127``). The scale ``X = 2^e`` is stored as the byte ``e + 127``.
2. Elements ``q = e2m1(y / X)``: round to nearest on the grid ``+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}``,
   ties to even, saturated to +-6 (``common.e2m1_round``; ``y / X`` is exact, X being a power of two).

Decode: ``x = q * X`` (then ``fwht(.) * d`` with ``hadamard``), in fp32, cast to the output dtype.

Error, per block (in the rotated domain with ``hadamard``, which is orthonormal): an element
with ``|y| <= 6X`` decodes within half a grid step of it, ``X/4`` below ``2X``, ``X/2`` below
``4X`` and ``X`` above; ``|y|`` in ``(6X, 8X)`` saturates to ``6X``. Since ``max|y| >= 4X``, every
element is within ``max|y| / 4`` of its input (``max|y| / 2`` for the saturated ones). Zeros decode
exactly, and so does any block whose values are E2M1 values times ``X``. Finite inputs up to
``MAX_ABS_VALUE`` never overflow. A block holding NaN, +-Inf or ``|x| > MAX_ABS_VALUE`` stores
the E8M0 NaN (``0xFF``) and zero codes and decodes to all-NaN; other blocks are unaffected (the
codecs' common rule: Megatron's NaN check then fires, no host sync is spent looking).

Wire (T = rows * ceil(h / 32) blocks, row-major; sizes in ``mxfp4_sections``):
header | ``scale``: E8M0 bytes[T] | ``codes``: 4-bit codes ``sign << 3 | index`` (index into
0, 0.5, 1, 1.5, 2, 3, 4, 6), two per byte, element ``2k`` in the low nibble of byte ``k``
(``common.pack_bits(codes, 4)``). 4 + 8/32 = 4.25 bits per element (plus the 16-byte header
and the alignment of the codes to 8 bytes).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .. import geometry
from .core import common
from .core.base import CHECKSUM_DEFAULT, Codec
from .core.errors import CodecError
from .core.header import register_codec_id
from .core.options import CodecDeclaration, Option

HADAMARD_OPTION = Option(
    "tah_fp4_hadamard", "hadamard", bool, False, "mxfp4 / nvfp4: rotate every block (32 / 16 values) by a "
    "random-sign Walsh-Hadamard transform before quantizing (reference-only codecs, no Triton kernel).")
DECLARATION = CodecDeclaration(kernel=False, options=(HADAMARD_OPTION,))

BLOCK_SIZE = 32  # values per shared E8M0 scale (OCP MX v1.0)
E2M1_EMAX = 2  # exponent of E2M1's largest binade (4..6): the OCP MX scale is 2^(floor(log2 amax) - 2)
E8M0_BIAS = 127  # an E8M0 byte e is the scale 2^(e - 127); 255 is NaN (a bad block)
E8M0_NAN = 0xFF


def mxfp4_sections(shape: Sequence[int]) -> list[tuple[str, int]]:
    """The ``mxfp4`` wire sections of ``shape``: an E8M0 scale byte per block, then the 4-bit codes."""
    blocks = geometry.total_tiles(shape, BLOCK_SIZE)
    return [("scale", blocks), ("codes", geometry.packed_nbytes(blocks * BLOCK_SIZE, 4))]


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """fp32 ``2^exponent`` for integer exponents in [-149, 127], exact (subnormals included)."""
    return torch.exp2(exponent.double()).float()


def mxfp4_encode_reference(blocks: torch.Tensor, bad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``[T, 32]`` blocks (bad values zeroed) -> E8M0 scale bytes uint8[T], E2M1 codes uint8 ``[T, 32]``.

    A bad block is written as scale ``0xFF`` (NaN) and zero codes.
    """
    amax = blocks.abs().amax(dim=-1)
    floor_log2 = ((amax.view(torch.int32) >> 23) & 0xFF) - E8M0_BIAS  # -127 for 0 and subnormals
    exponent = (floor_log2 - E2M1_EMAX).clamp(-E8M0_BIAS, E8M0_BIAS)
    codes = common.e2m1_codes(common.e2m1_round(blocks * pow2(-exponent)[:, None]))
    scale = (exponent + E8M0_BIAS).to(torch.uint8).masked_fill(bad, E8M0_NAN)
    return scale, codes.masked_fill(bad[:, None], 0)


def mxfp4_decode_reference(scale: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Inverse of ``mxfp4_encode_reference``: fp32 ``[T, 32]`` (``0xFF`` scales decode to NaN)."""
    exponent = scale.to(torch.int32) - E8M0_BIAS
    factor = torch.where(scale == E8M0_NAN, float("nan"), pow2(exponent))
    return common.e2m1_values(codes) * factor[:, None]


class RotatedBlockCodec(Codec):
    """What mxfp4, nvfp4 and hadint share: blocks along the last dim, zero padding, the optional random Hadamard."""

    block_size: int = BLOCK_SIZE

    def __init__(self, hadamard: bool = False, hadamard_seed: int = 0, backend: str = "auto",
                 checksum: bool = CHECKSUM_DEFAULT):
        super().__init__(backend, checksum)
        if not isinstance(hadamard, bool):
            raise CodecError(f"hadamard must be True or False, got {hadamard!r}")
        if not isinstance(hadamard_seed, int) or not 0 <= hadamard_seed < 2**32:
            raise CodecError(f"hadamard_seed must be an integer in [0, 2^32), got {hadamard_seed!r}")
        self.hadamard = hadamard
        self.hadamard_seed = hadamard_seed
        self._signs: dict[str, torch.Tensor] = {}

    def config(self) -> dict:
        # The seed only matters (and only has to agree) when the transform is on.
        return {"hadamard": True, "hadamard_seed": self.hadamard_seed} if self.hadamard else {"hadamard": False}

    def num_blocks(self, shape) -> int:
        return geometry.total_tiles(shape, self.block_size)

    def code_sections(self) -> dict[str, int]:
        return {"codes": self.code_bits}

    @property
    def code_bits(self) -> int:
        """Bits per code in the ``codes`` section (4: E2M1; hadint: its ``bits``)."""
        return 4

    def _store_codes(self, buf, layout, codes: torch.Tensor) -> None:
        layout.view(buf, "codes").copy_(common.pack_bits(codes, self.code_bits))

    def _load_codes(self, buf, layout, shape) -> torch.Tensor:
        """The ``codes`` section unpacked to ``[blocks, block_size]``."""
        blocks = self.num_blocks(shape)
        codes = common.unpack_bits(layout.view(buf, "codes"), self.code_bits, blocks * self.block_size)
        return codes.reshape(blocks, self.block_size)

    def signs(self, device) -> torch.Tensor | None:
        """The Hadamard's sign flips (fp32 [block_size]), or None without ``hadamard``."""
        if not self.hadamard:
            return None
        key = str(device)
        if key not in self._signs:
            self._signs[key] = common.random_signs(self.hadamard_seed, self.block_size, device)
        return self._signs[key]

    def _to_blocks(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``[T, B]`` blocks (zero padded, bad values zeroed, rotated with ``hadamard``) and the bad mask."""
        tiles, bad = common.to_tiles(x, self.block_size)
        tail = x.shape[-1] % self.block_size
        if tail:
            tiles[:, -1, tail:] = 0.0
        blocks = common.signed_fwht(tiles.reshape(-1, self.block_size), self.signs(x.device))
        return blocks, bad.reshape(-1)

    def _from_blocks(self, blocks: torch.Tensor, shape, dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        return common.from_tiles(common.signed_fwht_inverse(blocks, self.signs(blocks.device)), shape, dtype, out)


class MxFp4Codec(RotatedBlockCodec):
    name = "mxfp4"
    codec_id = 6
    block_size = BLOCK_SIZE

    def _sections(self, shape, dtype):
        return mxfp4_sections(shape)

    def _encode_torch(self, x, buf, layout):
        blocks, bad = self._to_blocks(x)
        scale, codes = mxfp4_encode_reference(blocks, bad)
        layout.view(buf, "scale").copy_(scale)
        self._store_codes(buf, layout, codes)

    def _decode_torch(self, buf, shape, dtype, layout, out=None):
        values = mxfp4_decode_reference(layout.view(buf, "scale"), self._load_codes(buf, layout, shape))
        return self._from_blocks(values, shape, dtype, out)


register_codec_id(MxFp4Codec.codec_id, MxFp4Codec.name)
