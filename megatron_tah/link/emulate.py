"""In-process slow-link emulation for the compressing transports.

``emulation(config)`` is a process's emulated link (``--tah-emulate-bandwidth``): a ``LinkEmulator``, or with
``--tah-emulate-wire inbound`` an ``InboundWire``, shared by the process's link ends; each link end's messages
cross it through its last step, an ``EmulationStep`` (``steps.py``), which delays each message's completion
until the emulated link has carried it.

Model: every directed link ``(src, dst)`` is a serial pipe of ``bandwidth_bps`` bits/s
with a one-way ``latency_s``. A message whose real transfer completed at time ``t``
(the moment both ends had posted it, on the fast real link) starts on the emulated
link at ``start = max(t, link_free)``, occupies it for ``nbytes * 8 / bandwidth``
seconds (``link_free = end``), and is complete for the sender at ``end`` and for
the receiver at ``end + latency``. ``complete`` sleeps until that moment, so
compute done between posting and waiting overlaps with the emulated transfer, as
on a real link. Both ends of a link apply the model independently (each process
has its own emulator), from the same completion time.
"""

from __future__ import annotations

import threading
import time

import torch

from .steps import Step
from .wire import decode_trailer, wall_seconds

__all__ = ["EmulationStep", "InboundWire", "LinkEmulator", "emulation"]


class LinkEmulator:
    def __init__(self, bandwidth_bps: float, latency_s: float = 0.0, clock=time.monotonic, sleep=time.sleep):
        if not bandwidth_bps > 0:
            raise ValueError(f"bandwidth_bps must be > 0, got {bandwidth_bps!r}")
        if latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {latency_s!r}")
        self.bandwidth_bps = float(bandwidth_bps)
        self.latency_s = float(latency_s)
        self.clock = clock
        self.sleep = sleep
        self._link_free: dict[tuple[int, int], float] = {}
        self._lock = threading.Lock()
        self.total_delay_s = 0.0  # time spent sleeping in ``complete``
        self.last_finish = None  # when the last message ``complete`` saw finished on the emulated link

    def transfer_seconds(self, nbytes: int) -> float:
        return nbytes * 8.0 / self.bandwidth_bps

    def finish_time(self, link: tuple[int, int], nbytes: int, completed_at: float, receiver: bool) -> float:
        """When the message is complete on the emulated link; reserves the link for its transfer."""
        with self._lock:
            start = max(completed_at, self._link_free.get(link, completed_at))
            end = start + self.transfer_seconds(nbytes)
            self._link_free[link] = end
        return end + (self.latency_s if receiver else 0.0)

    def complete(self, link: tuple[int, int], nbytes: int, completed_at: float | None = None,
                 receiver: bool = False) -> float:
        """Block until the message of ``nbytes`` on ``link`` is complete; returns the seconds slept."""
        completed_at = self.clock() if completed_at is None else completed_at
        self.last_finish = self.finish_time(link, nbytes, completed_at, receiver)  # (the rate meter's end stamp)
        wait = self.last_finish - self.clock()
        if wait <= 0:
            return 0.0
        self.sleep(wait)
        self.total_delay_s += wait
        return wait


class InboundWire:
    """One rank's inbound wire, shared by the messages of both neighbours (a receiver-side meter).

    Model (the WAN yardstick's meter): a message of ``nbytes`` sent at ``sent_at`` (the sender's
    clock, which travels with the message) starts on the wire at ``max(wire free, sent_at)`` and
    holds it for ``nbytes * 8 / bandwidth_bps + latency_s`` -- the latency occupies the wire too;
    the receiver may use the message only when that ends. Messages are metered in the order the
    receiver takes them (``arrival`` / ``receive`` calls), activations from the previous stage and
    gradients from the next on the same wire. ``nbytes`` is what is billed: pass the bytes the
    message actually uses (the wire bytes of a codec), not a padded buffer's size.

    ``sent_at`` must be read from the same clock as ``clock`` (``time.monotonic`` is system-wide on
    Linux, so processes on one host agree). ``clock`` and ``sleep`` are injectable for tests.
    """

    def __init__(self, bandwidth_bps: float, latency_s: float = 0.0, clock=time.monotonic, sleep=time.sleep):
        if not bandwidth_bps > 0:
            raise ValueError(f"bandwidth_bps must be > 0, got {bandwidth_bps!r}")
        if not latency_s >= 0:
            raise ValueError(f"latency_s must be >= 0, got {latency_s!r}")
        self.bandwidth_bps = float(bandwidth_bps)
        self.latency_s = float(latency_s)
        self.clock = clock
        self.sleep = sleep
        self.free_at = float("-inf")  # when the last metered message has arrived
        self.billed_bytes = 0
        self.total_delay_s = 0.0  # time spent sleeping in ``receive``
        self._lock = threading.Lock()

    def occupancy_seconds(self, nbytes: int) -> float:
        """How long one message of ``nbytes`` holds the wire: serialisation plus latency."""
        return nbytes * 8.0 / self.bandwidth_bps + self.latency_s

    def arrival(self, sent_at: float, nbytes: int) -> float:
        """Meter the next message; returns when it has arrived (pure: no clock read, no sleep)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
        with self._lock:
            start = max(self.free_at, float(sent_at))
            self.free_at = start + self.occupancy_seconds(nbytes)
            self.billed_bytes += int(nbytes)
            return self.free_at

    def receive(self, sent_at: float, nbytes: int) -> float:
        """Meter the next message and block until it has arrived; returns the seconds slept."""
        wait = self.arrival(sent_at, nbytes) - self.clock()
        if wait <= 0:
            return 0.0
        self.sleep(wait)
        self.total_delay_s += wait
        return wait


def emulation(config) -> LinkEmulator | InboundWire | None:
    """The emulated link of a ``TahConfig`` (None: ``tah_emulate_bandwidth`` not set). The inbound wire reads the
    send stamps the trailer carries, wall time (``wire.py``)."""
    bandwidth, latency = config.emulated_bandwidth_bps, config.tah_emulate_latency_ms / 1e3
    if bandwidth is None:
        return None
    if config.tah_emulate_wire == "inbound":
        return InboundWire(bandwidth, latency, clock=time.time)
    return LinkEmulator(bandwidth, latency)


class EmulationStep(Step):
    """A link end's messages on the process's emulated link ``meter``; ``bill_trailer``: the trailer is traffic
    (auto's) and the inbound wire bills it (a trailer that only carries the send stamp is not)."""

    def __init__(self, meter: LinkEmulator | InboundWire, bill_trailer: bool):
        self.meter, self.bill_trailer = meter, bill_trailer

    def on_complete(self, m, done_at: float | None) -> float | None:
        """Sleep until the emulated link has carried ``m`` and return when that was (wall time): on a
        ``LinkEmulator`` every message, both ends, its second message included; on an ``InboundWire`` a receive,
        from its trailer's send stamp, billed what crossed the network."""
        rest_nbytes = 0 if m.rest is None else m.rest.numel()
        if isinstance(self.meter, LinkEmulator):
            me = torch.distributed.get_rank()
            pair = (m.link.peer, me) if m.is_recv else (me, m.link.peer)
            self.meter.complete(pair, m.buf.numel() + rest_nbytes, m.completed_at, receiver=m.is_recv)
            return wall_seconds(self.meter.last_finish)
        if not (m.is_recv and m.extra_nbytes):
            return done_at
        billed = m.buf.numel() - (0 if self.bill_trailer else m.extra_nbytes) + rest_nbytes
        self.meter.receive(decode_trailer(m.trailer).sent_at, billed)
        return self.meter.free_at
