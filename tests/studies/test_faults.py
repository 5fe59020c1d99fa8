"""The fault harness (``benchmarks/faults``): its verdicts from a run's facts, its page block, and one
scenario for real (a payload byte flipped in flight with checksums on: stopped naming the link, resumed)."""

from __future__ import annotations

import json

import pytest

from benchmarks.faults import __main__ as faults

RECORDS = [{"iteration": i, "lm_loss": 10.0 - i / 10} for i in range(1, faults.ITERS + 1)]
ERROR_LINE = ("[rank1]: megatron_tah.codecs.core.errors.PayloadChecksumError: link stage 0 -> stage 1, iteration 6: tah: "
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


def test_the_error_is_the_restart_loops_first_error_not_the_first_traceback():
    """Under load a neighbour's lost connection can reach the output before the error that caused it: the restart
    loop's account (the first error a rank recorded) names the cause."""
    lost = ("[rank0]: megatron_tah.link.peer.PeerLostError: megatron_tah: link stage 0 -> stage 1, iteration 6 (world "
            "rank 0 -> 1): the link failed after 0.1 s waiting for activations")
    cause = ("[restart 00:25:13] first error of attempt 1: PayloadChecksumError on rank 1: link stage 0 -> stage 1, "
             "iteration 6: tah: 1 buffer(s) failed the payload checksum")
    output = f"{lost}\n{ERROR_LINE}\n[restart 00:25:13] attempt 1 failed (exit status 1)\n{cause}\nafter 2 attempts"
    row = faults.judge("corrupt", _facts(output), _facts(wall=50.0))
    assert row["error"] == "PayloadChecksumError" and row["where"] == "link stage 0 -> stage 1, iteration 6"
    assert row["message"].startswith("PayloadChecksumError: link stage 0 -> stage 1") and row["ok"]
    assert faults.judge("corrupt", _facts(output.replace(cause, "")), _facts(wall=50.0))["error"] == "PeerLostError"
    lost_only = ("[restart 00:25:13] first error of attempt 1: PeerLostError on rank 0 (a neighbour's process ended "
                 "without recording an error: killed, or out of memory): megatron_tah: world rank 0, iteration 7: a "
                 "collective between stages failed\nRoot Cause (first observed failure):\n  rank      : 1\n"
                 "  exitcode  : -9 (pid: 7632)  (SIGKILL)\nafter 2 attempts")
    killed = faults.judge("killed", _facts(lost_only), _facts(wall=50.0))
    assert killed["error"] == "PeerLostError" and killed["where"] == "world rank 0, iteration 7" and killed["ok"]


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
    with pytest.raises(ValueError, match="choose from reference, unchecked, killed"):
        faults.scenario("flood")


@pytest.fixture
def busy_cpu():
    """A busy loop beside the test (the machine under load: which rank exits first is then anyone's guess)."""
    import subprocess
    import sys

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield
    busy.kill()
    busy.wait()


@pytest.mark.distributed
def test_a_flipped_payload_byte_stops_the_run_naming_the_link_and_the_script_resumes_it(tmp_path, busy_cpu):
    from megatron_tah.data import prepare

    prefix = tmp_path / "shk"
    prepare("shakespeare", prefix, max_docs=6, max_tokens=20_000)
    facts = faults.run_scenario(faults.scenario("corrupt"), tmp_path / "corrupt", str(prefix), 29790, deadline_s=600)
    row = faults.judge("corrupt", facts, None)
    assert row["injected"] and row["outcome"] == "stopped, resumed by the script", facts["output"][-3000:]
    assert row["error"] == "PayloadChecksumError", facts["output"][-3000:]
    assert row["where"] == f"link stage 0 -> stage 1, iteration {faults.FAULT_ITERATION}" and row["ok"]
    assert "] first error of attempt 1: PayloadChecksumError on rank 1: link stage 0 -> stage 1" in facts["output"]
    assert row["iterations"] == faults.ITERS


def test_a_worker_killed_before_any_stage_reports_is_named_by_torchruns_summary():
    output = ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n  rank      : 0 (local_rank: 0)\n"
              "  exitcode  : -15 (pid: 7631)  (SIGTERM)\nRoot Cause (first observed failure):\n[0]:\n"
              "  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 7632)  (SIGKILL)\n"
              "[restart] finished after 2 attempts (1 failed)")
    row = faults.judge("killed", _facts(output), _facts(wall=50.0))
    assert row["ok"] and row["where"] == "rank 1, exit code -9 (SIGKILL)" and row["error"].startswith("torchrun")


# ----- the rate drop ------------------------------------------------------------------------------------
def _rd_records(codecs_by_iteration, ms_by_iteration):
    """Auto-run records: per iteration each link's codec (fwd, bwd) and its wire bytes (a stand-in size per codec)."""
    size = {"none": 1000, "fp8": 500, "paper": 300, "fixedpoint4": 200, "hadint4": 250}
    return [{"iteration": k, "ms": ms_by_iteration(k), "fwd_wire_bytes": size[f], "bwd_wire_bytes": size[b],
             "auto": {"0->1": {"codec": f}, "1->0": {"codec": b}}}
            for k, (f, b) in enumerate(codecs_by_iteration, start=1)]


