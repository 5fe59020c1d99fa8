"""benchmarks.speedrun.simulate: Megatron's 1F1B under the inbound-wire link model, and its projection."""

import math
import random

import pytest

from benchmarks.speedrun import projection, simulate

RATE = 8e6  # 1 MB holds the wire for 1 s
MB = 1_000_000


# ----- hand-computable cases ---------------------------------------------------------------------------

# S = 2, no compute, no latency, forward messages hold the wire d s and backward ones e s. Stage 1's wire
# carries only activations (arrivals d, 2d, ...); it returns gradient m as soon as activation m is in;
# stage 0's wire serialises the gradients. M = 1: d + e; M = 2: max(d + 2e, 2d + e); M = 3: max(d + 3e,
# 2d + 2e, 3d + e).
@pytest.mark.parametrize("micro_batches, d, e, expected", [
    (1, 1, 1, 2.0), (2, 1, 1, 3.0), (3, 1, 1, 4.0),
    (1, 1, 2, 3.0), (2, 1, 2, 5.0), (3, 1, 2, 7.0),
    (1, 2, 1, 3.0), (2, 2, 1, 5.0), (3, 2, 1, 7.0),
])
def test_two_stages_without_compute_or_latency_match_the_hand_computed_step(micro_batches, d, e, expected):
    for blocking in (True, False):
        step = simulate.simulate_step(2, micro_batches, 0.0, 0.0, d * MB, e * MB, RATE, 0.0, blocking=blocking)
        assert step == pytest.approx(expected)


def test_latency_holds_the_wire_and_compute_adds_on_the_critical_path():
    # S = 2, M = 2, 1 s messages + 0.5 s latency: 1.5 s per message, three in a row on the critical path
    assert simulate.simulate_step(2, 2, 0.0, 0.0, MB, MB, RATE, 0.5) == pytest.approx(4.5)
    # S = 2, M = 1 with compute: F0 (0.1), activation (1 + 0.5), F1 + B1 (0.1 + 0.2), gradient (2 + 0.5), B0 (0.2)
    assert simulate.simulate_step(2, 1, 0.1, 0.2, MB, 2 * MB, RATE, 0.5) == pytest.approx(4.6)


def test_three_stages_interleave_both_neighbours_on_the_middle_wire():
    # S = 3, M = 2, 1 s messages, no compute. Stage 1's wire: activation 0 arrives at 1, activation 1 at 2
    # (queued), gradient 0 (sent by stage 2 at 2) at 3, gradient 1 (sent at 3) at 4; stage 0 gets the
    # gradients at 4 and 5.
    timeline = simulate.simulate(3, 2, 0.0, 0.0, MB, MB, RATE, 0.0)
    starts = {op: start for op, (start, _) in timeline.ops.items()}
    assert [starts[(1, k, 0, m)] for k, m in (("F", 0), ("F", 1), ("B", 0), ("B", 1))] == pytest.approx([1, 2, 3, 4])
    assert [starts[(0, "B", 0, m)] for m in (0, 1)] == pytest.approx([4, 5])
    assert timeline.makespan == pytest.approx(5.0)
    assert timeline.wires[1].billed_bytes == 4 * MB and timeline.wires[0].billed_bytes == 2 * MB


def test_the_schedule_is_1f1b_and_every_op_waits_for_its_message():
    rng = random.Random(7)
    S, M, lat = 4, 7, 0.05
    fwd = [rng.uniform(0.01, 0.2) for _ in range(S)]
    bwd = [rng.uniform(0.02, 0.4) for _ in range(S)]
    fb = [rng.uniform(0, 2) * MB for _ in range(S - 1)]
    bb = [rng.uniform(0, 2) * MB for _ in range(S - 1)]
    timeline = simulate.simulate(S, M, fwd, bwd, fb, bb, RATE, lat)
    occ = lambda nbytes: nbytes * 8 / RATE + lat  # noqa: E731
    for s in range(S):
        order = sorted((start, end, k, m) for (st, k, _, m), (start, end) in timeline.ops.items() if st == s)
        kinds = "".join(k for *_, k, _ in order)
        warmup = S - s - 1
        assert kinds == "F" * warmup + "FB" * (M - warmup) + "B" * warmup  # megatron-core's 1F1B
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(order, order[1:]))  # one op at a time
        for start, end, k, m in order:
            assert end - start == pytest.approx(fwd[s] if k == "F" else bwd[s])
            if k == "F" and s > 0:
                assert start >= timeline.ops[(s - 1, "F", 0, m)][1] + occ(fb[s - 1]) - 1e-9
            if k == "B" and s < S - 1:
                assert start >= timeline.ops[(s + 1, "B", 0, m)][1] + occ(bb[s]) - 1e-9


