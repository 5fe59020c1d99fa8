"""``channel``: one asymmetric b-bit grid per hidden channel, shared by every token of the message.

Torch reference here and fused Triton kernels (``kernels/channel.py``) writing the same bytes. The
tile codecs (``fixedpoint``, ``tah``, ``hadint``) give every token's tile its own grid; this one
gives every *channel* one grid, computed over the message's tokens, so a value's reconstruction is
a fixed function of the value for the whole message (and the per-tile metadata goes: two bf16
numbers per channel instead of per tile).

Encode, with ``x`` viewed as ``[rows, h]`` (``h`` the last dim, ``rows = numel / h``):

1. ``lo_c = min_r x[r, c]``, ``hi_c = max_r x[r, c]`` per channel ``c``.
2. ``zero_c = lo_c`` rounded *down* to bf16 and ``scale_c = (hi_c - zero_c) / (2^bits - 1)`` rounded
   *up* to bf16 (``common.quantize_tiles`` with the channel as its tile: the grid
   ``zero + q * scale, q = 0 .. 2^bits - 1`` covers ``[lo, hi]``, and no finite input up to
   ``MAX_ABS_VALUE`` overflows it).
3. Codes ``q = round((x - zero) * (1 / scale))`` (ties to even), or ``floor(... + u)`` with ``u``
   uniform in [0, 1) from ``common.RoundingNoise`` (element ``r * h + c`` of the call's
   ``common.hash_uniform``) when ``stochastic_rounding``, clamped to ``[0, 2^bits - 1]``.

Decode: ``x = q * scale + zero`` in fp32 (the product is exact), cast to the output dtype (fp16
clamped to its range), written into ``out`` when given.

Error: rounding to nearest, every element decodes within ``scale_c / 2`` of its input (up to the
reciprocal's rounding, about ``(2^bits - 1) * 2^-23`` of a step); stochastic rounding, within
``scale_c`` and unbiased. ``scale_c`` is the channel's range over the message divided by
``2^bits - 1`` (rounded up to bf16).

Bad input (the codecs' common rule with a channel for a tile): a channel holding NaN, +-Inf or
``|x| > MAX_ABS_VALUE`` in any row is written as scale 0, zero NaN (``BF16_NAN_BITS``) and all-zero
codes, as ``quantize_tiles`` writes a bad tile, and decodes to NaN in every row; the other channels
are unaffected. The blast radius is a channel over the whole message, not a tile of one token. A
channel whose scale is below the smallest normal fp32 (a constant channel) gets all-zero codes and
decodes to its zero: exactly, when the constant is a bf16 value; zeros decode exactly.

Outlier tokens (``outlier_tokens > 0``): a model's attention-sink tokens carry hidden states tens of times
larger than the others', and one such row sets every channel's range. ``k = outlier_tokens`` rows per
sequence of the message (``channel_outliers``: a ``[s, b, h]`` message holds ``b``; at most
``rows - 1``), those with the largest ``max |x|`` over the whole message (rows holding NaN or +-Inf first;
ties in row order), are sent apart as bf16 with their indices, and each is replaced, before the steps
above, by the next row in that order, so the grids span the other rows only (in torch before either
path: a sort of the rows and a copy of the message). Decode writes them back: those rows decode to their
bf16 values (NaN and Inf included: a bad value among them stays in its row).

Wire (row-major, token-major and channel-minor; sizes in ``kernels/channel.py``, ``channel_sections``):
header | ``scale``: bf16[h] | ``zero``: bf16[h] | ``codes``: rows*h codes of ``bits`` bits packed by
``common.pack_bits``, padded with zero codes to a multiple of 8 | with outlier tokens, ``outlier_index``:
int32[k] | ``outlier_rows``: bf16[k, h]. ``bits + 32 / rows`` bits per element, plus the 16-byte header
and the alignment of each section to 8 bytes: 4.5 at 4 bits and 64 tokens, 4.03 at 1024 tokens; outlier
tokens add ``(16 h + 32) k / (rows h)``: 0.016 at one per sequence of ``[1024, 8, 1024]``.
"""

from __future__ import annotations

import math

import torch

from .. import geometry
from ..kernels.channel import channel_code_count, channel_outliers, channel_sections
from .core import common
from .core.base import CHECKSUM_DEFAULT, Codec
from .core.errors import CodecError
from .core.header import register_codec_id
from .core.options import CodecDeclaration, Option

DECLARATION = CodecDeclaration(
    takes=("bits", "stochastic_rounding"), kernel=True,
    options=(Option("tah_channel_outlier_tokens", "outlier_tokens", int, 0,
                    "channel: tokens per sequence, those of the message with the largest magnitudes (attention "
                    "sinks), sent apart in bf16 and left out of the per-channel grids; 0: none.",
                    bounds=(0, math.inf)),))
CHANNEL_SECTIONS = ("scale", "zero", "codes")


def to_channels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``[h, rows]`` (a transposed view: one row per channel) of ``x`` with its bad values set to 0,
    and the per-channel bad mask ``[h]`` (``common.bad_mask``)."""
    rows = x.reshape(-1, x.shape[-1]).float()
    bad = common.bad_mask(rows)
    return rows.masked_fill(bad, 0.0).t(), bad.any(dim=0)


def channel_encode_reference(x: torch.Tensor, bits: int, seed: int | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` (any shape, last dim ``h``) -> int16 bits of the bf16 ``scale`` and ``zero`` (``[h]``) and the
    uint8 codes ``[rows, h]``; ``seed`` (a ``RoundingNoise`` call seed) switches to stochastic rounding."""
    channels, bad = to_channels(x)
    noise = None
    if seed is not None:
        rows = channels.shape[1]
        noise = common.hash_uniform(seed, channels.numel(), channels.device).reshape(rows, -1).t()
    codes, scale, zero = common.quantize_tiles(channels, 2**bits - 1, bad, noise)
    return scale, zero, codes.t()


