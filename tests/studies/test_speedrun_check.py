"""The schedule simulator's check against timing runs (``benchmarks.speedrun.check``) and the page's split rows."""

import json

import pytest

from benchmarks.speedrun import check, projection, report, runs, scoring, simulate, verdicts


def test_a_split_keeps_the_global_batch_and_refuses_one_that_does_not_divide_it():
    full = runs.SIZES["full"]
    at8 = check.sized(full, 8, 12)
    assert (at8.micro_batches, at8.micro_batch, at8.timing_iters) == (8, 2, 12)
    assert at8.micro_batches * at8.micro_batch == full.micro_batches * full.micro_batch
    assert at8.message_shape == (64, 2, 128)
    for bad in (0, 3, 32):
        with pytest.raises(ValueError, match="do not split"):
            check.sized(full, bad, 12)


def test_measured_seconds_are_the_median_after_the_start_up_steps():
    assert check.measured_seconds([9.0, 5.0, 1.0, 3.0, 2.0]) == 2.0  # 9 and 5 skipped
    assert check.measured_seconds([9.0, 1.0, 4.0], skip=1) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="none left"):
        check.measured_seconds([1.0, 2.0])


def test_simulated_seconds_bill_the_split_message_and_its_compute():
    link = runs.Link(376e3, 0.037)
    at8 = check.sized(runs.SIZES["full"], 8, 12)
    fwd, bwd = runs.message_nbytes("bf16", at8)
    assert fwd == 16 + 64 * 2 * 128 * 2  # two sequences per message
    f, b = simulate.compute_per_micro_batch(2.5, 8, 8)
    assert check.simulated_seconds("bf16", at8, 2.5, link) == pytest.approx(
        simulate.simulate_step(8, 8, f, b, fwd, bwd, link.rate_bps, link.latency_s))
    # fewer bytes, a shorter step on the same wire
    assert check.simulated_seconds("channel9", at8, 2.5, link) < check.simulated_seconds("bf16", at8, 2.5, link)


def _row(codec, m, measured, simulated):
    return {"codec": codec, "micro_batches": m, "micro_batch": 16 // m, "compute_s": 2.0, "measured_s": measured,
            "simulated_s": simulated, "error": simulated / measured - 1.0, "times": []}


def test_the_check_renders_every_row_its_worst_error_and_the_split_ratios():
    result = {"date": "2026-11-28", "host": {"cpu": "test cpu", "cores": 2}, "iters": 12, "skip": 2,
              "rows": [_row("bf16", 16, 20.0, 19.2), _row("bf16", 8, 22.0, 22.0), _row("channel9", 16, 8.0, 8.4)]}
    text = check.render(result)
    assert "| bf16 | 8 x 2 | 2.000 | 22.000 | 22.000 | +0.0% |" in text
    assert "| channel9 | 16 x 1 | 2.000 | 8.000 | 8.400 | +5.0% |" in text
    assert "within 5.0% of every run (worst: `channel9` at 16 micro-batches)." in text
    assert "`bf16` at 8 against 16 micro-batches: measured 1.100x, simulated 1.146x (+4.2%)." in text
    slow = check.render({**result, "rows": [_row("bf16", 16, 20.0, 20.2), _row("channel9", 16, 8.0, 8.4)]})
    assert "(worst: `channel9` at 16 micro-batches); it overestimates every step, the compressed codecs' more" in slow
    assert "compressed codecs' more" not in check.render({**result, "rows": [_row("bf16", 16, 20.0, 21.2),
                                                                             _row("channel9", 16, 8.0, 8.4)]})
    assert "`channel9` at 16 against" and "`channel9` at 8 against" not in text  # one split: no ratio