def test_without_a_slow_link_1f1b_takes_its_bubble_and_the_split_inverts_it():
    for stages, micro_batches, step_s in ((8, 64, 0.539), (8, 32, 0.655), (4, 4, 1.0)):
        f, b = simulate.compute_per_micro_batch(step_s, stages, micro_batches)
        assert b == pytest.approx(2 * f)
        assert (micro_batches + stages - 1) * (f + b) == pytest.approx(step_s)
        assert simulate.simulate_step(stages, micro_batches, f, b, MB, MB, math.inf, 0.0) == pytest.approx(step_s)


def test_blocking_sends_hold_a_stage_only_when_stages_differ():
    # S = 3, M = 3, no forward compute, backwards of 2 s on stages 0 and 1, 1 s messages. Stage 1 finishes
    # B1 at 7 with gradient 2 already in (at 7); blocking, its send_backward(1) waits until stage 0, busy with
    # B0 until 8, posts the receive: B2 runs 8-10 instead of 7-9, stage 0's B2 ends at 13 instead of 12.
    args = (3, 3, 0.0, [2.0, 2.0, 0.0], MB, MB, RATE, 0.0)
    assert simulate.simulate_step(*args) == pytest.approx(13.0)
    assert simulate.simulate_step(*args, blocking=False) == pytest.approx(12.0)
    # alike stages and boundaries: the same step (random cases)
    rng = random.Random(1)
    for _ in range(40):
        S, M = rng.randint(2, 6), rng.randint(1, 10)
        args = (S, M, rng.uniform(0, 1), rng.uniform(0, 2), rng.uniform(0, 4) * MB, rng.uniform(0, 4) * MB,
                RATE, rng.uniform(0, 1))
        assert simulate.simulate_step(*args) == pytest.approx(simulate.simulate_step(*args, blocking=False))


def test_inputs_are_checked():
    with pytest.raises(ValueError, match="fwd_s needs 3"):
        simulate.simulate_step(3, 2, [0.1, 0.1], 0.2, MB, MB, RATE, 0.0)
    with pytest.raises(ValueError, match="bwd_bytes needs 2"):
        simulate.simulate_step(3, 2, 0.1, 0.2, MB, [MB] * 3, RATE, 0.0)
    with pytest.raises(ValueError, match=">= 0"):
        simulate.simulate_step(3, 2, -0.1, 0.2, MB, MB, RATE, 0.0)
    with pytest.raises(ValueError, match=">= 1"):
        simulate.simulate_step(3, 0, 0.1, 0.2, MB, MB, RATE, 0.0)


# ----- calibration on the published records ----------------------------------------------------------

PUBLISHED = {"dense bf16": 100.475, "ReparamSSN": 19.889}  # ProtocolNanoGPT records, s/step with the slow link


def test_the_published_records_are_reproduced_within_2_percent_from_their_inputs():
    records = {r.name: r for r in simulate.RECORDS}
    dense, ssn = records["dense bf16"], records["ReparamSSN"]
    # the records' published inputs
    assert (dense.stages, dense.micro_batch, dense.micro_batches, dense.bytes_per_token) == (8, 8, 64, 2048)
    assert (ssn.stages, ssn.micro_batch, ssn.micro_batches, ssn.bytes_per_token) == (8, 16, 32, 322)
    assert dense.message_bytes == 1024 * 8 * 2048
    assert dense.step_no_link_s == 0.539 and ssn.step_no_link_s == 0.655
    assert (simulate.BANDWIDTH_BPS, simulate.LATENCY_S) == (200e6, 0.05)
    for name, published in PUBLISHED.items():
        assert records[name].published_s_per_step == published
        assert simulate.simulate_record(records[name]) == pytest.approx(published, rel=0.02)
    assert dense.published_T == pytest.approx(293_889, rel=1e-5)
    assert ssn.published_T == pytest.approx(181_487, rel=1e-5)


