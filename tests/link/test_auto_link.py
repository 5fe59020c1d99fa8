"""``--tah-*-codec auto`` on the pipeline's links (``link/auto.py``): the lockstep protocol
between a sender's and a receiver's ``AutoEnd`` in one process with fake link rates and codec costs,
the flags, the handshake record and the log line; the real transport at PP=2 is in
``test_auto_pipeline.py``."""

from __future__ import annotations

import pytest
import torch

from megatron_tah.codecs import WireFormatError
from megatron_tah.config import TahConfig
from megatron_tah.config.auto import steps_measured
from megatron_tah.link.auto import AutoEnd
from megatron_tah.link.choice import Chooser
from megatron_tah.link.handshake import config_record
from megatron_tah.link.measure import CandidateCost, CodecCostTable, LinkRate
from megatron_tah.link.wire import TrailerStep
from megatron_tah.link.wire import ANNOUNCEMENT_NBYTES, TRAILER_NBYTES, Trailer, decode_trailer, encode_trailer
from megatron_tah.megatron.places import STREAMS
from megatron_tah.megatron.stats import Stats

SHAPE = (32, 2, 64)
CANDIDATES = "none,fp8,paper"


def _config(**kw) -> TahConfig:
    return TahConfig(**{"tah_forward_codec": "auto", "tah_backend": "torch", "tah_auto_candidates": CANDIDATES,
                        "tah_auto_interval": 1, "tah_auto_probation": 0, **kw})  # (probation: its own test)


def _fake(end: AutoEnd, rates: list[float]) -> None:
    """Give a sender fixed costs (none: free, 4 MB on the wire; fp8: 2 MB, 1 ms; paper: 1 MB, 2 ms) and
    scripted link rates, one per measurement."""
    costs = {"none": (0.0, 4_000_000), "fp8": (1e-3, 2_000_000), "paper": (2e-3, 1_000_000)}
    table = CodecCostTable.from_costs([
        CandidateCost(name, end.codecs[name].codec_id, end.codecs[name].config_digest(), seconds / 2, seconds / 2,
                      nbytes, {"none": 0.0, "fp8": 0.01, "paper": 0.1}[name])
        for name, (seconds, nbytes) in costs.items()])
    end.table, end.chooser = table, Chooser(table, end.settings)
    script = iter(rates)
    end.meter.measure = lambda recent=None: LinkRate(next(script), 0.0, 10)


def _exchange(sender: AutoEnd, receiver: AutoEnd, iteration: int, x: torch.Tensor, messages: int = 2):
    """``messages`` messages of ``iteration`` from sender to receiver; returns (sender's codec, receiver's
    codec, the decoded tensors)."""
    decoded = []
    for _ in range(messages):
        sender.prepare(x)
        codec = sender.begin(iteration)
        buf, announcement = codec.encode(x), sender.sent(0.0)
        theirs = receiver.begin(iteration)
        assert buf.numel() == theirs.wire_nbytes(x.shape, x.dtype) and len(announcement) == ANNOUNCEMENT_NBYTES
        decoded.append(theirs.decode(buf, x.shape, x.dtype))
        receiver.received(announcement)
    return sender.current, receiver.current, decoded


def test_the_receiver_switches_with_the_sender_one_iteration_after_the_announcement():
    cfg = _config()
    sender, receiver = AutoEnd(cfg, "forward", "send"), AutoEnd(cfg, "forward", "recv")
    x = torch.randn(SHAPE)
    sender.prepare(x)  # measures the real candidates once; then fake costs and rates decide
    # 1 Mbit/s: paper (fewest bytes) wins; 100 Gbit/s: none (no codec time), by far: at the first measurement.
    _fake(sender, [1e6, 1e6, 1e11, 1e11] + [1e11] * 6)
    seen = [_exchange(sender, receiver, k, x)[:2] for k in range(7)]
    # Iteration 0 sends the start codec (none: the largest messages); the first measurement (iteration 0's
    # boundary: the fake meter always has one) chooses freely: paper from iteration 1; 1e11 at iteration 2's
    # boundary predicts none far faster (over ``jump``) and switches there, effective from iteration 3.
    assert [s for s, _ in seen] == ["none"] + ["paper"] * 2 + ["none"] * 4
    assert [r for _, r in seen] == [s for s, _ in seen]  # lockstep
    _, _, decoded = _exchange(sender, receiver, 7, x, 1)
    assert torch.equal(decoded[0], x.to(decoded[0].dtype))  # none: the bits as sent


