"""The host coder: each section's symbols through ``constriction``'s ANS coder (``--tah-entropy-coder ans``, the
default).

A section's symbols are coded with asymmetric numeral systems under a static model of the section's own symbol
counts: any other section's bytes, and a packed-code section's codes, several neighbouring codes to a symbol of
at most 8 bits where the section is large enough for the larger table (``symbol_bits``: 3- and 4-bit codes in pairs
from 8 and 32 KB of codes; half the library calls per code, and the order-0 entropy of a pair is at most twice a
code's, so the size stays at or under the single codes' bound). The model is quantized to one byte per symbol on a log scale
(``TABLE_STEPS`` steps per octave: a probability within 3.5% of the count's share, which costs well under 0.1% of
the section's bits). The coding itself is the library's (PyPI ``constriction``, Rust: ``stack.AnsCoder`` with a
``model.Categorical`` built from the table); unpacking the codes and packing them back are numpy on the host. A
CUDA buffer is copied to the host to be coded (see ``entropy.py``: the device coder is ``huffman.py``).

Why this library (measured on this project's 2-core CPU beside another job, one thread; the tables and commands are
in docs/CODECS.md, "Which coder, and where it pays"): ``python -m benchmarks.lossless.coder_libraries`` put the same symbols
(every section of ``lowrank_h3_rn``'s buffers of real SmolLM2-135M messages at [1024, 1, 576] and [128, 1, 576])
through PyPI ``constriction`` 0.5 (0.9999-1.0009x the order-0 bound, 31 MB/s of codec buffer encode + decode at
both shapes) and PyPI ``torch-ans`` 0.4 (rANS, 4 interleaved states: 1.0004-1.0076x, 10.5-29.8 MB/s, its per-call
set-up weighing on small sections; and with zero counts in its table it did not return from one real section).
``python -m benchmarks.lossless`` times this whole coder (tables, unpacking and packing included) against the torch
Huffman coder it replaced as the default, in the same command: 7-29 MB/s against 0.3-0.9 MB/s, and from 0.5% below
to 2.6% above the buffer's order-0 bound (tables included; below it where codes go in pairs) against 1.4-4.1% above. torch-ans's prebuilt wheel has no CUDA kernels (it compiles them
with ``nvcc`` on first use of a CUDA tensor), so it would not give a GPU path without a toolkit either.

Section format (``entropy.py`` writes the bytes around it), little endian::

    0       1   mode: 2 (``MODE``)
    1       4   W: the coded stream's length in 32-bit words
    5       A   the model: one byte per symbol (A = 2**symbol_bits(bits, section bytes)): 0: absent; q:
                probability proportional to 2**((q - 255) / TABLE_STEPS)
    5 + A   4W  the ANS stream (``AnsCoder.get_compressed()``)

Decoding checks what it can: the stream's length against the section's bytes, that the coder ends in its
initial state with every symbol decoded (a corrupted stream almost never does), and that no decoded symbol is
one the table says is absent; anything else is the payload checksum's (``--tah-wire-checksum``).
"""

from __future__ import annotations

from importlib.metadata import version

import numpy as np

from .errors import WireFormatError

__all__ = ["MODE", "TABLE_SHARE", "decode_section", "encode_section", "library", "pack", "symbol_bits", "unpack"]

MODE = 2
TABLE_STEPS = 10  # table steps per octave of a symbol's count
_HEAD = 5  # mode byte and word count
TABLE_SHARE = 128  # codes go several to a symbol only while the larger table is at most 1/128 of the section
def _constriction():
    try:
        import constriction
    except ImportError as err:  # a dependency of the package: only a broken environment lacks it
        raise ImportError("megatron_tah's host entropy coder needs PyPI constriction (pip install constriction)") \
            from err
    return constriction


def library() -> str:
    """The coding library and its version: both ends of a link must hold the same (the handshake compares it)."""
    return f"constriction {version('constriction')}"



def symbol_bits(bits: int, nbytes: int) -> int:
    """Bits of the symbols a section of ``nbytes`` bytes of ``bits``-bit codes is coded as: the most codes per
    symbol (8, 4 or 2, at most 8 bits) whose table (a byte per symbol) is at most ``1 / TABLE_SHARE`` of the
    section, else 1."""
    for per in (8, 4, 2):
        if per * bits <= 8 and (1 << per * bits) * TABLE_SHARE <= nbytes:
            return per * bits
    return bits


