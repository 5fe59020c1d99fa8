"""``python -m benchmarks.real_model.coder_cost``: what the lossless coder costs in the real pipeline.

    python -m benchmarks.real_model.coder_cost --out runs/coder_cost              # lowrank_h3_rn, depth 8, 12 steps
    python -m benchmarks.real_model.coder_cost --out runs/coder_cost --write docs/CODECS.md

Short runs of the users' path -- the real pipeline, one gloo process per stage, SmolLM2-135M fine-tuned on the
real-model study's schedule (``runs.pipeline_run``; model and corpora prepared under ``--out`` as the study
prepares them) -- with the same codec, seed and steps, with ``--tah-entropy-coding`` and without, in the order
with, without, without, with, ... (``--repeats`` pairs), so that a load that drifts weighs on both alike.
From each run's log, over its training iterations after the first two (evaluations are counted apart):

* ``codec_ms``: the stages' encode + decode time per iteration, summed over the stages (the coder's included);
* ``ms``: the iteration's wall time (an iteration followed by an evaluation left out);
* bits per value each way on the wire (the codec's statistics), and both ways together as the WAN ledger billed
  them: the pipeline's bytes (``wan.pipeline.codec_bytes``, both directions) over the values one direction carries.

The verdict is the ratio of the medians of ``codec_ms`` with and without the coder (goal: at most 1.5x).
``--write PAGE`` puts the table between ``<!-- coder_cost:begin -->`` and ``<!-- coder_cost:end -->`` and
writes ``docs/data/coder_cost.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from datetime import date
from pathlib import Path

from ..common.pages import replace_block
from ..common.runner import ReproduceError, execute_all, host_info, load_average, read_log, say
from . import runs

CODER_FLAG = "--tah-entropy-coding"
SKIP = 2  # start-up iterations left out
GOAL = 1.5  # codec time per iteration with the coder over without, at most


def plan(codec: str, seed: int, depth: int, steps: int, repeats: int, model_dir: Path, data: dict,
         size: runs.Size) -> list:
    """The runs, in the order they run: with, without, without, with, ... (``repeats`` pairs)."""
    todo = []
    for i in range(repeats):
        order = (True, False) if i % 2 == 0 else (False, True)
        for coded in order:
            run = runs.pipeline_run(codec, seed, size, model_dir, data, depth,
                                    flags=(CODER_FLAG,) if coded else (), exit=steps)
            name = f"{'coded' if coded else 'plain'}_{run.name}_r{i + 1}"
            todo.append(dataclasses.replace(run, name=name, info={**run.info, "coded": coded, "repeat": i + 1}))
    return todo


def summary(records: list[dict]) -> dict:
    """Medians over a run's steady training iterations, and its wire bits per value each way."""
    evaluated = {r["iteration"] for r in records if "valid_loss" in r}
    steady = [r for r in records if r["iteration"] > SKIP and "lm_loss" in r]
    if not steady:
        raise ReproduceError(f"no training iteration after the first {SKIP}")
    tah = lambda d, k: sum(r["tah"][d][k] for r in steady)  # noqa: E731
    wall = [r["ms"] for r in steady if r.get("ms") and r["iteration"] - 1 not in evaluated]
    values = tah("forward", "raw_bytes") / 2  # values per direction (bf16 messages, the same shape both ways)
    return {"iterations": len(steady), "codec_ms": statistics.median(r["codec_ms"] for r in steady),
            "ms": statistics.median(wall) if wall else None,
            "forward_bits": 16 * tah("forward", "wire_bytes") / tah("forward", "raw_bytes"),
            "backward_bits": 16 * tah("backward", "wire_bytes") / tah("backward", "raw_bytes"),
            "ledger_bits": 8 * sum(r["wan"]["pipeline"]["codec_bytes"] for r in steady) / values}


def score(todo: list, out: Path, metas: dict) -> dict:
    rows = []
    for run in todo:
        rows.append({"run": run.name, "coded": run.info["coded"], "repeat": run.info["repeat"],
                     "load": metas[run.name].get("load_before"), **summary(read_log(out / f"{run.name}.jsonl"))})
    med = lambda coded, k: statistics.median(r[k] for r in rows if r["coded"] == coded)  # noqa: E731
    first = todo[0].info
    return {"codec": first["codec"], "depth": first["depth"], "seed": first["seed"], "steps": todo[0].iterations(),
            "rows": rows, "ratio": med(True, "codec_ms") / med(False, "codec_ms"),
            "codec_ms": {"coded": med(True, "codec_ms"), "plain": med(False, "codec_ms")},
            "bits": {k: {"coded": med(True, k), "plain": med(False, k)}
                     for k in ("forward_bits", "backward_bits", "ledger_bits")},
            "goal": GOAL, "host": host_info()["cpu"], "date": date.today().isoformat()}


