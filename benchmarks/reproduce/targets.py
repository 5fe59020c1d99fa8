"""The reproduction's yardsticks: the papers' reported numbers (``PAPER_*``) and the targets set for them
(``TARGETS``), and how ``docs/RESULTS.md`` prints a number."""

from __future__ import annotations

import math

# The papers' numbers: GPT2-XL, 8 stages, tokens/s (FP32, AQ-SGD, TAH-Quant).
PAPER_THROUGHPUT = {"1gbit": (2600, 4749, 5650), "500mbit": (2482, 4311, 5749), "300mbit": (1761, 4369, 5120),
                    "100mbit": (751, 3310, 4045)}
PAPER_ABLATIONS = {"abl_tau0": 2.60, "tah": 2.55, "abl_tau4": 2.57, "abl_tauinf": 2.63,
                   "abl_mix100": 2.51, "abl_mix50": 2.57, "abl_mix0": 2.60}
RESOLVED = 0.005
"""Loss differences (relative) below this are read as equal in the generated prose."""
TARGETS = {"of_bound": 0.85, "paper_vs_fp32": 4.3, "paper_vs_bf16": 2.4, "loss_gap": 0.01, "direct3_worse": 0.005,
           "auto": 0.97}


def _f(x, spec=".2f", missing="n/a") -> str:
    return missing if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _x(x) -> str:
    """``1.23x``, or ``n/a``."""
    return "n/a" if x is None else f"{x:.2f}x"


def _pct(x, spec=".2f") -> str:
    return "n/a" if x is None else f"{100 * x:{spec}}%"


def _ok(flag) -> str:
    return "n/a" if flag is None else ("**met**" if flag else "**not met**")


def _mib(kb):
    return None if kb is None else kb / 1024
