"""The auto codec's decision core: link-rate estimate, codec costs, choice with hysteresis, lockstep
announcements and resume (fake link rates and codec costs; one test measures the real codecs on CPU)."""

import dataclasses
import random
import warnings

import pytest
import torch

from megatron_tah.codecs import WireFormatError, get_codec
from megatron_tah.codecs.none import NoneCodec
from megatron_tah.codecs.core.samples import activation_like
from megatron_tah.config import DEFAULT_CANDIDATES, AutoSettings, candidate_codec
from megatron_tah.link.choice import Chooser, Probation, predicted_seconds
from megatron_tah.link.measure import CandidateCost, CodecCostTable, LinkRate, LinkRateMeter
from megatron_tah.link.wire import ANNOUNCEMENT_NBYTES, AutoDecision, decode_announcement, encode_announcement

MBIT = 1e6
UNLIMITED = 1e15  # bits/s: what a transfer timed near 0 s gives

# A [1024, 1, 1600] bf16 message (3.3 MB): seconds per call roughly as measured on an H100 (docs/DESIGN.md).
FAKE = [
    CandidateCost("none", 0, 0x11, 5e-5, 5e-5, 3_276_816, 0.0),
    CandidateCost("fp8", 3, 0x33, 3e-4, 3e-4, 1_689_616, 0.027),
    CandidateCost("paper", 2, 0x22, 4e-4, 3e-4, 918_560, 0.094),
    CandidateCost("hadint4", 8, 0x88, 3e-4, 3e-4, 870_416, 0.066),
    CandidateCost("lowrank", 9, 0x99, 4e-3, 1e-3, 858_384, 0.060),
]
LOSSY = CandidateCost("lossy", 6, 0x66, 1e-4, 1e-4, 100_000, 0.5)


def chooser(costs=FAKE, current=None, **settings):
    settings.setdefault("candidates", ("none", "fp8", "paper", "hadint4", "lowrank"))
    return Chooser(CodecCostTable.from_costs(costs), AutoSettings(**settings), current=current)


def break_even(a: CandidateCost, b: CandidateCost) -> float:
    """The link rate (bits/s) at which ``a`` and ``b`` take equally long per message."""
    return 8 * (a.wire_nbytes - b.wire_nbytes) / (b.encode_s + b.decode_s - a.encode_s - a.decode_s)


# ----- settings ----------------------------------------------------------------------------------
def test_settings_defaults_and_validation():
    settings = AutoSettings()
    assert settings.candidates == DEFAULT_CANDIDATES == ("none", "fp8", "paper", "hadint4", "lowrank", "fixedpoint4")
    assert (settings.max_error, settings.interval, settings.gain, settings.patience, settings.jump, settings.overlap,
            settings.probation) == (None, 50, 0.05, 2, 0.5, 0.0, 2)
    assert AutoSettings(candidates="none, fp8,paper").candidates == ("none", "fp8", "paper")
    for bad, match in [({"candidates": ()}, "empty"), ({"candidates": ("none", "zip")}, "zip"),
                       ({"candidates": ("none", "none", "paper")}, "twice"),
                       ({"candidates": ("none", "fp8")}, "paper"), ({"max_error": -0.1}, "max_error"),
                       ({"max_error": float("nan")}, "max_error"), ({"interval": 0}, "interval"),
                       ({"gain": 1.0}, "gain"), ({"patience": 0}, "patience"),
                       ({"jump": 1.0}, "jump"), ({"gain": 0.2, "jump": 0.1}, "jump"), ({"overlap": 1.5}, "overlap"),
                       ({"probation": -1}, "probation")]:
        with pytest.raises(ValueError, match=match):
            AutoSettings(**bad)
    assert AutoSettings(candidates=("none", "fp8"), max_error=0.05).max_error == 0.05


