"""The fast host coder: each section's symbols, one to a byte, through zstd (``--tah-entropy-coder zstd``).

A packed-code section is unpacked to symbols of ``symbol_bits(bits)`` bits, one per byte: 1-, 2-, 4- and 8-bit
codes stay the section's own bytes (several codes to a byte), 3-bit codes go in pairs and 6-bit codes alone as
6-bit symbols (every 3 bytes of the little-endian bit stream are 4 symbols), 5- and 7-bit codes alone. Any other
section goes as its bytes, in order or, where its odd bytes span few values (``PLANES_SPREAD``), as two byte planes
(its even bytes, then its odd bytes): a section of 16-bit scales has a sign-and-exponent byte of a few values beside
a mantissa byte of many, and apart their order-0 entropies sum to less than theirs mixed (measured on
``lowrank_h3_rn``'s scale section of a ``[128, 1, 576]`` message: 1634 bytes in order, 1394 as planes). That byte
stream goes through the zstd library (PyPI ``zstandard``, level ``LEVEL``): on such a stream zstd's Huffman literal
coder comes close to the symbols' order-0 entropy (on a bit-packed stream, where codes straddle bytes, it cannot), at
about a GB/s; most of this coder's time is numpy's unpacking and packing.

Why beside ``ans`` (``ans.py``): measured on this project's 2-core CPU, one thread, on ``lowrank_h3_rn``'s buffers of
real SmolLM2-135M messages (``python -m benchmarks.lossless --coders``, docs/CODECS.md "Which coder, and where it
pays"): the same size as ``ans`` within about 1% either way, at several times its speed.

Section format (``entropy.py`` writes the bytes around it), little endian::

    0   1   mode: 3 (``MODE``)
    1   1   planes: 1 = the symbols in order, 2 = a byte section's even bytes then its odd bytes (``PLANES``)
    2   4   N: the zstd frame's length in bytes
    6   N   one zstd frame of the symbols (its content size and checksum written: decoding checks both)

Decoding checks the planes byte, the frame's length against the buffer, the frame itself (zstd: its content size,
its checksum), the symbol count the section's size implies and that no symbol exceeds its bits; anything else is the
payload checksum's (``--tah-wire-checksum``). The frame format is zstd's stable one: any zstd decodes any other's
frames, so the two ends of a link need not hold the same library version (``IDENTITY``).
"""

from __future__ import annotations

import threading

import numpy as np

from .errors import WireFormatError

__all__ = ["IDENTITY", "LEVEL", "MODE", "decode_section", "encode_section", "pack", "symbol_bits", "unpack"]

MODE = 3
LEVEL = 1  # zstd's fastest positive level: the literals are Huffman-coded (the negative levels leave them raw)
IDENTITY = "zstd (frame format 1, byte planes)"  # what the handshake compares: the format, not the library's version
PLANES = (1, 2)  # the symbols in order; a byte section as its even bytes, then its odd bytes
# A byte section goes as planes where its odd bytes span fewer values than this: the high bytes of 16-bit scales
# (sign and exponent) span a few, a section of 8-bit codes spans about all 256. One frame a section, chosen before.
PLANES_SPREAD = 64
_HEAD = 6  # mode byte, planes byte and frame length
_LOCAL = threading.local()  # a compression and a decompression context per thread (zstd's contexts are not shared)


def _zstd():
    try:
        import zstandard
    except ImportError as err:  # a dependency of the package: only a broken environment lacks it
        raise ImportError("megatron_tah's zstd entropy coder needs PyPI zstandard (pip install zstandard)") from err
    return zstandard


def _contexts():
    if not hasattr(_LOCAL, "compress"):
        zstandard = _zstd()
        _LOCAL.compress = zstandard.ZstdCompressor(level=LEVEL, write_checksum=True, write_content_size=True)
        _LOCAL.decompress = zstandard.ZstdDecompressor()
    return _LOCAL.compress, _LOCAL.decompress


def symbol_bits(bits: int) -> int:
    """Bits of the symbols a section of ``bits``-bit codes goes as, one per byte: 8 where codes fill bytes
    exactly, a pair of 3-bit codes, else one code."""
    if 8 % bits == 0:
        return 8
    return 2 * bits if 2 * bits <= 8 else bits


