"""Steps to a loss and their intervals, the scoring rules every study shares (the speedrun's first): steps to a
target loss, steady seconds per step, T, and intervals.

* **Steps to target** (``steps_to_target``): the iteration of the first validation whose loss is at
  or below the target; ``None`` when no validation of the run reaches it ("missed").
* **The target** (``target_loss``): fixed from the uncompressed bf16 runs, the highest validation
  loss any of them has at ``fraction`` (0.92) of its schedule, rounded up to 3 decimals; so every bf16
  seed reaches it by then, at about 90-95% of its schedule.
* **Steady seconds per step** (``steady_seconds``): the run's step times in consecutive windows of
  ``window`` (10) steps; the first three consecutive windows whose means lie within ``tolerance`` (1%)
  of each other (largest / smallest - 1) are steady, and their median window mean is the step time
  (the reference's rule). ``None`` until three windows agree.
* **T** = steps to target x steady seconds per step.
* **Intervals** (``mean_interval``, ``paired_ratio``): a two-sided 95% Student-t interval of the mean
  over seeds; a codec's steps multiplier is the mean of its per-seed ratios to bf16's steps with the
  same seed (same initialisation and data order), with that interval.
* **Interpolated steps** (``crossing``): where a curve first reaches a loss, linearly interpolated between the
  validation before and the first at or below it; and the **equivalent steps** (``equivalent_steps``): at each
  validation N of one run, the step M at which a baseline's curve reached the same loss (interpolated, never
  extrapolated), so N / M is read along the curve and not at one point (the real-model study).
* **A missed target** (``missed_bound``): a codec that did not reach the target within its longest
  schedule of N steps needs more than N steps; against bf16's steps on the same seed that is a lower
  bound on its multiplier, the smallest over the seeds that missed. Not a multiplier.
* **Two codecs compared** (``compare``): the same-seed ratio A / B over their common seeds, with its
  interval; "within noise" where the interval holds 1.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Iterable, Mapping, Sequence

from . import stats

def steps_to_target(validations: Iterable[tuple[int, float]], target: float) -> int | None:
    """The first iteration (ascending) whose validation loss is ``<= target``; None: the run missed it."""
    for iteration, loss in sorted(validations):
        if math.isfinite(loss) and loss <= target:
            return int(iteration)
    return None


def crossing(validations: Iterable[tuple[int, float]], level: float) -> float | None:
    """The step at which the curve ``validations`` first reaches ``level``: linearly interpolated between the
    validation before and the first at or below it; the first validation's step when that one already is (never
    before the curve starts); None when no validation reaches it."""
    points = sorted((int(i), float(loss)) for i, loss in validations if math.isfinite(loss))
    for k, (step, loss) in enumerate(points):
        if loss <= level:
            if k == 0:
                return float(step)
            before, higher = points[k - 1]
            return before + (higher - level) / (higher - loss) * (step - before)
    return None


def equivalent_steps(curve: Iterable[tuple[int, float]], base: Iterable[tuple[int, float]]) -> list[tuple[int, float]]:
    """(N, M) for each validation N of ``curve`` whose loss ``base`` reaches within its own validations: M is
    ``crossing(base, loss)``. A loss above ``base``'s first validation (reached before ``base`` was first
    measured) or below all of ``base``'s has no M: never extrapolated."""
    base = sorted((int(i), float(loss)) for i, loss in base if math.isfinite(loss))
    if not base:
        return []
    found = []
    for n, loss in sorted(curve):
        if math.isfinite(loss) and loss <= base[0][1]:
            m = crossing(base, loss)
            if m is not None and m > 0:
                found.append((int(n), m))
    return found


def target_loss(baselines: Sequence[Iterable[tuple[int, float]]], schedule: int, fraction: float = 0.92) -> float:
    """The fixed target: the highest loss the baseline runs have at their last validation at or before
    ``fraction * schedule``, rounded up to 3 decimals (each baseline run reaches it by then)."""
    if not baselines:
        raise ValueError("target_loss needs at least one baseline run")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction = {fraction}: must lie in (0, 1]")
    limit = fraction * schedule
    losses = []
    for run in baselines:
        before = [(it, loss) for it, loss in sorted(run) if it <= limit]
        if not before:
            raise ValueError(f"a baseline run has no validation at or before iteration {limit:g}")
        losses.append(before[-1][1])
    return math.ceil(max(losses) * 1000) / 1000


@dataclasses.dataclass(frozen=True)
class Steady:
    seconds: float
    """The median of the three agreeing windows' mean step times."""
    first_step: int
    """Index (0-based, into the step times given) of the first step of the first agreeing window."""
    windows: tuple[float, float, float]


