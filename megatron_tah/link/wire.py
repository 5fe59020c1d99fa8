"""A pipeline message on the wire: the codec buffer, then the trailer (its layout, its step), and its timing.

Every message of one transport call is one uint8 buffer per direction::

    message = codec buffer                       (every direction fixed: Megatron's own pattern)
    message = codec buffer || trailer            (either direction auto: every message, both directions,
                                                  warm-up and evaluations included)

The codec buffer is ``codec.encode``'s: a 16-byte header (magic, wire version, codec id, config digest,
shape digest, payload checksum) and the codec's sections (``codecs/core/base.py``). Its length
``codec.wire_nbytes(shape, dtype)`` depends only on the shape, dtype and codec settings, so a receiver
posts ``wire_nbytes + message_extra_nbytes(auto)`` bytes before anything arrives.

The trailer, ``TRAILER_NBYTES`` (24) bytes, little endian::

    0    8   announcement: the codec the *next* iteration uses on this direction (below);
             8 zero bytes on a fixed direction
    8    8   sent at: the sender's wall clock when it posted the message, int64 microseconds
             (written in place just before posting, ``stamp_sent_at``)
    16   4   report, bytes: wire bytes of one message the *receiver of this one* sent to its sender
             (the other direction), 0 when there is nothing to report
    20   4   report, microseconds: that message's transit (uint32, saturating; never 0 with a report)

The announcement, ``ANNOUNCEMENT_NBYTES`` (8) bytes, little endian (``encode_announcement``)::

    0    1   magic 0xA7
    1    1   codec id
    2    4   config digest
    6    2   effective-from iteration mod 2**16

The codec buffer's own header is still checked on every decode, so a buffer of another codec than
the announced one is a ``WireFormatError``, never a misread. What the fields are for (the lockstep
switch, the transit reports) is the auto protocol's (``auto.py``).

The trailer step (:class:`TrailerStep`, a link end's ``steps.Step``) fills and reads the trailer. It is on when
either direction is auto, or with the inbound wire's emulation, which reads its send stamp (``Message.stamp``
writes it just before the message is posted; ``emulate.EmulationStep`` reads it). It fills the rest on a send
end and, when a direction is auto (``measure``), reads it on a receive end:

* a send appends the trailer: the announcement of the next iteration's codec (an auto direction's sender,
  ``AutoEnd.sent``) and the report the link end holds for its peer (``Link.report``), then empty;
* a complete receive hands its announcement to its auto receiver (a fixed direction refuses one), keeps its
  transit as the report for the peer when it is the fastest since the last report (on this rank's send end
  of the other direction to that peer) and feeds the peer's report, less the link's latency
  (``handshake.link_latency``), to that send end's rate meter.

The layout above, the announcement (``auto.py``) and this step change together if the trailer changes.

When a transfer is complete, and how long it took, whatever the backend. A NCCL ``Work``'s ``wait()`` returns
once its kernel is queued (it only makes the current stream wait for the NCCL stream), so a host clock read
around it times the launch; and a later host read of the received data waits for everything queued before it
on the current stream too (the receiver's compute). A gloo ``Work``'s ``wait()`` returns when the transfer is
done (and a gloo receive reads as complete only once waited for). Two ways to the transfer's own time on both:

* ``wait_completed(work, wait)`` waits through ``wait`` (the caller's bounded wait, ``peer.PeerWatch``; gloo:
  the transfer is done; it raises the work's error, if any), then polls ``is_completed()`` (NCCL: the work's
  end event on the device) until it is: a host clock read right after it is the completion time, to within
  one poll.
* ``time_works(group)`` turns on a NCCL group's own timing of its works
  (``ProcessGroup._enable_collectives_timing``: a CUDA event before and after each kernel on the NCCL
  stream; it applies to works posted afterwards); ``work_seconds(work)`` reads a complete timed work's
  duration (``Work._get_duration()``, milliseconds). Other backends keep their works untimed
  (``time_works`` is False): their transfers are timed on the host.
"""

