"""A place is its own module plus one registry line: a throwaway place, declared in this module and put into
``places.PLACES`` by a fixture, has its checks run by ``install`` and by the flags' validation, its start-up line
printed by the plugin, and its statistics (a stream and its own levels) in the iteration line, the writers and the
JSON log -- with no other edit to megatron_tah. A second throwaway place has a flag of its own: its field line (here
in a subclass of ``TahConfig``, standing for the one line a new place adds to the schema) is all the flags, the
flag table, the config's checks and the installer need."""

# No ``from __future__ import annotations``: megatron's flag factory reads ConfigWithItsFlag's annotations as types.
import argparse
import dataclasses
import json

import megatron.training.arguments as megatron_arguments
import pytest
from tests.megatron.test_arguments import gpt_argv, parse
from tests.megatron.test_run_log import call_training_log, megatron_state  # noqa: F401  (a fixture)

import megatron_tah
from megatron_tah.config import TahConfig
from megatron_tah.megatron import arguments, places, plugin
from megatron_tah.megatron import run_log as tah_logging
from megatron_tah.megatron.collectives import Traffic
from megatron_tah.megatron.place_spec import PlaceSpec
from megatron_tah.megatron.registry import REGISTRY
from megatron_tah.megatron.stats import Stats, Stream

NAME = "throwaway"
REFUSED_INTERVAL = 7  # a tah_error_sample_interval the place's check refuses
REFUSED_MICRO_BATCH = 3  # a --micro-batch-size its check of Megatron's arguments refuses


def _install(place) -> None:
    place.state["items"] = 3


def _check(config: TahConfig) -> None:
    if config.tah_error_sample_interval == REFUSED_INTERVAL:
        raise ValueError(f"tah_error_sample_interval = {REFUSED_INTERVAL}: the throwaway place refuses it")


def _check_args(config: TahConfig, args) -> None:
    if getattr(args, "micro_batch_size", None) == REFUSED_MICRO_BATCH:
        raise ValueError(f"megatron_tah: the throwaway place cannot run --micro-batch-size {REFUSED_MICRO_BATCH}")


def _startup(config: TahConfig, args) -> list[str]:
    return [f"> megatron_tah: throwaway here, hidden {args.hidden_size}"]


def _statistics(place) -> dict[str, float]:
    return {"items": place.state["items"]}


PLACE = PlaceSpec(name=NAME, option=None, install=_install, streams=(Stream(NAME, NAME, "backward", "thr"),),
                  check=_check, check_args=_check_args, startup=_startup, statistics=_statistics)


@pytest.fixture
def throwaway(monkeypatch):
    """``PLACE`` registered (last, as a new entry of ``PLACES``), its stream declared on a sink of its own."""
    monkeypatch.setitem(places.PLACES, NAME, PLACE)
    monkeypatch.setattr(REGISTRY, "stats", Stats())
    yield PLACE
    megatron_tah.uninstall()


def test_its_checks_run_at_install_and_its_line_is_among_the_start_up_lines(throwaway):
    with pytest.raises(ValueError, match="the throwaway place refuses it"):
        megatron_tah.install(tah_error_sample_interval=REFUSED_INTERVAL)
    assert REGISTRY.places == {} and REGISTRY.config is None
    megatron_tah.install(tah_preset="paper")
    assert list(REGISTRY.places)[-1] == NAME and places.installed(NAME).state["items"] == 3
    with pytest.raises(ValueError, match="--micro-batch-size 3"):
        places.check_args(TahConfig(), argparse.Namespace(micro_batch_size=REFUSED_MICRO_BATCH))
    places.check_args(TahConfig(), argparse.Namespace(micro_batch_size=2))
    lines = places.startup_lines(TahConfig(tah_preset="paper"), argparse.Namespace(hidden_size=256))
    assert lines[0].startswith("> megatron_tah: pipeline activations via tah(")
    assert lines[-1] == "> megatron_tah: throwaway here, hidden 256"
    megatron_tah.uninstall()
    assert places.installed(NAME) is None and REGISTRY.stats.sources == {}


def test_megatron_s_argument_validation_runs_its_checks_in_one_line_naming_the_flag(throwaway, monkeypatch, capsys):
    arguments.install_arguments()
    try:
        for extra, expected in (
                (["--tah-error-sample-interval", str(REFUSED_INTERVAL)],
                 "error: invalid megatron_tah flags (--tah-error-sample-interval 7): --tah-error-sample-interval = 7: "
                 "the throwaway place refuses it"),
                (["--micro-batch-size", str(REFUSED_MICRO_BATCH)],
                 "error: megatron_tah: the throwaway place cannot run --micro-batch-size 3")):
            args = parse(monkeypatch, gpt_argv(2, *extra))
            with pytest.raises(SystemExit) as exit_info:
                megatron_arguments.validate_args(args)
            assert exit_info.value.code == 2
            assert capsys.readouterr().err.splitlines() == [expected]
    finally:
        arguments.uninstall_arguments()


def test_the_plugin_prints_its_start_up_line(throwaway, megatron_state, monkeypatch, tmp_path, capsys):  # noqa: F811
    monkeypatch.setattr(megatron_state.args, "tah_log_json", str(tmp_path / "log.jsonl"))  # a tah flag: not off
    initialize = plugin._initializing_then_installing(lambda **kwargs: "initialized")
    try:
        assert initialize() == "initialized"
    finally:
        plugin.uninstall_megatron_lm_plugin()
    out = capsys.readouterr().out.splitlines()
    assert f"> megatron_tah: throwaway here, hidden {megatron_state.args.hidden_size}" in out


