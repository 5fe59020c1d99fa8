"""``make soak`` (``scripts/soak.py``) tells the truth: 0 on healthy tests whose fork server outlives pytest by a
moment, 1 on a test that hangs, and SIGTERM leaves neither its CPU hog nor the running pytest behind.

Fake ``distributed`` tests in a temporary folder, soaked for real with short bounds."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
TESTS = '''
import multiprocessing, os, time
import pytest


def _child(path):
    with open(path, "w") as f:
        f.write(str(os.getpid()))


@pytest.mark.distributed
def test_a_forkserver_child():  # multiprocessing's fork server (and resource tracker) outlive pytest briefly
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])  # (as the tests' helper preloads megatron-core: a server slower to end)
    p = ctx.Process(target=_child, args=(os.environ["SOAK_MARK"] + ".child",))
    p.start()
    p.join()
    assert p.exitcode == 0


@pytest.mark.distributed
def test_hangs():
    if os.environ.get("SOAK_HANG"):
        with open(os.environ["SOAK_MARK"] + ".hang", "w") as f:
            f.write(str(os.getpid()))
        time.sleep(120)
'''


@pytest.fixture
def fake(tmp_path):
    """The fake tests' file, inside the repository (ignored ``runs/``: pytest names tests from the rootdir) and
    removed after."""
    (REPO / "runs").mkdir(exist_ok=True)  # absent on a fresh clone
    folder = Path(tempfile.mkdtemp(prefix="soak-test-", dir=REPO / "runs"))
    (folder / "test_fake.py").write_text(TESTS)
    try:
        yield folder / "test_fake.py"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _soak(test: Path, tmp_path: Path, *flags: str, hang: bool = False) -> subprocess.Popen:
    env = dict(os.environ, SOAK_MARK=str(tmp_path / "mark"), PYTHONPATH=str(REPO))
    if hang:
        env["SOAK_HANG"] = "1"
    return subprocess.Popen([sys.executable, "scripts/soak.py", "--hogs", "1", "--logs", str(tmp_path / "logs"),
                             *flags, str(test.relative_to(REPO))], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.mark.slow  # a soak of its own beside a CPU hog: `make test-all`
def test_healthy_tests_pass_once_their_fork_server_has_ended(fake, tmp_path):
    proc = _soak(fake, tmp_path, "--runs", "2", "--timeout", "60")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "| 2 | 2 | 0 | 0 | 0 | 0 |" in out, out  # 2 runs, 2 passed, no failure, hang, skip or leftover


@pytest.mark.slow  # a soak of its own beside a CPU hog: `make test-all`
def test_a_resumed_soak_runs_only_the_rounds_its_records_lack_and_counts_them_all(fake, tmp_path):
    records = tmp_path / "soak.json"
    proc = _soak(fake, tmp_path, "--runs", "1", "--timeout", "60", "--json", str(records))
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    first = json.loads(records.read_text())["runs"]
    assert [r["round"] for r in first] == [1, 1] and all(r["commit"] for r in first)
    proc = _soak(fake, tmp_path, "--runs", "2", "--timeout", "60", "--json", str(records), "--resume")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "2 runs recorded" in out and out.count("round 2: passed") == 2 and "round 1: " not in out, out
    assert "| 2 | 2 | 0 | 0 | 0 | 0 |" in out, out  # each test: round 1 recorded, round 2 run now
    assert sorted(r["round"] for r in json.loads(records.read_text())["runs"]) == [1, 1, 2, 2]
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.slow  # a soak of its own beside a CPU hog: `make test-all`
def test_a_hanging_test_makes_the_soak_fail(fake, tmp_path):
    proc = _soak(fake, tmp_path, "--runs", "1", "--timeout", "5", "--settle-s", "2", hang=True)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out
    assert "hang" in out and "test_hangs" in out, out


@pytest.mark.slow  # a soak of its own beside a CPU hog: `make test-all`
def test_sigterm_stops_the_running_pytest_and_the_hog(fake, tmp_path):
    proc = _soak(fake, tmp_path, "--runs", "1", "--timeout", "120", hang=True)
    mark = tmp_path / "mark.hang"
    deadline = time.monotonic() + 120
    while not mark.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert mark.exists(), proc.communicate(timeout=30)[0]
    family = psutil.Process(proc.pid).children(recursive=True)
    assert len(family) >= 2  # the hog, the pytest (and its test)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "stopped by SIGTERM" in out, out
    _, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, [p.cmdline() for p in alive]


@pytest.mark.parametrize("runs", [3])
def test_a_budget_samples_every_test_before_any_runs_twice(runs):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import soak
    finally:
        sys.path.pop(0)
    tests = ["a.py::x", "a.py::y", "b.py::z"]
    assert soak.schedule(tests, runs, budget=True)[:4] == [(1, ["a.py::x"]), (1, ["a.py::y"]), (1, ["b.py::z"]),
                                                           (2, ["a.py::x"])]
    assert soak.schedule(tests, 1, budget=False) == [(1, ["a.py::x", "a.py::y"]), (1, ["b.py::z"])]
    done = {(1, "a.py::x"), (1, "b.py::z"), (2, "a.py::y")}
    assert soak.schedule(tests, 2, budget=False, done=done) == [(1, ["a.py::y"]), (2, ["a.py::x"]), (2, ["b.py::z"])]
    assert soak.schedule(tests, 2, budget=True, done=done)[:2] == [(1, ["a.py::y"]), (2, ["a.py::x"])]


def test_only_the_soaks_own_run_folders_count_as_left_and_are_removed(tmp_path, monkeypatch):
    """A soak beside other tests (``make test-all``'s workers) counts and removes the temporary folders of its own
    pytest process only: another test's running folder is neither counted nor deleted."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import soak
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mine, theirs = tmp_path / "tah_dist_123_a", tmp_path / "tah_dist_1234_b"
    mine.mkdir(), theirs.mkdir()
    assert soak.run_folders(123) == {mine} and soak.run_folders(1234) == {theirs}


def test_a_product_timeout_error_is_a_failure_and_the_harness_timing_out_is_a_hang():
    """A run is a hang when the harness or the watchdog gave up on it, not when the code under test raised its own
    ``PeerTimeoutError`` (the error a silent peer should cause) and an assertion about it failed."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import soak
    finally:
        sys.path.pop(0)
    assert soak.failure_kind("AssertionError: ('PeerTimeoutError', 'megatron_tah: world rank 0 ...', 7.34)") == "failed"
    assert soak.failure_kind("TimeoutError: ranks [1] gave no result within 120 s") == "hang"
    assert soak.failure_kind("builtins.TimeoutError: x") == "hang"
    assert soak.failure_kind("Failed: stopped after 900 s") == "hang"
    assert soak.failure_kind("AssertionError: assert 1 == 2") == "failed"