def unpack(raw: np.ndarray, bits: int) -> np.ndarray:
    """The symbols (uint8, ``symbol_bits(bits)`` bits each, the first in the lowest bits) of a packed section
    (``common.pack_bits``' layout: 8 codes little endian in ``bits`` bytes)."""
    width = symbol_bits(bits)
    if width == 8:
        return raw
    if width == 6:  # 3 bytes: 4 symbols
        g = raw.reshape(-1, 3)
        out = np.empty((g.shape[0], 4), dtype=np.uint8)
        out[:, 0] = g[:, 0] & 63
        out[:, 1] = (g[:, 0] >> 6) | ((g[:, 1] & 15) << 2)
        out[:, 2] = (g[:, 1] >> 4) | ((g[:, 2] & 3) << 4)
        out[:, 3] = g[:, 2] >> 2
        return out.reshape(-1)
    groups = np.zeros((raw.size // bits, 8), dtype=np.uint8)  # 5 or 7 bits: 8 codes in `bits` bytes
    groups[:, :bits] = raw.reshape(-1, bits)
    shifts = np.arange(0, 8 * bits, bits, dtype=np.uint64)
    return ((groups.view("<u8") >> shifts) & np.uint64((1 << bits) - 1)).astype(np.uint8).reshape(-1)


def pack(symbols: np.ndarray, bits: int, nbytes: int) -> np.ndarray:
    """``unpack``'s inverse: the section's ``nbytes`` bytes (uint8)."""
    width = symbol_bits(bits)
    if width == 8:
        return symbols
    if width == 6:
        s = symbols.reshape(-1, 4)
        out = np.empty((s.shape[0], 3), dtype=np.uint8)
        out[:, 0] = s[:, 0] | ((s[:, 1] & 3) << 6)
        out[:, 1] = (s[:, 1] >> 2) | ((s[:, 2] & 15) << 4)
        out[:, 2] = (s[:, 2] >> 4) | (s[:, 3] << 2)
        return out.reshape(-1)
    groups = symbols.reshape(-1, 8).astype(np.uint64)
    words = groups[:, 0].copy()
    for i in range(1, 8):
        words |= groups[:, i] << np.uint64(i * bits)
    return words.astype("<u8").view(np.uint8).reshape(-1, 8)[:, :bits].reshape(-1)[:nbytes]


def _planes(raw: np.ndarray) -> bytes:
    """A byte section of even size as two planes: its even bytes, then its odd bytes."""
    return raw.reshape(-1, 2).T.tobytes()


def _interleave(planes: bytes) -> np.ndarray:
    """``_planes``' inverse."""
    return np.frombuffer(planes, dtype=np.uint8).reshape(2, -1).T.reshape(-1)


def encode_section(raw: np.ndarray, bits: int) -> np.ndarray:
    """Section ``raw`` (uint8, a whole number of ``bits``-bit codes) coded (format above), mode byte first: a byte
    section (``bits`` 8) of even size as two planes where its odd bytes span fewer than ``PLANES_SPREAD`` values."""
    compress, _ = _contexts()
    high = raw[1::2] if bits == 8 and raw.size and raw.size % 2 == 0 else None
    planes = 2 if high is not None and int(high.max()) - int(high.min()) < PLANES_SPREAD else 1
    frame = compress.compress(_planes(raw) if planes == 2 else np.ascontiguousarray(unpack(raw, bits)).tobytes())
    head = np.array([MODE, planes, *len(frame).to_bytes(4, "little")], dtype=np.uint8)
    return np.concatenate([head, np.frombuffer(frame, dtype=np.uint8)])


def decode_section(data: np.ndarray, at: int, size: int, bits: int) -> tuple[np.ndarray, int]:
    """The ``size`` bytes of the section coded at ``data[at:]`` (its mode byte first) and the coded section's
    length; ``WireFormatError`` when it is not one this coder wrote."""
    width = symbol_bits(bits)
    n = size * 8 // width
    if data.size < at + _HEAD:
        raise WireFormatError(f"zstd-coded section at byte {at}: {data.size - at} bytes, its head alone needs {_HEAD}")
    planes = int(data[at + 1])
    if planes not in PLANES or (planes == 2 and (bits != 8 or size % 2)):
        raise WireFormatError(f"zstd-coded section at byte {at}: planes byte {planes}, for a section of {size} bytes "
                              f"of {bits}-bit codes (corrupted)")
    length = int.from_bytes(data[at + 2 : at + _HEAD].tobytes(), "little")
    end = at + _HEAD + length
    if end > data.size:
        raise WireFormatError(f"zstd-coded section at byte {at}: its frame of {length} bytes ends at byte {end}, "
                              f"past the buffer's {data.size}")
    _, decompress = _contexts()
    try:
        out = decompress.decompress(data[at + _HEAD : end].tobytes(), max_output_size=n)
    except _zstd().ZstdError as err:
        raise WireFormatError(f"zstd-coded section at byte {at}: not a valid frame ({err})") from None
    if len(out) != n:
        raise WireFormatError(f"zstd-coded section at byte {at}: {len(out)} symbols, its {size} bytes hold {n}")
    if planes == 2:
        return _interleave(out), end - at
    symbols = np.frombuffer(out, dtype=np.uint8)
    if width < 8 and int(symbols.max(initial=0)) >> width:
        raise WireFormatError(f"zstd-coded section at byte {at}: a symbol above {width} bits (corrupted)")
    return pack(symbols, bits, size), end - at
