"""Pipeline traffic statistics: per-rank totals, the reduction to the last rank, the log fragment."""

from __future__ import annotations

import pytest
import torch

from megatron_tah.codecs.core.samples import activation_like
from megatron_tah.megatron import places, stats
from tests.helpers.codec_cases import cases
from tests.helpers.dist_utils import run_distributed
from tests.helpers.edge_cases import rel_error


@pytest.fixture
def sink():
    return stats.Stats(places.STREAMS)


def test_collect_totals_ratio_means_and_links(sink):
    sink.record_send("forward", 4000, 1000, peer=1, rel_error=0.1, rotated_fraction=0.25)
    sink.record_send("forward", 4000, 1000, peer=1, rotated_fraction=0.75)
    sink.record_send("backward", 3000, 1500, peer=3, rel_error=0.02)
    s = sink.collect(reset=False)
    fwd, bwd = s["forward"], s["backward"]
    assert (fwd["messages"], fwd["raw_bytes"], fwd["wire_bytes"]) == (2, 8000, 2000)
    assert fwd["ratio"] == 4.0 and bwd["ratio"] == 2.0
    assert fwd["rel_error"] == pytest.approx(0.1) and fwd["rel_error_samples"] == 1
    assert fwd["rotated_fraction"] == pytest.approx(0.5) and bwd["rotated_fraction"] is None
    assert s["links"] == {(0, 1): 2000, (0, 3): 1500}  # no process group: this rank is 0
    assert sink.collect(reset=True) == s  # reset=False kept them
    empty = sink.collect()
    assert empty["forward"]["messages"] == 0 and empty["forward"]["ratio"] is None and empty["links"] == {}


@pytest.mark.parametrize("case", cases())
def test_a_codecs_message_is_counted_before_and_on_the_wire_with_its_error(case, sink):
    """A link end sending with any registered codec records the message's bytes, its encoded size on the wire,
    their ratio and, on a sampled message, the round trip's relative error (a codec keeping state per sample:
    not sampled)."""
    from megatron_tah.config import TahConfig
    from megatron_tah.link.transport import PipelineTransport

    config = TahConfig(tah_forward_codec=case.name, tah_backend="torch", tah_error_sample_interval=1)
    transport = PipelineTransport(config, sink)
    link = transport.link("forward", "send", 1)
    x = activation_like((16, 2, 128), torch.bfloat16, seed=2)
    if case.declaration.needs_sample_ids:
        transport.sample_ids.push(torch.arange(2))
    buf, rest = transport.encode(link, x)
    forward = sink.collect()["forward"]
    assert rest is None and forward["messages"] == 1 and forward["raw_bytes"] == x.numel() * x.element_size()
    assert forward["wire_bytes"] == buf.numel() == config.forward_codec().wire_nbytes(x.shape, x.dtype)
    assert forward["ratio"] == pytest.approx(forward["raw_bytes"] / forward["wire_bytes"])
    if case.declaration.needs_sample_ids:
        assert forward["rel_error"] is None
    else:
        decoded = config.forward_codec().decode(buf, x.shape, x.dtype)
        assert forward["rel_error_samples"] == 1
        assert forward["rel_error"] == pytest.approx(rel_error(x, decoded), rel=1e-4, abs=1e-6)


def test_codec_time_and_buffer_bytes(sink):
    sink.record_send("forward", 400, 100, peer=1)
    sink.record_codec_time("forward", encode_seconds=0.004)
    sink.record_codec_time("forward", decode_seconds=0.001)
    sink.record_codec_time("backward", encode_seconds=0.002)
    sink.buffer_source = lambda: 12_500_000
    s = sink.collect()
    sink.buffer_source = None
    assert s["forward"]["encode_seconds"] == pytest.approx(0.004)
    assert s["forward"]["decode_seconds"] == pytest.approx(0.001)
    assert s["backward"]["encode_seconds"] == pytest.approx(0.002)
    assert s["buffer_bytes"] == 12_500_000
    # Backward has no message, so only the forward 5 ms count in the log line.
    assert sink.format_for_log(s).endswith(" tah codec ms: 5.0 | tah buffer MB: 12.5 |")
    sink.sources["a"] = lambda: {"tables": 2, "idle": 0}  # a place's own levels: the non-zero ones shown
    assert sink.format_for_log(sink.collect(reset=False)) == " tah a tables: 2 |"
    del sink.sources["a"]
    after = sink.collect()
    assert after["forward"]["encode_seconds"] == 0 and after["buffer_bytes"] == 0
    with pytest.raises(ValueError, match="sideways"):
        sink.record_codec_time("sideways", encode_seconds=1.0)