def table(result: dict) -> str:
    r, bits = result, result["bits"]
    verdict = "meets" if r["ratio"] <= r["goal"] else "misses"
    lines = [f"Measured by `python -m benchmarks.real_model.coder_cost --write docs/CODECS.md` on {r['host']} "
             f"({r['date']}): `{r['codec']}` on the real pipeline ({r['depth']} gloo processes, SmolLM2-135M, the "
             f"real-model study's schedule, seed {r['seed']}, {r['steps']} steps, messages `[128, 1, 576]`), with "
             f"`--tah-entropy-coding` (its default coder) and without, in turn; medians over each run's iterations "
             f"after the first {SKIP}, load average beside each run. The stages' codec time per iteration with the "
             f"coder is **{r['ratio']:.2f}x** the codec's alone ({verdict} the goal of {r['goal']:g}x).", "",
             "| run | coder | load | codec ms / iteration (stages summed) | ms / iteration | forward bits | "
             "backward bits | pipeline bits both ways (WAN ledger) |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in r["rows"]:
        ms = "-" if row["ms"] is None else f"{row['ms']:,.0f}"
        lines.append(f"| {row['run']} | {'on' if row['coded'] else 'off'} | {row['load']:.1f} | {row['codec_ms']:,.0f} "
                     f"| {ms} | {row['forward_bits']:.2f} | {row['backward_bits']:.2f} | {row['ledger_bits']:.2f} |")
    lines += ["", f"With the coder the wire carries {bits['ledger_bits']['coded']:.2f} bits per value both ways "
              f"against {bits['ledger_bits']['plain']:.2f} without it, for {r['codec_ms']['coded']:,.0f} against "
              f"{r['codec_ms']['plain']:,.0f} ms of codec time per iteration." + noise_text(r)]
    return "\n".join(lines)


def noise_text(result: dict) -> str:
    """A caveat where the load beside the runs moved their times more than the coder can have: a ratio below 1
    (the coder only adds work), or pairs of runs of one kind further apart than the ratio's distance from 1."""
    spread = [max(v) / min(v) - 1 for coded in (True, False)
              if len(v := [row["codec_ms"] for row in result["rows"] if row["coded"] is coded]) > 1 and min(v) > 0]
    loads = [row["load"] for row in result["rows"]]
    if result["ratio"] >= 1 and not any(s > abs(result["ratio"] - 1) for s in spread):
        return ""
    return (f" The load beside the runs ({min(loads):.0f}-{max(loads):.0f}) moved their codec times more than the coder"
            f" did (runs of one kind {max(spread, default=0):.0%} apart" + (", and the coder only adds work" if
                                                                          result["ratio"] < 1 else "")
            + "): this ratio measures the load more than the coder; a quiet machine measures the coder.")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.real_model.coder_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/coder_cost"))
    parser.add_argument("--size", choices=sorted(runs.SIZES), default="long", help="the model and schedule")
    parser.add_argument("--codec", default="lowrank_h3_rn")
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--repeats", type=int, default=1, help="pairs of runs (with, without the coder)")
    parser.add_argument("--write", type=Path, help="put the table into this page (docs/CODECS.md)")
    args = parser.parse_args(argv)
    if args.steps <= SKIP + 1:
        parser.error(f"--steps must exceed {SKIP + 1}: the first {SKIP} iterations are start-up")
    out = args.out.resolve()
    size = runs.SIZES[args.size]
    try:
        model_dir = runs.prepare_model(out, size)
        data = runs.prepare_data(out, model_dir, size)
        todo = plan(args.codec, args.seed, args.depth, args.steps, args.repeats, model_dir, data, size)
        say(f"coder cost: {len(todo)} runs of {args.codec} at depth {args.depth}, load {load_average():.1f}")
        metas = execute_all(todo, out, jobs=1, env={"OMP_NUM_THREADS": "1"})
        result = score(todo, out, metas)
    except ReproduceError as err:
        print(f"coder_cost: {err}", file=sys.stderr)
        return 1
    text = table(result)
    print(text)
    if args.write:
        page = args.write
        page.write_text(replace_block(page.read_text(), "coder_cost", text))
        data_dir = page.parent / "data"
        (data_dir / "coder_cost.json").write_text(json.dumps({**result, "text": text}, indent=1) + "\n")
        print(f"[coder_cost] wrote {page} and {data_dir / 'coder_cost.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
