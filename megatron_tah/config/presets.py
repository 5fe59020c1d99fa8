"""``--tah-preset``: named sets of pipeline-codec options (``PRESETS``: name -> the ``TahConfig`` fields it sets)."""

from __future__ import annotations

PRESETS = {
    "none": {},
    # TAH-Quant as its paper and the authors' code specify it (docs/CODECS.md), with the 6-bit tile-32 backward codec.
    "paper": {"tah_forward_codec": "tah", "tah_backward_codec": "fixedpoint", "tah_tile_size": 64,
              "tah_high_bits": 4, "tah_low_bits": 3, "tah_high_ratio": 0.8, "tah_outlier_threshold": 2.0,
              "tah_allocation": "token", "tah_backward_bits": 6, "tah_backward_tile_size": 32},
    # Random-sign Hadamard INT4 both ways, one bf16 scale per 64 values (4.25 bits each way), gradients
    # rounded stochastically: the parity study's candidate (Triton kernels: kernels/hadint.py).
    "hadint4": {"tah_forward_codec": "hadint", "tah_forward_bits": 4, "tah_tile_size": 64,
                "tah_backward_codec": "hadint", "tah_backward_bits": 4, "tah_backward_tile_size": 64,
                "tah_backward_stochastic_rounding": True},
    # The message's 16 principal directions apart (8-bit basis, 6-bit coefficients) and the residual as
    # Hadamard INT3 (4.38 bits at hidden 128, 512 rows; fewer at larger sizes), gradients as in hadint4.
    "lowrank": {"tah_forward_codec": "lowrank", "tah_forward_bits": 3, "tah_tile_size": 64,
                "tah_lowrank_rank": 16, "tah_lowrank_coef_bits": 6,
                "tah_backward_codec": "hadint", "tah_backward_bits": 4, "tah_backward_tile_size": 64,
                "tah_backward_stochastic_rounding": True},
    # The same with 8 directions: fewer bits (3.88 at hidden 128, 3.63 at 256), a larger measured gap.
    "lowrank8": {"tah_forward_codec": "lowrank", "tah_forward_bits": 3, "tah_tile_size": 64,
                 "tah_lowrank_rank": 8, "tah_lowrank_coef_bits": 6,
                 "tah_backward_codec": "hadint", "tah_backward_bits": 4, "tah_backward_tile_size": 64,
                 "tah_backward_stochastic_rounding": True},
    # For deep pipelines: per-channel 4-bit activations (one asymmetric min/max per hidden channel over the
    # message's tokens, rounded to nearest) and per-channel 3-bit stochastically rounded gradients; 7.01 bits
    # both ways at [1024, 8, 1024] (8.03 at [64, 1, 128]). Steps to target at depth 8: docs/SPEEDRUN.md.
    "channel": {"tah_forward_codec": "channel", "tah_forward_bits": 4,
                "tah_backward_codec": "channel", "tah_backward_bits": 3, "tah_backward_stochastic_rounding": True},
    # The same with 2-bit gradients: 6.01 bits both ways at [1024, 8, 1024].
    "channel6": {"tah_forward_codec": "channel", "tah_forward_bits": 4,
                 "tah_backward_codec": "channel", "tah_backward_bits": 2, "tah_backward_stochastic_rounding": True},
    # The same with 6-bit activations: 9.01 bits both ways at [1024, 8, 1024]. At depth 8 the forward codec
    # carries the steps penalty (docs/DEPTH.md); two more forward bits: steps to target in docs/SPEEDRUN.md.
    "channel9": {"tah_forward_codec": "channel", "tah_forward_bits": 6,
                 "tah_backward_codec": "channel", "tah_backward_bits": 3, "tah_backward_stochastic_rounding": True},
    # Per-channel 6-bit activations with each sequence's largest token sent apart in bf16 (a decoder LM's
    # attention sink would otherwise set every channel's range) and hadint4's gradients: 6.02 + 4.25 bits at
    # [1024, 8, 1024]. Steps to target at depth 8: docs/SPEEDRUN.md.
    "channel_h4": {"tah_forward_codec": "channel", "tah_forward_bits": 6, "tah_channel_outlier_tokens": 1,
                   "tah_backward_codec": "hadint", "tah_backward_bits": 4, "tah_backward_tile_size": 64,
                   "tah_backward_stochastic_rounding": True},
    # channel_h4 with bits per boundary (--tah-boundary-bits): 6 at the first and sixth of seven boundaries, 5 at the
    # others, where 5 bits cost SmolLM2-135M most and least alone (docs/REAL_MODEL.md, "Where the model needs bits");
    # 5.31 + 4.25 bits at [1024, 8, 1024] and depth 8 (the busiest link: 6.02 + 4.25). Any depth: the list stretches.
    "channel_b_h4": {"tah_forward_codec": "channel", "tah_forward_bits": 6, "tah_channel_outlier_tokens": 1,
                     "tah_backward_codec": "hadint", "tah_backward_bits": 4, "tah_backward_tile_size": 64,
                     "tah_backward_stochastic_rounding": True, "tah_boundary_bits": "6,5,5,5,5,6,5"},
}
