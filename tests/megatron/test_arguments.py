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
from megatron_tah.megatron import places
from tests.helpers.codec_cases import cases


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


def refused_by_validation(monkeypatch, capsys, argv, world_size=2) -> list[str]:
    """Parse ``argv`` with the tah flags installed and run Megatron's validation, which must exit with
    argparse's status 2; the lines it printed to stderr."""
    tah_arguments.install_arguments()
    try:
        args = parse(monkeypatch, argv, world_size)
        with pytest.raises(SystemExit) as exit_info:
            megatron_arguments.validate_args(args)
    finally:
        tah_arguments.uninstall_arguments()
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


def test_flags_are_generated_from_every_config_field():
    parser = tah_arguments.add_tah_arguments(argparse.ArgumentParser())
    helps = TahConfig.field_help()
    for field in dataclasses.fields(TahConfig):
        action = parser._option_string_actions["--" + field.name.replace("_", "-")]
        assert action.dest == field.name
        assert action.help.replace("%%", "%").startswith(helps[field.name])
    # Adding twice is harmless (e.g. a script's extra_args_provider also adds them).
    assert tah_arguments.add_tah_arguments(parser) is parser


def test_realistic_command_line_without_tah_flags(monkeypatch, installed):
    args = parse(monkeypatch, gpt_argv())
    assert (args.num_layers, args.hidden_size, args.pipeline_model_parallel_size, args.lr) == (4, 256, 2, 1e-4)
    for field in dataclasses.fields(TahConfig):
        assert getattr(args, field.name) == field.default, field.name
    config = tah_arguments.tah_config_from_args(args)
    assert config == TahConfig() and config.is_off()  # opt-in: nothing is compressed without a flag
    assert (type(config.forward_codec()).__name__, type(config.backward_codec()).__name__) == ("NoneCodec",
                                                                                            "NoneCodec")


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


