"""``python -m benchmarks.speedrun.check``: the schedule simulator against timing runs behind the emulated wire.

    python -m benchmarks.speedrun.check --write  # bf16 and channel9 at 16 and 8 micro-batches (about 15 minutes
                                                 # on the 2-core machine); then regenerate the speedrun page

The speedrun's seconds per step come from the schedule simulator (``simulate.py``). This checks it where it
matters: the real pipeline (one process per stage, gloo, ``--tah-emulate-wire inbound`` at the speedrun page's
rate and latency) at every micro-batch count of ``--micro-batches``, the global batch fixed at the page's
(``micro_batch x micro_batches`` sequences), so that a schedule choice is measured before it is recommended.
Per micro-batch count: bf16 without a slow link (the compute step the simulator takes,
``simulate.compute_per_micro_batch``), then each codec behind the wire, one run at a time, ``--iters``
iterations each. Measured seconds per step: the median of the steps after the first ``SKIP``; simulated:
``simulate.simulate_step`` from that compute step and the codec's exact message bytes each way (codec compute
not counted, as on the speedrun page). Results go to ``docs/data/schedule_check.json``; the speedrun page shows
them (``render``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
from pathlib import Path

from ..common.runner import ReproduceError, execute_all, host_info, read_log
from ..common.codecs import CODECS, NEEDS_LINK, entropy_coded
from . import runs, simulate

SKIP = 2  # the first steps pay start-up (process groups, first messages): left out of the median
ROOT = Path(__file__).resolve().parents[2]
PAGE_JSON = ROOT / "docs" / "data" / "speedrun.json"
RESULT = ROOT / "docs" / "data" / "schedule_check.json"


def sized(size: runs.Size, micro_batches: int, iters: int) -> runs.Size:
    """``size`` with ``micro_batches`` micro-batches of the same global batch, timed over ``iters`` iterations."""
    sequences = size.micro_batch * size.micro_batches
    if micro_batches < 1 or sequences % micro_batches:
        raise ValueError(f"{micro_batches} micro-batches do not split the global batch of {sequences} sequences")
    return dataclasses.replace(size, micro_batch=sequences // micro_batches, micro_batches=micro_batches,
                               timing_iters=iters)


def measured_seconds(step_seconds: list[float], skip: int = SKIP) -> float:
    """The median step time after the first ``skip`` steps; ``ValueError`` with none left."""
    rest = list(step_seconds)[skip:]
    if not rest:
        raise ValueError(f"{len(step_seconds)} timed steps: none left after skipping {skip}")
    return statistics.median(rest)


def measured_message_nbytes(records: list[dict], size: runs.Size, skip: int = SKIP) -> tuple[float, float]:
    """Mean (forward, backward) bytes of one message in a timing run's log after ``skip`` steps (all links)."""
    messages = (size.stages - 1) * size.micro_batches
    return tuple(n / messages for n in runs.bytes_per_iteration(records, skip))


def simulated_seconds(codec: str, size: runs.Size, compute_s: float, link: runs.Link,
                      nbytes: tuple[float, float] | None = None) -> float:
    """The schedule simulator's step for ``codec`` at ``size`` behind ``link`` from a measured compute step, with
    its exact message bytes (``nbytes``: measured ones, for an entropy-coded codec)."""
    f, b = simulate.compute_per_micro_batch(compute_s, size.stages, size.micro_batches)
    fwd, bwd = runs.message_nbytes(codec, size) if nbytes is None else nbytes
    return simulate.simulate_step(size.stages, size.micro_batches, f, b, fwd, bwd, link.rate_bps, link.latency_s)


