"""``python -m benchmarks.real_model``: a real pretrained model trained through the codecs at pipeline depth 8.

    python -m benchmarks.real_model                          # SmolLM2-135M, every codec x 3 seeds (hours)
    python -m benchmarks.real_model --size tiny --out /tmp/r  # the same machinery on a random 4-layer model
    python -m benchmarks.real_model --write docs/REAL_MODEL.md  # run what is missing, then write the page

What it does, in order (runs already complete under ``--out`` are not run again; ``runs.py`` says what each
run is):

1. imports the model into a Megatron checkpoint and tokenizes the corpora with its tokenizer;
2. evaluates the untouched checkpoint (validation and damage samples, uncompressed);
3. runs bf16 (no codec) with every seed over the schedule and fixes the target from them
   (``benchmarks.speedrun.score.target_loss``: the worst seed's validation loss at 92% of the schedule);
   each seed's model where it first reached the target is evaluated;
4. runs every codec with every seed until its first validation at or below the target, at most
   ``max_factor`` schedules, and evaluates the model where it stopped;
5. with ``--pipeline CODEC``, runs that codec with the first seed as the real pipeline (bf16's schedule);
6. scores (``report.py``) and, with ``--write``, writes the page, its JSON and its plot.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from ..reproduce.runner import ReproduceError, execute_all, host_info, read_log
from ..speedrun import score
from ..speedrun.runs import CODECS
from . import runs

DEFAULT_SEEDS = (1234, 1235, 1236)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # runs side by side: torch's default threads each contend for the cores


def prune(ckpt: Path, keep: int | None) -> None:
    """Remove every saved iteration of ``ckpt`` but ``keep`` (None: remove the folder)."""
    if keep is None:
        shutil.rmtree(ckpt, ignore_errors=True)
        return
    for folder in ckpt.glob("iter_*"):
        if folder.is_dir() and int(folder.name[5:]) != keep:
            shutil.rmtree(folder, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.real_model", description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(runs.SIZES), default="full")
    parser.add_argument("--out", type=Path, default=Path("runs/real_model"))
    parser.add_argument("--codecs", default=",".join(runs.STUDY_CODECS), help="comma list of " + ", ".join(CODECS))
    parser.add_argument("--seeds", default=",".join(map(str, DEFAULT_SEEDS)))
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one process each, one thread)")
    parser.add_argument("--pipeline", help="a codec to run once as the real pipeline (the emulation's check)")
    parser.add_argument("--write", type=Path, help="write the page here (its JSON and plot under docs/data/)")
    args = parser.parse_args(argv)
    size = runs.SIZES[args.size]
    codecs = [c for c in args.codecs.split(",") if c]
    unknown = sorted(set(codecs) - set(CODECS))
    if unknown or "bf16" not in codecs:
        parser.error(f"--codecs: unknown {unknown}" if unknown else "--codecs must include bf16 (the baseline)")
    if args.pipeline and args.pipeline not in codecs:
        parser.error(f"--pipeline {args.pipeline}: not among --codecs")
    seeds = [int(s) for s in args.seeds.split(",")]
    out = args.out.resolve()
    try:
        model_dir = runs.prepare_model(out, size)
        data = runs.prepare_data(out, model_dir, size)
        untouched = runs.eval_run("eval_untouched", size, model_dir, data, model_dir, info={"codec": "untouched"})
        base = [runs.train_run("bf16", s, size, model_dir, data, out) for s in seeds]
        execute_all([untouched, *base], out, jobs=args.jobs, env=ONE_THREAD)
        curves = {r.name: runs.validations(read_log(out / f"{r.name}.jsonl")) for r in base}
        target = score.target_loss(list(curves.values()), size.iters)
        print(f"[real_model] target validation loss {target:.3f}", flush=True)
        evals = []
        for r in base:  # each bf16 seed's model where it first reached the target
            at = score.steps_to_target(curves[r.name], target)
            ckpt = out / "ckpt" / r.name
            evals.append(runs.eval_run(f"eval_{r.name}", size, model_dir, data, ckpt, step=at,
                                       info={"codec": "bf16", "seed": r.info["seed"], "step": at}))
        execute_all(evals, out, jobs=args.jobs, env=ONE_THREAD)
        for r, e in zip(base, evals):
            prune(out / "ckpt" / r.name, e.info["step"])
        trains = [runs.train_run(c, s, size, model_dir, data, out, target) for c in codecs if c != "bf16" for s in seeds]
        evals = [runs.eval_run(f"eval_{t.name}", size, model_dir, data, out / "ckpt" / t.name, after=(t.name,),
                               info={"codec": t.info["codec"], "seed": t.info["seed"]}) for t in trains]
        todo = [*trains, *evals]
        if args.pipeline:
            todo.append(runs.pipeline_run(args.pipeline, seeds[0], size, model_dir, data))
        execute_all(todo, out, jobs=args.jobs, env=ONE_THREAD)
        for t in trains:
            prune(out / "ckpt" / t.name, None)
    except ReproduceError as err:
        print(f"real_model: {err}", file=sys.stderr)
        return 1
    from .report import build, write_page

    result = build(size, target, codecs, seeds, out, host_info(), pipeline=args.pipeline)
    print(json.dumps(result["table"], indent=1))
    if args.write:
        write_page(result, args.write)
        print(f"[real_model] wrote {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
