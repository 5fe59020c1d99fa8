"""The whole-run study (``benchmarks.real_model`` with ``--plan``): the registered plan, the ratio along the run, its
trend, the gap at equal steps, the rule that picks presets, the WAN ledger's bits, and the whole machinery on a
random 4-layer Llama (``size tiny_long``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.real_model import plan as plans
from benchmarks.real_model import runs, whole_run
from benchmarks.common.codecs import CODECS

REPO = Path(__file__).resolve().parents[2]


# ----- the plan ----------------------------------------------------------------------------------------------
def test_the_registered_plan_runs_the_readme_choices_made_before_it_and_paper_with_the_same_seeds_at_its_depths():
    plan = plans.load()
    assert plan.size is runs.SIZES["long"] and plan.size.iters == 5 * runs.SIZES["short"].iters
    assert plan.points[-1] == plan.size.iters and len(plan.points) >= 4  # the end and points from early on
    codecs = plan.depth_codecs()
    readme = (REPO / "README.md").read_text()
    presets = readme[readme.index("<!-- real_model:presets -->"):readme.index("<!-- /real_model:presets -->")]
    from benchmarks.real_model.verdicts import flag_line

    by_flags = {flag_line(c): c for c in CODECS if c not in ("bf16", "auto")}
    piped = {(d, c) for s in plan.stages if s.kind == "pipeline" for d in s.depths for c in s.codecs}
    outside, unpiped = set(), set()
    for line in presets.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells and cells[0].isdigit():  # | depth | served on its own | through the pipeline |
            for use, cell in zip(("own", "pipeline"), cells[1:]):
                if cell.endswith("none (uncompressed)"):  # the whole run's rule chose nothing there: nothing to run
                    continue
                codec = by_flags[cell.strip("`")]
                if codec not in codecs[int(cells[0])]:
                    outside.add((int(cells[0]), use, codec))
                if (int(cells[0]), codec) not in piped:
                    unpiped.add((int(cells[0]), use, codec))
    assert outside == set()  # stages F and G added the pipeline column's choices once the one rule judged it through the codecs
    assert unpiped == set()  # and H and I run them as the real pipeline at the depths they are recommended for
    assert "paper" in codecs[8] and all(c[0] == "bf16" for c in codecs.values())
    for stage in plan.stages:
        if stage.kind == "emulated":
            assert stage.seeds == plan.seeds  # every codec the same seeds
    assert plan.budget["jobs"] >= 1 and plan.budget["hours"] > 0


def test_a_stage_added_after_the_first_results_says_so_and_the_others_do_not():
    plan = plans.load()
    registered = "ABCD"  # the stages of the plan as first committed, before any run
    assert all(s.added for s in plan.stages if s.name not in registered)
    assert not any(plan.stage(n).added for n in registered) and len(plan.stages) > len(registered)


def test_the_plans_runs_are_seed_major_with_bf16_once_per_seed():
    plan = plans.load()
    names = plan.run_names(plan.stage("B"))
    assert names[:4] == ["train_lowrank_h3_rn_d4_s1234", "train_lowrank_h3_rn_s8_d4_s1234",
                         "train_lowrank_h3_rn_d2_s1234", "train_lowrank_h3_rn_s8_d2_s1234"]
    a = plan.run_names(plan.stage("A"))
    assert a.count("train_bf16_s1235") == 1 and a.index("train_bf16_s1235") > a.index("train_paper_d8_s1234")
    assert plan.run_names(plan.stage("C")) == [runs.pipeline_name("lowrank_h3_rn", 1234, d) for d in (8, 4, 2)]
    assert plan.run_names(plan.stage("J")) == [f"pipeline_lowrank_h3_rn_d{d}_s1234_zstd" for d in (8, 4, 2)]
    assert plan.stage("J").flags == plan.stage("C").flags  # stage C again, under the coder users now get


BASE = """name = "t"
registered = "2026-12-07"
size = "tiny_long"
seeds = [1, 2]
[target]
step = 8
points = [4, 8, 16]
[rule]
text = "t"
tie = 0.05
ratio_high = 1.2
goal_ratio = 1.1
goal_damage = 0.005
goal_bits = 6.0
[[stages]]
name = "A"
kind = "emulated"
depth = 2
codecs = ["bf16", "paper"]
"""


@pytest.mark.parametrize("change, error", [
    (('codecs = ["bf16", "paper"]', 'codecs = ["bf16", "nope"]'), "unknown: \\['nope'\\]"),
    (("points = [4, 8, 16]", "points = [4, 8, 17]"), "step 17 lies outside"),
    (("step = 8", "step = 6"), "not size 'tiny_long'"),
    (('kind = "emulated"', 'kind = "other"'), "kind 'other'"),
    (("seeds = [1, 2]", "seeds = [1, 1]"), "give each seed once"),
    (('size = "tiny_long"', 'size = "huge"'), "size 'huge'"),
    (('kind = "emulated"\ndepth = 2', 'kind = "pipeline"\ndepth = 2'), "needs `exit`"),
    (("depth = 2\n", ""), "pipeline depth"),
    (("tie = 0.05\n", ""), "\\[rule\\] lacks \\['tie'\\]"),
    (('kind = "emulated"\ndepth = 2', 'kind = "toy"'), "needs its run length `steps`"),
    (('kind = "emulated"\ndepth = 2\ncodecs = ["bf16", "paper"]', 'kind = "pipeline"\ndepth = 2\nexit = 8\n'
      'codecs = ["paper"]\n[[stages]]\nname = "B"\nkind = "pipeline"\ndepth = 2\nexit = 8\ncodecs = ["paper"]'),
     "give the later a `tag`"),
])
def test_a_plan_that_does_not_fit_is_refused_naming_the_file_and_the_field(tmp_path, change, error):
    assert plans.load(_write(tmp_path, BASE)).size.name == "tiny_long"  # the base plan loads
    with pytest.raises(ValueError, match=error) as caught:
        plans.load(_write(tmp_path, BASE.replace(*change)))
    assert "plan.toml" in str(caught.value)


def _write(folder: Path, text: str) -> Path:
    path = folder / "plan.toml"
    path.write_text(text)
    return path


def test_the_long_size_decays_by_a_cosine_over_the_run_and_the_short_sizes_setup_is_unchanged():
    flags = runs.SIZES["long"].train_flags(200)
    assert flags[flags.index("--lr-decay-style") + 1] == "cosine"
    assert flags[flags.index("--lr-decay-iters") + 1] == "200" and flags[flags.index("--min-lr") + 1] == "1e-05"
    short = runs.SIZES["short"]
    assert "--min-lr" not in short.train_flags(40) and "decay" not in short.setup()  # earlier pages stay comparable
    assert runs.SIZES["long"].setup()["decay"] == "cosine"
    check = runs.PipelineRun("p", [*flags, "--exit-interval", "60"], 2)  # complete at its exit step
    assert check.iterations() == 60 and runs.PipelineRun("p", flags, 2).iterations() == 200


# ----- along the run -------------------------------------------------------------------------------------------
def _curve(slope: float, lag: float = 1.0, start: float = 5.0, steps=range(10, 201, 10)) -> list[list[float]]:
    """A falling curve: the loss bf16 (lag 1) has at step s / lag."""
    return [[s, start - slope * (s / lag) ** 0.5] for s in steps]


def test_the_ratio_at_a_point_is_the_point_over_bf16s_step_at_the_same_loss_censored_or_none_beyond_its_curve():
    base = _curve(0.1)
    assert whole_run.ratio_at(_curve(0.1, lag=1.25), base, 100) == (pytest.approx(1.25, rel=1e-3), "")
    ratio, how = whole_run.ratio_at(_curve(0.1, lag=0.8), base, 200)  # better than bf16's end: at most 1.0
    assert how == "censored" and ratio == pytest.approx(1.0)
    assert whole_run.ratio_at([[50, 9.0]], base, 50) == (None, "above")
    assert whole_run.ratio_at(_curve(0.1), base, 55) == (None, "missing")


def _curves(lags: dict[int, float | list[float]], codec: str = "c") -> tuple[dict, dict, dict]:
    curves, names, bf16 = {}, {}, {}
    for seed, lag in lags.items():
        bf16[seed], names[seed] = f"b{seed}", f"{codec}{seed}"
        slope = 0.1 + 0.003 * seed
        curves[bf16[seed]] = {"uncompressed": _curve(slope)}
        if isinstance(lag, list):  # a lag that changes along the run
            points = [[s, _curve(slope, lag=lag[0] + (lag[1] - lag[0]) * (s - 10) / 190, steps=[s])[0][1]]
                      for s in range(10, 201, 10)]
        else:
            points = _curve(slope, lag=lag)
        curves[names[seed]] = {"uncompressed": points, "compressed": points}
    return curves, names, bf16


def test_a_lag_that_grows_along_the_run_reads_grows_and_a_steady_one_holds():
    curves, names, bf16 = _curves({1: [1.0, 1.3], 2: [1.01, 1.32], 3: [0.99, 1.29]})
    points = whole_run.along(curves, names, bf16, "uncompressed", (50, 100, 150, 190))
    assert points["50"]["ratio"] < points["100"]["ratio"] < points["190"]["ratio"]
    assert whole_run.trend(points)["verdict"] == "grows"
    curves, names, bf16 = _curves({1: [1.1, 1.12], 2: [1.12, 1.09], 3: [1.08, 1.09]})  # changes of either sign
    points = whole_run.along(curves, names, bf16, "uncompressed", (50, 100, 150, 190))
    assert points["190"]["ratio"] == pytest.approx(1.1, abs=0.01)
    assert whole_run.trend(points)["verdict"] == "holds (within noise)"


def test_a_seed_above_bf16s_curve_leaves_the_point_without_an_interval():
    curves, names, bf16 = _curves({1: 1.1, 2: 1.1})
    curves["c2"]["uncompressed"] = [[s, 9.0] for s, _ in curves["c2"]["uncompressed"]]
    point = whole_run.along(curves, names, bf16, "uncompressed", (100,))["100"]
    assert point["ratio"] is None and point["how"] == {"1": "", "2": "above"} and point["censored"] == ["2"]


def test_the_gap_at_equal_steps_is_the_paired_loss_difference_at_every_validation():
    curves, names, bf16 = _curves({1: 1.2, 2: 1.2})
    found = whole_run.gaps(curves, names, bf16, "uncompressed")
    assert [g["step"] for g in found] == list(range(10, 201, 10))
    for g in found:
        step = g["step"]
        diffs = [dict(curves[f"c{s}"]["uncompressed"])[step] - dict(curves[f"b{s}"]["uncompressed"])[step] for s in (1, 2)]
        assert g["gap"] == pytest.approx(sum(diffs) / 2) and g["gap"] > 0 and g["n"] == 2


# ----- choosing ------------------------------------------------------------------------------------------------
RULE = {"tie": 0.05, "ratio_high": 1.20, "goal_ratio": 1.10, "goal_damage": 0.005, "goal_bits": 6.0}


def _row(codec: str, ratio: float | None, high: float, busiest: float, damage_low: float = -0.001,
         missed: bool = False, seeds=(1, 2, 3)) -> dict:
    point = {"ratio": ratio, "ratio_low": None if ratio is None else ratio - 0.05, "ratio_high": high,
             "by_seed": {}, "how": {}, "censored": []}
    m = {"points": {"200": point}, "missed_within": 200 if missed else None,
         "steps_by_seed": {"1": None if missed else 90.0}, "damage_vs_bf16": damage_low + 0.002,
         "damage_vs_bf16_low": damage_low, "damage_vs_bf16_high": damage_low + 0.004, "projected_T": 1e5 * busiest}
    return {"codec": codec, "depth": 8, "seeds": list(seeds), "busiest_bits": busiest,
            "uncompressed": m, "compressed": dict(m)}


def test_the_rule_takes_the_fewest_busiest_bits_among_eligible_presets_tied_within_005_of_the_best_end_ratio():
    rows = [_row("bf16", 1.0, 1.0, 32.0), _row("channel_h4", 1.02, 1.10, 10.0), _row("channel_b_h4", 1.06, 1.15, 6.0),
            _row("lowrank", 1.10, 1.18, 4.0), _row("hadint4", 1.00, 1.30, 3.0),
            _row("paper", 1.00, 1.05, 2.0, damage_low=0.001), _row("lowrank_h3_rn", 1.0, 1.0, 1.0, missed=True),
            _row("lowrank_h3_rn_fwd", 1.0, 1.0, 0.5),
            _row("lowrank_h3_rn_s8", 1.0, 1.0, 0.7)]
    # lowrank lies 0.08 above the best eligible (channel_h4); of the tied, channel_b_h4 sends fewer bits
    assert whole_run.choose(rows, "uncompressed", RULE) == "channel_b_h4"
    reasons = {r["codec"]: whole_run.eligible(r, "uncompressed", RULE) for r in rows}
    assert reasons["hadint4"].startswith("end-of-run ratio's upper end 1.30")
    assert reasons["paper"] == "more damage than bf16's" and reasons["lowrank_h3_rn"].startswith("missed the target")
    assert reasons["channel_h4"] == ""
    assert whole_run.eligible(_row("paper", 1.0, 1.01, 1.5, seeds=(1,)), "uncompressed", RULE) == "one seed"
    assert reasons["lowrank_h3_rn_fwd"] == "not a preset"  # a one-direction probe is never advice
    assert reasons["lowrank_h3_rn_s8"].startswith("not a preset (a serving variant")  # on its own: its preset's row
    assert whole_run.choose(rows, "compressed", RULE) == "lowrank_h3_rn_s8"  # through the pipeline: a candidate
    assert whole_run.choose([rows[0], rows[3]], "uncompressed", {**RULE, "ratio_high": 1.1}) is None


def test_the_verdict_at_a_depth_is_in_when_every_codec_the_rule_may_choose_has_every_planned_seed():
    rows = [_row("bf16", 1.0, 1.0, 32.0), _row("channel_b_h4", 1.01, 1.17, 6.0, seeds=(1, 2)),
            _row("lowrank_h3_rn_fwd", 1.0, 1.0, 0.5, seeds=(1,))]
    for row in rows:
        row["planned_seeds"] = [1, 2, 3, 1, 2, 3]  # (a codec planned in two stages at this depth counts its seeds once)
    codecs = ["bf16", "channel_b_h4", "lowrank_h3_rn_fwd"]
    assert not whole_run.verdict_in(rows, codecs)  # channel_b_h4 has 2 of 3 seeds
    assert whole_run.chosen_text("channel_b_h4", False).startswith("Chosen by the rule so far (not the plan's verdict")
    rows[1]["seeds"] = [1, 2, 3]
    assert whole_run.verdict_in(rows, codecs)  # the one-direction measurement is never chosen: it does not wait
    assert not whole_run.verdict_in(rows, codecs + ["channel_h4"])  # a planned preset with no run finished
    assert not whole_run.verdict_in(rows, codecs + ["lowrank_h3_rn_s8"])  # a serving variant may be chosen too
    assert whole_run.chosen_text("channel_b_h4", True) == "Chosen by the rule: channel_b_h4."
    assert whole_run.chosen_text(None, True) == "Chosen by the rule: none."


def test_the_goal_names_each_figure_that_fails_and_asks_for_the_ledgers_bits_with_the_coder():
    row = _row("x", 1.12, 1.19, 5.0, damage_low=0.004)  # damage up to +0.8%
    check = {"codec": "x", "depth": 8, "flags": ["--tah-entropy-coding"],
             "ledger_bits": {"forward": 3.5, "backward": 3.0, "both": 6.5}}
    fails = whole_run.goal(row, RULE, [check])
    assert fails == ["end-of-run ratio 1.12 [1.07, 1.19]", "damage up to +0.80%", "6.50 bits both ways on the WAN ledger"]
    assert whole_run.goal(row, RULE, [{**check, "flags": []}])[-1].startswith("no real pipeline run with the coder")
    good = _row("x", 1.05, 1.15, 5.0)
    assert whole_run.goal(good, RULE, [{**check, "ledger_bits": {"both": 5.9}}]) == []
    # through the pipeline: the ratio and damage on that evaluation, with the serving bits (no ledger figure)
    assert whole_run.goal(good, RULE, [], "compressed") == []
    assert whole_run.goal(row, RULE, [], "compressed") == fails[:2]


def test_the_page_says_whether_the_rules_choice_meets_the_plans_goal_naming_what_fails():
    rows = [_row("bf16", 1.0, 1.0, 32.0), _row("channel_b_h4", 1.05, 1.19, 10.0)]
    rows[1]["uncompressed"]["goal_fails"] = ["10.20 bits both ways on the WAN ledger"]
    rows[1]["compressed"] = {**rows[1]["compressed"], "goal_fails": []}
    own = whole_run.goal_text(rows, "channel_b_h4", "uncompressed", RULE)
    assert own.startswith("The plan's goal (end-of-run ratio <= 1.10x with its upper end <= 1.20x, damage within "
                          "0.5% of bf16's, <= 6 bits both ways on the WAN ledger of a real pipeline run with the coder)")
    assert own.endswith("`channel_b_h4` does not meet it: 10.20 bits both ways on the WAN ledger.")
    assert whole_run.goal_text(rows, "channel_b_h4", "compressed", RULE).endswith(
        "with its serving bits): `channel_b_h4` meets it.")
    assert whole_run.goal_text(rows, None, "compressed", RULE).endswith("no preset is eligible, so none meets it "
                                                                        "here; bf16 (uncompressed) stays.")
    # until every planned seed of the depth is in, the line says so far, never "stays"
    assert whole_run.goal_text(rows, None, "compressed", RULE, final=False).endswith(
        "with its serving bits): no preset is eligible so far.")
    assert whole_run.goal_text(rows, "channel_b_h4", "uncompressed", RULE, final=False).endswith(
        "`channel_b_h4` does not meet it so far: 10.20 bits both ways on the WAN ledger.")
    assert whole_run.goal_text(rows, "channel_b_h4", "compressed", RULE, final=False).endswith("meets it so far.")


def test_a_pipeline_check_on_the_page_names_the_validations_outside_the_tolerance_and_the_bits_against_the_goal():
    check = {"codec": "lowrank_h3_rn", "depth": 8, "flags": ["--tah-entropy-coding"], "exit": 60, "commit": "0123456789ab",
             "agrees": False, "shape": [128, 1], "ledger_bits": {"forward": 3.47, "backward": 2.533, "both": 6.003},
             "uncompressed": {"iterations": [10, 20], "pipeline": [4.0, 3.9], "emulated": [4.001, 3.905],
                              "max_abs_diff": 0.005, "mean_diff": -0.003},
             "compressed": {"iterations": [10, 20], "pipeline": [4.2, 4.1], "emulated": [4.19, 4.126],
                            "max_abs_diff": 0.026, "mean_diff": -0.008}}
    line = whole_run.pipeline_line(check, 6.0)
    assert "**does not agree** within 0.02" in line and "largest 0.0050 (step 20)" in line
    assert "Evaluated through the codecs: largest 0.0260 (step 20), mean pipeline - emulation -0.0080, outside at " \
           "step(s) 20" in line and line.count("outside at") == 1
    assert "3.47 + 2.53 = 6.003 bits per value (above 6)" in line and "commit 0123456789" in line
    assert "same to 6 digits" not in line  # no iteration recorded where they part
    parted = whole_run.pipeline_line({**check, "parted_at": 4}, 6.0)
    assert "The training losses are the same to 6 digits until iteration 3, apart from iteration 4 on. WAN" in parted
    records = [{"iteration": i, "lm_loss": v} for i, v in ((1, 4.0), (2, 3.9), (3, 3.8))]
    assert whole_run.parted_at(records, records) is None
    assert whole_run.parted_at(records, [*records[:2], {"iteration": 3, "lm_loss": 3.81}]) == 3
    waiting = whole_run.pipeline_line({**check, "agrees": None, "uncompressed": None, "compressed": None}, 6.0)
    assert "its emulated run has not finished: no comparison yet. WAN ledger: 3.47 + 2.53 = 6.003" in waiting


def test_the_ledgers_bits_are_the_wire_bytes_of_the_training_steps_over_the_bf16_bytes():
    records = [{"iteration": i, "lm_loss": 3.0, "fwd_raw_bytes": 1000, "fwd_wire_bytes": 200, "bwd_raw_bytes": 1000,
                "bwd_wire_bytes": 100} for i in (1, 2)] + [{"iteration": 2, "valid_loss": 3.0}]
    assert whole_run.ledger_bits(records) == {"forward": 3.2, "backward": 1.6, "both": pytest.approx(4.8)}
    assert whole_run.ledger_bits([{"iteration": 1, "lm_loss": 3.0}]) is None


# ----- the machinery end to end ----------------------------------------------------------------------------------
@pytest.mark.distributed
def test_a_tiny_plan_runs_its_stages_in_order_and_scores_the_whole_run_with_the_real_pipelines_ledger(tmp_path):
    pytest.importorskip("transformers")
    text = BASE.replace("points = [4, 8, 16]", "points = [4, 8, 12, 16]").replace(
        'codecs = ["bf16", "paper"]', 'codecs = ["bf16", "lowrank_h3_rn"]') + """
