"""What ``auto`` measures, per link and direction: the link's rate and each candidate codec's cost.

1. **Link rate** (``LinkRateMeter``): the transport records ``(wire bytes, seconds)`` of the real
   transfers it makes anyway (each message's transit from its sender's stamp to its completion at the
   receiver, reported back to the sender, less the link's latency measured at the handshake:
   ``auto.py``); every ``interval`` iterations (and at the handshake) ``measure()`` turns the transfers
   since the last measurement into a rate and its spread. A transit can only include extra time (the
   receiver posting late, scheduling), never less, so the estimate is an upper order statistic of the
   per-transfer rates of the window's large messages (those of at least half the largest size; too few
   of them twice in a row, as after a switch to a codec with smaller messages, and they are dropped):
   the upper quartile by default, and the spread is the interquartile range (``quantile`` picks
   another: the pipeline transport reads the fastest transfer, 1.0). The first ``skip_first``
   transfers of a meter are ignored (connection set-up, allocator and kernel warm-up).
2. **Codec cost** (``CodecCostTable``): per candidate, encode and decode seconds at the link's
   message shape on this device (``codecs.core.timing.Stopwatch``: CUDA events on a GPU, wall time on
   the CPU; one untimed warm-up call, then the median of ``calls`` (5) calls, made while the
   pipeline runs: where stages share cores, the contention is part of what a codec call costs the
   pipeline -- measured: with the fastest of 3 calls, auto compressed on the CPU throughput
   reproduction's 100 Mbit/s-10 Gbit/s links, where every codec is slower than fp32), the exact wire bytes
   (``codec.wire_nbytes``) and the relative round-trip error on a sample tensor (a real message
   when the transport has one, else ``codecs.core.samples.activation_like``). ``observe`` refreshes the
   seconds from the running statistics. A candidate whose build or first call raises is dropped
   with one warning. The table owns its codec objects (a stochastic-rounding codec's noise state
   here is never the transport's). The sender measures the decode cost on its own device and
   stands it in for the receiver's.

``LinkRateMeter.state_dict()`` (pending transfers) restores exactly; codec costs are measured afresh
at start-up: they are measurements, not state.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import warnings
from typing import Callable, Mapping, Sequence

import torch

from ..codecs import Codec
from ..codecs.core import timing
from ..codecs.core.samples import activation_like
from ..config import AutoSettings, candidate_codec

MIN_SECONDS = 1e-9  # a transfer timed at 0 s counts as this (an unlimited link: a huge, finite rate)


# ----- the link --------------------------------------------------------------------------------
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

    def fell_from(self, last: "LinkRate", factor: float = 0.5) -> bool:
        """Whether the link got far slower since measurement ``last``: at every message size both measured, this
        window's fastest transfer is below ``factor`` times ``last``'s. A window's fastest transfer is the one
        least delayed by a late receiver, so a whole window of them under half is the link, not a late post
        (which can hide a drop from ``LinkRateMeter.collapsed``: where a receiver posts late, as a last stage
        between its forward and backward steps, every transit is slow, before the drop as after it)."""
        mine, theirs = dict(self.by_size), dict(last.by_size)
        common = mine.keys() & theirs.keys()
        return bool(common) and all(mine[n] < factor * theirs[n] for n in common)


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
        self.stalled = False  # the last measure() found too few large messages
        self.marks: list[int] = [0]  # where each iteration's transfers begin in the window (since the last measurement)

    def record(self, nbytes: int, seconds: float) -> None:
        """One real transfer of ``nbytes`` bytes that took ``seconds`` (post to completion)."""
        if nbytes <= 0 or not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"a transfer of {nbytes} bytes in {seconds} s: need bytes > 0 and finite seconds >= 0")
        self.seen += 1
        if self.seen > self.skip_first:
            self.window.append((int(nbytes), max(float(seconds), MIN_SECONDS)))

    def iteration_done(self) -> None:
        """An iteration boundary: the transfers recorded from here on are the next iteration's (``fell``)."""
        self.marks.append(len(self.window))

    def fell(self, last: LinkRate, factor: float = 0.5) -> int:
        """How many of the window's latest transfers show the link far slower than measurement ``last``: the longest
        run of whole iterations (at least ``min_transfers`` transfers) whose fastest transfer, at every message size
        both saw, is below ``factor`` times ``last``'s fastest there (``LinkRate.fell_from``); 0 if none. A drop
        inside the window shows here at the first boundary after it, where the window's fastest transfer is still
        the old rate's; and where the receiver posts late, so that every transit includes its wait and the latest
        transfers never look ``collapsed``, an iteration's fastest transfer still shows the link."""
        theirs, fastest, found, end = dict(last.by_size), {}, 0, len(self.window)
        for mark in reversed(self.marks):  # the shortest run first, each transfer read once
            for nbytes, seconds in self.window[mark:end]:
                fastest[nbytes] = max(fastest.get(nbytes, 0.0), 8.0 * nbytes / seconds)
            end = mark
            common = fastest.keys() & theirs.keys()
            if any(fastest[n] >= factor * theirs[n] for n in common):
                break  # a longer run holds this transfer too
            if common and len(self.window) - mark >= self.min_transfers:
                found = len(self.window) - mark
        return found

    def due(self, iteration: int) -> bool:
        """Whether a measurement is due after ``iteration`` completed iterations (0: the handshake)."""
        return iteration % self.interval == 0

    def collapsed(self, last: LinkRate, factor: float = 0.5) -> bool:
        """Whether the link got far slower since measurement ``last``: the latest ``min_transfers`` transfers are
        all of one size that ``last`` measured and each is below ``factor`` times ``last``'s slower quartile (its
        rate less its spread: on a jittery link the usual transfer, not the luckiest). A message size ``last``
        did not see (after a codec switch) is never a collapse: a small message's rate is not a large one's."""
        recent = self.window[-self.min_transfers:]
        sizes = {nbytes for nbytes, _ in recent}
        if len(recent) < self.min_transfers or len(sizes) != 1 or sizes.pop() not in dict(last.by_size):
            return False
        usual = last.rate_bps - last.spread_bps
        return usual > 0 and all(8.0 * nbytes / seconds < factor * usual for nbytes, seconds in recent)

    def measure(self, recent: int | None = None) -> LinkRate | None:
        """The rate from the transfers since the last measurement (which it consumes); None with too few.
        ``recent``: from the latest ``recent`` of them only (a collapse: the older ones are the old rate's).

        Too few large messages keep the window as it is (more may come), but not twice in a row beside smaller
        ones: after a codec switch the messages shrink and the last large ones would stall the meter for good,
        so on the second such call they are dropped and the smaller ones measured."""
        if recent is not None:
            self.window, self.marks = self.window[-recent:], [0]
        while True:
            if not self.window:
                return None
            largest = max(nbytes for nbytes, _ in self.window)
            rates = [8.0 * nbytes / seconds for nbytes, seconds in self.window if 2 * nbytes >= largest]
            if len(rates) >= self.min_transfers:
                break
            smaller = [(nbytes, seconds) for nbytes, seconds in self.window if 2 * nbytes < largest]
            if not smaller or not self.stalled:
                self.stalled = bool(smaller)
                return None
            self.window, self.marks = smaller, [0]
        self.stalled = False
        fastest: dict[int, float] = {}
        for nbytes, seconds in self.window:
            fastest[nbytes] = max(fastest.get(nbytes, 0.0), 8.0 * nbytes / seconds)
        self.window, self.marks = [], [0]
        low, _, high = statistics.quantiles(rates, n=4, method="inclusive")
        if self.quantile != 0.75:
            ordered = sorted(rates)
            high = ordered[round(self.quantile * (len(ordered) - 1))]
        return LinkRate(rate_bps=high, spread_bps=high - low, transfers=len(rates), by_size=tuple(sorted(fastest.items())))

    def state_dict(self) -> dict:
        return {"seen": self.seen, "window": [list(item) for item in self.window], "stalled": self.stalled,
                "marks": list(self.marks)}

    def load_state_dict(self, state: dict) -> None:
        self.seen = int(state["seen"])
        self.window = [(int(nbytes), float(seconds)) for nbytes, seconds in state["window"]]
        self.stalled = bool(state.get("stalled", False))  # (absent from checkpoints written before it)
        self.marks = [int(mark) for mark in state.get("marks", [0])]  # (likewise)


# ----- the codecs -----------------------------------------------------------------------------
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
