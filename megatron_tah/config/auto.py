"""``auto``'s settings, declared once: a pipeline direction whose codec is chosen per link.

``AutoSettings`` holds every setting with its default and checks them (``ValueError`` naming the
setting first: ``interval = 0: ...``). ``TahConfig``'s ``tah_auto_*`` fields take their defaults
from ``DEFAULTS`` and are checked by building an ``AutoSettings`` (the message then names the field);
the link's auto (``link/auto.py``, ``link/choice.py``) reads the same object.

The steps multipliers (``STEPS_MULTIPLIER``, ``STEPS_AT_LEAST``) are read from ``measured.json``, the package's
record of what the studies measured (``MEASURED``), not written here.

The candidates (``CANDIDATES``) are ``none``, ``fp8``, every ``--tah-preset`` but ``none`` and the candidates that
are not a preset (``NON_PRESET``: ``fixedpoint4`` and the studies' candidates whose steps were measured), each with
its fields and one-line description (``candidate_fields``, ``candidate_description``) and standing for its codec of
the direction; ``TahConfig.auto_candidate_codec`` builds them.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import math

from .presets import PRESETS, Preset

AUTO = "auto"  # a value of tah_forward_codec / tah_backward_codec
DIRECTIONS = ("forward", "backward")
CHANNEL_GRADIENTS = {"tah_backward_codec": "channel", "tah_backward_bits": 3, "tah_backward_stochastic_rounding": True}
NON_PRESET: dict[str, Preset] = {
    "none": Preset("uncompressed both ways", {"tah_forward_codec": "none", "tah_backward_codec": "none"}),
    "fp8": Preset("FP8 both ways", {"tah_forward_codec": "fp8", "tah_backward_codec": "fp8"}),
    "fixedpoint4": Preset("direct 4-bit fixed-point activations, paper's 6-bit gradients",
                          {"tah_forward_codec": "fixedpoint", "tah_forward_bits": 4, "tah_tile_size": 64,
                           "tah_backward_codec": "fixedpoint", "tah_backward_bits": 6, "tah_backward_tile_size": 32}),
    # The studies' candidates whose steps at depth 8 were measured (MEASURED): auto may choose them too.
    "lowrank8": Preset("lowrank with 8 principal directions", {**PRESETS["lowrank"], "tah_lowrank_rank": 8}),
    "channel": Preset("per-channel 4-bit activations, per-channel 3-bit gradients rounded stochastically",
                      {"tah_forward_codec": "channel", "tah_forward_bits": 4, **CHANNEL_GRADIENTS}),
    "channel6": Preset("channel with 2-bit gradients", {"tah_forward_codec": "channel", "tah_forward_bits": 4,
                                                        **CHANNEL_GRADIENTS, "tah_backward_bits": 2}),
    "channel9": Preset("channel with 6-bit activations",
                       {"tah_forward_codec": "channel", "tah_forward_bits": 6, **CHANNEL_GRADIENTS}),
}
"""Candidates that are not a ``--tah-preset``: the fields each sets (besides the backend and checksum)."""
CANDIDATES = ("none", "fp8") + tuple(name for name in PRESETS if name != "none") + tuple(
    name for name in NON_PRESET if name not in ("none", "fp8"))
DEFAULT_CANDIDATES = ("none", "fp8", "paper", "hadint4", "lowrank", "fixedpoint4")


def check_candidate(name: str) -> None:
    """``ValueError`` unless ``name`` is one of ``CANDIDATES``."""
    if name not in CANDIDATES:
        raise ValueError(f"candidate {name!r}: choose among {', '.join(CANDIDATES)}")


def candidate_fields(name: str) -> dict:
    """The ``TahConfig`` fields candidate ``name`` sets on both directions: its own (``NON_PRESET``), or its preset's
    name."""
    check_candidate(name)
    return dict(NON_PRESET[name]) if name in NON_PRESET else {"tah_preset": name}


def candidate_description(name: str) -> str:
    """Candidate ``name``'s one line: its own, or its preset's."""
    check_candidate(name)
    return (NON_PRESET.get(name) or PRESETS[name]).description
FLOOR_REFERENCE = "paper"  # the default TAH-Quant codec: its error is the default accuracy floor


MEASURED: dict = json.loads(importlib.resources.files(__package__).joinpath("measured.json").read_text())
"""What the studies measured, shipped as package data (``measured.json``, written by the studies that measured it:
``benchmarks/real_model/measured.py``): per pipeline depth, the steps multipliers below, each row with its page, command, date
and host."""

STEPS_MULTIPLIER: dict[int, dict[str, float]] = {
    int(depth): dict(row["multipliers"]) for depth, row in MEASURED["steps_multiplier"].items()}
"""Measured steps to a loss relative to uncompressed training, ``{pipeline depth: {candidate: multiplier}}``, both
directions compressed (``MEASURED``): from the real-model study at each depth it ran (docs/REAL_MODEL.md: steps to
bf16's target over seeds, the model evaluated uncompressed, or the lower bound of a codec that missed it);
``tests/studies/test_auto_depth.py`` checks them against the page's committed JSON."""


DIRECTION_SHARES: dict[int, dict[str, float]] = {
    int(depth): dict(row["shares"]) for depth, row in MEASURED.get("direction_shares", {}).items()}
"""The forward direction's share of a candidate's steps multiplier (of its logarithm), ``{pipeline depth:
{candidate: share}}``, where the whole-run study trained with each direction's codec alone (``MEASURED``); the
backward direction takes the rest."""


def steps_multiplier(candidate: str, depth: int, direction: str = "forward") -> float:
    """How many times uncompressed training's steps ``candidate`` needs to reach the same loss in a pipeline of
    ``depth`` stages, charged to ``direction``: the row of the deepest measured depth at or below ``depth`` (none
    below it: 1.0, the parity study's gaps at depth 4 being within 2%); ``none`` is 1.0; a candidate that row lacks
    takes the row's largest multiplier (unmeasured is not assumed free). The multiplier ``m`` is split between the
    directions where a share ``s`` was measured (``DIRECTION_SHARES``, the deepest depth at or below ``depth``):
    forward ``m ** s``, backward ``m ** (1 - s)``, so the two charges multiply to ``m``; elsewhere the forward codec
    carries it whole and the backward direction is 1.0 (the depth study, docs/DEPTH.md: at depth 8 the forward
    codec carries the penalty)."""
    measured = [d for d in STEPS_MULTIPLIER if d <= depth]
    if candidate == "none" or not measured:
        return 1.0
    row = STEPS_MULTIPLIER[max(measured)]
    whole = row.get(candidate, max(row.values(), default=1.0))
    split = [d for d in DIRECTION_SHARES if d <= depth]
    share = DIRECTION_SHARES[max(split)].get(candidate) if split else None
    if share is None:
        return whole if direction == "forward" else 1.0
    return whole ** (share if direction == "forward" else 1.0 - share)


STEPS_AT_LEAST: dict[int, frozenset[str]] = {
    int(depth): frozenset(row["at_least"]) for depth, row in MEASURED["steps_multiplier"].items()}
"""The entries of ``STEPS_MULTIPLIER`` that are lower bounds, not steps to target: the codec missed the target (the
speedrun) or its final loss was read against the uncompressed curve (the depth study). They are charged, but they
do not tell how many steps the codec needs, so they waive nothing (``steps_measured``)."""


def steps_measured(candidate: str, depth: int) -> bool:
    """Whether ``candidate``'s steps to a loss were measured at ``depth`` (it is in the row ``steps_multiplier``
    reads, and not as a lower bound: ``STEPS_AT_LEAST``): then its time to target is known, and auto judges it by
    that, not by the default error floor."""
    measured = [d for d in STEPS_MULTIPLIER if d <= depth]
    if not measured:
        return False
    row = max(measured)
    return candidate in STEPS_MULTIPLIER[row] and candidate not in STEPS_AT_LEAST.get(row, frozenset())


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class AutoSettings:
    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    """Codecs auto chooses among, names of ``CANDIDATES``; a comma-separated string is split."""

    max_error: float | None = None
    """Accuracy floor: largest relative round-trip error allowed; None: the default TAH-Quant codec's (paper) error,
    waived for a candidate whose steps were measured at the pipeline's depth (``steps_measured``)."""

    interval: int = 50
    """Measure the link and reconsider the codec every this many iterations (and at the handshake)."""

    gain: float = 0.05
    """Predicted speed-up a switch needs (0.05: the new codec's message time <= 95% of the current one's)."""

    patience: int = 2
    """Consecutive measurements that must show that gain before the codec switches."""

    jump: float = 0.5
    """Predicted speed-up that switches at the first measurement showing it, without ``patience`` (0.5: the new
    codec's message time <= half the current one's; a rate that fell this far is not a measurement's noise)."""

    overlap: float = 0.0
    """Share of encode + decode time the schedule hides behind compute (0: none, 1: all)."""

    memory: int = 4
    """Measurements a rate measured at one message size is kept for predicting that size and smaller ones,
    and a codec that failed its probation is left out of the choice."""

    probation: int = 2
    """Iterations a new codec runs before its iteration times are compared with the previous codec's (0: never)."""

    def __post_init__(self):
        candidates = self.candidates
        if isinstance(candidates, str):
            candidates = tuple(part.strip() for part in candidates.split(",") if part.strip())
        object.__setattr__(self, "candidates", tuple(candidates))
        if not self.candidates:
            raise ValueError("candidates is empty: name at least one of " + ", ".join(CANDIDATES))
        unknown = [name for name in self.candidates if name not in CANDIDATES]
        if unknown:
            raise ValueError(f"candidates {unknown}: choose among {', '.join(CANDIDATES)}")
        if len(set(self.candidates)) != len(self.candidates):
            raise ValueError(f"candidates {self.candidates} name a codec twice")
        if self.max_error is None and FLOOR_REFERENCE not in self.candidates:
            raise ValueError(f"max_error = None takes the floor from candidate {FLOOR_REFERENCE!r}, which "
                             f"candidates {self.candidates} lack: add it or give max_error")
        if self.max_error is not None and not (math.isfinite(self.max_error) and self.max_error >= 0):
            raise ValueError(f"max_error = {self.max_error!r}: must be a finite number >= 0 (or None)")
        if not _is_int(self.interval) or self.interval < 1:
            raise ValueError(f"interval = {self.interval!r}: must be an integer >= 1")
        if not 0.0 <= self.gain < 1.0:
            raise ValueError(f"gain = {self.gain!r}: must lie in [0, 1)")
        if not self.gain <= self.jump < 1.0:
            raise ValueError(f"jump = {self.jump!r}: must lie in [gain = {self.gain!r}, 1)")
        if not _is_int(self.patience) or self.patience < 1:
            raise ValueError(f"patience = {self.patience!r}: must be an integer >= 1")
        if not _is_int(self.memory) or self.memory < 1:
            raise ValueError(f"memory = {self.memory!r}: must be an integer >= 1")
        if not _is_int(self.probation) or self.probation < 0:
            raise ValueError(f"probation = {self.probation!r}: must be an integer >= 0")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"overlap = {self.overlap!r}: must lie in [0, 1]")

    def start(self) -> str:
        """The candidate links start with, before their first measurement: none, else paper, else the first.
        ``none`` sends the largest messages, and a rate measured on large messages holds for smaller ones,
        not the other way round (a link's burst allowance carries small messages faster than its sustained
        rate), so the first choice rests on the measurement that extrapolates safely."""
        return next(name for name in ("none", "paper", self.candidates[0]) if name in self.candidates)


DEFAULTS = AutoSettings()
"""The settings' defaults (``TahConfig``'s ``tah_auto_*`` defaults are these)."""