[[stages]]
name = "C"
kind = "pipeline"
depths = [2]
codecs = ["lowrank_h3_rn"]
seeds = [1]
exit = 8
flags = ["--tah-entropy-coding"]

[[stages]]
name = "D"
kind = "toy"
codecs = ["bf16", "lowrank_h3_rn"]
seeds = [1]
steps = 12
"""
    path, out, page = _write(tmp_path, text), tmp_path / "out", tmp_path / "docs" / "WHOLE_RUN.md"
    cmd = [sys.executable, "-m", "benchmarks.real_model", "--plan", str(path), "--out", str(out), "--write", str(page)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((page.parent / "data" / "whole_run.json").read_text())
    assert result["planned"] == result["planned_finished"] == 7
    toy = result["toy"][0]  # the toy's loss runs, both evaluations, against bf16's with the same seed
    assert toy["finished"] == toy["planned"] == 2 and toy["points"][-1] == 12 and toy["target"] > 0
    for traffic in runs.TRAFFIC:
        assert set(toy["rows"][0][traffic]["to_target"]) == {"1"} and toy["rows"][0][traffic]["end_gap"]["step"] == 12
    assert {m["commit"] for m in result["finished"].values()} != {None}  # each run names the commit it ran
    row = {r["codec"]: r for r in result["tables"]["2"]}["lowrank_h3_rn"]
    for traffic in runs.TRAFFIC:
        assert sorted(row[traffic]["points"], key=int) == ["4", "8", "12", "16"]
        assert len(row[traffic]["gaps"]) == 8 and row[traffic]["trend"]["verdict"] != "–"
    check = result["pipeline"][0]  # the real pipeline against the emulation at equal steps, and its ledger's bits
    assert check["agrees"] and check["exit"] == 8 and check["uncompressed"]["iterations"] == [2, 4, 6, 8]
    assert 0 < check["ledger_bits"]["both"] < 32 and check["flags"] == ["--tah-entropy-coding"]
    lr = [r["lr"] for r in map(json.loads, (out / "train_bf16_s1.jsonl").read_text().splitlines()) if "lr" in r]
    assert lr[-1] < lr[len(lr) // 2] < max(lr)  # the cosine decay after the warm-up
    text = page.read_text()
    assert "Runs finished: 7 of 7 planned" in text and "## The toy, pretraining from scratch (stage D)" in text and "| `lowrank_h3_rn` | 2 of 2 |" in text
    assert "- Stage A (emulated): 4 of 4 runs finished (commit " in text and "Loss gap at equal steps" in text
    assert (page.parent / "data" / "whole_run.png").stat().st_size > 0
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)  # nothing runs again
    assert again.returncode == 0 and "start " not in again.stdout + again.stderr
