"""``fp8``: TACO-style FP8 (E4M3) with an adaptive pre-scale and a Hadamard per group (SPEC section 4).

Encode, per group of ``G = group_size`` channels of one token (``h`` padded with zeros to
whole groups, not with ``common.to_tiles``' repeated last channel: zeros carry no energy
into the Hadamard, so the last group keeps its precision; ``G`` a power of two, 8..128):

1. **Pre-scale** ``alpha = 448 / sqrt(mean(x^2) + 1e-6)``, clamped to ``[1e-3, 1e3]``.
   Computed without overflow or underflow as ``448 / hypot(rms, 1e-3)`` with
   ``rms = peak * sqrt(mean((x * (1/peak))^2))``, ``peak = max|x|`` (``rms = 0`` for a zero group).
2. **Hadamard** on every group (no outlier test): ``y = fwht(alpha * x)`` (``common.fwht``:
   ``(alpha * x) @ H_G / sqrt(G)`` by butterflies).
3. **Post-scale** ``s = max|y| / 448`` (a group with ``s`` below the smallest normal fp32 multiplies by 1).
4. **E4M3** codes ``q = e4m3(clamp(y * (1/s), -448, 448))`` (round to nearest even, saturated).

Decode: ``x = fwht(q * s) * (1/alpha)`` (the normalised Hadamard is its own inverse).
Every step is spelled out in fp32 in a fixed order (sums as ``common.tree_sum``), so the
torch reference and the kernels write the same bytes.

Error: the Hadamard is orthonormal and E4M3 rounds within ``2^-4`` relative (normals) or
``2^-10`` absolute (subnormals, in units of ``s``), so per group
``||x - decode(x)|| <= (2^-4 + 2^-10 * sqrt(G) / 448) * ||x||`` before the cast to the
output dtype. Finite inputs up to ``MAX_ABS_VALUE`` never overflow (alpha >= 1e-3 keeps
``|y| <= sqrt(G) * 1e33``). A group holding NaN, +-Inf or ``|x| > MAX_ABS_VALUE`` stores
``alpha = NaN`` (``s = 0``, zero codes) and decodes to all-NaN; other groups are unaffected.

Wire (T = tokens * ceil(h / G) groups, token-major; sizes in ``kernels/fp8.py``, ``fp8_sections``):
header | ``prescale``: fp32[T] (alpha) | ``postscale``: fp32[T] (s) | ``codes``: E4M3 bytes[T*G].
At G=128: 8 + 64/128 = 8.5 bits per element (plus the 16-byte header).
"""

from __future__ import annotations

import torch

from .. import geometry
from ..numerics import FP8_MAX  # noqa: F401  (re-exported)
from ..kernels.fp8 import FP32_NAN_BITS, PRESCALE_MAX, PRESCALE_MIN, RMS_EPS, fp8_sections
from .core import common
from .core.base import CHECKSUM_DEFAULT, Codec
from .core.header import register_codec_id
from .core.options import CodecDeclaration, Option

DECLARATION = CodecDeclaration(
    kernel=True,
    options=(Option("tah_fp8_group_size", "group_size", int, 128, "Group size of the fp8 codec (pipeline or "
                    "tensor-parallel).", choices=geometry.TILE_SIZES),),
)


