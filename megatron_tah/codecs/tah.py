"""``tah``: TAH-Quant, tile-wise adaptive Hadamard quantization (SPEC section 1).

Encode, for an ``[s, b, h]`` tensor (``h`` padded to whole tiles of ``G`` channels by
repeating each token's last channel, see ``common.to_tiles``):

1. **Bit allocation at a fixed ratio.** Every allocation unit (a token with
   ``allocation="token"``, paper v1; a tile with ``"tile"``, paper v2) gets the entropy of its
   normalised magnitudes ``p = |x| / sum|x|`` (real channels only; NaN, Inf and huge values
   count as 0), in bits: ``H = -sum p log2 p = log2(S) - L / S`` with ``S = sum |x|`` and
   ``L = sum |x| log2 |x|`` (``H = 0`` when ``S = 0``). **decision:** this form (the SPEC's
   ``-sum p log(p + eps)`` without the ``eps``, which moves ``H`` by less than 1e-7) is what lets a
   kernel sum ``S`` and ``L`` per tile in the same pass as everything else; ``log2`` is
   ``common.log2_approx`` (within 3.1e-5) and the sums are pairwise trees over each tile, then over
   a token's tiles (zero-padded to a power of two), so every device ranks the units identically.
   In every sample (column ``b``) the ``floor(s * (1 - high_ratio))`` lowest-entropy tokens get
   ``low_bits``, the rest ``high_bits`` (``"tile"``: the same rule over the tiles of each token,
   ``floor(n_tiles * (1 - high_ratio))`` per token). Ties go to the lower index (stable sort).
   The number of low-bit units depends only on the shape, so the wire size does too.
   ``low_bits_for="high_entropy"`` inverts the rule (the highest-entropy units get
   ``low_bits``): a diagnostic knob for the ablations, not the paper's method.
2. **Outlier test, pivot swap, Hadamard.** A tile is rotated when
   ``|a1| > outlier_threshold * (|a2| + eps)`` (``a1``, ``a2``: its two largest magnitudes,
   ``a2 = a1`` on a tie; the SPEC's ``|a1| / (|a2| + eps) > tau`` without the division; ``0``
   rotates every tile, ``inf`` none; a bad tile never). Rotation swaps the largest-magnitude
   element (first one on ties) into position 0, then applies ``common.fwht``: ``H_G / sqrt(G)``
   by butterflies; row 0 of ``H_G`` is all ones, so the outlier becomes a constant offset that
   the zero-point absorbs. Decode rotates again (the matrix is its own inverse) and swaps back.
3. **Asymmetric per-tile quantization** (``common.quantize_tiles``): bf16 scale and
   zero, round to nearest (or stochastic), within ``scale / 2`` per element in the
   rotated domain; a rotated tile's L2 error is at most ``sqrt(G) * scale / 2``.

Tiles holding NaN, +-Inf or ``|x| > MAX_ABS_VALUE`` decode to all-NaN; others are untouched.
The torch reference below and the Triton kernels (``kernels/tah.py``) write the same bytes.

Wire (T tiles in token order ``(s, b)``, then tile order; sizes in ``kernels/tah.py``, ``tah_sections``):
header | ``flags``: 1 bit per allocation unit (token or tile), set = low bits |
``scale``: bf16[T] | ``zero``: bf16[T] | ``meta``: uint8[T] = ``rotated << 7 | pivot`` |
``high``: codes of the high-bit tiles in order, packed at ``high_bits`` |
``low``: codes of the low-bit tiles in order, packed at ``low_bits``.
At G=64, 4/3 bits, 80/20: 3.8 + 40/64 bits of metadata = ~4.43 bits per element.
"""

from __future__ import annotations

import math

import torch

from .. import geometry
from ..kernels.tah import TAH_ALLOCATIONS, TAH_EPS, tah_low_units_per_group, tah_sections, tah_tile_counts
from .core import common
from .core.base import CHECKSUM_DEFAULT, Codec
from .core.errors import CodecError
from .core.header import register_codec_id
from .core.options import CodecDeclaration, Option

LOW_BITS_FOR = ("low_entropy", "high_entropy")  # which units get the low bit width (the paper: low_entropy)

