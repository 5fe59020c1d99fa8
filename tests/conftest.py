"""Multi-process tests (marker ``distributed``) cannot hang the suite, and no process outlives its test.

* Every process the tests start runs with ``PYTHONFAULTHANDLER=1``: a Python process sent SIGABRT writes its
  threads' stacks to its stderr before it dies.
* The test process adopts orphans (``PR_SET_CHILD_SUBREAPER``, Linux): a launcher's worker whose parent was
  killed (a ``subprocess.run`` timeout kills only its child) stays among the test process's descendants.
* Around each ``distributed`` test, a watchdog: after ``DISTRIBUTED_TIMEOUT_S`` (``$TAH_DISTRIBUTED_TIMEOUT_S``,
  default 2400) every process the test
  started gets SIGABRT (its stacks), then SIGKILL, and the test process's own threads are dumped; and once
  the test is over, a process it started that still runs ``EXIT_GRACE_S`` later is killed and the test fails,
  naming it (pid, parent, age, command line).

``run_distributed`` (``helpers/dist_utils.py``) bounds its own runs first; this is the backstop for the tests that
start processes themselves (torchrun, the restart loop, the demo).

Megatron's fusions (bias-dropout-add, bias-GELU, ...: ``megatron.core.jit.jit_fuser``) are ``torch.compile``'d; on
CPU inductor builds C++ for them in every training process the tests start (a PP 2 test of 3 short runs: 112 s
compiled, 49 s not, measured). The tests run them uncompiled (``TORCHDYNAMO_DISABLE=1``: the same Python functions,
not fused); the ``smoke`` tests (``make test``'s pipelines) keep them compiled, as a GPU run has them.
``TORCHDYNAMO_DISABLE=0`` in the environment compiles them in every test.

When several tests run at a time (pytest-xdist's workers: ``make test``, ``make test-all``), every process runs
torch with one thread (``OMP_NUM_THREADS=1``, as torchrun gives each rank) unless the environment says otherwise:
OpenMP's threads spin waiting for each other on a few busy cores (``tests/kernels`` and ``tests/codecs`` three at a
time on 2 cores: 124 s of wall and 230 s of CPU with torch's default of a thread per core, 77 s and 133 s with one,
measured). One test at a time (plain ``pytest``) keeps torch's default.

The fixtures several test files use live here too (``corpus``). This file imports nothing of the tests' own
(``tests/project/test_dist_utils.py`` runs a copy of it alone).
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
import threading
import time

import psutil
import pytest

DISTRIBUTED_TIMEOUT_S = float(os.environ.get("TAH_DISTRIBUTED_TIMEOUT_S", 2400))  # above every test's own bound
EXIT_GRACE_S = 5.0  # a process still running this long after its test ended was left behind
PR_SET_CHILD_SUBREAPER = 36

os.environ.setdefault("PYTHONFAULTHANDLER", "1")
COMPILE_CHOSEN = "TORCHDYNAMO_DISABLE" in os.environ  # the caller's choice holds for every test
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # several tests at a time: one thread each (module docstring)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads OpenMP; a value the environment set is kept
try:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
except (OSError, AttributeError):
    pass


def _descendants() -> dict[int, psutil.Process]:
    try:
        return {p.pid: p for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return {}


def _ours(proc: psutil.Process) -> bool:
    """Not the test process's own helpers, started once per session: multiprocessing's resource tracker and
    fork server (the server's own child; the ranks it forks carry its command line and are the tests')."""
    try:
        command = " ".join(proc.cmdline())
        server = "multiprocessing.forkserver" in command and proc.ppid() == os.getpid()
        return "resource_tracker" not in command and not server
    except psutil.Error:
        return False


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _name(proc: psutil.Process) -> str:
    """pid, parent pid, age and command line: enough to tell which of a test's steps started it."""
    try:
        age = time.time() - proc.create_time()
        return f"{proc.pid} (parent {proc.ppid()}, {age:.0f} s old) {' '.join(proc.cmdline())[:160]}"
    except psutil.Error:
        return str(proc.pid)


def _stop(procs: list[psutil.Process], dump: bool) -> None:
    """SIGABRT (stacks; with ``dump``) then SIGKILL ``procs``; reap those that are the test process's children."""
    if dump:
        for proc in procs:
            try:
                proc.send_signal(signal.SIGABRT)
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=3)
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)


def _reap_zombies() -> None:
    """Reap the adopted children that have ended (orphans re-parented to the test process)."""
    for child in psutil.Process().children():
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(child.pid, os.WNOHANG)
        except (psutil.Error, ChildProcessError):
            pass


@pytest.fixture(autouse=True)
def _environment_restored():
    """What a test, or code it ran in-process (``hf_checkpoint`` sets ``HF_HUB_OFFLINE`` and ``MASTER_PORT``), set in
    ``os.environ`` ends with it: later tests see the suite's environment, and their ranks fork from the one server
    that imported under it (``helpers/dist_utils.py``) instead of spawning."""
    before = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    yield
    now = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    if now != before:
        for name in set(now) - set(before):
            del os.environ[name]
        os.environ.update(before)


@pytest.fixture(autouse=True)
def _compiled_fusions_in_smoke_tests(request, monkeypatch):
    """A ``smoke`` test's processes compile Megatron's fusions (unless the environment chose for every test)."""
    if request.node.get_closest_marker("smoke") is not None and not COMPILE_CHOSEN:
        monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")  # (read as each process imports torch)
    yield


@pytest.fixture(autouse=True)
def _bounded_processes(request):
    if request.node.get_closest_marker("distributed") is None:
        yield
        return
    before = set(_descendants())
    fired = threading.Event()

    def watchdog():
        fired.set()
        print(f"\n--- {request.node.nodeid}: still running after {DISTRIBUTED_TIMEOUT_S:.0f} s; stacks follow",
              file=sys.__stderr__, flush=True)
        faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        _stop([p for pid, p in _descendants().items() if pid not in before and _ours(p)], dump=True)

    timer = threading.Timer(DISTRIBUTED_TIMEOUT_S, watchdog)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
    left = [p for pid, p in _descendants().items() if pid not in before and _ours(p) and _running(p)]
    _, left = psutil.wait_procs(left, timeout=EXIT_GRACE_S)  # (one that is exiting on its own is no leak)
    left = [p for p in left if _running(p)]
    names = [_name(p) for p in left]
    _stop(left, dump=False)
    _reap_zombies()
    if fired.is_set():
        pytest.fail(f"stopped after {DISTRIBUTED_TIMEOUT_S:.0f} s (every process it started was sent SIGABRT, "
                    "then killed: their stacks are in the captured stderr)")
    if names:
        pytest.fail("processes the test started were still running after it: " + "; ".join(names))


def pytest_collection_modifyitems(config, items):
    """The modules with a multi-process or slow test run first, each module's tests together (its fixtures are
    made once): with several workers (``make test-all``) the long tests start early and the many short ones even out
    the end, instead of one worker finishing a long test alone."""
    heavy = {item.module.__name__ for item in items
             if item.get_closest_marker("distributed") or item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module.__name__ not in heavy)  # (a stable sort: the order within each group)


# ----- shared fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """A small Shakespeare corpus for Megatron's loop (6 documents, at most 20k tokens): its indexed-dataset
    prefix. Made once per test module (``test_pretrain_gpt.py``, ``test_restart.py``,
    ``megatron/test_activation_memory.py``)."""
    from megatron_tah.data import prepare

    prefix = tmp_path_factory.mktemp("data") / "shk"
    prepare("shakespeare", prefix, max_docs=6, max_tokens=20_000)
    return str(prefix)
