"""``--tah-boundary-bits``: the forward codec's bits per pipeline boundary.

Entry ``floor(i * n / (p - 1))`` of the ``n`` given for boundary ``i`` of a ``p``-stage pipeline; both ends of a
link build the same codec (the handshake compares the list); the emulated boundaries of the depth studies use
the same mapping; bad values and the interleaved schedule are errors naming the flag. A 3-stage gloo pipeline
checks the bytes each link carries.
"""

from __future__ import annotations

import types

import pytest
import torch

from megatron_tah.config import TahConfig
from megatron_tah.link.handshake import config_record
from megatron_tah.link.link import link_boundary
from megatron_tah.link.transport import PipelineTransport
from tests.helpers.dist_utils import run_distributed


def _config(bits="2,4,8", **fields):
    return TahConfig(tah_forward_codec="channel", tah_forward_bits=4, tah_boundary_bits=bits,
                     tah_backend="torch", **fields)


def test_each_boundary_takes_its_entry_stretched_over_the_pipeline():
    config = _config("3,6")
    assert [config.forward_bits(i, 7) for i in range(7)] == [3, 3, 3, 3, 6, 6, 6]  # floor(i * 2 / 7)
    assert [config.forward_bits(i, 2) for i in range(2)] == [3, 6]
    assert [config.forward_bits(i, 1) for i in range(1)] == [3]
    assert [c.bits for c in (config.forward_codec(i, 2) for i in range(2))] == [3, 6]
    assert config.forward_codec().bits == 4  # outside a pipeline's links: --tah-forward-bits
    assert TahConfig(tah_forward_codec="channel").forward_bits(3, 7) == 4  # not set: every boundary alike
    with pytest.raises(ValueError, match="boundary 7 of 7"):
        config.forward_bits(7, 7)


@pytest.mark.parametrize("fields, message", [
    ({"tah_boundary_bits": "4,x"}, "comma-separated integers"),
    ({"tah_boundary_bits": ""}, "comma-separated integers"),
    ({"tah_boundary_bits": "4,9"}, "entry 9"),
    ({"tah_boundary_bits": "4,5", "tah_forward_codec": "tah"}, "takes bits"),
    ({"tah_boundary_bits": "4,5", "tah_forward_codec": "none"}, "takes bits"),
    ({"tah_boundary_bits": "4,5", "tah_forward_codec": "auto"}, "takes bits"),
])
def test_bad_lists_and_codecs_without_bits_are_errors_naming_the_flag(fields, message):
    with pytest.raises(ValueError, match="tah_boundary_bits") as err:
        TahConfig(**{"tah_forward_codec": "channel", **fields})
    assert message in str(err.value)


def test_both_ends_must_hold_the_same_list():
    """The forward record's digest covers the list (a neighbour with another raises CodecMismatchError); the
    backward record does not change."""
    a, b, plain = config_record(_config("2,4,8")), config_record(_config("2,4,6")), config_record(_config(None))
    assert a["forward"][0] != b["forward"][0] != plain["forward"][0]
    assert a["backward"] == b["backward"] == plain["backward"]
    assert config_record(_config("2,4,8")) == a
    assert "bits per boundary 2,4,8" in a["forward"][1]


def _transport(stage, depth, bits="2,4,8"):
    return PipelineTransport(_config(bits), stats=None, depth=lambda: depth, stage=lambda: stage)


def _boundary(transport, direction, role):
    """The boundary ``transport``'s ``direction`` link end as ``role`` goes through (``link.link_boundary``)."""
    return link_boundary(transport.config, direction, role, transport.stage, transport.depth)


@pytest.mark.parametrize("stage, send_bits, recv_bits", [(0, 2, None), (1, 4, 2), (2, 8, 4), (3, None, 8)])
def test_a_link_end_builds_its_boundarys_codec(stage, send_bits, recv_bits):
    """Stage s sends activations through boundary s and receives them through boundary s - 1; gradients are
    not per boundary."""
    transport = _transport(stage, 4)
    if send_bits is not None:
        assert _boundary(transport, "forward", "send") == (stage, 3)
        assert transport.link("forward", "send", stage + 1).codec.bits == send_bits
    if recv_bits is not None:
        assert _boundary(transport, "forward", "recv") == (stage - 1, 3)
        assert transport.link("forward", "recv", stage - 1).codec.bits == recv_bits
    assert _boundary(transport, "backward", "send") is None


def test_links_around_the_pipelines_end_or_an_unknown_stage_are_errors():
    with pytest.raises(ValueError, match="interleaved"):
        _boundary(_transport(3, 4), "forward", "send")  # the last stage sends on only when interleaved
    with pytest.raises(ValueError, match="interleaved"):
        _boundary(_transport(0, 4), "forward", "recv")
    with pytest.raises(ValueError, match="parallel state"):
        _boundary(_transport(None, None), "forward", "send")
    assert _boundary(_transport(None, None, bits=None), "forward", "send") is None  # not set: no stage needed


