"""``make demo`` scaled down: both runs (Megatron's loop) learn, the table, PNG and summary exist, and
TAH-Quant sends at most 40% of the bytes of the uncompressed bf16 pipeline (forward and backward together).

The full-size demo (80 iterations of a 4-layer, hidden-128 GPT on Shakespeare, bf16) is `make demo`;
here: 2 layers (1 + 1), hidden 64, 12 iterations on the first plays, in-process link emulation.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from megatron_tah import demo
from megatron_tah.config import DEFAULT_CANDIDATES
from megatron_tah.megatron.cpu_shims import bf16_instructions


@pytest.mark.distributed
def test_scaled_down_demo(tmp_path):
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "megatron_tah.demo", "--out", str(out), "--data-prefix", str(tmp_path / "shk"),
           "--max-docs", "8", "--max-tokens", "30000", "--link", "emulate", "--train-iters", "12",
           "--num-layers", "2", "--first-stage-layers", "1", "--hidden-size", "64", "--num-attention-heads", "2",
           "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--eval-interval", "6",
           "--eval-iters", "2", "--lr", "3e-3", "--rate", "1gbit", "--no-speed-check"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    summary = json.loads((out / "summary.json").read_text())
    checks = summary["checks"]
    assert proc.returncode == demo.exit_status(checks), proc.stderr[-3000:]
    assert checks["bytes_vs_bf16"]["ok"] and checks["both_learn"]["ok"], checks
    assert checks["valid_loss_gap"]["value"] < 0.05, checks  # the 2% limit is for the full-size demo
    rows = summary["rows"]
    assert rows["bf16"]["bytes_vs_bf16"] == pytest.approx(1.0, rel=0.01)  # bf16 messages + 16-byte headers
    assert rows["tah"]["bytes_vs_bf16"] < 0.4
    for name in ("bf16", "tah"):
        assert rows[name]["valid_loss"] < rows[name]["first_loss"] - 0.3
    assert not checks["speedup"]["checked"] and "not compared with the goal" in proc.stdout
    compute = summary["compute"]  # the link-free run measured this machine's compute per iteration
    assert compute["compute_ms_per_iter"] > 0 and "ms of compute per iteration" in proc.stdout
    assert ("has no bf16 instructions" in proc.stdout) == (not bf16_instructions())  # said before it computes
    assert compute["bf16_link_ms_per_iter"] == pytest.approx(rows["bf16"]["link_ms_per_iter"])
    assert "bf16: iteration 10/12, lm loss" in proc.stdout and "ETA" in proc.stdout  # the last log line (every 10)
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "table.md").read_text()
    assert "TAH-Quant" in table and "in-process emulation" in table
    assert "check: TAH-Quant bytes" in proc.stdout and "run 3/3" in proc.stdout
    # The auto row: every link named the codec it chose (a candidate), reported against its goal.
    assert set(rows["auto"]["auto_codecs"]) == {"0->1", "1->0"}, rows["auto"]
    assert set(rows["auto"]["auto_codecs"].values()) <= set(DEFAULT_CANDIDATES)
    assert checks["auto"]["matches"] == "tah" and "measured: auto chose 0->1: " in proc.stdout


def test_demo_falls_back_to_emulation_without_root(monkeypatch, capsys):
    import megatron_tah.netns_link as netns_link

    monkeypatch.setattr(netns_link.os, "geteuid", lambda: 1000)
    assert demo.choose_link("auto") == "emulate"
    assert "in-process emulation" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="need root"):
        demo.choose_link("netns")


# Real Megatron output (docs/benchmarks/nvidia-h100-80gb-hbm3-pretrain-pp1.txt, lines 22-33).
MEGATRON_LOG = """\
Overwriting rerun_state_machine.current_iteration from -1 to 0...
WARNING:megatron.core.rerun_state_machine:Result validation enabled
 [2026-11-23 01:45:17.670548] iteration        1/      30 | consumed samples:           16 | elapsed time per iteration (ms): 4845.3 | learning rate: 1.000000E-04 | global batch size:    16 | lm loss: 1.084639E+01 | loss scale: 1.0 | grad norm: 5.270 | number of skipped iterations:   0 | number of nan iterations:   0 | tah saved MB: 13.2/23.2 |
[Rank 0] (after 1 iterations) memory (MB) | allocated: 342.81 | max allocated: 403.96 | reserved: 502.00 | max reserved: 502.00
 [2026-11-23 01:45:18.640458] iteration        5/      30 | consumed samples:           80 | elapsed time per iteration (ms): 1163.0 | learning rate: 2.963610E-04 | global batch size:    16 | lm loss: 1.052366E+01 | loss scale: 1.0 | grad norm: 2.520 | number of skipped iterations:   0 | number of nan iterations:   0 | tah saved MB: 13.2/23.2 |
