"""``tah``: TAH-Quant, tile-wise adaptive Hadamard quantization (SPEC section 1).

Encode, for an ``[s, b, h]`` tensor (``h`` padded to whole tiles of ``G`` channels by
repeating each token's last channel, see ``common.to_tiles``):

1. **Bit allocation at a fixed ratio.** ``allocation="token"`` (paper v1): each token's
   entropy ``H = -sum p log(p + eps)``, ``p = |x| / (sum |x| + eps)`` over its channels;
   in every sample (column ``b``) the ``floor(s * (1 - high_ratio))`` lowest-entropy
   tokens get ``low_bits``, the rest ``high_bits``. ``allocation="tile"`` (paper v2):
   the same rule over the tiles of each token, ``floor(n_tiles * (1 - high_ratio))`` low
   tiles per token. Ties go to the lower index (stable sort). The number of low-bit
   units depends only on the shape, so the wire size does too. ``low_bits_for=
   "high_entropy"`` inverts the rule (the highest-entropy units get ``low_bits``): a
   diagnostic knob for the ablations, not the paper's method.
2. **Outlier test, pivot swap, Hadamard.** A tile is rotated when
   ``|a1| / (|a2| + eps) > outlier_threshold`` (``a1``, ``a2``: its two largest
   magnitudes; ``0`` rotates every tile, ``inf`` none). Rotation swaps the
   largest-magnitude element (first one on ties) into position 0, then multiplies by
   ``H_G / sqrt(G)``; row 0 of ``H_G`` is all ones, so the outlier becomes a constant
   offset that the zero-point absorbs. Decode rotates again (the matrix is its own
   inverse) and swaps back.
3. **Asymmetric per-tile quantization** (``common.quantize_tiles``): bf16 scale and
   zero, round to nearest (or stochastic), within ``scale / 2`` per element in the
   rotated domain; a rotated tile's L2 error is at most ``sqrt(G) * scale / 2``.

Tiles holding NaN, +-Inf or ``|x| > MAX_ABS_VALUE`` decode to all-NaN; others are untouched.

Wire (T tiles in token order ``(s, b)``, then tile order):
header | ``flags``: 1 bit per allocation unit (token or tile), set = low bits |
``scale``: bf16[T] | ``zero``: bf16[T] | ``meta``: uint8[T] = ``rotated << 7 | pivot`` |
``high``: codes of the high-bit tiles in order, packed at ``high_bits`` |
``low``: codes of the low-bit tiles in order, packed at ``low_bits``.
At G=64, 4/3 bits, 80/20: 3.8 + 40/64 bits of metadata = ~4.43 bits per element.
"""

from __future__ import annotations

import math

import torch

from . import common
from .base import Codec, CodecError, register_codec_id

EPS = 1e-8
ALLOCATIONS = ("token", "tile")
LOW_BITS_FOR = ("low_entropy", "high_entropy")


