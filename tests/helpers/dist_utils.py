"""Run a function in N CPU/gloo processes and get each rank's result back (for multi-process tests).

API::

    from tests.helpers.dist_utils import run_distributed, RankFailure

    def body(rank, world_size, scale):        # module level (it is pickled by reference)
        t = torch.full((1,), float(rank))
        torch.distributed.all_reduce(t)
        return t.item() * scale               # must be picklable

    results = run_distributed(body, 2, 10.0)  # -> [10.0, 10.0], one entry per rank

* Each rank is a new process with ``torch.distributed`` initialised (gloo, file rendezvous, no
  fixed port), ``torch.set_num_threads(threads)`` (default 1; the CI machine has 2 cores) and the
  parent's environment plus ``env``. Ranks are forked from one ``forkserver`` per test process
  that imported megatron-core and Megatron's training package once (about 5 s a rank saved);
  a rank whose environment differs from the one the server imported under (beyond the running
  test's name) is a fresh ``spawn`` process instead, so no import sees other variables than it
  would have. The process group is destroyed after ``fn`` returns.
* If a rank raises, ``run_distributed`` raises ``DistributedError`` listing every rank's
  failure, unless ``return_exceptions=True``: then a failed rank's entry is a
  ``RankFailure`` (``type_name``, ``message``, ``traceback``). Results travel pickled by value (a tensor
  shared by file descriptor could not be read once its rank has exited). After the first failure the
  other ranks get ``grace`` seconds to finish (they usually fail too, when their peer's
  connections close) and are then killed (``RankFailure("Killed", ...)``).
* ``timeout`` bounds the run once every rank has started (process group made, ``preload`` imported:
  megatron-core by default, which a loaded 2-core machine may take minutes to import); start-up gets
  ``startup`` s more at most. Ranks still running then are killed and ``TimeoutError`` names them, so a
  hang fails the test instead of blocking CI. Before a rank is
  killed (timed out, or still running ``grace`` s after another failed) its threads' stacks are
  dumped (``faulthandler`` on ``SIGUSR1``) and come back in the error.
* No process outlives the run: each rank leads its own process group, which is killed once the rank
  is done or stopped (helpers it spawned die with it), and a rank dies with its parent
  (``PR_SET_PDEATHSIG``, set by ``rank_entry.start`` before the rank imports torch or the test: the test process,
  or the fork server, which ends with it) and leaves when the test process is gone (checked at its start and
  twice a second), so a killed test run leaves no rank behind. The run's temporary folder is removed by the run,
  else by a rank that finds its test gone, else by the next run or soak (``rank_entry.remove_stale_folders``:
  ``tah_dist_<test pid>_*`` of a test process that has ended).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import datetime
import faulthandler
import os
import pickle
import queue as queue_module
import shutil
import signal
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

from tests.helpers import rank_entry


@dataclasses.dataclass
class RankFailure:
    """What a failed rank raised (or why it was stopped)."""

    rank: int
    type_name: str
    message: str
    traceback: str = ""

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.type_name}: {self.message}"


class DistributedError(RuntimeError):
    def __init__(self, failures: list[RankFailure]):
        self.failures = failures
        details = "\n".join(f"--- {f}\n{f.traceback}" for f in failures)
        super().__init__(f"{len(failures)} rank(s) failed:\n{details}")


STACKS_S = 3.0  # how long the parent waits for a rank's stack dump


def _stacks_file(tmpdir: str, rank: int) -> str:
    return os.path.join(tmpdir, f"stacks.{rank}")


PRELOAD = ("megatron.core",)  # imported before a rank counts as started (absent modules are skipped)


def _worker(rank, world_size, init_file, fn, args, kwargs, env, threads, results, pg_timeout, preload):
    os.setpgid(0, 0)  # a process group of its own: killed with the helpers it spawns
    stacks = open(_stacks_file(os.path.dirname(init_file), rank), "w")  # noqa: SIM115 (open while the rank lives)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    os.environ.clear()  # the parent's environment now (a forked rank inherited the fork server's, from its start)
    os.environ.update(env)
    torch.set_num_threads(threads)
    try:
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout))
        for name in preload:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
        results.put((rank, "started", pickle.dumps(None)))
        value = fn(rank, world_size, *args, **kwargs)
        results.put((rank, "ok", pickle.dumps(value)))  # by value: a tensor shared by fd dies with its rank
    except BaseException as err:  # noqa: BLE001 - everything a rank raises is reported to the parent
        failure = RankFailure(rank, type(err).__name__, str(err), traceback.format_exc())
        results.put((rank, "error", pickle.dumps(failure)))
        results.close()
        results.join_thread()
        os._exit(1)  # do not wait on peers (destroy/atexit could block on a dead link)
    torch.distributed.destroy_process_group()
    results.close()
    results.join_thread()


# what the fork server imports once (first: it dies with the test process, even while importing the rest)
SERVER_PRELOAD = ("tests.helpers.server_dies_with_parent", "megatron.core", "megatron.training")
RUNTIME_ONLY = ("PYTEST_CURRENT_TEST", "TAH_FORK_SERVER_PARENT")  # variables that change between tests and that no
# import reads (the second: the fork server's parent check, rank_entry.PARENT_VARIABLE)
_server_env: dict = {}  # the environment the fork server imported under, once it runs
SUITE_SET = {"TORCHDYNAMO_DISABLE": os.environ.get("TORCHDYNAMO_DISABLE")}
"""The variables ``tests/conftest.py`` set for the whole suite, as it set them (this module is imported as tests are
collected); a ``smoke`` test changes one (its processes compile Megatron's fusions), and its ranks then spawn."""


def _assign(values: dict) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@contextlib.contextmanager
def _suite_variables():
    """``os.environ`` with ``SUITE_SET`` as the suite set it, not as the running test changed it: the one fork server
    imports what most tests' ranks need."""
    changed = {name: os.environ.get(name) for name in SUITE_SET}
    _assign(SUITE_SET)
    try:
        yield
    finally:
        _assign(changed)


def _context(env: dict, preload: tuple):
    """``forkserver``: ranks forked from one server per test process that imported ``SERVER_PRELOAD`` (about 5 s
    of start-up saved per rank), when the ranks' environment is the one the server imported under (up to
    ``RUNTIME_ONLY``) and ``preload`` is among its imports; ``spawn`` otherwise."""
    import multiprocessing.forkserver as forkserver

    def imported_under(variables):
        return {k: v for k, v in variables.items() if k not in RUNTIME_ONLY}

    if not _server_env:
        from tests.helpers.rank_entry import PARENT_VARIABLE

        with _suite_variables():
            os.environ[PARENT_VARIABLE] = str(os.getpid())  # the server checks its parent is still this process
            mp.get_context("forkserver").set_forkserver_preload(list(SERVER_PRELOAD))
            forkserver.ensure_running()
            _server_env.update(imported_under(os.environ))
    if imported_under(env) == _server_env and set(preload) <= set(SERVER_PRELOAD):
        return mp.get_context("forkserver")
    return mp.get_context("spawn")


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0, grace: float = 20.0,
                    return_exceptions: bool = False, env: dict | None = None, threads: int = 1,
                    startup: float = 600.0, preload: tuple = PRELOAD, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; results in rank order."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    env = {**os.environ, **{k: str(v) for k, v in (env or {}).items()}}
    ctx = _context(env, preload)
    results = ctx.Queue()
    rank_entry.remove_stale_folders()
    tmpdir = tempfile.mkdtemp(prefix=f"{rank_entry.FOLDER_PREFIX}{os.getpid()}_")
    init_file = os.path.join(tmpdir, "rendezvous")
    procs = [ctx.Process(target=rank_entry.start, daemon=True,
                         args=(os.getpid(), tmpdir, results,
                               pickle.dumps((r, world_size, init_file, fn, args, kwargs, env, threads,
                                             startup + timeout, preload))))
             for r in range(world_size)]
    for p in procs:
        p.start()
    outcome: dict[int, object] = {}
    started: set[int] = set()
    deadline = time.monotonic() + startup + timeout
    try:
        while len(outcome) < world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                rank, status, value = results.get(timeout=min(1.0, deadline - now))
            except queue_module.Empty:
                if any(not p.is_alive() and p.exitcode not in (0, None) and r not in outcome
                       for r, p in enumerate(procs)):
                    # A rank died without reporting (e.g. a crash in C++): stop waiting soon.
                    deadline = min(deadline, time.monotonic() + grace)
                continue
            if status == "started":
                started.add(rank)
                if len(started) == world_size:
                    deadline = min(deadline, time.monotonic() + timeout)
                continue
            outcome[rank] = pickle.loads(value)
            if status == "error":
                deadline = min(deadline, time.monotonic() + grace)
        while len(outcome) < world_size:  # results sent before the deadline, not yet read
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue_module.Empty:
                break
            if status != "started":
                outcome[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5 if len(outcome) == world_size else 0.1)
        stacks = _dump_stacks(procs, tmpdir)
        for p in procs:
            _kill_group(p)
        shutil.rmtree(tmpdir, ignore_errors=True)
    missing = [r for r in range(world_size) if r not in outcome]
    errors_seen = any(isinstance(v, RankFailure) for v in outcome.values())
    dumps = "".join(f"\n--- rank {r}'s threads when it was stopped:\n{text}" for r, text in stacks.items())
    if missing and not errors_seen:
        codes = {r: procs[r].exitcode for r in missing}
        late = sorted(set(range(world_size)) - started)
        when = (f"within {timeout:.0f} s of starting" if not late else
                f"(ranks {late} had not started within {startup:.0f} + {timeout:.0f} s)")
        raise TimeoutError(f"ranks {missing} of {world_size} gave no result {when} "
                           f"(exit codes {codes}; negative = killed by the harness or a signal){dumps}")
    for r in missing:
        code = procs[r].exitcode
        outcome[r] = RankFailure(r, "Killed", f"no result (exit code {code}) after another rank failed",
                                 stacks.get(r, ""))
    ordered = [outcome[r] for r in range(world_size)]
    failures = [v for v in ordered if isinstance(v, RankFailure)]
    if failures and not return_exceptions:
        raise DistributedError(failures)
    return ordered


def _dump_stacks(procs, tmpdir: str) -> dict[int, str]:
    """The stacks of the ranks still running, each dumped by the rank itself on SIGUSR1 (``faulthandler``)."""
    alive = {r: p for r, p in enumerate(procs) if p.is_alive()}
    for p in alive.values():
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    stacks, deadline = {}, time.monotonic() + STACKS_S
    if alive:
        time.sleep(1.0)  # (the handler writes every thread's frames itself, even while a rank blocks in C++)
    for r in alive:
        text = ""
        while not text and time.monotonic() < deadline:
            try:
                with open(_stacks_file(tmpdir, r)) as f:
                    text = f.read()
            except OSError:
                break
            time.sleep(0.1)
        stacks[r] = text or "(no stack dump)"
    return stacks


def _kill_group(p) -> None:
    """Kill a rank and every process of its process group (the helpers it spawned), then reap it."""
    for kill in (lambda: os.killpg(p.pid, signal.SIGKILL), p.kill):
        try:
            kill()
        except (ProcessLookupError, PermissionError, OSError):
            pass
    p.join()