from __future__ import annotations

import dataclasses
import struct
import time
from typing import Callable, Mapping

import torch

from ..codecs import WireFormatError
from .measure import MIN_SECONDS
from .steps import Outgoing, Step

__all__ = ["ANNOUNCEMENT_MAGIC", "ANNOUNCEMENT_NBYTES", "TRAILER_NBYTES", "AutoDecision", "Trailer",
           "append_trailer", "codec_buffer", "decode_announcement", "decode_trailer", "encode_announcement",
           "encode_trailer", "message_extra_nbytes", "read_trailer", "stamp_sent_at", "time_works", "TrailerStep",
           "wait_completed", "wall_seconds", "work_seconds"]

ANNOUNCEMENT_MAGIC = 0xA7
ANNOUNCEMENT_NBYTES = 8
TRAILER_NBYTES = 24
_TRAILER = struct.Struct("<8sqII")  # announcement, sent at (us), report bytes, report us
_NO_ANNOUNCEMENT = bytes(ANNOUNCEMENT_NBYTES)
_US_MAX = 2**32 - 1
_SENT_AT = slice(-TRAILER_NBYTES + ANNOUNCEMENT_NBYTES, -TRAILER_NBYTES + ANNOUNCEMENT_NBYTES + 8)


def wall_seconds(monotonic: float | None = None) -> float:
    """The wall clock (seconds since the epoch) now, or at the ``time.monotonic()`` reading ``monotonic``."""
    now = time.time()
    return now if monotonic is None else now - (time.monotonic() - monotonic)


# ----- the announcement ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AutoDecision:
    """The codec a link direction uses from iteration ``effective_from`` on."""

    name: str
    codec_id: int
    config_digest: int
    effective_from: int


def encode_announcement(decision: AutoDecision) -> bytes:
    """``decision`` as ``ANNOUNCEMENT_NBYTES`` bytes (layout in the module docstring)."""
    if not 0 <= decision.codec_id < 256 or not 0 <= decision.config_digest < 2**32 or decision.effective_from < 0:
        raise ValueError(f"cannot encode {decision}")
    return (bytes([ANNOUNCEMENT_MAGIC, decision.codec_id]) + decision.config_digest.to_bytes(4, "little")
            + (decision.effective_from % 2**16).to_bytes(2, "little"))


def decode_announcement(raw: bytes | torch.Tensor, candidates: Mapping[str, object],
                        effective_from: int) -> AutoDecision:
    """The decision in ``raw``, which must name one of ``candidates`` (codecs, or costs with ``codec_id`` and
    ``config_digest``) and iteration ``effective_from`` (what the receiver expects: its current iteration + 1);
    ``WireFormatError`` otherwise."""
    if isinstance(raw, torch.Tensor):
        raw = bytes(raw.detach().to("cpu", torch.uint8).tolist())
    raw = bytes(raw)
    if len(raw) != ANNOUNCEMENT_NBYTES or raw[0] != ANNOUNCEMENT_MAGIC:
        raise WireFormatError(f"not an auto-codec announcement ({len(raw)} bytes, starting {raw[:1]!r})")
    codec_id, digest = raw[1], int.from_bytes(raw[2:6], "little")
    iteration = int.from_bytes(raw[6:8], "little")
    if iteration != effective_from % 2**16:
        raise WireFormatError(f"announcement for iteration {iteration} (mod 2**16), "
                              f"expected {effective_from % 2**16}: the ends are out of step")
    for name, item in candidates.items():
        item_digest = item.config_digest() if callable(item.config_digest) else item.config_digest
        if (item.codec_id, item_digest) == (codec_id, digest):
            return AutoDecision(name, codec_id, digest, effective_from)
    raise WireFormatError(f"announced codec id {codec_id} with config digest {digest:08x} is none of this "
                          f"receiver's candidates ({', '.join(candidates)})")