def test_the_rate_drop_row_reads_the_lag_the_return_and_tokens_per_second():
    from benchmarks.faults import ratedrop

    first, last = ratedrop.DROP
    codecs = []
    for k in range(1, ratedrop.ITERS + 1):
        fwd = "fixedpoint4" if first + 4 <= k <= last + 6 else "none"  # 4 iterations late, 6 more after the drop
        bwd = "paper" if first + 2 <= k <= last + 3 else "none"
        codecs.append((fwd, bwd))
    slow_ms = lambda k: 500.0 if first <= k <= last else 100.0  # noqa: E731
    fixed = {name: [{"status": 0, "records": [{"iteration": k, "ms": ms + 10 * rep}
                                              for k in range(1, ratedrop.FIXED_ITERS + 1)]} for rep in (-1, 1)]
             for name, ms in (("none", 900.0), ("paper", 520.0), ("fixedpoint4", 505.0))}  # pooled median: ms
    output = ("INFO:megatron_tah.link.auto:megatron_tah: auto forward to rank 1: none's fastest iteration took 761 ms, "
              "fixedpoint4's 332 ms: back to fixedpoint4; none is left out for 4 measurements\n"
              "UserWarning: Falling back to Torch optimizers.")
    auto = {"status": 0, "records": _rd_records(codecs, slow_ms), "output": output}
    row = ratedrop.judge({"auto": [auto, dict(auto, output="")], "fixed": fixed})
    assert row["links"]["0->1"]["lag_down"] == 4 and row["links"]["1->0"]["lag_down"] == 2
    assert row["links"]["0->1"]["lag_up"] == 6 and row["links"]["1->0"]["lag_up"] == 3
    assert row["links"]["0->1"]["before"] == "none" and row["links"]["0->1"]["during"] == "fixedpoint4"
    assert row["best_fixed"] == "fixedpoint4" and row["ratio_steady"] == pytest.approx(505.0 / 500.0)
    assert row["tokens_per_s"]["steady"] == pytest.approx(ratedrop.GLOBAL * ratedrop.SEQ / 0.5)
    assert row["lag_down_intervals"] == pytest.approx(4 / ratedrop.INTERVAL)
    assert len(row["probation"]) == 1 and row["ok"] and row["tokens_goal_met"]  # "Falling back to" is no verdict
    stuck = ratedrop.judge({"auto": [{"status": 0, "records": _rd_records([("none", "none")] * ratedrop.ITERS,
                                                                          slow_ms), "output": ""}], "fixed": fixed})
    assert stuck["links"]["0->1"]["lag_down"] is None and stuck["ratio_steady"] is None and not stuck["ok"]
    assert not stuck["tokens_goal_met"]
    text = ratedrop.markdown(row)
    assert "| stage 0 -> 1 (activations), run 2 | none | fixedpoint4 | none | 4 | 6 |" in text and "1.010x" in text
    assert row["left_out"] == [] and row["best_allowed"] == "fixedpoint4" and row["rate"] == ratedrop.RATE
    # a faster fixed codec that auto's accuracy floor left out: shown, but the goal is judged against what auto
    # may choose
    floor = ("INFO:megatron_tah.link.auto:megatron_tah: auto forward to rank 1: accuracy floor 0.156 (relative "
             "round-trip error); left out: hadint4 0.2, lowrank 0.19\n"
             "INFO:megatron_tah.link.auto:megatron_tah: auto backward to rank 0: accuracy floor 0.05 (relative "
             "round-trip error); left out: nothing\n")
    faster = {**fixed, "hadint4": [{"status": 0, "records": [{"iteration": k, "ms": 400.0}
                                                             for k in range(1, ratedrop.FIXED_ITERS + 1)]}]}
    assert row["pinned"] is None and "its one candidate" not in text  # no pinned runs: nothing said
    # auto pinned to one candidate against that candidate fixed, per round (505 +- 10 ms against 525 and 545 ms)
    pinned = [{"status": 0, "records": [{"iteration": k, "ms": ms} for k in range(1, ratedrop.FIXED_ITERS + 1)]}
              for ms in (525.0, 545.0)]
    priced = ratedrop.judge({"auto": [auto], "fixed": fixed, "pinned": pinned})["pinned"]
    assert priced["codec"] == ratedrop.PINNED and priced["ratio"] == pytest.approx(505.0 / 535.0)
    assert priced["rounds"] == pytest.approx([495.0 / 525.0, 515.0 / 545.0])
    assert priced["tokens_per_s"] == pytest.approx(ratedrop.GLOBAL * ratedrop.SEQ / 0.535)
    assert "its one candidate" in ratedrop.markdown({**row, "pinned": priced}) and "0.944x" in ratedrop.markdown(
        {**row, "pinned": priced})
    floored = ratedrop.judge({"rate": "100mbit", "auto": [dict(auto, output=floor)], "fixed": faster})
    assert floored["best_fixed"] == "hadint4" and floored["ratio_steady"] == pytest.approx(400.0 / 500.0)
    assert floored["left_out"] == ["hadint4", "lowrank"] and floored["best_allowed"] == "fixedpoint4"
    assert floored["ratio_allowed"] == pytest.approx(505.0 / 500.0) and floored["tokens_goal_met"]
    text = ratedrop.markdown(floored)
    assert "left out hadint4, lowrank" in text and "the emulated link at 100mbit" in text


