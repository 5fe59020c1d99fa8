"""Entropy-coded pipeline messages: one transfer per message where the backend allows it, else agreed frames.

With ``--tah-entropy-coding`` each pipeline message carries its codec buffer through the lossless coder
(``codecs/core/entropy.py``), whose output varies in size from message to message. A message, little endian::

    0   4   n: the coded buffer's length in bytes
    4   n   the coded buffer (entropy.py's format)
            (framed only: zero bytes to the frame's agreed size)
            then the trailer, when on (``wire.py``)

* **Exact** (gloo: a receive may be larger than the send that fills it; gloo writes the message at its start
  and leaves the rest): the receiver posts the most a message can be, the coder's most plus the 4 length bytes
  (``entropy.capacity_nbytes`` + 4), plus the trailer; the sender sends exactly ``4 + n`` bytes (plus the
  trailer). The length ``n`` tells the receiver where the message ends. One transfer per message, nothing
  follows it, no size agreement: receives may be posted in any order.
* **Framed** (NCCL, whose receive must be the send's size): both ends size message ``k`` of a link alike from
  the coded sizes of the messages before it (``FrameSizes``): the largest of the last ``WINDOW``, plus
  ``MARGIN``, rounded up to ``ROUND`` bytes; the first message of a codec and shape is sized for the coder's
  most. A coded buffer longer than its frame fills it, and its remaining ``n + 4 - size`` bytes follow as a
  second message in one more batch of the same batched call, once the frames are complete (activations first,
  on both ends). Only on batched transfers: an unbatched call is refused (the interleaved schedule's overlapped
  transfers keep receives from one stage open across calls, which NCCL, ignoring tags, could match to another
  message's overflow). A receive posted before the link's previous one was read is refused too (its size
  depends on it).

Whether a message is coded at all is the sender's (``CodingRule``): with a known link rate (``--tah-link-rate``,
else ``--tah-emulate-bandwidth``) it times its coder on a link's message and compares that with the wire time the
coded bytes save; ``--tah-entropy-when auto`` sends the messages where coding does not pay with every section raw
(``entropy.encode(..., "raw")``: the receiver reads them like any other), ``always`` codes them and warns once.

:class:`FramingStep` is the link end's step (``steps.py``): it codes each codec buffer it sends (exact or in
its agreed frame), sizes each receive, reads a complete receive's length (its message's end; a framed one's
overflow) and decodes the coded buffer back to the codec's.
"""

from __future__ import annotations

import collections
import math
import struct
import time
import warnings
from typing import Callable

import torch

from ..codecs import WireFormatError
from ..codecs.core import entropy
from ..codecs.core.graphs import eager
from .steps import Outgoing, Step

__all__ = ["FRAME_HEADER_NBYTES", "MARGIN", "PROBE_EVERY", "ROUND", "WINDOW", "CodingRule", "FrameSizes", "FramingStep",
           "coded_length", "frame", "unframe"]

FRAME_HEADER_NBYTES = 4
WINDOW = 8  # messages of a link whose largest coded size sizes the next (framed)
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


