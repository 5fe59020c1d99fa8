"""The real-model study (``benchmarks.real_model``): where a pipeline splits a model, stopping at the target, both
evaluations and their per-micro-batch losses, the scoring rules, and the whole study on a random 4-layer Llama at
depths 2 and 4 (``--size tiny``)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import types
from pathlib import Path

import pytest

from benchmarks.real_model import readme as readme_sections
from benchmarks.real_model import report, runs, scoring, verdicts
from benchmarks.common import score
from megatron_tah.hf_checkpoint import UnsupportedModel, split_flags, stage_layers

REPO = Path(__file__).resolve().parents[2]


def test_a_30_layer_model_splits_over_8_stages_as_megatron_does_with_a_lighter_first_and_last_stage():
    assert stage_layers(30, 8) == [3, 4, 4, 4, 4, 4, 4, 3]
    assert runs.boundaries(30, 8) == [3, 7, 11, 15, 19, 23, 27]
    assert split_flags(30, 8) == ["--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers", "3"]
    assert stage_layers(32, 8) == [4] * 8 and split_flags(32, 8) == [] and runs.boundaries(4, 2) == [2]
    with pytest.raises(UnsupportedModel, match="31 layers do not split over 8"):
        stage_layers(31, 8)


def _fake_training(monkeypatch, losses, passes):
    """A stand-in for ``megatron.training.training`` whose ``evaluate`` returns ``losses`` in turn and whose
    ``evaluate_and_print_results`` evaluates ``passes`` times (2: ``--tah-eval-traffic both``); and Megatron's args."""
    module = types.ModuleType("fake_training")
    losses = iter(losses)
    module.evaluate = lambda *a, **k: ({"lm loss": next(losses)}, None, False)
    module.evaluate_and_print_results = lambda prefix, *args, **kwargs: tuple(module.evaluate() for _ in range(passes))
    args = types.SimpleNamespace(train_iters=100)
    monkeypatch.setattr("megatron.training.global_vars.get_args", lambda: args)
    monkeypatch.setitem(sys.modules, "megatron.training.training", module)
    return module, args


def test_stop_at_loss_ends_training_at_the_first_validation_at_or_below_the_target(monkeypatch):
    from benchmarks.depth.run import StopAtLoss

    module, args = _fake_training(monkeypatch, [3.0, 2.6, 2.4, 2.2], passes=1)
    stop = StopAtLoss(2.5)
    stop.install()
    try:
        for iteration in (10, 20, 30):
            module.evaluate_and_print_results("validation", None, None, None, iteration)
            assert args.train_iters == (100 if iteration < 30 else 30)
        module.evaluate_and_print_results("validation", None, None, None, 30)  # the end-of-training repeat
        assert (stop.stopped_at, args.train_iters) == (30, 30)
    finally:
        stop.restore()
    assert not hasattr(module.evaluate, "__wrapped__")


def test_stop_at_loss_stops_on_the_evaluation_through_the_codecs_when_both_are_made(monkeypatch):
    """With ``--tah-eval-traffic both`` Megatron's ``evaluate`` runs twice per validation (through the codecs, then
    uncompressed): the first pass decides."""
    from benchmarks.depth.run import StopAtLoss

    module, args = _fake_training(monkeypatch, [2.6, 2.4, 2.4, 2.6], passes=2)
    stop = StopAtLoss(2.5)
    stop.install()
    try:
        module.evaluate_and_print_results("validation", None, None, None, 10)  # compressed 2.6, uncompressed 2.4
        assert args.train_iters == 100
        module.evaluate_and_print_results("validation", None, None, None, 20)  # compressed 2.4
        assert args.train_iters == 20
    finally:
        stop.restore()


def test_eval_losses_records_each_pass_per_micro_batch_and_skips_early_and_repeated_validations(monkeypatch, tmp_path):
    from benchmarks.depth.run import EvalLosses

    module = types.ModuleType("fake_training")
    boundaries = types.SimpleNamespace(uncompressed=False)

    def evaluate(forward_step_func, *args, **kwargs):  # Megatron's: the forward step's loss report per micro-batch
        for total in (6.0, 9.0):
            _, loss_func = forward_step_func(None, None)
            loss_func(None)
        return ({"lm loss": 2.5}, None, False)

    def step(data_iterator, model):
        return None, lambda output: (None, None, {"lm loss": torch.tensor([next(totals), 3.0])})

    import torch

    totals = iter([6.0, 9.0, 3.0, 6.0, 9.0, 9.0])
    module.evaluate = evaluate

    def evaluate_and_print_results(prefix, forward_step_func, data_iterator, model, iteration, *a, **k):
        module.evaluate(forward_step_func)
        if "validation set" in prefix and iteration == 20:  # as --tah-eval-traffic both: a second, raw pass
            boundaries.uncompressed = True
            module.evaluate(forward_step_func)
            boundaries.uncompressed = False

    module.evaluate_and_print_results = evaluate_and_print_results
    args = types.SimpleNamespace(train_iters=20)
    monkeypatch.setattr("megatron.training.global_vars.get_args", lambda: args)
    monkeypatch.setitem(sys.modules, "megatron.training.training", module)
    path = tmp_path / "evals.jsonl"
    recorder = EvalLosses(path, boundaries, first=10)
    recorder.install()
    try:
        module.evaluate_and_print_results("iteration 5 on validation set", step, None, None, 5)  # before the first
        module.evaluate_and_print_results("iteration 20 on validation set", step, None, None, 20)
        module.evaluate_and_print_results("iteration 20 on validation set", step, None, None, 20)  # the end's repeat
        module.evaluate_and_print_results("iteration 20 on test set", step, None, None, 20)
    finally:
        recorder.restore()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["iteration"], r["split"], r["traffic"]) for r in records] == [
        (20, "valid", "codec"), (20, "valid", "uncompressed"), (20, "test", "codec")]
    assert records[0]["losses"] == [2.0, 3.0] and records[1]["losses"] == [1.0, 2.0]
    assert records[2]["losses"] == [3.0, 3.0]
    assert runs.eval_losses(path)[(20, "valid", "uncompressed")] == [1.0, 2.0]


