"""In-process slow-link emulation for the compressing transports.

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