# ----- 1. the link -------------------------------------------------------------------------------
def test_link_rate_sees_through_waiting_and_first_call_outliers():
    rng = random.Random(0)
    meter = LinkRateMeter(interval=50)
    meter.record(1_000_000, 30.0)  # connection set-up
    meter.record(1_000_000, 1e-7)  # a send that returned once buffered
    link_s = 8 * 1_000_000 / (100 * MBIT)
    for i in range(200):
        wait = rng.uniform(0.0, 1.0) if i % 5 < 3 else 0.0  # 60% of transfers also waited for the peer
        meter.record(1_000_000, link_s * rng.uniform(0.98, 1.02) + wait)
    rate = meter.measure()
    assert rate.transfers == 200
    assert rate.rate_bps == pytest.approx(100 * MBIT, rel=0.05)
    assert rate.spread_bps > 0
    assert "Mbit/s" in rate.describe()
    assert meter.measure() is None  # the window was consumed


def test_link_rate_uses_the_large_messages_and_needs_enough_of_them():
    meter = LinkRateMeter(skip_first=0, min_transfers=3)
    for _ in range(2):
        meter.record(1_000_000, 0.08)
    for _ in range(50):
        meter.record(1_000, 0.01)  # latency-bound: 0.8 Mbit/s if it counted
    assert meter.measure() is None  # two large messages are too few; nothing consumed
    meter.record(1_000_000, 0.08)
    assert meter.measure().rate_bps == pytest.approx(100 * MBIT)
    # The messages shrank (a codec switch): the last large ones do not stall the meter a second time.
    for _ in range(2):
        meter.record(1_000_000, 0.08)
    for _ in range(4):
        meter.record(100_000, 0.008)
    assert meter.measure() is None and len(meter.window) == 6
    assert meter.measure().rate_bps == pytest.approx(100 * MBIT) and meter.window == []
    assert meter.state_dict()["stalled"] is False


def test_link_rate_unlimited_and_bad_input():
    meter = LinkRateMeter(skip_first=0)
    for _ in range(4):
        meter.record(4096, 0.0)
    rate = meter.measure()
    assert rate.rate_bps > 1e12 and rate.rate_bps < float("inf")
    for nbytes, seconds in [(0, 1.0), (-5, 1.0), (10, -1.0), (10, float("nan")), (10, float("inf"))]:
        with pytest.raises(ValueError, match="transfer"):
            meter.record(nbytes, seconds)
    assert [LinkRateMeter(interval=50).due(i) for i in (0, 1, 49, 50, 100)] == [True, False, False, True, True]


def test_link_meter_resumes_exactly():
    rng = random.Random(1)
    transfers = [(1_000_000, rng.uniform(0.08, 0.5)) for _ in range(40)]
    whole = LinkRateMeter()
    for item in transfers:
        whole.record(*item)
    first = LinkRateMeter()
    for item in transfers[:17]:
        first.record(*item)
    resumed = LinkRateMeter()
    resumed.load_state_dict(first.state_dict())
    for item in transfers[17:]:
        resumed.record(*item)
    assert resumed.measure() == whole.measure()


# ----- 3. the choice (fake costs) ------------------------------------------------------------------
def test_slow_link_picks_a_compressing_codec_and_an_unlimited_link_none():
    slow = chooser()
    picked = slow.update(LinkRate(1 * MBIT, 0.0, 10))
    assert picked != "none"
    assert slow.table.costs[picked].wire_nbytes < slow.table.costs["none"].wire_nbytes / 3
    assert picked == min(slow.predicted, key=slow.predicted.get)
    assert chooser().update(UNLIMITED) == "none"
    # 10 Gbit/s: hadint4's 0.6 ms of codec time save 2 ms of wire; at 100 Gbit/s they save 0.2 ms
    assert chooser().update(10_000 * MBIT) == "hadint4"
    assert chooser().update(100_000 * MBIT) == "none"
    # the prediction itself: codec time plus bytes over the rate
    assert predicted_seconds(FAKE[1], 8e9) == pytest.approx(6e-4 + 1_689_616 / 1e9)
    assert predicted_seconds(FAKE[1], 8e9, overlap=1.0) == pytest.approx(1_689_616 / 1e9)


