"""TAH-Quant's bit allocation on the device, in a handful of launches (``TahCodec`` has the definition).

From the per-tile partial sums of ``kernels/tah.py``'s first pass:

* ``tah_token_entropy_kernel`` (token allocation): each token's ``S`` and ``L`` as pairwise trees
  over its tiles (zero-padded to a power of two), then ``H = log2(S) - L / S``. With tile
  allocation the partials kernel writes ``H`` itself.
* ``tah_rank_kernel``: every unit's position in its group's stable ascending order of ``H`` (or
  ``-H``), by counting; ``low = position < n_low``.
* ``tah_token_tables_kernel`` / ``tah_tile_tables_kernel``: from the low flags (or, decoding, from
  the ``flags`` section's bits), the units of each bit width in order (the tables the encode and
  decode kernels walk), the packed ``flags`` section when encoding, and a count of corrupt flags
  when decoding. Token allocation runs as one program over all units (a running count); tile
  allocation as one program per token (its counts are per token).

Each step is ``TahCodec.unit_entropy`` / ``select_low_units`` / ``unit_tables``'s arithmetic, so the
flags and tables are the reference's exactly.
"""

from __future__ import annotations

import torch

from .. import geometry, numerics
from .common import HAVE_TRITON, check_launch, launch, next_power_of_2, tl, triton

