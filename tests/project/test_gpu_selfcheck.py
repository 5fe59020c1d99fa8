"""scripts/gpu_selfcheck.py without a GPU: it imports, its steps are the issue's in order and fit the budget,
the runner's verdicts (pass, fail, time limit, budget) and report files, the judges of the GPU steps on
made-up numbers, and the steps that run on the CPU (the staging loopback over gloo, LAAQ on one layer)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_tah.codecs.core import entropy

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_selfcheck.py"


@pytest.fixture(scope="module")
def selfcheck():
    spec = importlib.util.spec_from_file_location("gpu_selfcheck", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_selfcheck"] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gpu_selfcheck", None)


def test_the_steps_are_the_issues_in_order_and_their_estimates_fit_25_minutes(selfcheck):
    names = [s.name for s in selfcheck.STEPS]
    assert names == ["kernels", "graphs", "sync", "staging", "sanitizer", "share", "interleaved", "auto", "laaq",
                     "entropy"]
    assert set(selfcheck.STEP_FUNCTIONS) == set(names)
    assert sum(s.estimate_s for s in selfcheck.STEPS) <= selfcheck.BUDGET_S == 25 * 60
    assert all(s.estimate_s < s.limit_s for s in selfcheck.STEPS)
    assert [s.name for s in selfcheck.STEPS if s.cpu] == ["staging", "laaq", "entropy"]
    assert dict(selfcheck.step("sanitizer").env) == {"TORCH_CUDA_SANITIZER": "1"}
    assert selfcheck.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_gpu_check_runs_the_self_check_by_default_and_names_every_step(selfcheck):
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    assert "set -euo pipefail" in script and "STEP=${1:-selfcheck}" in script
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")]).returncode == 0
    named = script[script.index("case $STEP in"):script.index("esac")]
    for s in selfcheck.STEPS:
        assert (s.name if s.name != "laaq" else "laaq-layer") in named, s.name


def test_arguments(selfcheck, capsys):
    assert selfcheck.parse_args([]).steps == [s.name for s in selfcheck.STEPS]
    assert selfcheck.parse_args(["--device", "cpu"]).steps == ["staging", "laaq", "entropy"]
    assert selfcheck.parse_args(["--steps", "laaq, sync"]).steps == ["laaq", "sync"]
    with pytest.raises(ValueError, match="unknown step 'nope'.*kernels"):
        selfcheck.parse_args(["--steps", "nope"])
    with pytest.raises(SystemExit):
        selfcheck.parse_args(["--device", "cpu", "--steps", "sync"])
    assert "runs only staging, laaq, entropy; not sync" in capsys.readouterr().err
    assert selfcheck.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "share" in out and "total ~20.0 min estimated, budget 25 min" in out


def _launch_writing(verdicts, calls, now):
    """A fake ``launch_step`` taking 200 s: writes the verdict given for the step (or times out / fails without one)."""
    def launch(command, env, timeout):
        name = command[command.index("--run-step") + 1]
        calls.append((name, timeout, env.get("TORCH_CUDA_SANITIZER")))
        now[0] += 200.0
        verdict = verdicts[name]
        if verdict == "timeout":
            return None, "stuck"
        if verdict == "crash":
            return 1, "a\nb\nTraceback: boom"
        result = Path(command[command.index("--result") + 1])
        result.write_text(json.dumps({"name": name, "passed": verdict, "detail": "made up", "seconds": 0.0}))
        return 0, "ok"

    return launch


def test_the_runner_gives_each_step_its_limit_and_stops_at_the_budget(selfcheck, tmp_path, capsys):
    now, calls = [0.0], []
    verdicts = {"sync": True, "staging": "timeout", "sanitizer": "crash", "share": False, "laaq": True}
    results = selfcheck.run_steps(["sync", "staging", "sanitizer", "share", "laaq", "auto"], tmp_path, "cuda", 1000.0,
                                  files=tmp_path / "logs", clock=lambda: now[0],
                                  launch=_launch_writing(verdicts, calls, now))
    assert [(r.name, r.passed) for r in results] == [("sync", True), ("staging", False), ("sanitizer", False),
                                                      ("share", False), ("laaq", True), ("auto", False)]
    assert [(name, limit) for name, limit, _ in calls] == [("sync", 180), ("staging", 150), ("sanitizer", 240),
                                                          ("share", 400), ("laaq", 180)]  # share: what was left
    assert calls[2][2] == "1" and calls[0][2] is None  # the sanitizer's environment, for its step only
    assert "timed out after 150 s" in results[1].detail and results[1].seconds == 200
    assert results[2].detail == "exit 1 without a verdict: a | b | Traceback: boom"
    assert results[5].detail == "not run: 0 s of the 1000 s budget left, estimate 150 s"
    assert (tmp_path / "logs" / "staging.log").read_text() == "stuck"
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "PASS sync (200 s): made up" and printed[1].startswith("FAIL staging") and len(printed) == 6


def test_a_step_that_runs_past_its_limit_is_stopped_with_its_children(selfcheck, tmp_path):
    marker = tmp_path / "child-alive"
    grandchild = tmp_path / "grandchild.py"
    grandchild.write_text(f"import pathlib, time\ntime.sleep(3)\npathlib.Path({str(marker)!r}).write_text('x')\n")
    child = tmp_path / "child.py"
    child.write_text(f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, {str(grandchild)!r}])\n"
                     "time.sleep(60)\n")
    status, _ = selfcheck.launch_step([sys.executable, str(child)], {}, 1.0)
    assert status is None
    import time

    time.sleep(4)
    assert not marker.exists()  # the grandchild was stopped too
    assert selfcheck.launch_step([sys.executable, "-c", "print('hi')"], {}, 30) == (0, "hi\n")


def test_the_report_files_name_the_gpu_and_say_pass_or_fail(selfcheck, tmp_path):
    results = [selfcheck.Result("sync", True, "18/18 calls without a sync", 12.0),
               selfcheck.Result("share", False, "pp4: loss differs | badly", 250.0)]
    json_path, md_path = selfcheck.write_report(results, tmp_path, "NVIDIA H100 80GB HBM3", {"date": "2026-11-25"})
    assert json_path.name == "nvidia-h100-80gb-hbm3-selfcheck.json" and md_path.suffix == ".md"
    record = json.loads(json_path.read_text())
    assert record["passed"] is False and [s["name"] for s in record["steps"]] == ["sync", "share"]
    assert record["steps"][0]["estimate_s"] == 90
    md = md_path.read_text()
    assert "| sync | PASS | 12 | 90 | 18/18 calls without a sync |" in md
    assert "| share | FAIL | 250 | 240 | pp4: loss differs \\| badly |" in md


def test_the_judges_of_the_gpu_steps(selfcheck):
    ok, detail = selfcheck.compare_losses([10.8, 10.5, 10.1],
                                          {"pp4": [10.8, 10.51, 10.1], "pp2xdp2": [10.8, 10.5, 10.1]})
    assert ok and "largest gap 0.01" in detail
    ok, detail = selfcheck.compare_losses([10.8, 10.5], {"pp4": [10.8, 10.6], "pp2xdp2": [10.8]})
    assert not ok and "pp4: loss differs from the reference by up to 0.1" in detail and "pp2xdp2: 1 iterations" in detail
    assert selfcheck.losses([{"iteration": 1, "lm_loss": 3.0}, {"iteration": 2, "valid_loss": 2.0}]) == [3.0]
    record = {"auto": {"0->1": {"codec": "fp8", "rate_bps": 1.9e8}, "1->0": {"codec": "none", "rate_bps": 2.1e8}}}
    assert selfcheck.check_auto_rates(record, 2e8)[0]
    ok, detail = selfcheck.check_auto_rates({"auto": {"0->1": {"codec": "none", "rate_bps": 5e9}}}, 2e8)
    assert not ok and "0->1: 5000000000.0 bit/s outside" in detail
    assert selfcheck.check_auto_rates({}, 2e8) == (False, "no auto record in the log")
    sizes = {"seq": 2048, "batch": 2}
    act = {"type": "Tensor", "dtype": "bfloat16", "shape": [2048, 2, 1024], "packed": True, "kept_because": ""}
    stats = {"type": "Tensor", "dtype": "float32", "shape": [2048, 2, 1], "packed": True, "kept_because": ""}
    table = dict(act, shape=[2048, 1, 1, 64])
    want, close, far = [torch.ones(4)], [torch.ones(4) * 1.1], [torch.ones(4) * 3]
    assert selfcheck.judge_laaq([act], want, close, sizes)[0]
    for bad_log, grads in (([act, stats], close), ([act, table], close), ([act], far), ([], close), ([act], want)):
        assert not selfcheck.judge_laaq(bad_log, want, grads, sizes)[0]


def test_training_runs_use_the_small_model_and_share_the_gpu(selfcheck, tmp_path):
    command = selfcheck.training_command(2, 4, *selfcheck.SHARED, "--num-layers-per-virtual-pipeline-stage", "1")
    assert command[:3] == ["bash", str(ROOT / "scripts" / "pretrain_gpt.sh"), "2"]
    joined = " ".join(command)
    assert "--hidden-dropout 0" in joined and "--tah-share-gpus --distributed-backend gloo" in joined
    env = selfcheck.training_env(4, tmp_path, 29700, 6, "auto", "auto", RATE="200mbit", LINK="emulate")
    assert (env["GPUS_PER_NODE"], env["DEVICE"], env["SAVE"], env["RATE"], env["MASTER_PORT"]) == (
        "4", "gpu", "none", "200mbit", "29700")
    dry = subprocess.run(command, env={**env, "DRY_RUN": "1"}, capture_output=True, text=True, cwd=ROOT)
    assert dry.returncode == 0, dry.stderr
    assert "--nproc_per_node 4" in dry.stdout and "--pipeline-model-parallel-size 2" in dry.stdout
    assert "--tah-emulate-bandwidth 200mbit" in dry.stdout and "--hidden-size 512" in dry.stdout
    if importlib.util.find_spec("scaled_masked_softmax_cuda") is None:  # Megatron's fused softmax needs it in bf16
        assert "--no-masked-softmax-fusion" in dry.stdout


@pytest.mark.distributed
def test_the_cpu_steps_pass_end_to_end(tmp_path):
    """``--device cpu``: the staging loopback (2 processes, gloo), LAAQ on one megatron-core layer and the
    lossless coder at a small message."""
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads((tmp_path / "cpu-selfcheck.json").read_text())
    assert record["passed"] and [s["name"] for s in record["steps"]] == ["staging", "laaq", "entropy"]
    assert "bytes equal, buffers and memory constant" in record["steps"][0]["detail"]
    saved = json.loads((tmp_path / "cpu-selfcheck" / "laaq" / "saved-tensors.json").read_text())
    assert any(e["packed"] for e in saved) and any(e["kept_because"] == "attention's own" for e in saved)
    assert not any(e["packed"] and e["shape"][-1] == 1 for e in saved)
    coded = json.loads((tmp_path / "cpu-selfcheck" / "entropy" / "entropy.json").read_text())
    assert [(r["preset"], r["direction"], r["coder"]) for r in coded] == [
        (p, d, c) for p in ("lowrank", "channel_h4") for d in ("forward", "backward") for c in entropy.CODERS]
    assert all(r["exact"] and r["coded_nbytes"] < r["wire_nbytes"] and r["decode_ms"] > 0 for r in coded)
    assert "64x2x128: lowrank forward zstd:" in record["steps"][2]["detail"]


def test_the_kernel_step_runs_every_kernel_test_file(selfcheck):
    """A new codec's kernel tests must not be left out of the compiled run on a GPU."""
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests" / "kernels").glob("test_*.py")}
    assert files and files <= set(selfcheck.KERNEL_TESTS)


def test_pp4_on_a_shared_gpu_must_train(selfcheck):
    assert selfcheck.judge_pp4([10.9, 10.9, 9.8, 9.6, 9.57, 9.54], 6)[0]
    for bad in ([10.9, 9.8], [10.9, float("nan"), 9.8, 9.6, 9.5, 9.4], [9.5, 9.6, 9.7, 9.8, 9.9, 10.0]):
        assert not selfcheck.judge_pp4(bad, 6)[0]
