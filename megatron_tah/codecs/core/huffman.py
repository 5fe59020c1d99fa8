"""The device coder: canonical Huffman codes in torch operations on the buffer's device (``--tah-entropy-coder
huffman``).

Each section's symbols are coded with a canonical Huffman code built from the section's own symbol counts, in
chunks of ``CHUNK`` symbols that start on a byte, each with its length in the section's chunk table, so that the
chunks decode independently (all chunks at once: pointer doubling, a fixed number of tensor operations per
section whatever its size). It runs wherever the buffer is, so a CUDA message is coded without a copy to the
host (not timed on a GPU yet); on a CPU it is 16-88x slower than the host coder (``ans.py``) and 1-4% above the
order-0 bound (whole bits per symbol, its tables), measured by ``python -m benchmarks.lossless`` (docs/CODECS.md).

Section format (``entropy.py`` writes the mode byte's neighbours)::

    0   1  mode: 1 (``MODE``)
    1   1  longest code length, 1 .. MAX_CODE_BITS
    2   A/2 (at least 1)  code length of each symbol, 4 bits each (low nibble first; 0: absent),
                 A = 2**bits symbols
    .   2C chunk byte lengths, uint16 little endian, C = ceil(symbols / CHUNK)
    .   the chunks, each a byte-aligned run of codes, most significant bit first

The symbol counts and the table are read on the host: one device-to-host copy per section, each way.
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence

import torch

from .errors import WireFormatError

__all__ = ["CHUNK", "MAX_CODE_BITS", "MODE", "code_lengths", "decode_symbols", "encode_symbols"]

CHUNK = 512  # symbols per independently decodable chunk: 2 bytes of table each, 1/256 bit per 8-bit symbol
MAX_CODE_BITS = 12  # longest code: the decode table has 2**12 entries; a code spans at most 3 bytes
INT32_BITS = 2**31  # sections of fewer coded bits than this decode with int32 bit positions, larger ones int64
MODE = 1  # the section's first byte (entropy.py): coded by this coder


def code_lengths(counts: Sequence[int], limit: int = MAX_CODE_BITS) -> list[int]:
    """Huffman code lengths for symbol ``counts`` (0: the symbol is absent, length 0), none above ``limit``.

    A single present symbol gets length 1. Lengths above ``limit`` are cut to it and the code's Kraft sum
    restored by lengthening the least frequent symbols still shorter than ``limit``.
    """
    present = [s for s, c in enumerate(counts) if c > 0]
    if len(present) > 2**limit:
        raise ValueError(f"{len(present)} symbols do not fit codes of at most {limit} bits")
    lengths = [0] * len(counts)
    if len(present) == 1:
        lengths[present[0]] = 1
        return lengths
    heap = [(counts[s], s, [s]) for s in present]
    heapq.heapify(heap)
    while len(heap) > 1:
        c1, t1, s1 = heapq.heappop(heap)
        c2, t2, s2 = heapq.heappop(heap)
        for s in s1 + s2:
            lengths[s] += 1
        heapq.heappush(heap, (c1 + c2, min(t1, t2), s1 + s2))
    if max(lengths) > limit:
        for s in present:
            lengths[s] = min(lengths[s], limit)
        kraft = sum(2 ** (limit - lengths[s]) for s in present)
        rarest_first = sorted(present, key=lambda s: (counts[s], s))
        while kraft > 2**limit:
            s = next(s for s in rarest_first if lengths[s] < limit)
            kraft -= 2 ** (limit - lengths[s] - 1)
            lengths[s] += 1
    return lengths


def _canonical_codes(lengths: Sequence[int]) -> list[int]:
    """Canonical Huffman codes: by (length, symbol), each the previous plus one, shifted to its length."""
    codes, code, previous = [0] * len(lengths), 0, 0
    for s in sorted((s for s, n in enumerate(lengths) if n), key=lambda s: (lengths[s], s)):
        code <<= lengths[s] - previous
        codes[s], previous = code, lengths[s]
        code += 1
    return codes


def _table(lengths: Sequence[int], longest: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode table over every ``longest``-bit window: (symbol, code length); length 0 marks no code."""
    symbols, sizes = [0] * 2**longest, [0] * 2**longest
    for s, code in enumerate(_canonical_codes(lengths)):
        n = lengths[s]
        if n:
            start, count = code << (longest - n), 1 << (longest - n)
            symbols[start : start + count] = [s] * count
            sizes[start : start + count] = [n] * count
    return (torch.tensor(symbols, dtype=torch.int64, device=device),
            torch.tensor(sizes, dtype=torch.int64, device=device))


def _nibbles(lengths: Sequence[int]) -> list[int]:
    padded = list(lengths) + [0] * (len(lengths) % 2)
    return [padded[i] | padded[i + 1] << 4 for i in range(0, len(padded), 2)]


