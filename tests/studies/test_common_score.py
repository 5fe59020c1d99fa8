"""The speedrun's scoring rules: target crossing, the target, the steady-state rule, intervals."""

import math

import pytest

from benchmarks.common import score, stats


def test_steps_to_target_is_the_first_validation_at_or_below_it():
    validations = [(100, 6.0), (125, 5.51), (150, 5.5), (175, 5.49), (200, 5.52)]
    assert score.steps_to_target(validations, 5.5) == 150  # equal counts
    assert score.steps_to_target(list(reversed(validations)), 5.495) == 175  # order of the records is irrelevant
    assert score.steps_to_target(validations, 5.4) is None  # missed
    assert score.steps_to_target([(25, float("nan")), (50, 5.0)], 5.4) == 50  # a NaN validation never counts


def test_the_target_is_the_worst_baseline_at_the_fraction_rounded_up():
    a = [(400, 5.80), (450, 5.7012), (475, 5.69), (500, 5.65)]
    b = [(400, 5.82), (450, 5.7100), (475, 5.70), (500, 5.66)]
    # 0.92 * 500 = 460: the last validation at or before it is 450 in both runs; the worse is b's 5.7100
    assert score.target_loss([a, b], 500) == pytest.approx(5.71)
    assert score.target_loss([a], 500) == pytest.approx(5.702)  # 5.7012 rounded up
    assert score.steps_to_target(a, score.target_loss([a, b], 500)) == 450
    with pytest.raises(ValueError, match="no validation at or before"):
        score.target_loss([[(480, 5.0)]], 500)


def test_steady_needs_three_consecutive_windows_within_the_tolerance():
    warm = [3.0] * 10  # start-up: slow
    noisy = [1.0] * 10 + [1.05] * 10  # two windows 5% apart
    steady = [1.002] * 10 + [1.0] * 10 + [1.008] * 10
    result = score.steady_seconds(warm + noisy + steady, window=10, tolerance=0.01)
    assert result is not None
    assert result.first_step == 30
    assert result.seconds == pytest.approx(1.002)  # the median window
    assert score.steady_seconds(warm + noisy, window=10) is None
    # a partial window at the end is not a window
    assert score.steady_seconds([1.0] * 29, window=10) is None
    assert score.steady_seconds([1.0] * 30, window=10).first_step == 0
    assert score.steady_seconds([5.0] * 3 + [1.0] * 30, skip=3).first_step == 3


def test_intervals_use_student_t_and_ratios_pair_seeds():
    one = score.mean_interval([460])
    assert (one.mean, one.n) == (460, 1) and "one seed" in one.text()
    three = score.mean_interval([450, 460, 470])
    half = 4.303 * 10 / math.sqrt(3)
    assert (three.low, three.high) == (pytest.approx(460 - half), pytest.approx(460 + half))
    ratio = score.paired_ratio({1: 500, 2: 440, 3: 999}, {1: 500, 2: 400, 4: 1})
    assert ratio.n == 2 and ratio.mean == pytest.approx((1.0 + 1.1) / 2)
    with pytest.raises(ValueError, match="no common seed"):
        score.paired_ratio({1: 1}, {2: 1})


def test_two_codecs_are_compared_by_the_paired_interval_of_their_same_seed_ratio():
    a, b = {1: 330, 2: 380, 3: 400}, {1: 300, 2: 350, 3: 420, 4: 500}  # seed 4: b's alone, left out
    got = score.compare(a, b)
    ratios = [330 / 300, 380 / 350, 400 / 420]
    mean = sum(ratios) / 3
    half = stats.t975(2) * math.sqrt(sum((r - mean) ** 2 for r in ratios) / 2) / math.sqrt(3)
    assert got.ratio.n == 3 and got.ratio.mean == pytest.approx(mean)
    assert (got.ratio.low, got.ratio.high) == pytest.approx((mean - half, mean + half))
    assert got.verdict == "within noise" and got.text().endswith(", within noise")
    # with a scale (the s/step ratio: the ratio of T), every per-seed ratio is scaled
    assert score.compare(a, b, 0.5).ratio.mean == pytest.approx(mean / 2)
    assert score.compare(a, b, 0.5).verdict == "lower" and score.compare(a, b, 2.0).verdict == "higher"
    one = score.compare({1: 330}, b)
    assert one.verdict == "one seed" and one.text() == "1.10x (one seed)"
    with pytest.raises(ValueError, match="no common seed"):
        score.compare({5: 1.0}, b)


def test_a_missed_target_bounds_the_multiplier_by_the_schedule_over_bf16s_steps_on_the_same_seed():
    assert score.missed_bound({1: 500, 2: 740}, {1: 320, 2: 390, 3: 460}) == pytest.approx(min(500 / 320, 740 / 390))
    assert score.missed_bound({3: 500}, {1: 320}) is None  # bf16 has no steps on that seed
    assert score.missed_text({1: 500, 2: 500}) == "missed within 500 steps"
    assert score.missed_text({1: 500, 2: 740, 3: 500}, seeds=True) == \
        "missed within 500 steps (seeds 1, 3) and 740 steps (seed 2)"