def test_the_emulated_boundaries_pass_messages_untouched_inside_an_uncompressed_evaluation():
    """``--tah-eval-traffic``'s switch (``pipeline_parallel.evaluation``) reaches the emulated boundaries as it
    reaches the pipeline's links."""
    import torch

    from benchmarks.depth.boundaries import Boundaries
    from megatron_tah.megatron import pipeline_parallel

    x = torch.randn(16, 1, 64).to(torch.bfloat16)
    boundaries = Boundaries([1], {"tah_preset": "hadint4"}, {"tah_preset": "hadint4"})
    boundaries.install()
    try:
        compressed = boundaries.round_trip(1, "forward", x)
        with pipeline_parallel.evaluation(uncompressed=True):
            raw = boundaries.round_trip(1, "forward", x)
        with pipeline_parallel.evaluation(uncompressed=False):
            again = boundaries.round_trip(1, "forward", x)
    finally:
        boundaries.restore()
    assert torch.equal(raw, x) and not torch.equal(compressed, x) and not torch.equal(again, x)
    assert not boundaries.uncompressed and pipeline_parallel.evaluation.__name__ == "evaluation"
    assert not hasattr(pipeline_parallel.evaluation, "_megatron_tah")


def test_steps_to_a_loss_are_interpolated_between_validations_and_never_extrapolated():
    curve = [(10, 4.0), (12, 3.8), (14, 3.7), (16, 3.75), (18, 3.6)]
    assert score.crossing(curve, 3.9) == pytest.approx(11.0)
    assert score.crossing(curve, 3.7) == pytest.approx(14.0)
    assert score.crossing(curve, 3.65) == pytest.approx(16 + 2 * 0.1 / 0.15)  # the first crossing after the bump
    assert score.crossing(curve, 4.2) == 10.0 and score.crossing(curve, 3.5) is None
    base = [(10, 4.0), (12, 3.9), (14, 3.8), (16, 3.7)]
    # 4.1 lies before bf16's first validation and 3.6 below all of it: no M; 3.85 is reached at step 13
    assert score.equivalent_steps([(10, 4.1), (14, 3.85), (16, 3.8), (20, 3.6)], base) == [(14, pytest.approx(13.0)),
                                                                                           (16, pytest.approx(14.0))]


def _curves(slope_codec: float, seeds=(1, 2, 3), noise=(0.0, 0.004, -0.003)):
    """bf16 falling 0.02 per step from 4.0 at step 10, a codec falling ``slope_codec`` per step from the same start."""
    curves = {}
    for seed, jitter in zip(seeds, noise):
        for codec, slope in (("bf16", 0.02), ("x", slope_codec)):
            curve = [(i, 4.0 - slope * (i - 10) + jitter) for i in range(10, 41, 2)]
            damage = {t: {"damage_loss": 3.0 + (0.03 if codec == "x" else 0.0) + jitter, "damage_accuracy": 0.3}
                      for t in runs.TRAFFIC}
            curves[runs.run_name(codec, seed, 8)] = {"codec": codec, "seed": seed, "depth": 8, "uncompressed": curve,
                                                     "compressed": curve, "damage": damage, "ms": 1.0}
    return curves


def test_the_target_is_bf16s_mean_loss_at_its_step_where_the_slope_is_measured():
    base = [[(i, 4.0 - 0.02 * (i - 10) + d) for i in range(10, 41, 2)] for d in (0.0, 0.01, -0.01)]
    target, slope = scoring.target_and_slope(base, 21)
    assert target == pytest.approx(4.0 - 0.02 * 11, abs=1e-4) and slope == pytest.approx(0.02)
    with pytest.raises(ValueError, match="outside"):
        scoring.target_and_slope(base, 50)
    sparse = [[(i, 4.0 - 0.02 * (i - 10)) for i in range(10, 41, 10)]]  # one validation every 10 steps
    with pytest.raises(ValueError, match="fewer than two bf16 validations within 4 steps"):
        scoring.target_and_slope(sparse, 20)
    assert scoring.target_and_slope(sparse, 20, window=10)[1] == pytest.approx(0.02)


def test_a_codec_at_half_the_slope_needs_more_steps_and_one_that_missed_gets_no_multiplier():
    curves = _curves(0.01)
    names = {s: runs.run_name("x", s, 8) for s in (1, 2, 3)}
    bf16 = {s: runs.run_name("bf16", s) for s in (1, 2, 3)}
    m = scoring.metric(curves, names, bf16, "uncompressed", 3.8, 40)
    # bf16 reaches 3.8 at step 20 (+ the jitter / 0.02), the codec at step 30 (+ the jitter / 0.01)
    assert m["steps_by_seed"]["2"] == pytest.approx(30.4) and m["multiplier"] == pytest.approx(
        statistics.fmean([30 / 20, 30.4 / 20.2, 29.7 / 19.85]), rel=1e-6)
    assert m["multiplier_low"] < m["multiplier"] < m["multiplier_high"] and m["missed_within"] is None
    assert m["along"] > 1.2  # at every N where bf16 reached the codec's loss, bf16 had taken fewer steps
    missed = scoring.metric(curves, names, bf16, "uncompressed", 3.6, 40)  # the codec ends at 3.7
    assert missed["multiplier"] is None and missed["missed_within"] == 40
    assert report.multiplier_text(missed) == "missed within 40 steps (3 of 3 seeds)"
    assert report.steps_text(missed) == "missed within 40 steps (seed 1, 2, 3)"


def test_damage_verdicts_follow_the_paired_interval():
    assert scoring.verdict(score.mean_interval([0.02, 0.03, 0.025])) == scoring.MORE_DAMAGE
    assert scoring.verdict(score.mean_interval([-0.02, -0.03, -0.025])) == "less damage than bf16's"
    assert scoring.verdict(score.mean_interval([0.02, -0.03, 0.01])) == "within noise"
    assert scoring.verdict(score.mean_interval([0.02])) == "one seed"


