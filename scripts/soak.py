#!/usr/bin/env python
"""Run every multi-process test (marker ``distributed``) many times with a CPU hog beside it; report, per test,
its passes, failures and hangs.

    python scripts/soak.py --runs 20                         # every `distributed` test, 20 rounds
    python scripts/soak.py --runs 20 tests/test_entropy_pipeline.py tests/test_peer_timeout.py
    python scripts/soak.py --runs 3 --hogs 2 --timeout 1800 --json runs/soak.json

Each round runs each selected test once (in turn: the load varies alike for all), each in its own
``python -m pytest`` in a session of its own, while ``--hogs`` busy loops run beside it (one by default: on
a 2-core machine a test gets about one core). A run is:

* **passed** / **failed**: pytest's verdict;
* **hang**: the test did not end within ``--timeout`` s (every process of its session gets SIGABRT -- with
  ``PYTHONFAULTHANDLER`` set, its stacks -- then SIGKILL), or pytest's summary line says it failed because a
  multi-process run of its own gave no result in time (``run_distributed``'s ``TimeoutError``, the tests'
  watchdog);
* **left**: a process of its session still ran after it (killed then; the table counts the runs).

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

REPO = Path(__file__).resolve().parents[1]
HANG_MARKS = ("gave no result within", "Failed: stopped after ")  # in pytest's summary line of a failed test


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
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def run_one(test: str, timeout: float, log: Path) -> dict:
    """One run of ``test``: its verdict, seconds and the processes it left."""
    start = time.monotonic()
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test],
                                cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONFAULTHANDLER": "1"})
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            signal_all(session_pids(proc.pid), signal.SIGABRT)  # stacks, into the log
            time.sleep(3)
            signal_all(session_pids(proc.pid), signal.SIGKILL)
            proc.wait()
    seconds = time.monotonic() - start
    time.sleep(0.5)  # (a process that was ending is gone by now)
    left = session_pids(proc.pid)
    signal_all(left, signal.SIGKILL)
    summary = [line for line in log.read_text(errors="replace").splitlines() if line.startswith(("FAILED", "ERROR"))]
    if timed_out or any(" - TimeoutError: " in line or any(mark in line for mark in HANG_MARKS) for line in summary):
        verdict = "hang"
    else:
        verdict = "passed" if proc.returncode == 0 else "failed"
    return {"test": test, "verdict": verdict, "seconds": round(seconds, 1), "left": len(left)}


def table(runs: list[dict], tests: list[str]) -> str:
    """The per-test table (Markdown)."""
    lines = ["| test | runs | passed | failed | hangs | left a process | median s | max s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for test in tests:
        mine = [r for r in runs if r["test"] == test]
        if not mine:
            continue
        count = {v: sum(r["verdict"] == v for r in mine) for v in ("passed", "failed", "hang")}
        seconds = [r["seconds"] for r in mine]
        lines.append(f"| `{test}` | {len(mine)} | {count['passed']} | {count['failed']} | {count['hang']} | "
                     f"{sum(r['left'] > 0 for r in mine)} | {statistics.median(seconds):.0f} | {max(seconds):.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", default=["tests"], help="test files or ids (default: tests)")
    parser.add_argument("--runs", type=int, default=20, help="rounds (each runs every selected test once)")
    parser.add_argument("--hogs", type=int, default=1, help="busy loops beside the tests")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one test run may take")
    parser.add_argument("--marker", default="distributed", help="pytest marker expression selecting the tests")
    parser.add_argument("--logs", type=Path, default=REPO / "runs" / "soak", help="where failed runs' output goes")
    parser.add_argument("--json", type=Path, help="write every run's record here too")
    args = parser.parse_args(argv)
    tests = collect(args.paths, args.marker)
    args.logs.mkdir(parents=True, exist_ok=True)
    print(f"soak: {len(tests)} tests x {args.runs} rounds, {args.hogs} CPU hog(s), {args.timeout:.0f} s each",
          flush=True)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    runs = []
    try:
        for round_ in range(1, args.runs + 1):
            for test in tests:
                name = test.replace("/", "_").replace("::", "__").replace("[", "_").replace("]", "")
                log = args.logs / f"{name}.{round_}.log"
                run = run_one(test, args.timeout, log)
                run["round"] = round_
                runs.append(run)
                if run["verdict"] == "passed" and not run["left"]:
                    log.unlink()
                print(f"[{time.strftime('%H:%M:%S')}] round {round_}: {run['verdict']:6s} {run['seconds']:6.0f} s"
                      f"{'  left ' + str(run['left']) if run['left'] else ''}  {test}", flush=True)
                if args.json:
                    args.json.write_text(json.dumps({"runs": runs, "hogs": args.hogs}, indent=1))
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    print(table(runs, tests))
    return int(any(r["verdict"] != "passed" or r["left"] for r in runs))


if __name__ == "__main__":
    sys.exit(main())
