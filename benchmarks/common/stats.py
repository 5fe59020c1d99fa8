"""The studies' statistics, written once: Student's t quantile and the 95% interval of a mean.

Every study's interval comes from here (``interval95``, ``score.mean_interval`` and
the pages built on them): two-sided 95%, Student's t with n - 1 degrees of freedom over n paired values.
"""

from __future__ import annotations

import statistics

# Student's t, two-sided 95% (upper 97.5% point), by degrees of freedom; beyond 30 the Cornish-Fisher
# expansion around the normal quantile (within 1e-3 of the exact value there).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
         29: 2.045, 30: 2.042}
_Z975 = 1.959964


def t975(df: int) -> float:
    """Upper 97.5% point of Student's t with ``df`` >= 1 degrees of freedom (``ValueError`` below 1: one value
    has no interval)."""
    if df < 1:
        raise ValueError(f"t975: df {df} < 1: need at least 1 degree of freedom (two values)")
    if df in _T975:
        return _T975[df]
    z = _Z975
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def half_width(values: list[float]) -> float:
    """The 95% interval's half width of the mean of ``values`` (two or more)."""
    return t975(len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5


def interval95(values: list[float]) -> tuple[float, float] | None:
    """Two-sided 95% t-interval of the mean of ``values`` (None with fewer than 2)."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    half = half_width(values)
    return mean - half, mean + half