def test_bits_are_the_codecs_exact_wire_bytes_at_the_reference_shape():
    fwd, bwd = scoring.bits("paper", scoring.REFERENCE_SHAPE)
    assert fwd == pytest.approx(4.43, abs=0.01) and bwd == pytest.approx(7.0, abs=0.01)
    assert scoring.bits("bf16", scoring.REFERENCE_SHAPE) == pytest.approx((16.0, 16.0), abs=0.001)
    # bits per boundary: the mean over the boundaries; the busiest link carries the most
    fwd, _ = scoring.bits("channel_b_h4", scoring.REFERENCE_SHAPE, 8)
    assert fwd == pytest.approx(5.31, abs=0.01)
    assert scoring.busiest_bits("channel_b_h4", scoring.REFERENCE_SHAPE, 8) == pytest.approx(6.02 + 4.25, abs=0.01)


def _table_row(codec, multiplier, verdict, t, bits=(4.0, 4.0), seeds=(1, 2, 3), spread=0.01, busiest=None):
    steps = {str(s): None if multiplier is None else 20 * (multiplier + spread * (k - 1)) for k, s in enumerate(seeds)}
    m = {"multiplier": multiplier, "steps_by_seed": steps, "missed_within": None if multiplier else 40,
         "projected_T": t, "projected_T_low": t and t * (1 if codec == "bf16" else 0.9),
         "projected_T_high": t and t * (1 if codec == "bf16" else 1.1),
         "damage_verdict": verdict, "damage_vs_bf16": 0.001, "damage_vs_bf16_low": -0.002,
         "damage_vs_bf16_high": 0.004}
    if multiplier is not None:
        m.update(multiplier_low=multiplier - 0.1, multiplier_high=multiplier + 0.1)
    return {"codec": codec, "forward_bits": bits[0], "backward_bits": bits[1], "seeds": list(seeds),
            "busiest_bits": busiest or sum(bits), "projected_s_per_step": (t or 1.0) / (20 * (multiplier or 1)),
            "uncompressed": dict(m), "compressed": dict(m)}


def test_the_recommended_preset_reached_the_target_without_more_damage_and_ties_go_to_fewer_bits():
    table = [_table_row("bf16", 1.0, "–", 300_000.0, (16, 16)),
             _table_row("hadint4", 1.0, scoring.MORE_DAMAGE, 50_000.0),
             _table_row("paper", None, "within noise", None, (3, 3)),
             _table_row("channel9", 1.6, "within noise", 160_000.0),
             _table_row("channel_h4", 1.1, "less damage than bf16's", 100_000.0, (6, 4)),
             _table_row("not_a_preset", 1.0, "within noise", 90_000.0)]
    assert verdicts.recommended(table) == "channel_h4"
    assert verdicts.recommended(table[:3]) is None
    # a preset within noise of the best projected T, with fewer bits on the busiest link, is chosen instead
    tied = [*table, _table_row("channel_b_h4", 1.12, "within noise", 101_000.0, (5, 4), spread=-0.05, busiest=9.0)]
    assert verdicts.recommended(tied) == "channel_b_h4"
    # not within noise (the seeds agree closely on a clearly larger T): the best stays
    apart = [*table, _table_row("channel_b_h4", 1.5, "within noise", 150_000.0, (5, 4), spread=0.001, busiest=9.0)]
    assert verdicts.recommended(apart) == "channel_h4"
    # within noise of the best but far slower on average (few seeds, a wide interval): not a tie
    wide = [*table, _table_row("channel_b_h4", 1.5, "within noise", 150_000.0, (5, 4), spread=0.5, busiest=9.0)]
    assert verdicts.recommended(wide) == "channel_h4"
    # one seed is no evidence: a preset must have reached the target in two or more
    alone = [*table, _table_row("channel_b_h4", 1.0, "within noise", 60_000.0, (5, 4), seeds=(1,), busiest=9.0)]
    assert verdicts.recommended(alone) == "channel_h4"
    one = {**alone[-1]["uncompressed"], "multiplier_low": 1.0, "multiplier_high": 1.0}
    assert report.multiplier_text(one) == "1.00x (one seed)"
    text = report.frontier_text({"table": table})
    assert text.index("`paper` 6.00 bits: missed within 40 steps") < text.index("`channel_h4` 10.00 bits: 1.10x")
    # the README's table: bf16 and the presets on both evaluations, the other candidates on the page only
    wire = {"channel_h4": {8: {"forward": 5.1, "backward": 3.2, "both": 8.3, "shape": [128, 1]},
                           4: {"forward": 9.0, "backward": 9.0, "both": 18.0, "shape": [128, 1]}}}
    readme = readme_sections.readme_table({"table": [table[0], table[2], table[4], table[5]], "depth": 8}, wire=wire)
    assert readme.startswith("| preset | bits fwd + bwd on the wire: WAN ledger, real 8-stage pipeline with the coder, "
                             "[128, 1, hidden] | bits fwd + bwd at [1024, 8, 1024] |")
    assert "| [bf16 (uncompressed)](docs/REAL_MODEL.md) | – | 16.00 + 16.00 | 1 | 1 | – | 300,000 |" in readme
    assert "| [`paper`](docs/REAL_MODEL.md) | – | 3.00 + 3.00 | missed within 40 steps (3 of 3 seeds) | missed within " \
           "40 steps (3 of 3 seeds) | +0.10% [-0.20%, +0.40%] (within noise) | – |" in readme
    assert "| [`channel_h4`](docs/REAL_MODEL.md) | [5.10 + 3.20](docs/WHOLE_RUN.md) | 6.00 + 4.00 | 1.10x [1.00x, " \
           "1.20x] | 1.10x [1.00x, 1.20x] | +0.10% [-0.20%, +0.40%] (less damage than bf16's) | 100,000 [90,000, " \
           "110,000] |" in readme  # the ledger's bits at the table's depth, not another depth's
    assert "not_a_preset" not in readme and readme.count("\n| [") == 3


