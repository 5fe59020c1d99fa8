"""Run a Megatron training command again after a failure, from its latest checkpoint, a bounded number of times.

    python -m megatron_tah.restart --save DIR [--restarts 3] [--delay-s 5] [--log-json FILE] -- COMMAND...

``scripts/pretrain_gpt.sh`` (and ``finetune_gpt.sh``) run their command this way (``RESTARTS``, default 3;
0: no restart). The first attempt runs COMMAND as given. When an attempt fails (exit status not 0), the
next one runs COMMAND with ``--load DIR`` in place of any ``--load``/``--finetune`` it had, when DIR holds a
checkpoint this run wrote (``latest_checkpointed_iteration.txt``, Megatron's tracker, written since the first
attempt started: an earlier run's checkpoint in DIR is not resumed): Megatron resumes model, optimizer,
data order and random state from it, the plugin the codecs' and ``auto``'s state (``megatron/codec_state.py``),
so the resumed run's losses are the uninterrupted run's. Without one, COMMAND runs again as given (from the
start, or from its own ``--load``). COMMAND must save to DIR (``--save DIR``) for a restart to resume.

Not restarted: exit status 2 (a usage or flag error: the same command would fail the same way); two attempts
in a row that fail without logging an iteration to ``--log-json`` (the failure is not a passing fault); an
interrupted supervisor (Ctrl-C, SIGTERM: COMMAND's process group is stopped, then this exits).

What it prints (``[restart HH:MM:SS] ...`` lines): each failure -- its exit status, the checkpoint the next
attempt resumes from and how much training since it is redone, and the error it stopped on (``first error of
attempt N: ...``: the first its ranks recorded in the attempt's ``TAH_ERROR_DIR``, ``megatron/failures.py``, e.g.
the checksum error naming the link and iteration, not a neighbour's lost connection nor whichever process exited
first; no such line when no rank recorded one) --, each new attempt's start-up until it logged its first
iteration (with ``--log-json``, the file ``--tah-log-json`` writes), and at the end the time lost to failures:
the work after each last checkpoint (the time to notice the fault included), the waits between attempts and the
restarts' start-up. Exit status: the last attempt's.

No process outlives its attempt: the supervisor adopts the orphans of the processes it starts (Linux's
``PR_SET_CHILD_SUBREAPER``) and, once an attempt has ended and its process group is stopped, stops whatever of the
attempt still runs, naming it -- e.g. the results-queue manager that Megatron's ``torch_dist`` checkpoint writer
spawns in every rank (``dist_checkpointing/strategies/filesystem_async.py``), left running when its rank is killed
(torchrun gives each rank a session of its own, out of COMMAND's process group).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil

from .megatron import failures
from .netns_link import stop_process

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's: the iteration of the latest complete checkpoint
NOT_RESTARTED = (2,)  # usage errors: the same command fails the same way
POLL_S = 0.5
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def latest_checkpoint(save: str) -> tuple[str, float] | None:
    """The latest complete checkpoint in ``save``: (its iteration as the tracker says it, when it was written);
    None when there is none."""
    path = os.path.join(save, TRACKER)
    try:
        with open(path) as tracker:
            return tracker.read().strip(), os.path.getmtime(path)
    except OSError:
        return None


def resume_command(command: list[str], save: str) -> list[str]:
    """``command`` resuming from ``save``: its ``--load X`` / ``--load=X`` and ``--finetune`` replaced by
    ``--load save`` (the run's own checkpoint is loaded in full)."""
    out, skip = [], False
    for arg in command:
        if skip:
            skip = False
        elif arg == "--load":
            skip = True
        elif not (arg.startswith("--load=") or arg == "--finetune"):
            out.append(arg)
    return [*out, "--load", save]


def count_records(path: str | None) -> int:
    """Lines in ``path`` (one JSON record per iteration or evaluation); 0 when it does not exist."""
    if path is None:
        return 0
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


@dataclasses.dataclass
class Attempt:
    number: int
    start: float
    end: float = 0.0
    status: int | None = None
    first_record_at: float | None = None  # when it logged its first record (None: never, or not watched)
    error: failures.RankError | None = None  # the error it stopped on, as its ranks recorded it (None: none)


def _say(text: str) -> None:
    print(f"[restart {time.strftime('%H:%M:%S')}] {text}", flush=True)


def adopt_orphans() -> bool:
    """Make this process the reaper of its descendants' orphans (Linux); whether it could."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def stop_leftovers(grace_s: float = 5.0) -> list[str]:
    """Stop (SIGTERM, SIGKILL after ``grace_s``) every process still descending from this one -- an ended attempt's
    orphans, adopted by :func:`adopt_orphans` -- and reap them; ``"PID (COMMAND)"`` of each."""
    left = psutil.Process().children(recursive=True)
    names = []
    for proc in left:
        try:
            names.append(f"{proc.pid} ({' '.join(proc.cmdline())[:160] or proc.name()})")
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(left, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    return names


def _run(argv: list[str], log_json: str | None, attempt: Attempt) -> None:
    """Run one attempt to its end, noting when it logs its first record and the error its ranks recorded (in a
    folder of its own, ``failures.ENV``); stop it when interrupted."""
    before = count_records(log_json)
    with tempfile.TemporaryDirectory(prefix="tah-errors-") as folder:
        proc = subprocess.Popen(argv, start_new_session=True, env={**os.environ, failures.ENV: folder})
        try:
            while (status := proc.poll()) is None:
                time.sleep(POLL_S)
                if attempt.first_record_at is None and log_json is not None and count_records(log_json) > before:
                    attempt.first_record_at = time.time()
            attempt.status = status
        finally:
            stop_process(proc)
            left = stop_leftovers()
            if left:
                _say(f"stopped {len(left)} process(es) attempt {attempt.number} left running: {'; '.join(left)}")
            attempt.end = time.time()
            attempt.error = failures.first_error(failures.read(folder))


def supervise(command: list[str], save: str, restarts: int = 3, delay_s: float = 5.0,
              log_json: str | None = None) -> int:
    """Run ``command``; after a failure run it again from the latest checkpoint in ``save``, at most ``restarts``
    times (module docstring). Returns the last attempt's exit status."""
    if restarts < 0 or delay_s < 0:
        raise ValueError(f"restarts = {restarts}, delay_s = {delay_s}: both must be >= 0")
    attempts: list[Attempt] = []
    lost = {"redone": 0.0, "waiting": 0.0, "start-up": 0.0}
    argv = list(command)
    while True:
        attempt = Attempt(len(attempts) + 1, time.time())
        attempts.append(attempt)
        if attempt.number > 1:
            _say(f"attempt {attempt.number} of {restarts + 1}: {' '.join(argv[-4:])}")
        _run(argv, log_json, attempt)
        if len(attempts) > 1 and attempts[-2].status and attempt.first_record_at is not None:
            lost["start-up"] += attempt.first_record_at - attempt.start
            _say(f"attempt {attempt.number} logged its first iteration {attempt.first_record_at - attempt.start:.1f} s "
                 "after it started")
        if attempt.status == 0:
            break
        checkpoint = latest_checkpoint(save)
        if checkpoint is not None and checkpoint[1] < attempts[0].start:
            checkpoint = None  # an earlier run's: this run resumes only from its own checkpoints
        since = attempt.start if checkpoint is None else max(attempt.start, checkpoint[1])
        lost["redone"] += attempt.end - since
        where = (f"no checkpoint of this run in {save}: the next attempt starts over" if checkpoint is None else
                 f"the next attempt resumes from iteration {checkpoint[0]} in {save}")
        _say(f"attempt {attempt.number} failed (exit status {attempt.status}) after {attempt.end - attempt.start:.1f} s; "
             f"{attempt.end - since:.1f} s of it since the last checkpoint is lost; {where}")
        if attempt.error is not None:
            _say(f"first error of attempt {attempt.number}: {attempt.error.text()}")
        no_progress = log_json is not None and [a.first_record_at for a in attempts[-2:]] == [None, None]
        if attempt.status in NOT_RESTARTED or len(attempts) > restarts or (len(attempts) >= 2 and no_progress):
            reason = ("a usage error" if attempt.status in NOT_RESTARTED else
                      f"{restarts} restart(s) used" if len(attempts) > restarts else
                      "two attempts in a row logged no iteration")
            _say(f"not restarting ({reason})")
            break
        if checkpoint is not None:
            argv = resume_command(command, save)
        _say(f"restarting in {delay_s:g} s")
        time.sleep(delay_s)
        lost["waiting"] += delay_s
    failures = sum(1 for a in attempts if a.status)
    total = time.time() - attempts[0].start
    if len(attempts) > 1:
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in lost.items())
        _say(f"{'finished' if attempt.status == 0 else 'gave up'} after {len(attempts)} attempts ({failures} "
             f"failed) in {total:.1f} s; time lost to failures: {sum(lost.values()):.1f} s ({parts})")
    return attempt.status


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_tah.restart", description=__doc__.split("\n")[0],
                                epilog="form: --save DIR [--restarts N] [--delay-s S] [--log-json FILE] -- COMMAND...")
    p.add_argument("--save", required=True, help="the checkpoint directory COMMAND saves to (--save); restarts "
                   "load from it")
    p.add_argument("--restarts", type=int, default=3, help="restarts after failures at most (default 3)")
    p.add_argument("--delay-s", type=float, default=5.0, help="seconds between a failure and the next attempt "
                   "(default 5)")
    p.add_argument("--log-json", help="COMMAND's --tah-log-json file: start-up times, and attempts that made no "
                   "progress")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        _parser().parse_args(argv)  # --help, or the error for a missing --save
        print("error: no command given: put it after `--`", file=sys.stderr)
        return 2
    cut = argv.index("--")
    args, command = _parser().parse_args(argv[:cut]), argv[cut + 1:]
    if not command:
        print("error: no command given: put it after `--`", file=sys.stderr)
        return 2

    def _interrupted(signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupted)
    adopt_orphans()
    try:
        return supervise(command, args.save, args.restarts, args.delay_s, args.log_json)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _say("interrupted: the command was stopped, no restart")
        return 130


if __name__ == "__main__":
    sys.exit(main())
