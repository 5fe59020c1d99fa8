"""The fault harness's rate-drop scenario: the link's rate falls 10x mid-run and comes back, ``auto`` on both
directions, against every candidate codec run fixed at the dropped rate.

``scripts/pretrain_gpt.sh 2`` on the CPU with the in-process link emulation (``LINK=emulate``, ``RATE``),
``--tah-forward-codec auto --tah-backward-codec auto --tah-auto-interval INTERVAL``; ``site/sitecustomize.py``'s
``ratedrop`` fault divides the emulated rate by ``FACTOR`` for the messages of log iterations ``DROP[0]`` to
``DROP[1]`` (Megatron's ``args.curr_iteration`` is the log iteration minus one) in both ranks. The fixed runs
(``FIXED_ITERS`` iterations each) run every default candidate on both directions at the dropped rate from the
start. What is read from the logs (``log.jsonl``, one record per iteration):

* per link direction (``0->1`` activations, ``1->0`` gradients), the codec of every iteration, and for a link
  uncompressed (``none``) before the drop the lag: iterations at the dropped rate that still sent it
  (``lag_down``), and iterations at the restored rate before the link is back on a codec of that size
  (``lag_up``); a link compressed already before the drop has nothing to follow (``needs_switch`` false);
* tokens/s (from the median iteration time) of the auto runs over the drop once both directions had
  switched (``steady``) and over the whole drop (``whole``: the lag's iterations included), against the best
  fixed codec's tokens/s at the dropped rate (its iterations after the first ``SKIP``), every run ``REPEATS``
  times and pooled;
* auto's own cost beyond its choice: auto with ``PINNED`` as its one candidate (its trailers, rate meter and
  announcements running, nothing to choose) against ``PINNED`` fixed, both at the dropped rate, per round;
* auto's probation verdicts (``back to``) from the output;
* which candidates auto's accuracy floor left out (its ``accuracy floor`` lines): the tokens/s goal is judged
  against the best fixed codec auto may choose (``best_allowed``); the best of all is shown beside it.

``--ratedrop-rate`` sets the rate before the drop (``RATE`` by default).
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from . import ROOT, script_env
RATE, FACTOR = "10gbit", 10  # on 2 cores: none wins at 10 Gbit/s, a compressed codec at 1 Gbit/s
INTERVAL = 3
ITERS, DROP = 40, (12, 25)  # log iterations whose messages see the dropped rate
FIXED_ITERS, SKIP = 16, 4
REPEATS = 2  # every run twice, alternating (a shared machine drifts by 20% between runs: pooled medians)
SEQ, MICRO, GLOBAL, VOCAB = 128, 4, 16, 1024
MODEL = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", str(SEQ),
         "--max-position-embeddings", str(SEQ), "--micro-batch-size", str(MICRO), "--global-batch-size",
         str(GLOBAL), "--eval-interval", "1000", "--log-interval", "1", "--vocab-size", str(VOCAB)]
DIRECTIONS = {"0->1": "fwd", "1->0": "bwd"}  # auto's link key -> the record's bytes prefix
PROBATION = re.compile(r"megatron_tah: auto .*?: back to \w+")
FLOOR = re.compile(r"megatron_tah: auto (forward|backward)[^:]*: accuracy floor \S+ \(relative round-trip error\); "
                   r"left out: ([^;\n]*)")
DEADLINE_S = 900.0
MIN_TOKENS_RATIO = 0.97  # auto's tokens/s during the drop (once switched) against the best fixed codec's
PINNED = "fixedpoint4"  # auto's one candidate in the run that prices its machinery (the cheapest codec on a CPU)


def dropped_rate(rate: str = RATE) -> str:
    from megatron_tah.units import parse_bandwidth

    return f"{parse_bandwidth(rate) / FACTOR:.0f}"


def candidate_flags(name: str) -> list[str]:
    """Candidate ``name`` (``config.auto``'s) fixed on both directions, as flags: a preset, or its fields."""
    from megatron_tah.config import candidate_fields
    from megatron_tah.megatron.arguments import fields_flags

    return fields_flags(candidate_fields(name))


def run(out: Path, data_prefix: str, port: int, rate: str, iters: int, flags: list[str], fault: str | None = None,
        codec: str | None = None) -> dict:
    """One run of ``scripts/pretrain_gpt.sh 2`` into ``out`` (emptied first): its records and output."""
    from megatron_tah.megatron.run_log import read_records

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = script_env(out, data_prefix, port, rate, iters, SAVE="none", RESTARTS="0",
                     CODEC=codec or "none", BWD_CODEC=codec or "none")  # (none: the flags' preset or codecs decide)
    if fault:
        env["TAH_FAULT"] = fault
    output = out.parent / f"{out.name}.out"
    start = time.monotonic()
    with open(output, "w") as sink:
        proc = subprocess.run(["bash", str(ROOT / "scripts" / "pretrain_gpt.sh"), "2", *MODEL, *flags], cwd=ROOT,
                              env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=DEADLINE_S)
    log = out / "log.jsonl"
    records = [r for r in read_records(log) if "ms" in r] if log.exists() else []
    facts = {"status": proc.returncode, "wall_s": time.monotonic() - start, "records": records}
    (out / "facts.json").write_text(json.dumps({k: v for k, v in facts.items() if k != "records"}))
    return {**facts, "output": output.read_text(errors="replace")}


def read(out: Path) -> dict:
    """The facts of runs already under ``out`` (``--rejudge``)."""
    from megatron_tah.config.auto import DEFAULT_CANDIDATES
    from megatron_tah.megatron.run_log import read_records

    def one(path: Path) -> dict:
        facts = json.loads((path / "facts.json").read_text())
        records = [r for r in read_records(path / "log.jsonl") if "ms" in r] if (path / "log.jsonl").exists() else []
        return {**facts, "records": records,
                "output": (path.parent / f"{path.name}.out").read_text(errors="replace")}

    setup = out / "ratedrop.json"
    return {"rate": json.loads(setup.read_text())["rate"] if setup.exists() else RATE,
            "auto": [one(out / f"ratedrop-auto-{rep}") for rep in range(REPEATS)
                     if (out / f"ratedrop-auto-{rep}" / "facts.json").exists()],
            "fixed": {name: [one(out / f"ratedrop-{name}-{rep}") for rep in range(REPEATS)
                             if (out / f"ratedrop-{name}-{rep}" / "facts.json").exists()]
                      for name in DEFAULT_CANDIDATES},
            "pinned": [one(out / f"ratedrop-pinned-{rep}") for rep in range(REPEATS)
                       if (out / f"ratedrop-pinned-{rep}" / "facts.json").exists()]}


def prepare_data(out: Path) -> str:
    """The shipped corpus with a compact vocabulary (``VOCAB``): the output layer's compute stays small beside the
    messages, so that the link's time is a large share of a step."""
    from megatron_tah.data import prepare

    prefix = out / "data" / "rd"
    if not Path(f"{prefix}_valid_text_document.idx").is_file():
        prepare("shakespeare", prefix, max_docs=6, max_tokens=20_000, vocab_limit=VOCAB)
    return str(prefix)


def measure(out: Path, data_prefix: str, port: int, rate: str = RATE) -> dict:
    """``REPEATS`` rounds of: the auto run with the drop from ``rate``, then each default candidate fixed at the
    dropped rate, then auto pinned to ``PINNED`` at the dropped rate."""
    from megatron_tah.config.auto import DEFAULT_CANDIDATES

    first, last = DROP
    facts = {"rate": rate, "auto": [], "fixed": {name: [] for name in DEFAULT_CANDIDATES}, "pinned": []}
    for rep in range(REPEATS):
        print(f"[faults {time.strftime('%H:%M:%S')}] ratedrop: auto, the rate {FACTOR:g}x lower from iteration "
              f"{first} to {last} (round {rep + 1} of {REPEATS})", flush=True)
        facts["auto"].append(run(out / f"ratedrop-auto-{rep}", data_prefix, port, rate, ITERS,
                                 ["--tah-auto-interval", str(INTERVAL)],
                                 fault=f"ratedrop:*:{first - 1}:{last - 1}:{FACTOR:g}", codec="auto"))
        for i, name in enumerate(DEFAULT_CANDIDATES):
            print(f"[faults {time.strftime('%H:%M:%S')}] ratedrop: {name} fixed at {dropped_rate(rate)} bit/s",
                  flush=True)
            facts["fixed"][name].append(run(out / f"ratedrop-{name}-{rep}", data_prefix, port + 1 + i,
                                            dropped_rate(rate), FIXED_ITERS, candidate_flags(name)))
        print(f"[faults {time.strftime('%H:%M:%S')}] ratedrop: auto pinned to {PINNED} at {dropped_rate(rate)} bit/s",
              flush=True)
        facts["pinned"].append(run(out / f"ratedrop-pinned-{rep}", data_prefix, port + 1 + len(DEFAULT_CANDIDATES),
                                   dropped_rate(rate), FIXED_ITERS,
                                   ["--tah-auto-candidates", PINNED, "--tah-auto-max-error", "1",  # (no floor)
                                    "--tah-auto-interval", str(INTERVAL)],
                                   codec="auto"))
    (out / "ratedrop.json").write_text(json.dumps({"rate": rate}))
    return facts


def _ms(records: list[dict], first: int | None, last: int) -> list[float]:
    return [] if first is None else [r["ms"] for r in records if first <= r["iteration"] <= last and r.get("ms")]


def _links(records: list[dict]) -> dict:
    """Per link direction of one auto run: its codecs and lags (module docstring)."""
    first, last = DROP
    by_iteration = {r["iteration"]: r for r in records}
    links = {}
    for key, prefix in DIRECTIONS.items():
        codec = {k: r.get("auto", {}).get(key, {}).get("codec") for k, r in by_iteration.items()}
        nbytes = {k: r.get(f"{prefix}_wire_bytes") or 0 for k, r in by_iteration.items()}
        before = nbytes.get(first - 1, 0)
        uncompressed = codec.get(first - 1) == "none"  # a compressed link has nothing to follow
        down = next((k for k in range(first, last + 1) if k in nbytes and nbytes[k] < 0.9 * before), None)
        up = next((k for k in range(last + 1, ITERS + 1) if k in nbytes and nbytes[k] >= 0.9 * before), None)
        links[key] = {"before": codec.get(first - 1), "during": codec.get(last), "after": codec.get(ITERS),
                      "needs_switch": uncompressed,
                      "lag_down": (None if down is None else down - first) if uncompressed else 0,
                      "lag_up": (None if up is None else up - (last + 1)) if uncompressed else None,
                      "timeline": [codec.get(k) for k in range(1, ITERS + 1)]}
    return links


def judge(facts: dict) -> dict:
    """The scenario's row (module docstring): per auto run its links' codecs and lags; tokens/s from the median
    iteration time pooled over the runs, against the best fixed codec's; probation verdicts."""
    first, last = DROP
    tokens = GLOBAL * SEQ
    rounds, steady, whole = [], [], []
    for run_ in facts["auto"]:
        links = _links(run_["records"])
        switched = [link["lag_down"] for link in links.values()]
        steady_from = first + max(switched) if None not in switched else None
        steady += _ms(run_["records"], steady_from, last)
        whole += _ms(run_["records"], first, last)
        rounds.append({"status": run_["status"], "iterations": len(run_["records"]), "links": links,
                       "probation": PROBATION.findall(run_["output"]),
                       # the way back is reported, not required: at the restored rate the codecs may nearly tie
                       "ok": (run_["status"] == 0 and len(run_["records"]) == ITERS and None not in switched
                              and any(link["needs_switch"] for link in links.values()))})
    kept = lambda runs: [m for r in runs if r["status"] == 0 for m in _ms(r["records"], SKIP + 1, FIXED_ITERS)]  # noqa: E731
    fixed = {name: statistics.median(ms) for name, runs in facts["fixed"].items() if (ms := kept(runs))}
    pinned, pinned_kept = facts.get("pinned", []), kept(facts.get("pinned", []))
    pinned_ms = statistics.median(pinned_kept) if pinned_kept else None
    fixed_runs = facts["fixed"].get(PINNED, [])
    pinned_rounds = [statistics.median(kept([fixed_run])) / statistics.median(kept([run_]))
                     for fixed_run, run_ in zip(fixed_runs, pinned) if kept([fixed_run]) and kept([run_])]
    best = min(fixed, key=fixed.get, default=None)
    left_out = sorted({item.split()[0] for r in facts["auto"] for _, items in FLOOR.findall(r["output"])
                       for item in items.split(", ") if item.strip() and item != "nothing"})
    allowed = {name: ms for name, ms in fixed.items() if name not in left_out}
    best_allowed = min(allowed, key=allowed.get, default=None)
    median = lambda ms: statistics.median(ms) if ms else None  # noqa: E731
    per_s = lambda ms: None if not ms else tokens / (ms / 1e3)  # noqa: E731
    ratio = lambda ms, to=best: None if not ms or to is None else fixed[to] / ms  # noqa: E731
    lags = [link["lag_down"] for r in rounds for link in r["links"].values()]
    goal = ratio(median(steady), best_allowed)
    return {"rate": facts.get("rate", RATE), "rounds": rounds, "links": rounds[0]["links"] if rounds else {},
            "lag_down_intervals": None if not lags or None in lags else max(lags) / INTERVAL,
            "tokens_per_s": {"steady": per_s(median(steady)), "whole": per_s(median(whole)),
                             "fixed": {name: per_s(ms) for name, ms in fixed.items()}},
            "best_fixed": best, "ratio_steady": ratio(median(steady)), "ratio_whole": ratio(median(whole)),
            "left_out": left_out, "best_allowed": best_allowed, "ratio_allowed": goal,
            "probation": [line for r in rounds for line in r["probation"]],
            "pinned": None if pinned_ms is None or PINNED not in fixed else {
                "codec": PINNED, "tokens_per_s": per_s(pinned_ms), "ratio": fixed[PINNED] / pinned_ms,
                "rounds": pinned_rounds},
            "ok": bool(rounds) and all(r["ok"] for r in rounds),
            "tokens_goal_met": goal is not None and goal >= MIN_TOKENS_RATIO}


def markdown(row: dict) -> str:
    """The scenario's paragraph and table for the page."""
    first, last = DROP
    lines = [f"`scripts/pretrain_gpt.sh 2`, a tiny model ({MODEL[1]} layers of hidden {MODEL[3]}, sequence {SEQ}, "
             f"{GLOBAL // MICRO} micro-batches of {MICRO}), the emulated link at {row.get('rate', RATE)}; from iteration {first} to "
             f"{last} its rate is {FACTOR:g}x lower, then restored; `--tah-forward-codec auto --tah-backward-codec "
             f"auto --tah-auto-interval {INTERVAL}`. The fixed runs send one candidate both ways at the dropped rate "
             f"for {FIXED_ITERS} iterations (tokens/s over the last {FIXED_ITERS - SKIP}). Every run {REPEATS} times, "
             "alternating; tokens/s from the median iteration time of the runs pooled.", "",
             "| link | codec before | during the drop | after | switched after (iterations at the dropped rate) "
             "| back after (iterations at the restored rate) |", "|---|---|---|---|---:|---:|"]
    for i, round_ in enumerate(row["rounds"]):
        for key, link in round_["links"].items():
            name = {"0->1": "stage 0 -> 1 (activations)", "1->0": "stage 1 -> 0 (gradients)"}[key]
            down = link["lag_down"] if link["needs_switch"] else "(compressed already)"
            lines.append(f"| {name}, run {i + 1} | {link['before']} | {link['during']} | {link['after']} | "
                         f"{'-' if down is None else down} | {'-' if link['lag_up'] is None else link['lag_up']} |")
    tps = row["tokens_per_s"]
    fixed = ", ".join(f"{name} {value:.0f}" for name, value in sorted(tps["fixed"].items(), key=lambda kv: -kv[1])
                      if value)
    fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    ratio = lambda v: "-" if v is None else f"{v:.3f}x"  # noqa: E731
    allowed = row.get("best_allowed", row["best_fixed"])
    floor = (f"; auto's accuracy floor left out {', '.join(row['left_out'])}, so the goal is judged against the best "
             f"fixed codec it may choose, {allowed}: {ratio(row['ratio_allowed'])}" if row.get("left_out") else "")
    lines += ["", f"Tokens/s at the dropped rate: auto {fmt(tps['steady'])} once both directions had switched "
              f"({ratio(row['ratio_steady'])} the best fixed codec, {row['best_fixed']}{floor}), {fmt(tps['whole'])} over "
              f"the whole drop, the switch's lag included ({ratio(row['ratio_whole'])}; goal: >= {MIN_TOKENS_RATIO:g}x "
              f"once switched: {'met' if row.get('tokens_goal_met') else 'not met'}); fixed codecs: {fixed}. "
              f"Probation verdicts: {len(row['probation'])}"
              + (f" (`{row['probation'][0]}`)" if row["probation"] else "") + "."]
    if row.get("pinned"):
        pin = row["pinned"]
        lines[-1] += (f" Auto's own cost, its choice aside: auto with `{pin['codec']}` as its one candidate (trailers, "
                      f"rate meter and announcements running) ran {fmt(pin['tokens_per_s'])} tokens/s at the dropped "
                      f"rate, {ratio(pin['ratio'])} `{pin['codec']}` fixed (per round: "
                      f"{', '.join(ratio(r) for r in pin['rounds'])}).")
    return "\n".join(lines)
