"""A lossless coder after any codec: its buffer in fewer bytes, decoded back bit for bit.

A codec's buffer has a fixed size, but its codes are not uniformly distributed (docs/CODECS.md, "What a
lossless coder after the codec would save"). ``encode(codec, buf, shape, dtype, coder)`` codes each of the
buffer's sections with an order-0 entropy coder whose model is that section's own symbol counts: the codec's
bit-packed codes (``Codec.code_sections``) as symbols of their bits, every other section (scales, zero
points, a basis) as bytes. ``decode`` rebuilds the codec's buffer exactly, so ``codec.decode`` of it is the
tensor the codec alone would give: a codec's steps to a target loss do not change, only its bytes.

Three coders (``CODERS``, ``--tah-entropy-coder``), two on the host and one on the buffer's device:

* ``zstd`` (``zstd.py``, the default): the symbols one to a byte through PyPI ``zstandard``, within about 1% of
  ``ans``'s size at several times its speed (docs/CODECS.md, "Which coder, and where it pays"). A CUDA buffer is
  copied to the host and back, as for ``ans``.
* ``ans`` (``ans.py``): PyPI ``constriction``'s ANS coder on the host, at the order-0 bound and
  16-88x faster than ``huffman`` where both were timed in one command on this project's CPU.
* ``huffman`` (``huffman.py``): canonical Huffman codes in torch operations on the buffer's own device (a CUDA
  message is coded where it is; not timed on a GPU); 1-4% above the order-0 bound.

A GPU library coder (nvCOMP's ANS, torch-ans's CUDA kernels) is not wired: neither can be installed as a
prebuilt wheel and run without a GPU here (nvCOMP's wheels need CUDA at import; torch-ans compiles its CUDA
kernels with ``nvcc`` on first use), so neither could be tested on the machines this project is built on.

Wire format of one coded buffer: the codec buffer's bytes outside its sections (the 16-byte header, the
alignment between sections) as they are, in place, and in place of each section its mode byte and what
follows it::

    0   1  mode: 0 = the section's bytes follow as they are (whenever coding would not make it smaller),
                 1 = huffman-coded (huffman.py's format), 2 = ans-coded (ans.py's format),
                 3 = zstd-coded (zstd.py's format)

A link's two ends agree on the coder at start-up (the handshake, ``link/handshake.py``); a section coded by
another coder than the link's is refused (``WireFormatError``), as is any section that is not a whole, valid
code. A section's symbol count is its byte size x 8 / bits (the receiver knows it from the codec's layout). A
coded buffer is at most ``capacity_nbytes`` = the codec buffer plus one byte per section, whatever the coder.
"""

from __future__ import annotations

import numpy as np
import torch

from . import ans, huffman, zstd
from .base import Codec
from .errors import WireFormatError
from .common import pack_bits, unpack_bits

__all__ = ["CODERS", "DEFAULT_CODER", "RAW", "capacity_nbytes", "coder_identity", "decode", "encode"]

RAW = 0
CODERS = {"zstd": zstd.MODE, "ans": ans.MODE, "huffman": huffman.MODE}  # name -> the mode byte of its sections
DEFAULT_CODER = "zstd"
_HOST = {"zstd": zstd, "ans": ans}  # the host coders' modules: encode_section, decode_section
_NAME_OF_MODE = {mode: name for name, mode in CODERS.items()}


def coder_identity(coder: str) -> str:
    """What both ends of a link must hold alike to read each other's sections: the coder and, for a library's,
    its version (``ans``: the model's quantization is the library's)."""
    _check_coder(coder)
    return {"ans": f"ans ({ans.library()})", "zstd": zstd.IDENTITY}.get(coder, "huffman (torch)")


def _check_coder(coder: str) -> None:
    if coder not in CODERS:
        raise ValueError(f"entropy coder {coder!r}: choose one of {', '.join(CODERS)}")


def _symbol_bits(codec: Codec, name: str, size: int) -> int | None:
    """Bits per symbol of section ``name`` (``size`` bytes): its codes' bits, 8 for bytes, None: not coded."""
    bits = codec.code_sections().get(name, 8)
    return bits if size and size % bits == 0 else None


def _regions(codec: Codec, shape, dtype):
    """(start, size, bits, is a section) over the whole codec buffer in order: bits None for bytes carried
    as they are (the header, the alignment between sections, a section whose size is no whole number of codes)."""
    layout = codec.layout(shape, dtype)
    cursor = 0
    for name, (start, size) in sorted(layout.offsets.items(), key=lambda item: item[1][0]):
        if start > cursor:
            yield cursor, start - cursor, None, False
        yield start, size, _symbol_bits(codec, name, size), True
        cursor = start + size
    if layout.nbytes > cursor:
        yield cursor, layout.nbytes - cursor, None, False


def capacity_nbytes(codec: Codec, shape, dtype) -> int:
    """The most bytes ``encode`` returns for this shape and dtype: the codec's buffer plus a byte per section."""
    return codec.wire_nbytes(shape, dtype) + len(codec.layout(shape, dtype).offsets)


