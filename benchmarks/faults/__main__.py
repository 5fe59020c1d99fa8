"""``python -m benchmarks.faults``: each fault a real run, and what the run did.

    python -m benchmarks.faults                              # everything (~25 minutes on 2 cores)
    python -m benchmarks.faults --only killed,corrupt --out /tmp/f
    python -m benchmarks.faults --write docs/RELIABILITY.md  # the page's measured table (docs/data/faults.json)

Every scenario runs ``scripts/pretrain_gpt.sh 2`` on the CPU behind an emulated slow link (``RATE``) -- the
script users run, with its defaults for a slow link: the restart loop, checkpoints every ``SAVE_INTERVAL``
iterations, payload checksums on, the peer timeout (``--tah-peer-timeout-s``, here ``BOUND_S``) -- on a tiny model for ``ITERS`` iterations, and injects one fault once the run is past its
first checkpoint: signals to stage 1's process (kill, freeze), or in-process faults on the link stage 0 ->
stage 1 (``site/sitecustomize.py``: a message held back, a payload byte flipped; this kernel has no
``netem``, and a frozen or killed peer is what a cut link or a dead machine look like from the other
end). Each row says what happened (continued / stopped with the message naming the link and the
iteration -- the restart loop's first error of the run, whichever process exited first --, then resumed by the
script / failed / hang), the time lost against the uninterrupted run, and whether every iteration's loss equals
the uninterrupted run's, bit for bit.

Two more parts, run with the scenarios (or alone: ``--only ratedrop``, ``--only checksum-cost``):

* ``ratedrop`` (``ratedrop.py``): the emulated link's rate falls 10x and comes back with ``auto`` on both
  directions -- which codec each link takes, how many iterations it takes to follow, and tokens/s during the
  drop against every candidate run fixed at the dropped rate;
* ``checksum-cost`` (``checksum_cost.py``): the payload checksum's time per step against the demo's and the
  speedrun's measured steps.

Not here: faults on GPU links, ``tc`` (this kernel has no ``netem``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import time
from pathlib import Path

from benchmarks.faults import ROOT, SITE, script_env  # noqa: F401  (SITE: the tests' too)
from benchmarks.common.pages import replace_block

BOUND_S = 10.0  # --tah-peer-timeout-s of every run (the default, 120 s, sized for a WAN, would only be slower)
ITERS, SAVE_INTERVAL, FAULT_ITERATION = 16, 4, 6
DEADLINE_S = 900.0  # a run still going after this is a hang
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--eval-interval", "1000", "--log-interval", "1", "--tah-stochastic-rounding"]
CAUSE = re.compile(r"\] first error of attempt \d+: (\w+) on rank \d+(?: \([^)]*\))?: (.*)")  # the restart loop's
ERROR = re.compile(r"(PeerTimeoutError|PeerLostError|PayloadChecksumError|LinkError)\b:? ?(.*)")  # a traceback's
WHERE = re.compile(r"(link stage \d+ -> stage \d+, iteration \d+|world rank \d+, iteration \d+)")
ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):.*?rank\s*: (\d+).*?exitcode\s*: (-?\d+)"
                        r"(?: \(pid: \d+\))?\s*(\(SIG\w+\))?", re.S)  # torchrun's summary: a worker died first
BEGIN, END = "<!-- faults:begin -->", "<!-- faults:end -->"
PARTS = ("ratedrop", "checksum-cost")  # besides the scenarios (module docstring)


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    signal: str | None = None  # "kill" or "stop" (stage 1's process)
    resume_after_s: float | None = None  # SIGCONT this long after SIGSTOP (None: never)
    fault: str | None = None  # TAH_FAULT (site/sitecustomize.py)
    flags: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # the script's variables besides the harness's


SCENARIOS = (
    Scenario("reference", "no fault"),
    Scenario("unchecked", "no fault, payload checksums off (CHECKSUM=0: the step without them)",
             env=(("CHECKSUM", "0"),)),
    Scenario("killed", "stage 1 killed (SIGKILL): a dead machine", signal="kill"),
    Scenario("frozen-short", f"stage 1 frozen (SIGSTOP) for {0.4 * BOUND_S:g} s, then resumed", signal="stop",
             resume_after_s=0.4 * BOUND_S),
    Scenario("frozen", "stage 1 frozen (SIGSTOP) for good: a silent peer", signal="stop"),
    Scenario("outage-short", f"link stage 0 -> 1 silent for {0.4 * BOUND_S:g} s (in-process)",
             fault=f"outage:0:{FAULT_ITERATION}:{0.4 * BOUND_S:g}"),
    Scenario("outage", f"link stage 0 -> 1 silent for {2 * BOUND_S:g} s, past the bound (in-process)",
             fault=f"outage:0:{FAULT_ITERATION}:{2 * BOUND_S:g}"),
    Scenario("corrupt", "one payload byte flipped on link 0 -> 1 (checksums on: the script's default on a slow link)",
             fault=f"corrupt:0:{FAULT_ITERATION}"),
    Scenario("corrupt-unchecked", "the same byte flipped, checksums off (CHECKSUM=0)",
             fault=f"corrupt:0:{FAULT_ITERATION}", env=(("CHECKSUM", "0"),)),
)
RATE = "1gbit"  # every run behind an emulated slow link: the script's defaults for one (checksums on)


def scenario(name: str) -> Scenario:
    for s in SCENARIOS:
        if s.name == name:
            return s
    raise ValueError(f"unknown scenario {name!r}; choose from {', '.join([*(s.name for s in SCENARIOS), *PARTS])}")


# ----- one run ------------------------------------------------------------------------------------------
def stage_pid(out: Path, rank: int) -> int | None:
    """The training process of world rank ``rank`` of the run writing to ``out``."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (b"megatron_tah.pretrain_gpt" in cmdline and b"torch.distributed.run" not in cmdline
                and any(str(out).encode() in arg for arg in cmdline) and f"RANK={rank}".encode() in environ):
            return int(pid)
    return None