def test_an_entropy_coded_codec_is_simulated_from_its_measured_bytes_and_set_beside_its_codec():
    at16 = check.sized(runs.SIZES["full"], 16, 12)
    with pytest.raises(ValueError, match="entropy-coded: their bytes are measured"):
        runs.message_nbytes("channel_h4_ec", at16)
    records = [{"fwd_wire_bytes": 70.0 * 112, "bwd_wire_bytes": 50.0 * 112}] * 3 + \
              [{"fwd_wire_bytes": 7000.0 * 112, "bwd_wire_bytes": 4000.0 * 112}] * 4
    assert check.measured_message_nbytes(records, at16, skip=3) == (7000.0, 4000.0)  # 7 links x 16 messages
    link = runs.Link(376e3, 0.037)
    f, b = simulate.compute_per_micro_batch(1.2, 8, 16)
    assert check.simulated_seconds("channel_h4_ec", at16, 1.2, link, (7000.0, 4000.0)) == pytest.approx(
        simulate.simulate_step(8, 16, f, b, 7000.0, 4000.0, link.rate_bps, link.latency_s))
    base = {**_row("channel_h4", 16, 7.0, 7.5), "message_nbytes": (7000.0, 4000.0)}
    coded = {**_row("channel_h4_ec", 16, 7.7, 7.3), "message_nbytes": (7070.0, 3600.0)}
    result = {"date": "2026-11-28", "host": {"cpu": "test cpu", "cores": 2}, "iters": 12, "skip": 2,
              "rows": [_row("bf16", 16, 20.0, 20.2), base, coded]}
    text = check.render(result)
    assert "| channel_h4_ec | 16 x 1 | 2.000 | 7.700 | 7.300 | -5.2% |" in text
    # the coded row measures the coder's time, which the simulator leaves out: not in the simulator's verdict
    assert "within 7.1% of every run (worst: `channel_h4` at 16 micro-batches)" in text
    assert ("`channel_h4_ec` (`channel_h4` through `--tah-entropy-coding`) sent +1.0% bytes per activation message "
            "and -10.0% per gradient message") in text and "measured +10.0% seconds per step" in text
    other_session = {**base, "compute_s": 1.9}
    assert check.entropy_pairs({**result, "rows": [other_session, coded]}) == []


def test_the_cli_refuses_codecs_without_fixed_bytes_and_too_few_iterations(tmp_path):
    page = tmp_path / "page.json"
    page.write_text(json.dumps({"link": {"rate_bps": 1e6, "latency_s": 0.01}}))
    with pytest.raises(SystemExit):
        check.main(["--codecs", "auto", "--page", str(page), "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        check.main(["--iters", "2", "--page", str(page), "--out", str(tmp_path)])


def test_the_page_shows_each_codecs_best_split_against_the_setups_own():
    # "unrun": a codec this page did not run, projected at equal steps: never the lowest T's verdict
    result = {"projection": [{"codec": "none", "steps_label": scoring.MEASURED},
                             {"codec": "lowrank", "steps_label": scoring.MEASURED},
                             {"codec": "unrun", "steps_label": "at equal steps"}],
              "projection_splits": {str(m): projection_rows for m, projection_rows in {
                  32: [{"codec": "none", "micro_batch": 16, "s_per_step": 105.0, "steps": 2925, "T": 307125.0},
                       {"codec": "lowrank", "micro_batch": 16, "s_per_step": 28.0, "steps": 3195, "T": 89460.0},
                       {"codec": "unrun", "micro_batch": 16, "s_per_step": 20.0, "steps": 2925, "T": 58500.0}],
                  64: [{"codec": "none", "micro_batch": 8, "s_per_step": 100.0, "steps": 2925, "T": 292500.0},
                       {"codec": "lowrank", "micro_batch": 8, "s_per_step": 30.0, "steps": 3195, "T": 95850.0},
                       {"codec": "unrun", "micro_batch": 8, "s_per_step": 21.0, "steps": 2925, "T": 61425.0}]}.items()}}
    best = verdicts.best_split(result, "lowrank")
    assert (best["micro_batches"], best["T"]) == (32, 89460.0)
    assert best["vs_setup"] == pytest.approx(89460.0 / 95850.0)
    assert verdicts.best_split(result, "none")["micro_batches"] == 64
    assert verdicts.best_split(result, "paper") is None
    table = report.splits_markdown(result)
    assert "| lowrank | 28.00 | 30.00 | 32 x 16 | 89,460 | 0.933x |" in table
    assert "| none | 105.00 | 100.00 | 64 x 8 | 292,500 | 1.000x |" in table
    # the lowest projected T's split, judged by the simulator's error in the micro-batch dependence
    checked = {"rows": [_row("lowrank", 16, 7.0, 7.5), _row("lowrank", 8, 7.0, 7.2)]}  # ratio 0.960 vs 1.000: -4%
    verdict = verdicts.split_verdict(result, checked)
    assert "`lowrank`'s at 32 micro-batches of 16: 89,460 s, 6.7% under its 64-micro-batch projection" in verdict
    assert "erred by up to 4.0% (`lowrank`), always in favour of fewer" in verdict and "not a recommendation" in verdict
    checked = {"rows": [_row("lowrank", 16, 7.0, 7.0), _row("lowrank", 8, 7.0, 7.07)]}  # +1%: small against 6.7%
    assert "larger than that error" in verdicts.split_verdict(result, checked)


def test_the_speedrun_refuses_an_entropy_coded_codec_and_names_the_check(capsys):
    from benchmarks.speedrun.__main__ import main

    with pytest.raises(SystemExit):
        main(["--codecs", "bf16,channel_h4_ec"])
    assert "['channel_h4_ec'] entropy-code their messages" in capsys.readouterr().err