def test_a_switch_that_made_iterations_slower_is_undone_and_that_codec_waits(monkeypatch, caplog):
    """Probation with a scripted clock: at 1 Mbit/s the model picks paper (fewest bytes), but paper's iterations
    take 1.5 s against none's 1.0 s: after 2 of them the sender announces none again, leaves paper out for 4
    measurements, and takes the next best, fp8 (0.8 s per iteration: kept); the receiver follows every switch."""
    import logging

    import megatron_tah.link.auto as auto_link

    cfg = _config(tah_auto_probation=2)
    sender, receiver = AutoEnd(cfg, "forward", "send", peer=1), AutoEnd(cfg, "forward", "recv", peer=0)
    x = torch.randn(SHAPE)
    sender.prepare(x)
    _fake(sender, [])
    rates = iter([None, None] + [1e6] * 20)  # the meter has nothing for iterations 0 and 1
    sender.meter.measure = lambda recent=None: (lambda rate: rate and LinkRate(rate, 0.0, 10))(next(rates))
    seconds = {"none": 1.0, "paper": 1.5, "fp8": 0.8}
    clock = [0.0]
    monkeypatch.setattr(auto_link.time, "monotonic", lambda: clock[0])
    seen = []
    with caplog.at_level(logging.INFO, logger=auto_link.__name__):
        for k in range(13):
            seen.append(_exchange(sender, receiver, k, x)[:2])
            clock[0] += seconds[sender.current]
    assert [s for s, _ in seen] == ["none"] * 3 + ["paper"] * 3 + ["none"] * 2 + ["fp8"] * 4 + ["paper"]
    assert [r for _, r in seen] == [s for s, _ in seen]  # lockstep
    assert "auto forward to rank 1: paper's fastest iteration took 1500 ms, none's 1000 ms: back to none" in caplog.text
    # paper came back after 4 measurements (the model still prefers it) and is on probation again
    assert sender.probation.trial == ("fp8", "paper", 12) and sender.chooser.rejected == {}


def test_the_sender_says_which_candidates_the_accuracy_floor_leaves_out(caplog):
    """On its first message the sender measures the candidates and logs the floor (paper's error on that tensor)
    with the candidates above it and their errors; at a depth where a candidate's steps were measured it passes
    the floor and the line says so."""
    import logging
    import re

    import megatron_tah.link.auto as auto_link

    from megatron_tah.codecs.core.samples import activation_like

    x = activation_like((64, 2, 128))  # outlier channels: fixed point's error is above paper's here
    for depth in (1, 8):
        caplog.clear()
        sender = AutoEnd(_config(tah_auto_candidates="none,fp8,paper,hadint4,lowrank,fixedpoint4"), "forward", "send",
                         peer=1, depth=depth)
        with caplog.at_level(logging.INFO, logger=auto_link.__name__):
            sender.prepare(x)
        costs, floor = sender.table.costs, sender.chooser.floor()
        assert floor == pytest.approx(costs["paper"].error) and floor > 0
        line = next(r.getMessage() for r in caplog.records if "accuracy floor" in r.getMessage())
        left_out = re.search(r"left out: ([^;]*)", line).group(1)
        above = {name for name, cost in costs.items() if cost.error > floor}
        assert above, {name: cost.error for name, cost in costs.items()}  # the floor leaves something out here
        measured = {name for name in above if steps_measured(name, depth)}
        assert {item.split()[0] for item in left_out.split(", ") if item != "nothing"} == above - measured
        assert ("judged by their steps measured at depth 8" in line) == bool(measured)
        sender.chooser.update(1e6)
        assert set(sender.chooser.predicted) == set(costs) - (above - measured)