# ----- the trailer ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Trailer:
    """A message's trailer (layout in the module docstring); ``report``: (bytes, seconds) or None."""

    announcement: bytes | None
    sent_at: float
    report: tuple[int, float] | None = None


def encode_trailer(trailer: Trailer) -> bytes:
    """``trailer`` as ``TRAILER_NBYTES`` bytes."""
    announcement = _NO_ANNOUNCEMENT if trailer.announcement is None else trailer.announcement
    if len(announcement) != ANNOUNCEMENT_NBYTES or announcement == _NO_ANNOUNCEMENT and trailer.announcement:
        raise ValueError(f"announcement of {len(announcement)} bytes: expected {ANNOUNCEMENT_NBYTES}, not all zero")
    nbytes, seconds = trailer.report or (0, 0.0)
    if not 0 <= nbytes < 2**32 or not seconds >= 0:
        raise ValueError(f"report ({nbytes} bytes, {seconds} s): need 0 <= bytes < 2**32 and seconds >= 0")
    micros = min(max(round(seconds * 1e6), 1), _US_MAX) if nbytes else 0  # a report is never 0 us
    return _TRAILER.pack(announcement, round(trailer.sent_at * 1e6), int(nbytes), micros)


def decode_trailer(raw: bytes) -> Trailer:
    """The trailer in ``raw`` (``TRAILER_NBYTES`` bytes); ``WireFormatError`` if it is not one."""
    if len(raw) != TRAILER_NBYTES:
        raise WireFormatError(f"auto codec: a trailer of {len(raw)} bytes, expected {TRAILER_NBYTES}")
    announcement, sent_us, nbytes, micros = _TRAILER.unpack(bytes(raw))
    if sent_us <= 0 or (nbytes == 0) != (micros == 0):
        raise WireFormatError(f"auto codec: not a message trailer (sent at {sent_us} us, report {nbytes} bytes "
                              f"in {micros} us)")
    report = (nbytes, micros / 1e6) if nbytes else None
    return Trailer(None if announcement == _NO_ANNOUNCEMENT else announcement, sent_us / 1e6, report)


# ----- the message ----------------------------------------------------------------------------------
def message_extra_nbytes(auto: bool) -> int:
    """Bytes a message carries after its codec buffer: the trailer when either direction is auto, else 0."""
    return TRAILER_NBYTES if auto else 0


def append_trailer(buf: torch.Tensor, trailer: Trailer) -> torch.Tensor:
    """The message ``buf || trailer`` (a new uint8 tensor on ``buf``'s device)."""
    raw = encode_trailer(trailer)
    return torch.cat([buf, torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(buf.device)])


def stamp_sent_at(message: torch.Tensor) -> None:
    """Write the wall clock now into the ``sent at`` field of ``message`` (a uint8 message ending in a trailer),
    in place, just before it is posted (a host write on the CPU, an 8-byte copy on a GPU)."""
    now = torch.tensor([round(wall_seconds() * 1e6)], dtype=torch.int64).view(torch.uint8)  # little endian host
    message[_SENT_AT].copy_(now)


def read_trailer(message: torch.Tensor) -> bytes:
    """The trailer's bytes of a received ``message``, read on the host (on a GPU the read waits for the data)."""
    return message[-TRAILER_NBYTES:].cpu().numpy().tobytes()


def codec_buffer(message: torch.Tensor, extra_nbytes: int) -> torch.Tensor:
    """The codec buffer of ``message`` (a view: the message less its ``extra_nbytes`` trailing bytes)."""
    return message[:-extra_nbytes] if extra_nbytes else message


# ----- completion ------------------------------------------------------------------------------------
def wait_completed(work, wait) -> None:
    """Return once ``work``'s transfer is complete, whatever the backend: ``wait(work)`` (gloo; the caller's
    bounded wait of ``work.wait()``), then ``is_completed()`` polled (NCCL); raises what ``wait`` raises."""
    wait(work)
    while not work.is_completed():
        time.sleep(0)  # (lets other Python threads run; the poll itself is a CUDA event query on NCCL)