def test_record_send_rejects_unknown_direction(sink):
    with pytest.raises(ValueError, match="sideways"):
        sink.record_send("sideways", 1, 1, peer=0)


def test_format_for_log(sink):
    sink.record_send("forward", 4_936_000, 1_234_000, peer=1, rel_error=0.0123, rotated_fraction=0.5)
    line = sink.format_for_log(sink.collect())
    assert line.startswith(" tah fwd MB: 1.234 | tah fwd ratio: 4.00x | tah fwd rel err: 1.2E-02 |")
    assert "tah fwd rotated: 0.500 |" in line and "bwd" not in line
    assert sink.format_for_log(sink.collect()) == ""


def test_reduce_without_a_process_group_returns_the_input(sink):
    sink.record_send("backward", 10, 5, peer=0)
    s = sink.collect()
    assert stats.reduce_to_last_rank(s) is s


def _reduce_body(rank, world_size):
    sink = stats.Stats(places.STREAMS)
    sink.record_send("forward", 100 * (rank + 1), 10 * (rank + 1), peer=(rank + 1) % world_size,
                      rel_error=0.1 * (rank + 1))
    if rank == 2:
        sink.record_send("backward", 80, 20, peer=1, rotated_fraction=0.4)
    sink.record_codec_time("forward", encode_seconds=0.001 * (rank + 1))
    sink.buffer_source = lambda: 1000 * (rank + 1)
    sink.record_wan("embedding", 7 * (rank + 1), codec=rank == 0)
    sink.sources["a"] = lambda: {"held": 2.5 * (rank + 1), "open": 1}  # places' own levels (a statistics hook)
    sink.sources["b"] = lambda: {"held": 100 * (rank + 1)}
    # An explicit group (WORLD) keeps megatron-core out of these processes; the pipeline tests
    # cover the default (megatron-core's pipeline group).
    return stats.reduce_to_last_rank(sink.collect(), group=torch.distributed.group.WORLD)


@pytest.mark.distributed
def test_reduce_to_last_rank_sums_over_the_group():
    results = run_distributed(_reduce_body, 3, timeout=120)
    last = results[-1]
    assert last["forward"]["messages"] == 3 and last["forward"]["raw_bytes"] == 600
    assert last["forward"]["wire_bytes"] == 60 and last["forward"]["ratio"] == 10.0
    assert last["forward"]["rel_error"] == pytest.approx(0.2)  # mean of 0.1, 0.2, 0.3
    assert last["backward"]["messages"] == 1 and last["backward"]["rotated_fraction"] == pytest.approx(0.4)
    assert last["links"] == {(0, 1): 10, (1, 2): 20, (2, 0): 30, (2, 1): 20}
    assert last["forward"]["encode_seconds"] == pytest.approx(0.006) and last["buffer_bytes"] == 6000
    assert results[0]["links"] == {(0, 1): 10}  # other ranks keep their own numbers
    assert last["wan"]["embedding"] == {"ops": 3, "bytes": 42, "codec_bytes": 7} and last["wan"]["other"]["ops"] == 0
    assert last["places"] == {"a": {"held": pytest.approx(15.0), "open": 3.0}, "b": {"held": 600.0}}
    assert results[0]["places"] == {"a": {"held": 2.5, "open": 1.0}, "b": {"held": 100.0}}


