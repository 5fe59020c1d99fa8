"""``auto``'s choice: which candidate codec a link direction sends with, from what ``measure.py`` measured.

**Choice** (``Chooser``): predicted seconds per message ``(1 - overlap) * (encode + decode) +
8 * wire_bytes / rate``, times the candidate's measured steps multiplier at the pipeline's depth
(``config.auto.steps_multiplier``: a codec that sends half the bytes but needs 2.5x the steps to the
same loss is slower to target, not faster); ``overlap`` is the share of codec time the schedule hides (default 0:
none hidden, the conservative case for a synchronous 1F1B schedule). Among candidates whose
error is at most the floor (``max_error``; by default the error of the default TAH-Quant
codec, candidate ``paper``, on the same tensor, so auto never sends less accurately than the
default; ``none`` has error 0; if ``paper`` itself was dropped the floor is 0), the smallest
prediction wins, ties to the earlier candidate. The default floor is a proxy for steps to a loss; a
candidate whose steps were measured at the pipeline's depth (``config.auto.steps_measured``: its multiplier
is in the table as steps to target, not as a lower bound) is judged by them instead and passes it (a larger
round-trip error need not cost more steps: ``config/measured.json``, docs/REAL_MODEL.md); so does a candidate left
out as the same codec as a measured one (in the backward direction ``lowrank``'s gradients are ``hadint4``'s). A
lower bound waives nothing: a candidate that missed the target is held to the floor. An explicit ``max_error`` binds every candidate. The rate a candidate is predicted with is the
slowest of the rates measured in the last ``memory`` (4) measurements on messages at least as
large as its own, if any, else the current measurement: a link with a burst allowance (a token
bucket, e.g. tc's tbf) carries messages smaller than its burst far faster than its sustained
rate, so a rate read on small compressed messages must not be extrapolated to uncompressed ones
(measured: 629 Mbit/s read on a 1 Mbit/s tbf link with a 32 KiB burst). Once the large size's
rate is older than ``memory`` measurements, the current rate stands in for it, so a link that
got faster is found again. Hysteresis: leaving the current codec needs the
best one predicted ``>= gain`` (5%) faster on ``patience`` (2) consecutive measurements, or ``>= jump``
(50%) faster on one, or ``>= gain`` faster on a measurement taken early because the link collapsed (the
latest transfers all under half the rate last measured, its slower quartile, at their size:
``LinkRateMeter.collapsed``, checked at every iteration boundary, not only every interval; or the latest
whole iterations' fastest transfer fell under half the last measurement's at the same size, ``LinkRateMeter.fell``,
checked there too); a current codec
that was dropped or no longer meets the floor is left at once.

**Probation** (``Probation``): the prediction adds link time and codec time, but a schedule hides
part of the link time behind other stages' compute, and stages that share cores lose to a codec's
CPU time what they gain on the link (measured on the CPU throughput reproduction, 4 stages on 2
cores: at 500 Mbit/s the model predicted hadint4's messages 2x faster than fp32's, the iterations
took as long). So a switch is a trial: after ``probation`` (2) iterations of the new codec, the
fastest of them is compared with the fastest of the last ``probation`` iterations before the
switch; not faster, the link goes back (``Chooser.reject``) and the new codec is left out of the
choice for ``memory`` measurements. Iteration times are the sender's (between the first
messages of consecutive iterations on its link end) and include every link's choice, which is
what the pipeline pays.

**Checkpoints.** ``Chooser.state_dict()`` (current codec, hysteresis streak, rates per size, rejected
codecs) and ``Probation.state_dict()`` (recent iteration times, an open trial) restore exactly: fed
the same measurements after a resume, the decisions equal an uninterrupted run's.

The settings are ``config.AutoSettings``; the decision reaches the receiver as an ``AutoDecision``
announced in every message's trailer (``wire.py``, carried by ``auto.AutoEnd``).
"""

from __future__ import annotations

from ..config import AutoSettings
from ..config.auto import FLOOR_REFERENCE, steps_measured, steps_multiplier
from .measure import CandidateCost, CodecCostTable, LinkRate
from .wire import AutoDecision


def predicted_seconds(cost: CandidateCost, rate_bps: float, overlap: float = 0.0) -> float:
    """Seconds one message takes with this candidate on a link of ``rate_bps`` (see the module docstring)."""
    return (1.0 - overlap) * (cost.encode_s + cost.decode_s) + 8.0 * cost.wire_nbytes / rate_bps


