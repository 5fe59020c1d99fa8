"""The GPT-2-small GPU run: the commands it starts and its table, on synthetic logs (no GPU needed)."""

import json

import pytest

from benchmarks.gpu_gpt2_small import __main__ as gpu


def test_commands_share_model_seed_and_time_budget(tmp_path):
    seen = {}
    for codec in gpu.CODECS:
        env, argv = gpu.command(codec, 8, 50, tmp_path)
        assert argv[:3] == ["bash", "scripts/pretrain_gpt.sh", "2"]
        assert argv[argv.index("--exit-duration-in-mins") + 1] == "8"
        assert env["LAYERS"] == "12" and env["SHARE_GPUS"] == "1" and env["OUT"] == str(tmp_path / codec)
        seen[codec] = (env.get("CODEC"), env.get("BWD_CODEC"), argv[argv.index("--tah-preset") + 1]
                       if "--tah-preset" in argv else None)
        assert argv[argv.index("--hidden-size") + 1] == "768" and argv[argv.index("--seed") + 1] == "1234"
    assert seen == {"bf16": ("none", "none", None), "paper": (None, None, None), "hadint4": (None, None, "hadint4"),
                    "lowrank": (None, None, "lowrank")}


def _log(path, iters, losses):
    path.parent.mkdir(parents=True)
    with open(path, "w") as f:
        for it in range(1, iters + 1):
            f.write(json.dumps({"iteration": it, "lm_loss": 5.0}) + "\n")
            if it in losses:
                f.write(json.dumps({"iteration": it, "valid_loss": losses[it]}) + "\n")


def test_table_judges_every_run_on_the_iterations_all_reached(tmp_path):
    _log(tmp_path / "runs" / "bf16" / "log.jsonl", 200, {100: 4.0, 150: 3.0, 200: 2.0})
    _log(tmp_path / "runs" / "lowrank" / "log.jsonl", 160, {100: 4.4, 150: 3.3})
    md = gpu.table(tmp_path / "runs", tmp_path / "docs").read_text()
    rows = json.loads((tmp_path / "docs" / "gpu-gpt2-small.json").read_text())
    # Common reach 160: the window is [120, 160], so bf16's 2.0 at 200 does not count.
    assert rows["bf16"]["late_valid_loss"] == 3.0 and rows["lowrank"]["late_valid_loss"] == pytest.approx(3.3)
    assert rows["lowrank"]["gap"] == pytest.approx(0.1) and rows["lowrank"]["iterations"] == 160
    assert "| lowrank | 160 | 3.3000 | +10.00% |" in md


def test_table_needs_the_bf16_run_and_late_evaluations(tmp_path):
    _log(tmp_path / "a" / "lowrank" / "log.jsonl", 10, {10: 3.0})
    with pytest.raises(FileNotFoundError, match="bf16"):
        gpu.table(tmp_path / "a", tmp_path / "docs")
    with pytest.raises(ValueError, match="no evaluation"):
        gpu.late_losses({"bf16": [{"iteration": 40}], "x": [{"iteration": 40, "valid_loss": 1.0}]})
