"""Pure-torch building blocks shared by the reference codecs.

Everything here is the readable reference the Triton kernels must match byte for byte:
tiling, bit packing, the Walsh-Hadamard transform in butterfly order, pairwise tree sums,
directed rounding to bf16, the counter-based rounding noise and the asymmetric per-tile
quantizer. Each function spells out its fp32 operations in the order the kernels perform
them (no fused multiply-adds, sums in a fixed tree order, reciprocal multiplies where a
kernel would otherwise divide per element), so the torch and Triton paths write the same
bytes on every device.
"""

from __future__ import annotations

import math
import zlib

import torch

from ... import geometry, numerics
from ...geometry import flags_nbytes, num_tiles, packed_nbytes  # noqa: F401  (re-exported)
from .errors import CodecError

TILE_SIZES = geometry.TILE_SIZES
FLAT_SCALE = 2.0**-126  # a scale below the smallest normal fp32 quantizes its tile to zero codes


def check_tile_size(tile_size: int) -> int:
    if tile_size not in TILE_SIZES:
        raise CodecError(f"tile_size must be one of {TILE_SIZES}, got {tile_size}")
    return tile_size


def check_bits(bits: int, name: str = "bits", low: int = 2, high: int = 8) -> int:
    if not isinstance(bits, int) or not low <= bits <= high:
        raise CodecError(f"{name} must be an integer in [{low}, {high}], got {bits!r}")
    return bits


# ----- tiles ---------------------------------------------------------------------------
def bad_mask(values: torch.Tensor) -> torch.Tensor:
    """True where fp32 ``values`` hold NaN, +-Inf or a magnitude above ``MAX_ABS_VALUE``.

    Compared on the bits of ``|x|`` (NaN and Inf have the largest), as the kernels do.
    """
    return (values.abs().view(torch.int32) > numerics.MAX_ABS_BITS)