def frame(coded: torch.Tensor, size: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``coded`` behind its length, in ``size`` bytes (None: exactly ``4 + n``), and the bytes that did not fit
    (None: none)."""
    n = coded.numel()
    size = n + FRAME_HEADER_NBYTES if size is None else size
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


PROBE_EVERY = 64  # messages of a link (per codec and shape) between two timings of its coder (auto)


class CodingRule:
    """Whether coding a link end's messages saves time at the link's rate ``rate_bps``: the coder's encode and
    decode of a message (timed here, on the sender: its decode stands in for the receiver's) against the wire time
    its saved bytes take, ``8 * (raw - coded) / rate_bps``. ``auto``: messages between two timings (every
    ``PROBE_EVERY`` of a codec and shape) are coded only where the last timing paid, otherwise sent as they are
    (every section raw, which any receiver reads); otherwise every message is coded and a timing that does not pay
    is one warning per codec and shape with its numbers. ``rate``: the link's rate in bit/s, or a function giving
    it at each timing (an ``auto`` link end's measured rate); None (or a function giving None): no judging, every
    message coded."""

    def __init__(self, coder: str, rate: float | Callable[[], float | None] | None, auto: bool, what: str,
                 every: int = PROBE_EVERY):
        self.coder, self.rate, self.auto, self.what, self.every = coder, rate, auto, what, every
        self.state: dict[tuple, list] = {}  # key -> [pays, messages since its timing]
        self.last: dict | None = None  # the last timing's numbers

    @property
    def rate_bps(self) -> float | None:
        """The link's rate now (bit/s), None: not known."""
        return self.rate() if callable(self.rate) else self.rate

    def encode(self, codec, buf: torch.Tensor, shape, dtype, key: tuple) -> torch.Tensor:
        """``buf`` coded as the rule says for a message of ``key``."""
        rate_bps = self.rate_bps
        if rate_bps is None:
            return entropy.encode(codec, buf, shape, dtype, self.coder)
        state = self.state.get(key)
        if state is not None and (state[1] < self.every or not self.auto):
            state[1] += 1
            return entropy.encode(codec, buf, shape, dtype, self.coder if state[0] else "raw")
        start = time.perf_counter()
        coded = entropy.encode(codec, buf, shape, dtype, self.coder)
        middle = time.perf_counter()
        entropy.decode(codec, coded, shape, dtype, self.coder)
        uncoded = entropy.capacity_nbytes(codec, shape, dtype)  # the message with every section raw
        numbers = self.judge(uncoded, coded.numel(), middle - start, time.perf_counter() - middle, rate_bps)
        self.state[key] = [numbers["pays"], 1]
        if not numbers["pays"]:
            if not self.auto and state is None:
                warnings.warn(f"megatron_tah: --tah-entropy-coding on the {self.what} does not pay: "
                              f"{self.describe(numbers)}; --tah-entropy-when auto sends such messages uncoded",
                              stacklevel=2)
            if self.auto:
                return entropy.encode(codec, buf, shape, dtype, "raw")
        return coded

    def judge(self, raw_nbytes: int, coded_nbytes: int, encode_s: float, decode_s: float,
              rate_bps: float | None = None) -> dict:
        """The numbers of one timing (``raw_nbytes``: the message uncoded, ``coded_nbytes``: coded) at ``rate_bps``
        (default: the link's now) and whether coding pays."""
        rate_bps = self.rate_bps if rate_bps is None else rate_bps
        saved_s = 8.0 * (raw_nbytes - coded_nbytes) / rate_bps
        self.last = {"raw": raw_nbytes, "coded": coded_nbytes, "encode_s": encode_s, "decode_s": decode_s,
                     "saved_s": saved_s, "rate_bps": rate_bps, "pays": saved_s > encode_s + decode_s}
        return self.last

    def describe(self, n: dict) -> str:
        return (f"it saves {n['raw'] - n['coded']:,} of {n['raw']:,} bytes per message, "
                f"{1e3 * n['saved_s']:.2f} ms at {n['rate_bps'] / 1e6:.4g} Mbit/s, and costs "
                f"{1e3 * (n['encode_s'] + n['decode_s']):.2f} ms to encode and decode "
                f"({1e3 * n['encode_s']:.2f} + {1e3 * n['decode_s']:.2f} ms, {self.coder})")


class FramingStep(Step):
    """``--tah-entropy-coding`` on one link end (``direction``, ``peer``: for errors; ``coder``: ``entropy.CODERS``,
    both ends the same, checked by the handshake): framed, its agreed frame
    sizes and, on a receive end, the receive posted and not yet read (its coded size sizes the next one). An
    exact receive keeps nothing here: its length is its message's (``m.nbytes``)."""

    def __init__(self, direction: str, peer: int, coder: str = entropy.DEFAULT_CODER,
                 rate: float | Callable[[], float | None] | None = None, auto: bool = False):
        self.direction, self.peer, self.coder = direction, peer, coder
        self.rule = CodingRule(coder, rate, auto, f"{direction} link with rank {peer}")
        self.sizes = FrameSizes()
        self.pending: tuple[tuple, int] | None = None  # framed receive end: (key, capacity) of the posted receive
        self.coded_nbytes: int | None = None  # ... and the coded length its frame announced, once read

    def _frame(self, codec, shape, dtype) -> tuple[tuple, int, int]:
        """(key, capacity, agreed size) of the next message through ``codec``."""
        plain = eager(codec)
        key = (plain.name, plain.config_digest(), tuple(shape), dtype)
        capacity = entropy.capacity_nbytes(plain, shape, dtype) + FRAME_HEADER_NBYTES
        return key, capacity, self.sizes.size(key, capacity)

    def on_send(self, out: Outgoing) -> None:
        key, _, size = self._frame(out.codec, out.shape, out.dtype)
        coded = self.rule.encode(eager(out.codec), out.buf, out.shape, out.dtype, key)
        if out.exact:
            out.buf, out.rest = frame(coded)
            return
        out.buf, out.rest = frame(coded, size)
        self.sizes.record(key, coded.numel() + FRAME_HEADER_NBYTES)

    def post_nbytes(self, codec, shape, dtype, nbytes: int, exact: bool = False) -> int:
        """Exact: the coder's most plus the length; framed: the agreed frame size, refused while the previous
        receive has not been read."""
        key, capacity, size = self._frame(codec, shape, dtype)
        if exact:
            return capacity
        if self.pending is not None:
            raise RuntimeError(
                f"megatron_tah: --tah-entropy-coding sizes each message from the ones before it on its link, but a "
                f"{self.direction} receive from rank {self.peer} was posted before the previous one had been read: "
                "this schedule posts receives ahead; turn the entropy coding off")
        self.pending = (key, capacity)
        return size

    def received_nbytes(self, m, nbytes: int) -> int:
        """An exact receive's message: ``4 + n`` of its ``nbytes`` (the trailer's bytes apart); framed: all."""
        return coded_length(m.buf, nbytes) + FRAME_HEADER_NBYTES if m.exact else nbytes

    def follow_nbytes(self, m) -> int:
        """A framed receive's overflow: the frame's coded length less what the frame holds (exact: none)."""
        if m.exact:
            return 0
        body = m.buf[: m.buf.numel() - m.extra_nbytes]
        self.coded_nbytes = coded_length(body, self.pending[1])
        return max(0, self.coded_nbytes + FRAME_HEADER_NBYTES - body.numel())

    def check_unbatched(self, received_from: list[int], exact: bool) -> None:
        if not exact:
            raise RuntimeError("megatron_tah: --tah-entropy-coding on unbatched transfers needs a backend that takes "
                               "a message shorter than its receive (gloo); on this one a message may need a second "
                               "one, which only a batched call keeps in step: use Megatron's batched transfers "
                               "(--no-overlap-p2p-communication) or turn the entropy coding off")

    def on_receive(self, m, buf: torch.Tensor) -> torch.Tensor:
        """The codec's buffer, decoded from the message ``buf`` (less its trailer) and, framed, the overflow
        ``m.rest``."""
        if m.exact:
            coded = unframe(buf, buf.numel() - FRAME_HEADER_NBYTES, None)
            return entropy.decode(eager(m.codec), coded, m.target.shape, m.target.dtype, self.coder)
        coded = unframe(buf, self.coded_nbytes, m.rest)
        decoded = entropy.decode(eager(m.codec), coded, m.target.shape, m.target.dtype, self.coder)
        self.sizes.record(self.pending[0], self.coded_nbytes + FRAME_HEADER_NBYTES)
        self.pending = self.coded_nbytes = None
        return decoded
