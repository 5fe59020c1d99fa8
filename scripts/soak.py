#!/usr/bin/env python
"""Run every multi-process test (marker ``distributed``) many times with a CPU hog beside it; report, per test,
its passes, failures and hangs.

    python scripts/soak.py --runs 20                         # every `distributed` test, 20 rounds
    python scripts/soak.py --runs 20 tests/link/test_entropy_pipeline.py tests/link/test_peer_timeout.py
    python scripts/soak.py --runs 3 --hogs 2 --timeout 1800 --json runs/soak.json
    python scripts/soak.py --budget-minutes 30               # as many runs as fit in 30 minutes, round-robin
    python scripts/soak.py --budget-minutes 150 --json runs/soak.json --resume   # go on where the last soak stopped

Each round runs each selected test once (in turn: the load varies alike for all), a file's tests in one
``python -m pytest`` in a session of its own, while ``--hogs`` busy loops run beside it (one by default: on
a 2-core machine a test gets about one core). With ``--budget-minutes`` the tests run one per pytest, in turn
(round-robin: test 1, 2, ..., N, 1, 2, ...), and no run starts once the budget is spent: every test is sampled
before any runs twice (the table's runs column says how often each ran; at most ``--runs`` rounds). A run is:

* **passed** / **failed** / **skipped**: pytest's verdict (its JUnit XML report);
* **hang**: the file's run did not end within ``--timeout`` s per test (every process of its session gets
  SIGABRT -- with ``PYTHONFAULTHANDLER`` set, its stacks -- then SIGKILL), or the test failed because a
  multi-process run of its own gave no result in time (``run_distributed``'s ``TimeoutError``, the tests'
  watchdog);
* **left**: a process of its file's session still ran ``--settle-s`` s after pytest exited (killed then), or a
  multi-process run's temporary folder (``tah_dist_<its pid>_*``) was still there (removed then); the
  table counts the runs. Until then the session's processes may end by themselves: pytest's children's
  children (multiprocessing's fork server and resource tracker) outlive it by a second or two.

With ``--json`` every run's record (round, test, verdict, seconds, left, the commit it ran at) is written there
after each pytest (to a temporary name, then renamed: a killed soak leaves the last whole file); ``--resume``
reads it and runs only the (round, test) pairs it lacks, so a soak longer than a working session goes on across
sessions, and the table covers every recorded run.

SIGTERM or SIGINT stops the soak: the running pytest's session and the hogs are killed, the table of the runs so
far printed, exit status 130. A failed or hung run's output is kept in ``--logs`` (default ``runs/soak/``). Exit
status 1 when any run failed, hung or left a process.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from xml.etree import ElementTree

REPO = Path(__file__).resolve().parents[1]
POLL_S = 0.1
HANG_MARKS = ("gave no result", "Failed: stopped after ")  # a multi-process run or the watchdog timed out
SETTLE_S = 30.0  # a session's processes get this long to end after pytest: waited for only while they run (a fork
# server outlived pytest by more than 10 s beside a training study and a CI run)
HANG_ERROR = re.compile(r"\bTimeoutError\b")  # run_distributed's; not a product error such as PeerTimeoutError


def failure_kind(text: str) -> str:
    """"hang" when a failed test's report ``text`` says a multi-process run or the watchdog timed out, else
    "failed" (a product's own error, ``PeerTimeoutError`` among them, is a failure)."""
    return "hang" if HANG_ERROR.search(text) or any(mark in text for mark in HANG_MARKS) else "failed"


def collect(paths: list[str], marker: str) -> list[str]:
    """The test ids pytest collects under ``paths`` with ``marker``."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                          "-m", marker, *paths], cwd=REPO, capture_output=True, text=True, check=False)
    ids = [line.strip() for line in out.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        raise SystemExit(f"no `{marker}` tests collected under {paths}:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return ids


def session_pids(sid: int) -> list[int]:
    """The processes of session ``sid`` (read from /proc), zombies apart."""
    from megatron_tah.netns_link import processes

    return processes(session=sid)


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def settle(sid: int, settle_s: float) -> list[int]:
    """The processes of session ``sid`` still running after at most ``settle_s`` s of waiting for them to end."""
    deadline = time.monotonic() + settle_s
    while (left := session_pids(sid)) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return left


def stop_session(sid: int) -> None:
    """SIGKILL every process of session ``sid``."""
    signal_all(session_pids(sid), signal.SIGKILL)


def run_folders(pid: int) -> set[Path]:
    """The multi-process runs' temporary folders of test process ``pid`` (``tests/helpers/rank_entry.py``'s
    ``tah_dist_<test pid>_*``): only this soak's own, never those of tests running beside it."""
    return set(Path(tempfile.gettempdir()).glob(f"tah_dist_{pid}_*"))