def test_the_interleaved_schedule_is_refused_with_megatrons_arguments():
    from megatron_tah.megatron.pipeline_parallel import check_args

    interleaved = types.SimpleNamespace(num_layers_per_virtual_pipeline_stage=2, use_ring_exchange_p2p=False)
    with pytest.raises(ValueError, match="--tah-boundary-bits.*interleaved"):
        check_args(_config("4,6"), interleaved)
    check_args(_config(None), interleaved)
    check_args(_config("4,6"), types.SimpleNamespace(use_ring_exchange_p2p=False))


def test_the_emulated_boundaries_use_the_same_mapping():
    from benchmarks.depth.boundaries import Boundaries

    fields = {"tah_forward_codec": "channel", "tah_boundary_bits": "6,5,5,5,5,6,5"}
    emulated = Boundaries([27, 3, 7, 11, 15, 19, 23], fields, {})
    assert [emulated.codec(k, "forward").bits for k in (3, 7, 11, 15, 19, 23, 27)] == [6, 5, 5, 5, 5, 6, 5]


def test_the_studies_count_the_mean_bits_and_project_the_busiest_link():
    from benchmarks.common.codecs import busiest_nbytes, forward_codecs

    config = _config("2,8")
    shape = (1024, 8, 1024)
    codecs = forward_codecs(config, 8)
    assert [c.bits for c in codecs] == [2, 2, 2, 2, 8, 8, 8]
    assert busiest_nbytes(config, shape, 8) == config.forward_codec(6, 7).wire_nbytes(shape, torch.bfloat16)
    assert [c.bits for c in forward_codecs(_config(None), 8)] == [4]


# ----- a 3-stage gloo pipeline ------------------------------------------------------------------------
def _pipeline(rank, world_size):
    """Every rank: one training iteration with bits 2 then 8 at the two boundaries, then with the last stage
    given another list: (forward link ends' bits, bytes sent to each rank, each rank's mismatch message)."""
    import megatron_tah
    from megatron_tah.link.handshake import CodecMismatchError
    from megatron_tah.megatron.cpu_shims import apply_cpu_shims
    from megatron_tah.megatron.pipeline_parallel import installed_transport
    from tests.megatron.test_patch_pipeline import _build, _train, _WireSpy

    apply_cpu_shims()
    megatron_tah.install(tah_forward_codec="channel", tah_boundary_bits="2,8", tah_backend="torch")
    with _WireSpy() as spy:
        _train(_build(world_size, None, True, False, world_size), 1)
    ends = {(link.role, link.peer): link.codec.bits for link in installed_transport().links.values()
            if link.direction == "forward"}
    megatron_tah.uninstall()
    megatron_tah.install(tah_forward_codec="channel", tah_boundary_bits="2,8" if rank < 2 else "2,4",
                         tah_backend="torch")
    try:
        _train(_build(world_size, None, True, False, world_size), 1)
        mismatch = "no error"
    except CodecMismatchError as err:
        mismatch = str(err)
    finally:
        megatron_tah.uninstall()
    return {"ends": ends, "sent": spy.bytes_to, "mismatch": mismatch}


@pytest.mark.distributed
def test_a_three_stage_pipeline_sends_each_boundarys_bits():
    from megatron_tah.codecs import get_codec
    from tests.megatron.test_patch_pipeline import ENV, HIDDEN, MICRO_BATCH, MICRO_BATCHES, SEQ

    results = run_distributed(_pipeline, 3, env=ENV, timeout=600)
    assert results[0]["ends"] == {("send", 1): 2}
    assert results[1]["ends"] == {("recv", 0): 2, ("send", 2): 8}
    assert results[2]["ends"] == {("recv", 1): 8}
    shape = (SEQ, MICRO_BATCH, HIDDEN)
    for sender, receiver, bits in ((0, 1, 2), (1, 2, 8)):
        expected = MICRO_BATCHES * get_codec("channel", bits=bits).wire_nbytes(shape, torch.float32)
        assert results[sender]["sent"][receiver] == expected, (sender, receiver)
    for rank in range(3):
        message = results[rank]["mismatch"]
        assert "forward codecs" in message and "bits per boundary" in message, (rank, message)


def test_auto_links_hand_their_boundary_to_the_candidates(monkeypatch):
    """An auto direction's link ends know their boundary (a candidate may be a preset with per-boundary bits);
    where it is unknown or the link wraps around, its candidates take their own bits instead of an error."""
    from megatron_tah.link.auto import AutoEnd

    config = TahConfig(tah_forward_codec="auto", tah_backward_codec="auto")
    auto = PipelineTransport(config, stats=None, depth=lambda: 4, stage=lambda: 1)
    assert _boundary(auto, "forward", "send") == (1, 3) and _boundary(auto, "forward", "recv") == (0, 3)
    assert _boundary(auto, "backward", "send") is None
    assert _boundary(PipelineTransport(config, stats=None, depth=lambda: 4, stage=lambda: 3), "forward", "send") is None
    assert _boundary(PipelineTransport(config, stats=None), "forward", "send") is None
    asked = []
    original = TahConfig.auto_candidate_codec

    def candidate(self, name, direction, boundary=None):
        asked.append(boundary)
        return original(self, name, direction, boundary)

    monkeypatch.setattr(TahConfig, "auto_candidate_codec", candidate)
    AutoEnd(config, "forward", "send", 2, boundary=(1, 3))
    assert asked and set(asked) == {(1, 3)}