def encode(codec: Codec, buf: torch.Tensor, shape, dtype, coder: str = DEFAULT_CODER) -> torch.Tensor:
    """``codec``'s buffer ``buf`` (of ``shape``, ``dtype``) coded losslessly by ``coder`` (``CODERS``; ``"raw"``:
    every section as it is, the format's cheapest message): a 1-D uint8 tensor of at most ``capacity_nbytes`` bytes
    on ``buf``'s device (format above)."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != codec.wire_nbytes(shape, dtype):
        raise WireFormatError(f"entropy.encode takes {codec.name}'s {codec.wire_nbytes(shape, dtype)}-byte buffer "
                              f"(1-D uint8), got {buf.dtype} of shape {tuple(buf.shape)}")
    if coder in ("huffman", "raw"):  # on the buffer's device
        return _encode_on_device(codec, buf, shape, dtype, coder == "huffman")
    _check_coder(coder)
    coded = _code_sections(codec, buf.cpu().numpy(), shape, dtype, _HOST[coder].encode_section,
                           lambda raw: np.concatenate([np.array([RAW], dtype=np.uint8), raw]), np.concatenate)
    return torch.from_numpy(coded).to(buf.device)


def _encode_on_device(codec: Codec, buf: torch.Tensor, shape, dtype, code: bool) -> torch.Tensor:
    """``encode`` in torch operations on ``buf``'s device: the device coder (``code``), or every section raw."""
    def huffman_section(raw, bits):
        return huffman.encode_symbols(unpack_bits(raw, bits, raw.numel() * 8 // bits), bits) if code else None

    return _code_sections(codec, buf, shape, dtype, huffman_section,
                          lambda raw: torch.cat([raw.new_tensor([RAW]), raw]), torch.cat)


def _code_sections(codec: Codec, data, shape, dtype, code_section, as_raw, join):
    """``data`` (a 1-D uint8 array or tensor: the codec's buffer) with every section of ``bits``-bit symbols coded
    by ``code_section(raw, bits)`` (None: not coded), sent raw (``as_raw``: the RAW mode byte, then the bytes)
    where coding does not make it smaller; the parts that are not sections as they are; ``join``ed."""
    parts = []
    for start, size, bits, section in _regions(codec, shape, dtype):
        raw = data[start : start + size]
        if not section:
            parts.append(raw)
            continue
        coded = code_section(raw, bits) if bits else None
        if coded is None or len(coded) >= size + 1:
            coded = as_raw(raw)
        parts.append(coded)
    return join(parts)


def _section_mode(mode: int, start: int, bits: int | None, coder: str) -> int:
    """A section's mode byte, checked: raw, or ``coder``'s (a codes section only); ``WireFormatError`` otherwise."""
    if mode == RAW or (mode == CODERS[coder] and bits):
        return mode
    if mode in _NAME_OF_MODE:
        raise WireFormatError(f"entropy-coded buffer: the section at byte {start} was coded by "
                              f"{_NAME_OF_MODE[mode]}, this end decodes {coder}: both ends of a link need the same "
                              "--tah-entropy-coder")
    raise WireFormatError(f"entropy-coded buffer: section at byte {start} has mode {mode}")


def decode(codec: Codec, coded: torch.Tensor, shape, dtype, coder: str = DEFAULT_CODER) -> torch.Tensor:
    """The codec buffer ``encode`` coded with ``coder``, bit for bit, on ``coded``'s device; ``WireFormatError`` on a
    buffer that is not one (a section coded by another coder included)."""
    _check_coder(coder)
    if coded.dtype != torch.uint8 or coded.dim() != 1:
        raise WireFormatError(f"entropy.decode takes a 1-D uint8 buffer, got {coded.dtype} of shape "
                              f"{tuple(coded.shape)}")
    if coder == "huffman":
        return _decode_huffman(codec, coded, shape, dtype)
    data = coded.cpu().numpy()
    buf = np.empty(codec.wire_nbytes(shape, dtype), dtype=np.uint8)
    at = 0
    for start, size, bits, section in _regions(codec, shape, dtype):
        if section:
            if at >= data.size:
                raise WireFormatError(f"entropy-coded buffer ends at byte {at}, before its section at {start}")
            if _section_mode(int(data[at]), start, bits, coder) != RAW:
                buf[start : start + size], used = _HOST[coder].decode_section(data, at, size, bits)
                at += used
                continue
            at += 1
        if data.size < at + size:
            raise WireFormatError(f"entropy-coded buffer: {data.size} bytes, its bytes at {start} need {at + size}")
        buf[start : start + size] = data[at : at + size]
        at += size
    if at != data.size:
        raise WireFormatError(f"entropy-coded buffer: {data.size} bytes, its sections end at {at}")
    return torch.from_numpy(buf).to(coded.device)


def _decode_huffman(codec: Codec, coded: torch.Tensor, shape, dtype) -> torch.Tensor:
    """``decode`` with the device coder, on ``coded``'s device."""
    buf = torch.empty(codec.wire_nbytes(shape, dtype), dtype=torch.uint8, device=coded.device)
    at = 0
    for start, size, bits, section in _regions(codec, shape, dtype):
        if section:
            if at >= coded.numel():
                raise WireFormatError(f"entropy-coded buffer ends at byte {at}, before its section at {start}")
            mode = _section_mode(int(coded[at]), start, bits, "huffman")
            at += 1
            if mode != RAW:
                symbols, used = huffman.decode_symbols(coded[at - 1 :], size * 8 // bits, bits)
                buf[start : start + size] = pack_bits(symbols, bits)
                at += used - 1
                continue
        if coded.numel() < at + size:
            raise WireFormatError(f"entropy-coded buffer: {coded.numel()} bytes, its bytes at {start} need {at + size}")
        buf[start : start + size] = coded[at : at + size]
        at += size
    if at != coded.numel():
        raise WireFormatError(f"entropy-coded buffer: {coded.numel()} bytes, its sections end at {at}")
    return buf