def split_outliers(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` (contiguous) with its ``k`` outlier rows replaced by the next row in their order (the module
    docstring), their indices int64 ``[k]`` and their values bf16 ``[k, h]``."""
    rows = x.reshape(-1, x.shape[-1])
    size = rows.float().abs().amax(dim=1).nan_to_num(nan=math.inf)
    order = torch.argsort(size, descending=True, stable=True)
    index = order[:k]
    kept = rows.clone()
    kept[index] = rows[order[k]]
    return kept.view(x.shape), index, rows[index].to(torch.bfloat16)


def merge_outliers(values: torch.Tensor, index: torch.Tensor, outliers: torch.Tensor) -> torch.Tensor:
    """Write the bf16 outlier rows into the decoded ``values`` (any shape, last dim ``h``; fp16 clamped to its
    range) at ``index`` (out-of-range indices, only in a payload no checksum guarded, are clamped)."""
    rows = values.view(-1, values.shape[-1])
    patch = outliers.float()
    if values.dtype == torch.float16:
        limit = torch.finfo(torch.float16).max
        patch = patch.clamp(-limit, limit)
    rows.index_copy_(0, index.long().clamp(0, rows.shape[0] - 1), patch.to(values.dtype))
    return values


def channel_decode_reference(scale: torch.Tensor, zero: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """fp32 ``codes * scale + zero`` of ``[rows, h]`` codes and bf16 ``[h]`` scale and zero (the product is exact,
    so fused or not, the same number)."""
    return codes.float() * scale.float() + zero.float()


class ChannelCodec(Codec):
    name = "channel"
    codec_id = 10

    def __init__(self, bits: int = 4, stochastic_rounding: bool = False, outlier_tokens: int = 0, seed: int = 0,
                 backend: str = "auto", checksum: bool = CHECKSUM_DEFAULT):
        super().__init__(backend, checksum)
        self.bits = common.check_bits(bits)
        if not isinstance(stochastic_rounding, bool):
            raise CodecError(f"stochastic_rounding must be True or False, got {stochastic_rounding!r}")
        if isinstance(outlier_tokens, bool) or not isinstance(outlier_tokens, int) or outlier_tokens < 0:
            raise CodecError(f"outlier_tokens must be an integer >= 0, got {outlier_tokens!r}")
        self.stochastic_rounding = stochastic_rounding
        self.outlier_tokens = outlier_tokens
        self.seed = int(seed)
        self.rounding_noise = common.RoundingNoise(self.stochastic_rounding, self.seed)

    def code_sections(self) -> dict[str, int]:
        return {"codes": self.bits}

    def config(self) -> dict:
        # outlier_tokens only when set: without it the wire (and the digest) is the one from before it existed
        return {"bits": self.bits, "stochastic_rounding": self.stochastic_rounding,
                **({"outlier_tokens": self.outlier_tokens} if self.outlier_tokens else {})}

    def _sections(self, shape, dtype):
        return channel_sections(shape, self.bits, self.outlier_tokens)

    def _split(self, x, buf, layout):
        """``x`` for the grids: with outlier tokens, their rows written to their sections and replaced in ``x``."""
        k = channel_outliers(x.shape, self.outlier_tokens)
        if not k:
            return x
        kept, index, outliers = split_outliers(x, k)
        layout.view(buf, "outlier_index", torch.int32).copy_(index)
        layout.view(buf, "outlier_rows", torch.bfloat16).copy_(outliers.reshape(-1))
        return kept

    def _merge(self, values, buf, layout):
        if "outlier_index" not in layout.offsets:
            return values
        h = values.shape[-1]
        return merge_outliers(values, layout.view(buf, "outlier_index", torch.int32),
                              layout.view(buf, "outlier_rows", torch.bfloat16).reshape(-1, h))

    def _encode_torch(self, x, buf, layout):
        x = self._split(x, buf, layout)
        scale, zero, codes = channel_encode_reference(x, self.bits, self.rounding_noise.next_seed())
        layout.view(buf, "scale", torch.int16).copy_(scale)
        layout.view(buf, "zero", torch.int16).copy_(zero)
        flat = codes.reshape(-1)
        pad = channel_code_count(x.shape) - flat.numel()
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        layout.view(buf, "codes").copy_(common.pack_bits(flat, self.bits))

    def _decode_torch(self, buf, shape, dtype, layout, out=None):
        h = shape[-1]
        codes = common.unpack_bits(layout.view(buf, "codes"), self.bits, geometry.num_tokens(shape) * h)
        values = channel_decode_reference(layout.view(buf, "scale", torch.bfloat16),
                                          layout.view(buf, "zero", torch.bfloat16), codes.reshape(-1, h))
        return self._merge(common.from_tiles(values, shape, dtype, out), buf, layout)

    def _encode_triton(self, x, buf, layout):
        from ..kernels.channel import triton_channel_encode

        x = self._split(x, buf, layout)
        triton_channel_encode(x, self._grid_sections(buf, layout), self.bits, seed=self.rounding_noise.next_seed())

    def _decode_triton(self, buf, shape, dtype, layout, out=None):
        from ..kernels.channel import triton_channel_decode

        values = triton_channel_decode(self._grid_sections(buf, layout), shape, dtype, self.bits, out=out)
        return self._merge(values, buf, layout)

    @staticmethod
    def _grid_sections(buf, layout):
        sections = layout.sections(buf)
        return {name: sections[name] for name in CHANNEL_SECTIONS}


register_codec_id(ChannelCodec.codec_id, ChannelCodec.name)