def test_the_floor_excludes_a_too_lossy_candidate():
    costs = FAKE + [LOSSY]
    floor = chooser(costs).floor()
    assert floor == FAKE[2].error  # the default TAH-Quant codec's error
    assert chooser(costs).update(1 * MBIT) != "lossy"
    assert chooser(costs, max_error=1.0).update(1 * MBIT) == "lossy"
    # an explicit floor below TAH-Quant's: only none and fp8 remain
    strict = chooser(costs, max_error=0.03)
    assert strict.update(1 * MBIT) == "fp8" and set(strict.predicted) == {"none", "fp8"}
    # the reference dropped: nothing may be less accurate than lossless
    no_reference = chooser(costs)
    with pytest.warns(RuntimeWarning, match="paper"):
        no_reference.table.drop("paper", "kernel did not compile")
    assert no_reference.update(1 * MBIT) == "none"


def test_no_flapping_under_noise():
    rate = break_even(FAKE[0], FAKE[3])  # none and hadint4 (~38 Gbit/s; the others are slower there)
    rng = random.Random(2)
    rates = [rate * rng.uniform(0.95, 1.05) for _ in range(200)]
    steady, naive = chooser(current="none"), chooser(current="none", gain=0.0, patience=1)
    steady_picks = [steady.update(r) for r in rates]
    naive_picks = [naive.update(r) for r in rates]
    assert steady_picks == ["none"] * len(rates)
    assert set(naive_picks) == {"none", "hadint4"}
    assert sum(a != b for a, b in zip(naive_picks, naive_picks[1:])) > 20  # without hysteresis it flaps


def test_switching_needs_two_consecutive_measurements():
    """A gain of at least ``gain`` but under ``jump`` needs ``patience`` measurements in a row (jump set out of the
    way here: 1 Mbit/s against an unlimited link is a gain of >99%)."""
    slow, fast = 1 * MBIT, UNLIMITED
    c = chooser(current="none", jump=0.999)
    picks = [c.update(r) for r in (slow, fast, slow, fast, slow, slow, slow, fast, fast)]
    assert picks == ["none"] * 5 + ["lowrank"] * 3 + ["none"]
    assert chooser(current="none", patience=3, jump=0.999).update(slow) == "none"
    # a gain under 5% never switches, however often it is seen
    near = chooser([FAKE[0], dataclasses.replace(FAKE[0], name="paper", codec_id=2, config_digest=0x22,
                                                 wire_nbytes=3_200_000)], current="none")
    assert [near.update(1 * MBIT) for _ in range(5)] == ["none"] * 5


def test_a_large_predicted_gain_switches_at_the_first_measurement():
    """``jump`` (50%): a rate that fell far (a 10x drop) switches at once; a moderate gain (hadint4 predicted at 70%
    of none's time) still needs ``patience``."""
    none, hadint4 = FAKE[0], FAKE[3]
    codec_s = lambda c: c.encode_s + c.decode_s  # noqa: E731
    # the rate where hadint4's message takes 0.7 of none's: codec_h + 8 b_h / r = 0.7 (codec_n + 8 b_n / r)
    moderate = 8 * (hadint4.wire_nbytes - 0.7 * none.wire_nbytes) / (0.7 * codec_s(none) - codec_s(hadint4))
    c = chooser(current="none")
    assert c.update(moderate) == "none" and c.predicted["hadint4"] == pytest.approx(0.7 * c.predicted["none"])
    assert c.update(moderate) == "hadint4"  # the second measurement in a row
    dropped = chooser(current="none")
    assert dropped.update(UNLIMITED) == "none"
    assert dropped.update(1 * MBIT) == "lowrank"  # at once
    assert dropped.predicted["lowrank"] <= 0.5 * dropped.predicted["none"]


def test_a_dropped_or_too_lossy_current_codec_is_left_at_once():
    c = chooser(current="hadint4")
    with pytest.warns(RuntimeWarning, match="hadint4"):
        c.table.drop("hadint4", "RuntimeError: kernel failed")
    assert c.update(1 * MBIT) == "lowrank"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c.table.drop("hadint4", "again")  # one warning per candidate
    assert chooser(current="hadint4", max_error=0.03).update(1 * MBIT) == "fp8"