def test_the_bits_on_the_wire_are_the_whole_run_pipelines_with_the_coder_only(tmp_path):
    page = tmp_path / "whole_run.json"
    check = {"codec": "lowrank_h3_rn", "depth": 8, "shape": [128, 1],
             "ledger_bits": {"forward": 3.47, "backward": 2.53, "both": 6.0}}
    page.write_text(json.dumps({"pipeline": [{**check, "flags": ["--tah-entropy-coding"]},
                                             {**check, "depth": 4, "flags": []},  # without the coder: not these bits
                                             {**check, "depth": 2, "flags": ["--tah-entropy-coding"],
                                              "ledger_bits": None}]}))
    assert readme_sections.wire_bits(page) == {"lowrank_h3_rn": {8: {**check["ledger_bits"], "shape": [128, 1]}}}
    assert readme_sections.wire_bits(tmp_path / "absent.json") == {}


def test_the_pipeline_column_is_judged_on_the_evaluation_through_the_codecs_with_serving_candidates():
    """Served through the pipeline, a candidate's steps and damage are both the evaluation through the codecs'; the
    runs trained as usual and served at more forward bits compete there only."""
    bf16 = _table_row("bf16", 1.0, "–", 300_000.0, (16, 16))
    best = _table_row("channel_h4", 1.05, "within noise", 100_000.0, (6, 4))
    best["compressed"]["damage_verdict"] = scoring.MORE_DAMAGE  # fine served on its own, not through the pipeline
    other = _table_row("hadint4", 1.3, "within noise", 130_000.0)
    served = _table_row("lowrank_h3_rn_s8", 1.1, "within noise", 90_000.0, (3.4, 3.3))
    rows = [bf16, best, other, served]
    assert verdicts.recommended(rows, "uncompressed") == "channel_h4"  # a serving candidate is no choice here
    assert verdicts.recommended(rows, "compressed") == "lowrank_h3_rn_s8"
    served["compressed"]["damage_verdict"] = scoring.MORE_DAMAGE
    assert verdicts.recommended(rows, "compressed") == "hadint4"
    other["compressed"].update(multiplier=None)  # missed through the codecs
    assert verdicts.recommended(rows, "compressed") is None
    assert [r["codec"] for r in verdicts.candidates(rows, "compressed")] == ["channel_h4", "hadint4", "lowrank_h3_rn_s8"]
    assert [r["codec"] for r in verdicts.candidates(rows, "uncompressed")] == ["channel_h4", "hadint4"]


def test_tied_candidates_with_the_same_busiest_link_go_to_the_lower_projected_t_not_to_fewer_bits_elsewhere():
    """Two tied (within noise and within ``TIE``) with the same bits on the busiest link: the lower projected T, as the
    rule says, whatever their bits on the other links."""
    table = [_table_row("bf16", 1.0, "–", 300_000.0, (16, 16)),
             _table_row("channel_h4", 1.07, "within noise", 117_000.0, (6.02, 4.25), spread=0.05, busiest=10.27),
             _table_row("channel_b_h4", 1.12, "within noise", 122_000.0, (5.31, 4.25), spread=0.1, busiest=10.27)]
    for traffic in report.runs.TRAFFIC:
        assert verdicts.recommended(table, traffic) == "channel_h4"
    table[2]["busiest_bits"] = 9.5  # fewer bits on the busiest link: it wins the tie
    assert verdicts.recommended(table, "uncompressed") == "channel_b_h4"
    table[2]["uncompressed"]["projected_T"] = 1.06 * 117_000.0  # beyond TIE: no tie
    assert verdicts.recommended(table, "uncompressed") == "channel_h4"


def test_the_rule_is_written_once_with_its_ties_and_the_page_and_the_readme_print_it(tmp_path):
    text = " ".join(verdicts.rule_text().split())
    assert f"within noise of it (the paired interval of the T ratio holds 1) and within {verdicts.TIE:.0%} of it ties" \
        in text and "the fewest bits on the busiest link win, then the lowest projected T." in text
    assert "through the codecs" in text and "`--tah-eval-forward-bits`" in text
    template = (REPO / "benchmarks" / "real_model" / "page.md").read_text()
    assert "{rule}" in template and "within noise of it" not in template  # the rule is not written twice
    readme = tmp_path / "README.md"
    readme.write_text("".join(f"<!-- real_model:{n} -->\n<!-- /real_model:{n} -->\n"
                              for n in readme_sections.README_SECTIONS))
    result = json.loads((REPO / "docs" / "data" / "real_model.json").read_text())
    assert readme_sections.write_readme(result, readme)
    assert text in " ".join(readme.read_text().split())


def test_a_choice_s_flags_train_and_serve_as_its_runs_did():
    import argparse
    import dataclasses

    from benchmarks.common.codecs import CODECS
    from megatron_tah.config import TahConfig
    from megatron_tah.megatron.arguments import add_tah_arguments, tah_config_from_args

    assert verdicts.flag_line("channel_h4") == "--tah-preset channel_h4"
    assert verdicts.flag_line("lowrank_h3_rn_s8") == "--tah-preset lowrank_h3_rn --tah-eval-forward-bits 8"
    assert verdicts.flag_line("lowrank_s5") == "--tah-preset lowrank --tah-eval-forward-bits 5"
    parser = add_tah_arguments(argparse.ArgumentParser())
    for codec in ("channel4_h3_s6", "lowrank_h3_rn_s8", "channel_b_h4"):
        parsed = dataclasses.asdict(tah_config_from_args(parser.parse_args(verdicts.flag_line(codec).split())))
        wanted = dataclasses.asdict(TahConfig(**CODECS[codec]))
        assert {**parsed, "tah_preset": None} == {**wanted, "tah_preset": None}, codec


def test_a_goal_is_met_by_bits_mean_multiplier_and_the_damage_intervals_upper_end_over_two_seeds():
    row = _table_row("cheap", 1.04, "within noise", 90_000.0, (4, 3))  # damage +0.1% [-0.2%, +0.4%]
    assert verdicts.meets(row, 8.0, 1.05, 0.005)
    assert not verdicts.meets(row, 6.0, 1.05, 0.005)  # 7 bits
    assert not verdicts.meets(row, 8.0, 1.03, 0.005)  # its multiplier
    assert not verdicts.meets(row, 8.0, 1.05, 0.003)  # its damage interval's upper end
    assert not verdicts.meets(_table_row("cheap", 1.04, "one seed", 90_000.0, (4, 3), seeds=(1,)), 8.0, 1.05, 0.005)
    text = report.goals_text({"table": [_table_row("bf16", 1.0, "–", 3e5, (16, 16)), row]})
    assert "At most 8 bits" in text and "met by `cheap`" in text
    assert "At most 6 bits" in text and "not met. Within the bits: no candidate run had so few bits" in text