def encode_symbols(symbols: torch.Tensor, bits: int) -> torch.Tensor:
    """``symbols`` (integers below ``2**bits``, 1-D, at least one) as a mode-1 section (above), on their device."""
    device, n, alphabet = symbols.device, symbols.numel(), 2**bits
    flat = symbols.reshape(-1).to(torch.int64)
    counts = torch.bincount(flat, minlength=alphabet).tolist()
    lengths = code_lengths(counts)
    longest = max(lengths)
    size_of = torch.tensor(lengths, dtype=torch.int64, device=device)
    code_of = torch.tensor(_canonical_codes(lengths), dtype=torch.int64, device=device)
    chunks = math.ceil(n / CHUNK)
    sizes = torch.zeros(chunks * CHUNK, dtype=torch.int64, device=device)
    sizes[:n] = size_of[flat]
    sizes = sizes.view(chunks, CHUNK)
    chunk_nbytes = (sizes.sum(dim=1) + 7) // 8
    starts = torch.cumsum(chunk_nbytes, 0) - chunk_nbytes
    total = int(chunk_nbytes.sum())
    at = (starts[:, None] * 8 + torch.cumsum(sizes, dim=1) - sizes).reshape(-1)[:n]  # each code's first bit
    sizes = sizes.reshape(-1)[:n]
    window = code_of[flat] << (24 - (at & 7) - sizes)  # the code in a 3-byte window starting at its byte
    out = torch.zeros(total + 2, dtype=torch.int32, device=device)
    byte = at >> 3
    for k, shift in enumerate((16, 8, 0)):  # codes own disjoint bits: the sum of a byte's parts is their OR
        out.index_add_(0, byte + k, ((window >> shift) & 0xFF).to(torch.int32))
    table = torch.tensor([MODE, longest] + _nibbles(lengths), dtype=torch.uint8, device=device)
    lengths16 = torch.stack([chunk_nbytes & 0xFF, chunk_nbytes >> 8], dim=1).reshape(-1).to(torch.uint8)
    return torch.cat([table, lengths16, out[:total].to(torch.uint8)])


def decode_symbols(data: torch.Tensor, n: int, bits: int) -> tuple[torch.Tensor, int]:
    """The ``n`` symbols of the mode-1 section at the start of ``data`` (its mode byte first), as int64, and
    the section's length in bytes.

    Raises ``WireFormatError`` when the section is not a whole, valid code (a table longer than
    ``MAX_CODE_BITS``, a window that is no code, a chunk whose codes do not end in its last byte).
    """
    device, alphabet, chunks = data.device, 2**bits, math.ceil(n / CHUNK)
    table_nbytes = 2 + max(1, alphabet // 2)
    head_nbytes = table_nbytes + 2 * chunks
    if data.numel() < head_nbytes:
        raise WireFormatError(f"entropy-coded section: {data.numel()} bytes, its table alone needs {head_nbytes}")
    head = data[:head_nbytes].tolist()
    longest = head[1]
    lengths = [v for b in head[2:table_nbytes] for v in (b & 0xF, b >> 4)][:alphabet]
    if not 1 <= longest <= MAX_CODE_BITS or max(lengths) != longest or \
            sum(2.0 ** -n_ for n_ in lengths if n_) > 1.0:
        raise WireFormatError(f"entropy-coded section: invalid code table (longest code {longest})")
    chunk_nbytes = torch.tensor([head[table_nbytes + 2 * c] | head[table_nbytes + 2 * c + 1] << 8
                                 for c in range(chunks)], dtype=torch.int64, device=device)
    total = int(chunk_nbytes.sum())
    if data.numel() < head_nbytes + total:
        raise WireFormatError(f"entropy-coded section: {data.numel()} bytes, its chunks need {head_nbytes + total}")
    # int32 bit positions (int64 from 256 MiB of codes on) and uint8 symbols and lengths: the per-bit tensors are
    # the decode's memory
    position = torch.int32 if 8 * total < INT32_BITS else torch.int64
    payload = torch.cat([data[head_nbytes : head_nbytes + total].to(position),
                         torch.zeros(3, dtype=position, device=device)])
    symbol_at, size_at = (t.to(torch.uint8) for t in _table(lengths, longest, device))
    # Decode at every bit position at once: the symbol and code length a code starting there would have.
    bit = torch.arange(8 * total, dtype=position, device=device)
    byte = bit >> 3
    window = payload[byte] << 16 | payload[byte + 1] << 8 | payload[byte + 2]
    index = (window >> (24 - longest - (bit & 7))) & ((1 << longest) - 1)
    del byte, window
    symbols_at = torch.cat([symbol_at[index], symbol_at.new_zeros(1)])
    sizes_at = torch.cat([size_at[index], size_at.new_zeros(1)])  # the last position: past the end, no code
    del index
    after = torch.clamp(torch.cat([bit + sizes_at[:-1], bit.new_full((1,), 8 * total)]), max=8 * total)
    del bit
    # Code i of a chunk starts at after^i(the chunk's first bit): pointer doubling, log2(CHUNK) steps.
    starts = torch.cumsum(chunk_nbytes, 0) - chunk_nbytes
    step = torch.arange(CHUNK, device=device)
    at = (starts * 8).to(position)[:, None].expand(chunks, CHUNK).clone()
    jump = after
    for j in range(CHUNK.bit_length() - 1):
        at = torch.where(((step >> j) & 1).bool(), jump[at], at)
        jump = jump[jump]
    del jump, after
    counts = torch.full((chunks,), CHUNK, dtype=torch.int64, device=device)
    counts[-1] = n - (chunks - 1) * CHUNK
    live = step < counts[:, None]
    bad = (live & (sizes_at[at] == 0)).any(dim=1)  # a window that is no code, or past the section's end
    last = at.gather(1, (counts - 1)[:, None])[:, 0].long()
    end = last + sizes_at[last]
    bad |= (end - starts * 8 + 7) // 8 != chunk_nbytes
    if bool(bad.any()):
        raise WireFormatError(f"entropy-coded section: {int(bad.sum())} of {chunks} chunks are not valid codes")
    out = symbols_at[at].long()
    return out.reshape(-1)[:n], head_nbytes + total
