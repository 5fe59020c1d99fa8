"""The restart loop (``python -m megatron_tah.restart``, run by ``scripts/pretrain_gpt.sh``): a failed run starts
again from the latest checkpoint it wrote, a bounded number of times, and says what the failures cost.

With a fake trainer (a Python script that records its arguments, writes Megatron's checkpoint tracker and a log
record, and exits as told), then for real: ``scripts/pretrain_gpt.sh`` at PP=2 with one stage killed mid-run
resumes by itself and ends with the uninterrupted run's losses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.faults.__main__ import stage_pid
from megatron_tah import restart
from tests.helpers.rank_entry import alive

REPO = Path(__file__).resolve().parents[1]
FAKE_TRAINER = """
import json, os, sys, time
from megatron_tah.megatron import failures
plan_file, calls_file, save, log = sys.argv[1:5]
with open(calls_file, "a") as f:
    f.write(json.dumps(sys.argv[5:]) + "\\n")
attempt = sum(1 for _ in open(calls_file))
status, checkpoint, records, *errors = json.load(open(plan_file))[attempt - 1]
for rank, name, message, secondary in (errors[0] if errors else []):  # its ranks' errors, in the order they came
    failures.record(type(name, (RuntimeError,), {})(message), rank, secondary=secondary)
    time.sleep(0.05)
for _ in range(records):
    with open(log, "a") as f:
        f.write('{"iteration": 1}\\n')