def test_the_six_bit_goal_bounds_the_steps_intervals_upper_end_and_asks_for_a_serving_codec():
    row = _table_row("cheap", 1.04, "within noise", 90_000.0, (3, 2.5))  # 1.04x [0.94x, 1.14x]
    assert verdicts.meets(row, 6.0, 1.10, 0.005, multiplier_high=1.20)
    assert not verdicts.meets(row, 6.0, 1.10, 0.005, multiplier_high=1.10)  # its interval's upper end
    bf16 = _table_row("bf16", 1.0, "–", 3e5, (16, 16))
    text = report.goals_text({"table": [bf16, row]})
    assert "At most 6 bits both ways, at most 1.10x bf16's steps (upper end at most 1.20x; model served on its own)" in text
    assert "met by `cheap`" in text
    assert "**The same, served through the pipeline at its serving bits (`--tah-eval-forward-bits`) in at most " \
           "1.05x bf16's steps:** not met: no candidate that meets the goal above was evaluated at serving bits." in text
    # a serving candidate (trained as lowrank_h3_rn, evaluated through the pipeline at 8 forward bits)
    served = _table_row("lowrank_h3_rn_s8", 1.04, "within noise", 90_000.0, (3, 2.5))
    served["compressed"]["multiplier"] = 1.03
    text = report.goals_text({"table": [bf16, served]})
    assert "1.05x bf16's steps:** met by `lowrank_h3_rn_s8` (1.03x [0.94x, 1.14x] through the pipeline at 8 " \
           "forward bits)." in text
    served["compressed"]["multiplier"] = 1.08
    text = report.goals_text({"table": [bf16, served]})
    assert "1.05x bf16's steps:** not met: `lowrank_h3_rn_s8`: 1.08x [0.94x, 1.14x] through the pipeline at 8 " \
           "forward bits, 1.04x [0.94x, 1.14x] served on its own (the same runs)." in text
    # the same runs served on their own above the goal, interval included: the training sets the steps
    served["uncompressed"].update(multiplier=1.08, multiplier_low=1.06, multiplier_high=1.10)
    text = report.goals_text({"table": [bf16, served]})
    assert "1.08x [1.06x, 1.10x] served on its own (the same runs): the training itself takes more than 1.05x " \
           "bf16's steps, whatever the pipeline serves at." in text
    assert not verdicts.serves(row, 1.05)  # evaluated through its training codec: not a serving candidate


def test_the_six_bit_goal_says_its_projected_t_and_the_toys_t_and_why_not():
    from benchmarks.speedrun import projection

    bf16, row = _table_row("bf16", 1.0, "–", 3e5, (16, 16)), _table_row("cheap", 1.04, "within noise", 90_000.0, (3, 2.5))
    row["projected_s_per_step"] = 26.0
    alone = 26.0 * projection.SETUP.steps_to_target
    text = report.goals_text({"table": [bf16, row]})
    assert "T (served on its own; an estimate) at most 80,000 s:** not met: `cheap`: 90,000 [81,000, 99,000] s; at " \
           f"bf16's steps its seconds per step alone give {alone:,.0f} s (its steps multiplier makes the difference)." in text
    row["projected_s_per_step"] = 30.0  # its wire alone is too slow
    assert "alone give 87,750 s (above the goal whatever its steps)" in report.goals_text({"table": [bf16, row]})
    row["uncompressed"].update(projected_T=78_000.0, projected_T_low=75_000.0, projected_T_high=81_000.0)
    assert "80,000 s:** met by `cheap` (78,000 [75,000, 81,000] s)." in report.goals_text({"table": [bf16, row]})
    # the toy speedrun's page: missing, a codec it did not run, one that missed, one within the goal
    assert "0.35x bf16's:** the toy speedrun's JSON was not found beside this page." in text
    toy = {"bf16": {"codec": "bf16", "seeds": [1, 2], "s_per_step": 20.0, "T_vs_bf16": 1.0, "multiplier": 1.0}}
    assert "0.35x bf16's:** not met: `cheap`: not run on the toy." in report.goals_text({"table": [bf16, row]}, toy)
    toy["cheap"] = {"codec": "cheap", "seeds": [1, 2], "s_per_step": 8.0, "T_vs_bf16": None, "multiplier": None,
                    "missed_within": {"1": 500, "2": 740}}
    assert "0.35x bf16's:** not met: `cheap` (2 seeds): missed within 500/740 steps; its seconds per step alone are " \
           "0.400x bf16's." in report.goals_text({"table": [bf16, row]}, toy)
    toy["cheap"].update(s_per_step=6.0, T_vs_bf16=0.33, multiplier=1.1, multiplier_low=1.0, multiplier_high=1.2)
    assert "0.35x bf16's:** met by `cheap`: `cheap` (2 seeds): T 0.330x bf16's (steps 1.10x [1.00x, 1.20x]); its " \
           "seconds per step alone are 0.300x bf16's." in report.goals_text({"table": [bf16, row]}, toy)
    toy_page = Path(__file__).parent / "no_such_dir" / "speedrun.json"
    assert verdicts.toy_rows(toy_page) == {}


def test_a_goal_counts_the_bits_the_lossless_coder_sends_where_it_was_measured():
    row = _table_row("cheap", 1.04, "within noise", 90_000.0, (4, 3))
    assert not verdicts.meets(row, 6.0, 1.05, 0.005)
    coded = {**row, "coded_bits": 5.5}
    assert verdicts.meets(coded, 6.0, 1.05, 0.005) and verdicts.fewest_bits(coded) == 5.5
    assert verdicts.fewest_bits({**row, "coded_bits": 7.5}) == 7.0  # the coder would send more: not counted
    text = report.goals_text({"table": [_table_row("bf16", 1.0, "–", 3e5, (16, 16)), coded]})
    assert "met by `cheap` (7.00 bits, 5.50 with `--tah-entropy-coding`)" in text
    slow = {**coded, "uncompressed": {**coded["uncompressed"], "multiplier": 1.2}}
    text = report.goals_text({"table": [_table_row("bf16", 1.0, "–", 3e5, (16, 16)), slow]})
    assert "At most 6 bits" in text and "Within the bits: `cheap` (7.00 bits, 5.50 with `--tah-entropy-coding`; " \
        "3 seeds): 1.20x" in text