def test_observed_costs_refresh_the_table():
    c = chooser(current="none")
    table = c.table
    table.observe("fp8", encode_s=1.3e-3)  # weight 0.25: 0.75 * 3e-4 + 0.25 * 1.3e-3
    assert table.costs["fp8"].encode_s == pytest.approx(5.5e-4)
    assert table.costs["fp8"].decode_s == FAKE[1].decode_s
    with pytest.raises(ValueError, match="zip"):
        table.observe("zip", encode_s=1.0)


def test_resume_equals_an_uninterrupted_run():
    rng = random.Random(3)
    rates = [rng.choice([1 * MBIT, 300 * MBIT, 10_000 * MBIT, UNLIMITED]) * rng.uniform(0.9, 1.1) for _ in range(60)]
    whole = chooser(current="paper")
    expected = [whole.update(r) for r in rates]
    assert len(set(expected)) >= 2
    for cut in (1, 13, 31):
        first = chooser(current="paper")
        picks = [first.update(r) for r in rates[:cut]]
        resumed = chooser(current="paper")
        resumed.load_state_dict(first.state_dict())
        picks += [resumed.update(r) for r in rates[cut:]]
        assert picks == expected
    with pytest.raises(ValueError, match="zip"):
        chooser().load_state_dict({"current": "zip", "streak": 0})


def test_nothing_within_the_floor_is_an_error():
    c = chooser([FAKE[2], LOSSY], candidates=("paper",), max_error=0.01)
    with pytest.raises(RuntimeError, match="floor"):
        c.update(1 * MBIT)
    with pytest.raises(ValueError, match="rate"):
        chooser().update(0.0)
    with pytest.raises(RuntimeError, match="nothing chosen"):
        chooser().announcement(0)


# ----- 2. real codecs on the CPU ---------------------------------------------------------------------
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_real_codec_costs_on_cpu(direction):
    shape, dtype = (32, 2, 128), torch.bfloat16
    table = CodecCostTable.for_direction(AutoSettings(), direction, shape, dtype, backend="torch", calls=2)
    assert not table.dropped
    # backward: lowrank's gradients are hadint4's codec and fixedpoint4's are paper's (6-bit fixed point), so each
    # is one candidate on the wire
    expected = DEFAULT_CANDIDATES if direction == "forward" else ("none", "fp8", "paper", "hadint4")
    assert tuple(table.costs) == expected
    if direction == "backward":
        assert table.aliases == {"lowrank": "hadint4", "fixedpoint4": "paper"}
    for name, cost in table.costs.items():
        codec = candidate_codec(name, direction, backend="torch")
        assert cost.encode_s > 0 and cost.decode_s > 0
        assert cost.wire_nbytes == codec.wire_nbytes(shape, dtype)
        assert (cost.codec_id, cost.config_digest) == (codec.codec_id, codec.config_digest())
        assert cost.error == 0.0 if name == "none" else 0.0 < cost.error < 0.2
    c = Chooser(table, AutoSettings())
    assert c.floor() == table.costs["paper"].error
    # 100 kbit/s: the wire dominates by ~1 s, whatever the CPU's load
    picked = c.update(1e5)
    assert picked != "none" and table.costs[picked].wire_nbytes == min(table.costs[n].wire_nbytes for n in c.predicted)


def test_a_failing_candidate_is_dropped_with_one_warning():
    class Broken(NoneCodec):
        name, codec_id = "broken", 250

        def _encode_torch(self, x, buf, layout):
            raise RuntimeError("kernel did not compile")

    def unbuildable():
        return get_codec("hadint", bits=1)

    with pytest.warns(RuntimeWarning) as caught:
        table = CodecCostTable({"none": get_codec("none"), "broken": Broken(), "hadint1": unbuildable},
                               (8, 1, 64), torch.float32, calls=1)
    assert tuple(table.costs) == ("none",)
    assert set(table.dropped) == {"broken", "hadint1"} and "kernel did not compile" in table.dropped["broken"]
    assert "CodecError" in table.dropped["hadint1"]
    assert sorted(str(w.message).split("'")[1] for w in caught) == ["broken", "hadint1"]
    with pytest.raises(ValueError, match="sample"):
        CodecCostTable({"none": get_codec("none")}, (8, 1, 64), torch.float32, sample=torch.zeros(4))