def test_a_buffer_of_another_codec_than_the_announced_one_is_an_error():
    cfg = _config()
    sender, receiver = AutoEnd(cfg, "forward", "send"), AutoEnd(cfg, "forward", "recv")
    for codec in receiver.codecs.values():
        codec.defer_checks("full")
    x = torch.randn(SHAPE)
    _exchange(sender, receiver, 0, x, 1)
    fp8 = sender.codecs["fp8"].encode(x)
    with pytest.raises(WireFormatError):
        receiver.codec.decode(torch.cat([fp8, fp8])[: receiver.codec.wire_nbytes(SHAPE, x.dtype)], SHAPE, x.dtype)


def test_announcements_that_disagree_or_name_another_iteration_are_errors():
    cfg = _config()
    x = torch.randn(SHAPE)
    sender, receiver = AutoEnd(cfg, "forward", "send"), AutoEnd(cfg, "forward", "recv")
    _exchange(sender, receiver, 0, x, 1)
    sender.next, sender._announcement = "fp8", None  # a sender changing its mind within an iteration
    _exchange(sender, receiver, 0, x, 1)
    with pytest.raises(WireFormatError, match="disagree"):
        receiver.begin(1)
    sender, receiver = AutoEnd(cfg, "forward", "send"), AutoEnd(cfg, "forward", "recv")
    _exchange(sender, receiver, 5, x, 1)
    receiver.iteration = 6  # out of step: the trailer names iteration 6, the receiver expects 7
    with pytest.raises(WireFormatError, match="out of step"):
        receiver.begin(7)
    receiver = AutoEnd(cfg, "forward", "recv")
    receiver.begin(0)
    receiver.received(bytes(ANNOUNCEMENT_NBYTES - 1) + b"\x01")
    with pytest.raises(WireFormatError, match="not an auto-codec announcement"):
        receiver.begin(1)
    with pytest.raises(WireFormatError, match="without an announcement"):
        receiver.received(None)


def test_resume_from_state_dicts_equals_an_uninterrupted_run():
    cfg = _config(tah_auto_candidates="none,fp8,paper,hadint4", tah_backward_codec="auto",
                  tah_auto_max_error=0.2)
    rates = [1e6, 1e11, 1e11, 1e6, 1e11, 1e11, 1e11, 1e11]  # one per iteration (interval 1)
    x = torch.randn(SHAPE)

    def ends(script):
        sender, receiver = AutoEnd(cfg, "backward", "send"), AutoEnd(cfg, "backward", "recv")
        sender.prepare(x)
        _fake(sender, script)
        return sender, receiver

    def run(sender, receiver, iterations, start=0):
        out = [_exchange(sender, receiver, k, x) for k in range(start, start + iterations)]
        return [(s, r, [d.tolist() for d in decoded]) for s, r, decoded in out]

    full = run(*ends(rates), 8)
    sender, receiver = ends(rates[:4])
    first = run(sender, receiver, 4)
    saved = {"send": sender.state_dict(), "recv": receiver.state_dict()}
    sender, receiver = ends(rates[4:])  # a new process: fresh ends, then the checkpoint
    sender.load_state_dict(saved["send"])
    receiver.load_state_dict(saved["recv"])
    second = run(sender, receiver, 4, start=4)
    assert first + second == full  # codecs and decoded bits (hadint4's stochastic rounding continues)
    # each rate change predicts the other codec far faster (over ``jump``): a switch at every change, and the one
    # decided at iteration 3's boundary (before the checkpoint) takes effect at iteration 4 (after it)
    assert [s for s, _, _ in full] == ["none", "paper", "none", "none", "paper", "none", "none", "none"]


