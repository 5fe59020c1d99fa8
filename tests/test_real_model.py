"""The real-model study (``benchmarks.real_model``): where a pipeline splits a model, stopping at the target, the
scoring rules, and the whole study on a random 4-layer Llama at depth 2 (``--size tiny``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from benchmarks.real_model import report, runs
from benchmarks.speedrun import score
from megatron_tah.hf_checkpoint import UnsupportedModel, split_flags, stage_layers

REPO = Path(__file__).resolve().parents[1]


def test_a_30_layer_model_splits_over_8_stages_as_megatron_does_with_a_lighter_first_and_last_stage():
    assert stage_layers(30, 8) == [3, 4, 4, 4, 4, 4, 4, 3]
    assert runs.boundaries(30, 8) == [3, 7, 11, 15, 19, 23, 27]
    assert split_flags(30, 8) == ["--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers", "3"]
    assert stage_layers(32, 8) == [4] * 8 and split_flags(32, 8) == [] and runs.boundaries(4, 2) == [2]
    with pytest.raises(UnsupportedModel, match="31 layers do not split over 8"):
        stage_layers(31, 8)


def test_stop_at_loss_ends_training_at_the_first_validation_at_or_below_the_target(monkeypatch):
    from benchmarks.depth.run import StopAtLoss

    module = types.ModuleType("fake_training")
    losses = iter([3.0, 2.6, 2.4, 2.2])
    module.evaluate = lambda *a, **k: ({"lm loss": next(losses)}, None, False)
    module.evaluate_and_print_results = lambda prefix, *args, **kwargs: module.evaluate()
    args = types.SimpleNamespace(train_iters=100)
    monkeypatch.setattr("megatron.training.global_vars.get_args", lambda: args)
    monkeypatch.setitem(sys.modules, "megatron.training.training", module)
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


def _row(steps, seeds=(1, 2, 3), **extra):
    return {"codec": "x", "seeds": list(seeds), "steps": None if None in steps else 10.0,
            "steps_by_seed": {str(s): v for s, v in zip(seeds, steps)}, "multiplier": None, **extra}


def test_a_run_that_missed_says_missed_within_its_steps_and_gets_no_multiplier():
    row = _row([40, None, 45], missed_within=200)
    assert report.steps_text(row) == "missed within 200 steps (seed 2)"
    assert report.multiplier_text(row) == "–"


def test_damage_verdicts_follow_the_paired_interval():
    assert report.verdict(score.mean_interval([0.02, 0.03, 0.025])) == "more damage than bf16's fine-tune"
    assert report.verdict(score.mean_interval([-0.02, -0.03, -0.025])) == "less damage than bf16's fine-tune"
    assert report.verdict(score.mean_interval([0.02, -0.03, 0.01])) == "within noise"
    assert report.verdict(score.mean_interval([0.02])) == "one seed"


def test_bits_are_the_codecs_exact_wire_bytes_at_the_reference_shape():
    fwd, bwd = report.bits("paper", report.REFERENCE_SHAPE)
    assert fwd == pytest.approx(4.43, abs=0.01) and bwd == pytest.approx(7.0, abs=0.01)
    assert report.bits("bf16", report.REFERENCE_SHAPE) == pytest.approx((16.0, 16.0), abs=0.001)


def _table_row(codec, multiplier, verdict, projected, bits=(4.0, 4.0)):
    interval = {} if multiplier is None else {"multiplier_low": multiplier - 0.1, "multiplier_high": multiplier + 0.1}
    return {"codec": codec, "multiplier": multiplier, "missed_within": None if multiplier else 100,
            "damage_verdict": verdict, "projected_T": projected, "forward_bits": bits[0], "backward_bits": bits[1],
            "damage_vs_bf16": 0.001, "damage_vs_bf16_low": -0.002, "damage_vs_bf16_high": 0.004, **interval}


def test_the_recommended_codec_reached_the_target_without_more_damage_at_the_lowest_projected_t():
    table = [_table_row("bf16", 1.0, "–", 300_000.0, (16, 16)),
             _table_row("fast_but_damaging", 1.0, "more damage than bf16's fine-tune", 50_000.0),
             _table_row("missed", None, "within noise", None, (3, 3)),
             _table_row("slow", 1.2, "within noise", 120_000.0),
             _table_row("best", 1.1, "less damage than bf16's fine-tune", 100_000.0)]
    assert report.recommended({"table": table}) == "best"
    assert report.recommended({"table": table[:3]}) is None
    text = report.frontier_text({"table": table})
    assert text.index("`missed` 6.00 bits: missed within 100 steps") < text.index("`best` 8.00 bits: 1.10x")
    assert text.endswith("`best`.")
    # of equal projected T, the fewest bits both ways (bits per boundary: T charges the busiest link)
    tied = [*table, _table_row("fewer_bits", 1.1, "within noise", 100_000.4, (3.5, 4.0))]
    assert report.recommended({"table": tied}) == "fewer_bits"
    assert report.recommended({"table": [*table, _table_row("fewer_bits", 1.1, "within noise", 100_001.0,
                                                            (3.5, 4.0))]}) == "best"
    # the README's table: bf16 and the presets, the other candidates on the page only
    readme = report.readme_table({"table": [table[0], {**table[2], "codec": "paper"}, table[4]]})
    assert "| [bf16 (uncompressed)](docs/REAL_MODEL.md) | 16.00 + 16.00 | 1 | – | 300,000 |" in readme
    assert "| [`paper`](docs/REAL_MODEL.md) | 3.00 + 3.00 | missed within 100 steps | +0.10% [-0.20%, +0.40%] " \
           "(within noise) | – |" in readme
    assert "`best`" not in readme and readme.count("\n| [") == 2


@pytest.mark.distributed
def test_the_tiny_study_runs_scores_and_writes_its_page(tmp_path):
    pytest.importorskip("transformers")
    out, page = tmp_path / "study", tmp_path / "docs" / "REAL_MODEL.md"
    cmd = [sys.executable, "-m", "benchmarks.real_model", "--size", "tiny", "--out", str(out), "--codecs", "bf16,paper",
           "--seeds", "1,2", "--pipeline", "paper", "--write", str(page)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((page.parent / "data" / "real_model.json").read_text())
    size = runs.SIZES["tiny"]
    rows = {r["codec"]: r for r in result["table"]}
    assert set(rows) == {"bf16", "paper"} and result["boundaries"] == [2]
    bf16 = [result["curves"][runs.run_name("bf16", s)]["validations"] for s in (1, 2)]
    assert result["target"] == score.target_loss(bf16, size.iters)
    for seed in (1, 2):  # paper's runs stopped at their first validation at or below the target, or ran the maximum
        curve = result["curves"][runs.run_name("paper", seed)]["validations"]
        reached = score.steps_to_target(curve, result["target"])
        assert curve[-1][0] == (reached or int(size.max_factor * size.iters))
        assert rows["paper"]["steps_by_seed"][str(seed)] == reached
    for row in rows.values():  # every run's model evaluated uncompressed on both corpora
        assert all(v > 0 for v in row["damage_by_seed"].values()) and 0 <= row["damage_accuracy"] <= 1
    assert result["untouched"]["damage_loss"] > 0
    check = result["pipeline"]  # the real 2-stage pipeline from the same weights tracks the emulated run
    assert len(check["iterations"]) >= 3 and check["max_abs_diff"] < 0.1
    text = page.read_text()
    assert "| paper | 4.43 + 7.00 |" in text and "layers 2 (Megatron" in text
    assert (page.parent / "data" / "real_model_frontier.png").stat().st_size > 0
    assert "Not measured for this page" in text  # no sensitivity JSON beside this page


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
