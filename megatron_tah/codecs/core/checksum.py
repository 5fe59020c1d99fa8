"""The payload checksum carried in bytes 12-15 of the wire header (see ``header``).

Value, a little-endian uint32::

    1 + (sum over i of (i + 1) * w[i]) mod P,    P = 2**32 - 5 (the largest prime below 2**32)

where ``w`` is the payload (every byte after the 16-byte header, alignment padding included) read as
little-endian uint16 words. The field is 0 when the sender has the checksum off, so a real value is
never 0 (it lies in [1, P]).

Why this sum:

* A change confined to one word (any single byte, or both bytes of one word) moves the sum by
  ``(i + 1) * d`` with ``0 < |d| < 2**16`` and ``0 < i + 1 < P``: never a multiple of the prime P, so it
  is always detected (payloads below 8 GiB). Swapping two different words moves it by
  ``(j - i) * (w[i] - w[j])``: detected too. Any other change goes unseen only when its weighted
  sum is a multiple of P: about 1 in 2**32 for random corruption (TCP's 16-bit sum: 1 in 2**16).
* Integer arithmetic, exact in int64 (a word times a weight < 2**16 * 2**15, a chunk's sums < 2**62),
  so the summation order does not matter: the value is the same on CPU and CUDA, for any view of
  the same bytes. CRC-32 would need byte-serial table lookups or a carry-less multiply, which are
  not a handful of torch ops.
* It runs as torch ops on the buffer's own device and returns a device tensor: no host sync.
"""

from __future__ import annotations

import torch

from .errors import PayloadChecksumError, WireFormatError
from .header import CHECKSUM_OFFSET, HEADER_NBYTES

PRIME = 2**32 - 5
CHUNK = 1 << 15  # words per row: weights within a row stay below 2**15, so row sums stay below 2**62

ENABLED_BY_DEFAULT = False
"""Default of ``Codec(checksum=...)`` and ``--tah-wire-checksum``. The yardstick is the step, not the codec: on a
slow link a message's link time is 100-1000x its checksum's, and there the checksum costs under 0.05% of a step
(``python -m benchmarks.faults.checksum_cost``: the demo at 1 Mbit/s, the depth-8 speedrun), so the scripts turn it
on whenever they run behind one (``scripts/pretrain_gpt.sh`` with ``RATE``, the demo). Off by default here, where
the link may be fast: on CPU it costs 58-80 us at the demo's 64x4x128 bf16 and 1.9-4.0 ms at 1024x1x1600 bf16,
0.9-9.9% of a codec's own time (``OMP_NUM_THREADS=1 python scripts/bench_codecs.py --device cpu --checksum
--backends torch --shapes 64x4x128 1024x1x1600 --ref-iters 15``); the GPU's cost is not measured."""