def steady_seconds(step_seconds: Sequence[float], window: int = 10, tolerance: float = 0.01,
                   skip: int = 0) -> Steady | None:
    """The reference's steady state over ``step_seconds[skip:]`` (see the module docstring); None until
    three consecutive windows agree within ``tolerance``."""
    if window < 1 or tolerance < 0 or skip < 0:
        raise ValueError(f"window = {window} (>= 1), tolerance = {tolerance} (>= 0), skip = {skip} (>= 0)")
    times = list(step_seconds)[skip:]
    means = [statistics.fmean(times[i:i + window]) for i in range(0, len(times) - window + 1, window)]
    for k in range(2, len(means)):
        trio = means[k - 2:k + 1]
        if max(trio) <= (1 + tolerance) * min(trio):
            return Steady(statistics.median(trio), skip + (k - 2) * window, tuple(trio))
    return None


@dataclasses.dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int

    def text(self, digits: int = 2, suffix: str = "") -> str:
        if self.n < 2:
            return f"{self.mean:.{digits}f}{suffix} (one seed)"
        return f"{self.mean:.{digits}f}{suffix} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def mean_interval(values: Sequence[float]) -> Interval:
    """Mean and two-sided 95% t-interval (one value: the value, no interval)."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("mean_interval of no values")
    mean = statistics.fmean(values)
    if len(values) == 1:
        return Interval(mean, mean, mean, 1)
    half = stats.half_width(values)
    return Interval(mean, mean - half, mean + half, len(values))


def paired_ratio(codec_steps: Mapping[int, float], base_steps: Mapping[int, float], scale: float = 1.0) -> Interval:
    """Steps multiplier: per-seed ratios codec / base (times ``scale``) over the seeds both have, with their
    interval."""
    seeds = sorted(set(codec_steps) & set(base_steps))
    if not seeds:
        raise ValueError(f"no common seed between {sorted(codec_steps)} and {sorted(base_steps)}")
    return mean_interval([codec_steps[s] / base_steps[s] * scale for s in seeds])


def missed_bound(missed_within: Mapping, bf16_steps: Mapping) -> float | None:
    """The lower bound on the steps multiplier of a codec that missed the target: ``missed_within[seed]`` (the
    longest schedule it ran with that seed) over ``bf16_steps[seed]`` (bf16's steps to target on that seed and
    schedule), the smallest over the seeds both have; None without one."""
    bounds = [missed_within[s] / bf16_steps[s] for s in missed_within if bf16_steps.get(s)]
    return min(bounds) if bounds else None


def missed_text(missed_within: Mapping, seeds: bool = False) -> str:
    """``missed within 500 steps``: a row that missed, by the longest schedule each seed that missed ran
    (``missed_within``: {seed: steps}); ``seeds``: ``missed within 500 steps (seeds 1, 2) and 740 steps (seed 3)``."""
    by_steps: dict[int, list[str]] = {}
    for seed, steps in missed_within.items():
        by_steps.setdefault(steps, []).append(str(seed))
    if not seeds:
        return "missed within " + "/".join(str(n) for n in sorted(by_steps)) + " steps"
    return "missed within " + " and ".join(f"{n} steps ({'seed' if len(s) == 1 else 'seeds'} {', '.join(s)})"
                                           for n, s in sorted(by_steps.items()))


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Codec A against codec B: ``ratio`` is the mean over their common seeds of the same-seed ratio A / B (times a
    common scale), with its interval."""

    ratio: Interval

    @property
    def verdict(self) -> str:
        """"within noise" (the interval holds 1), "lower" or "higher" (it does not), "one seed" (no interval)."""
        if self.ratio.n < 2:
            return "one seed"
        if self.ratio.low <= 1.0 <= self.ratio.high:
            return "within noise"
        return "lower" if self.ratio.high < 1.0 else "higher"

    def text(self, digits: int = 2) -> str:
        """``0.97x [0.80, 1.15], within noise``; ``0.97x (one seed)``."""
        return self.ratio.text(digits, "x") + ("" if self.ratio.n < 2 else f", {self.verdict}")


def compare(a: Mapping[int, float], b: Mapping[int, float], scale: float = 1.0) -> Comparison:
    """A against B over the seeds both have: per seed ``a[seed] / b[seed] * scale`` (steps multipliers: the steps
    ratio; with ``scale`` the s/step ratio A / B: the ratio of T), the mean with its Student-t interval."""
    return Comparison(paired_ratio(a, b, scale))
