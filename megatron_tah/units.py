"""Units shared by the CLI tools; imports nothing heavy (no torch)."""

from __future__ import annotations

import math
import re

_RATE_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_bandwidth(text: str | float | int) -> float:
    """Link rate in bits/s from ``"100mbit"``, ``"1gbit"``, ``"500Mbps"``, ``"10gbps"`` or a number (bits/s)."""
    if isinstance(text, (int, float)):
        rate = float(text)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?)(?:bit|bps|b/s)?\s*", str(text).lower())
        if not match:
            raise ValueError(f"cannot read bandwidth {text!r}: use e.g. 100mbit, 1gbit, 500mbps")
        rate = float(match.group(1)) * _RATE_UNITS[match.group(2)]
    if not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"bandwidth must be a positive rate, got {text!r}")
    return rate
