"""The CPU speedrun end to end at its tiny size (2 stages, a few iterations), and its link scaling."""

import json

import pytest

from benchmarks.speedrun import __main__ as speedrun
from benchmarks.speedrun import runs, simulate


def test_the_link_makes_bf16_link_bound_by_the_factor_with_the_reference_latency_share():
    size = runs.SIZES["full"]
    nbytes = speedrun.message_nbytes("bf16", size)
    assert nbytes == 16 + 64 * 1 * 128 * 2  # the none codec: a 16-byte header and the raw bf16 message
    link = speedrun.scale_link(0.9, size, nbytes)
    f, b = simulate.compute_per_micro_batch(0.9, size.stages, size.micro_batches)
    step = simulate.simulate_step(size.stages, size.micro_batches, f, b, nbytes, nbytes, link.rate_bps, link.latency_s)
    assert step == pytest.approx(speedrun.LINK_BOUND * 0.9, rel=1e-6)
    assert 2 * size.micro_batches * link.latency_s == pytest.approx(speedrun.LATENCY_SHARE * step)
    assert link.flags()[-1] == "inbound"


@pytest.mark.distributed
def test_tiny_speedrun_scores_every_codec_and_writes_its_page(tmp_path):
    page = tmp_path / "docs" / "SPEEDRUN.md"
    status = speedrun.main(["--size", "tiny", "--out", str(tmp_path / "runs"), "--codecs", "bf16,fixedpoint4",
                            "--seeds", "1234", "--jobs", "1", "--write", str(page)])
    assert status == 0
    result = json.loads((tmp_path / "docs" / "data" / "speedrun.json").read_text())
    rows = {r["codec"]: r for r in result["table"]}
    assert set(rows) == {"bf16", "fixedpoint4"}
    bf16, fp4 = rows["bf16"], rows["fixedpoint4"]
    # the baseline reaches its own target by construction (at or before 92% of its schedule)
    assert bf16["steps"] is not None and bf16["steps"] <= 0.92 * runs.SIZES["tiny"].iters
    assert bf16["multiplier"] == pytest.approx(1.0) and bf16["T_vs_bf16"] == pytest.approx(1.0)
    # measured bits: bf16 16 bits + header; fixed point 4-bit forward (tile 64) and 6-bit backward (tile 32)
    assert 16.0 < bf16["forward_bits"] < 16.3 and 16.0 < bf16["backward_bits"] < 16.3
    assert 4.4 < fp4["forward_bits"] < 4.8 and 6.9 < fp4["backward_bits"] < 7.3
    assert bf16["s_per_step"] > 0 and fp4["s_per_step"] > 0
    text = page.read_text()
    assert "| fixedpoint4 |" in text and f"{result['target']:.3f}" in text
    assert (tmp_path / "docs" / "data" / "speedrun.png").stat().st_size > 1000


def test_a_missed_run_gets_a_schedule_long_enough_for_the_loss_it_reached():
    base = {"validations": [(100, 6.0), (200, 5.6), (300, 5.4), (400, 5.3), (500, 5.25)]}
    # the codec ended at 5.6, where bf16 was at 200 of 500: 2.5x the steps, 15% more, rounded to the interval
    codec = {"validations": [(250, 5.9), (500, 5.6)]}
    assert speedrun.longer_schedule(codec, base, 500, 10) == 1440
    # nearly there: at least 1.25x; far off: at most MAX_FACTOR
    assert speedrun.longer_schedule({"validations": [(500, 5.26)]}, base, 500, 10) == 630
    assert speedrun.longer_schedule({"validations": [(500, 7.0)]}, base, 500, 10) == int(speedrun.MAX_FACTOR * 500)