# ----- 4. the lockstep switch ------------------------------------------------------------------------
def test_announcement_round_trip_and_garbage():
    codecs = {name: candidate_codec(name, "forward", backend="torch") for name in ("none", "fp8", "paper")}
    for name, codec in codecs.items():
        for iteration in (1, 77, 2**16 + 5):
            decision = AutoDecision(name, codec.codec_id, codec.config_digest(), iteration)
            raw = encode_announcement(decision)
            assert len(raw) == ANNOUNCEMENT_NBYTES
            assert decode_announcement(raw, codecs, iteration) == decision
            as_tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            assert decode_announcement(as_tensor, codecs, iteration) == decision
    raw = encode_announcement(AutoDecision("fp8", codecs["fp8"].codec_id, codecs["fp8"].config_digest(), 10))
    with pytest.raises(WireFormatError, match="out of step"):
        decode_announcement(raw, codecs, 11)
    with pytest.raises(WireFormatError, match="candidates"):
        decode_announcement(raw, {"none": codecs["none"], "paper": codecs["paper"]}, 10)
    other_fp8 = get_codec("fp8", group_size=64)
    with pytest.raises(WireFormatError, match="digest"):
        decode_announcement(raw, {"fp8": other_fp8}, 10)
    with pytest.raises(WireFormatError, match="not an auto-codec"):
        decode_announcement(raw[:7], codecs, 10)
    with pytest.raises(WireFormatError, match="not an auto-codec"):
        decode_announcement(bytes([0]) + raw[1:], codecs, 10)
    rng = random.Random(4)
    for _ in range(2000):
        with pytest.raises(WireFormatError):
            decode_announcement(rng.randbytes(8), codecs, 10)
    with pytest.raises(ValueError, match="cannot encode"):
        encode_announcement(AutoDecision("x", 300, 0, 1))


def test_lockstep_switch_decodes_every_message():
    """A sender switching codecs and a receiver following the announcements, message by message."""
    names, shape, dtype = ("none", "fp8", "paper"), (16, 2, 128), torch.bfloat16
    sender_codecs = {name: candidate_codec(name, "forward", backend="torch") for name in names}
    receiver_codecs = {name: candidate_codec(name, "forward", backend="torch") for name in names}
    costs = [CandidateCost(name, codec.codec_id, codec.config_digest(), 1e-5 if name == "none" else 1e-4, 1e-4,
                           codec.wire_nbytes(shape, dtype), 0.0 if name == "none" else 0.05)
             for name, codec in sender_codecs.items()]
    c = Chooser(CodecCostTable.from_costs(costs), AutoSettings(candidates=names, jump=0.999),  # (patience's path)
                current="none")
    rates = [UNLIMITED, 1e3, 1e3, 1e3, UNLIMITED, UNLIMITED, UNLIMITED, 1e3, 1e3, 1e3]
    sender_active = receiver_active = "none"  # agreed at the handshake
    used = []
    for iteration, rate in enumerate(rates):
        c.update(rate)  # the boundary's measurement
        trailer = torch.frombuffer(bytearray(encode_announcement(c.announcement(iteration))), dtype=torch.uint8)
        for micro_batch in range(3):
            x = activation_like(shape, dtype, seed=10 * iteration + micro_batch)
            buf = sender_codecs[sender_active].encode(x)
            message = torch.cat([buf, trailer])
            posted = receiver_codecs[receiver_active].wire_nbytes(shape, dtype) + ANNOUNCEMENT_NBYTES
            assert message.numel() == posted
            y = receiver_codecs[receiver_active].decode(message[:-ANNOUNCEMENT_NBYTES], shape, dtype)
            assert torch.equal(y, sender_codecs[sender_active].decode(buf, shape, dtype))
            announced = decode_announcement(message[-ANNOUNCEMENT_NBYTES:], receiver_codecs, iteration + 1)
        used.append(receiver_active)
        sender_active, receiver_active = c.announcement(iteration).name, announced.name
    # decided at the boundary of iterations 2, 5 and 8 (the second measurement in a row), used from 3, 6 and 9
    assert used == ["none"] * 3 + ["paper"] * 3 + ["none"] * 3 + ["paper"]