def test_back_to_back_steps_keep_the_same_step_time():
    dense = simulate.RECORDS[0]
    one, three = simulate.simulate_record(dense), simulate.simulate_record(dense, steps=3)
    assert three == pytest.approx(one, rel=0.005)


# ----- projection ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rows():
    return {r["codec"]: r for r in projection.project({"paper": 2.0}, multiplier_label="test multiplier")}


def test_projection_bills_each_codecs_exact_wire_bytes(rows):
    import torch
    from megatron_tah.config import TahConfig

    assert set(rows) == set(projection.CODECS)
    tokens = 1024 * 8
    for name, fields in projection.CODECS.items():
        cfg = TahConfig(**fields)
        fwd = cfg.forward_codec().wire_nbytes([1024, 8, 1024], torch.bfloat16)
        bwd = cfg.backward_codec().wire_nbytes([1024, 8, 1024], torch.bfloat16)
        assert rows[name]["bytes_per_token"] == pytest.approx((fwd + bwd) / tokens)
        assert rows[name]["forward_bits"] == pytest.approx(fwd * 8 / (1024 * 8 * 1024))
        f, b = simulate.compute_per_micro_batch(0.539, 8, 64)
        assert rows[name]["s_per_step_without_codec_time"] == pytest.approx(
            simulate.simulate_step(8, 64, f, b, fwd, bwd, 200e6, 0.05))
        assert rows[name]["s_per_step"] >= rows[name]["s_per_step_without_codec_time"] - 1e-9
        assert rows[name]["T"] == pytest.approx(rows[name]["steps"] * rows[name]["s_per_step"])
    # uncompressed is the dense record up to the codec's copy; every codec is faster
    assert rows["none"]["s_per_step"] == pytest.approx(PUBLISHED["dense bf16"], rel=0.02)
    assert all(r["s_per_step"] < rows["none"]["s_per_step"] for n, r in rows.items() if n != "none")


def test_projection_steps_are_the_records_times_the_multiplier_and_say_so(rows):
    assert rows["paper"]["steps"] == pytest.approx(2 * 2925) and rows["paper"]["steps_label"] == "test multiplier"
    assert rows["hadint4"]["steps"] == pytest.approx(2925) and rows["hadint4"]["steps_label"] == "at equal steps"
    assert rows["none"]["T_vs_none"] == pytest.approx(1.0)
    assert rows["paper"]["T_vs_none"] == pytest.approx(rows["paper"]["T"] / rows["none"]["T"])
    # codec time: the committed H100 measurement, scaled, where one exists; labelled otherwise
    assert "tah (triton), scaled" in rows["paper"]["codec_time_source"]
    assert "fixedpoint-b6-g32" in rows["paper"]["codec_time_source"]
    assert rows["paper"]["forward_codec_s"] > 0
    assert rows["hadint4"]["forward_codec_s"] == 0 and "not measured" in rows["hadint4"]["codec_time_source"]


def test_a_byte_scale_bills_that_share_of_the_wire_bytes_each_way(rows):
    scaled = projection.project({"paper": 2.0}, {"paper": projection.CODECS["paper"]}, byte_scale={"paper": (0.5, 0.75)})
    row, base = scaled[0], rows["paper"]
    assert row["forward_bits"] == pytest.approx(base["forward_bits"] / 2, rel=1e-6)
    assert row["backward_bits"] == pytest.approx(base["backward_bits"] * 0.75, rel=1e-6)
    assert row["s_per_step"] < base["s_per_step"] and row["steps"] == base["steps"]
    assert row["T"] == pytest.approx(row["steps"] * row["s_per_step"])