DECLARATION = CodecDeclaration(
    takes=("tile_size", "stochastic_rounding"),
    kernel=True,
    options=(
        Option("tah_high_bits", "high_bits", int, 4, "TAH-Quant: bits for the high-entropy share of tokens (or tiles).",
               bounds=(2, 8)),
        Option("tah_low_bits", "low_bits", int, 3, "TAH-Quant: bits for the lowest-entropy share of tokens (or tiles); "
               "at most --tah-high-bits.", bounds=(2, 8)),
        Option("tah_high_ratio", "high_ratio", float, 0.8, "TAH-Quant: fraction of tokens per sample (or tiles per "
               "token) quantized with the high bit width.", bounds=(0.0, 1.0)),
        Option("tah_outlier_threshold", "outlier_threshold", float, 2.0, "TAH-Quant: rotate a tile when |largest| / "
               "|second largest| exceeds this; 0 always rotates, inf never.", bounds=(0.0, math.inf)),
        Option("tah_allocation", "allocation", str, "token", "TAH-Quant bit allocation unit: token (paper v1) or "
               "tile (paper v2).", choices=TAH_ALLOCATIONS),
        Option("tah_low_bits_for", "low_bits_for", str, "low_entropy", "TAH-Quant: which tokens (or tiles) get the "
               "low bit width: low_entropy (the paper) or high_entropy (diagnostic).",
               choices=LOW_BITS_FOR),
    ),
)


