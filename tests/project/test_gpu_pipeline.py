"""scripts/gpu_pipeline.sh's commands (dry run) and gpu_pipeline_table.py on synthetic --tah-log-json runs."""

import json
import os
import pathlib
import re
import subprocess
import sys
import types

import pytest

from megatron_tah.megatron import places, stats
from megatron_tah.megatron.run_log import append_json, iteration_record

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import gpu_pipeline_table as table  # noqa: E402

GPU = "NVIDIA H100 80GB HBM3"
TOKENS = 8 * 1024  # global batch 8 of seq 1024
BF16_MESSAGE = 1024 * 1600 * 2


def _record(iteration, ms, fwd_wire, bwd_wire, codec_ms):
    """A record as logging.iteration_record writes it, from reduced statistics."""
    reduced = stats.Stats(places.STREAMS).collect(reset=True)
    reduced["forward"].update(raw_bytes=8 * BF16_MESSAGE, wire_bytes=fwd_wire, encode_seconds=codec_ms / 2e3)
    reduced["backward"].update(raw_bytes=8 * BF16_MESSAGE, wire_bytes=bwd_wire, decode_seconds=codec_ms / 2e3)
    margs = types.SimpleNamespace(global_batch_size=8, seq_length=1024, consumed_train_samples=8 * iteration)
    return iteration_record(margs, iteration, reduced, {"lm loss": 7.0}, 1e-4, 1.0, False, ms / 1e3)


def _run(root, name, pp, rate, codec, ms, wire_per_message, codec_ms, memory=()):
    run = root / name
    run.mkdir(parents=True)
    (run / "meta.json").write_text(json.dumps({"name": name, "pp": pp, "rate": rate, "codec": codec, "link": "netns",
                                               "gpu": GPU, "layers_per_stage": 4, "micro_batches": 8, "warmup": 2}))
    links = max(pp - 1, 1)
    for it, t in enumerate([50_000.0, 40_000.0, ms, ms + 10, ms - 10], start=1):  # two warm-ups far off
        append_json(str(run / "log.jsonl"), _record(it, t, 8 * links * wire_per_message, 8 * links * wire_per_message,
                                                    codec_ms))
    (run / "stdout.log").write_text("".join(
        f"[Rank {r}] (after 1 iterations) memory (MB) | allocated: 1.0 | max allocated: {mb} | reserved: 2.0\n"
        for r, mb in memory))