def time_works(group) -> bool:
    """Whether the works posted on ``group`` from now on time themselves: True on a NCCL group (its timing
    is turned on here; idempotent), False elsewhere."""
    if torch.distributed.get_backend(group) != "nccl":
        return False
    enable = getattr(group, "_enable_collectives_timing", None)
    if enable is None:  # (a torch without it: the host's timing stands)
        return False
    enable()
    return True


def work_seconds(work) -> float | None:
    """The seconds a complete work posted with ``time_works`` took on the device (its kernel's start to
    its end on the NCCL stream), None where the backend did not time it."""
    try:
        milliseconds = float(work._get_duration())
    except (AttributeError, RuntimeError):  # untimed, or a backend without durations (gloo)
        return None
    return milliseconds / 1e3 if milliseconds > 0 else None


# ----- the trailer step --------------------------------------------------------------------------------
class TrailerStep(Step):
    """The trailer of one link end (``link``: a ``link.Link``). ``measure``: a direction is auto, so receives
    are measured and reported; ``reply()``: this rank's send end of the other direction to the same peer (where
    a receive's report goes); ``latency``: one-way latency to each neighbour (world rank: seconds), shared with
    the transport, which measures it at the handshake."""

    def __init__(self, link, *, measure: bool, reply: Callable[[], object], latency: dict[int, float]):
        self.link, self.measure, self.latency = link, measure, latency
        self._reply, self._reply_end = reply, None  # (looked up once: a link end, once made, stays)

    def on_send(self, out: Outgoing) -> None:
        """``out.buf`` || the trailer of a message sent on this link end now."""
        link = self.link
        announcement = link.auto.sent(out.encode_seconds) if link.auto is not None else None
        report, link.report = link.report, None
        out.buf = append_trailer(out.buf, Trailer(announcement, wall_seconds(), report))

    def on_arrival(self, m, done_at: float | None, emulated: bool) -> None:
        """A complete receive: on NCCL (``m.timed``) the receive's own time on the device bounds its transit
        too, unless the link is emulated (its time is the emulator's)."""
        if self.measure:
            seconds = work_seconds(m.work) if m.timed and not emulated else None
            self.received(m.trailer, m.buf.numel(), done_at, seconds)

    def received(self, raw: bytes, nbytes: int, done_at: float, seconds: float | None = None) -> None:
        """The trailer ``raw`` of a message of ``nbytes`` received on this link end, complete at wall time
        ``done_at``. The transit is ``done_at`` less the sent-at stamp or, when the backend timed the receive on
        the device (``seconds``: NCCL), the smaller of the two: both bound the link's time from above, and on
        NCCL ``done_at`` is a host read that waited for the receiver's queued compute too."""
        link, trailer = self.link, decode_trailer(raw)
        if link.auto is not None:
            link.auto.received(trailer.announcement)
        elif trailer.announcement is not None:
            raise WireFormatError(f"auto codec: a {link.direction} message from rank {link.peer} announces a codec, "
                                  f"but this rank's {link.direction} codec is fixed")
        if self._reply_end is None:
            self._reply_end = self._reply()
        reply = self._reply_end
        transit = done_at - trailer.sent_at if seconds is None else min(seconds, done_at - trailer.sent_at)
        transit = max(transit, MIN_SECONDS)
        if reply.report is None or nbytes * reply.report[1] > reply.report[0] * transit:  # a faster transfer
            reply.report = (nbytes, transit)
        if trailer.report is not None and reply.auto is not None:
            nbytes, seconds = trailer.report  # the transfer's own time: the latency every message pays apart
            reply.auto.meter.record(nbytes, max(seconds - self.latency.get(link.peer, 0.0), MIN_SECONDS))