def test_coded_bits_scale_each_direction_by_the_coders_measured_share_for_the_same_training(tmp_path):
    import json

    from megatron_tah.link import frames

    lossless = tmp_path / "lossless.json"
    lossless.write_text(json.dumps({"rows": [
        {"preset": "channel4_h3", "direction": "forward", "bits": 4.0, "coded": 3.0},
        {"preset": "channel4_h3", "direction": "backward", "bits": 4.0, "coded": 2.0}]}))
    expected = (4.02 * 0.75 + 3.25 * 0.5) * (1 + frames.MARGIN)
    assert scoring.coded_bits("channel4_h3", 4.02, 3.25, lossless) == pytest.approx(expected)
    # a serving candidate trains as channel4_h3: the same buffers, the same share
    assert scoring.coded_bits("channel4_h3_s6", 4.02, 3.25, lossless) == pytest.approx(expected)
    assert scoring.coded_bits("lowrank", 3.38, 4.25, lossless) is None  # not measured
    assert scoring.coded_bits("bf16", 16.0, 16.0, lossless) is None


def test_serving_at_other_bits_is_reported_beside_the_same_training_through_its_own_codec():
    served = _table_row("channel4_h3_s6", 1.05, "within noise", 90_000.0, (4.02, 3.25))
    served["compressed"].update(multiplier=1.08, multiplier_low=1.0, multiplier_high=1.16)
    own = _table_row("channel4_h3", 1.05, "within noise", 90_000.0, (4.02, 3.25))
    own["compressed"].update(multiplier=None, missed_within=40)
    text = report.serving_text({"table": [_table_row("bf16", 1.0, "–", 3e5, (16, 16)), served, own]})
    assert "`channel4_h3_s6` trains at 4.02 + 3.25 bits and evaluates through the pipeline at 6 forward bits" in text
    assert "1.05x [0.95x, 1.15x] bf16's steps served on its own, 1.08x [1.00x, 1.16x] served through the pipeline" in text
    assert "through its own codec (`channel4_h3`): missed within 40 steps" in text
    assert "No run" in report.serving_text({"table": [own]})


def test_the_study_rewrites_the_readmes_sections_between_their_markers_only(tmp_path, monkeypatch):
    monkeypatch.setattr(readme_sections, "README_SECTIONS",
                        {"table": lambda r, wire: f"T{r['n']}", "presets": lambda r, wire: "P"})
    readme = tmp_path / "README.md"
    readme.write_text("a\n<!-- real_model:table -->\nold\n<!-- /real_model:table -->\nb\n"
                      "<!-- real_model:presets -->\n<!-- /real_model:presets -->\nc\n")
    assert readme_sections.write_readme({"n": 1}, readme) and readme_sections.write_readme({"n": 2}, readme)
    assert readme.read_text() == ("a\n<!-- real_model:table -->\nT2\n<!-- /real_model:table -->\nb\n"
                                  "<!-- real_model:presets -->\nP\n<!-- /real_model:presets -->\nc\n")
    readme.write_text("no markers\n")
    assert not readme_sections.write_readme({"n": 1}, readme) and readme.read_text() == "no markers\n"


def test_evaluation_noise_is_the_paired_standard_error_on_the_same_samples(tmp_path):
    curves = _curves(0.01, seeds=(1,), noise=(0.0,))
    for name, losses in ((runs.run_name("bf16", 1), [3.0, 3.2, 2.8, 3.0]), (runs.run_name("x", 1, 8), [3.1, 3.3, 2.9, 3.3])):
        traffic = "codec" if "bf16" in name else "uncompressed"
        (tmp_path / f"{name}.evals.jsonl").write_text(
            json.dumps({"iteration": 20, "split": "valid", "traffic": traffic, "losses": losses}) + "\n")
    found = scoring.noise(curves, tmp_path, {1: runs.run_name("bf16", 1)}, 0.02)
    diffs = [0.1, 0.1, 0.1, 0.3]
    assert found["pairs"] == 1 and found["median_gap"] == pytest.approx(0.15)
    assert found["median_se"] == pytest.approx(statistics.stdev(diffs) / 2)
    assert found["se_in_steps"] == pytest.approx(found["median_se"] / 0.02)
    resolution = scoring.resolution(_curves(0.01), 3.81, 2)
    assert resolution["max_diff_steps"] == pytest.approx(0.0, abs=1e-9)  # a straight line interpolates exactly