def test_ring_exchange_with_a_pipeline_codec_fails_validation_naming_the_flag(monkeypatch, installed, capsys):
    """Megatron's ring exchange bypasses the two transports megatron_tah replaces: refused with a codec."""
    args = parse(monkeypatch, gpt_argv(2, "--use-ring-exchange-p2p", "--tah-preset", "paper"))
    with pytest.raises(SystemExit) as exit_info:
        megatron_arguments.validate_args(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--use-ring-exchange-p2p" in err and "--tah-forward-codec tah" in err, err
    args = parse(monkeypatch, gpt_argv(2, "--use-ring-exchange-p2p", "--tah-tp-codec", "fp8"))
    places.check_args(tah_arguments.tah_config_from_args(args), args)  # the pipeline uncompressed


def test_presets_set_their_fields_and_refuse_a_conflicting_flag(monkeypatch, installed):
    from megatron_tah.config import PRESETS

    # "paper" is TAH-Quant as its paper specifies it, with the 6-bit backward codec: the codecs' own defaults.
    assert dataclasses.replace(TahConfig(tah_preset="paper"), tah_preset="none") == TahConfig(
        tah_forward_codec="tah", tah_backward_codec="fixedpoint")
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


# ----- options declared once, by the codecs ----------------------------------------------------------


def test_the_codec_option_fields_are_written_out_and_are_exactly_the_declared_options():
    """TahConfig is a plain dataclass (editors and type checkers see every field); each codec option's field
    takes its default, help and range from the codec's declaration, in registry order, none missing."""
    from megatron_tah.config import CODEC_OPTIONS, codec_option

    fields = [f for f in dataclasses.fields(TahConfig) if "option" in f.metadata]
    assert [f.name for f in fields] == list(CODEC_OPTIONS)
    for f in fields:
        option = CODEC_OPTIONS[f.name]
        assert f.metadata["option"] is option and f.default == option.default
        assert TahConfig.__annotations__[f.name] is option.type  # written in the class, not generated
    with pytest.raises(ValueError, match="tah_no_such_option"):
        codec_option("tah_no_such_option")
    table, docs = tah_arguments.flags_markdown(), TahConfig.field_docs()
    for f in dataclasses.fields(TahConfig):  # every field: a flag-table row with its help
        assert f"| `{tah_arguments.flag_name(f.name)}` |" in table and docs[f.name], f.name


COLUMNS = 80  # argparse's width on an 80-column terminal


def test_every_flag_s_help_prints_at_most_two_lines_at_80_columns_and_quotes_no_measured_number():
    """The help argparse prints for each flag (its default included) takes at most two lines on an 80-column
    terminal, laid out by argparse's own formatter beside the other flags, and holds no decimal number, ratio or
    percentage but its default and its examples' (the numbers live on the docs pages the help names)."""
    import re

    parser = tah_arguments.add_tah_arguments(argparse.ArgumentParser())
    formatter = argparse.HelpFormatter(parser.prog, width=COLUMNS - 2)  # argparse: the terminal's columns - 2
    formatter.add_arguments(parser._actions)
    width = formatter._width - min(formatter._action_max_length + 2, formatter._max_help_position)
    assert width <= 54  # the help column beside the long --tah-* flags
    for field in dataclasses.fields(TahConfig):
        action = parser._option_string_actions[tah_arguments.flag_name(field.name)]
        assert len(formatter._split_lines(formatter._expand_help(action), width)) <= 2, field.name
        text = action.help.replace("%%", "%")
        prose = text.rpartition(" Default: ")[0] or text
        assert not re.search(r"\d\.\d|\d+(\.\d+)?x\b|\d\.?\d*%", prose.replace("plus 2%", "")), field.name


def test_a_flag_s_help_is_the_first_sentence_of_its_docs_and_the_flag_page_has_the_whole():
    from megatron_tah.config.fields import first_sentence

    assert first_sentence("Bits per boundary, e.g. 6,5. In place of x.") == "Bits per boundary, e.g. 6,5."
    assert first_sentence("A fraction, 0.8 by default. More.") == "A fraction, 0.8 by default."
    docs, helps = TahConfig.field_docs(), TahConfig.field_help()
    assert set(helps) == set(docs)
    assert helps["tah_tile_size"] == first_sentence(docs["tah_tile_size"]) != docs["tah_tile_size"]  # its codecs
    assert helps["tah_channel_outlier_tokens"] != docs["tah_channel_outlier_tokens"]  # written under its field
    assert docs["tah_auto_candidates"] in tah_arguments.flags_markdown()


def test_preset_and_candidate_lists_come_from_the_registries():
    """auto's candidate help lists ``CANDIDATES`` as they are; the flag page's preset and candidate tables have a row
    per registered preset and candidate, with the description declared with it."""
    from megatron_tah.config import CANDIDATES, PRESETS, candidate_description
    from scripts import write_flags

    assert TahConfig.field_docs()["tah_auto_candidates"].endswith(f"Candidates: {', '.join(CANDIDATES)}.")
    assert "channel_b_h4" in CANDIDATES
    presets, candidates = write_flags.presets_markdown(), write_flags.candidates_markdown()
    assert [row.split(" | ")[0] for row in presets.splitlines()[2:]] == [f"| `{name}`" for name in PRESETS]
    assert [row.split(" | ")[1] for row in presets.splitlines()[2:]] == [p.description for p in PRESETS.values()]
    assert [row.split(" | ")[:2] for row in candidates.splitlines()[2:]] == [
        [f"| `{name}`", candidate_description(name)] for name in CANDIDATES]
    assert all(p.description and "\n" not in p.description for p in PRESETS.values())


@pytest.mark.parametrize("case", cases())
def test_every_codec_is_a_flag_value_its_options_config_fields_and_both_flag_table_rows(case):
    from megatron_tah.codecs import codec_class

    parser = tah_arguments.add_tah_arguments(argparse.ArgumentParser())
    fields = {f.name: f for f in dataclasses.fields(TahConfig)}
    table = tah_arguments.flags_markdown()
    name, declaration = case.name, case.declaration
    for option in declaration.options:
        assert fields[option.name].default == option.default and fields[option.name].type is option.type
        action = parser._option_string_actions[tah_arguments.flag_name(option.name)]
        assert action.help.startswith(TahConfig.field_help()[option.name]) and action.default == option.default
        assert f"| {option.help.replace('|', chr(92) + '|')} |" in table  # the flag page: the whole help
        assert f"| `{tah_arguments.flag_name(option.name)}` |" in table
        assert (tuple(action.choices) if action.choices else ()) == option.choices
    # The capabilities agree with the class: sample ids, a Triton path, the backward choices.
    codec = codec_class(name)()
    assert declaration.needs_sample_ids == codec.needs_sample_ids, name
    assert declaration.kernel or not codec.has_triton_path(), name
    backward = parser._option_string_actions["--tah-backward-codec"].choices
    assert name in parser._option_string_actions["--tah-forward-codec"].choices
    assert (name in backward) == (not declaration.forward_only), name
    # The flag table lists it among the codec flags' values, and among the takers of each direction parameter.
    values = {row.split(" | ")[0]: row.split(" | ")[2].split(", ")
              for row in table.splitlines() if row.startswith("| `")}
    assert name in values["| `--tah-forward-codec`"]
    assert (name in values["| `--tah-backward-codec`"]) == (name in backward)
    docs = TahConfig.field_docs()
    for field, parameter in TahConfig._DIRECTION_PARAMETERS.items():
        takers = docs[field].rpartition("Codecs that take it: ")[2].rstrip(".").split(", ")
        wanted = parameter in declaration.takes and ("backward" not in field or name in backward)
        assert (name in takers) == wanted, (field, name)
    # A config selecting it builds it (every declared keyword is one its constructor takes).
    built = TahConfig(tah_forward_codec=name).forward_codec()
    assert type(built) is codec_class(name)


# ----- --help ---------------------------------------------------------------------------------------


def test_bare_percent_in_an_upstream_help_is_escaped_only_where_argparse_cannot_format_it():
    parser = argparse.ArgumentParser()
    flag = tah_arguments.UPSTREAM_HELP_WITH_BARE_PERCENT[0]
    parser.add_argument(flag, type=float, help="headroom (e.g. 1.10 = 10%).")
    parser.add_argument("--other", help="also 10%)")  # not a flag the shim covers: left as it is
    with pytest.raises(ValueError, match="unsupported format character"):
        parser.format_help()
    assert tah_arguments.escape_percent_in_upstream_help(parser) == [flag]
    assert parser._option_string_actions[flag].help == "headroom (e.g. 1.10 = 10%%)."
    assert parser._option_string_actions["--other"].help == "also 10%)"
    assert tah_arguments.escape_percent_in_upstream_help(parser) == []  # repaired once; formattable help untouched
    fine = argparse.ArgumentParser()
    fine.add_argument(flag, default=1.1, help="factor, default %(default)s")
    assert tah_arguments.escape_percent_in_upstream_help(fine) == []


def _run_help(*command: str, cwd=None):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", *command, "--help"], cwd=cwd or repo, env=env, capture_output=True,
                          text=True, timeout=300)


