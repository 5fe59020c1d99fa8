"""``--tah-forward-codec auto``: measure the link and the codecs, pick per link and direction.

Pure decision logic (torch only to time and round-trip codecs); the pipeline transport feeds it
and carries its decisions. Per link and direction:

1. **Link rate** (``LinkRateMeter``): the transport records ``(wire bytes, seconds)`` of the real
   transfers it makes anyway (``auto_link.py``: each message's transit from its sender's stamp to its
   completion at the receiver, reported back to the sender, less the link's latency measured at the
   handshake); every ``interval`` iterations (and at the handshake) ``measure()`` turns the transfers
   since the last measurement into a rate and its spread. A transit can only include extra time (the
   receiver posting late, scheduling), never less, so the estimate is an upper order statistic of the
   per-transfer rates of the window's large messages (those of at least half the largest size):
   the upper quartile by default, and the spread is the interquartile range (``quantile`` picks
   another: the pipeline transport reads the fastest transfer, 1.0). The first ``skip_first``
   transfers of a meter are ignored (connection set-up, allocator and kernel warm-up).
2. **Codec cost** (``CodecCostTable``): per candidate, encode and decode seconds at the link's
   message shape on this device (``codecs.timing.Stopwatch``: CUDA events on a GPU, wall time on
   the CPU; one untimed warm-up call, then the median of ``calls`` (5) calls, made while the
   pipeline runs: where stages share cores, the contention is part of what a codec call costs the
   pipeline -- measured: with the fastest of 3 calls, auto compressed on the CPU throughput
   reproduction's 100 Mbit/s-10 Gbit/s links, where every codec is slower than fp32), the exact wire bytes
   (``codec.wire_nbytes``) and the relative round-trip error on a sample tensor (a real message
   when the transport has one, else ``codecs.samples.activation_like``). ``observe`` refreshes the
   seconds from the running statistics. A candidate whose build or first call raises is dropped
   with one warning. The table owns its codec objects (a stochastic-rounding codec's noise state
   here is never the transport's). The sender measures the decode cost on its own device and
   stands it in for the receiver's.
3. **Choice** (``Chooser``): predicted seconds per message ``(1 - overlap) * (encode + decode) +
   8 * wire_bytes / rate``; ``overlap`` is the share of codec time the schedule hides (default 0:
   none hidden, the conservative case for a synchronous 1F1B schedule). Among candidates whose
   error is at most the floor (``max_error``; by default the error of the default TAH-Quant
   codec, candidate ``paper``, on the same tensor, so auto never sends less accurately than the
   default; ``none`` has error 0; if ``paper`` itself was dropped the floor is 0), the smallest
   prediction wins, ties to the earlier candidate. The rate a candidate is predicted with is the
   slowest of the rates measured in the last ``memory`` (4) measurements on messages at least as
   large as its own, if any, else the current measurement: a link with a burst allowance (a token
   bucket, e.g. tc's tbf) carries messages smaller than its burst far faster than its sustained
   rate, so a rate read on small compressed messages must not be extrapolated to uncompressed ones
   (measured: 629 Mbit/s read on a 1 Mbit/s tbf link with a 32 KiB burst). Once the large size's
   rate is older than ``memory`` measurements, the current rate stands in for it, so a link that
   got faster is found again. Hysteresis: leaving the current codec needs the
   best one predicted ``>= gain`` (5%) faster on ``patience`` (2) consecutive measurements; a
   current codec that was dropped or no longer meets the floor is left at once.
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
4. **Lockstep switch.** A receiver posts a receive of a known size, so it must know the codec
   before the message arrives: every message of iteration ``k`` announces the codec for
   iteration ``k + 1`` (``AutoDecision``, encoded in ``ANNOUNCEMENT_NBYTES`` bytes by
   ``encode_announcement``) and both ends switch at the boundary. The sender decides; the receiver
   holds a decoder for every candidate and follows the announcement. The codec's own header
   (codec id, config digest) is still checked on every decode, so a buffer from another codec
   than the announced one is a ``WireFormatError``, never a misread. Proposed carriage: the
   8 bytes trail the codec buffer (message = buffer || announcement, received size
   ``wire_nbytes + 8``), leaving the 16-byte codec header and its reserved word (payload checksum)
   alone. Announcement bytes::

       0     1   magic 0xA7
       1     1   codec id
       2     4   config digest (little endian)
       6     2   effective-from iteration mod 2**16 (little endian)

5. **Checkpoints.** ``Chooser.state_dict()`` (current codec, hysteresis streak, rates per size, rejected
   codecs), ``Probation.state_dict()`` (recent iteration times, an open trial) and
   ``LinkRateMeter.state_dict()`` (pending transfers) restore exactly: fed the same measurements
   after a resume, the decisions equal an uninterrupted run's. Codec costs are measured afresh at
   start-up; they are measurements, not state.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import warnings
from typing import Callable, Mapping, Sequence

import torch

from ..codecs import Codec, WireFormatError, timing
from ..codecs.samples import activation_like
from ..config import AutoSettings, candidate_codec
from ..config.auto import DIRECTIONS, FLOOR_REFERENCE

ANNOUNCEMENT_MAGIC = 0xA7
ANNOUNCEMENT_NBYTES = 8
MIN_SECONDS = 1e-9  # a transfer timed at 0 s counts as this (an unlimited link: a huge, finite rate)


# ----- 1. the link ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LinkRate:
    """One measurement of a link direction: rate and spread in bits/s over ``transfers`` transfers."""

    rate_bps: float
    spread_bps: float
    transfers: int
    by_size: tuple[tuple[int, float], ...] = ()
    """(message bytes, fastest rate in bits/s) for each message size in the window."""

    def describe(self) -> str:
        return f"{self.rate_bps / 1e6:.4g} Mbit/s (IQR {self.spread_bps / 1e6:.3g}, {self.transfers} transfers)"


class LinkRateMeter:
    """Rate of one link direction from the transfers it carries (see the module docstring, point 1)."""

    def __init__(self, interval: int = 50, skip_first: int = 2, min_transfers: int = 3, quantile: float = 0.75):
        if interval < 1 or skip_first < 0 or min_transfers < 2 or not 0.5 <= quantile <= 1.0:
            raise ValueError(f"interval = {interval} (>= 1), skip_first = {skip_first} (>= 0), "
                             f"min_transfers = {min_transfers} (>= 2), quantile = {quantile} (in [0.5, 1])")
        self.interval, self.skip_first, self.min_transfers = interval, skip_first, min_transfers
        self.quantile = quantile
        self.seen = 0
        self.window: list[tuple[int, float]] = []

    def record(self, nbytes: int, seconds: float) -> None:
        """One real transfer of ``nbytes`` bytes that took ``seconds`` (post to completion)."""
        if nbytes <= 0 or not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"a transfer of {nbytes} bytes in {seconds} s: need bytes > 0 and finite seconds >= 0")
        self.seen += 1
        if self.seen > self.skip_first:
            self.window.append((int(nbytes), max(float(seconds), MIN_SECONDS)))

    def due(self, iteration: int) -> bool:
        """Whether a measurement is due after ``iteration`` completed iterations (0: the handshake)."""
        return iteration % self.interval == 0

    def measure(self) -> LinkRate | None:
        """The rate from the transfers since the last measurement (which it consumes); None with too few."""
        if not self.window:
            return None
        largest = max(nbytes for nbytes, _ in self.window)
        rates = [8.0 * nbytes / seconds for nbytes, seconds in self.window if 2 * nbytes >= largest]
        if len(rates) < self.min_transfers:
            return None
        fastest: dict[int, float] = {}
        for nbytes, seconds in self.window:
            fastest[nbytes] = max(fastest.get(nbytes, 0.0), 8.0 * nbytes / seconds)
        self.window = []
        low, _, high = statistics.quantiles(rates, n=4, method="inclusive")
        if self.quantile != 0.75:
            ordered = sorted(rates)
            high = ordered[round(self.quantile * (len(ordered) - 1))]
        return LinkRate(rate_bps=high, spread_bps=high - low, transfers=len(rates), by_size=tuple(sorted(fastest.items())))

    def state_dict(self) -> dict:
        return {"seen": self.seen, "window": [list(item) for item in self.window]}

    def load_state_dict(self, state: dict) -> None:
        self.seen = int(state["seen"])
        self.window = [(int(nbytes), float(seconds)) for nbytes, seconds in state["window"]]


# ----- 2. the codecs -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CandidateCost:
    """A candidate at one message shape: its wire identity, seconds per call, wire bytes, error."""

    name: str
    codec_id: int
    config_digest: int
    encode_s: float
    decode_s: float
    wire_nbytes: int
    error: float


class CodecCostTable:
    """Costs of the candidates of one link direction at ``shape``/``dtype`` on ``device``.

    ``candidates`` maps a name to a codec object or to a function building one. A candidate with
    the same codec id and config digest as an earlier one is left out (the two are one codec on
    the wire). ``costs`` holds the measured candidates in the given order, ``dropped`` the failed
    ones with their reason.
    """

    def __init__(self, candidates: Mapping[str, Codec | Callable[[], Codec]], shape: Sequence[int],
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 sample: torch.Tensor | None = None, calls: int = 5, smoothing: float = 0.25):
        if calls < 1 or not 0.0 < smoothing <= 1.0:
            raise ValueError(f"calls = {calls} (>= 1), smoothing = {smoothing} (in (0, 1])")
        self.shape, self.dtype, self.device = tuple(shape), dtype, torch.device(device)
        if sample is None:
            sample = activation_like(self.shape, dtype=dtype, device=self.device)
        if tuple(sample.shape) != self.shape or sample.dtype != dtype or sample.device.type != self.device.type:
            raise ValueError(f"sample is {tuple(sample.shape)} {sample.dtype} on {sample.device}, "
                             f"expected {self.shape} {dtype} on {self.device}")
        self.calls, self.smoothing = calls, smoothing
        self.costs: dict[str, CandidateCost] = {}
        self.dropped: dict[str, str] = {}
        self.aliases: dict[str, str] = {}  # a candidate left out as the same codec as an earlier one -> that one
        for name, make in candidates.items():
            try:
                codec = make if isinstance(make, Codec) else make()
                identity = (codec.codec_id, codec.config_digest())
                same = [other for other, c in self.costs.items() if (c.codec_id, c.config_digest) == identity]
                if same:
                    self.aliases[name] = same[0]
                    continue
                self.costs[name] = self._measure(name, codec, sample)
            except Exception as err:  # noqa: BLE001 (any failure of a candidate drops it, with its message)
                self.drop(name, f"{type(err).__name__}: {err}")

    @classmethod
    def for_direction(cls, settings: AutoSettings, direction: str, shape: Sequence[int],
                      dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                      backend: str = "auto", **kwargs) -> "CodecCostTable":
        """The table of ``settings.candidates`` for ``direction``, built with ``candidate_codec``."""
        makers = {name: (lambda name=name: candidate_codec(name, direction, backend)) for name in settings.candidates}
        return cls(makers, shape, dtype, device, **kwargs)

    @classmethod
    def from_costs(cls, costs: Sequence[CandidateCost], smoothing: float = 0.25) -> "CodecCostTable":
        """A table of given costs, nothing measured (tests, or costs carried over from elsewhere)."""
        table = cls.__new__(cls)
        table.shape = table.dtype = table.device = None
        table.calls, table.smoothing = 0, smoothing
        table.costs, table.dropped, table.aliases = {cost.name: cost for cost in costs}, {}, {}
        return table

    def _measure(self, name: str, codec: Codec, sample: torch.Tensor) -> CandidateCost:
        buf = codec.encode(sample)  # first calls: compilation and allocation, not timed
        decoded = codec.decode(buf, self.shape, self.dtype)
        error = timing.to_float(timing.relative_error(sample, decoded))
        encode, decode = [], []
        for _ in range(self.calls):
            watch = timing.Stopwatch(self.device)
            buf = codec.encode(sample)
            encode.append(watch.stop())
            watch = timing.Stopwatch(self.device)
            codec.decode(buf, self.shape, self.dtype)
            decode.append(watch.stop())
        nbytes = codec.wire_nbytes(self.shape, self.dtype)
        if buf.numel() != nbytes:
            raise RuntimeError(f"encode gave {buf.numel()} bytes, wire_nbytes says {nbytes}")
        return CandidateCost(name=name, codec_id=codec.codec_id, config_digest=codec.config_digest(),
                             encode_s=statistics.median(timing.to_float(t) for t in encode),
                             decode_s=statistics.median(timing.to_float(t) for t in decode),
                             wire_nbytes=nbytes, error=error)

    def drop(self, name: str, reason: str) -> None:
        """Leave candidate ``name`` out from now on, with one warning (e.g. its kernel failed at run time)."""
        if name in self.dropped:
            return
        self.costs.pop(name, None)
        self.dropped[name] = reason
        warnings.warn(f"auto codec: candidate {name!r} dropped ({reason})", RuntimeWarning, stacklevel=2)

    def observe(self, name: str, encode_s: float | None = None, decode_s: float | None = None) -> None:
        """Fold observed seconds per call (running statistics) into ``name``'s cost, weight ``smoothing``."""
        def mix(old: float, new: float | None) -> float:
            return old if new is None else (1 - self.smoothing) * old + self.smoothing * float(new)

        if name not in self.costs:
            raise ValueError(f"observe({name!r}): not a measured candidate ({', '.join(self.costs)})")
        cost = self.costs[name]
        self.costs[name] = dataclasses.replace(cost, encode_s=mix(cost.encode_s, encode_s),
                                               decode_s=mix(cost.decode_s, decode_s))