class PayloadChecksum:
    """The checksum's constant tensors (word weights, byte shifts), made once per device on first use.

    Each codec holds one (``Codec.payload_checksum``), so this module keeps no state, and the constants a
    captured CUDA graph reads stay alive with the codec that captured it."""

    def __init__(self):
        self._weights: dict[str, torch.Tensor] = {}
        self._shifts: dict[str, torch.Tensor] = {}

    def weights(self, device: torch.device) -> torch.Tensor:
        """1, 2, ..., CHUNK as int64 on ``device``."""
        key = str(device)
        if key not in self._weights:
            self._weights[key] = torch.arange(1, CHUNK + 1, dtype=torch.int64, device=device)
        return self._weights[key]

    def shifts(self, device: torch.device) -> torch.Tensor:
        """0, 8, 16, 24 as int64 on ``device``."""
        key = str(device)
        if key not in self._shifts:
            self._shifts[key] = torch.tensor([0, 8, 16, 24], dtype=torch.int64).to(device)
        return self._shifts[key]

    def value(self, payload: torch.Tensor) -> torch.Tensor:
        """The checksum of ``payload`` (1-D uint8, an even number of bytes): a 0-d int64 in [1, PRIME] on its device."""
        if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() % 2:
            raise ValueError(f"a payload is a 1-D uint8 tensor of an even length, got {payload.dtype} "
                             f"{tuple(payload.shape)}")
        n = payload.numel() // 2
        device = payload.device
        weights = self.weights(device)
        if n <= CHUNK:  # one row: the fewest ops (most messages of a small model)
            words = payload.view(torch.int16).to(torch.int64).bitwise_and_(0xFFFF)
            return words.mul_(weights[:n]).sum().remainder_(PRIME).add_(1)
        rows = -(-n // CHUNK)
        words = torch.empty(rows * CHUNK, dtype=torch.int64, device=device)
        words[n:].zero_()
        words[:n].copy_(payload.view(torch.int16)).bitwise_and_(0xFFFF)
        words = words.view(rows, CHUNK)
        plain = words.sum(1)  # < 2**31
        within = words.mul_(weights).sum(1)  # sum of (c + 1) * w over a row, < 2**46
        # Word r * CHUNK + c has weight r * CHUNK + c + 1: add r * CHUNK times the row's plain sum.
        starts = torch.arange(rows, dtype=torch.int64, device=device).mul_(CHUNK)
        total = starts.mul_(plain).add_(within).remainder_(PRIME)
        return total.sum().remainder_(PRIME).add_(1)

    def field(self, value: torch.Tensor) -> torch.Tensor:
        """A 0-d int64 checksum as the header's 4 little-endian bytes (uint8[4], same device)."""
        return (value >> self.shifts(value.device)).bitwise_and_(0xFF).to(torch.uint8)


def payload_checksum(payload: torch.Tensor) -> torch.Tensor:
    """``PayloadChecksum().value(payload)``: its constants made for this one call."""
    return PayloadChecksum().value(payload)


def checksum_bytes(value: torch.Tensor) -> torch.Tensor:
    """``PayloadChecksum().field(value)``: its constants made for this one call."""
    return PayloadChecksum().field(value)


class ChecksumField:
    """A codec's use of the checksum: written by the sender, compared by the decoder.

    Part of ``Codec``: reads its ``checksum`` switch, ``payload_checksum``, ``name`` and ``describe()``.
    """

    def write_checksum(self, buf: torch.Tensor) -> None:
        """Put the payload's checksum in ``buf``'s header (on the device, no sync); the field stays 0 when off."""
        if self.checksum:
            checksum = self.payload_checksum
            buf[CHECKSUM_OFFSET:HEADER_NBYTES].copy_(checksum.field(checksum.value(buf[HEADER_NBYTES:])))

    def checksum_mismatch(self, buf: torch.Tensor) -> torch.Tensor:
        """0-d bool on ``buf``'s device: its header's checksum field is not its payload's checksum (no sync)."""
        checksum = self.payload_checksum
        computed = checksum.field(checksum.value(buf[HEADER_NBYTES:]))
        return (buf[CHECKSUM_OFFSET:HEADER_NBYTES] != computed).any()

    def _check_checksum(self, found: int, computed: int | None) -> None:
        """Compare the header's checksum field with the payload's (None: this decoder has the checksum off)."""
        if computed is None:
            if found:
                raise WireFormatError(f"buffer carries a payload checksum ({found:08x}) but this decoder "
                                      f"({self.describe()}) has the checksum off; turn it on or off at both ends "
                                      "(--tah-wire-checksum)")
            return
        if not found:
            raise WireFormatError(f"buffer carries no payload checksum (its sender has the checksum off) but this "
                                  f"decoder ({self.describe()}) checks one; turn it on or off at both ends "
                                  "(--tah-wire-checksum)")
        if found != computed:
            raise PayloadChecksumError(
                f"{self.name}: corrupt payload: the header's checksum is {found:08x}, the payload's {computed:08x} "
                "(bytes changed on the way); refusing to decode it", codec=self.describe(), found=found,
                computed=computed)