if checkpoint is not None:
    os.makedirs(save, exist_ok=True)
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(checkpoint))
time.sleep(1.2)  # (the supervisor polls the log twice a second)
sys.exit(status)
"""


def _fake(tmp_path: Path, plan: list, *flags: str, restarts: int = 3, log: bool = True):
    """Supervise the fake trainer (``plan``: per attempt, [exit status, checkpoint iteration or None, records,
    optionally its ranks' errors: [rank, class name, message, secondary]]); returns (exit status, the trainer's
    arguments per attempt, the supervisor's output)."""
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    (tmp_path / "trainer.py").write_text(FAKE_TRAINER)
    save, calls, log_json = tmp_path / "ckpt", tmp_path / "calls.jsonl", tmp_path / "log.jsonl"
    command = [sys.executable, str(tmp_path / "trainer.py"), str(tmp_path / "plan.json"), str(calls), str(save),
               str(log_json), "--save", str(save), *flags]
    argv = [sys.executable, "-m", "megatron_tah.restart", "--save", str(save), "--restarts", str(restarts),
            "--delay-s", "0.2", *(["--log-json", str(log_json)] if log else []), "--", *command]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    attempts = [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
    return result.returncode, attempts, result.stdout + result.stderr


def test_a_failed_run_resumes_from_its_own_checkpoint_in_place_of_its_load_and_finetune(tmp_path):
    status, attempts, out = _fake(tmp_path, [[1, 20, 3], [0, 40, 2]], "--load", "pretrained", "--finetune", "--lr", "1")
    assert status == 0 and len(attempts) == 2, out
    save = str(tmp_path / "ckpt")
    assert attempts[0] == ["--save", save, "--load", "pretrained", "--finetune", "--lr", "1"]
    assert attempts[1] == ["--save", save, "--lr", "1", "--load", save]  # the run's own checkpoint, in full
    assert "attempt 1 failed (exit status 1)" in out and f"the next attempt resumes from iteration 20 in {save}" in out
    assert "attempt 2 logged its first iteration" in out
    assert "finished after 2 attempts (1 failed)" in out and "time lost to failures: " in out
    assert "redone" in out and "waiting 0.2 s" in out and "start-up" in out


def test_without_a_checkpoint_of_its_own_the_command_runs_again_as_given(tmp_path):
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / restart.TRACKER).write_text("200")  # an earlier run's, in the same directory
    os.utime(save / restart.TRACKER, (time.time() - 3600, time.time() - 3600))
    status, attempts, out = _fake(tmp_path, [[1, None, 1], [0, None, 1]], "--lr", "1")
    assert status == 0 and attempts[1] == attempts[0] == ["--save", str(save), "--lr", "1"], out
    assert "no checkpoint of this run" in out


def test_a_failure_names_the_error_it_stopped_on_not_a_neighbours_lost_connection(tmp_path):
    lost = "megatron_tah: link stage 0 -> stage 1, iteration 6 (world rank 0 -> 1): the link failed"
    checksum = "link stage 0 -> stage 1, iteration 6: tah: 1 buffer(s) failed the payload checksum"
    first = [[0, "PeerLostError", lost, True], [1, "PayloadChecksumError", checksum, False]]  # the lost one first
    status, attempts, out = _fake(tmp_path, [[1, 4, 1, first], [1, 8, 1, [[1, "PeerLostError", lost, True]]],
                                             [1, 8, 1], [0, 8, 1]])
    assert status == 0 and len(attempts) == 4, out
    assert f"first error of attempt 1: PayloadChecksumError on rank 1: {checksum}\n" in out
    assert "first error of attempt 2: PeerLostError on rank 1 (a neighbour's process ended without recording" in out
    assert "attempt 3 failed (exit status 1)" in out and "first error of attempt 3" not in out  # a folder per attempt
    assert "PeerLostError on rank 0" not in out


def test_restarts_are_bounded_and_the_last_status_is_returned(tmp_path):
    status, attempts, out = _fake(tmp_path, [[1, 10, 1], [1, 10, 1], [3, 10, 1]], restarts=2)
    assert status == 3 and len(attempts) == 3, out
    assert "not restarting (2 restart(s) used)" in out and "gave up after 3 attempts (3 failed)" in out


@pytest.mark.parametrize("plan, reason", [([[2, None, 0]], "a usage error"),
                                          ([[1, None, 0], [1, None, 0], [0, None, 0]], "two attempts in a row")])
def test_a_failure_that_is_not_passing_is_not_restarted(tmp_path, plan, reason):
    status, attempts, out = _fake(tmp_path, plan)
    assert status != 0 and len(attempts) == min(len(plan), 2) and f"not restarting ({reason}" in out, out


def test_an_attempt_whose_launcher_ended_leaves_none_of_its_workers_behind():
    """The restart loop stops an attempt's whole process group (its own session), also when the launcher itself
    has already exited and a worker of its is still running (``netns_link.stop_process``)."""
    from megatron_tah.netns_link import stop_process

    launcher = subprocess.Popen(["bash", "-c", "sleep 300 & echo $!"], start_new_session=True,
                                stdout=subprocess.PIPE, text=True)
    worker = int(launcher.stdout.readline())
    launcher.wait(timeout=30)
    assert alive(worker)  # the launcher is gone, its worker is not
    stop_process(launcher)
    deadline = time.monotonic() + 10
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(worker)


ORPHAN = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'tah_orphan = 1; import time; time.sleep(600)'], " \
         "start_new_session=True)"


