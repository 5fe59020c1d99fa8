"""``benchmarks.real_model.coder_cost``: the lossless coder's cost in the real pipeline, from the runs' logs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.common.pages import replace_block
from benchmarks.real_model import coder_cost, runs

REPO = Path(__file__).resolve().parents[2]


def _record(iteration: int, codec_ms: float, ms: float | None, fwd: tuple[int, int], bwd: tuple[int, int]) -> dict:
    stream = lambda raw, wire: {"raw_bytes": raw, "wire_bytes": wire}  # noqa: E731
    return {"iteration": iteration, "lm_loss": 3.0, "codec_ms": codec_ms, "ms": ms,
            "tah": {"forward": stream(*fwd), "backward": stream(*bwd)},
            "wan": {"pipeline": {"codec_bytes": fwd[1] + bwd[1]}}}


DATA = {"train": "t", "valid": "v", "damage": "d"}


@pytest.fixture
def model_dir(tmp_path):
    """A folder with the model flags an import writes (the runs' commands read them; nothing is loaded)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "megatron_flags.txt").write_text("--num-layers 8 --hidden-size 64 --num-attention-heads 4")
    return folder


def test_the_runs_alternate_with_and_without_the_coder_and_differ_only_in_its_flag(model_dir):
    todo = coder_cost.plan("lowrank_h3_rn", 1234, 8, 12, 2, model_dir, DATA, runs.SIZES["long"])
    assert [r.info["coded"] for r in todo] == [True, False, False, True]
    assert len({r.name for r in todo}) == 4 and all(r.iterations() == 12 and r.pipeline == 8 for r in todo)
    coded, plain = todo[0].flags, todo[1].flags
    assert [f for f in coded if f != coder_cost.CODER_FLAG] == plain and coder_cost.CODER_FLAG in coded


def test_the_summary_leaves_out_start_up_and_the_wall_time_of_an_iteration_after_an_evaluation():
    # raw bf16 1000 bytes each way (500 values); forward 250 wire bytes = 4 bits, backward 125 = 2 bits
    records = [_record(i, 1000.0 if i <= 2 else 10.0 * i, 50.0, (1000, 250), (1000, 125)) for i in range(1, 7)]
    records[3]["valid_loss"] = 3.1  # iteration 4 validated: iteration 5's wall time holds the evaluation
    records[4]["ms"] = 9999.0
    s = coder_cost.summary(records)
    assert s["iterations"] == 4 and s["codec_ms"] == pytest.approx(45.0)  # iterations 3-6: 30, 40, 50, 60
    assert s["ms"] == pytest.approx(50.0)
    assert s["forward_bits"] == pytest.approx(4.0) and s["backward_bits"] == pytest.approx(2.0)
    assert s["ledger_bits"] == pytest.approx(6.0)  # both ways: both directions' wire bytes over one's 500 values


def test_the_ratio_is_of_the_medians_with_and_without_the_coder_and_the_page_says_whether_it_meets_the_goal(
        tmp_path, model_dir):
    todo = coder_cost.plan("lowrank_h3_rn", 1234, 2, 6, 1, model_dir, DATA, runs.SIZES["long"])
    for run, codec_ms, wire in zip(todo, (180.0, 100.0), (200, 250)):
        (tmp_path / f"{run.name}.jsonl").write_text("\n".join(
            json.dumps(_record(i, codec_ms, 40.0, (1000, wire), (1000, 125))) for i in range(1, 7)))
    metas = {r.name: {"load_before": 2.0} for r in todo}
    result = coder_cost.score(todo, tmp_path, metas)
    assert result["ratio"] == pytest.approx(1.8) and result["depth"] == 2 and result["steps"] == 6
    assert result["bits"]["forward_bits"] == {"coded": pytest.approx(3.2), "plain": pytest.approx(4.0)}
    text = coder_cost.table(result)
    assert "**1.80x**" in text and "misses the goal of 1.5x" in text and text.count("\n| coded_") == 1
    assert "moved their codec times" not in text  # one run of each kind, a ratio above 1: no caveat
    noisy = {**result, "ratio": 0.85}
    assert "moved their codec times more than the coder did" in coder_cost.table(noisy)
    page = (REPO / "docs" / "CODECS.md").read_text()
    assert text in replace_block(page, "coder_cost", text)  # the page has the block the command writes


def test_too_few_steps_are_refused_before_anything_runs(capsys):
    with pytest.raises(SystemExit):
        coder_cost.main(["--steps", "3", "--out", "/nonexistent"])
    assert "--steps must exceed 3" in capsys.readouterr().err
