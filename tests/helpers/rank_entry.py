"""Where a multi-process test's rank starts (``dist_utils.run_distributed``), before it imports anything heavy.

Only the standard library at import: a spawned rank unpickles this function and its arguments first, so the
parent-death signal (``PR_SET_PDEATHSIG``) is set, and the test process checked to be alive, before the rank imports
torch, the harness or the test's module (the rank's function and its arguments come pickled, loaded after). A rank
whose test process is gone removes the run's temporary folder and exits; while it runs, a watchdog thread does the
same as soon as the test process ends (a forked rank's parent is the fork server, which may outlive the test by a
moment).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import threading
import time

PR_SET_PDEATHSIG = 1
WATCH_S = 0.5
FOLDER_PREFIX = "tah_dist_"  # a run's temporary folder: tah_dist_<test pid>_*
PARENT_VARIABLE = "TAH_FORK_SERVER_PARENT"  # the test process's pid, set as it starts the fork server


def die_with_parent() -> None:
    """This process gets SIGKILL when its parent dies (Linux; elsewhere nothing)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def remove_stale_folders(root: str | None = None) -> list[str]:
    """Remove the temporary folders (under ``root``, default the system's) of runs whose test process has ended;
    their names."""
    import tempfile

    root = tempfile.gettempdir() if root is None else root
    removed = []
    for entry in os.listdir(root):
        owner = entry[len(FOLDER_PREFIX):].split("_", 1)[0]
        if entry.startswith(FOLDER_PREFIX) and owner.isdigit() and not alive(int(owner)):
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
            removed.append(entry)
    return removed


def _orphaned(tmpdir: str) -> None:
    shutil.rmtree(tmpdir, ignore_errors=True)
    os._exit(1)


def _watch(test_pid: int, tmpdir: str) -> None:
    while alive(test_pid):
        time.sleep(WATCH_S)
    _orphaned(tmpdir)


def start(test_pid: int, tmpdir: str, results, payload: bytes) -> None:
    """The rank's entry: die with the parent, leave at once when the test process is gone, watch it; then run
    ``dist_utils._worker`` with the pickled ``payload`` (its arguments but ``results``)."""
    die_with_parent()
    if os.getppid() == 1 or not alive(test_pid):
        _orphaned(tmpdir)
    threading.Thread(target=_watch, args=(test_pid, tmpdir), daemon=True, name="tah-parent-watch").start()
    import pickle

    from tests.helpers import dist_utils

    rank, world_size, init_file, fn, args, kwargs, env, threads, pg_timeout, preload = pickle.loads(payload)
    dist_utils._worker(rank, world_size, init_file, fn, args, kwargs, env, threads, results, pg_timeout, preload)
