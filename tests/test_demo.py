"""``make demo`` scaled down: both runs (Megatron's loop) learn, the table, PNG and summary exist, and
TAH-Quant sends at most 40% of the bytes of the uncompressed bf16 pipeline (forward and backward together).

The full-size demo (80 iterations of a 4-layer, hidden-128 GPT on Shakespeare, bf16) is `make demo`;
here: 2 layers (1 + 1), hidden 64, 12 iterations on the first plays, in-process link emulation.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_tah import demo


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
    assert proc.returncode == (0 if all(c["ok"] for c in checks.values()) else 1), proc.stderr[-3000:]
    assert checks["bytes_vs_bf16"]["ok"] and checks["both_learn"]["ok"], checks
    assert checks["valid_loss_gap"]["value"] < 0.05, checks  # the 2% limit is for the full-size demo
    rows = summary["rows"]
    assert rows["bf16"]["bytes_vs_bf16"] == pytest.approx(1.0, rel=0.01)  # bf16 messages + 16-byte headers
    assert rows["tah"]["bytes_vs_bf16"] < 0.4
    for name in ("bf16", "tah"):
        assert rows[name]["valid_loss"] < rows[name]["first_loss"] - 0.3
    assert not checks["speedup"]["checked"] and "not checked" in proc.stdout
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "table.md").read_text()
    assert "TAH-Quant" in table and "in-process emulation" in table
    assert "check: TAH-Quant bytes" in proc.stdout and "run 2/2" in proc.stdout


def test_demo_falls_back_to_emulation_without_root(monkeypatch, capsys):
    import megatron_tah.slow_link as slow_link

    monkeypatch.setattr(slow_link.os, "geteuid", lambda: 1000)
    assert demo.choose_link("auto") == "emulate"
    assert "in-process emulation" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="need root"):
        demo.choose_link("netns")
