"""The fault harness (``benchmarks/faults``): its verdicts from a run's facts, its page block, and one
scenario for real (a payload byte flipped in flight with checksums on: stopped naming the link, resumed)."""

from __future__ import annotations

import json

import pytest

from benchmarks.faults import __main__ as faults

RECORDS = [{"iteration": i, "lm_loss": 10.0 - i / 10} for i in range(1, faults.ITERS + 1)]
ERROR_LINE = ("[rank1]: megatron_tah.codecs.base.PayloadChecksumError: link stage 0 -> stage 1, iteration 6: tah: "
              "1 buffer(s) failed the payload checksum")


def _facts(output="", status=0, records=RECORDS, hang=False, wall=60.0):
    return {"wall_s": wall, "status": status, "hang": hang, "injected": True, "output": output, "records": records}


def test_verdicts_from_a_runs_facts():
    reference = _facts(wall=50.0)
    resumed = faults.judge("corrupt", _facts(f"{ERROR_LINE}\n[restart] finished after 2 attempts (1 failed) in 70.0 s; "
                                             "time lost to failures: 10.0 s (redone 4.0 s, waiting 1.0 s, start-up 5.0 s)"),
                           reference)
    assert resumed["outcome"] == "stopped, resumed by the script" and resumed["ok"]
    assert resumed["where"] == "link stage 0 -> stage 1, iteration 6" and resumed["time_lost_s"] == 10.0
    assert resumed["error"] == "PayloadChecksumError" and resumed["losses_equal"] is True
    silent = faults.judge("corrupt-unchecked", _facts(records=[dict(r, lm_loss=r["lm_loss"] + 1e-3) for r in RECORDS]),
                          reference)
    assert silent["outcome"] == "continued" and silent["losses_equal"] is False and not silent["ok"]
    assert faults.judge("frozen", _facts(hang=True, status=None), reference)["outcome"] == "hang"
    slow = [dict(r, ms=100.0) for r in RECORDS]
    held = faults.judge("outage-short", _facts(records=slow[:5] + [dict(slow[5], ms=4100.0)] + slow[6:]),
                        _facts(records=slow))
    assert held["outcome"] == "continued" and held["time_lost_s"] == pytest.approx(4.0) and held["ok"]
    unnamed = faults.judge("frozen", _facts("PeerTimeoutError: stuck\nafter 2 attempts"), reference)
    assert not unnamed["ok"]  # a stop must name its link and iteration
    short = faults.judge("killed", _facts(records=RECORDS[:5], status=1), reference)
    assert short["outcome"] == "failed" and not short["ok"]


def test_the_page_block_is_replaced_between_its_markers(tmp_path):
    page = tmp_path / "RELIABILITY.md"
    page.write_text(f"intro\n{faults.BEGIN}\nold\n{faults.END}\noutro\n")
    reference = faults.judge("reference", _facts(wall=50.0), None)
    row = faults.judge("corrupt", _facts(f"{ERROR_LINE}\nafter 2 attempts; time lost to failures: 10.0 s"),
                       _facts(wall=50.0))
    result = {"date": "2026-11-27", "cpu": "cpu", "cores": 2, "rows": [reference, row]}
    faults.write_page(result, page)
    text = page.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "old" not in text
    assert "| corrupt | one payload byte flipped" in text and "equal, bit for bit" in text and "+10 s" in text
    assert json.loads((tmp_path / "data" / "faults.json").read_text())["rows"][1]["scenario"] == "corrupt"
    (tmp_path / "bare.md").write_text("no markers")
    with pytest.raises(ValueError, match="no <!-- faults:begin -->"):
        faults.write_page(result, tmp_path / "bare.md")


def test_unknown_scenarios_are_named():
    with pytest.raises(ValueError, match="choose from reference, checksum, killed"):
        faults.scenario("flood")


@pytest.mark.distributed
def test_a_flipped_payload_byte_stops_the_run_naming_the_link_and_the_script_resumes_it(tmp_path):
    from megatron_tah.data import prepare

    prefix = tmp_path / "shk"
    prepare("shakespeare", prefix, max_docs=6, max_tokens=20_000)
    facts = faults.run_scenario(faults.scenario("corrupt"), tmp_path / "corrupt", str(prefix), 29790, deadline_s=600)
    row = faults.judge("corrupt", facts, None)
    assert row["injected"] and row["outcome"] == "stopped, resumed by the script", facts["output"][-3000:]
    assert row["where"] == f"link stage 0 -> stage 1, iteration {faults.FAULT_ITERATION}" and row["ok"]
    assert row["iterations"] == faults.ITERS


def test_a_worker_killed_before_any_stage_reports_is_named_by_torchruns_summary():
    output = ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n  rank      : 0 (local_rank: 0)\n"
              "  exitcode  : -15 (pid: 7631)  (SIGTERM)\nRoot Cause (first observed failure):\n[0]:\n"
              "  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 7632)  (SIGKILL)\n"
              "[restart] finished after 2 attempts (1 failed)")
    row = faults.judge("killed", _facts(output), _facts(wall=50.0))
    assert row["ok"] and row["where"] == "rank 1, exit code -9 (SIGKILL)" and row["error"].startswith("torchrun")