def hypot_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sqrt(a^2 + b^2)`` for ``a, b >= 0`` without overflow: ``big * sqrt(1 + (small / big)^2)``."""
    big = torch.maximum(a, b)
    small = torch.minimum(a, b)
    ratio = common.div_rn(small, torch.where(big > 0, big, torch.ones_like(big)))
    return big * common.sqrt_rn(1.0 + ratio * ratio)


def prescale_reference(groups: torch.Tensor) -> torch.Tensor:
    """``alpha`` per group of fp32 ``[T, G]`` finite values: ``448 / sqrt(mean(x^2) + 1e-6)`` clamped.

    ``mean(x^2)`` is ``peak^2 * mean((x * (1 / peak))^2)`` with the sum as ``common.tree_sum``.
    """
    peak = groups.abs().amax(dim=-1)
    safe_peak = torch.where(peak > 0, peak, torch.ones_like(peak))
    r = groups * common.div_rn(1.0, safe_peak)[:, None]
    rms = safe_peak * common.sqrt_rn(common.tree_sum(r * r) * (1.0 / groups.shape[-1]))
    alpha = common.div_rn(FP8_MAX, hypot_reference(rms, torch.full_like(rms, RMS_EPS)))
    return alpha.clamp(PRESCALE_MIN, PRESCALE_MAX)


def fp8_encode_reference(groups: torch.Tensor, bad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 ``[T, G]`` groups (bad values zeroed) -> ``alpha`` fp32[T], ``s`` fp32[T], E4M3 codes uint8 ``[T, G]``.

    A bad group is written as alpha NaN, s 0 and zero codes.
    """
    alpha = prescale_reference(groups)
    rotated = common.fwht(groups * alpha[:, None])
    post = common.div_rn(rotated.abs().amax(dim=-1), FP8_MAX)
    inverse = common.div_rn(1.0, torch.where(post >= common.FLAT_SCALE, post, torch.ones_like(post)))
    scaled = (rotated * inverse[:, None]).clamp(-FP8_MAX, FP8_MAX)
    codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    alpha = torch.where(bad, torch.full_like(alpha, float("nan")), alpha)
    post = post.masked_fill(bad, 0.0)
    codes = codes.masked_fill(bad[:, None], 0)
    return alpha, post, codes


def fp8_decode_reference(alpha: torch.Tensor, post: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Inverse of ``fp8_encode_reference``: fp32 ``[T, G]`` (``fwht(q * s) * (1 / alpha)``)."""
    rotated = codes.view(torch.float8_e4m3fn).float() * post[:, None]
    return common.fwht(rotated) * common.div_rn(1.0, alpha)[:, None]


class Fp8Codec(Codec):
    name = "fp8"
    codec_id = 3

    def __init__(self, group_size: int = 128, backend: str = "auto", checksum: bool = CHECKSUM_DEFAULT):
        super().__init__(backend, checksum)
        self.group_size = common.check_tile_size(group_size)

    def config(self) -> dict:
        return {"group_size": self.group_size}

    def _sections(self, shape, dtype):
        return fp8_sections(shape, self.group_size)

    def _encode_torch(self, x, buf, layout):
        tiles, bad = common.to_tiles(x, self.group_size)
        tail = x.shape[-1] % self.group_size
        if tail:
            tiles[:, -1, tail:] = 0.0
        alpha, post, codes = fp8_encode_reference(tiles.reshape(-1, self.group_size), bad.reshape(-1))
        alpha_bits = alpha.view(torch.int32).masked_fill(bad.reshape(-1), FP32_NAN_BITS)
        layout.view(buf, "prescale", torch.int32).copy_(alpha_bits)
        layout.view(buf, "postscale", torch.float32).copy_(post)
        layout.view(buf, "codes").copy_(codes.reshape(-1))

    def _decode_torch(self, buf, shape, dtype, layout, out=None):
        alpha = layout.view(buf, "prescale", torch.float32)
        post = layout.view(buf, "postscale", torch.float32)
        codes = layout.view(buf, "codes").reshape(-1, self.group_size)
        return common.from_tiles(fp8_decode_reference(alpha, post, codes), shape, dtype, out)

    # ----- fused Triton path (megatron_tah/kernels/fp8.py) --------------------------
    def _encode_triton(self, x, buf, layout):
        from ..kernels.fp8 import triton_fp8_encode

        triton_fp8_encode(x, layout.sections(buf), self.group_size)

    def _decode_triton(self, buf, shape, dtype, layout, out=None):
        from ..kernels.fp8 import triton_fp8_decode

        return triton_fp8_decode(layout.sections(buf), shape, dtype, self.group_size, out=out)


register_codec_id(Fp8Codec.codec_id, Fp8Codec.name)