# ----- 3. the choice -----------------------------------------------------------------------------
def predicted_seconds(cost: CandidateCost, rate_bps: float, overlap: float = 0.0) -> float:
    """Seconds one message takes with this candidate on a link of ``rate_bps`` (see the module docstring)."""
    return (1.0 - overlap) * (cost.encode_s + cost.decode_s) + 8.0 * cost.wire_nbytes / rate_bps


@dataclasses.dataclass(frozen=True)
class AutoDecision:
    """The codec a link direction uses from iteration ``effective_from`` on."""

    name: str
    codec_id: int
    config_digest: int
    effective_from: int


class Chooser:
    """Picks the codec of one link direction from measured rates (see the module docstring, point 3).

    ``current`` is the codec the link starts with (the handshake's); None lets the first
    measurement choose freely.
    """

    def __init__(self, table: CodecCostTable, settings: AutoSettings, current: str | None = None):
        if current is not None and current not in table.costs:
            raise ValueError(f"current = {current!r} is not a measured candidate ({', '.join(table.costs)})")
        self.table, self.settings = table, settings
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

    def rate_for(self, cost: CandidateCost, rate_bps: float) -> float:
        """The rate to predict ``cost``'s messages with: the slowest recent rate measured on messages at least
        as large (a rate measured on small messages may be a burst allowance's, not the link's), else
        ``rate_bps``."""
        larger = [rate for nbytes, (rate, _) in self.size_rates.items() if nbytes >= cost.wire_nbytes]
        return min(larger, default=rate_bps)

    def update(self, rate: LinkRate | float) -> str:
        """Take one measurement of the link; returns the codec chosen now (maybe unchanged)."""
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
                          for name, cost in self.table.costs.items() if cost.error <= floor}
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
            if self.streak >= self.settings.patience:
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
    """Whether a switch made a link direction faster, from the iterations it ran (module docstring, point 3).

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


# ----- 4. the announcement -----------------------------------------------------------------------
def encode_announcement(decision: AutoDecision) -> bytes:
    """``decision`` as ``ANNOUNCEMENT_NBYTES`` bytes (layout in the module docstring)."""
    if not 0 <= decision.codec_id < 256 or not 0 <= decision.config_digest < 2**32 or decision.effective_from < 0:
        raise ValueError(f"cannot encode {decision}")
    return (bytes([ANNOUNCEMENT_MAGIC, decision.codec_id]) + decision.config_digest.to_bytes(4, "little")
            + (decision.effective_from % 2**16).to_bytes(2, "little"))


def decode_announcement(raw: bytes | torch.Tensor, candidates: Mapping[str, Codec | CandidateCost],
                        effective_from: int) -> AutoDecision:
    """The decision in ``raw``, which must name one of ``candidates`` and iteration ``effective_from``
    (what the receiver expects: its current iteration + 1); ``WireFormatError`` otherwise."""
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
        item_digest = item.config_digest() if isinstance(item, Codec) else item.config_digest
        if (item.codec_id, item_digest) == (codec_id, digest):
            return AutoDecision(name, codec_id, digest, effective_from)
    raise WireFormatError(f"announced codec id {codec_id} with config digest {digest:08x} is none of this "
                          f"receiver's candidates ({', '.join(candidates)})")