def test_a_process_an_attempt_leaves_running_in_a_session_of_its_own_is_stopped_and_named(tmp_path):
    """As torchrun's ranks each lead a session, a killed rank's own children (Megatron's checkpoint-writer
    manager) leave COMMAND's process group: the supervisor adopts them and stops them with their attempt."""
    result = subprocess.run([sys.executable, "-m", "megatron_tah.restart", "--save", str(tmp_path), "--restarts", "0",
                             "--", sys.executable, "-c", ORPHAN], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "stopped 1 process(es) attempt 1 left running: " in result.stdout and "tah_orphan" in result.stdout, \
        result.stdout
    assert not [line for line in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
                .splitlines() if "tah_orphan" in line and "ps -eo" not in line]


def test_the_command_line_and_resume_command():
    assert restart.resume_command(["a", "--load=x", "--finetune", "--load", "y", "--save", "s"], "s") == \
        ["a", "--save", "s", "--load", "s"]
    result = subprocess.run([sys.executable, "-m", "megatron_tah.restart", "--save", "s"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.startswith("error: no command given")


def test_the_scripts_run_under_the_restart_loop_unless_told_not_to():
    env = dict(os.environ, DRY_RUN="1", PYTHON=sys.executable)
    for extra, wrapped in (({}, True), ({"RESTARTS": "0"}, False), ({"SAVE": "none"}, False)):
        out = subprocess.run(["bash", "scripts/pretrain_gpt.sh", "2"], cwd=REPO, env={**env, **extra},
                             capture_output=True, text=True, check=True).stdout.strip()
        assert ("-m megatron_tah.restart --restarts 3" in out) is wrapped, (extra, out[:300])
        if wrapped:
            assert "--save runs/pretrain_pp2/ckpt --log-json runs/pretrain_pp2/log.jsonl -- " in out


# ----- for real: a stage killed mid-run, resumed by the script ------------------------------------------
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--eval-interval", "1000", "--log-interval", "1", "--tah-stochastic-rounding"]


_stage_pid = stage_pid  # the fault harness's: the training process of a pipeline rank of a run


def _script(corpus: str, out: Path, port: int, flags=(), **env) -> tuple[subprocess.Popen, Path]:
    """The script's run writing to ``out``, and the file its output goes to (a file, not a pipe: a pipe nobody
    reads while the test watches the run fills up and blocks the trainer)."""
    full = dict(os.environ, PYTHON=sys.executable, DEVICE="cpu", OUT=str(out), DATA_PREFIX=corpus, TRAIN_ITERS="10",
                SAVE_INTERVAL="4", RESTART_DELAY="1", MASTER_PORT=str(port), RATE="", LR="2e-3", **env)
    output = out.parent / f"{out.name}.out"
    with open(output, "w") as sink:
        proc = subprocess.Popen(["bash", "scripts/pretrain_gpt.sh", "2", *TINY, *flags], cwd=REPO, env=full, text=True,
                                stdout=sink, stderr=subprocess.STDOUT)
    return proc, output


# Entropy-coded messages with the trailer on (the inbound wire's send stamp) and the tied embedding's gradient
# through its codec: every part of a message, and the embedding exchange, cut when the stage is killed.
VARIANTS = {"plain": ((), {}, 29531),
            "entropy-trailer-embedding": (("--tah-entropy-coding", "--tah-emulate-bandwidth", "1gbit",
                                           "--tah-emulate-wire", "inbound"), {"EMBEDDINGS": "codec"}, 29541)}


@pytest.mark.distributed
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_killed_stage_is_restarted_by_the_script_and_ends_with_the_uninterrupted_losses(corpus, tmp_path, variant):
    from megatron_tah.megatron.run_log import read_records

    flags, env, port = VARIANTS[variant]
    plain, plain_output = _script(corpus, tmp_path / "plain", port, flags, **env)
    plain.wait(timeout=900)
    assert plain.returncode == 0, plain_output.read_text()[-3000:]
    expected = read_records(tmp_path / "plain" / "log.jsonl")
    assert [r["iteration"] for r in expected] == list(range(1, 11))

    out = tmp_path / "killed"
    run, run_output = _script(corpus, out, port + 2, flags, **env)
    deadline, killed = time.monotonic() + 900, None
    try:
        while killed is None and time.monotonic() < deadline and run.poll() is None:
            log = out / "log.jsonl"
            done = len(log.read_text().splitlines()) if log.exists() else 0
            if done >= 6 and (out / "ckpt" / restart.TRACKER).exists():  # past the checkpoint of iteration 4
                killed = _stage_pid(out, 1)
                if killed is not None:
                    os.kill(killed, signal.SIGKILL)
            time.sleep(0.2)
        run.wait(timeout=900)
    finally:
        if run.poll() is None:  # the supervisor stops its command's processes on SIGTERM
            run.terminate()
            run.wait(timeout=60)
    output = run_output.read_text()
    assert killed is not None and run.returncode == 0, output[-4000:]
    assert "attempt 1 failed" in output and "the next attempt resumes from iteration 4" in output, output[-4000:]
    assert "finished after 2 attempts (1 failed)" in output and "time lost to failures: " in output
    resumed = read_records(out / "log.jsonl")
    assert [r["iteration"] for r in resumed] == list(range(1, 11))
    assert [r["lm_loss"] for r in resumed] == [r["lm_loss"] for r in expected]  # bit for bit
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in expected]