def test_a_buffer_from_another_codec_than_announced_is_an_error():
    shape, dtype = (16, 2, 128), torch.bfloat16
    x = activation_like(shape, dtype)
    paper = candidate_codec("paper", "forward", backend="torch")
    same_size = get_codec("tah", outlier_threshold=0.0, backend="torch")  # another config, same length
    assert same_size.wire_nbytes(shape, dtype) == paper.wire_nbytes(shape, dtype)
    with pytest.raises(WireFormatError, match="another config"):
        paper.decode(same_size.encode(x), shape, dtype)
    with pytest.raises(WireFormatError, match="bytes"):
        paper.decode(candidate_codec("fp8", "forward", backend="torch").encode(x), shape, dtype)
    with pytest.raises(ValueError, match="direction"):
        candidate_codec("paper", "sideways")


def test_a_rate_read_on_small_messages_is_not_extrapolated_to_larger_ones():
    """A token-bucket link (1 Mbit/s sustained, a burst allowance larger than a compressed message)
    carries compressed messages at line rate; the rate measured on the large messages first keeps
    predicting the large ones until it is ``memory`` measurements old."""
    costs = [CandidateCost("none", 0, 0, 0.0, 0.0, 64_000, 0.0),
             CandidateCost("paper", 1, 1, 0.01, 0.01, 18_000, 0.1)]
    settings = AutoSettings(candidates=("none", "paper"), memory=3)
    chooser = Chooser(CodecCostTable.from_costs(costs), settings)
    assert chooser.update(LinkRate(1e6, 0.0, 4, by_size=((64_024, 1e6),))) == "paper"
    burst = LinkRate(6e8, 0.0, 4, by_size=((18_024, 6e8),))
    assert [chooser.update(burst) for _ in range(2)] == ["paper", "paper"]  # none still predicted at 1 Mbit/s
    assert chooser.predicted["none"] == pytest.approx(8 * 64_000 / 1e6)
    # The large size's rate is 3 measurements old now: the current one stands in, and none wins by far
    # (0.9 ms against paper's 20 ms: over ``jump``), at once.
    assert chooser.update(burst) == "none"
    state = chooser.state_dict()
    again = Chooser(CodecCostTable.from_costs(costs), settings)
    again.load_state_dict(state)
    assert again.size_rates == chooser.size_rates and again.measurements == chooser.measurements
    with pytest.raises(ValueError, match="memory"):
        AutoSettings(memory=0)


def test_floor_follows_paper_when_an_earlier_candidate_is_the_same_codec():
    # fixedpoint4's gradients are paper's codec: listed first, it stands for paper in the backward table, and the
    # floor is still paper's error (not 0, which would leave only none)
    settings = AutoSettings(candidates=("none", "fixedpoint4", "paper"))
    table = CodecCostTable.for_direction(settings, "backward", (16, 2, 64), torch.float32, backend="torch", calls=1)
    assert tuple(table.costs) == ("none", "fixedpoint4") and table.aliases == {"paper": "fixedpoint4"}
    assert 0 < Chooser(table, settings).floor() == table.costs["fixedpoint4"].error


