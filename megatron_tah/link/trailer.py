"""The trailer step: what a link end writes into, and reads from, the trailer after every message.

The trailer (``wire.py``: 24 bytes after the codec buffer or frame) is on when either direction is auto, or
with the inbound wire's emulation, which reads its send stamp (``Message.stamp`` writes it just before the
message is posted; ``emulate.EmulationStep`` reads it). :class:`TrailerStep` fills the rest on a send end
and, when a direction is auto (``measure``), reads it on a receive end (the protocol: ``auto.py``):

* a send appends the trailer: the announcement of the next iteration's codec (an auto direction's sender,
  ``AutoEnd.sent``) and the report the link end holds for its peer (``Link.report``), then empty;
* a complete receive hands its announcement to its auto receiver (a fixed direction refuses one), keeps its
  transit as the report for the peer when it is the fastest since the last report (on this rank's send end
  of the other direction to that peer) and feeds the peer's report, less the link's latency
  (``handshake.link_latency``), to that send end's rate meter.

The trailer's layout (``wire.py``), the announcement (``auto.py``) and this step are the three places to
change together if the trailer changes.
"""

from __future__ import annotations

from typing import Callable

from ..codecs import WireFormatError
from .completion import work_seconds
from .measure import MIN_SECONDS
from .steps import Outgoing, Step
from .wire import Trailer, append_trailer, decode_trailer, wall_seconds

__all__ = ["TrailerStep"]


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
            self.received(m.trailer(), m.buf.numel(), done_at, seconds)

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