class TahCodec(Codec):
    name = "tah"
    codec_id = 2

    def __init__(self, tile_size: int = 64, high_bits: int = 4, low_bits: int = 3, high_ratio: float = 0.8,
                 outlier_threshold: float = 2.0, allocation: str = "token", stochastic_rounding: bool = False,
                 seed: int = 0, backend: str = "auto", low_bits_for: str = "low_entropy",
                 checksum: bool = CHECKSUM_DEFAULT):
        super().__init__(backend, checksum)
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
        if allocation not in TAH_ALLOCATIONS:
            raise CodecError(f"allocation must be one of {TAH_ALLOCATIONS}, got {allocation!r}")
        self.allocation = allocation
        if low_bits_for not in LOW_BITS_FOR:
            raise CodecError(f"low_bits_for must be one of {LOW_BITS_FOR}, got {low_bits_for!r}")
        self.low_bits_for = low_bits_for
        self.stochastic_rounding = bool(stochastic_rounding)
        self.seed = int(seed)
        self.rounding_noise = common.RoundingNoise(self.stochastic_rounding, self.seed)
        self._rotated: torch.Tensor | None = None  # the last encode's rotated fraction (0-d fp32, kept in place)

    def code_sections(self) -> dict[str, int]:
        return {"high": self.high_bits, "low": self.low_bits}

    def config(self) -> dict:
        return {
            "tile_size": self.tile_size, "high_bits": self.high_bits, "low_bits": self.low_bits,
            "high_ratio": self.high_ratio, "outlier_threshold": self.outlier_threshold,
            "allocation": self.allocation, "stochastic_rounding": self.stochastic_rounding,
            "low_bits_for": self.low_bits_for,
        }

    @property
    def last_rotated(self) -> torch.Tensor | None:
        """Fraction of tiles the last ``encode`` rotated, as a 0-d fp32 tensor on its device (no sync)."""
        return None if self._rotated is None else self._rotated.clone()

    def _keep_rotated(self, counts: torch.Tensor, total: int) -> None:
        """Write the fraction ``sum(counts) / total`` into one device buffer, in place: a replayed CUDA graph
        (``graphs.GraphedCodec``) refreshes what ``last_rotated`` reads, and its first call leaves the warm-up's."""
        fraction = counts.sum(dtype=torch.float32) / max(total, 1)
        if self._rotated is None or self._rotated.device != fraction.device:
            self._rotated = torch.empty((), dtype=torch.float32, device=fraction.device)
        self._rotated.copy_(fraction)

    @property
    def last_rotated_fraction(self) -> float | None:
        """``last_rotated`` as a Python float (None before the first encode); reading it waits for the device."""
        rotated = self.last_rotated
        return None if rotated is None else float(rotated)

    # ----- shape-only quantities (shared with the Triton path) --------------------------
    @staticmethod
    def _dims(shape) -> tuple[int, int, int]:
        if len(shape) != 3:
            raise CodecError(f"tah takes [s, b, h] tensors, got shape {tuple(shape)}")
        return tuple(int(d) for d in shape)

    def low_units_per_group(self, shape) -> int:
        """Low-bit units per selection group: tokens per sample, or tiles per token."""
        s, _, h = self._dims(shape)
        return tah_low_units_per_group(s, geometry.num_tiles(h, self.tile_size), self.high_ratio, self.allocation)

    def tile_counts(self, shape) -> tuple[int, int, int]:
        """(all tiles, low-bit tiles, allocation units) for ``shape``."""
        return tah_tile_counts(self._dims(shape), self.tile_size, self.high_ratio, self.allocation)

    def _sections(self, shape, dtype):
        return tah_sections(self._dims(shape), self.tile_size, self.high_bits, self.low_bits, self.high_ratio,
                            self.allocation)

    def levels(self, low: bool) -> int:
        return 2 ** (self.low_bits if low else self.high_bits) - 1

    # ----- bit allocation (shared by both paths) -------------------------------------------
    def unit_entropy(self, partials: torch.Tensor, shape) -> torch.Tensor:
        """Entropy in bits per allocation unit from per-tile partial sums ``[2, tokens * n_tiles]`` (S, L)."""
        s, b, h = shape
        n_tiles = geometry.num_tiles(h, self.tile_size)
        if self.allocation == "token":
            per_token = partials.reshape(2, s * b, n_tiles)
            pad = (1 << max(0, (n_tiles - 1).bit_length())) - n_tiles
            if pad:
                per_token = torch.nn.functional.pad(per_token, (0, pad))
            partials = common.tree_sum(per_token)
        total, weighted = partials[0], partials[1]
        safe = torch.where(total > 0, total, torch.ones_like(total))
        entropy = common.log2_approx(safe) - common.div_rn(weighted, safe)
        return torch.where(total > 0, entropy, torch.zeros_like(entropy))

    def select_low_units(self, entropy: torch.Tensor, shape) -> torch.Tensor:
        """Bool per unit: the ``low_units_per_group`` lowest-entropy units of each group (stable: lower index
        first; the highest-entropy ones with ``low_bits_for="high_entropy"``)."""
        s, b, _ = shape
        n_low = self.low_units_per_group(shape)
        key = entropy if self.low_bits_for == "low_entropy" else -entropy
        groups = key.reshape(s, b).t() if self.allocation == "token" else key.reshape(s * b, -1)
        low = torch.zeros(groups.shape, dtype=torch.bool, device=entropy.device)
        if n_low:
            order = torch.sort(groups, dim=1, stable=True).indices[:, :n_low]
            low.scatter_(1, order, True)
        return low.t().reshape(-1) if self.allocation == "token" else low.reshape(-1)

    def unit_tables(self, low: torch.Tensor, shape) -> tuple[torch.Tensor, torch.Tensor]:
        """int32 unit indices of the high-bit units and of the low-bit units, each in order.

        Sort-free (two running counts and one scatter); with corrupt flags the tables are garbage
        but every index stays in range.
        """
        total, n_low_tiles, units = self.tile_counts(shape)
        n_low = n_low_tiles // (total // units)
        low_i = low.to(torch.int32)
        position = torch.where(low, torch.cumsum(low_i, 0, dtype=torch.int32) - 1 + (units - n_low),
                               torch.cumsum(1 - low_i, 0, dtype=torch.int32) - 1)
        table = torch.empty(units, dtype=torch.int32, device=low.device)
        table.scatter_(0, position.clamp_(0, units - 1).long(),
                       torch.arange(units, dtype=torch.int32, device=low.device))
        return table[: units - n_low], table[units - n_low:]

    # ----- reference encode ---------------------------------------------------------
    def tile_partials(self, tiles: torch.Tensor, h: int) -> torch.Tensor:
        """Per tile: ``S = sum |x|`` and ``L = sum |x| log2 |x|`` (``[2, T]``), as the kernels compute them."""
        magnitude = tiles.abs()
        if h % self.tile_size:
            magnitude = magnitude.reshape(tiles.shape[0], -1)
            magnitude[:, h:] = 0  # padding channels count as zero
            magnitude = magnitude.reshape(tiles.shape)
        weighted = magnitude * common.log2_approx(magnitude)
        return torch.stack([common.tree_sum(magnitude), common.tree_sum(weighted)]).reshape(2, -1)

    def allocate_low_bits(self, tiles: torch.Tensor, shape) -> torch.Tensor:
        """Bool ``[tokens, n_tiles]``: which tiles get ``low_bits`` (fixed count per group)."""
        low = self.select_low_units(self.unit_entropy(self.tile_partials(tiles, shape[2]), shape), shape)
        return low.reshape(-1, 1).expand(-1, tiles.shape[1]) if self.allocation == "token" else low.reshape(tiles.shape[:2])

    def find_outliers(self, tiles: torch.Tensor, bad: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(rotate flag, pivot index) per tile; the pivot is 0 for tiles left unrotated. Bad tiles never rotate."""
        shape = tiles.shape[:-1]
        bad = torch.zeros(shape, dtype=torch.bool, device=tiles.device) if bad is None else bad
        if self.outlier_threshold == math.inf:
            never = torch.zeros(shape, dtype=torch.bool, device=tiles.device)
            return never, never.long()
        bits = tiles.abs().view(torch.int32)  # magnitudes ordered as their bits
        a1 = bits.amax(dim=-1, keepdim=True)
        is_max = bits == a1
        if self.outlier_threshold == 0:
            rotate = ~bad
        else:
            # a2: the largest magnitude after the first maximum, i.e. a1 again on a tie. (amax and compares over
            # every tile, argmax only over the rotated ones: several times faster on CPU than argmax everywhere.)
            a2 = torch.where(is_max, 0, bits).amax(dim=-1)
            a2 = torch.where(is_max.sum(dim=-1) > 1, a1[..., 0], a2)
            a1f, a2f = a1[..., 0].view(torch.float32), a2.view(torch.float32)
            rotate = ~bad & (a1f > (a2f + TAH_EPS) * self.outlier_threshold)
        pivot = torch.zeros(rotate.shape, dtype=torch.long, device=tiles.device)
        if rotate.any():
            pivot[rotate] = is_max[rotate].to(torch.uint8).argmax(dim=-1)  # the first maximum
        return rotate, pivot

    def _encode_torch(self, x, buf, layout):
        shape = self._dims(tuple(x.shape))
        tiles, bad = common.to_tiles(x, self.tile_size)
        low = self.allocate_low_bits(tiles, shape)
        rotate, pivot = self.find_outliers(tiles, bad)
        rotated = rotate_tiles(tiles, rotate, pivot)
        levels = torch.where(low, self.levels(True), self.levels(False))
        seed = self.rounding_noise.next_seed()
        noise = None if seed is None else common.hash_uniform(seed, rotated.numel(), x.device).reshape(rotated.shape)
        codes, scale, zero = common.quantize_tiles(rotated, levels, bad, noise)
        self._keep_rotated(rotate, rotate.numel())

        flags = low[:, 0] if self.allocation == "token" else low
        layout.view(buf, "flags").copy_(common.pack_flags(flags))
        layout.view(buf, "scale", torch.int16).copy_(scale.reshape(-1))
        layout.view(buf, "zero", torch.int16).copy_(zero.reshape(-1))
        layout.view(buf, "meta").copy_((rotate.to(torch.uint8) << 7 | pivot.to(torch.uint8)).reshape(-1))
        layout.view(buf, "high").copy_(common.pack_bits(codes[~low], self.high_bits))
        layout.view(buf, "low").copy_(common.pack_bits(codes[low], self.low_bits))

    # ----- decode: checks shared by both paths ----------------------------------------
    def _read_flags(self, buf, shape, layout) -> torch.Tensor:
        """Bool low flag per unit; a count other than the shape's is a corrupt buffer (raised now when
        checks are ``"full"``, counted on the device when ``"deferred"``)."""
        total, n_low, units = self.tile_counts(shape)
        low = common.unpack_flags(layout.view(buf, "flags"), units)
        flagged = low.sum() * (total // units)
        if not self.device_check(flagged != n_low) and int(flagged) != n_low:
            raise CodecError(f"corrupt tah buffer: {int(flagged)} low-bit tiles flagged, {n_low} expected")
        return low

    def _check_pivots(self, meta: torch.Tensor) -> None:
        bad_pivot = (meta & 0x7F) >= self.tile_size
        if not self.device_check(bad_pivot.any()) and bool(bad_pivot.any()):
            raise CodecError(f"corrupt tah buffer: pivot index {int((meta & 0x7F).max())} outside a tile of "
                             f"{self.tile_size}")

    # ----- reference decode ---------------------------------------------------------
    def _decode_torch(self, buf, shape, dtype, layout, out=None):
        s, b, h = self._dims(shape)
        g = self.tile_size
        n_tiles = geometry.num_tiles(h, g)
        total, n_low, units = self.tile_counts(shape)
        flags = self._read_flags(buf, shape, layout)
        low = flags.reshape(-1, 1).expand(-1, n_tiles) if self.allocation == "token" else flags.reshape(-1, n_tiles)
        codes = torch.zeros(s * b, n_tiles, g, dtype=torch.uint8, device=buf.device)
        high_codes = common.unpack_bits(layout.view(buf, "high"), self.high_bits, (total - n_low) * g)
        low_codes = common.unpack_bits(layout.view(buf, "low"), self.low_bits, n_low * g)
        if int(low.sum()) == n_low:  # (a corrupt count was raised or counted by _read_flags)
            codes[~low] = high_codes.reshape(-1, g)
            codes[low] = low_codes.reshape(-1, g)
        scale = layout.view(buf, "scale", torch.bfloat16).reshape(s * b, n_tiles)
        zero = layout.view(buf, "zero", torch.bfloat16).reshape(s * b, n_tiles)
        meta = layout.view(buf, "meta").reshape(s * b, n_tiles)
        self._check_pivots(meta)
        rotate = (meta >> 7).bool()
        pivot = (meta & (g - 1)).long()
        values = common.dequantize_tiles(codes, scale, zero)
        return common.from_tiles(unrotate_tiles(values, rotate, pivot), shape, dtype, out)

    # ----- fused Triton path (megatron_tah/kernels/tah.py) --------------------------
    def _kernel_sections(self, buf, layout) -> dict[str, torch.Tensor]:
        """The sections as the kernels take them: ``flags`` with its zero padding to whole int32 words."""
        sections = layout.sections(buf)
        start, size = layout.offsets["flags"]
        sections["flags"] = buf[start : start + -(-size // 4) * 4]  # (sections start 8-byte aligned)
        return sections

    def _encode_triton(self, x, buf, layout):
        from ..kernels import tah as kernels

        shape = self._dims(tuple(x.shape))
        sections = self._kernel_sections(buf, layout)
        high_units, low_units = kernels.triton_tah_allocate(
            x, sections["flags"], tile_size=self.tile_size, allocation=self.allocation,
            low_per_group=self.low_units_per_group(shape), invert=self.low_bits_for == "high_entropy")
        rotated = kernels.triton_tah_encode(
            x, sections, high_units, low_units, tile_size=self.tile_size, high_bits=self.high_bits,
            low_bits=self.low_bits, allocation=self.allocation, outlier_threshold=self.outlier_threshold,
            seed=self.rounding_noise.next_seed())
        self._keep_rotated(rotated, self.tile_counts(shape)[0])

    def _decode_triton(self, buf, shape, dtype, layout, out=None):
        from ..kernels import tah as kernels

        shape = self._dims(tuple(shape))
        if self.checks == "full":  # raise now (a host sync); otherwise the kernels count corrupt flags and pivots
            self._read_flags(buf, shape, layout)
            self._check_pivots(layout.view(buf, "meta"))
        error = self.deferred_errors(buf.device).count
        sections = self._kernel_sections(buf, layout)
        high_units, low_units = kernels.triton_tah_tables(
            sections["flags"], shape, error, tile_size=self.tile_size, allocation=self.allocation,
            low_per_group=self.low_units_per_group(shape))
        return kernels.triton_tah_decode(
            sections, shape, dtype, high_units, low_units, error, tile_size=self.tile_size,
            high_bits=self.high_bits, low_bits=self.low_bits, allocation=self.allocation,
            rotates=self.outlier_threshold != math.inf, out=out)


def _swap_index(pivot: torch.Tensor, tile_size: int) -> torch.Tensor:
    """Gather index that swaps element 0 and element ``pivot`` of each tile (an involution)."""
    index = torch.arange(tile_size, device=pivot.device).expand(*pivot.shape, tile_size).clone()
    index[..., 0] = pivot
    return index.scatter_(-1, pivot[..., None], 0)


def rotate_tiles(tiles: torch.Tensor, rotate: torch.Tensor, pivot: torch.Tensor) -> torch.Tensor:
    """Pivot swap then ``common.fwht`` on the tiles flagged in ``rotate``; others unchanged."""
    if not rotate.any():
        return tiles
    g = tiles.shape[-1]
    out = tiles.clone()
    out[rotate] = common.fwht(tiles[rotate].gather(-1, _swap_index(pivot[rotate], g)))
    return out


def unrotate_tiles(tiles: torch.Tensor, rotate: torch.Tensor, pivot: torch.Tensor) -> torch.Tensor:
    """Inverse of ``rotate_tiles``: ``common.fwht`` again, then undo the swap."""
    if not rotate.any():
        return tiles
    g = tiles.shape[-1]
    out = tiles.clone()
    out[rotate] = common.fwht(tiles[rotate]).gather(-1, _swap_index(pivot[rotate], g))
    return out


register_codec_id(TahCodec.codec_id, TahCodec.name)
