"""The multi-process harness (``dist_utils.run_distributed``): a hang is stopped at its timeout with every
stuck rank's stack in the error, and no rank nor any helper a rank spawned outlives the run."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest

from tests.helpers.dist_utils import DistributedError, run_distributed

pytestmark = pytest.mark.distributed


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # (a zombie has ended)
    except OSError:
        return False


def _stuck_with_a_helper(rank, world_size, where):
    """Each rank starts a helper process and writes both pids; rank 1 then blocks in ``_blocked_here``."""
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(f"{where}.{rank}", "w") as f:
        f.write(f"{os.getpid()} {helper.pid}")
    if rank == 1:
        _blocked_here()
    return rank


def _blocked_here():
    time.sleep(600)


def test_a_hang_is_stopped_with_the_stuck_ranks_stack_and_nothing_outlives_it(tmp_path):
    start = time.monotonic()
    with pytest.raises(TimeoutError) as caught:
        run_distributed(_stuck_with_a_helper, 2, str(tmp_path / "pids"), timeout=15, startup=300)
    assert time.monotonic() - start < 300 + 15 + 20
    text = str(caught.value)
    assert "ranks [1] of 2 gave no result within 15 s of starting" in text
    assert "rank 1's threads when it was stopped" in text and "_blocked_here" in text, text
    pids = [int(pid) for rank in range(2) for pid in (tmp_path / f"pids.{rank}").read_text().split()]
    assert len(pids) == 4 and not any(_alive(pid) for pid in pids), pids


def _fails_or_blocks(rank, world_size):
    if rank == 0:
        raise ValueError("rank 0 stops")
    _blocked_here()


def test_a_rank_left_running_after_anothers_failure_is_named_with_its_stack():
    with pytest.raises(DistributedError) as caught:
        run_distributed(_fails_or_blocks, 2, timeout=60, grace=3)
    failures = {f.rank: f for f in caught.value.failures}
    assert failures[0].type_name == "ValueError" and failures[1].type_name == "Killed"
    assert "_blocked_here" in failures[1].traceback


# ----- tests/conftest.py: the backstop for tests that start processes themselves -----------------------------
PROBES = """
import subprocess, sys, time
import pytest

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)  # tah-probe"]

@pytest.mark.distributed
def test_leaves_a_process_behind():
    subprocess.Popen(SLEEPER)

@pytest.mark.distributed
def test_hangs_on_a_child():
    subprocess.run(SLEEPER)
"""


def test_a_test_that_leaves_a_process_or_hangs_on_one_fails_and_leaves_nothing(tmp_path):
    conftest = os.path.join(os.path.dirname(os.path.dirname(__file__)), "conftest.py")  # tests/conftest.py
    (tmp_path / "conftest.py").write_text(open(conftest).read())
    (tmp_path / "test_probes.py").write_text(PROBES)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "TAH_DISTRIBUTED_TIMEOUT_S": "5"})
    out = done.stdout + done.stderr
    assert time.monotonic() - start < 90
    assert "processes the test started were still running after it" in out and "tah-probe" in out, out
    assert "test_hangs_on_a_child" in out and "stopped after 5 s" in out, out
    assert 'File "<string>", line 1 in <module>' in out, out  # the stuck child's stack (SIGABRT, PYTHONFAULTHANDLER)
    assert not [line for line in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
                .splitlines() if "tah-probe" in line and "ps -eo" not in line]


# ----- ranks forked from a server that imported megatron-core once ----------------------------------------------
def _what_the_rank_sees(rank, world_size, name):
    return os.environ.get(name), os.environ.get("PYTEST_CURRENT_TEST"), os.getppid(), "megatron.core" in sys.modules


def test_ranks_fork_from_one_server_with_the_parents_environment_or_spawn_when_an_import_could_differ(monkeypatch):
    first, second = (run_distributed(_what_the_rank_sees, 1, "TAH_PROBE")[0] for _ in range(2))
    # Forked from the same server (not this process), megatron-core imported before the rank began, and the
    # variables as they are now (pytest names the running test), not as when the server started.
    assert first[2] == second[2] != os.getpid() and first[3], (first, second)
    assert first[:2] == (None, os.environ["PYTEST_CURRENT_TEST"]), first
    # A variable the server did not import under: spawned (a child of this process), and the rank sees it.
    monkeypatch.setenv("TAH_PROBE", "set here")
    assert run_distributed(_what_the_rank_sees, 1, "TAH_PROBE")[0][::2] == ("set here", os.getpid())
    monkeypatch.delenv("TAH_PROBE")
    assert run_distributed(_what_the_rank_sees, 1, "TAH_PROBE", env={"TAH_PROBE": "given"})[0][::2] == \
        ("given", os.getpid())
    assert run_distributed(_what_the_rank_sees, 1, "TAH_PROBE")[0][2] == first[2]  # back to the server


# ----- a killed test leaves no rank running, and its folder goes -----------------------------------------------
def _marks_and_sleeps(rank, world_size, where):
    with open(f"{where}.{rank}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


KILLED_TEST = """
import sys
from tests.helpers.dist_utils import run_distributed
from tests.project.test_dist_utils import _marks_and_sleeps
run_distributed(_marks_and_sleeps, 2, sys.argv[1], timeout=300, env={"TAH_SPAWNED": "1"})  # (spawned ranks)
"""


@pytest.mark.parametrize("when", ["importing", "running"])
def test_no_rank_outlives_a_killed_test_and_its_folder_is_removed(tmp_path, when):
    """The test process SIGKILLed while its spawned ranks import (torch, the harness, the test module) or while they
    run: every rank ends within seconds, and the run's temporary folder is gone (removed by a rank, or by the
    next run's sweep)."""
    import psutil

    from tests.helpers import rank_entry

    where = str(tmp_path / "rank")
    test = subprocess.Popen([sys.executable, "-c", KILLED_TEST, where], cwd=os.path.dirname(
        os.path.dirname(os.path.dirname(__file__))), env={**os.environ, "PYTHONPATH": os.getcwd()})
    parent, deadline = psutil.Process(test.pid), time.monotonic() + 240
    ranks = []
    while time.monotonic() < deadline:
        ranks = [p for p in parent.children() if "spawn_main" in " ".join(p.cmdline())]
        ready = all(os.path.exists(f"{where}.{r}") for r in range(2))
        if len(ranks) == 2 and (when == "importing" or ready):
            break
        time.sleep(0.05)
    assert len(ranks) == 2, parent.children()
    family = parent.children(recursive=True)
    test.kill()
    test.wait()
    _, alive = psutil.wait_procs(family, timeout=15)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]
    rank_entry.remove_stale_folders()
    assert not [e for e in os.listdir(tempfile.gettempdir()) if e.startswith(f"{rank_entry.FOLDER_PREFIX}{test.pid}_")]
