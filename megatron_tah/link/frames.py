"""Entropy-coded pipeline messages of a size both ends agree on before the message exists.

With ``--tah-entropy-coding`` each pipeline message carries its codec buffer through the lossless coder
(``codecs/entropy.py``), whose output varies in size from message to message. torch.distributed's sends and
receives have sizes fixed in advance, so both ends of a link size message ``k`` the same way from what they
both already know, the coded sizes of the messages before it on that link (``FrameSizes``): the largest of
the last ``WINDOW``, plus ``MARGIN``, rounded up to ``ROUND`` bytes; the first message of a codec and shape
is sized for the most the coder can give (``entropy.capacity_nbytes``). A frame, little endian::

    0   4   n: the coded buffer's length in bytes
    4   n   the coded buffer (entropy.py's format), then zero bytes to the frame's agreed size

A coded buffer longer than its frame holds (an overflow) fills the frame, and its remaining
``n + 4 - size`` bytes follow as a second message on the same link, which the receiver posts once the
frame has told it ``n``. Both ends then record ``n + 4``, so the next size is the same on both.

Both ends must see a link's messages in turn: a receive is sized once the one before it on that link has
been read. Megatron's 1F1B schedules do, batched and unbatched, and the interleaved one with
``--overlap-p2p-communication``; but an overflow's second message has been seen missing (a hang) under CPU load,
cause not found, and tests/test_entropy_pipeline.py's multi-process test is skipped until it is. A receive posted
earlier is refused.

:class:`FramingStep` is the link end's step (``steps.py``): it codes and frames each codec buffer it sends,
sizes each receive, reads the frame's length once the receive is complete (the transport receives the
overflow next) and decodes the coded buffer back to the codec's.
"""

from __future__ import annotations

import collections
import math
import struct

import torch

from ..codecs import WireFormatError, entropy
from ..codecs.graphs import eager
from .steps import Outgoing, Step

__all__ = ["FRAME_HEADER_NBYTES", "MARGIN", "ROUND", "WINDOW", "FrameSizes", "FramingStep", "coded_length", "frame",
           "unframe"]

FRAME_HEADER_NBYTES = 4
WINDOW = 8  # messages of a link whose largest coded size sizes the next
MARGIN = 0.02  # share added to it: an overflow costs a second message, the margin only bytes
ROUND = 64  # bytes the agreed size is rounded up to
_LENGTH = struct.Struct("<I")


class FrameSizes:
    """The agreed frame sizes of one link end, per message key (codec config and shape): both ends of a
    link hold one each and record the same sizes in the same order."""

    def __init__(self):
        self.recent: dict[tuple, collections.deque[int]] = {}

    def size(self, key: tuple, capacity: int) -> int:
        """The frame size of the next message of ``key``, at most ``capacity`` (the coder's most plus the header)."""
        recent = self.recent.get(key)
        if not recent:
            return capacity
        return min(capacity, math.ceil(max(recent) * (1 + MARGIN) / ROUND) * ROUND)

    def record(self, key: tuple, used: int) -> None:
        """A message of ``key`` used ``used`` bytes (header included)."""
        self.recent.setdefault(key, collections.deque(maxlen=WINDOW)).append(int(used))