class Chooser:
    """Picks the codec of one link direction from measured rates (see the module docstring).

    ``current`` is the codec the link starts with (the handshake's); None lets the first
    measurement choose freely. ``depth`` (the pipeline's stages) and ``direction`` pick the steps multipliers.
    """

    def __init__(self, table: CodecCostTable, settings: AutoSettings, current: str | None = None, depth: int = 1,
                 direction: str = "forward"):
        if current is not None and current not in table.costs:
            raise ValueError(f"current = {current!r} is not a measured candidate ({', '.join(table.costs)})")
        self.table, self.settings, self.depth, self.direction = table, settings, int(depth), direction
        self.current, self.streak = current, 0
        self.predicted: dict[str, float] = {}
        self.measurements = 0  # rates taken so far
        self.size_rates: dict[int, tuple[float, int]] = {}  # message bytes -> (rate, measurement it was taken at)
        self.rejected: dict[str, int] = {}  # codec that failed its probation -> the measurement count then

    def floor(self) -> float:
        if self.settings.max_error is not None:
            return self.settings.max_error
        reference = self.table.costs.get(self.table.aliases.get(FLOOR_REFERENCE, FLOOR_REFERENCE))
        return 0.0 if reference is None else reference.error

    def within_floor(self, name: str, cost: CandidateCost, floor: float) -> bool:
        """Whether ``name`` may be chosen: its error is at most ``floor``, or the floor is the default one and the
        steps of ``name`` or of a candidate left out as the same codec (``aliases``) were measured at this depth
        (module docstring)."""
        if cost.error <= floor:
            return True
        same = [name, *(alias for alias, kept in self.table.aliases.items() if kept == name)]
        return self.settings.max_error is None and any(steps_measured(n, self.depth) for n in same)

    def rate_for(self, cost: CandidateCost, rate_bps: float) -> float:
        """The rate to predict ``cost``'s messages with: the slowest recent rate measured on messages at least
        as large (a rate measured on small messages may be a burst allowance's, not the link's), else
        ``rate_bps``."""
        larger = [rate for nbytes, (rate, _) in self.size_rates.items() if nbytes >= cost.wire_nbytes]
        return min(larger, default=rate_bps)

    def update(self, rate: LinkRate | float, collapse: bool = False) -> str:
        """Take one measurement of the link; returns the codec chosen now (maybe unchanged). ``collapse``: the
        measurement was taken early because the link got far slower (``LinkRateMeter.collapsed``): a gain of
        ``gain`` switches at once, without ``patience``."""
        rate_bps = rate.rate_bps if isinstance(rate, LinkRate) else float(rate)
        if not rate_bps > 0:
            raise ValueError(f"link rate {rate_bps!r} bit/s: must be > 0")
        self.measurements += 1
        for nbytes, size_rate in getattr(rate, "by_size", ()):
            self.size_rates[nbytes] = (size_rate, self.measurements)
        self.size_rates = {nbytes: item for nbytes, item in self.size_rates.items()
                           if self.measurements - item[1] < self.settings.memory}
        floor = self.floor()
        self.predicted = {name: predicted_seconds(cost, self.rate_for(cost, rate_bps), self.settings.overlap)
                          * steps_multiplier(name, self.depth, self.direction)
                          for name, cost in self.table.costs.items() if self.within_floor(name, cost, floor)}
        if not self.predicted:
            raise RuntimeError(f"auto codec: no candidate within the error floor {floor:.3g} "
                               f"(dropped: {self.table.dropped or 'none'})")
        self.rejected = {name: at for name, at in self.rejected.items()
                         if self.measurements - at <= self.settings.memory}
        eligible = [name for name in self.predicted if name not in self.rejected] or list(self.predicted)
        best = min(eligible, key=self.predicted.get)  # ties: the earlier candidate
        if self.current not in self.predicted:
            self.current, self.streak = best, 0
        elif best != self.current and self.predicted[best] <= (1 - self.settings.gain) * self.predicted[self.current]:
            self.streak += 1
            jump = self.predicted[best] <= (1 - self.settings.jump) * self.predicted[self.current]
            if self.streak >= self.settings.patience or jump or collapse:
                self.current, self.streak = best, 0
        else:
            self.streak = 0
        return self.current

    def reject(self, name: str, back_to: str) -> None:
        """``name`` failed its probation (``Probation``): the link goes back to ``back_to``, and ``name`` is left out
        of the choice for the next ``memory`` measurements."""
        if back_to not in self.table.costs:
            raise ValueError(f"reject({name!r}, back_to={back_to!r}): not a measured candidate")
        self.rejected[name] = self.measurements
        self.current, self.streak = back_to, 0

    def announcement(self, iteration: int) -> AutoDecision:
        """What the messages of ``iteration`` announce: the codec for ``iteration + 1``."""
        if self.current is None:
            raise RuntimeError("auto codec: nothing chosen yet (start with current= or update() first)")
        cost = self.table.costs[self.current]
        return AutoDecision(self.current, cost.codec_id, cost.config_digest, iteration + 1)

    def state_dict(self) -> dict:
        return {"current": self.current, "streak": self.streak, "measurements": self.measurements,
                "size_rates": [[nbytes, rate, at] for nbytes, (rate, at) in self.size_rates.items()],
                "rejected": dict(self.rejected)}

    def load_state_dict(self, state: dict) -> None:
        current = state["current"]
        if current is not None and current not in self.table.costs:
            raise ValueError(f"checkpoint's codec {current!r} is not a candidate here ({', '.join(self.table.costs)})")
        self.current, self.streak = current, int(state["streak"])
        self.measurements = int(state.get("measurements", 0))
        self.size_rates = {int(n): (float(r), int(at)) for n, r, at in state.get("size_rates", [])}
        self.rejected = {str(name): int(at) for name, at in state.get("rejected", {}).items()}