def test_flags_validate_and_the_handshake_record_covers_the_candidates():
    assert TahConfig().tah_auto_candidates == "none,fp8,paper,hadint4,lowrank,fixedpoint4"
    assert TahConfig().auto_settings().probation == 2 and TahConfig(tah_auto_probation=0).auto_settings().probation == 0
    for bad in ({"tah_auto_interval": 0}, {"tah_auto_max_error": -1.0}, {"tah_auto_candidates": "none,int4"},
                {"tah_auto_probation": -1}, {"tah_auto_probation": True},
                {"tah_auto_candidates": "none,fp8"}):  # no paper and no max_error: no floor
        with pytest.raises(ValueError, match="tah_auto"):
            TahConfig(tah_forward_codec="auto", **bad)
    assert TahConfig(tah_forward_codec="auto", tah_auto_candidates="none,fp8", tah_auto_max_error=0.05)
    a, b = _config(), _config(tah_auto_candidates="none,paper")
    assert config_record(a)["forward"] != config_record(b)["forward"]
    assert config_record(a)["backward"] == config_record(b)["backward"]
    assert config_record(a)["forward"][1] == "auto(none, fp8, paper)"
    assert a.forward_codec().name == "none" and _config(tah_auto_candidates="fp8,paper").forward_codec().name == "tah"
    assert _config(tah_auto_candidates="fp8,hadint4", tah_auto_max_error=0.1).forward_codec().name == "fp8"


def test_the_log_line_names_each_links_codec_and_rate():
    stats = Stats(STREAMS)
    stats.record_auto(1, "paper", 1.02e6, 3e4)
    collected = stats.collect()
    assert collected["auto"] == {(0, 1): {"codec": "paper", "rate_bps": 1.02e6, "spread_bps": 3e4}}
    for d in ("forward", "backward"):
        collected[d]["messages"] = 0
    assert "tah auto 0->1: paper at 1.02 Mbit/s" in stats.format_for_log(collected)
    stats.record_auto(1, "none", None, None)
    assert "tah auto 0->1: none at rate not measured yet" in stats.format_for_log(stats.collect())


def test_the_trailer_round_trips_and_rejects_what_is_not_one():
    announcement = bytes([0xA7, 3, 1, 2, 3, 4, 5, 0])
    for trailer in (Trailer(announcement, 1_790_000_000.25, (123_456, 0.0125)), Trailer(None, 1.5, None),
                    Trailer(None, 2.0, (1, 1e-9))):
        raw = encode_trailer(trailer)
        assert len(raw) == TRAILER_NBYTES
        back = decode_trailer(raw)
        assert back.announcement == trailer.announcement and back.sent_at == pytest.approx(trailer.sent_at, abs=1e-6)
        if trailer.report is None:
            assert back.report is None
        else:  # microseconds on the wire; a report is never 0 s (1 us at least)
            assert back.report[0] == trailer.report[0]
            assert back.report[1] == pytest.approx(max(trailer.report[1], 1e-6), abs=1e-6)
    for bad in (bytes(TRAILER_NBYTES), encode_trailer(Trailer(None, 1.0))[:-1]):  # no sent-at stamp, short
        with pytest.raises(WireFormatError):
            decode_trailer(bad)
    with pytest.raises(ValueError):
        encode_trailer(Trailer(bytes(8), 1.0))  # an all-zero announcement reads as none: refused


def _transport_pair(config: dict):
    """Two installed transports' worth of link ends in one process: rank 0 and rank 1 of a PP=2 link
    (the transport object of each is built directly; nothing is sent, the trailers are handed over)."""
    from megatron_tah.link.transport import PipelineTransport

    cfg = TahConfig(tah_backend="torch", tah_auto_candidates=CANDIDATES, **config)
    return PipelineTransport(cfg, Stats(STREAMS)), PipelineTransport(cfg, Stats(STREAMS))


def _deliver(sender, receiver, direction, sender_rank, receiver_rank, nbytes, sent_at, done_at):
    """A message of ``nbytes`` on ``direction``, sent at wall time ``sent_at`` and complete at ``done_at``."""
    import megatron_tah.link.wire as wire

    end = sender.link(direction, "send", receiver_rank)
    announcement = end.auto.sent(0.0) if end.auto is not None else None
    report, end.report = end.report, None
    raw = wire.encode_trailer(Trailer(announcement, sent_at, report))
    receiver.link(direction, "recv", sender_rank).step(TrailerStep).received(raw, nbytes, done_at)