def run_check(codecs: list[str], micro_batches: list[int], size: runs.Size, link: runs.Link, data: list[str],
              out: Path, iters: int) -> list[dict]:
    """Time bf16 without the link and each codec behind it at each micro-batch count; one row per codec and count."""
    rows = []
    for m in micro_batches:
        at = sized(size, m, iters)
        nolink = dataclasses.replace(runs.timing_run("bf16", at, data, None), name=f"check_bf16_nolink_m{m}")
        timed = [dataclasses.replace(runs.timing_run(c, at, data, link), name=f"check_{c}_m{m}") for c in codecs]
        execute_all([nolink, *timed], out, jobs=1)  # one at a time: they measure time
        compute_s = measured_seconds(runs.step_seconds(read_log(out / f"{nolink.name}.jsonl")))
        for codec, run in zip(codecs, timed):
            records = read_log(out / f"{run.name}.jsonl")
            times, nbytes = runs.step_seconds(records), measured_message_nbytes(records, at)
            measured = measured_seconds(times)
            simulated = simulated_seconds(codec, at, compute_s, link, nbytes if entropy_coded(codec) else None)
            rows.append({"codec": codec, "micro_batches": m, "micro_batch": at.micro_batch, "compute_s": compute_s,
                         "measured_s": measured, "simulated_s": simulated, "error": simulated / measured - 1.0,
                         "message_nbytes": nbytes, "times": times})
    return rows


def render(result: dict) -> str:
    """The page's section: one row per codec and micro-batch count, and what the rows say."""
    rows = result["rows"]
    lines = ["| codec | micro-batches x sequences | compute step without the link (s) | measured s/step | "
             "simulated s/step | simulated vs measured |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['codec']} | {r['micro_batches']} x {r['micro_batch']} | {r['compute_s']:.3f} | "
                     f"{r['measured_s']:.3f} | {r['simulated_s']:.3f} | {100 * r['error']:+.1f}% |")
    plain = [r for r in rows if not _coded(r)]
    worst = max(plain, key=lambda r: abs(r["error"]))
    text = [f"Timing runs on {result['host']['cpu']} ({result['host']['cores']} cores), {result['date']}: the real "
            f"pipeline behind the page's emulated wire, {result['iters']} iterations each, the median step after the "
            f"first {result['skip']} (`python -m benchmarks.speedrun.check`). The simulator is within "
            f"{100 * abs(worst['error']):.1f}% of every run (worst: `{worst['codec']}` at {worst['micro_batches']} "
            f"micro-batches){_bias(plain)}."]
    for r in split_ratios(result):
        text.append(f"`{r['codec']}` at {r['fewer']} against {r['more']} micro-batches: measured "
                    f"{r['measured']:.3f}x, simulated {r['simulated']:.3f}x ({100 * r['error']:+.1f}%).")
    text += [entropy_sentence(coded, base) for coded, base in entropy_pairs(result)]
    return "\n".join(lines) + "\n\n" + " ".join(text)


def _coded(row: dict) -> bool:
    return row["codec"] in CODECS and entropy_coded(row["codec"])


def entropy_pairs(result: dict) -> list[tuple[dict, dict]]:
    """(entropy-coded row, the same codec's row without the coder) at the same micro-batch count, from the same
    session (the same compute step)."""
    rows = result["rows"]
    pairs = []
    for coded in (r for r in rows if _coded(r)):
        fields = {k: v for k, v in CODECS[coded["codec"]].items() if k != "tah_entropy_coding"}
        base = [r for r in rows if r["codec"] in CODECS and CODECS[r["codec"]] == fields
                and r["micro_batches"] == coded["micro_batches"] and r["compute_s"] == coded["compute_s"]]
        if base:
            pairs.append((coded, base[0]))
    return pairs


def entropy_sentence(coded: dict, base: dict) -> str:
    """What the lossless coder did to a codec's bytes and step in the timing runs."""
    (cf, cb), (bf, bb) = coded["message_nbytes"], base["message_nbytes"]
    return (f"`{coded['codec']}` (`{base['codec']}` through `--tah-entropy-coding`) sent {cf / bf - 1:+.1%} bytes per "
            f"activation message and {cb / bb - 1:+.1%} per gradient message (the frames' margin and tables included) "
            f"and measured {coded['measured_s'] / base['measured_s'] - 1:+.1%} seconds per step, the coder's time on "
            "this CPU included (the simulated column counts no codec time).")