def test_its_stream_and_levels_reach_the_line_the_writers_and_the_json_log(throwaway, megatron_state,  # noqa: F811
                                                                           monkeypatch, tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    monkeypatch.setattr(megatron_state.args, "tah_log_json", str(log))
    tah_logging.install_logging()
    megatron_tah.install()
    places.installed(NAME).record("backward", Traffic(raw_nbytes=4_000_000, wire_nbytes=1_000_000))
    call_training_log(iteration=2)
    line = [line for line in capsys.readouterr().out.splitlines() if " iteration " in line][0]
    assert " tah thr MB/iter: 1.000 | tah thr ratio: 4.00x |" in line and line.endswith(" tah throwaway items: 3 |")
    assert megatron_state.writer.scalars["tah/throwaway_wire_bytes_per_iter"] == (1e6, 2)
    assert megatron_state.writer.scalars["tah/throwaway_items"] == (3.0, 2)
    record = json.loads(log.read_text().splitlines()[-1])
    assert record["tah"][NAME]["wire_bytes"] == 1_000_000 and record["places"] == {NAME: {"items": 3.0}}


# ----- a place with a flag of its own ----------------------------------------------------------------------------
FLAGGED = "flagged"
REFUSED_BLOCK = 32  # a tah_int8_block_size the flagged place's check refuses while it is on


@dataclasses.dataclass
class ConfigWithItsFlag(TahConfig):
    tah_flagged_codec: str = dataclasses.field(default="none", metadata={"choices": ("none", "int8")})
    """The flagged place's traffic: none (left alone) or int8."""


def _flagged_codec(config):
    return None if config.tah_flagged_codec == "none" else config.build_codec(config.tah_flagged_codec, 8,
                                                                              config.tah_int8_block_size)


def _flagged_check(config) -> None:
    if config.tah_flagged_codec != "none" and config.tah_int8_block_size == REFUSED_BLOCK:
        raise ValueError(f"tah_flagged_codec = {config.tah_flagged_codec!r} with tah_int8_block_size = "
                         f"{REFUSED_BLOCK}: the flagged place refuses it")


FLAGGED_PLACE = PlaceSpec(name=FLAGGED, option="tah_flagged_codec", install=lambda place: None, codec=_flagged_codec,
                          settings=lambda config: _flagged_codec(config).describe(), check=_flagged_check)


@pytest.fixture
def flagged(monkeypatch):
    """``FLAGGED_PLACE`` in ``places.PLACES`` and its field in the schema the flags are made from."""
    monkeypatch.setitem(places.PLACES, FLAGGED, FLAGGED_PLACE)
    monkeypatch.setattr(arguments, "TahConfig", ConfigWithItsFlag)
    monkeypatch.setattr(REGISTRY, "stats", Stats())
    yield FLAGGED_PLACE
    megatron_tah.uninstall()


def test_its_flag_its_row_and_its_values_come_from_its_field_line(flagged):
    parser = arguments.add_tah_arguments(argparse.ArgumentParser())
    action = parser._option_string_actions["--tah-flagged-codec"]
    assert action.choices == ("none", "int8") and action.default == "none"
    assert action.help == "The flagged place's traffic: none (left alone) or int8."
    assert "| `--tah-flagged-codec` | none | none, int8 | The flagged place's traffic: none (left alone) or int8. |" \
        in arguments.flags_markdown().splitlines()
    with pytest.raises(ValueError, match="tah_flagged_codec = 'fp8': choose one of none, int8"):
        ConfigWithItsFlag(tah_flagged_codec="fp8")
    with pytest.raises(ValueError, match="the flagged place refuses it"):  # its check, run by every place's check
        places.check(ConfigWithItsFlag(tah_flagged_codec="int8", tah_int8_block_size=REFUSED_BLOCK))
    places.check(ConfigWithItsFlag(tah_int8_block_size=REFUSED_BLOCK))  # off: nothing to refuse
    with pytest.raises(ValueError, match="is not a field of TahConfig"):  # a config without its field line
        places.check(TahConfig())


def test_its_flag_turns_it_on_and_its_settings_are_compared(flagged):
    megatron_tah.install(ConfigWithItsFlag(tah_preset="paper"))
    assert places.installed(FLAGGED) is None and places.settings(REGISTRY.config)[FLAGGED] == "none"
    megatron_tah.install(ConfigWithItsFlag(tah_preset="paper", tah_flagged_codec="int8"))
    assert places.installed(FLAGGED).codec.describe() == "int8(block_size=128)"
    assert places.settings(REGISTRY.config)[FLAGGED] == "int8(block_size=128)"
    lines = places.startup_lines(REGISTRY.config, argparse.Namespace(hidden_size=256))
    assert "flagged via int8(block_size=128)" in lines[1]


def test_megatron_s_argument_validation_names_its_flag(flagged, monkeypatch, capsys):
    arguments.install_arguments()
    try:
        args = parse(monkeypatch, gpt_argv(2, "--tah-flagged-codec", "int8", "--tah-int8-block-size",
                                           str(REFUSED_BLOCK)))
        assert args.tah_flagged_codec == "int8"
        with pytest.raises(SystemExit) as exit_info:
            megatron_arguments.validate_args(args)
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.splitlines() == [
            "error: invalid megatron_tah flags (--tah-int8-block-size 32 --tah-flagged-codec int8): "
            "--tah-flagged-codec = 'int8' with --tah-int8-block-size = 32: the flagged place refuses it"]
    finally:
        arguments.uninstall_arguments()