def test_each_direction_is_measured_by_its_receiver_and_reported_back():
    """Rank 0 sends activations to rank 1 over a 1 Mbit/s direction, rank 1 gradients back over a
    100 Mbit/s one (an asymmetric link): each sender's meter ends up with its own direction's rate,
    measured from the sent-at stamp (not from when the receiver posted: waiting for the peer's compute
    is not link time) and reported by the receiver in its next message the other way."""
    rank0, rank1 = _transport_pair({"tah_forward_codec": "auto", "tah_backward_codec": "auto"})
    for end in (rank0.link("forward", "send", 1), rank1.link("backward", "send", 0)):
        end.auto.begin(0)  # announcements name iteration 1
    for receiver, direction in ((rank1, "forward"), (rank0, "backward")):
        receiver.link(direction, "recv", 1 - (receiver is rank1)).auto.begin(0)
    nbytes, t = 125_000, 1000.0
    for _ in range(6):  # 1F1B-like: an activation, then a gradient, each after 10 s of the peer's compute
        _deliver(rank0, rank1, "forward", 0, 1, nbytes, sent_at=t, done_at=t + 1.0)  # 1 Mbit/s: 1 s
        t += 10.0
        _deliver(rank1, rank0, "backward", 1, 0, nbytes, sent_at=t, done_at=t + 0.01)  # 100 Mbit/s: 10 ms
        t += 10.0
    forward = rank0.link("forward", "send", 1).auto.meter
    backward = rank1.link("backward", "send", 0).auto.meter
    # 6 reports each way, the first reaching rank 1 with rank 0's first forward message after its gradient.
    assert forward.seen == 6 and backward.seen == 5
    assert forward.measure().rate_bps == pytest.approx(1e6, rel=1e-3)
    assert backward.measure().rate_bps == pytest.approx(1e8, rel=1e-3)


def test_a_fixed_direction_carries_the_trailer_and_reports_for_the_auto_one():
    rank0, rank1 = _transport_pair({"tah_forward_codec": "auto", "tah_backward_codec": "fixedpoint"})
    assert rank0.trailer_nbytes == rank1.trailer_nbytes == TRAILER_NBYTES
    rank0.link("forward", "send", 1).auto.begin(0)
    rank1.link("forward", "recv", 0).auto.begin(0)
    for k in range(5):
        _deliver(rank0, rank1, "forward", 0, 1, 80_000, sent_at=10.0 * k + 10, done_at=10.0 * k + 10.64)
        _deliver(rank1, rank0, "backward", 1, 0, 80_000, sent_at=10.0 * k + 15, done_at=10.0 * k + 15.1)
    assert rank0.link("backward", "recv", 1).auto is None
    assert rank0.link("forward", "send", 1).auto.meter.seen == 5  # (the first 2 skipped: 3 measured)
    meter = rank0.link("forward", "send", 1).auto.meter
    assert meter.measure().rate_bps == pytest.approx(8 * 80_000 / 0.64, rel=1e-3)
    rank0.latency[1] = 0.32  # handshake.link_latency's measurement: every message pays it, whatever its size
    for k in range(4):
        _deliver(rank0, rank1, "forward", 0, 1, 80_000, sent_at=100.0 + k, done_at=100.64 + k)
        _deliver(rank1, rank0, "backward", 1, 0, 80_000, sent_at=100.5 + k, done_at=100.6 + k)
    assert meter.measure().rate_bps == pytest.approx(8 * 80_000 / 0.32, rel=1e-3)
    # A fixed direction whose message announces a codec: the ends disagree about auto.
    raw = encode_trailer(Trailer(bytes([0xA7, 1, 0, 0, 0, 0, 1, 0]), 1.0))
    with pytest.raises(WireFormatError, match="fixed"):
        rank0.link("backward", "recv", 1).step(TrailerStep).received(raw, 100, 2.0)
    assert _transport_pair({"tah_forward_codec": "tah", "tah_backward_codec": "fixedpoint"})[0].trailer_nbytes == 0


