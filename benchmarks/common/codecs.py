"""The codecs every study runs, declared once: name -> the ``TahConfig`` fields of its runs (``CODECS``), and what
follows from a name (its flags, whether its bytes are known ahead, the busiest boundary's bytes)."""

from __future__ import annotations

from megatron_tah.config import PRESETS, candidate_fields

CODECS: dict[str, dict] = {
    "bf16": {},  # uncompressed: megatron_tah's none codec (the raw bf16 message behind a 16-byte header)
    "paper": {"tah_preset": "paper"},
    "hadint4": {"tah_preset": "hadint4"},
    "lowrank": {"tah_preset": "lowrank"},
    # lowrank trained, evaluated (served) with its residual at 5 bits
    "lowrank_s5": {"tah_preset": "lowrank", "tah_eval_forward_bits": 5},
    # auto's candidates that are no preset: lowrank with 8 directions, per-channel codecs (their fields: config.auto)
    "lowrank8": candidate_fields("lowrank8"),
    # lowrank both ways, the gradients' residual rounded stochastically (unbiased): 3.38 bits each way at
    # [1024, 8, 1024]. The toy's gradients hold 0.87 of their energy in 16 directions, SmolLM2's 0.28
    # (docs/CODECS.md): a toy-only candidate, not a preset.
    "lowrank2": {"tah_forward_codec": "lowrank", "tah_forward_bits": 3, "tah_tile_size": 64,
                 "tah_lowrank_rank": 16, "tah_lowrank_coef_bits": 6, "tah_backward_codec": "lowrank",
                 "tah_backward_bits": 3, "tah_backward_tile_size": 64, "tah_backward_stochastic_rounding": True},
    # the lowrank_h3_rn preset: lowrank's activations with Hadamard INT3 gradients rounded to nearest, 3.38 + 3.25
    # bits at [1024, 8, 1024]; a gradient codec that does not lean on a few directions (docs/CODECS.md). Beside it,
    # its gradients rounded stochastically (unbiased, about 1.4x the rounding error), and those with a bf16 scale
    # per 32 values instead of 64 (finer steps where a tile holds a large value: 3.38 + 3.50 bits). Its runs name
    # the fields, as they did before it was a preset.
    "lowrank_h3_rn": dict(PRESETS["lowrank_h3_rn"]),
    "lowrank_h3": {**PRESETS["lowrank_h3_rn"], "tah_backward_stochastic_rounding": True},
    "lowrank_h3_t32": {**PRESETS["lowrank_h3_rn"], "tah_backward_stochastic_rounding": True,
                       "tah_backward_tile_size": 32},
    # the channel_h4 preset: per-channel 6-bit activations with each sequence's largest token sent apart (a real
    # model's attention sink would set every channel's range), Hadamard INT4 gradients as hadint4's: 6.02 + 4.25
    # bits at [1024, 8, 1024]; on a real model its gradients err as on the toy, its activations 1.7x more
    # (docs/CODECS.md). Its runs name the fields, as they did before it was a preset.
    "channel_h4": dict(PRESETS["channel_h4"]),
    # the same with 5-, 4- and 3-bit activations: 5.02, 4.02 and 3.02 + 4.25 bits
    **{f"channel{bits}_h4": {**PRESETS["channel_h4"], "tah_forward_bits": bits} for bits in (5, 4, 3)},
    # 5-bit activations and Hadamard INT3 gradients: 5.02 + 3.25 bits
    "channel5_h3": {**PRESETS["channel_h4"], "tah_forward_bits": 5, "tah_backward_bits": 3},
    # channel_h4 through the lossless coder (--tah-entropy-coding): the same values, fewer bytes
    "channel_h4_ec": {**PRESETS["channel_h4"], "tah_entropy_coding": True},
    "fixedpoint4": candidate_fields("fixedpoint4"),
    "channel": candidate_fields("channel"),
    "channel6": candidate_fields("channel6"),
    "channel9": candidate_fields("channel9"),
    # between channel and channel9: 5-bit activations (the forward codec carries the PP 8 penalty, docs/DEPTH.md)
    "channel_f5": {"tah_forward_codec": "channel", "tah_forward_bits": 5, "tah_backward_codec": "channel",
                   "tah_backward_bits": 3, "tah_backward_stochastic_rounding": True},
    # lowrank's activations with per-channel stochastically rounded gradients (as channel9's): 3 bits, 6.38 bits
    # both ways at [1024, 8, 1024]; 2 bits, 5.38 (the candidate for <= 6 bits)
    **{f"lowrank_g{bits}": {"tah_forward_codec": "lowrank", "tah_forward_bits": 3, "tah_tile_size": 64,
                            "tah_lowrank_rank": 16, "tah_lowrank_coef_bits": 6, "tah_backward_codec": "channel",
                            "tah_backward_bits": bits, "tah_backward_stochastic_rounding": True} for bits in (3, 2)},
    # channel_h4's activations with per-channel 3-bit stochastically rounded gradients: 6.02 + 3.00 bits at
    # [1024, 8, 1024] (per direction: a real model's gradients err below the batch-to-batch noise at 3 bits,
    # docs/REAL_MODEL.md)
    "channel_h4_g3": {**PRESETS["channel_h4"], "tah_backward_codec": "channel", "tah_backward_bits": 3,
                      "tah_backward_tile_size": 32},
    # the channel_b_h4 preset: channel5_h4 with 6 bits at the two boundaries that cost SmolLM2-135M most at 5 bits
    # (after layers 3 and 23 of 30, the first and sixth of depth 8's seven; python -m benchmarks.real_model.sensitivity):
    # 5.31 + 4.25 bits
    "channel_b_h4": dict(PRESETS["channel_b_h4"]),
    # the same with Hadamard INT3 gradients (3.25 bits; on SmolLM2 they err less than per-channel 3-bit ones):
    # 5.31 + 3.25 bits
    "channel_b_h3": {**PRESETS["channel_b_h4"], "tah_backward_bits": 3},
    # channel5_h4's mean bits placed by the same measure: 6 where 5 bits cost most alone, 4 where 4 bits cost least
    # (after layers 11 and 19): 5.02 + 4.25 bits on average, as channel5_h4's
    "channel_b5_h4": {**PRESETS["channel_b_h4"], "tah_boundary_bits": "6,5,4,5,4,6,5"},
    # about 6 bits both ways at [1024, 8, 1024]: channel_h4's activations at 4 bits with per-channel 2-bit
    # stochastically rounded gradients (4.02 + 2.00)
    "channel4_g2": {**PRESETS["channel_h4"], "tah_forward_bits": 4, "tah_backward_codec": "channel",
                    "tah_backward_bits": 2, "tah_backward_tile_size": 32},
    # channel_h4's activations at 4 and 3 bits with Hadamard INT3 gradients rounded stochastically (per-channel
    # gradients at 2-3 bits cost SmolLM2 steps even evaluated uncompressed, Hadamard INT4 ones did not):
    # 4.02 + 3.25 and 3.02 + 3.25 bits at [1024, 8, 1024]
    "channel4_h3": {**PRESETS["channel_h4"], "tah_forward_bits": 4, "tah_backward_bits": 3},
    "channel3_h3": {**PRESETS["channel_h4"], "tah_forward_bits": 3, "tah_backward_bits": 3},
    # trained as channel4_h3, evaluated (served) through the pipeline at 6 bits: the bits inference needs
    "channel4_h3_s6": {**PRESETS["channel_h4"], "tah_forward_bits": 4, "tah_backward_bits": 3,
                       "tah_eval_forward_bits": 6},
    "auto": {"tah_forward_codec": "auto", "tah_backward_codec": "auto"},
}
"""Codec name -> the ``TahConfig`` fields of its runs (``codec_flags``: as ``--tah-*`` flags)."""
# trained as lowrank_h3_rn, evaluated (served) through the pipeline with lowrank's residual at 8 bits
CODECS["lowrank_h3_rn_s8"] = {**CODECS["lowrank_h3_rn"], "tah_eval_forward_bits": 8}
# lowrank_h3_rn one direction at a time (the other uncompressed): each direction's share of its steps multiplier
CODECS["lowrank_h3_rn_fwd"] = {**CODECS["lowrank_h3_rn"], "tah_backward_codec": "none"}
CODECS["lowrank_h3_rn_bwd"] = {**CODECS["lowrank_h3_rn"], "tah_forward_codec": "none"}
ONE_DIRECTION = ("lowrank_h3_rn_fwd", "lowrank_h3_rn_bwd")
"""Measurements of one direction's share of a preset's steps multiplier: not candidates to project or to pick."""