def _bias(rows: list[dict]) -> str:
    """What the errors' signs say of the page's numbers, if they all agree."""
    if not all(r["error"] > 0 for r in rows):
        return ""
    base = [r["error"] for r in rows if r["codec"] == "bf16"]
    other = [r["error"] for r in rows if r["codec"] != "bf16"]
    if base and other and min(other) > max(base):
        return ("; it overestimates every step, the compressed codecs' more than bf16's, so the page's T ratios "
                "against bf16 err on the slow side")
    return "; it overestimates every step"


def split_ratios(result: dict) -> list[dict]:
    """Per codec timed at two or more micro-batch counts: its step at the fewest over its step at the most, measured
    and simulated, and the simulated ratio's error (negative: the simulator favours fewer micro-batches more)."""
    out = []
    for codec in dict.fromkeys(r["codec"] for r in result["rows"]):
        mine = sorted((r for r in result["rows"] if r["codec"] == codec), key=lambda r: r["micro_batches"])
        if len(mine) > 1:
            lo, hi = mine[0], mine[-1]
            measured, simulated = lo["measured_s"] / hi["measured_s"], lo["simulated_s"] / hi["simulated_s"]
            out.append({"codec": codec, "fewer": lo["micro_batches"], "more": hi["micro_batches"],
                        "measured": measured, "simulated": simulated, "error": simulated / measured - 1.0})
    return out


def load() -> dict | None:
    """The committed check's result, if there is one."""
    return json.loads(RESULT.read_text()) if RESULT.is_file() else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.speedrun.check", description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(runs.SIZES), default="full")
    parser.add_argument("--codecs", default="bf16,channel9", help="comma list of codecs that do not choose per link")
    parser.add_argument("--micro-batches", default="16,8", help="comma list of micro-batch counts (same global batch)")
    parser.add_argument("--iters", type=int, default=12, help="iterations of each timing run")
    parser.add_argument("--page", type=Path, default=PAGE_JSON, help="the speedrun page's JSON: its emulated wire")
    parser.add_argument("--out", type=Path, default=Path("runs/schedule_check"))
    parser.add_argument("--write", action="store_true", help=f"write {RESULT.relative_to(ROOT)}")
    parser.add_argument("--add", action="store_true",
                        help="with --write: keep the committed rows of other codecs and micro-batch counts")
    args = parser.parse_args(argv)
    codecs = [c for c in args.codecs.split(",") if c]
    bad = [c for c in codecs if c not in CODECS or c in NEEDS_LINK]
    if bad:
        parser.error(f"--codecs: {bad} unknown or choosing per link (their bytes are not fixed)")
    if args.iters <= SKIP:
        parser.error(f"--iters must exceed the {SKIP} start-up steps left out")
    page = json.loads(args.page.read_text())
    size = runs.SIZES[args.size]
    link = runs.Link(page["link"]["rate_bps"], page["link"]["latency_s"])
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    try:
        prefix, vocab = runs.prepare_data(out, size)
        rows = run_check(codecs, [int(m) for m in args.micro_batches.split(",")], size, link,
                         runs.data_flags(prefix, vocab), out, args.iters)
    except (ReproduceError, ValueError) as err:
        print(f"speedrun.check: {err}", file=sys.stderr)
        return 1
    kept = []
    if args.add and load() is not None:
        new = {(r["codec"], r["micro_batches"]) for r in rows}
        kept = [r for r in load()["rows"] if (r["codec"], r["micro_batches"]) not in new]
    result = {"date": datetime.date.today().isoformat(), "host": host_info(), "size": args.size,
              "link": page["link"], "iters": args.iters, "skip": SKIP, "rows": kept + rows}
    print(render(result))
    if args.write:
        RESULT.write_text(json.dumps(result, indent=1) + "\n")
        print(f"[speedrun.check] wrote {RESULT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
