#!/usr/bin/env python
"""Run every multi-process test (marker ``distributed``) many times with a CPU hog beside it; report, per test,
its passes, failures and hangs.

    python scripts/soak.py --runs 20                         # every `distributed` test, 20 rounds
    python scripts/soak.py --runs 20 tests/link/test_entropy_pipeline.py tests/link/test_peer_timeout.py
    python scripts/soak.py --runs 3 --hogs 2 --timeout 1800 --json runs/soak.json

Each round runs each selected test once (in turn: the load varies alike for all), a file's tests in one
``python -m pytest`` in a session of its own, while ``--hogs`` busy loops run beside it (one by default: on
a 2-core machine a test gets about one core). A run is:

* **passed** / **failed** / **skipped**: pytest's verdict (its JUnit XML report);
* **hang**: the file's run did not end within ``--timeout`` s per test (every process of its session gets
  SIGABRT -- with ``PYTHONFAULTHANDLER`` set, its stacks -- then SIGKILL), or the test failed because a
  multi-process run of its own gave no result in time (``run_distributed``'s ``TimeoutError``, the tests'
  watchdog);
* **left**: a process of its file's session still ran after it (killed then; the table counts the runs).

A failed or hung run's output is kept in ``--logs`` (default ``runs/soak/``). Exit status 1 when any run
failed, hung or left a process.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from xml.etree import ElementTree

REPO = Path(__file__).resolve().parents[1]
HANG_MARKS = ("gave no result", "Failed: stopped after ")  # a multi-process run or the watchdog timed out


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


def run_unit(tests: list[str], timeout: float, log: Path) -> list[dict]:
    """One run of ``tests`` (one file's) in one pytest: each test's verdict and seconds (from its JUnit XML
    report), and the processes the run left (counted for each of its tests)."""
    report = log.with_suffix(".xml")
    report.unlink(missing_ok=True)
    start = time.monotonic()
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                 f"--junitxml={report}", *tests], cwd=REPO, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            signal_all(session_pids(proc.pid), signal.SIGABRT)  # stacks, into the log
            time.sleep(3)
            signal_all(session_pids(proc.pid), signal.SIGKILL)
            proc.wait()
    elapsed = time.monotonic() - start
    time.sleep(0.5)  # (a process that was ending is gone by now)
    left = session_pids(proc.pid)
    signal_all(left, signal.SIGKILL)
    found = {}
    if report.exists():
        for case in ElementTree.parse(report).iter("testcase"):
            test = f"{case.get('classname').replace('.', '/')}.py::{case.get('name')}"
            problems = [child for child in case if child.tag in ("failure", "error")]
            text = " ".join(f"{p.get('message', '')} {p.text or ''}" for p in problems)
            verdict = ("passed" if not problems else
                       "hang" if "TimeoutError" in text or any(mark in text for mark in HANG_MARKS) else "failed")
            if case.find("skipped") is not None and not problems:
                verdict = "skipped"
            found[test] = {"verdict": verdict, "seconds": round(float(case.get("time", 0.0)), 1)}
    missing = {"verdict": "hang" if timed_out else "failed", "seconds": round(elapsed / len(tests), 1)}
    return [dict(found.get(test, missing), test=test, left=len(left)) for test in tests]


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
    parser.add_argument("--budget-s", type=float, help="start no round after this many seconds (the table says how "
                                                          "many rounds ran)")
    args = parser.parse_args(argv)
    tests = collect(args.paths, args.marker)
    args.logs.mkdir(parents=True, exist_ok=True)
    print(f"soak: {len(tests)} tests x {args.runs} rounds, {args.hogs} CPU hog(s), {args.timeout:.0f} s each",
          flush=True)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    runs = []
    try:
        units: dict[str, list[str]] = {}
        for test in tests:
            units.setdefault(test.split("::")[0], []).append(test)
        began = time.monotonic()
        for round_ in range(1, args.runs + 1):
            if args.budget_s is not None and time.monotonic() - began > args.budget_s:
                print(f"soak: the budget of {args.budget_s:.0f} s is spent after {round_ - 1} rounds", flush=True)
                break
            for path, unit in units.items():
                log = args.logs / f"{path.replace('/', '_')}.{round_}.log"
                results = run_unit(unit, args.timeout * len(unit), log)
                for run in results:
                    run["round"] = round_
                    runs.append(run)
                    print(f"[{time.strftime('%H:%M:%S')}] round {round_}: {run['verdict']:6s} {run['seconds']:6.0f} s"
                          f"{'  left ' + str(run['left']) if run['left'] else ''}  {run['test']}", flush=True)
                if all(r["verdict"] in ("passed", "skipped") and not r["left"] for r in results):
                    log.unlink()
                    log.with_suffix(".xml").unlink(missing_ok=True)
                if args.json:
                    args.json.write_text(json.dumps({"runs": runs, "hogs": args.hogs}, indent=1))
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    print(table(runs, tests))
    return int(any(r["verdict"] not in ("passed", "skipped") or r["left"] for r in runs))


if __name__ == "__main__":
    sys.exit(main())
