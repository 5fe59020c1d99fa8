"""``fp8``: TACO-style FP8 (E4M3) with an adaptive pre-scale and a Hadamard per group (SPEC section 4).

Encode, per group of ``G = group_size`` channels of one token (``h`` padded with zeros to
whole groups, not with ``common.to_tiles``' repeated last channel: zeros carry no energy
into the Hadamard, so the last group keeps its precision; ``G`` a power of two, 8..128):

1. **Pre-scale** ``alpha = 448 / sqrt(mean(x^2) + 1e-6)``, clamped to ``[1e-3, 1e3]``.
   Computed without overflow or underflow as ``448 / hypot(rms, 1e-3)`` with
   ``rms = peak * sqrt(mean((x / peak)^2))``, ``peak = max|x|`` (``rms = 0`` for a zero group).
2. **Hadamard** on every group (no outlier test): ``y = (alpha * x) @ H_G / sqrt(G)``.
3. **Post-scale** ``s = max|y| / 448`` (a zero group stores ``s = 0`` and divides by 1).
4. **E4M3** codes ``q = e4m3(clamp(y / s, -448, 448))`` (round to nearest even, saturated).

Decode: ``x = (q * s) @ H_G / sqrt(G) / alpha`` (the normalised Hadamard is its own inverse).

Error: the Hadamard is orthonormal and E4M3 rounds within ``2^-4`` relative (normals) or
``2^-10`` absolute (subnormals, in units of ``s``), so per group
``||x - decode(x)|| <= (2^-4 + 2^-10 * sqrt(G) / 448) * ||x||`` before the cast to the
output dtype. Finite inputs up to ``MAX_ABS_VALUE`` never overflow (alpha >= 1e-3 keeps
``|y| <= sqrt(G) * 1e33``). A group holding NaN, +-Inf or ``|x| > MAX_ABS_VALUE`` stores
``alpha = NaN`` and decodes to all-NaN; other groups are unaffected.

Wire (T = tokens * ceil(h / G) groups, token-major):
header | ``prescale``: fp32[T] (alpha) | ``postscale``: fp32[T] (s) | ``codes``: E4M3 bytes[T*G].
At G=128: 8 + 64/128 = 8.5 bits per element (plus the 16-byte header).
"""

from __future__ import annotations

import math

import torch

from . import common
from .base import Codec, register_codec_id

FP8_MAX = 448.0  # largest finite float8_e4m3fn
PRESCALE_MIN = 1e-3
PRESCALE_MAX = 1e3
RMS_EPS = 1e-3  # sqrt of the 1e-6 added to mean(x^2)


def prescale_reference(groups: torch.Tensor) -> torch.Tensor:
    """``alpha`` per group of fp32 ``[T, G]`` finite values: ``448 / sqrt(mean(x^2) + 1e-6)`` clamped."""
    peak = groups.abs().amax(dim=-1)
    safe_peak = torch.where(peak > 0, peak, torch.ones_like(peak))
    rms = safe_peak * (groups / safe_peak[:, None]).square().mean(dim=-1).sqrt()
    alpha = FP8_MAX / torch.hypot(rms, torch.full_like(rms, RMS_EPS))
    return alpha.clamp(PRESCALE_MIN, PRESCALE_MAX)


def fp8_encode_reference(groups: torch.Tensor, bad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 ``[T, G]`` groups (bad ones zeroed) -> ``alpha`` fp32[T], ``s`` fp32[T], E4M3 codes uint8 ``[T, G]``."""
    hadamard = common.hadamard_matrix(groups.shape[-1], groups.device)
    alpha = prescale_reference(groups)
    rotated = (groups * alpha[:, None]) @ hadamard
    post = rotated.abs().amax(dim=-1) / FP8_MAX
    safe_post = torch.where(post > 0, post, torch.ones_like(post))
    scaled = (rotated / safe_post[:, None]).clamp(-FP8_MAX, FP8_MAX)
    codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    alpha = torch.where(bad, torch.full_like(alpha, float("nan")), alpha)
    return alpha, post, codes


def fp8_decode_reference(alpha: torch.Tensor, post: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Inverse of ``fp8_encode_reference``: fp32 ``[T, G]``."""
    hadamard = common.hadamard_matrix(codes.shape[-1], codes.device)
    rotated = codes.view(torch.float8_e4m3fn).float() * post[:, None]
    return (rotated @ hadamard) / alpha[:, None]


class Fp8Codec(Codec):
    name = "fp8"
    codec_id = 3

    def __init__(self, group_size: int = 128, backend: str = "auto"):
        super().__init__(backend)
        self.group_size = common.check_tile_size(group_size)

    def config(self) -> dict:
        return {"group_size": self.group_size}

    def num_groups(self, shape) -> int:
        return math.prod(shape[:-1]) * common.num_tiles(shape[-1], self.group_size)

    def _sections(self, shape, dtype):
        groups = self.num_groups(shape)
        return [
            ("prescale", 4 * groups),
            ("postscale", 4 * groups),
            ("codes", groups * self.group_size),
        ]

    def _encode_torch(self, x, buf, layout):
        tiles, bad = common.to_tiles(x, self.group_size)
        tail = x.shape[-1] % self.group_size
        if tail:
            tiles[:, -1, tail:] = 0.0
        alpha, post, codes = fp8_encode_reference(tiles.reshape(-1, self.group_size), bad.reshape(-1))
        layout.view(buf, "prescale", torch.float32).copy_(alpha)
        layout.view(buf, "postscale", torch.float32).copy_(post)
        layout.view(buf, "codes").copy_(codes.reshape(-1))

    def _decode_torch(self, buf, shape, dtype, layout):
        alpha = layout.view(buf, "prescale", torch.float32)
        post = layout.view(buf, "postscale", torch.float32)
        codes = layout.view(buf, "codes").reshape(-1, self.group_size)
        return common.from_tiles(fp8_decode_reference(alpha, post, codes), shape, dtype)

    # ----- fused Triton path (megatron_tah/kernels/fp8.py) --------------------------
    def _encode_triton(self, x, buf, layout):
        from ..kernels.fp8 import triton_fp8_encode

        triton_fp8_encode(x, buf, layout, self.group_size)

    def _decode_triton(self, buf, shape, dtype, layout):
        from ..kernels.fp8 import triton_fp8_decode

        return triton_fp8_decode(buf, shape, dtype, layout, self.group_size)


register_codec_id(Fp8Codec.codec_id, Fp8Codec.name)
# REFERENCE COMPLETE