[Rank 0] (after 5 iterations) memory (MB) | allocated: 342.81 | max allocated: 503.66 | reserved: 608.00 | max reserved: 608.00
 [2026-11-23 01:45:19.670893] iteration       10/      30 | consumed samples:          160 | elapsed time per iteration (ms): 206.1 | learning rate: 2.576426E-04 | global batch size:    16 | lm loss: 9.841206E+00 | loss scale: 1.0 | grad norm: 2.358 | number of skipped iterations:   0 | number of nan iterations:   0 | tah saved MB: 13.2/23.2 |
 [2026-11-23 01:45:20.701869] iteration       15/      30 | consumed samples:          240 | elapsed time per iteration (ms): 206.2 | learning rate: 1.884425E-04 | global batch size:    16 | lm loss: 9.390675E+00 | loss scale: 1.0 | grad norm: 2.371 | number of skipped iterations:   0 | number of nan iterations:   0 | tah saved MB: 13.2/23.2 |
 validation loss at iteration 15 | lm loss value: 9.244846E+00 | lm loss PPL: 1.035108E+04 | 
 [2026-11-23 01:45:23.168319] iteration       20/      30 | consumed samples:          320 | elapsed time per iteration (ms): 196.2 | learning rate: 1.115292E-04 | global batch size:    16 | lm loss: 9.046272E+00 | loss scale: 1.0 | grad norm: 2.607 | number of skipped iterations:   0 | number of nan iterations:   0 | tah saved MB: 13.2/23.2 |
 [2026-11-23 01:45:24.096940] iteration       25/      30 | consumed samples:          400 | elapsed time per iteration (ms): 185.7 | learning rate: 5.220915E-05 | global batch size:    16 | lm loss: 8.794627E+00 | loss scale: 1.0 | grad norm: 2.392 | number of skipped iterations:   0 | number of nan iterations:   0 | tah saved MB: 13.2/23.2 |
 [2026-11-23 01:45:25.157086] iteration       30/      30 | consumed samples:          480 | elapsed time per iteration (ms): 212.0 | learning rate: 3.000000E-05 | global batch size:    16 | lm loss: 8.686225E+00 | loss scale: 1.0 | grad norm: 2.394 | number of skipped iterations:   0 | number of nan iterations:   0 | tah saved MB: 13.2/23.2 |
"""


def test_progress_is_the_last_iteration_line_of_a_megatron_log():
    assert demo.parse_progress(MEGATRON_LOG) == {"iteration": 30, "total": 30, "ms_per_iter": 212.0,
                                                  "lm_loss": 8.686225}
    head = MEGATRON_LOG[:MEGATRON_LOG.index(" [2026-11-23 01:45:18")]
    assert demo.parse_progress(head) == {"iteration": 1, "total": 30, "ms_per_iter": 4845.3, "lm_loss": 10.84639}
    before = MEGATRON_LOG[:MEGATRON_LOG.index(" [2026-11-23 01:45:17")]
    assert demo.parse_progress(before) is None  # the validation and memory lines are not iteration lines
    cut = MEGATRON_LOG[:MEGATRON_LOG.index("lm loss: 9.046272E+00")]  # a line still being written
    assert demo.parse_progress(cut)["iteration"] == 20 and demo.parse_progress(cut)["lm_loss"] is None


def test_progress_line_estimates_time_left_from_measured_iterations_only():
    """The ETA is Megatron's time per iteration times the iterations left, not the time since the start (which
    holds the start-up); the first line, whose iterations include the first one's set-up, gives none."""
    progress = {"iteration": 20, "total": 80, "ms_per_iter": 812.0, "lm_loss": 7.1234}
    assert demo.progress_line("bf16", progress, 65.0) == "bf16: iteration 20/80, lm loss 7.123, 1m05s elapsed, ETA 0m48s"
    first = {"iteration": 1, "total": 80, "ms_per_iter": 45000.0, "lm_loss": 10.9}
    assert demo.progress_line("bf16", first, 45.0, measured=False) == \
        "bf16: iteration 1/80, lm loss 10.900, 0m45s elapsed, ETA after the next log line"


def test_progress_is_printed_while_a_run_writes_its_log(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo, "PROGRESS_SECONDS", 0.05)
    log = tmp_path / "run.log"
    iteration_lines = [line for line in MEGATRON_LOG.splitlines() if "iteration " in line and "/" in line]

    def run():
        for line in iteration_lines:
            with open(log, "a") as f:
                f.write(line + "\n")
            time.sleep(0.2)
        return 0

    assert demo._with_progress("tah", log, run) == 0
    out = capsys.readouterr().out
    assert "tah: iteration 1/30, lm loss 10.846" in out and "tah: iteration 30/30, lm loss 8.686" in out
    lines = [line for line in out.splitlines() if "] tah: iteration" in line]
    assert lines[0].endswith("ETA after the next log line") and lines[-1].endswith("ETA 0m00s")


