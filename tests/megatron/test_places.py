"""The compression places without a process group: flags and validation from TahConfig, install
replaces exactly what each place names, idempotent, restored exactly; statistics streams."""

from __future__ import annotations

import argparse
import importlib

import pytest
import torch

import megatron_tah
from megatron_tah.config import TahConfig
from megatron_tah.megatron import activation_memory, arguments, data_parallel, places, stats, tensor_parallel
from megatron_tah.megatron.pipeline_parallel import installed_transport
from megatron_tah.megatron.registry import REGISTRY

ALL_ON = {"tah_tp_codec": "fp8", "tah_dp_codec": "int8", "tah_embedding_codec": "int8", "tah_activation_memory": "laaq"}


def _targets():
    """Every attribute a place may replace, as the objects found there now."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
    from megatron.core.tensor_parallel import layers, mappings
    from megatron.core.transformer.transformer_layer import TransformerLayer

    found = {f"mappings.{n}": getattr(mappings, n) for n in ("_reduce", "dist_all_gather_func", "dist_reduce_scatter_func")}
    found.update({f"layers.{n}": getattr(layers, n) for n in (
        "dist_all_gather_func", "dist_reduce_scatter_func", "linear_with_grad_accumulation_and_async_allreduce",
        "linear_with_frozen_weight")})
    found["start_grad_sync"] = _ParamAndGradBucketGroup.__dict__["start_grad_sync"]
    found["TransformerLayer.forward"] = TransformerLayer.__dict__["forward"]
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")  # the package's name is its function
    found["_allreduce_word_embedding_grads"] = finalize._allreduce_word_embedding_grads
    return found


def _under_ledger(value):
    """What the always-on WAN ledger's counting function in front of ``value`` calls (``value`` itself when it is
    not one): the ledger counts what megatron-core bound by name as well."""
    is_ledger = getattr(value, "_megatron_tah", False) and value.__module__ == "megatron_tah.megatron.ledger"
    return value.__wrapped__ if is_ledger else value


@pytest.fixture
def originals():
    before = _targets()
    yield before
    megatron_tah.uninstall()
    assert _targets() == before


def test_flags_choices_and_validation_come_from_the_config_fields():
    parser = arguments.add_tah_arguments(argparse.ArgumentParser())
    assert parser._option_string_actions["--tah-tp-codec"].choices == ("none", "fp8")
    assert parser._option_string_actions["--tah-dp-codec"].choices == ("none", "int8")
    assert parser._option_string_actions["--tah-activation-memory"].choices == ("none", "laaq")
    args = parser.parse_args(["--tah-tp-codec", "fp8", "--tah-laaq-bits", "3,4", "--tah-int8-block-size", "256"])
    config = TahConfig.from_args(args)
    assert tensor_parallel.codec(config).describe() == "fp8(group_size=128)" and data_parallel.codec(config) is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--tah-dp-codec", "fp8"])
    # The same choices guard the dataclass itself (one declaration), and options are checked.
    with pytest.raises(ValueError, match="tah_dp_codec = 'fp8': choose one of none, int8"):
        TahConfig(tah_dp_codec="fp8")
    with pytest.raises(ValueError, match="tah_int8_block_size = 100: choose one of 32, 64"):
        TahConfig(tah_dp_codec="int8", tah_int8_block_size=100)
    with pytest.raises(ValueError, match="tah_laaq_bits = '4,9'"):
        TahConfig(tah_laaq_bits="4,9")
    with pytest.raises(ValueError, match="comma-separated"):
        TahConfig(tah_laaq_bits="four")
    with pytest.raises(ValueError, match="tah_laaq_block_size = 256"):  # the place's check (its quantizer's sizes)
        places.check(TahConfig(tah_laaq_block_size=256))
    with pytest.raises(ValueError, match="--tah-laaq-block-size = 256"):  # ... which the flags' validation runs
        arguments.tah_config_from_args(parser.parse_args(["--tah-laaq-block-size", "256"]))
    # int8 also serves the pipeline's gradients.
    assert TahConfig(tah_backward_codec="int8").backward_codec().describe() == "int8(block_size=128)"


def test_stage_bits_follow_the_list():
    config = TahConfig(tah_laaq_bits="4,5,6,8")
    bits = activation_memory.laaq_stage_bits
    assert [bits(config, i, 1) for i in range(1)] == [4]
    assert [bits(config, i, 2) for i in range(2)] == [4, 6]
    assert [bits(config, i, 4) for i in range(4)] == [4, 5, 6, 8]
    assert [bits(config, i, 8) for i in range(8)] == [4, 4, 5, 5, 6, 6, 8, 8]
    assert activation_memory.laaq_codec(config, 3, 4).describe() == \
        "fixedpoint(bits=8, tile_size=128, stochastic_rounding=False)"


def test_off_by_default_nothing_replaced(originals):
    megatron_tah.install()
    assert {k: _under_ledger(v) for k, v in _targets().items()} == originals  # only counted
    assert all(places.installed(name) is None for name in places.PLACES if name not in ("pp", "wan"))
    assert places.installed("pp").transport is installed_transport() is not None  # the pipeline: always
    assert places.installed("wan") is not None  # the WAN ledger: always


def test_install_replaces_each_place_idempotently_and_uninstall_is_exact(originals):
    megatron_tah.install(**ALL_ON)
    replaced = _targets()
    assert all(replaced[k] is not originals[k] for k in originals), [k for k in originals if replaced[k] is originals[k]]
    assert all(getattr(v, "_megatron_tah", False) and _under_ledger(v.__wrapped__) is originals[k]
               for k, v in replaced.items())
    # each place's own function sits in front, not the ledger's counting one (a place does not wrap what is ours)
    assert not [k for k, v in replaced.items() if v.__module__ == "megatron_tah.megatron.ledger"]
    assert list(places.PLACES)[-1] == "wan"
    assert {places.installed(n).codec.name if places.installed(n).codec else None for n in places.PLACES} == \
        {"fp8", "int8", None}
    megatron_tah.install(**ALL_ON)  # same config: nothing wrapped twice
    assert _targets() == replaced
    megatron_tah.install(tah_tp_codec="fp8")  # another config: the others are restored
    now = _targets()
    assert _under_ledger(now["start_grad_sync"]) is originals["start_grad_sync"]
    assert now["TransformerLayer.forward"] is originals["TransformerLayer.forward"]
    assert now["_allreduce_word_embedding_grads"] is originals["_allreduce_word_embedding_grads"]
    assert now["mappings._reduce"] is not originals["mappings._reduce"]
    megatron_tah.uninstall()
    assert _targets() == originals
    assert places.installed("tp") is None and REGISTRY.places == {} and REGISTRY.config is None


def test_ring_exchange_with_a_pipeline_codec_is_an_error_at_install(monkeypatch, originals):
    """--use-ring-exchange-p2p sends through torch.distributed.ring_exchange, not the transports megatron_tah
    replaces: with a pipeline codec, install refuses, naming the flag, and leaves nothing installed."""
    from megatron_tah.megatron import pipeline_parallel

    monkeypatch.setattr(pipeline_parallel, "_megatron_args", lambda: argparse.Namespace(use_ring_exchange_p2p=True))
    for codecs in ({"tah_forward_codec": "tah"}, {"tah_backward_codec": "fixedpoint"}, {"tah_forward_codec": "auto"}):
        with pytest.raises(ValueError, match="--use-ring-exchange-p2p"):
            megatron_tah.install(**codecs)
        assert REGISTRY.places == {} and REGISTRY.config is None
    megatron_tah.install(tah_tp_codec="fp8")  # the pipeline's codecs none: Megatron's ring exchange, untouched
    assert places.installed("tp") is not None
    monkeypatch.setattr(pipeline_parallel, "_megatron_args", lambda: argparse.Namespace(use_ring_exchange_p2p=False))
    megatron_tah.install(tah_forward_codec="tah")
    assert pipeline_parallel.is_installed()


def test_collective_codecs_must_be_stateless():
    from megatron_tah.codecs import CodecError, get_codec
    from megatron_tah.megatron import tensor_parallel

    place = places.Place("tp", TahConfig(), get_codec("aqsgd"))
    with pytest.raises(CodecError, match="stateless"):
        tensor_parallel.install(place)
    assert not place.patches


def test_statistics_streams_and_log_fragment():
    sink = stats.Stats(places.STREAMS)
    sink.record_collective("tp", "forward", 4000, 1000, rel_error=0.02, encode_seconds=0.001)
    sink.record_collective("dp", "backward", 8000, 2000)
    sink.memory_source = lambda reset: {"bits": 4, "raw_bytes": 3_000_000, "stored_bytes": 1_000_000}
    s = sink.collect()
    sink.memory_source = None
    assert s["tp_forward"]["ratio"] == 4.0 and s["tp_forward"]["rel_error"] == pytest.approx(0.02)
    assert s["dp_backward"]["wire_bytes"] == 2000 and s["forward"]["messages"] == 0
    assert s["saved_memory"] == {0: {"bits": 4, "raw_bytes": 3_000_000, "stored_bytes": 1_000_000}}
    line = sink.format_for_log(s)
    assert "tah tp fwd MB: 0.001 | tah tp fwd ratio: 4.00x" in line and "tah dp grad ratio: 4.00x" in line
    assert line.endswith(" tah saved MB: 1.0/3.0 |")
    merged = stats.merge(s, sink.collect())
    assert merged["tp_forward"]["messages"] == 1 and merged["saved_memory"] == s["saved_memory"]
    with pytest.raises(ValueError, match="no statistics stream"):
        sink.record_collective("pp", "sideways", 1, 1)
    assert torch.distributed.is_available()


def test_the_flags_page_is_the_generated_one():
    """docs/FLAGS.md is what ``scripts/write_flags.py`` writes: ``flags_markdown()``'s table under its intro."""
    import importlib.util
    import pathlib

    script = pathlib.Path(__file__).parents[2] / "scripts" / "write_flags.py"
    spec = importlib.util.spec_from_file_location("write_flags", script)
    write_flags = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(write_flags)
    page = write_flags.PAGE.read_text()
    assert arguments.flags_markdown() in page
    assert page == write_flags.page(), "docs/FLAGS.md differs from TahConfig: run python scripts/write_flags.py"