def run_unit(tests: list[str], timeout: float, log: Path, settle_s: float = SETTLE_S) -> list[dict]:
    """One run of ``tests`` (one file's) in one pytest: each test's verdict and seconds (from its JUnit XML
    report), and the processes the run left ``settle_s`` s after it ended (counted for each of its tests).
    Interrupted (SIGTERM/SIGINT as ``KeyboardInterrupt``), its session is killed before the interruption goes on."""
    report = log.with_suffix(".xml")
    report.unlink(missing_ok=True)
    start = time.monotonic()
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                 f"--junitxml={report}", *tests], cwd=REPO, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
        timed_out = False
        try:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                signal_all(session_pids(proc.pid), signal.SIGABRT)  # stacks, into the log
                time.sleep(3)
                stop_session(proc.pid)
                proc.wait()
        except BaseException:
            stop_session(proc.pid)
            proc.kill()
            proc.wait()
            raise
    elapsed = time.monotonic() - start
    left = settle(proc.pid, settle_s)
    stop_session(proc.pid)
    for folder in run_folders(proc.pid):  # the tests run in the pytest process itself (no workers)
        left.append(str(folder))
        shutil.rmtree(folder, ignore_errors=True)
    found = {}
    if report.exists():
        for case in ElementTree.parse(report).iter("testcase"):
            test = case.get("name")  # (unique within one file's run; the class name depends on the rootdir)
            problems = [child for child in case if child.tag in ("failure", "error")]
            text = " ".join(f"{p.get('message', '')} {p.text or ''}" for p in problems)
            verdict = "passed" if not problems else failure_kind(text)
            if case.find("skipped") is not None and not problems:
                verdict = "skipped"
            found[test] = {"verdict": verdict, "seconds": round(float(case.get("time", 0.0)), 1)}
    missing = {"verdict": "hang" if timed_out else "failed", "seconds": round(elapsed / len(tests), 1)}
    return [dict(found.get(test.split("::")[-1], missing), test=test, left=len(left)) for test in tests]


def schedule(tests: list[str], runs: int, budget: bool, done: set[tuple[int, str]] = frozenset()
             ) -> list[tuple[int, list[str]]]:
    """(round, the tests of one pytest) in the order they run: per round each file's tests together, or with a
    budget each test alone, round-robin; the (round, test) pairs in ``done`` (an earlier soak's) left out."""
    order = []
    for round_ in range(1, runs + 1):
        todo = [test for test in tests if (round_, test) not in done]
        if budget:
            order += [(round_, [test]) for test in todo]
        else:
            units: dict[str, list[str]] = {}
            for test in todo:
                units.setdefault(test.split("::")[0], []).append(test)
            order += [(round_, unit) for unit in units.values()]
    return order


def commit() -> str:
    """The checkout's commit (``unknown`` outside git)."""
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def read_records(path: Path | None) -> list[dict]:
    """The runs an earlier soak recorded in ``path`` (none when it is absent)."""
    if path is None or not path.exists():
        return []
    return json.loads(path.read_text())["runs"]