def run_scenario(s: Scenario, out: Path, data_prefix: str, port: int, deadline_s: float = DEADLINE_S) -> dict:
    """Run ``s`` into ``out`` (emptied first); the raw facts: wall seconds, exit status, output, records."""
    from megatron_tah.restart import TRACKER

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = script_env(out, data_prefix, port, RATE, ITERS, SAVE_INTERVAL=str(SAVE_INTERVAL), RESTART_DELAY="1",
                     RESTARTS="2", **dict(s.env))
    if s.fault:
        env.update(TAH_FAULT=s.fault, TAH_FAULT_DONE=str(out / "fault.done"))
    command = ["bash", str(ROOT / "scripts" / "pretrain_gpt.sh"), "2", *TINY, "--tah-peer-timeout-s", f"{BOUND_S:g}",
               *s.flags]
    output_path = out.parent / f"{out.name}.out"
    start, injected, resume_at, hang = time.monotonic(), None, None, False
    with open(output_path, "w") as sink:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            while proc.poll() is None:
                now = time.monotonic()
                if now - start > deadline_s:
                    hang = True
                    break
                log = out / "log.jsonl"
                done = len(log.read_text().splitlines()) if log.exists() else 0
                if (s.signal and injected is None and done >= FAULT_ITERATION
                        and (out / "ckpt" / TRACKER).exists()):
                    pid = stage_pid(out, 1)
                    if pid is not None:
                        os.kill(pid, signal.SIGKILL if s.signal == "kill" else signal.SIGSTOP)
                        injected = (pid, now)
                        if s.resume_after_s is not None:
                            resume_at = now + s.resume_after_s
                if resume_at is not None and now >= resume_at:
                    _signal(injected[0], signal.SIGCONT)
                    resume_at = None
                time.sleep(0.1)
        finally:
            if proc.poll() is None:
                _stop_group(proc)
    wall = time.monotonic() - start
    if s.fault and (out / "fault.done").exists():
        injected = (None, None)
    (out / "facts.json").write_text(json.dumps({"wall_s": wall, "status": proc.returncode, "hang": hang,
                                                "injected": injected is not None}))
    return read_facts(out)