def to_tiles(x: torch.Tensor, tile_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the last dim into tiles: fp32 ``[tokens, n_tiles, G]`` and a per-tile bad mask.

    When ``h % G != 0`` the last tile is padded by repeating the token's last channel,
    which leaves every tile's range (and a constant tile) unchanged. A tile is *bad* when it holds
    NaN, +-Inf or a magnitude above ``MAX_ABS_VALUE``; its bad values are replaced by 0 here
    (bad tiles are encoded as a fixed pattern, see ``quantize_tiles``; the 0s keep them out of
    anything computed from other tiles, such as a token's entropy).
    """
    h = x.shape[-1]
    tokens = x.reshape(-1, h).float()
    pad = num_tiles(h, tile_size) * tile_size - h
    if pad:
        tokens = torch.cat([tokens, tokens[:, -1:].expand(-1, pad)], dim=1)
    tiles = tokens.reshape(tokens.shape[0], -1, tile_size)
    bad = bad_mask(tiles)
    # Unconditionally (no host read of ``bad``): the torch path stays sync-free, so a CUDA graph can capture it.
    return tiles.masked_fill(bad, 0.0), bad.any(dim=-1)


def from_tiles(tiles: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of ``to_tiles``: drop padding, restore shape, cast (clamped to dtype's range).

    With ``out`` (contiguous, ``shape``/``dtype``) the result is written into it, cast on the way,
    and ``out`` is returned.
    """
    h = shape[-1]
    flat = tiles.reshape(math.prod(shape[:-1]), -1)[:, :h]
    if dtype == torch.float16:
        # Rounding to the nearest level may step past fp16's largest finite value.
        limit = torch.finfo(torch.float16).max
        flat = flat.clamp(-limit, limit)
    if out is not None:
        out.view(flat.shape).copy_(flat)
        return out
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


def pack_flags(flags: torch.Tensor) -> torch.Tensor:
    """Pack a bool vector into bytes, bit ``i % 8`` of byte ``i // 8`` (padded with 0)."""
    flat = flags.reshape(-1).to(torch.uint8)
    pad = -flat.numel() % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return pack_bits(flat, 1)


def unpack_flags(packed: torch.Tensor, count: int) -> torch.Tensor:
    return unpack_bits(packed, 1, count).bool()


# ----- correctly rounded fp32 arithmetic ---------------------------------------------------
def div_rn(a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
    """fp32 ``a / b`` correctly rounded (``tl.math.div_rn``), on every device.

    Computed in fp64 and rounded once to fp32, which is exact for division; torch's own
    ``scalar / tensor`` multiplies by a rounded reciprocal, off by an ulp now and then.
    """
    a = a.double() if isinstance(a, torch.Tensor) else a
    b = b.double() if isinstance(b, torch.Tensor) else b
    return (a / b).float()


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``sqrt(x)`` correctly rounded (``tl.math.sqrt_rn``); torch's fp32 sqrt on CPU is not always."""
    return x.double().sqrt().float()


# ----- Hadamard and tree sums ------------------------------------------------------------
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


def fwht(x: torch.Tensor) -> torch.Tensor:
    """``x @ hadamard_matrix(G)`` for fp32 ``[..., G]``, computed exactly as the kernels compute it.

    Butterflies of stride 1, 2, 4, ..., G/2 in that order, each turning the pair ``(a, b)``
    (``a`` at the lower index) into ``(a + b, a - b)``; then one multiply by the fp32 value
    of ``1/sqrt(G)`` (``numerics.hadamard_entry``). Its own inverse up to rounding.
    """
    g = x.shape[-1]
    lead = x.shape[:-1]
    source = x.reshape(-1, g)
    buffers = [torch.empty_like(source), torch.empty_like(source)]
    stride, step = 1, 0
    while stride < g:
        pairs = source.view(-1, g // (2 * stride), 2, stride)
        target = buffers[step % 2]
        out = target.view(-1, g // (2 * stride), 2, stride)
        torch.add(pairs[:, :, 0], pairs[:, :, 1], out=out[:, :, 0])
        torch.sub(pairs[:, :, 0], pairs[:, :, 1], out=out[:, :, 1])
        source, stride, step = target, stride * 2, step + 1
    return (source * numerics.hadamard_entry(g)).reshape(*lead, g)


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two) in the kernels' order: adjacent pairs, then pairs of pairs."""
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def log2_approx(x: torch.Tensor) -> torch.Tensor:
    """log2 of fp32 ``x >= 0`` to within 3.1e-5: exponent from the bits plus ``numerics.LOG2_POLY`` of the mantissa.

    Separate fp32 multiplies and adds, so every device computes the same bits. ``x = 0`` gives -127.
    """
    bits = x.contiguous().view(torch.int32)
    t = ((bits & 0x7FFFFF) | 0x3F800000).view(torch.float32).sub_(1.0)
    c = numerics.LOG2_POLY
    p = t * c[-1]  # (in place from here on: the same fp32 operations, fewer allocations)
    for coefficient in reversed(c[:-1]):
        p.add_(coefficient).mul_(t)
    return p.add_(((bits >> 23) - 127).float())


# ----- E2M1 (fp4) and the random-sign Hadamard ------------------------------------------------------
def e2m1_round(scaled: torch.Tensor) -> torch.Tensor:
    """fp32 ``scaled`` rounded to the E2M1 grid ``+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}``: nearest, ties to even, saturated.

    The grid's step is 0.5 below 2, 1 in [2, 4) and 2 from 4 up, so ``round(|x| / step) * step`` (ties to
    even) is round-to-nearest-even on the grid (a tie between two values goes to the one with an even
    mantissa bit); anything beyond 6 becomes 6. Returns fp32 grid values (``-0`` turned into ``+0``).
    """
    magnitude = scaled.abs()
    step = torch.where(magnitude < 2.0, 0.5, torch.where(magnitude < 4.0, 1.0, 2.0))
    rounded = ((magnitude / step).round_() * step).clamp_max_(numerics.E2M1_MAX)
    return torch.where(scaled < 0, -rounded, rounded) + 0.0


_E2M1_GRID: dict[str, torch.Tensor] = {}


def e2m1_grid(device) -> torch.Tensor:
    """The 16 values of the E2M1 codes ``sign << 3 | magnitude index`` (fp32; code 8 is ``-0``)."""
    key = str(device)
    if key not in _E2M1_GRID:
        half = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
        _E2M1_GRID[key] = torch.cat([half, -half]).to(device)
    return _E2M1_GRID[key]


def e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8) of fp32 values already on the E2M1 grid (``e2m1_round``'s output)."""
    grid = e2m1_grid(values.device)[:8]
    index = torch.searchsorted(grid, values.abs().contiguous())
    return (index | ((values < 0).to(index.dtype) << 3)).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of 4-bit E2M1 codes."""
    return e2m1_grid(codes.device)[codes.long()]


def random_signs(seed: int, size: int, device) -> torch.Tensor:
    """``size`` fp32 signs (+-1) drawn from ``hash_uniform(seed)``: the same pattern on every device."""
    return torch.where(hash_uniform(seed, size, device) < 0.5, -1.0, 1.0)


def signed_fwht(blocks: torch.Tensor, signs: torch.Tensor | None) -> torch.Tensor:
    """``fwht(blocks * signs)`` over the last dim (a randomized Hadamard); ``signs=None``: the identity."""
    return blocks if signs is None else fwht(blocks * signs)


def signed_fwht_inverse(blocks: torch.Tensor, signs: torch.Tensor | None) -> torch.Tensor:
    """Inverse of ``signed_fwht`` (the normalised Hadamard is its own inverse): ``fwht(blocks) * signs``
    (``-0`` turned into ``+0``, so a zero block decodes to the same bits with or without the transform)."""
    return blocks if signs is None else fwht(blocks) * signs + 0.0


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


def bf16_bits(values: torch.Tensor, nan: torch.Tensor | None = None) -> torch.Tensor:
    """int16 bits of bf16-representable fp32 ``values``; ``BF16_NAN_BITS`` where ``nan`` is set.

    The NaN bits are a fill value, not a tensor built on the host: on a GPU that would be a copy from
    pageable memory per call (a sync, and refused inside a CUDA graph capture)."""
    bits = (values.contiguous().view(torch.int32) >> 16).to(torch.int16)
    if nan is not None:
        bits = bits.masked_fill(nan, numerics.BF16_NAN_BITS)
    return bits


# ----- stochastic rounding -------------------------------------------------------------
def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``x * constant mod 2^32`` for int64 ``x`` in [0, 2^32), in halves so no int64 product overflows."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & 0xFFFFFFFF


def hash32(x: torch.Tensor) -> torch.Tensor:
    """``lowbias32`` of the uint32 values held in int64 ``x`` (see ``geometry``)."""
    x = x ^ (x >> 16)
    x = _mul32(x, numerics.HASH_MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, numerics.HASH_MUL2)
    return x ^ (x >> 16)


def hash_uniform(seed: int, count: int, device) -> torch.Tensor:
    """Uniform [0, 1) fp32 noise for elements ``0 .. count-1`` of one encode call seeded with ``seed`` (uint32)."""
    index = torch.arange(count, device=device, dtype=torch.int64)
    x = (_mul32(index, numerics.HASH_STEP) + seed) & 0xFFFFFFFF
    return (hash32(x) >> 8).float() * 2.0**-24


class RoundingNoise:
    """Per-call seeds for stochastic rounding, or None when rounding to nearest.

    Call ``k`` of a codec gets the seed ``lowbias32(seed * 2^16 + k)``, and element ``i`` of that call
    the noise ``hash_uniform(call_seed)[i]``: the torch reference and the kernels draw the same
    numbers, and a codec's sequence of encodes is reproducible run to run.
    """

    def __init__(self, enabled: bool, seed: int):
        self.enabled = bool(enabled)
        self.seed = int(seed)
        self.calls = 0

    def next_seed(self) -> int | None:
        if not self.enabled:
            return None
        start = torch.tensor([((self.seed << 16) + self.calls) & 0xFFFFFFFF], dtype=torch.int64)
        self.calls += 1
        return int(hash32(start)[0])

    def salted(self, salt: str) -> "RoundingNoise":
        """A fresh generator whose seed mixes this one's with ``salt`` (a link end's name): codecs built alike at
        different link ends must not draw the same noise for their k-th messages, or the errors of one
        micro-batch's gradients at successive pipeline boundaries add up coherently instead of averaging."""
        mixed = zlib.crc32(f"{self.seed}:{salt}".encode()) & 0xFFFF  # (seeds are 16 bits: next_seed's layout)
        return RoundingNoise(self.enabled, mixed)

    def state_dict(self) -> dict:
        """The call counter: a resumed codec continues the same sequence of seeds."""
        return {"seed": self.seed, "calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed") != self.seed:
            raise ValueError(f"rounding-noise state was saved with seed {state.get('seed')}, this codec uses "
                             f"{self.seed}: resuming would draw different noise")
        self.calls = int(state["calls"])


class RoundingState:
    """A codec's state kept between messages, saved with checkpoints: its ``rounding_noise`` (a ``RoundingNoise``,
    or none) unless a codec overrides these (AQ-SGD adds its buffers)."""

    @property
    def stateful(self) -> bool:
        """Whether messages depend on earlier ones (AQ-SGD buffers, stochastic-rounding generators)."""
        noise = getattr(self, "rounding_noise", None)
        return bool(noise is not None and noise.enabled)

    def salt_rounding(self, salt: str):
        """Give this codec's stochastic rounding its own noise stream, named by ``salt`` (the link end: direction,
        this rank, the peer); rounding to nearest is unaffected. Returns the codec."""
        noise = getattr(self, "rounding_noise", None)
        if noise is not None and noise.enabled:
            self.rounding_noise = noise.salted(salt)
        return self

    def state_dict(self) -> dict:
        """What a resumed run needs to continue this codec's message sequence exactly ({} when stateless)."""
        noise = getattr(self, "rounding_noise", None)
        return {"rounding_noise": noise.state_dict()} if self.stateful else {}

    def load_state_dict(self, state: dict) -> None:
        if "rounding_noise" in state:
            self.rounding_noise.load_state_dict(state["rounding_noise"])


# ----- the asymmetric quantizer ----------------------------------------------------------
def quantize_tiles(
    tiles: torch.Tensor,
    levels: torch.Tensor | int,
    bad_tile: torch.Tensor,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric per-tile quantization of fp32 ``[..., G]`` tiles.

    ``levels`` is ``2**bits - 1`` (an int, or a tensor broadcastable to ``tiles[..., 0]``).
    Returns ``codes`` (uint8) and the int16 bits of the bf16 ``scale`` and ``zero`` (shape
    ``tiles.shape[:-1]``).

    ``zero`` is ``min`` rounded down to bf16 and ``scale`` is ``(max - zero) / levels``
    rounded up to bf16 (both with ``-0`` turned into ``+0``), so the grid ``zero + q*scale,
    q = 0..levels`` covers ``[min, max]``. Codes are ``round((x - zero) * (1 / scale))``, ties
    to even (or ``floor(... + noise)`` with ``noise`` uniform in [0, 1), stochastic rounding),
    clamped to ``[0, levels]``: every decoded element is within ``scale / 2`` of its input, up to
    the reciprocal's rounding (about ``levels * 2^-23`` of a step). A tile whose scale is below
    the smallest normal fp32 (a constant tile, for instance) gets all-zero codes and decodes to
    ``zero``; a bf16-representable constant decodes exactly. A bad tile is written as scale 0,
    zero NaN (``BF16_NAN_BITS``) and all-zero codes, and decodes to NaN.
    """
    lo = tiles.amin(dim=-1)  # (two reductions are several times faster than aminmax on CPU)
    hi = tiles.amax(dim=-1)
    if not isinstance(levels, torch.Tensor):
        levels = torch.full_like(lo, float(levels))
    levels = levels.reshape(lo.shape).float()
    zero = round_bf16(lo, -1) + 0.0
    scale = round_bf16(div_rn(hi - zero, levels), +1) + 0.0
    scale = scale.masked_fill(bad_tile, 0.0)
    flat = ~(scale >= FLAT_SCALE)
    inverse = div_rn(1.0, scale.masked_fill(flat, 1.0))
    scaled = (tiles - zero[..., None]).mul_(inverse[..., None])
    scaled = scaled.add_(noise).floor_() if noise is not None else scaled.round_()
    codes = torch.minimum(scaled.clamp_min_(0), levels[..., None])
    codes.masked_fill_(flat[..., None], 0.0)
    return codes.to(torch.uint8), bf16_bits(scale), bf16_bits(zero, nan=bad_tile)


def dequantize_tiles(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``codes * scale + zero`` in fp32, per tile (bf16 scale and zero have codes' shape minus the last dim).

    The product of a code (< 2^8) and a bf16 scale is exact in fp32, so this is the same
    number whether an implementation fuses the multiply and the add or not.
    """
    return codes.float() * scale.float()[..., None] + zero.float()[..., None]
