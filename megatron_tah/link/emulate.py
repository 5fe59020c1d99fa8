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