@pytest.mark.distributed
def test_the_tiny_study_runs_scores_and_writes_its_page(tmp_path):
    pytest.importorskip("transformers")
    out, page = tmp_path / "study", tmp_path / "docs" / "REAL_MODEL.md"
    cmd = [sys.executable, "-m", "benchmarks.real_model", "--size", "tiny", "--out", str(out), "--codecs", "bf16,paper",
           "--depth", "2", "--other-depths", "4", "--seeds", "1,2", "--pipeline", "paper", "--write", str(page)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((page.parent / "data" / "real_model.json").read_text())
    size = runs.SIZES["tiny"]
    rows = {r["codec"]: r for r in result["table"]}
    assert set(rows) == {"bf16", "paper"} and [r["codec"] for r in result["depths"]["4"]] == ["bf16", "paper"]
    assert result["boundaries"] == {"2": [2], "4": [1, 2, 3]}
    bf16 = [result["curves"][runs.run_name("bf16", s)]["uncompressed"] for s in (1, 2)]
    assert result["target"] == pytest.approx(scoring.target_and_slope(bf16, size.target_step)[0])
    for name, curve in result["curves"].items():  # every run the same steps, validated from eval_from on, both ways
        assert [i for i, _ in curve["uncompressed"]] == list(range(size.eval_from, size.iters + 1, size.eval_interval))
        same = curve["uncompressed"] == curve["compressed"]
        assert same == (curve["codec"] == "bf16"), name  # bf16 has no codec; paper's evaluations differ
        assert curve["damage"]["uncompressed"]["damage_loss"] > 0
        assert 0 <= curve["damage"]["compressed"]["damage_accuracy"] <= 1
    for seed in (1, 2):
        curve = result["curves"][runs.run_name("paper", seed, 2)]["uncompressed"]
        assert rows["paper"]["uncompressed"]["steps_by_seed"][str(seed)] == score.crossing(curve, result["target"])
    assert result["untouched"]["damage_loss"] > 0
    assert result["noise"]["pairs"] >= 2 * len(bf16[0]) and result["noise"]["median_se"] > 0
    check = result["pipeline"]  # the real 2-stage pipeline from the same weights tracks the emulated run, both ways
    for traffic in runs.TRAFFIC:
        assert len(check[traffic]["iterations"]) >= 3 and check[traffic]["max_abs_diff"] < 0.1
    text = page.read_text()
    assert "| paper | 4.43 + 7.00 | 2 |" in text and "layers 2 (Megatron" in text
    assert "| 4 | paper | 4.43 + 7.00 | 2 |" in text
    for plot in ("real_model.png", "real_model_frontier.png", "real_model_along.png"):
        assert (page.parent / "data" / plot).stat().st_size > 0
    assert "Not measured for this page" in text  # no sensitivity JSON beside this page

    # the committed page's runs are reused, not run again: a fresh --out scores the same table from its JSON
    again, page2 = tmp_path / "again", tmp_path / "docs2" / "REAL_MODEL.md"
    reuse = ["--from-page", str(page.parent / "data" / "real_model.json")]
    for folder in ("model", "data"):  # imported and tokenized once
        shutil.copytree(out / folder, again / folder)
    done = subprocess.run([*cmd[:cmd.index("--out") + 1], str(again), *cmd[cmd.index("--out") + 2:-4], *reuse,
                           "--write", str(page2)], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not list(again.glob("train_*.jsonl")) and not list(again.glob("pipeline_*.jsonl"))
    second = json.loads((page2.parent / "data" / "real_model.json").read_text())
    assert second["table"] == result["table"] and second["depths"] == result["depths"]
    assert second["reused"]["runs"] == len(result["curves"]) and second["noise"] == result["noise"]
    assert f"the curves of {len(result['curves'])} more runs are this page's JSON" in page2.read_text()
    other = dict(result, setup={**result["setup"], "iters": result["setup"]["iters"] + 1})
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="not this study's"):
        scoring.reusable(tmp_path / "other.json", size)


def test_the_sensitivity_probe_measures_each_boundary_and_the_gradients_on_a_random_llama(tmp_path):
    """``benchmarks.real_model.sensitivity`` on the tiny random Llama at depth 4 (boundaries after layers 1, 2,
    3): 8 bits cost less than 2 at every boundary, alone and together; 3-bit gradients err more than 6-bit
    ones, and both less than nothing (> 0); two batches' exact gradients differ."""
    import transformers

    from benchmarks.real_model.sensitivity import measure

    runs.make_tiny_llama(tmp_path / "tiny")

    def load():
        return (transformers.AutoTokenizer.from_pretrained(tmp_path / "tiny"),
                transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tiny"))

    result = measure({"tah_forward_codec": "channel"}, {"tah_backward_codec": "channel",
                                                        "tah_backward_stochastic_rounding": True},
                     [2, 8], [3, 6], stages=4, seq=32, batches=3, load=load)
    assert result["boundaries"] == [1, 2, 3]
    gap = {(r["bits"], r["boundary"]): r["gap"] for r in result["forward"]}
    assert set(gap) == {(b, k) for b in (2, 8) for k in (1, 2, 3, "all")}
    for k in (1, 2, 3, "all"):
        assert abs(gap[(8, k)]) < abs(gap[(2, k)]), (k, gap)
    errors = {r["bits"]: r["rel_error"] for r in result["backward"]}
    assert 0 < errors[6] < errors[3]
    assert result["between_batches"]["rel_error"] > 0


def test_reused_runs_from_another_machine_are_named_with_the_untouched_models_difference_between_the_two():
    host = {"cpu": "AMD EPYC", "torch": "2.14.1"}
    result = {"host": host, "untouched": {"valid_loss": 4.2657, "damage_loss": 3.7445},
              "reused": {"runs": 40, "date": "2026-12-01", "run_hours": 14.6, "earlier_runs": 41,
                         "host": {"cpu": "Intel Xeon", "torch": "2.14.1"},
                         "untouched": {"valid_loss": 4.2668, "damage_loss": 3.7443}}}
    text = report.reused_text(result)
    assert "40 more runs" in text and "--from-page" in text and "on Intel Xeon" in text and "-0.0011 (validation)" in text
    assert "+0.0002 (damage corpus)" in text
    result["reused"]["host"] = host  # the same machine: nothing to compare
    assert "differs" not in report.reused_text(result) and report.reused_text({"host": host}) == ""


def test_bf16_trained_again_here_is_compared_with_its_reused_curve_at_the_validations_both_have(tmp_path):
    name = runs.run_name("bf16", 1)
    reused = {name: {"codec": "bf16", "seed": 1, "reused": True, "uncompressed": [(10, 4.0), (12, 3.9), (14, 3.8)],
                     "damage": {"uncompressed": {"damage_loss": 3.70}}}}
    assert scoring.control(tmp_path, reused, 3.85) is None  # not trained again
    records = [{"iteration": 10, "valid_loss": 4.01}, {"iteration": 12, "valid_loss": 3.88},
               {"iteration": 14, "valid_loss": 3.80}, {"iteration": 16, "valid_loss": 3.70}]
    log = tmp_path / f"{runs.CONTROL}{name}.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert scoring.control(tmp_path, reused, 3.85) is None  # unfinished: no damage evaluation yet
    log.write_text(log.read_text() + json.dumps({"iteration": 16, "test_loss": 3.72, "valid_loss": 3.70}) + "\n")
    found = scoring.control(tmp_path, reused, 3.85)
    assert found["run"] == name and found["validations"] == 3  # step 16 is only here
    assert found["mean_diff"] == pytest.approx((0.01 - 0.02 + 0.0) / 3) and found["max_abs_diff"] == pytest.approx(0.02)
    assert found["damage_diff"] == pytest.approx(0.02)
    assert found["steps_there"] == pytest.approx(13.0) and found["steps_here"] == pytest.approx(12.75)
    assert scoring.control(tmp_path, {name: {**reused[name], "reused": False}}, 3.85) is None  # run here: no check
    result = {"host": {"cpu": "AMD EPYC", "torch": "2"}, "reused": {
        "runs": 1, "date": "d", "run_hours": 1.0, "earlier_runs": 1, "host": {"cpu": "Intel", "torch": "2"},
        "control": found}}
    assert f"`{name}` trained again here: its 3 validations differ" in report.reused_text(result)


def test_where_the_whole_runs_verdict_is_in_the_readme_recommends_its_choice_by_its_rule():
    result = json.loads((REPO / "docs" / "data" / "real_model.json").read_text())
    short = report.presets_by_depth(result)
    whole = {"points": [50, 200], "rule": {"text": "eligible: every seed reached the target"},
             "chosen": {"8": {"uncompressed": "channel_b_h4", "compressed": None},
                        "4": {"uncompressed": "channel_h4", "compressed": "channel_h4"}},
             "final": {"8": True, "4": False}}
    assert readme_sections.whole_run_verdicts(whole) == {"8": whole["chosen"]["8"]}  # depth 4: still going on
    text = readme_sections.presets_section(result, whole)
    flat = " ".join(text.split())
    assert ("At depth 8 the whole run's verdict (200 steps, every planned seed, by its own rule: "
            "[docs/WHOLE_RUN.md](docs/WHOLE_RUN.md)) replaces it.") in flat
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in text.splitlines()
            if line.startswith("| ") and line[2].isdigit()}
    assert rows["8"][0] == f"`{verdicts.flag_line('channel_b_h4')}`"
    assert rows["8"][1] == "none met the whole run's rule: none (uncompressed) |"
    assert rows["4"][0] == f"`{verdicts.flag_line(short['4']['uncompressed'])}`"  # the short study's, as before
    found = " ".join(readme_sections.found_text(result, None, ["8"]).split())
    assert found.count("the whole run's at depth 8 (the table above)") == 2  # both uses, depth 8 only
    assert "The choice is `lowrank_h3_rn` at depths 4 and 2, the whole run's at depth 8" in found
    assert "replaces" not in readme_sections.presets_section(result, {**whole, "final": {"8": False}})


def test_the_readme_says_how_the_whole_run_stands_and_when_the_short_studys_choice_ends_above_its_goal():
    def row(codec, ratio, seeds):
        return {"codec": codec, "uncompressed": {"points": {"200": {"ratio": ratio, "by_seed": dict.fromkeys(seeds, ratio)}}}}

    whole = {"tables": {"8": [row("bf16", 1.0, "ab"), row("lowrank_h3_rn", 1.4, "ab"), row("channel_h4", 1.07, "a"),
                              row("lowrank_h3_rn_s8", 1.5, "a")]},
             "points": [50, 200], "rule": {"goal_ratio": 1.1}, "planned": 58, "planned_finished": 18,
             "toy": [{"rows": [{"codec": "lowrank_h3_rn", "seeds": [1, 2], "uncompressed": {"to_target": {
                 "1": {"steps": None}, "2": {"steps": 500.0}}}}]}]}
    result = json.loads((REPO / "docs" / "data" / "real_model.json").read_text())
    chosen = report.presets_by_depth(result)["8"]["uncompressed"]
    text = " ".join(readme_sections.so_far_text(result, whole).split())
    assert "18 of 58 planned runs in" in text and "`channel_h4` 1.07x (1), `lowrank_h3_rn` 1.40x (2)" in text
    assert "lowrank_h3_rn_s8" not in text and "`bf16`" not in text  # presets only
    assert "missed bf16's target in 1 of 2 seeds" in text
    assert ("So far the 40-step choice at depth 8, `lowrank_h3_rn`, ends above the plan's goal (1.10x)." in text) == (
        chosen == "lowrank_h3_rn")
    whole["tables"]["8"][1].update(seeds=[1, 2, 3], planned_seeds=[1, 2, 3])
    whole["tables"]["8"][1]["uncompressed"]["damage_vs_bf16"] = 0.0075
    assert ("Over every planned seed the 40-step choice at depth 8, `lowrank_h3_rn`, ends above the plan's goal (1.10x), "
            "damage +0.75%." in " ".join(readme_sections.so_far_text(result, whole).split())) == (chosen == "lowrank_h3_rn")
    whole["tables"]["8"][1] = row("lowrank_h3_rn", 1.05, "ab")
    assert "ends above" not in readme_sections.so_far_text(result, whole)
    assert "chooses" not in text  # the rule has chosen nothing yet
    whole["chosen"] = {"8": {"uncompressed": "channel_h4", "compressed": None}}
    assert ("The plan's rule, over the seeds in so far, chooses `channel_h4` there (1.07x, 1 seed;"
            in " ".join(readme_sections.so_far_text(result, whole).split())) == (chosen != "channel_h4")
    whole["final"] = {"8": True}
    whole["tables"]["8"][2]["uncompressed"]["goal_fails"] = ["10.20 bits both ways on the WAN ledger"]
    assert ("The plan's verdict there, over every planned seed: `channel_h4` (1.07x; short of the plan's goal: "
            "10.20 bits both ways on the WAN ledger)."
            in " ".join(readme_sections.so_far_text(result, whole).split())) == (chosen != "channel_h4")
    whole["tables"]["8"][2]["uncompressed"]["goal_fails"] = []
    assert ("`channel_h4` (1.07x; it meets the plan's goal)."
            in " ".join(readme_sections.so_far_text(result, whole).split())) == (chosen != "channel_h4")
    assert "no finished run yet" in readme_sections.so_far_text(result, {})
