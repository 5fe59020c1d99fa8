"""Pure-torch building blocks shared by the reference codecs.

Everything here is the readable reference the Triton kernels must match:
tiling with zero padding, bit packing, the Sylvester Hadamard matrix,
directed rounding to bf16, and the asymmetric per-tile quantizer.
"""

from __future__ import annotations

import math

import torch

from .base import MAX_ABS_VALUE, CodecError

TILE_SIZES = (8, 16, 32, 64, 128)


def check_tile_size(tile_size: int) -> int:
    if tile_size not in TILE_SIZES:
        raise CodecError(f"tile_size must be one of {TILE_SIZES}, got {tile_size}")
    return tile_size


def check_bits(bits: int, name: str = "bits", low: int = 2, high: int = 8) -> int:
    if not isinstance(bits, int) or not low <= bits <= high:
        raise CodecError(f"{name} must be an integer in [{low}, {high}], got {bits!r}")
    return bits


# ----- tiles ---------------------------------------------------------------------------
def num_tiles(h: int, tile_size: int) -> int:
    return -(-h // tile_size)


def to_tiles(x: torch.Tensor, tile_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the last dim into tiles: fp32 ``[tokens, n_tiles, G]`` and a per-tile bad mask.

    When ``h % G != 0`` the last tile is padded by repeating the token's last channel,
    which leaves every tile's range (and a constant tile) unchanged. A tile is *bad* when it holds
    NaN, +-Inf or a magnitude above ``MAX_ABS_VALUE``; its values are replaced by 0
    here so they cannot disturb anything computed from other tiles, and codecs
    decode it as all-NaN.
    """
    h = x.shape[-1]
    tokens = x.reshape(-1, h).float()
    pad = num_tiles(h, tile_size) * tile_size - h
    if pad:
        tokens = torch.cat([tokens, tokens[:, -1:].expand(-1, pad)], dim=1)
    tiles = tokens.reshape(tokens.shape[0], -1, tile_size)
    # NaN compares false, so "not <= MAX_ABS_VALUE" catches NaN, +-Inf and huge values;
    # amax propagates NaN, so one reduction finds the bad tiles.
    bad_tile = ~(tiles.abs().amax(dim=-1) <= MAX_ABS_VALUE)
    if bad_tile.any():
        tiles = tiles.masked_fill(~(tiles.abs() <= MAX_ABS_VALUE), 0.0)
    return tiles, bad_tile


def from_tiles(tiles: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``to_tiles``: drop padding, restore shape, cast (clamped to dtype's range)."""
    h = shape[-1]
    flat = tiles.reshape(math.prod(shape[:-1]), -1)[:, :h]
    if dtype == torch.float16:
        # Rounding to the nearest level may step past fp16's largest finite value.
        limit = torch.finfo(torch.float16).max
        flat = flat.clamp(-limit, limit)
    return flat.reshape(shape).to(dtype)


# ----- bit packing ---------------------------------------------------------------------
def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes (< 2**bits) little-endian: every 8 codes become ``bits`` bytes.

    Code ``i`` of a group of 8 occupies bits ``[i*bits, (i+1)*bits)`` of the
    group's 64-bit little-endian word. ``codes.numel()`` must be a multiple of 8.
    """
    flat = codes.reshape(-1)
    if flat.numel() % 8:
        raise CodecError("pack_bits needs a multiple of 8 codes")
    if bits == 8:
        return flat.to(torch.uint8)
    groups = flat.reshape(-1, 8).to(torch.int64)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    words = (groups << shifts).sum(dim=1, keepdim=True)
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    return ((words >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: ``count`` codes as uint8."""
    if bits == 8:
        return packed[:count].clone()
    groups = packed.reshape(-1, bits).to(torch.int64)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    words = (groups << byte_shifts).sum(dim=1, keepdim=True)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    return ((words >> shifts) & ((1 << bits) - 1)).to(torch.uint8).reshape(-1)[:count]


def packed_nbytes(count: int, bits: int) -> int:
    return count * bits // 8


def pack_flags(flags: torch.Tensor) -> torch.Tensor:
    """Pack a bool vector into bytes, bit ``i % 8`` of byte ``i // 8`` (padded with 0)."""
    flat = flags.reshape(-1).to(torch.uint8)
    pad = -flat.numel() % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return pack_bits(flat, 1)


def unpack_flags(packed: torch.Tensor, count: int) -> torch.Tensor:
    return unpack_bits(packed, 1, count).bool()


def flags_nbytes(count: int) -> int:
    return -(-count // 8)


# ----- Hadamard ------------------------------------------------------------------------
_HADAMARD_CACHE: dict[tuple, torch.Tensor] = {}


def hadamard_matrix(size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Normalised Sylvester Hadamard matrix ``H / sqrt(size)`` (fp32, symmetric, its own inverse)."""
    key = (size, str(device))
    if key not in _HADAMARD_CACHE:
        h = torch.ones(1, 1)
        while h.shape[0] < size:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        if h.shape[0] != size:
            raise CodecError(f"Hadamard size must be a power of two, got {size}")
        _HADAMARD_CACHE[key] = (h / math.sqrt(size)).to(device)
    return _HADAMARD_CACHE[key]


# ----- bf16 metadata -------------------------------------------------------------------
def round_bf16(x: torch.Tensor, direction: int) -> torch.Tensor:
    """Round fp32 ``x`` to a bf16-representable value, down (-1) or up (+1); returns fp32.

    Truncating the low 16 bits rounds toward zero; an inexact value is then moved
    one bf16 step away from zero when that is the requested direction.
    """
    bits = x.contiguous().view(torch.int32)
    truncated = bits & -65536  # 0xFFFF0000
    inexact = (bits & 0xFFFF) != 0
    away = (x < 0) if direction < 0 else (x > 0)
    rounded = torch.where(inexact & away, truncated + 65536, truncated)
    return rounded.view(torch.float32)


# ----- stochastic rounding -------------------------------------------------------------
class RoundingNoise:
    """Uniform [0, 1) noise for stochastic rounding, or None when rounding to nearest.

    One generator per device, seeded with ``seed`` on first use, so a codec's sequence
    of encodes is reproducible run to run.
    """

    def __init__(self, enabled: bool, seed: int):
        self.enabled = bool(enabled)
        self.seed = int(seed)
        self._generators: dict[str, torch.Generator] = {}

    def __call__(self, like: torch.Tensor) -> torch.Tensor | None:
        if not self.enabled:
            return None
        key = str(like.device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=like.device).manual_seed(self.seed)
        return torch.rand(like.shape, generator=self._generators[key], device=like.device)

    def state_dict(self) -> dict:
        """Generator states per device (CPU tensors)."""
        return {device: generator.get_state() for device, generator in self._generators.items()}

    def load_state_dict(self, state: dict) -> None:
        for device, generator_state in state.items():
            generator = torch.Generator(device=device)
            generator.set_state(generator_state)
            self._generators[device] = generator


# ----- the asymmetric quantizer ----------------------------------------------------------
def quantize_tiles(
    tiles: torch.Tensor,
    levels: torch.Tensor | int,
    bad_tile: torch.Tensor,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric per-tile quantization of fp32 ``[..., G]`` tiles.

    ``levels`` is ``2**bits - 1`` (an int, or a tensor broadcastable to ``tiles[..., :1]``).
    Returns ``codes`` (uint8), ``scale`` and ``zero`` (bf16, shape ``tiles.shape[:-1]``).

    ``zero`` is ``min`` rounded down to bf16 and ``scale`` is ``(max - zero) / levels``
    rounded up to bf16, so the grid ``zero + q*scale, q = 0..levels`` covers
    ``[min, max]`` and every decoded element is within ``scale / 2`` of its input
    (round to nearest). A constant tile representable in bf16 gets ``scale = 0``
    and decodes exactly. ``noise`` (uniform in [0, 1), tiles' shape) switches to
    stochastic rounding. Bad tiles get ``zero = NaN`` and decode to NaN.
    """
    lo = tiles.amin(dim=-1)  # (two reductions are several times faster than aminmax on CPU)
    hi = tiles.amax(dim=-1)
    if not isinstance(levels, torch.Tensor):
        levels = torch.full_like(lo, float(levels))
    levels = levels.reshape(lo.shape).float()
    zero = round_bf16(lo, -1)
    # (hi - zero) / levels, split so the subtraction cannot overflow fp32.
    scale = round_bf16(hi / levels - zero / levels, +1)
    flat = ~(scale > 0)
    safe_scale = scale.masked_fill(flat, 1.0)
    scaled = (tiles - zero[..., None]).div_(safe_scale[..., None])
    scaled = scaled.add_(noise).floor_() if noise is not None else scaled.round_()
    codes = torch.minimum(scaled.clamp_min_(0), levels[..., None])
    if flat.any():
        codes.masked_fill_(flat[..., None], 0.0)
    zero = torch.where(bad_tile, torch.full_like(zero, float("nan")), zero)
    return codes.to(torch.uint8), scale.to(torch.bfloat16), zero.to(torch.bfloat16)


def dequantize_tiles(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``codes * scale + zero`` in fp32, per tile (scale and zero have codes' shape minus the last dim)."""
    return codes.float() * scale.float()[..., None] + zero.float()[..., None]
