"""The speedrun's scoring rules: steps to a target loss, steady seconds per step, T, and intervals.

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
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Iterable, Mapping, Sequence

# Two-sided 95% Student-t quantiles t_{0.975, df}, df = 1 .. 10 (beyond: 1.96 + a small correction).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom (``df >= 1``)."""
    if df < 1:
        raise ValueError(f"df = {df}: need at least 1 degree of freedom (two values)")
    return _T975[df - 1] if df <= len(_T975) else 1.96 + 2.4 / df


def steps_to_target(validations: Iterable[tuple[int, float]], target: float) -> int | None:
    """The first iteration (ascending) whose validation loss is ``<= target``; None: the run missed it."""
    for iteration, loss in sorted(validations):
        if math.isfinite(loss) and loss <= target:
            return int(iteration)
    return None


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
    half = t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return Interval(mean, mean - half, mean + half, len(values))


def paired_ratio(codec_steps: Mapping[int, float], base_steps: Mapping[int, float]) -> Interval:
    """Steps multiplier: per-seed ratios codec / base over the seeds both have, with their interval."""
    seeds = sorted(set(codec_steps) & set(base_steps))
    if not seeds:
        raise ValueError(f"no common seed between {sorted(codec_steps)} and {sorted(base_steps)}")
    return mean_interval([codec_steps[s] / base_steps[s] for s in seeds])