@pytest.mark.parametrize("transit, expected", [(2e-4, "none"), (2e-4 + 8 * 80_000 / 1e5, "paper")])
def test_an_unlimited_link_chooses_none_and_a_slow_one_compresses(transit, expected):
    """Real codec costs (measured on this machine), reported transits: a transit equal to the ping's latency
    (an unlimited link: the bytes take no measurable time) chooses none; at 100 kbit/s the fewest bytes win (slow
    enough that the codecs' times, measured on a loaded CPU in Triton's interpreter, cannot outweigh them)."""
    rank0, rank1 = _transport_pair({"tah_forward_codec": "auto", "tah_backward_codec": "fixedpoint"})
    sender = rank0.link("forward", "send", 1)
    sender.auto.prepare(torch.randn(SHAPE))
    rank0.latency[1] = 2e-4
    for k in range(6):
        sender.auto.begin(k)
        rank1.link("forward", "recv", 0).auto.begin(k)
        _deliver(rank0, rank1, "forward", 0, 1, 80_000, sent_at=10.0 + k, done_at=10.0 + k + transit)
        _deliver(rank1, rank0, "backward", 1, 0, 80_000, sent_at=10.5 + k, done_at=10.6 + k)
    assert sender.auto.next == expected, (sender.auto.rate, sender.auto.chooser.predicted)  # (announced)


def test_after_the_rate_drops_the_link_switches_to_fewer_bytes_and_back_when_it_recovers():
    """A scripted 10x rate drop on the emulated link (``link/emulate.py``, fake clock): 10 Gbit/s, 1 Gbit/s from
    iteration 8, 10 Gbit/s again from iteration 20. The candidates' wire bytes and errors are measured, their
    times fixed (fp8 20 us, paper 40 us per encode and per decode: at 10 Gbit/s none is fastest, at 1 Gbit/s paper);
    two messages an iteration, each billed its codec's wire bytes; the receiver switches with the sender throughout.

    The drop: within ``bound`` iterations, less than one interval, the choice is a codec with fewer wire bytes:
    once the latest 3 transfers (2 iterations of 2 messages, the report lagging one message) are all under half
    the rate last measured at their size, the meter measures at that boundary from them alone
    (``LinkRateMeter.collapsed``), a gain of 5% switches without waiting for ``patience``, and the choice takes
    effect at the next boundary. The recovery takes longer by
    design: the compressed messages are smaller, and a small message's rate says nothing of a large one's (a token
    bucket carries small messages at its burst rate), so the slow rate measured on the uncompressed size is kept
    for ``memory`` (4) measurements before the current rate stands in for it (``choice.py``): ``bound_back``."""
    import dataclasses

    from megatron_tah.link.emulate import LinkEmulator

    interval, fast, slow = 4, 1e10, 1e9
    bound = 3  # < interval: within one interval
    bound_back = (4 + 3) * interval + 2
    rank0, rank1 = _transport_pair({"tah_forward_codec": "auto", "tah_backward_codec": "fixedpoint",
                                    "tah_auto_interval": interval, "tah_auto_probation": 0})
    sender, receiver = rank0.link("forward", "send", 1), rank1.link("forward", "recv", 0)
    x = torch.randn(SHAPE)
    sender.auto.prepare(x)
    seconds = {"none": 0.0, "fp8": 20e-6, "paper": 40e-6}
    table = CodecCostTable.from_costs([dataclasses.replace(cost, encode_s=seconds[name], decode_s=seconds[name])
                                       for name, cost in sender.auto.table.costs.items()])
    sender.auto.table, sender.auto.chooser = table, Chooser(table, sender.auto.settings)
    clock = [1000.0]
    emulator = LinkEmulator(fast, latency_s=1e-3, clock=lambda: clock[0], sleep=lambda s: None)
    rank0.latency[1] = 1e-3  # (the handshake's ping)
    rate_at = {k: (slow if 8 <= k < 20 else fast) for k in range(40)}
    chosen = []
    for k in range(40):
        emulator.bandwidth_bps = rate_at[k]
        sender.auto.begin(k)
        receiver.auto.begin(k)
        assert receiver.auto.current == sender.auto.current  # lockstep
        codec_name = sender.auto.current
        chosen.append(codec_name)
        nbytes = sender.auto.codec.wire_nbytes(SHAPE, x.dtype) + TRAILER_NBYTES
        for _ in range(2):  # two micro-batches: the peer computes 0.5 s between messages
            encode_s = sender.auto.table.costs[codec_name].encode_s
            announcement = sender.auto.sent(encode_s)
            report, sender.report = sender.report, None
            sent_at = clock[0]
            done_at = emulator.finish_time((0, 1), nbytes, sent_at, receiver=True)
            receiver.step(TrailerStep).received(encode_trailer(Trailer(announcement, sent_at, report)), nbytes, done_at)
            clock[0] = done_at + 0.5
            back = rank1.link("backward", "send", 0)  # the gradient, on a fast fixed direction, carries the report
            report, back.report = back.report, None
            rank0.link("backward", "recv", 1).step(TrailerStep).received(encode_trailer(Trailer(None, clock[0], report)),
                                                                  10_000, clock[0] + 1e-3)
            clock[0] += 0.5
    wire = {name: sender.auto.table.costs[name].wire_nbytes for name in sender.auto.table.costs}
    before, during, after = chosen[:8], chosen[8:20], chosen[20:]
    assert set(before[1:]) == {"none"}, chosen  # at 10 Gbit/s the codecs' time outweighs the bytes they save
    switched = next(k for k, name in enumerate(during) if wire[name] < wire["none"])
    assert switched <= bound and all(wire[name] < wire["none"] for name in during[switched:]), (chosen, wire)
    back_at = next(k for k, name in enumerate(after) if name == "none")
    assert back_at <= bound_back and set(after[back_at:]) == {"none"}, chosen