# ----- probation ---------------------------------------------------------------------------------
def test_probation_keeps_a_codec_only_if_its_fastest_iteration_beat_the_previous_ones():
    p = Probation(iterations=2)
    now = 0.0
    # iterations 1 (start-up, not timed), 2 and 3 with none, then the switch: 4 and 5 with fp8
    times = {1: 9.0, 2: 1.0, 3: 1.1, 4: 0.95, 5: 2.0}
    codec_of = {1: "none", 2: "none", 3: "none", 4: "fp8", 5: "fp8"}
    p.switched("none", "fp8", 4)
    for it in range(1, 6):
        p.begin(it, codec_of.get(it - 1, "none"), now)
        now += times[it]
        assert p.verdict() is None  # fp8 has not run 2 iterations yet
    p.begin(6, "fp8", now)
    assert [t[0] for t in p.times] == [2, 3, 4, 5]  # iteration 1 (start-up) not kept
    assert p.verdict() == "fp8" and p.compared == ("none", 1.0, "fp8", pytest.approx(0.95))  # 0.95 s < 1.0 s
    assert p.verdict() is None  # the trial is closed


def _run(probation, first, ended_codecs_and_seconds, now=0.0):
    """``begin`` for iterations ``first``, ``first + 1``, ...; each item: (codec of the iteration that just ended,
    seconds the new iteration takes). Returns the clock after the last one."""
    for it, (ended, seconds) in enumerate(ended_codecs_and_seconds, start=first):
        probation.begin(it, ended, now)
        now += seconds
    return now


def test_probation_goes_back_when_the_new_codec_was_not_faster_and_survives_a_checkpoint():
    p = Probation(iterations=2)
    now = _run(p, 1, [("none", 5.0), ("none", 1.0), ("none", 1.0)])  # iterations 1-3: none
    p.switched("none", "hadint4", 4)  # iterations 4 and 5: hadint4, slower than none
    q = Probation(iterations=2)
    q.load_state_dict(p.state_dict())  # a checkpoint between iterations 3 and 4
    assert q.trial == ("none", "hadint4", 4) and q.times == p.times
    for probation in (p, q):
        _run(probation, 4, [("none", 1.2), ("hadint4", 1.3), ("hadint4", 0.0)], now)
    assert p.verdict() == "none" and p.compared == ("none", 1.0, "hadint4", pytest.approx(1.2))
    # q resumed: iteration 3 (running at the checkpoint) and 4 (its first after the resume) are not timed,
    # so hadint4 has run one timed iteration (5) yet
    assert [t[0] for t in q.times] == [2, 5] and q.verdict() is None
    _run(q, 7, [("hadint4", 0.0)], 10.0)  # iteration 6 began at 9.5 s: 0.5 s, faster than none's 1.0 s
    assert q.verdict() == "hadint4"


def test_chooser_leaves_a_rejected_codec_out_for_memory_measurements():
    table = CodecCostTable.from_costs([CandidateCost("none", 0, 1, 0.0, 0.0, 1000, 0.0),
                                       CandidateCost("paper", 2, 2, 1e-3, 1e-3, 100, 0.1),
                                       CandidateCost("fp8", 3, 3, 1e-3, 1e-3, 300, 0.05)])
    settings = AutoSettings(candidates=("none", "paper", "fp8"), patience=1, memory=2)
    c = Chooser(table, settings, current="none")
    assert c.update(1e5) == "paper"  # 1000 vs 100 bytes at 100 kbit/s
    c.reject("paper", "none")
    assert c.current == "none" and c.state_dict()["rejected"] == {"paper": 1}
    assert c.update(1e5) == "fp8"  # paper left out: the next best
    assert c.update(1e5) == "fp8"
    d = Chooser(table, settings, current="none")
    d.load_state_dict(c.state_dict())
    assert d.update(1e5) == "paper" == c.update(1e5)  # 2 measurements later paper is back (and beats fp8)
    with pytest.raises(ValueError, match="not a measured candidate"):
        c.reject("paper", "zip")