def _rows(tah_bytes=0.3, tah_loss=5.0, tah_tokens=98.0, tah_first=9.0):
    row = {"bytes_vs_bf16": 1.0, "valid_loss": 5.0, "tokens_per_s": 100.0, "final_train_loss": 5.0, "first_loss": 9.0,
           "link_ms_per_iter": 400.0}
    return {"bf16": row, "tah": {**row, "bytes_vs_bf16": tah_bytes, "valid_loss": tah_loss, "tokens_per_s": tah_tokens,
                                 "first_loss": tah_first, "link_ms_per_iter": 120.0}}


@pytest.mark.parametrize("rows, status", [
    (_rows(), 0),  # 0.98x on a busy machine: reported, not a failure
    (_rows(tah_tokens=200.0), 0),
    (_rows(tah_bytes=0.41), 1),  # bytes wrong
    (_rows(tah_loss=5.2), 1),  # validation loss 4% worse
    (_rows(tah_first=4.0), 1),  # did not learn
])
def test_exit_status_depends_on_bytes_and_loss_only(rows, status):
    verdict = demo.checks(rows)
    assert demo.exit_status(verdict) == status
    assert verdict["speedup"]["met"] == (rows["tah"]["tokens_per_s"] >= 150.0) and "ok" not in verdict["speedup"]


def test_auto_goal_is_a_compressing_codec_on_a_slow_link_and_none_unlimited():
    rows = _rows()
    rows["auto"] = {**rows["tah"], "tokens_per_s": 97.0, "auto_codecs": {"0->1": "paper", "1->0": "hadint4"}}
    verdict = demo.checks(rows)
    assert verdict["auto"]["met"] and verdict["auto"]["tokens_ratio"] == pytest.approx(97.0 / 98.0)
    assert demo.exit_status(verdict) == 0 and not demo.checks(rows, unlimited=True)["auto"]["met"]
    rows["auto"] = {**rows["bf16"], "auto_codecs": {"0->1": "none", "1->0": "none"}}
    assert demo.checks(rows, unlimited=True)["auto"]["met"] and not demo.checks(rows)["auto"]["met"]


@pytest.mark.parametrize("auto_tokens, met", [(160.0, True), (98.0, True), (93.2, True), (93.0, False),
                                               (50.0, False)])
def test_auto_faster_than_tah_quant_or_at_most_5_percent_slower_meets_its_goal_and_the_line_says_so(auto_tokens, met):
    """TAH-Quant ran 98 tokens/s: auto 1.63x as fast meets the goal, as does 5% slower; 5.1% slower does not."""
    rows = _rows()
    rows["auto"] = {**rows["tah"], "tokens_per_s": auto_tokens, "auto_codecs": {"0->1": "hadint4", "1->0": "paper"}}
    a = demo.checks(rows)["auto"]
    assert a["met"] == met
    line = demo.auto_line(a, unlimited=False)
    assert line.startswith("measured: auto chose 0->1: hadint4, 1->0: paper; its tokens/s over TAH-Quant fwd + "
                           f"6-bit bwd's: {auto_tokens / 98.0:.2f}x (goal: a compressing codec, as fast or at most 5% "
                           "slower: ")
    assert line.endswith(("met" if met else "not met") + "; a measurement, not a check)")
    rows["auto"]["auto_codecs"] = {"0->1": "none", "1->0": "none"}  # fast, but not compressing on a slow link
    assert not demo.checks(rows)["auto"]["met"]


def test_the_plot_has_loss_against_iterations_and_validation_loss_against_wall_clock_seconds(tmp_path, monkeypatch):
    records = [{"iteration": i, "lm_loss": 9.0 - i, "ms": None if i == 1 else 500.0 * (2 if i > 2 else 1),
                **({"valid_loss": 8.0 - i} if i % 2 == 0 else {})} for i in range(1, 5)]
    assert demo.elapsed_seconds(records) == [0.0, 0.5, 1.5, 2.5]  # the first iteration's start-up not counted
    import matplotlib.axes

    drawn = []
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, xs, ys, *a, **k: drawn.append(
        (self.get_xlabel() or None, list(xs), list(ys))))
    demo.plot({"bf16": records, "tah": records}, tmp_path / "loss.png", "title")
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert ([0.5, 2.5], [6.0, 4.0]) in [(xs, ys) for _, xs, ys in drawn]  # validation loss over seconds
    assert ([2, 4], [6.0, 4.0]) in [(xs, ys) for _, xs, ys in drawn]  # and over iterations


def test_compute_bound_statement_from_measured_compute_and_link_time():
    busy = demo.compute_vs_link(1000.0, _rows())  # compute 1000 ms vs 400 / 120 ms of link time
    assert busy["compute_bound"] and busy["expected_speedup"] == pytest.approx([1.0, 1400 / 1120])
    assert "compute-bound" in demo.compute_statement(busy) and "1.00x-1.25x" in demo.compute_statement(busy)
    idle = demo.compute_vs_link(100.0, _rows())
    assert not idle["compute_bound"] and idle["expected_speedup"] == pytest.approx([500 / 220, 400 / 120])
    assert "link-bound" in demo.compute_statement(idle)