class TahCodec(Codec):
    name = "tah"
    codec_id = 2

    def __init__(self, tile_size: int = 64, high_bits: int = 4, low_bits: int = 3, high_ratio: float = 0.8,
                 outlier_threshold: float = 2.0, allocation: str = "token", stochastic_rounding: bool = False,
                 seed: int = 0, backend: str = "auto", low_bits_for: str = "low_entropy"):
        super().__init__(backend)
        self.tile_size = common.check_tile_size(tile_size)
        self.high_bits = common.check_bits(high_bits, "high_bits")
        self.low_bits = common.check_bits(low_bits, "low_bits")
        if self.low_bits > self.high_bits:
            raise CodecError(f"low_bits ({low_bits}) must not exceed high_bits ({high_bits})")
        self.high_ratio = float(high_ratio)
        if not 0.0 <= self.high_ratio <= 1.0:
            raise CodecError(f"high_ratio must lie in [0, 1], got {high_ratio}")
        self.outlier_threshold = float(outlier_threshold)
        if math.isnan(self.outlier_threshold) or self.outlier_threshold < 0:
            raise CodecError(f"outlier_threshold must be >= 0 (0: always rotate, inf: never), got {outlier_threshold}")
        if allocation not in ALLOCATIONS:
            raise CodecError(f"allocation must be one of {ALLOCATIONS}, got {allocation!r}")
        self.allocation = allocation
        if low_bits_for not in LOW_BITS_FOR:
            raise CodecError(f"low_bits_for must be one of {LOW_BITS_FOR}, got {low_bits_for!r}")
        self.low_bits_for = low_bits_for
        self.stochastic_rounding = bool(stochastic_rounding)
        self.seed = int(seed)
        self.rounding_noise = common.RoundingNoise(self.stochastic_rounding, self.seed)
        self._last_rotated: torch.Tensor | None = None

    def config(self) -> dict:
        return {
            "tile_size": self.tile_size, "high_bits": self.high_bits, "low_bits": self.low_bits,
            "high_ratio": self.high_ratio, "outlier_threshold": self.outlier_threshold,
            "allocation": self.allocation, "stochastic_rounding": self.stochastic_rounding,
            "low_bits_for": self.low_bits_for,
        }

    @property
    def last_rotated_fraction(self) -> float | None:
        """Fraction of tiles the last ``encode`` rotated (None before the first encode)."""
        return None if self._last_rotated is None else float(self._last_rotated)

    # ----- shape-only quantities (shared with the Triton path) --------------------------
    @staticmethod
    def _dims(shape) -> tuple[int, int, int]:
        if len(shape) != 3:
            raise CodecError(f"tah takes [s, b, h] tensors, got shape {tuple(shape)}")
        return shape

    def low_units_per_group(self, shape) -> int:
        """Low-bit units per selection group: tokens per sample, or tiles per token."""
        s, _, h = self._dims(shape)
        units = s if self.allocation == "token" else common.num_tiles(h, self.tile_size)
        return int(math.floor(units * (1.0 - self.high_ratio) + 1e-9))

    def tile_counts(self, shape) -> tuple[int, int, int]:
        """(all tiles, low-bit tiles, allocation units) for ``shape``."""
        s, b, h = self._dims(shape)
        n_tiles = common.num_tiles(h, self.tile_size)
        total = s * b * n_tiles
        if self.allocation == "token":
            return total, self.low_units_per_group(shape) * b * n_tiles, s * b
        return total, self.low_units_per_group(shape) * s * b, total

    def _sections(self, shape, dtype):
        total, low, units = self.tile_counts(shape)
        g = self.tile_size
        return [
            ("flags", common.flags_nbytes(units)),
            ("scale", 2 * total),
            ("zero", 2 * total),
            ("meta", total),
            ("high", common.packed_nbytes((total - low) * g, self.high_bits)),
            ("low", common.packed_nbytes(low * g, self.low_bits)),
        ]

    # ----- reference encode ---------------------------------------------------------
    def allocate_low_bits(self, tiles: torch.Tensor, shape) -> torch.Tensor:
        """Bool ``[tokens, n_tiles]``: which tiles get ``low_bits`` (fixed count per group)."""
        s, b, h = shape
        n_low = self.low_units_per_group(shape)
        # Entropy over the real channels only: padding channels count as zero.
        magnitude = tiles.abs()
        if h % self.tile_size:
            magnitude = magnitude.reshape(tiles.shape[0], -1)
            magnitude[:, h:] = 0
            magnitude = magnitude.reshape(tiles.shape)
        if self.allocation == "token":
            p = magnitude.div_(magnitude.sum(dim=(1, 2), keepdim=True) + EPS)
            entropy = -(p * (p + EPS).log_()).sum(dim=(1, 2)).reshape(s, b)
            order = torch.sort(self.selection_key(entropy), dim=0, stable=True).indices[:n_low]
            low_token = torch.zeros(s, b, dtype=torch.bool, device=tiles.device)
            low_token.scatter_(0, order, True)
            return low_token.reshape(-1, 1).expand(-1, tiles.shape[1])
        p = magnitude / (magnitude.sum(dim=2, keepdim=True) + EPS)
        entropy = -(p * torch.log(p + EPS)).sum(dim=2)
        order = torch.sort(self.selection_key(entropy), dim=1, stable=True).indices[:, :n_low]
        low = torch.zeros(entropy.shape, dtype=torch.bool, device=tiles.device)
        return low.scatter_(1, order, True)

    def selection_key(self, entropy: torch.Tensor) -> torch.Tensor:
        """Ascending order of this key picks the low-bit units: entropy, or -entropy when inverted."""
        return entropy if self.low_bits_for == "low_entropy" else -entropy

    def find_outliers(self, tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rotate flag, pivot index) per tile; the pivot is 0 for tiles left unrotated."""
        if self.outlier_threshold == math.inf:
            never = torch.zeros(tiles.shape[:-1], dtype=torch.bool, device=tiles.device)
            return never, never.long()
        magnitude = tiles.abs()
        if self.outlier_threshold == 0:
            return torch.ones(tiles.shape[:-1], dtype=torch.bool, device=tiles.device), magnitude.argmax(dim=-1)
        # a1, a2 = topk(2): a2 is a1 again when the largest magnitude is tied, else the largest of the rest.
        # (amax and compares instead of topk/argmax over every tile: several times faster on CPU.)
        a1 = magnitude.amax(dim=-1, keepdim=True)
        is_largest = magnitude == a1
        a2 = torch.where(is_largest, -1.0, magnitude).amax(dim=-1)
        a2 = torch.where(is_largest.sum(dim=-1) > 1, a1[..., 0], a2)
        rotate = a1[..., 0] / (a2 + EPS) > self.outlier_threshold
        pivot = torch.zeros(rotate.shape, dtype=torch.long, device=tiles.device)
        if rotate.any():
            pivot[rotate] = magnitude[rotate].argmax(dim=-1)  # the first one on ties
        return rotate, pivot

    def _encode_torch(self, x, buf, layout):
        shape = self._dims(tuple(x.shape))
        tiles, bad = common.to_tiles(x, self.tile_size)
        low = self.allocate_low_bits(tiles, shape)
        rotate, pivot = self.find_outliers(tiles)
        rotated = rotate_tiles(tiles, rotate, pivot)
        levels = torch.where(low, 2**self.low_bits - 1, 2**self.high_bits - 1)
        codes, scale, zero = common.quantize_tiles(rotated, levels, bad, self.rounding_noise(rotated))
        self._last_rotated = rotate.float().mean()

        flags = low[:, 0] if self.allocation == "token" else low
        layout.view(buf, "flags").copy_(common.pack_flags(flags))
        layout.view(buf, "scale", torch.bfloat16).copy_(scale.reshape(-1))
        layout.view(buf, "zero", torch.bfloat16).copy_(zero.reshape(-1))
        layout.view(buf, "meta").copy_((rotate.to(torch.uint8) << 7 | pivot.to(torch.uint8)).reshape(-1))
        layout.view(buf, "high").copy_(common.pack_bits(codes[~low], self.high_bits))
        layout.view(buf, "low").copy_(common.pack_bits(codes[low], self.low_bits))

    # ----- reference decode ---------------------------------------------------------
    def _decode_torch(self, buf, shape, dtype, layout):
        s, b, h = self._dims(shape)
        g = self.tile_size
        n_tiles = common.num_tiles(h, g)
        total, n_low, units = self.tile_counts(shape)
        flags = common.unpack_flags(layout.view(buf, "flags"), units)
        low = flags.reshape(-1, 1).expand(-1, n_tiles) if self.allocation == "token" else flags.reshape(-1, n_tiles)
        if int(low.sum()) != n_low:
            raise CodecError(f"corrupt tah buffer: {int(low.sum())} low-bit tiles flagged, {n_low} expected")
        codes = torch.empty(s * b, n_tiles, g, dtype=torch.uint8, device=buf.device)
        codes[~low] = common.unpack_bits(layout.view(buf, "high"), self.high_bits, (total - n_low) * g).reshape(-1, g)
        codes[low] = common.unpack_bits(layout.view(buf, "low"), self.low_bits, n_low * g).reshape(-1, g)
        scale = layout.view(buf, "scale", torch.bfloat16).reshape(s * b, n_tiles)
        zero = layout.view(buf, "zero", torch.bfloat16).reshape(s * b, n_tiles)
        meta = layout.view(buf, "meta").reshape(s * b, n_tiles)
        rotate = (meta >> 7).bool()
        pivot = (meta & 0x7F).long()
        if int(pivot.max()) >= g:
            raise CodecError(f"corrupt tah buffer: pivot index {int(pivot.max())} outside a tile of {g}")
        values = common.dequantize_tiles(codes, scale, zero)
        return common.from_tiles(unrotate_tiles(values, rotate, pivot), shape, dtype)

    # ----- fused Triton path (megatron_tah/kernels/tah.py) --------------------------
    def _encode_triton(self, x, buf, layout):
        from ..kernels.common import philox_seed
        from ..kernels.tah import triton_tah_encode

        self._last_rotated = triton_tah_encode(self, x, buf, layout, seed=philox_seed(self.rounding_noise))

    def _decode_triton(self, buf, shape, dtype, layout):
        from ..kernels.tah import triton_tah_decode

        return triton_tah_decode(self, buf, shape, dtype, layout)


def _swap_index(pivot: torch.Tensor, tile_size: int) -> torch.Tensor:
    """Gather index that swaps element 0 and element ``pivot`` of each tile (an involution)."""
    index = torch.arange(tile_size, device=pivot.device).expand(*pivot.shape, tile_size).clone()
    index[..., 0] = pivot
    return index.scatter_(-1, pivot[..., None], 0)


def rotate_tiles(tiles: torch.Tensor, rotate: torch.Tensor, pivot: torch.Tensor) -> torch.Tensor:
    """Pivot swap then ``H / sqrt(G)`` on the tiles flagged in ``rotate``; others unchanged."""
    if not rotate.any():
        return tiles
    g = tiles.shape[-1]
    picked = tiles[rotate]
    out = tiles.clone()
    out[rotate] = picked.gather(-1, _swap_index(pivot[rotate], g)) @ common.hadamard_matrix(g, tiles.device)
    return out


def unrotate_tiles(tiles: torch.Tensor, rotate: torch.Tensor, pivot: torch.Tensor) -> torch.Tensor:
    """Inverse of ``rotate_tiles``: Hadamard again, then undo the swap."""
    if not rotate.any():
        return tiles
    g = tiles.shape[-1]
    picked = tiles[rotate] @ common.hadamard_matrix(g, tiles.device)
    out = tiles.clone()
    out[rotate] = picked.gather(-1, _swap_index(pivot[rotate], g))
    return out


register_codec_id(TahCodec.codec_id, TahCodec.name)
# REFERENCE COMPLETE