def frame(coded: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``coded`` in a frame of ``size`` bytes, and the bytes that did not fit (None: none)."""
    n = coded.numel()
    out = torch.zeros(size, dtype=torch.uint8, device=coded.device)
    out[:FRAME_HEADER_NBYTES] = torch.tensor(list(_LENGTH.pack(n)), dtype=torch.uint8)
    fits = min(n, size - FRAME_HEADER_NBYTES)
    out[FRAME_HEADER_NBYTES : FRAME_HEADER_NBYTES + fits] = coded[:fits]
    return out, (coded[fits:].clone() if fits < n else None)


def coded_length(message: torch.Tensor, capacity: int) -> int:
    """The coded length ``n`` a frame announces; ``WireFormatError`` if it exceeds the most the coder gives."""
    n = _LENGTH.unpack(bytes(message[:FRAME_HEADER_NBYTES].cpu().tolist()))[0]
    if n + FRAME_HEADER_NBYTES > capacity:
        raise WireFormatError(f"entropy-coded frame announces {n} bytes, more than the coder's most "
                              f"({capacity - FRAME_HEADER_NBYTES})")
    return n


def unframe(message: torch.Tensor, n: int, rest: torch.Tensor | None) -> torch.Tensor:
    """The coded buffer of a frame (``message``, its trailer excluded) whose length is ``n``, with ``rest``
    when it overflowed."""
    body = message[FRAME_HEADER_NBYTES : FRAME_HEADER_NBYTES + n]
    if rest is None:
        if body.numel() != n:
            raise WireFormatError(f"entropy-coded frame of {message.numel()} bytes announces {n}, and nothing follows")
        return body
    if body.numel() + rest.numel() != n:
        raise WireFormatError(f"entropy-coded frame: {body.numel()} + {rest.numel()} bytes, announced {n}")
    return torch.cat([body, rest.to(body.device)])


class FramingStep(Step):
    """``--tah-entropy-coding`` on one link end (``direction``, ``peer``: for errors): its agreed frame sizes and,
    on a receive end, the receive posted and not yet read (its coded size sizes the next one)."""

    def __init__(self, direction: str, peer: int):
        self.direction, self.peer = direction, peer
        self.sizes = FrameSizes()
        self.pending: tuple[tuple, int] | None = None  # receive end: (key, capacity) of the posted receive
        self.coded_nbytes: int | None = None  # ... and the coded length its frame announced, once read

    def _frame(self, codec, shape, dtype) -> tuple[tuple, int, int]:
        """(key, capacity, agreed size) of the next message through ``codec``."""
        plain = eager(codec)
        key = (plain.name, plain.config_digest(), tuple(shape), dtype)
        capacity = entropy.capacity_nbytes(plain, shape, dtype) + FRAME_HEADER_NBYTES
        return key, capacity, self.sizes.size(key, capacity)

    def on_send(self, out: Outgoing) -> None:
        key, _, size = self._frame(out.codec, out.shape, out.dtype)
        coded = entropy.encode(eager(out.codec), out.buf, out.shape, out.dtype)
        out.buf, out.rest = frame(coded, size)
        self.sizes.record(key, coded.numel() + FRAME_HEADER_NBYTES)

    def post_nbytes(self, codec, shape, dtype, nbytes: int) -> int:
        """The agreed frame size; refused while the previous receive has not been read."""
        if self.pending is not None:
            raise RuntimeError(
                f"megatron_tah: --tah-entropy-coding sizes each message from the ones before it on its link, but a "
                f"{self.direction} receive from rank {self.peer} was posted before the previous one had been read: "
                "this schedule posts receives ahead; turn the entropy coding off")
        key, capacity, size = self._frame(codec, shape, dtype)
        self.pending = (key, capacity)
        return size

    def follow_nbytes(self, m) -> int:
        """The overflow's bytes: the frame's coded length less what the frame holds."""
        body = m.buf[: m.buf.numel() - m.extra_nbytes]
        self.coded_nbytes = coded_length(body, self.pending[1])
        return max(0, self.coded_nbytes + FRAME_HEADER_NBYTES - body.numel())

    def check_unbatched(self, received_from: list[int], gloo: bool) -> None:
        if not gloo and len(received_from) != len(set(received_from)):
            raise RuntimeError("megatron_tah: --tah-entropy-coding on unbatched transfers receives two messages from "
                               "one stage in one call here, whose overflows only gloo tells apart: use Megatron's "
                               "batched transfers (--no-overlap-p2p-communication) or turn the entropy coding off")

    def on_receive(self, m, buf: torch.Tensor) -> torch.Tensor:
        """The codec's buffer, decoded from the frame ``buf`` and the overflow ``m.rest``."""
        coded = unframe(buf, self.coded_nbytes, m.rest)
        decoded = entropy.decode(eager(m.codec), coded, m.target.shape, m.target.dtype)
        self.sizes.record(self.pending[0], self.coded_nbytes + FRAME_HEADER_NBYTES)
        self.pending = self.coded_nbytes = None
        return decoded