def test_the_rate_drop_fault_changes_the_emulated_rate_of_its_iterations_only(tmp_path):
    """``site/sitecustomize.py``'s ``ratedrop``, loaded as Python loads it at start-up, on a transport's emulator."""
    import os
    import subprocess
    import sys

    probe = ("import types\n"
             "from megatron_tah.config import TahConfig\n"
             "from megatron_tah.link.transport import PipelineTransport\n"
             "from megatron_tah.megatron.stats import Stats\n"
             "from megatron_tah.megatron.places import STREAMS\n"
             "k = [0]\n"
             "t = PipelineTransport(TahConfig(tah_emulate_bandwidth='1gbit'), Stats(STREAMS), iteration=lambda: k[0])\n"
             "rates = []\n"
             "for k[0] in range(6):\n"
             "    t.finish(types.SimpleNamespace(done=True))\n"
             "    rates.append(t.emulation.bandwidth_bps)\n"
             "print(rates)\n")
    env = dict(os.environ, TAH_FAULT="ratedrop:*:2:3:10", RANK="0",
               PYTHONPATH=os.pathsep.join([str(faults.SITE), str(faults.ROOT)]))
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == pytest.approx([1e9, 1e9, 1e8, 1e8, 1e9, 1e9])


def test_the_checksum_cost_is_a_share_of_the_measured_step():
    from benchmarks.faults import checksum_cost

    demo = checksum_cost.demo_setting()
    assert demo["runs"]["paper"]["step_s"] > 0 and demo["shape"] == (64, 4, 128)
    speedrun = checksum_cost.speedrun_setting()
    assert speedrun["stages"] == 8 and set(speedrun["runs"]) <= set(checksum_cost.SPEEDRUN_CODECS)
    tiny = {"name": "tiny", "stages": 4, "shape": (8, 1, 32), "micro_batches": 2,
            "runs": {"paper": {"fields": {"tah_preset": "paper"}, "step_s": 1.0}}}
    two = dict(tiny, stages=2)
    (deep,), (shallow,) = checksum_cost.measure([tiny]), checksum_cost.measure([two])
    assert deep["messages_per_step"] == 8 and shallow["messages_per_step"] == 4
    assert 0 < deep["share"] == pytest.approx(deep["checksum_ms_per_step"] / 1e3) and deep["share"] < 0.01
    assert "| tiny | paper | [8x1x32] bf16 | 8 |" in checksum_cost.table_markdown([deep])


def test_the_page_keeps_the_parts_not_run_this_time(tmp_path):
    page = tmp_path / "RELIABILITY.md"
    page.write_text("a\n<!-- faults:begin -->\nold\n<!-- faults:end -->\nb\n<!-- ratedrop:begin -->\nold rd\n"
                    "<!-- ratedrop:end -->\nc\n<!-- checksum:begin -->\nold cc\n<!-- checksum:end -->\n")
    stamp = {"date": "2026-11-27", "cpu": "cpu", "cores": 2}
    rows = [{"setting": "demo", "codec": "paper", "shape": [64, 4, 128], "messages_per_step": 8,
             "checksum_ms_per_step": 0.4, "step_s": 1.0, "share": 0.0004}]
    faults.write_page({"checksum_cost": {**stamp, "rows": rows}}, page)
    text = page.read_text()
    assert "old\n" in text and "old rd" in text and "old cc" not in text and "| 0.040% |" in text
    reference = faults.judge("reference", _facts(wall=50.0), None)
    faults.write_page({**stamp, "rows": [reference]}, page)
    text = page.read_text()
    assert "old\n" not in text and "| 0.040% |" in text  # the checksum block kept from the JSON
    # rate drops from two rates: the default rate's block first, another rate's after it, each with its command
    from benchmarks.faults import ratedrop

    drop = {"rounds": [], "links": {}, "tokens_per_s": {"steady": None, "whole": None, "fixed": {}}, "best_fixed": None,
            "ratio_steady": None, "ratio_whole": None, "probation": [], "ok": False, "tokens_goal_met": False}
    faults.write_page({"ratedrop": {**stamp, **drop, "rate": ratedrop.RATE}}, page)
    faults.write_page({"ratedrop@100mbit": {**stamp, **drop, "rate": "100mbit"}}, page)
    text = page.read_text()
    default, other = text.index(f"link at {ratedrop.RATE};"), text.index("link at 100mbit;")
    assert "old rd" not in text and default < other and "--only ratedrop --ratedrop-rate 100mbit --write" in text