def read_facts(out: Path) -> dict:
    """A finished scenario's facts from its directory (``--rejudge`` reads them without running again)."""
    from megatron_tah.megatron.run_log import read_records

    facts = json.loads((out / "facts.json").read_text())
    records = read_records(out / "log.jsonl") if (out / "log.jsonl").exists() else []
    return {**facts, "output": (out.parent / f"{out.name}.out").read_text(errors="replace"), "records": records}


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _stop_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGCONT, signal.SIGTERM):
        _signal(-proc.pid, sig)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        _signal(-proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


# ----- what it means ----------------------------------------------------------------------------------
def first_error(output: str) -> re.Match | None:
    """The error a run stopped on (its name: group 1, its message: group 2): the restart loop's account of its
    first failed attempt (the first error a rank recorded), else -- output without it -- the first traceback's
    error that names its link, else the first."""
    if cause := CAUSE.search(output):
        return cause
    errors = list(ERROR.finditer(output))
    return next((m for m in errors if WHERE.search(m.group(2))), errors[0] if errors else None)


def judge(name: str, facts: dict, reference: dict | None) -> dict:
    """One table row from a run's facts: outcome, the error's first words and where, attempts, time lost,
    losses against the reference's; ``ok``: continued or stopped-with-names-then-resumed, nothing lost."""
    output = facts["output"]
    attempts = int(m.group(1)) if (m := re.search(r"after (\d+) attempts", output)) else 1
    error = first_error(output)
    where = WHERE.search(error.group(2)) if error else None
    error_name, where_text = (error.group(1) if error else None), (where.group(1) if where else None)
    if error is None and (root := ROOT_CAUSE.search(output)):  # killed: torchrun stopped the job first
        error_name = "torchrun: a worker died"
        where_text = f"rank {root.group(1)}, exit code {root.group(2)}" + (f" {root.group(3)}" if root.group(3) else "")
    losses = [r.get("lm_loss") for r in facts["records"]]
    iterations = [r["iteration"] for r in facts["records"]]
    complete = iterations == list(range(1, ITERS + 1))
    if facts["hang"]:
        outcome = "hang"
    elif facts["status"] != 0:
        outcome = "failed"
    elif attempts > 1:
        outcome = "stopped, resumed by the script"
    else:
        outcome = "continued"
    equal = None
    if reference is not None and complete:
        equal = losses == [r.get("lm_loss") for r in reference["records"]]
    lost = time_lost(facts, reference, output)
    named = bool(where_text) if attempts > 1 else True
    ok = outcome in ("continued", "stopped, resumed by the script") and complete and equal is not False and named
    step_ms = statistics.median(ms) if (ms := [r["ms"] for r in facts["records"][2:] if r.get("ms")]) else None
    return {"scenario": name, "injected": facts["injected"], "outcome": outcome, "attempts": attempts,
            "error": error_name, "where": where_text,
            "message": (f"{error.group(1)}: {error.group(2)}"[:240] if error else None), "status": facts["status"],
            "wall_s": round(facts["wall_s"], 1), "time_lost_s": round(lost, 1), "iterations": len(iterations),
            "losses_equal": equal, "step_ms": step_ms, "ok": ok}


def time_lost(facts: dict, reference: dict | None, output: str) -> float:
    """Seconds the fault cost: the restart loop's own account when the run restarted (work redone, the
    wait, the new attempt's start-up), else the iterations' summed time over the reference's (start-up,
    which a loaded machine makes vary by tens of seconds, left out)."""
    if m := re.search(r"time lost to failures: ([0-9.]+) s", output):
        return float(m.group(1))
    if reference is None:
        return 0.0
    total = lambda records: sum(r.get("ms") or 0.0 for r in records) / 1e3  # noqa: E731
    return total(facts["records"]) - total(reference["records"])


# ----- the page -----------------------------------------------------------------------------------------
def table_markdown(rows: list[dict]) -> str:
    lines = ["| scenario | fault | what the run did | error, where | time lost | losses after vs uninterrupted "
             "| median step |", "|---|---|---|---|---:|---|---:|"]
    for r in rows:
        what = scenario(r["scenario"]).what
        err = f"`{r['error']}`, {r['where']}" if r["error"] and r["where"] else (f"`{r['error']}`" if r["error"] else "-")
        if r["scenario"] == "reference":
            losses, lost = "(the reference)", f"({r['wall_s']:.0f} s in all)"
        else:
            losses = {True: "equal, bit for bit", False: "**differ**", None: "n/a"}[r["losses_equal"]]
            lost = f"{r['time_lost_s']:+.0f} s"
        s = scenario(r["scenario"])
        outcome = r["outcome"] + ("" if r["injected"] or not (s.signal or s.fault) else " (fault not injected)")
        step = f"{r['step_ms']:.0f} ms" if r.get("step_ms") else "-"
        lines.append(f"| {r['scenario']} | {what} | {outcome} | {err} | {lost} | {losses} | {step} |")
    return "\n".join(lines)


def faults_block(result: dict, page: Path) -> str:
    return "\n".join([
        f"Measured by `python -m benchmarks.faults --write {page.as_posix()}` ({result['date']}, {result['cpu']}, "
        f"{result['cores']} cores): `scripts/pretrain_gpt.sh 2` behind an emulated {RATE} link (`RATE`, "
        f"`LINK=emulate`: the script's defaults for a slow link, checksums on) on a tiny model, {ITERS} iterations, a checkpoint "
        f"every {SAVE_INTERVAL}, `--tah-peer-timeout-s {BOUND_S:g}`, `RESTARTS=2`; the fault once the run is past "
        f"its first checkpoint (in-process faults at iteration {FAULT_ITERATION}). Time lost: the restart loop's "
        f"own account when the run restarted (work redone since the checkpoint, the wait, the new attempt's "
        f"start-up), else the iterations' time over the uninterrupted run's; on a machine shared with other "
        f"jobs both carry its load's noise (the median step column shows how much).",
        "",
        table_markdown(result["rows"])])


def write_page(result: dict, page: Path) -> None:
    """The measured blocks of ``page`` (between their markers) and ``docs/data/faults.json`` beside it; parts
    not run this time keep the JSON's earlier measurement."""
    from . import checksum_cost, ratedrop

    data = page.parent / "data" / "faults.json"
    data.parent.mkdir(parents=True, exist_ok=True)
    merged = json.loads(data.read_text()) if data.exists() else {}
    merged.update({k: v for k, v in result.items() if v is not None})
    data.write_text(json.dumps(merged, indent=1) + "\n")
    text = page.read_text()
    if merged.get("rows"):
        text = replace_block(text, "faults", faults_block(merged, page))
    drops = [merged[key] for key in ["ratedrop", *sorted(k for k in merged if k.startswith("ratedrop@"))]
             if merged.get(key)]  # the default rate's, then each other rate's (--ratedrop-rate)
    if drops:
        text = replace_block(text, "ratedrop", "\n\n".join(
            f"Measured by `python -m benchmarks.faults --only ratedrop"
            f"{'' if rd.get('rate', ratedrop.RATE) == ratedrop.RATE else ' --ratedrop-rate ' + rd['rate']} --write "
            f"{page.as_posix()}` ({rd['date']}, {rd['cpu']}, {rd['cores']} cores): " + ratedrop.markdown(rd)
            for rd in drops))
    if merged.get("checksum_cost"):
        cc = merged["checksum_cost"]
        text = replace_block(text, "checksum", f"Measured by `python -m benchmarks.faults --only checksum-cost --write "
                        f"{page.as_posix()}` ({cc['date']}, {cc['cpu']}, {cc['cores']} cores, one thread):\n\n"
                        + checksum_cost.table_markdown(cc["rows"]))
    page.write_text(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=__doc__.split("\n")[0])
    parser.add_argument("--only", help="comma list of scenarios (the reference always runs first)")
    parser.add_argument("--out", type=Path, default=Path("runs/faults"))
    parser.add_argument("--write", type=Path, help="the page whose measured block is replaced (docs/RELIABILITY.md)")
    parser.add_argument("--port", type=int, default=29700)
    parser.add_argument("--rejudge", action="store_true", help="judge the runs already under --out, run nothing")
    parser.add_argument("--ratedrop-rate", default=None, help="ratedrop: the link's rate before the drop "
                        "(default: ratedrop.RATE)")
    args = parser.parse_args(argv)
    names = [n for n in (args.only or ",".join([*(s.name for s in SCENARIOS), *PARTS])).split(",") if n]
    parts = [n for n in names if n in PARTS]
    faults = [scenario(n) for n in names if n not in PARTS and n != "reference"]
    chosen = [scenario("reference")] + faults if faults or "reference" in names else []
    from benchmarks.common.runner import host_info
    from megatron_tah.data import prepare

    from . import checksum_cost, ratedrop

    out = args.out.resolve()
    host = host_info()
    stamp = {"date": time.strftime("%Y-%m-%d"), "cpu": host["cpu"], "cores": host["cores"]}
    prefix = out / "data" / "shk"
    if chosen and not args.rejudge and not Path(f"{prefix}_valid_text_document.idx").is_file():
        prepare("shakespeare", prefix, max_docs=6, max_tokens=20_000)
    rows, reference = [], None
    for i, s in enumerate(chosen):
        print(f"[faults {time.strftime('%H:%M:%S')}] {s.name}: {s.what}", flush=True)
        facts = read_facts(out / s.name) if args.rejudge else run_scenario(s, out / s.name, str(prefix),
                                                                            args.port + 10 * i)
        if s.name == "reference":
            reference = facts
        row = judge(s.name, facts, reference)
        rows.append(row)
        print(f"[faults] {s.name}: {row['outcome']}, {row['error'] or 'no error'} {row['where'] or ''}, "
              f"{row['time_lost_s']:+.1f} s, losses equal: {row['losses_equal']}", flush=True)
    result = {**stamp, "bound_s": BOUND_S, "iters": ITERS, "save_interval": SAVE_INTERVAL, "rows": rows} if rows else {}
    ok = all(r["ok"] for r in rows if r["scenario"] not in {"corrupt-unchecked"})  # silent by design: the row shows it
    if rows:
        print(table_markdown(rows))
    if "ratedrop" in parts:
        print(f"[faults {time.strftime('%H:%M:%S')}] ratedrop: the link's rate falls {ratedrop.FACTOR:g}x, auto "
              "follows; then each candidate fixed at the dropped rate", flush=True)
        facts = (ratedrop.read(out) if args.rejudge
                 else ratedrop.measure(out, ratedrop.prepare_data(out), args.port + 10 * len(SCENARIOS) + 10,
                                       args.ratedrop_rate or ratedrop.RATE))
        row = {**stamp, **ratedrop.judge(facts)}
        result["ratedrop" if row["rate"] == ratedrop.RATE else f"ratedrop@{row['rate']}"] = row  # a rate's own row
        print(ratedrop.markdown(row))
        ok = ok and row["ok"]
    if "checksum-cost" in parts and not args.rejudge:
        result["checksum_cost"] = {**stamp, "rows": checksum_cost.measure()}
        print(checksum_cost.table_markdown(result["checksum_cost"]["rows"]))
    if args.write:
        write_page(result, args.write)
        print(f"[faults] wrote {args.write}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