def test_format_for_log_per_iteration_and_streams(sink):
    sink.record_send("forward", 8_000_000, 2_000_000, peer=1)
    sink.record_codec_time("forward", encode_seconds=0.004)
    sink.record_collective("tp", "forward", 4000, 1000)
    s = sink.collect()
    assert sink.format_for_log(s, 2, streams=("forward", "backward")) == \
        " tah fwd MB/iter: 1.000 | tah fwd ratio: 4.00x | tah codec ms/iter: 2.0 |"
    assert sink.format_for_log(s).startswith(" tah fwd MB: 2.000 | tah fwd ratio: 4.00x | tah tp fwd MB: 0.001 |")
    with pytest.raises(ValueError, match="iterations"):
        sink.format_for_log(s, 0)


def test_apart_counts_a_block_on_its_own_and_keeps_the_counts_from_before(sink):
    sink.memory_source = lambda reset: {"bits": 4, "raw_bytes": 300, "stored_bytes": 100}
    sink.record_send("forward", 4000, 1000, peer=1, rel_error=0.1)
    sink.record_codec_time("forward", encode_seconds=0.002)
    with sink.apart():
        sink.record_send("forward", 900, 300, peer=1, rel_error=0.3)
        block = sink.collect()
        sink.record_send("backward", 60, 20, peer=3)  # left uncollected: stays counted after the block
    assert (block["forward"]["messages"], block["forward"]["wire_bytes"]) == (1, 300)
    assert block["forward"]["rel_error"] == pytest.approx(0.3) and block["forward"]["encode_seconds"] == 0
    assert block["links"] == {(0, 1): 300} and block["saved_memory"] == {}  # the memory peak was not read
    after = sink.collect()
    sink.memory_source = None
    assert (after["forward"]["messages"], after["forward"]["wire_bytes"]) == (1, 1000)
    assert after["forward"]["rel_error"] == pytest.approx(0.1) and after["forward"]["encode_seconds"] == pytest.approx(0.002)
    assert after["backward"]["wire_bytes"] == 20 and after["links"] == {(0, 1): 1000, (0, 3): 20}
    assert after["link_errors"] == {(0, 1): (pytest.approx(0.1), 1)} and after["saved_memory"][0]["bits"] == 4
    with pytest.raises(RuntimeError), sink.apart():  # an error inside the block still restores the counters
        sink.record_send("forward", 10, 5, peer=1)
        raise RuntimeError
    assert sink.collect()["forward"]["wire_bytes"] == 5


def test_wan_ledger_counts_bytes_and_the_compressed_share(sink):
    """The WAN ledger's counters: bytes per category, the codec share (a compressing place's block, pipeline
    messages smaller than their tensor), counted apart in a block, merged, and first in the log fragment."""
    sink.record_wan("embedding", 25_000_000)
    with sink.codec_traffic():
        assert sink.in_codec_traffic
        sink.record_wan("embedding", 6_000_000)
    assert not sink.in_codec_traffic
    sink.record_send("forward", 4000, 1000, peer=1)  # compressed: its bytes are codec bytes of the pipeline
    sink.record_send("backward", 4000, 4016, peer=1)  # the none codec (header): not compressed
    sink.record_wan("pipeline", 5016)  # what the ledger counts for those two sends
    with sink.apart():
        sink.record_wan("other", 8)
        assert sink.collect()["wan"]["other"] == {"ops": 1, "bytes": 8, "codec_bytes": 0}
    s = sink.collect()
    assert s["wan"]["embedding"] == {"ops": 2, "bytes": 31_000_000, "codec_bytes": 6_000_000}
    assert s["wan"]["pipeline"] == {"ops": 1, "bytes": 5016, "codec_bytes": 1000} and s["wan"]["other"]["ops"] == 0
    assert stats.wan_totals(s) == (31_005_016, 6_001_000)
    assert sink.format_for_log(s, 2).startswith(" wan MB/iter: 15.503 | wan compressed: 19.4% | tah fwd MB/iter:")
    merged = stats.merge(s, s)
    assert stats.wan_totals(merged) == (62_010_032, 12_002_000)
    assert stats.wan_totals(sink.collect()) == (0, 0) and "wan" not in sink.format_for_log(sink.collect())
    with pytest.raises(ValueError, match="WAN category"):
        sink.record_wan("sideways", 1)