def test_a_collapse_is_the_latest_transfers_far_under_the_last_rate_at_their_size():
    """``LinkRateMeter.collapsed``: the latest ``min_transfers`` transfers, all of a size the last measurement saw,
    each under half its rate then; ``measure(recent=...)`` reads only those (the older ones are the old rate's)."""
    from megatron_tah.link.measure import LinkRateMeter

    meter = LinkRateMeter(interval=50, skip_first=0, quantile=1.0)
    for _ in range(4):
        meter.record(1_000_000, 8e-3)  # 1 Gbit/s
    last = meter.measure()
    assert last.rate_bps == pytest.approx(1e9) and dict(last.by_size) == {1_000_000: pytest.approx(1e9)}
    for _ in range(3):
        meter.record(1_000_000, 8e-3)  # still 1 Gbit/s
    assert not meter.collapsed(last)
    for _ in range(2):
        meter.record(1_000_000, 80e-3)  # 100 Mbit/s
    assert not meter.collapsed(last)  # two slow ones are not yet min_transfers (3)
    meter.record(1_000_000, 80e-3)
    assert meter.collapsed(last)
    assert meter.measure(recent=3).rate_bps == pytest.approx(1e8) and not meter.window
    for _ in range(3):
        meter.record(100_000, 80e-3)  # a size the last measurement did not see: never a collapse
    assert not meter.collapsed(last)
    for _ in range(3):
        meter.record(1_000_000, 12e-3)  # 667 Mbit/s: slower, not under half
    assert not meter.collapsed(last)


def test_a_measurement_fell_from_the_last_when_its_fastest_transfer_is_under_half_at_every_common_size():
    """``LinkRate.fell_from``: compared size by size (a small message's rate says nothing of a large one's)."""
    from megatron_tah.link.measure import LinkRate

    last = LinkRate(1e9, 5e8, 8, by_size=((1_000_000, 1e9), (250_000, 8e8)))
    assert LinkRate(1e8, 1e7, 8, by_size=((1_000_000, 1e8),)).fell_from(last)
    assert not LinkRate(6e8, 1e7, 8, by_size=((1_000_000, 6e8),)).fell_from(last)  # slower, not under half
    assert not LinkRate(1e8, 1e7, 8, by_size=((1_000_000, 1e8), (250_000, 7e8))).fell_from(last)  # one size did not
    assert not LinkRate(1e7, 1e6, 8, by_size=((100_000, 1e7),)).fell_from(last)  # no size in common
    assert LinkRate(1e8, 1e7, 8, by_size=((1_000_000, 1e8),)).fell_from(last, factor=0.2)
    assert not LinkRate(3e8, 1e7, 8, by_size=((1_000_000, 3e8),)).fell_from(last, factor=0.2)


def test_a_measurement_taken_on_a_collapse_switches_on_a_small_gain_at_once():
    none, hadint4 = FAKE[0], FAKE[3]
    codec_s = lambda c: c.encode_s + c.decode_s  # noqa: E731
    moderate = 8 * (hadint4.wire_nbytes - 0.7 * none.wire_nbytes) / (0.7 * codec_s(none) - codec_s(hadint4))
    assert chooser(current="none").update(moderate) == "none"  # patience: a second measurement needed
    assert chooser(current="none").update(moderate, collapse=True) == "hadint4"


def test_the_channel_h4_candidate_sends_its_presets_codecs_and_shares_hadint4s_gradients():
    """As an auto candidate, ``channel_h4`` is the preset's codec each way: per-channel activations with the
    sequence's largest token apart, and on the gradients the very codec ``hadint4`` sends (one candidate there)."""
    shape, dtype = (32, 2, 128), torch.bfloat16
    settings = AutoSettings(candidates=("none", "paper", "hadint4", "channel_h4"))
    forward = CodecCostTable.for_direction(settings, "forward", shape, dtype, backend="torch", calls=1)
    assert "channel_h4" in forward.costs
    codec = candidate_codec("channel_h4", "forward", backend="torch")
    assert codec.name == "channel" and codec.config()["outlier_tokens"] == 1
    assert forward.costs["channel_h4"].wire_nbytes == codec.wire_nbytes(shape, dtype)
    backward = CodecCostTable.for_direction(settings, "backward", shape, dtype, backend="torch", calls=1)
    assert backward.aliases == {"channel_h4": "hadint4"} and "channel_h4" not in backward.costs