def test_the_last_measurement_a_collapse_is_judged_against_survives_a_checkpoint():
    """``AutoEnd.state_dict`` carries the last ``LinkRate``: a resumed run checks a collapse against the same rate
    as the uninterrupted one (without it, the first boundaries after a resume could decide otherwise)."""
    from megatron_tah.link.measure import LinkRate

    cfg = _config()
    sender = AutoEnd(cfg, "forward", "send")
    sender.rate = LinkRate(1e9, 1e8, 4, by_size=((1_000_000, 1.1e9),))
    state = sender.state_dict()
    resumed = AutoEnd(cfg, "forward", "send")
    resumed.load_state_dict(state)
    assert resumed.rate == sender.rate
    for end in (sender, resumed):
        for _ in range(3):
            end.meter.record(1_000_000, 0.08)  # 100 Mbit/s: under half of 0.9 Gbit/s
    assert sender.meter.collapsed(sender.rate) and resumed.meter.collapsed(resumed.rate)
    old = {k: v for k, v in state.items() if k != "rate"}  # a checkpoint written before the field
    older = AutoEnd(cfg, "forward", "send")
    older.load_state_dict(old)
    assert older.rate is None


@pytest.mark.parametrize("drop", [8, 9])  # at a regular measurement's boundary; inside its window
def test_a_drop_switches_one_iteration_after_it_even_inside_the_window_and_behind_a_late_receiver(monkeypatch, drop):
    """Where the receiver posts late (a last stage between its forward and backward steps), most transits are
    its wait, before a drop as after it, so the latest transfers are never all far under the last rate's slower
    quartile (``LinkRateMeter.collapsed``); and a window that began before the drop still holds a transfer at the old
    rate, its fastest. But the first whole iteration at the dropped rate has its fastest transfer under half the last
    measurement's at the same size (``LinkRateMeter.fell``): the sender measures from that iteration's transfers at
    the next boundary, and a 5% predicted gain switches there, without ``patience``; the choice takes effect one
    iteration later. Without the check, the drop waits for regular measurements and ``patience``."""
    import dataclasses

    from megatron_tah.link.measure import LinkRateMeter

    interval, fast, slow = 4, 8e9, 8e8  # at 8e8 paper is ~37% faster than none: more than 5%, less than a jump
    seconds = {"none": 0.0, "fp8": 20e-6, "paper": 40e-6}

    def run() -> list[str]:
        end = AutoEnd(_config(tah_auto_interval=interval), "forward", "send")
        end.prepare(torch.randn(SHAPE))
        table = CodecCostTable.from_costs([dataclasses.replace(cost, encode_s=seconds[name], decode_s=seconds[name])
                                           for name, cost in end.table.costs.items()])
        end.table, end.chooser = table, Chooser(table, end.settings, current="none")
        nbytes = table.costs["none"].wire_nbytes
        chosen = []
        for k in range(24):
            end.begin(k)
            chosen.append(end.current)
            rate = fast if k < drop else slow
            assert end.rate is None or not end.meter.collapsed(end.rate)  # the late posts hide the drop from it
            for late in (2e-3, 2e-3, 2e-3, 0.0):  # one message of four finds the receiver posted
                end.meter.record(nbytes, late + 8 * nbytes / rate)
        return chosen

    chosen = run()
    switch = drop + 2  # measured at boundary drop + 1 from iteration drop's transfers
    assert set(chosen[:switch]) == {"none"} and set(chosen[switch:]) == {"paper"}, chosen
    monkeypatch.setattr(LinkRateMeter, "fell", lambda self, last, factor=0.5: 0)
    without = run()
    later = {8: 17, 9: 21}[drop]  # regular measurements (12, 16, 20) with patience 2; at 9, 12's window is not all slow
    assert set(without[:later]) == {"none"} and set(without[later:]) == {"paper"}, without


