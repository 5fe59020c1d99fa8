"""The --tah-* flags on the real Megatron-LM parser (megatron.training.arguments from the megatron-core wheel)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re

import megatron.training.arguments as megatron_arguments
import pytest
import torch

from megatron_tah.config import TahConfig
from megatron_tah.megatron import arguments as tah_arguments


def gpt_argv(pipeline_size: int = 2, *extra: str) -> list[str]:
    """A realistic Megatron-LM GPT command line (files are not opened by the parser)."""
    return [
        "pretrain_gpt.py",
        "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
        "--seq-length", "128", "--max-position-embeddings", "128",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-4", "--train-iters", "10",
        "--pipeline-model-parallel-size", str(pipeline_size),
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "gpt2-vocab.json", "--merge-file", "gpt2-merges.txt",
        "--log-interval", "2",
        *extra,
    ]


@pytest.fixture
def installed():
    tah_arguments.install_arguments()
    yield megatron_arguments
    tah_arguments.uninstall_arguments()


def parse(monkeypatch, argv, world_size=2):
    monkeypatch.setattr("sys.argv", argv)
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    return megatron_arguments.parse_args()


def test_flags_are_generated_from_every_config_field():
    parser = tah_arguments.add_tah_arguments(argparse.ArgumentParser())
    docs = TahConfig.field_docs()
    for field in dataclasses.fields(TahConfig):
        action = parser._option_string_actions["--" + field.name.replace("_", "-")]
        assert action.dest == field.name
        assert action.help.replace("%%", "%").startswith(docs[field.name])
    # Adding twice is harmless (e.g. a script's extra_args_provider also adds them).
    assert tah_arguments.add_tah_arguments(parser) is parser


def test_realistic_command_line_without_tah_flags(monkeypatch, installed):
    args = parse(monkeypatch, gpt_argv())
    assert (args.num_layers, args.hidden_size, args.pipeline_model_parallel_size, args.lr) == (4, 256, 2, 1e-4)
    for field in dataclasses.fields(TahConfig):
        assert getattr(args, field.name) == field.default, field.name
    config = tah_arguments.tah_config_from_args(args)
    assert config == TahConfig()
    assert (type(config.forward_codec()).__name__, type(config.backward_codec()).__name__) == ("TahCodec",
                                                                                            "FixedPointCodec")


def test_realistic_command_line_with_tah_flags(monkeypatch, installed):
    args = parse(monkeypatch, gpt_argv(
        2,
        "--tah-forward-codec", "fixedpoint", "--tah-forward-bits", "5", "--tah-tile-size", "32",
        "--tah-backward-codec", "none", "--tah-high-ratio", "0.5", "--tah-outlier-threshold", "inf",
        "--tah-stochastic-rounding", "--tah-emulate-bandwidth", "100mbit", "--tah-emulate-latency-ms", "2.5",
    ))
    assert args.num_layers == 4 and args.micro_batch_size == 2
    assert args.tah_forward_codec == "fixedpoint" and args.tah_forward_bits == 5 and args.tah_tile_size == 32
    assert args.tah_high_ratio == 0.5 and math.isinf(args.tah_outlier_threshold)
    assert args.tah_stochastic_rounding is True
    assert args.tah_emulate_bandwidth == "100mbit" and args.tah_emulate_latency_ms == 2.5

    config = tah_arguments.tah_config_from_args(args)
    assert config.emulated_bandwidth_bps == 100e6
    assert config.forward_codec().config() == {"bits": 5, "tile_size": 32, "stochastic_rounding": True}
    assert type(config.backward_codec()).__name__ == "NoneCodec"
    # Megatron's own validation still runs, then the tah values are checked.
    megatron_arguments.validate_args(args)
    assert args.data_parallel_size == 1


def test_unknown_and_badly_typed_tah_values_are_argparse_errors(monkeypatch, installed, capsys):
    for bad, expected in (
        (["--tah-forward-codec", "int4"], "invalid choice: 'int4'"),
        (["--tah-backward-codec", "aqsgd"], "invalid choice: 'aqsgd'"),
        (["--tah-tile-size", "sixty"], "invalid int value: 'sixty'"),
        (["--tah-high-ratio", "most"], "invalid float value: 'most'"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            parse(monkeypatch, gpt_argv(2, *bad))
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert bad[0] in err and expected in err, err


def test_inconsistent_tah_values_fail_validation_with_one_line_naming_the_flag(monkeypatch, installed, capsys):
    args = parse(monkeypatch, gpt_argv(2, "--tah-forward-codec", "fixedpoint", "--tah-forward-bits", "12"))
    with pytest.raises(SystemExit) as exit_info:
        megatron_arguments.validate_args(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: invalid megatron_tah flags")
    assert re.search(r"--tah-forward-bits 12.*\b12\b", err), err
    args = parse(monkeypatch, gpt_argv(2, "--tah-backward-codec", "none", "--tah-high-ratio", "1.5"))
    with pytest.raises(ValueError, match=r"--tah-high-ratio = 1.5: must lie in \[0, 1\]"):
        tah_arguments.tah_config_from_args(args)


def test_presets_set_their_fields_and_refuse_a_conflicting_flag(monkeypatch, installed):
    from megatron_tah.config import PRESETS

    # "paper" is TAH-Quant as SPEC.md specifies it: exactly the flags' defaults.
    assert dataclasses.replace(TahConfig(tah_preset="paper"), tah_preset="none") == TahConfig()
    args = parse(monkeypatch, gpt_argv(2, "--tah-preset", "hadint4", "--tah-log-json", "x.jsonl"))
    config = tah_arguments.tah_config_from_args(args)
    for name, value in PRESETS["hadint4"].items():
        assert getattr(config, name) == value, name
    assert config.tah_log_json == "x.jsonl"
    forward, backward = config.forward_codec(), config.backward_codec()
    assert forward.wire_nbytes((128, 2, 256), torch.bfloat16) * 8 / (128 * 2 * 256) < 4.3
    assert backward.stochastic_rounding and not forward.stochastic_rounding
    # The same value as the preset's is fine; another one is a conflict naming both flags.
    same = parse(monkeypatch, gpt_argv(2, "--tah-preset", "hadint4", "--tah-forward-codec", "hadint"))
    assert tah_arguments.tah_config_from_args(same) == config.__class__(**{**vars(config), "tah_log_json": None})
    clash = parse(monkeypatch, gpt_argv(2, "--tah-preset", "hadint4", "--tah-backward-bits", "5"))
    with pytest.raises(ValueError, match="--tah-backward-bits = 5 conflicts with --tah-preset = 'hadint4'"):
        tah_arguments.tah_config_from_args(clash)


def test_install_is_idempotent_and_uninstall_exact(monkeypatch):
    original_add, original_validate = megatron_arguments.add_megatron_arguments, megatron_arguments.validate_args
    try:
        tah_arguments.install_arguments()
        wrapped = megatron_arguments.add_megatron_arguments
        tah_arguments.install_arguments()
        assert megatron_arguments.add_megatron_arguments is wrapped
        assert wrapped.__wrapped__ is original_add
        assert tah_arguments.arguments_installed()
    finally:
        tah_arguments.uninstall_arguments()
    assert megatron_arguments.add_megatron_arguments is original_add
    assert megatron_arguments.validate_args is original_validate
    assert not tah_arguments.arguments_installed()
    # Without the wrapper Megatron's parser rejects the flags: they came from the wrapper.
    with pytest.raises(SystemExit):
        parse(monkeypatch, gpt_argv(2, "--tah-forward-codec", "none"))