class Probation:
    """Whether a switch made a link direction faster, from the iterations it ran (module docstring).

    The sender calls ``begin(iteration, codec, now)`` at the start of every iteration, with the codec of
    the iteration that just ended; that iteration's wall time is kept (not the first iteration this
    process sees: start-up). ``switched(previous, new, first)`` opens a trial; once ``new`` has run
    ``iterations`` iterations, ``verdict()`` answers ``new`` when its fastest iteration beat the fastest of
    the last ``iterations`` before the switch, else ``previous`` (no iteration of ``previous`` to compare
    with: ``new``), and closes the trial; None while it is open or when there is none. The fastest
    iteration, not the mean: an evaluation or a checkpoint only ever adds time to an iteration.
    """

    def __init__(self, iterations: int = 2):
        if iterations < 1:
            raise ValueError(f"iterations = {iterations}: must be >= 1")
        self.iterations = iterations
        self.times: list[tuple[int, str, float]] = []  # (iteration, its codec, seconds), the recent ones
        self.running: tuple[int, float, bool] | None = None  # (iteration, monotonic start, the first one seen)
        self.trial: tuple[str, str, int] | None = None  # (previous codec, new codec, the new one's first iteration)
        self.compared: tuple[str, float | None, str, float] | None = None  # the last verdict's fastest iterations

    def begin(self, iteration: int, codec: str, now: float) -> None:
        if self.running is not None and iteration == self.running[0] + 1 and not self.running[2]:
            self.times.append((self.running[0], codec, now - self.running[1]))
            self.times = self.times[-4 * self.iterations:]
        self.running = (iteration, now, self.running is None)

    def switched(self, previous: str, new: str, first: int) -> None:
        self.trial = (previous, new, first)

    def verdict(self) -> str | None:
        if self.trial is None:
            return None
        previous, new, first = self.trial
        after = [seconds for it, codec, seconds in self.times if it >= first and codec == new]
        if len(after) < self.iterations:
            return None
        before = [seconds for it, codec, seconds in self.times if it < first and codec == previous][-self.iterations:]
        self.trial = None
        self.compared = (previous, min(before) if before else None, new, min(after))
        return new if not before or min(after) < min(before) else previous

    def state_dict(self) -> dict:
        return {"times": [list(item) for item in self.times], "trial": list(self.trial) if self.trial else None}

    def load_state_dict(self, state: dict) -> None:
        self.times = [(int(it), str(codec), float(seconds)) for it, codec, seconds in state["times"]]
        self.trial = tuple(state["trial"]) if state["trial"] else None
        self.running = None  # the iteration running at the checkpoint is not timed after a resume