def write_records(path: Path, runs: list[dict], hogs: int) -> None:
    """``runs`` to ``path`` whole: a temporary name, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"runs": runs, "hogs": hogs}, indent=1))
    os.replace(partial, path)


def table(runs: list[dict], tests: list[str]) -> str:
    """The per-test table (Markdown)."""
    lines = ["| test | runs | passed | failed | hangs | skipped | left a process | median s | max s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for test in tests:
        mine = [r for r in runs if r["test"] == test]
        if not mine:
            continue
        count = {v: sum(r["verdict"] == v for r in mine) for v in ("passed", "failed", "hang", "skipped")}
        seconds = [r["seconds"] for r in mine]
        lines.append(f"| `{test}` | {len(mine)} | {count['passed']} | {count['failed']} | {count['hang']} | "
                     f"{count['skipped']} | "
                     f"{sum(r['left'] > 0 for r in mine)} | {statistics.median(seconds):.0f} | {max(seconds):.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", default=["tests"], help="test files or ids (default: tests)")
    parser.add_argument("--runs", type=int, default=20, help="rounds (each runs every selected test once)")
    parser.add_argument("--hogs", type=int, default=1, help="busy loops beside the tests")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one test may take")
    parser.add_argument("--marker", default="distributed", help="pytest marker expression selecting the tests")
    parser.add_argument("--logs", type=Path, default=REPO / "runs" / "soak", help="where failed runs' output goes")
    parser.add_argument("--json", type=Path, help="write every run's record here too")
    parser.add_argument("--resume", action="store_true", help="go on from the runs --json holds: run only the "
                        "(round, test) pairs it lacks; the table covers them all")
    parser.add_argument("--budget-minutes", type=float, help="start no run after this many minutes; the tests run "
                        "one at a time, round-robin, so every test is sampled before any runs twice")
    parser.add_argument("--settle-s", type=float, default=SETTLE_S, help="seconds a file's processes get to end after "
                        "pytest (fork server, resource tracker) before they count as left")
    args = parser.parse_args(argv)
    if args.resume and args.json is None:
        parser.error("--resume needs --json FILE (the records to go on from)")
    tests = collect(args.paths, args.marker)
    earlier = read_records(args.json) if args.resume else []
    here = commit()
    args.logs.mkdir(parents=True, exist_ok=True)
    budget = f", a budget of {args.budget_minutes:g} min" if args.budget_minutes is not None else ""
    print(f"soak: {len(tests)} tests x {args.runs} rounds, {args.hogs} CPU hog(s), {args.timeout:.0f} s each{budget}",
          flush=True)

    def _interrupted(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, _interrupted)
    signal.signal(signal.SIGINT, _interrupted)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    runs, interrupted = list(earlier), False
    if earlier:
        print(f"soak: {len(earlier)} runs recorded in {args.json} go on counting", flush=True)
    try:
        began = time.monotonic()
        done = {(r["round"], r["test"]) for r in earlier}
        for round_, unit in schedule(tests, args.runs, args.budget_minutes is not None, done):
            if args.budget_minutes is not None and time.monotonic() - began > 60 * args.budget_minutes:
                print(f"soak: the budget of {args.budget_minutes:g} min is spent after {len(runs) - len(earlier)} "
                      "runs", flush=True)
                break
            log = args.logs / f"{unit[0].split('::')[0].replace('/', '_')}.{round_}.{len(runs)}.log"
            results = run_unit(unit, args.timeout * len(unit), log, args.settle_s)
            for run in results:
                run["round"], run["commit"] = round_, here
                runs.append(run)
                print(f"[{time.strftime('%H:%M:%S')}] round {round_}: {run['verdict']:6s} {run['seconds']:6.0f} s"
                      f"{'  left ' + str(run['left']) if run['left'] else ''}  {run['test']}", flush=True)
            if all(r["verdict"] in ("passed", "skipped") and not r["left"] for r in results):
                log.unlink()
                log.with_suffix(".xml").unlink(missing_ok=True)
            if args.json:
                write_records(args.json, runs, args.hogs)
    except KeyboardInterrupt as err:
        interrupted = True
        print(f"soak: stopped by {err or 'SIGINT'} after {len(runs)} runs", flush=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for hog in hogs:
            hog.kill()
            hog.wait()
    print(table(runs, tests))
    if interrupted:
        return 130
    return int(any(r["verdict"] not in ("passed", "skipped") or r["left"] for r in runs))


if __name__ == "__main__":
    sys.exit(main())