def test_help_of_pretrain_gpt_exits_0_and_lists_the_tah_flags():
    result = _run_help("megatron_tah.pretrain_gpt")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--tah-forward-codec" in result.stdout and "--tah-high-ratio" in result.stdout
    assert "--moe-paged-stash-buffer-size-factor-cuda" in result.stdout  # Megatron's own flags are all there


def test_help_through_the_launcher_exits_0_and_lists_the_tah_flags(tmp_path):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("from megatron.training.arguments import parse_args\nparse_args()\n")
    result = _run_help("megatron_tah.launch", str(script), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--tah-forward-codec" in result.stdout and "--tah-lowrank-rank" in result.stdout


def test_the_reproduction_command_lines_say_which_codecs_they_run():
    """Nothing is on by default: every run of the reproduction names both directions (or a preset)."""
    from benchmarks.reproduce import convergence, throughput

    parser = tah_arguments.add_tah_arguments(argparse.ArgumentParser())
    for table in (convergence.CODECS, throughput.CODECS):
        for name, (_, flags) in table.items():
            config = tah_arguments.tah_config_from_args(parser.parse_known_args(flags)[0])
            assert "--tah-preset" in flags or {"--tah-forward-codec", "--tah-backward-codec"} <= set(flags), name
            assert config.forward_codec() is not None, name  # a valid configuration
    assert "6-bit bwd" in convergence.CODECS["tah"][0]
    tah = tah_arguments.tah_config_from_args(parser.parse_known_args(convergence.CODECS["tah"][1])[0])
    assert tah.backward_codec().describe() == "fixedpoint(bits=6, tile_size=32, stochastic_rounding=False)"


def test_one_layer_per_stage_leaves_megatron_neither_the_interleaved_schedule_nor_overlapped_p2p(monkeypatch, installed):
    """The speedrun's shape (one transformer layer per stage, as the reference's): Megatron's validation makes the
    virtual pipeline 1 (no interleaving: a stage's layers must divide into virtual stages) and turns off
    ``overlap_p2p_comm`` (interleaved only), so neither is a lever under latency there (docs/SPEEDRUN.md)."""
    args = parse(monkeypatch, gpt_argv(4, "--num-layers-per-virtual-pipeline-stage", "1"), world_size=4)
    assert args.overlap_p2p_comm  # megatron-core's default
    megatron_arguments.validate_args(args)
    assert args.num_layers // args.pipeline_model_parallel_size == 1
    assert args.virtual_pipeline_model_parallel_size is None and not args.overlap_p2p_comm
    two = parse(monkeypatch, gpt_argv(2, "--num-layers-per-virtual-pipeline-stage", "1"), world_size=2)
    megatron_arguments.validate_args(two)  # two layers per stage: interleaved, with overlapped p2p
    assert two.virtual_pipeline_model_parallel_size == 2 and two.overlap_p2p_comm