def test_a_split_into_fewer_micro_batches_keeps_the_tokens_and_bills_its_own_message_shape(rows):
    import torch
    from megatron_tah.config import TahConfig

    split = {r["codec"]: r for r in projection.project({"paper": 2.0}, multiplier_label="test multiplier",
                                                       micro_batches=32)}
    assert projection.message_shape(32) == (1024, 16, 1024) and projection.message_shape(64) == projection.SHAPE
    f64, b64 = projection.compute_at(64)
    assert projection.compute_at(32) == pytest.approx((2 * f64, 2 * b64))  # twice the tokens per micro-batch
    for name, fields in projection.CODECS.items():
        fwd = TahConfig(**fields).forward_codec().wire_nbytes([1024, 16, 1024], torch.bfloat16)
        assert split[name]["micro_batch"] == 16 and split[name]["micro_batches"] == 32
        assert split[name]["forward_bytes_per_token"] == pytest.approx(fwd / (1024 * 16))
        assert split[name]["steps"] == rows[name]["steps"]  # the same global batch: the same optimizer steps
        assert split[name]["s_per_step_without_codec_time"] == pytest.approx(simulate.simulate_step(
            8, 32, 2 * f64, 2 * b64, fwd, TahConfig(**fields).backward_codec().wire_nbytes([1024, 16, 1024],
                                                                                          torch.bfloat16), 200e6, 0.05))
    # uncompressed, the reference's 64 is the better split; a compressed message leaves latency a larger share
    assert rows["none"]["s_per_step"] < split["none"]["s_per_step"]
    assert split["lowrank"]["s_per_step"] < rows["lowrank"]["s_per_step"]
    with pytest.raises(ValueError, match="do not split"):
        projection.message_shape(48)


def test_codec_time_takes_the_nearest_measured_shape_scaled_by_element_count():
    from megatron_tah.codecs import get_codec

    codec = get_codec("fixedpoint", bits=6, tile_size=32)
    rows = [dict(shape=shape, codec="fixedpoint-b6-g32", backend=backend, op=op, us=us)
            for shape, backend, op, us in (([10, 1, 10], "triton", "encode", 1.0),
                                           ([10, 1, 10], "triton", "decode", 2.0),
                                           ([100, 1, 100], "torch", "encode", 50.0),
                                           ([100, 1, 100], "triton", "encode", 10.0),
                                           ([100, 1, 100], "triton", "decode", 20.0))]
    at = projection.codec_time(codec, (100, 1, 100), {"results": rows})
    assert (at.encode_s, at.decode_s) == pytest.approx((10e-6, 20e-6)) and "measured at [100, 1, 100]" in at.source
    near = projection.codec_time(codec, (200, 1, 100), {"results": rows})  # 2x the larger shape
    assert (near.encode_s, near.decode_s) == pytest.approx((20e-6, 40e-6))
    assert "scaled x2.00 by element count from [100, 1, 100]" in near.source
    small = projection.codec_time(codec, (20, 1, 10), {"results": rows})  # 2x the smaller shape
    assert (small.encode_s, small.decode_s) == pytest.approx((2e-6, 4e-6))
    none = projection.codec_time(get_codec("hadint", bits=4, tile_size=64), (100, 1, 100), {"results": rows})
    assert (none.encode_s, none.decode_s) == (0.0, 0.0) and "not measured" in none.source


def test_cli_prints_calibration_projection_and_records(capsys):
    assert projection.main(["--project", "--steps-multiplier", "paper=1.5"]) == 0
    out = capsys.readouterr().out
    assert "dense bf16" in out and "ReparamSSN" in out and "100.475" in out and "19.889" in out
    for name in projection.CODECS:
        assert f"\n{name} " in out
    assert "at equal steps" in out and "given multiplier" in out
    with pytest.raises(SystemExit, match="CODEC=X"):
        projection.main(["--project", "--steps-multiplier", "paper"])