if HAVE_TRITON:
    from .common import log2_approx_kernel

    @triton.jit
    def entropy_kernel(total, weighted, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr,
                       C4: tl.constexpr, C5: tl.constexpr):
        """``TahCodec.unit_entropy``'s last step: ``log2(S) - L / S`` (0 where ``S = 0``)."""
        safe = tl.where(total > 0, total, 1.0)
        entropy = log2_approx_kernel(safe, C1, C2, C3, C4, C5) - tl.math.div_rn(weighted, safe)
        return tl.where(total > 0, entropy, 0.0)

    @triton.jit
    def halve_rows_kernel(x, R: tl.constexpr, N: tl.constexpr):
        """``[R, N]`` -> ``[R, N/2]``: sums of adjacent pairs (``common.tree_sum``'s order)."""
        a, b = tl.split(tl.reshape(x, [R, N // 2, 2]))
        return a + b

    @triton.jit
    def row_tree_sum_kernel(x, R: tl.constexpr, N: tl.constexpr):
        """Per-row pairwise tree sum of ``[R, N]`` (N a power of two, at most 4096)."""
        if N >= 4096:
            x = halve_rows_kernel(x, R, 4096)
        if N >= 2048:
            x = halve_rows_kernel(x, R, 2048)
        if N >= 1024:
            x = halve_rows_kernel(x, R, 1024)
        if N >= 512:
            x = halve_rows_kernel(x, R, 512)
        if N >= 256:
            x = halve_rows_kernel(x, R, 256)
        if N >= 128:
            x = halve_rows_kernel(x, R, 128)
        if N >= 64:
            x = halve_rows_kernel(x, R, 64)
        if N >= 32:
            x = halve_rows_kernel(x, R, 32)
        if N >= 16:
            x = halve_rows_kernel(x, R, 16)
        if N >= 8:
            x = halve_rows_kernel(x, R, 8)
        if N >= 4:
            x = halve_rows_kernel(x, R, 4)
        if N >= 2:
            x = halve_rows_kernel(x, R, 2)
        return tl.reshape(x, [R])

    @triton.jit
    def tah_token_entropy_kernel(
        partials_ptr, entropy_ptr, n_tokens, tiles_per_token, n_tiles,
        R: tl.constexpr, NTP: tl.constexpr,
        C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr, C5: tl.constexpr,
    ):
        token = tl.program_id(0) * R + tl.arange(0, R)
        k = tl.arange(0, NTP)
        mask = (token < n_tokens)[:, None] & (k < tiles_per_token)[None, :]
        offset = token[:, None] * tiles_per_token + k[None, :]
        total = row_tree_sum_kernel(tl.load(partials_ptr + offset, mask=mask, other=0.0), R, NTP)
        weighted = row_tree_sum_kernel(tl.load(partials_ptr + n_tiles + offset, mask=mask, other=0.0), R, NTP)
        tl.store(entropy_ptr + token, entropy_kernel(total, weighted, C1, C2, C3, C4, C5), mask=token < n_tokens)

    @triton.jit
    def tah_rank_kernel(
        key_ptr, low_ptr, n_members, n_low, group_stride, member_stride,
        INVERT: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr, CHUNKS: tl.constexpr,
    ):
        """Low flag of members ``RB`` of group ``program_id(0)``: position in the stable ascending order < n_low."""
        group = tl.program_id(0)
        mine = tl.program_id(1) * RB + tl.arange(0, RB)
        mine_ok = mine < n_members
        key = tl.load(key_ptr + group * group_stride + mine * member_stride, mask=mine_ok, other=0.0)
        if INVERT:
            key = -key
        before = tl.zeros([RB], dtype=tl.int32)
        for chunk in range(CHUNKS):  # (a constexpr trip count: Triton 3.6's interpreter loops to no runtime bound)
            other = chunk * CB + tl.arange(0, CB)
            other_ok = other < n_members
            theirs = tl.load(key_ptr + group * group_stride + other * member_stride, mask=other_ok, other=0.0)
            if INVERT:
                theirs = -theirs
            earlier = (theirs[None, :] < key[:, None]) | ((theirs[None, :] == key[:, None]) &
                                                          (other[None, :] < mine[:, None]))
            before += tl.sum((earlier & other_ok[None, :]).to(tl.int32), axis=1)
        tl.store(low_ptr + group * group_stride + mine * member_stride, (before < n_low).to(tl.uint8), mask=mine_ok)

    @triton.jit
    def flag_bits_kernel(flags_ptr, unit, mask):
        """Low flag (int32 0/1) of units ``unit`` from the packed ``flags`` section (bit ``u % 8`` of byte ``u // 8``)."""
        byte = tl.load(flags_ptr + (unit >> 3), mask=mask, other=0).to(tl.int32)
        return (byte >> (unit & 7)) & 1

    @triton.jit
    def tah_token_tables_kernel(
        low_ptr, flags_ptr, high_ptr, lowtab_ptr, error_ptr, n_units, n_low,
        DECODE: tl.constexpr, CH: tl.constexpr, CHUNKS: tl.constexpr,
    ):
        """One program: the unit tables from a running count over all units (``TahCodec.unit_tables``).

        Encoding: flags from ``low_ptr`` (uint8 per unit), writes the packed ``flags`` section. Decoding:
        flags from the section's bits; a total other than ``n_low`` adds 1 to ``error``.
        """
        n_high = n_units - n_low
        seen = tl.zeros([], dtype=tl.int32)
        for chunk in range(CHUNKS):
            start = chunk * CH
            unit = start + tl.arange(0, CH)
            ok = unit < n_units
            if DECODE:
                low = flag_bits_kernel(flags_ptr, unit, ok)
            else:
                low = tl.load(low_ptr + unit, mask=ok, other=0).to(tl.int32)
                bits = tl.reshape(low, [CH // 8, 8]) << tl.arange(0, 8)[None, :]
                byte = start // 8 + tl.arange(0, CH // 8)
                tl.store(flags_ptr + byte, tl.sum(bits, axis=1).to(tl.uint8), mask=byte * 8 < n_units)
            low_before = seen + tl.cumsum(low, axis=0) - low
            high_before = unit - low_before
            ok_low = ok & (low != 0) & (low_before < n_low)
            ok_high = ok & (low == 0) & (high_before < n_high)
            tl.store(lowtab_ptr + low_before, unit, mask=ok_low)
            tl.store(high_ptr + high_before, unit, mask=ok_high)
            seen += tl.sum(low, axis=0)
        if DECODE:
            tl.atomic_add(error_ptr, 1, mask=seen != n_low)

    @triton.jit
    def tah_tile_tables_kernel(
        low_ptr, flags_ptr, high_ptr, lowtab_ptr, error_ptr, n_tokens, tiles_per_token, n_low,
        DECODE: tl.constexpr, NTP: tl.constexpr,
    ):
        """One program per token: its tiles' places in the tables (``n_low`` low tiles per token).

        Encoding: flags from ``low_ptr``; sets their bits in the (zeroed) ``flags`` section, seen as int32
        words. Decoding: flags from the bits; a token with another count adds 1 to ``error``.
        """
        token = tl.program_id(0)
        sub = tl.arange(0, NTP)
        ok = sub < tiles_per_token
        tile = token * tiles_per_token + sub
        if DECODE:
            low = flag_bits_kernel(flags_ptr, tile, ok)
        else:
            low = tl.load(low_ptr + tile, mask=ok, other=0).to(tl.int32)
            tl.atomic_or(flags_ptr + (tile >> 5), low << (tile & 31), mask=ok & (low != 0))
        low_before = tl.cumsum(low, axis=0) - low
        high_before = sub - low_before
        n_high = tiles_per_token - n_low
        tl.store(lowtab_ptr + token * n_low + low_before, tile, mask=ok & (low != 0) & (low_before < n_low))
        tl.store(high_ptr + token * n_high + high_before, tile, mask=ok & (low == 0) & (high_before < n_high))
        if DECODE:
            tl.atomic_add(error_ptr, 1, mask=tl.sum(low, axis=0) != n_low)

else:  # pragma: no cover - without triton
    tah_token_entropy_kernel = tah_rank_kernel = tah_token_tables_kernel = tah_tile_tables_kernel = None


def _poly():
    c1, c2, c3, c4, c5 = numerics.LOG2_POLY
    return dict(C1=c1, C2=c2, C3=c3, C4=c4, C5=c5)


def token_entropy(partials: torch.Tensor, n_tokens: int, tiles_per_token: int) -> torch.Tensor:
    """fp32 entropy per token from the per-tile partials ``[2, n_tokens * tiles_per_token]``."""
    check_launch(tah_token_entropy_kernel, "tah token entropy", partials)
    entropy = torch.empty(n_tokens, dtype=torch.float32, device=partials.device)
    ntp = next_power_of_2(tiles_per_token)
    rows = max(1, min(64, 4096 // ntp))
    launch("tah_token_entropy", tah_token_entropy_kernel, (geometry.cdiv(n_tokens, rows),),
           (partials, entropy, n_tokens, tiles_per_token, n_tokens * tiles_per_token),
           dict(R=rows, NTP=ntp, num_warps=4, enable_fp_fusion=False, **_poly()), 0)
    return entropy


def rank_low(entropy: torch.Tensor, groups: int, members: int, n_low: int, group_stride: int,
             member_stride: int, invert: bool) -> torch.Tensor:
    """uint8 low flag per unit: the ``n_low`` smallest keys (``entropy``, or ``-entropy``) of every group."""
    low = torch.empty(entropy.shape, dtype=torch.uint8, device=entropy.device)
    mine, theirs = 32, 128  # a 32 x 128 comparison block: 32 values a thread with 4 warps
    launch("tah_rank", tah_rank_kernel, (groups, geometry.cdiv(members, mine)),
           (entropy, low, members, n_low, group_stride, member_stride),
           dict(INVERT=invert, RB=mine, CB=theirs, CHUNKS=geometry.cdiv(members, theirs), num_warps=4), 0)
    return low


def unit_tables(low: torch.Tensor | None, flags: torch.Tensor, shape, tile_size: int, allocation: str, n_low: int,
                error: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(high units, low units) int32 tables. Encoding (``low`` given): also writes the ``flags`` section
    (token allocation: its uint8 view; tile: int32 words over it and its padding). Decoding (``low`` None):
    reads the flags, counts corrupt ones in ``error``."""
    s, b, h = shape
    tiles_per_token = geometry.num_tiles(h, tile_size)
    decode = low is None
    device = flags.device
    dummy = torch.empty(1, dtype=torch.int32, device=device)
    if allocation == "token":
        units = s * b
        high_table = torch.empty(units - n_low, dtype=torch.int32, device=device)
        low_table = torch.empty(n_low, dtype=torch.int32, device=device)
        launch("tah_token_tables" + (" decode" if decode else ""), tah_token_tables_kernel, (1,),
               (dummy if decode else low, flags, high_table, low_table, dummy if error is None else error,
                units, n_low),
               dict(DECODE=decode, CH=1024, CHUNKS=geometry.cdiv(units, 1024), num_warps=4), 0)
        return high_table, low_table
    per_token = n_low // (s * b)
    units = s * b * tiles_per_token
    high_table = torch.empty(units - n_low, dtype=torch.int32, device=device)
    low_table = torch.empty(n_low, dtype=torch.int32, device=device)
    words = flags
    if not decode:  # the bits are or-ed into int32 words over the section and its zero padding
        words = flags.view(torch.int32)
        words.zero_()
    launch("tah_tile_tables" + (" decode" if decode else ""), tah_tile_tables_kernel, (s * b,),
           (dummy if decode else low, words, high_table, low_table, dummy if error is None else error, s * b,
            tiles_per_token, per_token),
           dict(DECODE=decode, NTP=next_power_of_2(tiles_per_token), num_warps=4), 0)
    return high_table, low_table