def unpack(raw: np.ndarray, bits: int) -> np.ndarray:
    """The symbols of a packed section (``common.pack_bits``' layout: 8 codes little endian in ``bits`` bytes) as
    int32, ``symbol_bits(bits, raw.size)`` bits each (neighbouring codes, the first in the lowest bits)."""
    width = symbol_bits(bits, raw.size)
    if width == 8:
        return raw.astype(np.int32)
    groups = np.zeros((raw.size // bits, 8), dtype=np.uint8)
    groups[:, :bits] = raw.reshape(-1, bits)
    shifts = np.arange(0, 8 * bits, width, dtype=np.uint64)
    return ((groups.view("<u8") >> shifts) & np.uint64((1 << width) - 1)).astype(np.int32).reshape(-1)


def pack(symbols: np.ndarray, bits: int, nbytes: int) -> np.ndarray:
    """``unpack``'s inverse: the section's ``nbytes`` bytes (uint8)."""
    width = symbol_bits(bits, nbytes)
    if width == 8:
        return symbols.astype(np.uint8)
    groups = symbols.reshape(-1, 8 * bits // width).astype(np.uint64)
    words = groups[:, 0].copy()
    for i in range(1, groups.shape[1]):
        words |= groups[:, i] << np.uint64(i * width)
    return words.astype("<u8").view(np.uint8).reshape(-1, 8)[:, :bits].reshape(-1)


def _table(counts: np.ndarray) -> np.ndarray:
    """One byte per symbol from its count: 0 absent, else 255 + round(TABLE_STEPS * log2(count / largest)), >= 1."""
    table = np.zeros(counts.size, dtype=np.uint8)
    present = counts > 0
    steps = np.rint(TABLE_STEPS * np.log2(counts[present] / counts.max()))
    table[present] = np.clip(255 + steps, 1, 255).astype(np.uint8)
    return table


def _model(table: np.ndarray):
    """The table's model: the same floats, so the same quantized model, on both ends."""
    weights = np.where(table > 0, np.exp2((table.astype(np.float64) - 255) / TABLE_STEPS), 0.0)
    return _constriction().stream.model.Categorical(weights / weights.sum(), perfect=False)


def encode_section(raw: np.ndarray, bits: int) -> np.ndarray:
    """Section ``raw`` (uint8, a whole number of ``bits``-bit codes) coded (format above), mode byte first."""
    symbols = unpack(raw, bits)
    counts = np.bincount(symbols, minlength=1 << symbol_bits(bits, raw.size))
    table = _table(counts)
    coder = _constriction().stream.stack.AnsCoder()
    coder.encode_reverse(symbols, _model(table))
    words = coder.get_compressed().astype("<u4", copy=False)
    head = np.array([MODE, *int(words.size).to_bytes(4, "little")], dtype=np.uint8)
    return np.concatenate([head, table, words.view(np.uint8)])


def decode_section(data: np.ndarray, at: int, size: int, bits: int) -> tuple[np.ndarray, int]:
    """The ``size`` bytes of the section coded at ``data[at:]`` (its mode byte first) and the coded section's
    length; ``WireFormatError`` when it is not one this coder wrote."""
    width = symbol_bits(bits, size)
    alphabet, n = 1 << width, size * 8 // width
    if data.size < at + _HEAD + alphabet:
        raise WireFormatError(f"ans-coded section at byte {at}: {data.size - at} bytes, its table alone needs "
                              f"{_HEAD + alphabet}")
    words = int.from_bytes(data[at + 1 : at + _HEAD].tobytes(), "little")
    table = data[at + _HEAD : at + _HEAD + alphabet]
    end = at + _HEAD + alphabet + 4 * words
    if end > data.size:
        raise WireFormatError(f"ans-coded section at byte {at}: its stream of {words} words ends at byte {end}, "
                              f"past the buffer's {data.size}")
    if not table.any():
        raise WireFormatError(f"ans-coded section at byte {at}: a table without symbols")
    stream = np.frombuffer(data[at + _HEAD + alphabet : end].tobytes(), dtype="<u4").astype(np.uint32)
    try:
        coder = _constriction().stream.stack.AnsCoder(stream)
        symbols = coder.decode(_model(table), n)
        ended = coder.is_empty()
    except (ValueError, RuntimeError, AssertionError) as err:
        raise WireFormatError(f"ans-coded section at byte {at}: not a valid stream ({err})") from None
    if not ended:
        raise WireFormatError(f"ans-coded section at byte {at}: its stream does not end with its {n} symbols "
                              "(corrupted)")
    if not table[symbols].all():
        raise WireFormatError(f"ans-coded section at byte {at}: decoded a symbol its table says is absent "
                              "(corrupted)")
    return pack(symbols, bits, size), end - at