def test_a_meter_finds_a_fall_in_its_latest_whole_iterations_and_measures_from_them_alone():
    """``LinkRateMeter.fell``: the longest run of whole iterations whose fastest transfer is under half the last
    measurement's at every common size; a suffix shorter than ``min_transfers``, another message size or a
    slower-but-not-half iteration is no fall; a measurement resets the iterations; a checkpoint keeps them."""
    from megatron_tah.link.measure import LinkRate, LinkRateMeter

    last = LinkRate(8e9, 1e9, 12, by_size=((1000, 8e9),))
    meter = LinkRateMeter(interval=4, skip_first=0, quantile=1.0)
    for rate in (8e9, 8e9):  # one iteration at the old rate
        meter.record(1000, 8 * 1000 / rate)
    meter.iteration_done()
    assert meter.fell(last) == 0  # the window's fastest is the old rate's; the new iteration is empty
    for rate in (5e9, 5e9, 5e9):  # slower, not under half
        meter.record(1000, 8 * 1000 / rate)
    meter.iteration_done()
    assert meter.fell(last) == 0
    for rate in (1e9, 2e9):  # under half, but 2 transfers < min_transfers
        meter.record(1000, 8 * 1000 / rate)
    meter.iteration_done()
    assert meter.fell(last) == 0
    meter.record(500, 8 * 500 / 1e9)  # another size only: no size in common
    meter.record(1000, 8 * 1000 / 1e9)
    meter.iteration_done()
    assert meter.fell(last) == 4  # the last two iterations: 4 transfers, under half at 1000 bytes
    resumed = LinkRateMeter(interval=4, skip_first=0, quantile=1.0)
    resumed.load_state_dict(meter.state_dict())
    assert resumed.fell(last) == 4
    rate = meter.measure(recent=meter.fell(last))
    assert rate.rate_bps == pytest.approx(2e9) and dict(rate.by_size)[1000] == pytest.approx(2e9)
    assert meter.marks == [0] and meter.fell(last) == 0