NEEDS_LINK = ("auto",)
"""Codecs whose loss runs must see the emulated link (their choice depends on it)."""


def entropy_coded(codec: str) -> bool:
    """Whether ``codec``'s messages go through the lossless coder: their sizes vary, so they are measured."""
    return bool(CODECS[codec].get("tah_entropy_coding"))


def codec_flags(codec: str) -> list[str]:
    """``CODECS[codec]`` as Megatron flags: ``tah_tile_size`` -> ``--tah-tile-size``; a true bool is its bare flag."""
    from megatron_tah.megatron.arguments import fields_flags

    return fields_flags(CODECS[codec])


def forward_codecs(config, stages: int) -> list:
    """The forward codec of each of the ``stages - 1`` boundaries of a pipeline of ``stages`` (one and the same
    unless ``--tah-boundary-bits`` gives each its bits)."""
    return [config.forward_codec(i, stages - 1) for i in range(max(stages - 1, 1))] if config.boundary_bits() \
        else [config.forward_codec()]


def busiest_nbytes(config, shape, stages: int) -> int:
    """Wire bytes of the largest forward message of a bf16 ``shape`` among the pipeline's boundaries: the link
    that sets the pipeline's pace when every link has the same rate (per-boundary bits differ per link)."""
    import torch

    return max(c.wire_nbytes(shape, torch.bfloat16) for c in forward_codecs(config, stages))