@pytest.fixture
def runs(tmp_path):
    _run(tmp_path, "calib_pp1", 1, "", "bf16", 400.0, 0, 0.0)
    _run(tmp_path, "pp2_100mbit_bf16", 2, "100mbit", "bf16", 2600.0, BF16_MESSAGE, 0.0, [(0, 3000.0), (1, 3500.0)])
    _run(tmp_path, "pp2_100mbit_tah", 2, "100mbit", "tah", 1100.0, BF16_MESSAGE // 3.6, 16.0, [(0, 3100.0), (1, 3600.0)])
    _run(tmp_path, "pp2_10gbit_bf16", 2, "10gbit", "bf16", 450.0, BF16_MESSAGE, 0.0)
    _run(tmp_path, "pp2_10gbit_tah", 2, "10gbit", "tah", 470.0, BF16_MESSAGE // 3.6, 16.0)
    return tmp_path


def test_rows_speedup_bound_projection_memory(runs):
    rows, calib = table.build_rows(runs)
    assert calib["ms"] == pytest.approx(400.0) and [r["codec"] for r in rows] == ["bf16", "tah", "bf16", "tah"]
    bf16, tah = rows[0], rows[1]
    assert tah["iterations"] == 3 and tah["ms"] == pytest.approx(1100.0)  # the warm-up iterations are not counted
    assert tah["tokens_per_s"] == pytest.approx(TOKENS / 1.1)
    assert tah["speedup"] == pytest.approx(2600 / 1100)
    assert bf16["link_ms"] == pytest.approx(8 * BF16_MESSAGE * 8 / 1e8 * 1e3)
    assert bf16["wire_mb"] == pytest.approx(2 * 8 * BF16_MESSAGE / 1e6)
    tah_link = 8 * (BF16_MESSAGE // 3.6) * 8 / 1e8 * 1e3
    assert tah["link_ms"] == pytest.approx(tah_link)
    assert tah["codec_ms"] == pytest.approx(16.0)
    # projection: one stage's compute (measured alone) + the stage's codec share + the busiest link
    assert tah["projected_ms"] == pytest.approx(400 + 16 / 2 + tah_link)
    assert tah["bound"] == pytest.approx(bf16["projected_ms"] / tah["projected_ms"])
    assert tah["of_bound"] == pytest.approx(tah["speedup"] / tah["bound"])
    assert tah["projected_tokens_per_s"] == pytest.approx(TOKENS / tah["projected_ms"] * 1e3)
    assert (tah["peak_mb_stage"], tah["peak_mb_total"]) == (3600.0, 6700.0)
    assert rows[3]["peak_mb_stage"] is None  # no memory lines: reported as missing, not zero


def test_markdown_png_and_goals(runs, tmp_path):
    out = tmp_path / "out"
    assert table.main([str(runs), "--out-dir", str(out)]) == 0
    text = (out / "nvidia-h100-80gb-hbm3-pipeline.md").read_text()
    assert GPU in text and "tc in network namespaces" in text and "**400 ms**" in text
    assert "| 2 | 100mbit | TAH-Quant (default) | 7447 | 2.36x |" in text
    assert "TAH-Quant 2.36x over bf16 (misses >= 3.0x)" in text
    assert "PP 2, 10gbit: best codec TAH-Quant (default) at 0.96x (slower than bf16" in text
    saved = json.loads((out / "nvidia-h100-80gb-hbm3-pipeline.json").read_text())
    assert len(saved["rows"]) == 4 and saved["calibration"]["ms"] == pytest.approx(400.0)
    assert (out / "nvidia-h100-80gb-hbm3-pipeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_counted_iteration_is_an_error(tmp_path):
    run = tmp_path / "pp2_1gbit_bf16"
    run.mkdir()
    (run / "meta.json").write_text(json.dumps({"pp": 2, "rate": "1gbit", "codec": "bf16", "warmup": 2, "gpu": GPU}))
    assert table.main([str(tmp_path), "--out-dir", str(tmp_path / "out")]) == 1


def test_dry_run_commands(tmp_path):
    env = dict(os.environ, DRY_RUN="1", PY=sys.executable, PPS="2 4", RATES="100mbit", CODECS="bf16 lowrank",
               RUN_DIR=str(tmp_path / "runs"), OUT_DIR=str(tmp_path / "out"))
    out = subprocess.run(["bash", "scripts/gpu_pipeline.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout
    parts = re.split(r"^== (calib_pp1|pp\w+)\n", out, flags=re.M)  # a run's name, then its command(s)
    blocks = dict(zip(parts[1::2], parts[2::2]))
    calib = blocks["calib_pp1"]
    assert "--nproc_per_node 1" in calib and "--num-layers 4 " in calib and "--pipeline-model-parallel-size 1" in calib
    assert "--tah-forward-codec none --tah-backward-codec none" in calib and "--save " not in calib
    for pp in (2, 4):
        bf16, lowrank = blocks[f"pp{pp}_100mbit_bf16"], blocks[f"pp{pp}_100mbit_lowrank"]
        for cmd in (bf16, lowrank):
            assert f"--pipeline-model-parallel-size {pp}" in cmd and f"--num-layers {4 * pp} " in cmd
            assert "--tah-share-gpus --distributed-backend gloo" in cmd and "--global-batch-size 8" in cmd
            assert ("megatron_tah.netns_link --stages" in cmd) or ("--tah-emulate-bandwidth 100mbit" in cmd)
        assert "--tah-forward-codec none --tah-backward-codec none" in bf16
        assert "--tah-preset lowrank" in lowrank and "--tah-forward-codec tah" in lowrank
    assert json.loads((tmp_path / "runs" / "pp4_100mbit_lowrank" / "meta.json").read_text())["pp"] == 4
