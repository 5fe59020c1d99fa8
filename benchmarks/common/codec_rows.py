"""The codec table's rows (``python -m benchmarks.codec_report``; ``--real`` measures the same rows): one place."""

from __future__ import annotations

from megatron_tah.codecs import CODECS, codec_declaration
from megatron_tah.config import PRESETS

# (label, codec name, options) of the stateless rows, in table order.
STATELESS_ROWS = [
    ("none", "none", {}),
    ("fixedpoint 6b/32", "fixedpoint", {"bits": 6, "tile_size": 32}),
    ("fixedpoint 4b/64", "fixedpoint", {"bits": 4, "tile_size": 64}),
    ("fixedpoint 3b/64", "fixedpoint", {"bits": 3, "tile_size": 64}),
    ("tah (default)", "tah", {}),
    ("tah tau=inf (no rotation)", "tah", {"outlier_threshold": float("inf")}),
    ("fp8 G=128", "fp8", {"group_size": 128}),
    ("int8 B=128", "int8", {"block_size": 128}),
    ("mxfp4", "mxfp4", {}),
    ("mxfp4 + hadamard", "mxfp4", {"hadamard": True}),
    ("nvfp4", "nvfp4", {}),
    ("nvfp4 + hadamard", "nvfp4", {"hadamard": True}),
    ("hadint 4b/64", "hadint", {"bits": 4, "tile_size": 64}),
    ("hadint 4b/64 stochastic", "hadint", {"bits": 4, "tile_size": 64, "stochastic_rounding": True}),
    ("lowrank r16 c6 + hadint 3b/64", "lowrank", {"bits": 3, "tile_size": 64, "rank": 16, "coef_bits": 6}),
    ("channel 4b", "channel", {"bits": 4}),
    ("channel 3b", "channel", {"bits": 3}),
]
AQSGD_OPTIONS = {"bits": 4, "tile_size": 64, "warmup_samples": 0}

FORMER_PRESETS = ("lowrank8", "channel", "channel6", "channel9")
"""``auto``'s candidates that were presets when the committed runs were made (``config.NON_PRESET``): their rows
stay."""
STUDIED_PRESETS = tuple(name for name in PRESETS if name != "none") + FORMER_PRESETS
"""The sets of pipeline-codec options the reports measure as presets (``megatron_tah.config.candidate_fields``
names): every ``--tah-preset`` (``config.PRESETS``, read at import: a new preset joins), then ``FORMER_PRESETS``."""


def stateless_rows() -> list[tuple[str, str, dict]]:
    """``STATELESS_ROWS``, then a row at its defaults for each registered codec they leave out (but one keeping
    state per sample, which has rows of its own): a codec in the registry is in the table."""
    named = {name for _, name, _ in STATELESS_ROWS}
    return STATELESS_ROWS + [(name, name, {}) for name in CODECS
                             if name not in named and not codec_declaration(name).needs_sample_ids]
