"""benchmarks.auto_seeds: the same-seed gap of auto to TAH-Quant and its table (no training here)."""

import json

import pytest

from benchmarks.auto_seeds import __main__ as auto_seeds


def _rows(tah, auto, codecs=None):
    return {"tah": {"valid_loss": tah}, "auto": {"valid_loss": auto, "auto_codecs": codecs or {"0->1": "hadint4"}}}


def test_gap_is_relative_to_tah_quant_and_negative_when_auto_is_lower():
    assert auto_seeds.gap(_rows(6.0, 5.94)) == pytest.approx(-0.01)
    assert auto_seeds.gap(_rows(6.0, 6.06)) == pytest.approx(0.01)


def test_table_lists_every_seed_and_the_mean_with_its_interval(tmp_path):
    per_seed = {1234: _rows(6.0, 6.06), 1235: _rows(6.0, 5.94), 1236: _rows(5.0, 4.95, {"0->1": "hadint4", "1->0": "paper"})}
    text = auto_seeds.markdown(per_seed, "1mbit")
    assert "| 1234 | 6.0000 | 6.0600 | +1.00% | 0->1 hadint4 |" in text
    assert "| 1236 | 5.0000 | 4.9500 | -1.00% | 0->1 hadint4, 1->0 paper |" in text
    # mean of +1, -1, -1 % = -0.33%; t(2) = 4.303, sd 1.1547% -> half width 2.87%
    assert "Mean gap over 3 seeds: **-0.33%**, 95% interval -3.20% to +2.54%" in text
    assert "with 2 of 3 seeds" in text


def test_demo_rows_stand_for_seed_1234_and_a_missing_run_is_an_error(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"rows": {"bf16": {}, **_rows(6.0, 5.97)}}))
    out = tmp_path / "seeds.md"
    assert auto_seeds.main(["--seeds", "--demo", str(tmp_path), "--write", str(out)]) == 0
    assert "| 1234 | 6.0000 | 5.9700 | -0.50% |" in out.read_text()
    with pytest.raises(SystemExit):  # seed 1234 twice
        auto_seeds.main(["--seeds", "1234", "--demo", str(tmp_path)])
    (tmp_path / "summary.json").write_text(json.dumps({"rows": {"tah": {"valid_loss": 6.0}}}))
    with pytest.raises(SystemExit, match="no auto row"):
        auto_seeds.main(["--seeds", "--demo", str(tmp_path)])
