"""The wire header and the layout of a codec's sections behind it.

====== ===== ==========================================================
offset bytes  field
====== ===== ==========================================================
0      2      magic ``b"MT"``
2      1      wire format version (``WIRE_VERSION``)
3      1      codec id (``Codec.codec_id``, registered with ``register_codec_id``)
4      4      CRC-32 of the codec's config (little endian)
8      4      CRC-32 of the shape and dtype (little endian)
12     4      payload checksum (little endian; ``checksum.py``), 0: none
====== ===== ==========================================================

Sections follow in the order the codec lists them, each starting on an
8-byte boundary (so bf16/fp32 sections can be viewed in place); the
alignment padding is zeros, so identical inputs give identical bytes.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Sequence

import torch

from .errors import dtype_name

MAGIC = b"MT"
WIRE_VERSION = 2  # 2: bytes 12-15 hold the payload checksum (1: reserved, zero)
HEADER_NBYTES = 16
CHECKSUM_OFFSET = 12  # the header's last 4 bytes
SECTION_ALIGN = 8


def align_up(n: int, alignment: int = SECTION_ALIGN) -> int:
    return (n + alignment - 1) // alignment * alignment


def crc32_of(text: str) -> int:
    return zlib.crc32(text.encode()) & 0xFFFFFFFF


@dataclasses.dataclass(frozen=True)
class WireLayout:
    """Byte offsets of a codec's sections inside one buffer (header first)."""

    offsets: dict[str, tuple[int, int]]  # name -> (start, nbytes)
    nbytes: int

    @classmethod
    def build(cls, sections: Sequence[tuple[str, int]]) -> "WireLayout":
        offsets = {}
        cursor = HEADER_NBYTES
        for name, size in sections:
            cursor = align_up(cursor)
            offsets[name] = (cursor, int(size))
            cursor += int(size)
        return cls(offsets=offsets, nbytes=align_up(cursor))

    def view(self, buf: torch.Tensor, name: str, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """The section ``name`` of ``buf`` as a 1-D tensor of ``dtype`` (no copy)."""
        start, size = self.offsets[name]
        return buf[start : start + size].view(dtype)

    def sections(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every section of ``buf`` as a 1-D uint8 view, by name: what the kernels' launchers take."""
        return {name: buf[start : start + size] for name, (start, size) in self.offsets.items()}


class WireHeader:
    """The header bytes a codec writes and expects, cached per shape, dtype and device.

    Part of ``Codec``: reads its ``codec_id`` and ``config_digest()``, and keeps ``_header_cache``.
    """

    def _header_bytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> bytes:
        shape_digest = crc32_of(f"{shape}/{dtype_name(dtype)}")
        return (
            MAGIC
            + bytes([WIRE_VERSION, self.codec_id])
            + self.config_digest().to_bytes(4, "little")
            + shape_digest.to_bytes(4, "little")
            + bytes(4)
        )

    def _fixed_bytes(self, shape, dtype, layout: WireLayout, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, values) of the bytes fixed by shape and config: the header and the alignment padding."""
        key = ("fixed", shape, dtype, str(device), layout.nbytes)
        if key not in self._header_cache:
            positions = list(range(HEADER_NBYTES))
            cursor = HEADER_NBYTES
            for start, size in sorted(layout.offsets.values()):
                positions += range(cursor, start)
                cursor = start + size
            positions += range(cursor, layout.nbytes)
            values = bytearray(self._header_bytes(shape, dtype)) + bytearray(len(positions) - HEADER_NBYTES)
            self._header_cache[key] = (torch.tensor(positions, dtype=torch.int64).to(device),
                                       torch.frombuffer(values, dtype=torch.uint8).to(device))
        return self._header_cache[key]

    def _header(self, shape, dtype, device) -> torch.Tensor:
        key = (shape, dtype, str(device))
        if key not in self._header_cache:
            raw = torch.frombuffer(bytearray(self._header_bytes(shape, dtype)), dtype=torch.uint8)
            self._header_cache[key] = raw.to(device)
        return self._header_cache[key]

    @staticmethod
    def _zero_padding(buf: torch.Tensor, layout: WireLayout) -> None:
        cursor = HEADER_NBYTES
        for start, size in sorted(layout.offsets.values()):
            if start > cursor:
                buf[cursor:start].zero_()
            cursor = start + size
        if layout.nbytes > cursor:
            buf[cursor:].zero_()


_CODEC_NAMES_BY_ID: dict[int, str] = {}


def register_codec_id(codec_id: int, name: str) -> None:
    """Record that ``codec_id`` (the header's byte 3) is codec ``name``'s, run when the codec's module is
    imported; an id outside one byte or already another codec's raises ``ValueError`` naming both."""
    if isinstance(codec_id, bool) or not isinstance(codec_id, int) or not 0 <= codec_id < 255:
        raise ValueError(f"codec_id = {codec_id!r} of codec {name!r}: must be an integer in [0, 254] "
                         "(255 is the base class's)")
    other = _CODEC_NAMES_BY_ID.setdefault(codec_id, name)
    if other != name:
        raise ValueError(f"codec_id = {codec_id} of codec {name!r} is already codec {other!r}'s: "
                         "give the new codec an unused id")


def codec_name_for_id(codec_id: int) -> str:
    return _CODEC_NAMES_BY_ID.get(codec_id, f"unknown id {codec_id}")
