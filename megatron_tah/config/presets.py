"""``--tah-preset``: the named sets of pipeline-codec options a user should choose from (``PRESETS``), each with the
one line that describes it.

A preset is what the studies found worth choosing (docs/REAL_MODEL.md on a real model, docs/SPEEDRUN.md on the toy),
plus ``paper``, TAH-Quant as its paper specifies it. The studies' other candidates are theirs
(``benchmarks/common/codecs.py``'s ``CODECS``), or ``auto``'s when it may choose them (``auto.NON_PRESET``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class Preset(Mapping):
    """A named set of ``TahConfig`` fields with its one-line ``description``; read as the mapping of its fields
    (``PRESETS[name]["tah_forward_codec"]``, ``{**PRESETS[name]}``)."""

    description: str
    fields: dict

    def __getitem__(self, name: str):
        return self.fields[name]

    def __iter__(self):
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self.fields)


# Hadamard INT4 gradients rounded stochastically, one bf16 scale per 64 values (Triton kernels: kernels/hadint.py).
HADINT4_GRADIENTS = {"tah_backward_codec": "hadint", "tah_backward_bits": 4, "tah_backward_tile_size": 64,
                     "tah_backward_stochastic_rounding": True}

PRESETS: dict[str, Preset] = {
    "none": Preset("nothing preset: the codec flags as given", {}),
    # TAH-Quant as its paper and the authors' code specify it (docs/CODECS.md), with the 6-bit tile-32 backward codec.
    "paper": Preset("TAH-Quant as its paper specifies it, with 6-bit fixed-point gradients",
                    {"tah_forward_codec": "tah", "tah_backward_codec": "fixedpoint", "tah_tile_size": 64,
                     "tah_high_bits": 4, "tah_low_bits": 3, "tah_high_ratio": 0.8, "tah_outlier_threshold": 2.0,
                     "tah_allocation": "token", "tah_backward_bits": 6, "tah_backward_tile_size": 32}),
    "hadint4": Preset("random-sign Hadamard INT4 both ways, gradients rounded stochastically",
                      {"tah_forward_codec": "hadint", "tah_forward_bits": 4, "tah_tile_size": 64, **HADINT4_GRADIENTS}),
    # The message's 16 principal directions apart (8-bit basis, 6-bit coefficients) and the residual as Hadamard INT3.
    "lowrank": Preset("16 principal directions apart and a Hadamard INT3 residual; hadint4's gradients",
                      {"tah_forward_codec": "lowrank", "tah_forward_bits": 3, "tah_tile_size": 64,
                       "tah_lowrank_rank": 16, "tah_lowrank_coef_bits": 6, **HADINT4_GRADIENTS}),
    # lowrank's activations with Hadamard INT3 gradients rounded to nearest (biased, but about 0.7x stochastic
    # rounding's error at the same bits): about 6.6 bits both ways at [1024, 8, 1024], 5.4 with --tah-entropy-coding
    # (docs/REAL_MODEL.md, where it is also served through the pipeline at --tah-eval-forward-bits 8).
    "lowrank_h3_rn": Preset("lowrank's activations, Hadamard INT3 gradients rounded to nearest",
                            {"tah_forward_codec": "lowrank", "tah_forward_bits": 3, "tah_tile_size": 64,
                             "tah_lowrank_rank": 16, "tah_lowrank_coef_bits": 6, "tah_backward_codec": "hadint",
                             "tah_backward_bits": 3, "tah_backward_tile_size": 64,
                             "tah_backward_stochastic_rounding": False}),
    # Each sequence's largest token sent apart in bf16: a decoder LM's attention sink would otherwise set every
    # channel's range.
    "channel_h4": Preset("per-channel 6-bit activations, each sequence's largest token apart in bf16; hadint4's "
                         "gradients",
                         {"tah_forward_codec": "channel", "tah_forward_bits": 6, "tah_channel_outlier_tokens": 1,
                          **HADINT4_GRADIENTS}),
    # 6 bits at the first and sixth of seven boundaries, where 5 bits cost SmolLM2-135M most alone (docs/REAL_MODEL.md,
    # "Where the model needs bits"), 5 at the others; at any depth the list stretches.
    "channel_b_h4": Preset("channel_h4 with bits per boundary, 6,5,5,5,5,6,5 (--tah-boundary-bits)",
                           {"tah_forward_codec": "channel", "tah_forward_bits": 6, "tah_channel_outlier_tokens": 1,
                            **HADINT4_GRADIENTS, "tah_boundary_bits": "6,5,5,5,5,6,5"}),
}
