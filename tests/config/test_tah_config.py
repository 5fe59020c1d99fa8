"""``TahConfig`` on its own: each codec option's range checked once, the rules between options that the codecs'
declared capabilities imply, and the auto fields' defaults and checks (the flags on Megatron's parser:
``tests/megatron/test_arguments.py``)."""

from __future__ import annotations

import pytest

from megatron_tah.config import AutoSettings, TahConfig


def test_auto_fields_take_their_defaults_and_checks_from_auto_settings():
    settings, config = AutoSettings(), TahConfig()
    assert config.auto_settings() == settings
    assert (config.tah_auto_candidates, config.tah_auto_max_error, config.tah_auto_interval,
            config.tah_auto_probation) == (",".join(settings.candidates), settings.max_error, settings.interval,
                                           settings.probation)
    with pytest.raises(ValueError, match="tah_auto_interval = 0: must be an integer >= 1"):
        TahConfig(tah_auto_interval=0)
    with pytest.raises(ValueError, match="tah_auto_max_error = nan"):
        TahConfig(tah_auto_max_error=float("nan"))


def test_a_codec_option_changes_only_its_codec_and_its_range_is_checked_once():
    config = TahConfig(tah_forward_codec="tah", tah_backward_codec="tah", tah_high_ratio=0.5, tah_tile_size=32)
    assert config.forward_codec().high_ratio == 0.5 and config.backward_codec().high_ratio == 0.5
    assert (config.forward_codec().tile_size, config.backward_codec().tile_size) == (32, 32)  # each direction's
    assert TahConfig(tah_forward_codec="fixedpoint", tah_high_ratio=0.5).forward_codec().config() == {
        "bits": 4, "tile_size": 64, "stochastic_rounding": False}
    for bad, message in ((dict(tah_high_ratio=-0.1), r"tah_high_ratio = -0.1: must lie in \[0, 1\]"),
                         (dict(tah_outlier_threshold=float("nan")), "tah_outlier_threshold = nan: must be >= 0"),
                         (dict(tah_lowrank_rank=0), r"tah_lowrank_rank = 0: must lie in \[1, 256\]"),
                         (dict(tah_allocation="row"), "tah_allocation = 'row': choose one of token, tile"),
                         (dict(tah_int8_block_size=100), "tah_int8_block_size = 100: choose one of 32, 64"),
                         (dict(tah_aqsgd_warmup_samples=-1), "tah_aqsgd_warmup_samples = -1: must be >= 0")):
        with pytest.raises(ValueError, match=message):
            TahConfig(**bad)  # whichever codec is selected: the value is the flag's


def test_rules_between_options_come_from_the_declared_capabilities():
    with pytest.raises(ValueError, match="'aqsgd': it compresses activations only"):
        TahConfig(tah_backward_codec="aqsgd")
    with pytest.raises(ValueError, match="tah_warmup_iters with tah_forward_codec = 'aqsgd'"):
        TahConfig(tah_forward_codec="aqsgd", tah_warmup_iters=2)
    with pytest.raises(ValueError, match="tah_eval_traffic = 'both' with tah_forward_codec = 'aqsgd'"):
        TahConfig(tah_forward_codec="aqsgd", tah_eval_traffic="both")
    with pytest.raises(ValueError, match="tah_backend = 'triton' with tah_forward_codec = 'mxfp4': it has no Triton"):
        TahConfig(tah_forward_codec="mxfp4", tah_backward_codec="fixedpoint", tah_backend="triton")
    assert TahConfig(tah_forward_codec="tah", tah_backward_codec="fixedpoint", tah_backend="triton").tah_backend == "triton"
    # Stochastic rounding is never silently ignored: a codec rounding to nearest refuses it.
    with pytest.raises(ValueError, match="tah_forward_codec = 'fp8': it rounds to nearest"):
        TahConfig(tah_forward_codec="fp8", tah_backward_codec="fixedpoint", tah_stochastic_rounding=True)
    with pytest.raises(ValueError, match="neither direction"):
        TahConfig(tah_stochastic_rounding=True)
    both = TahConfig(tah_forward_codec="tah", tah_stochastic_rounding=True)  # none backward: nothing to round
    assert both.forward_codec().stochastic_rounding
