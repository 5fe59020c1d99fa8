"""``python -m benchmarks.real_model``: a real pretrained model trained through the codecs at pipeline depths 8, 4, 2.

    python -m benchmarks.real_model                          # SmolLM2-135M, every codec x 4 seeds at depth 8 (hours)
    python -m benchmarks.real_model --size tiny --out /tmp/r  # the same machinery on a random 4-layer model
    python -m benchmarks.real_model --other-depths 2,4 --write docs/REAL_MODEL.md  # run what is missing, write the page
    python -m benchmarks.real_model --from-page docs/data/real_model.json ...  # the committed page's runs not run again
    python -m benchmarks.real_model --from-page docs/data/real_model.json --write docs/REAL_MODEL.md --pages-only
    python -m benchmarks.real_model --plan benchmarks/real_model/whole_run.toml --stages A  # a registered plan's stage

What it does, in order (runs already complete under ``--out`` are not run again; ``runs.py`` says what each
run is, ``scoring.py`` how it is scored):

1. imports the model into a Megatron checkpoint and tokenizes the corpora with its tokenizer;
2. evaluates the untouched checkpoint, and when ``--from-page``'s runs were made on another machine (CPU or torch),
   trains bf16's first seed again as ``control_train_bf16_s<seed>``: the page says how far its curve lies from the
   reused one;
3. runs bf16 (no codec) and every codec with every seed for the same number of steps, validating through the
   codecs and uncompressed, and scoring the damage corpus at the end (equal steps); the codecs at ``--depth``,
   and ``--other-codecs`` (default: the presets among ``--codecs``) at each of ``--other-depths``; seed by seed,
   so that an interrupted study has whole seeds;
4. with ``--pipeline CODEC``, runs that codec with the first seed as the real pipeline at ``--depth``;
5. scores (``scoring.py``; ``--score-only``: only this, over the runs finished so far: the target from bf16's curves, steps to it and along the curve, damage, intervals)
   and, with ``--write``, writes the page, its JSON and plots, and ``auto``'s steps charges per depth into the
   checkout's ``megatron_tah/config/measured.json`` (``benchmarks/real_model/measured.py``) and the README's table and preset
   per depth (between its ``<!-- real_model:... -->`` markers).

``--pages-only`` does none of this: it writes the page, its plots and the README's sections from ``--from-page``'s
JSON alone (after a change to how they read; the numbers stay that JSON's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from ..common.runner import ReproduceError, execute_all, host_info, say
from ..common.codecs import CODECS
from . import runs

DEFAULT_SEEDS = (1234, 1235, 1236, 1237)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # runs side by side: torch's default threads each contend for the cores


def _codecs(parser, text: str, flag: str) -> list[str]:
    codecs = [c for c in text.split(",") if c]
    unknown = sorted(set(codecs) - set(CODECS))
    if unknown:
        parser.error(f"{flag}: unknown {unknown}; choose among " + ", ".join(CODECS))
    return codecs


def main(argv=None) -> int:
    from megatron_tah.config.presets import PRESETS

    parser = argparse.ArgumentParser(prog="python -m benchmarks.real_model", description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(runs.SIZES), default="short")
    parser.add_argument("--out", type=Path, default=Path("runs/real_model"))
    parser.add_argument("--codecs", default=",".join(runs.STUDY_CODECS), help="comma list of " + ", ".join(CODECS))
    parser.add_argument("--seeds", default=",".join(map(str, DEFAULT_SEEDS)))
    parser.add_argument("--depth", type=int, default=8, help="pipeline depth of --codecs (emulated boundaries)")
    parser.add_argument("--other-depths", default="", help="comma list of further pipeline depths")
    parser.add_argument("--other-codecs", help="codecs run at --other-depths (default: the presets of --codecs)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one process each, one thread)")
    parser.add_argument("--pipeline", help="a codec to run once as the real pipeline (the emulation's check)")
    parser.add_argument("--write", type=Path, help="write the page here (its JSON and plots under docs/data/)")
    parser.add_argument("--from-page", type=Path, metavar="JSON",
                        help="an earlier page's JSON (docs/data/real_model.json): its runs' curves are scored "
                             "with the runs under --out and not run again (same size, schedule and model)")
    parser.add_argument("--plan", type=Path, metavar="TOML",
                        help="a plan registered before its runs (benchmarks/real_model/whole_run.toml): its size, "
                             "seeds and codecs, stage by stage; --size, --codecs, --seeds and the depths are its")
    parser.add_argument("--stages", help="with --plan: comma list of its stages to run, in that order (default: every "
                                         "stage, in the plan's order)")
    parser.add_argument("--score-only", action="store_true",
                        help="run nothing: score the runs of the plan already finished under --out (a study going on)")
    parser.add_argument("--pages-only", action="store_true",
                        help="run and score nothing: write --write's page and the README from --from-page's JSON")
    args = parser.parse_args(argv)
    if args.pages_only:
        if not (args.from_page and args.write):
            parser.error("--pages-only needs --from-page JSON and --write PAGE")
        return pages_only(args.from_page, args.write)
    if args.plan:
        return registered(parser, args, argv)
    size = runs.SIZES[args.size]
    codecs = _codecs(parser, args.codecs, "--codecs")
    if "bf16" not in codecs:
        parser.error("--codecs must include bf16 (the baseline)")
    others = [int(d) for d in args.other_depths.split(",") if d.strip()]
    other_codecs = [c for c in codecs if c in PRESETS] if args.other_codecs is None else \
        _codecs(parser, args.other_codecs, "--other-codecs")
    if args.pipeline and args.pipeline not in codecs:
        parser.error(f"--pipeline {args.pipeline}: not among --codecs")
    seeds = [int(s) for s in args.seeds.split(",")]
    plan = {args.depth: codecs, **{d: ["bf16", *(c for c in other_codecs if c != "bf16")] for d in others}}
    out = args.out.resolve()
    from .readme import write_readme
    from .report import write_page
    from .scoring import build, reusable

    try:
        earlier = reusable(args.from_page, size) if args.from_page else None
    except (OSError, ValueError) as err:
        parser.error(f"--from-page: {err}")
    host = host_info()
    if not args.score_only and not run_plan(plan, seeds, size, out, args, earlier, host):
        return 1
    result = build(size, plan, seeds, out, host, depth=args.depth, pipeline=args.pipeline, earlier=earlier)
    print(json.dumps(result["table"], indent=1))
    if args.write:
        import shlex

        from . import measured

        command = shlex.join(["python", "-m", "benchmarks.real_model", *(sys.argv[1:] if argv is None else argv)])
        result["command"] = command
        write_page(result, args.write)
        print(f"[real_model] wrote {args.write}")
        written = measured.write_beside(args.write, measured.real_model_rows(result, command))
        if written:  # auto's steps charges per depth (benchmarks/real_model/measured.py)
            print(f"[real_model] wrote {written}")
        readme = args.write.resolve().parent.parent / "README.md"
        if write_readme(result, readme):  # its table and preset per depth
            print(f"[real_model] wrote {readme}")
    return 0


def pages_only(page_json: Path, page: Path) -> int:
    """``--pages-only``: the page (with its JSON and plots) and the README's study sections from ``page_json``."""
    from .readme import write_readme
    from .report import write_page

    result = json.loads(Path(page_json).read_text())
    write_page(result, page)
    print(f"[real_model] wrote {page} from {page_json}")
    readme = Path(page).resolve().parent.parent / "README.md"
    if write_readme(result, readme):
        print(f"[real_model] wrote {readme}")
    return 0


def registered(parser, args, argv) -> int:
    """``--plan``: runs the plan's ``--stages`` under ``--out`` in order (what is finished there is kept), then,
    with ``--write``, scores the whole run (``whole_run.py``)."""
    from . import plan as plans

    try:
        plan = plans.load(args.plan)
        chosen = [plan.stage(n) for n in args.stages.split(",")] if args.stages else list(plan.stages)
    except (OSError, ValueError, KeyError) as err:
        parser.error(f"--plan: {err}")
    out = args.out.resolve()
    if not args.score_only:
        try:
            model_dir = runs.prepare_model(out, plan.size)
            data = runs.prepare_data(out, model_dir, plan.size)
            todo = [runs.eval_run("eval_untouched", plan.size, model_dir, data, model_dir, info={"codec": "untouched"})]
            for stage in chosen:
                todo += [r for r in plans.stage_runs(plan, stage, model_dir, data, out) if r.name not in
                         {t.name for t in todo}]
            other = elsewhere(out, host_info())
            if other:  # finished runs from another machine: bf16's first seed again here (the page compares them)
                again = runs.train_run("bf16", plan.seeds[0], plan.size, model_dir, data, out)
                todo.insert(1, dataclasses.replace(again, name=runs.CONTROL + again.name))
                say(f"runs under {out} were made on {other}: {todo[1].name} trains bf16 again here")
            say(f"plan {plan.name} ({args.plan}): stages {', '.join(s.name for s in chosen)}, {len(todo)} runs, "
                f"{args.jobs} at a time")
            execute_all(todo, out, jobs=args.jobs, env=ONE_THREAD)
        except ReproduceError as err:
            print(f"real_model: {err}", file=sys.stderr)
            return 1
    if args.write:
        from . import whole_run

        whole_run.main_write(plan, out, args.write, argv)
    return 0


def elsewhere(out: Path, host: dict) -> str | None:
    """The CPU (and torch) of a finished run under ``out`` made on another machine than ``host``; None if none."""
    for path in sorted(Path(out).glob("*.meta.json")):
        meta = json.loads(path.read_text())
        there = meta.get("host") or {}
        if meta.get("status") == 0 and there and (there.get("cpu"), there.get("torch")) != (host["cpu"], host["torch"]):
            return f"{there.get('cpu')} (torch {there.get('torch')})"
    return None


def run_plan(plan: dict[int, list[str]], seeds: list[int], size, out: Path, args, earlier: dict | None,
             host: dict) -> bool:
    """Runs what the plan lacks under ``out`` (complete runs are kept) and ``earlier`` (an earlier page's JSON)
    does not hold, the untouched model's evaluation always (beside ``earlier``'s: the two machines compared);
    False (said why) when one fails."""
    kept = (earlier or {}).get("curves", {})
    from megatron_tah.megatron.cpu_shims import bf16_instructions

    if not bf16_instructions():  # the runs train with --bf16
        say("note: this CPU has no bf16 instructions oneDNN uses: the runs' bf16 matrix products are computed in "
            "fp32 and rounded to bf16 (a CPU shim, docs/PATCHES.md)")
    try:
        model_dir = runs.prepare_model(out, size)
        data = runs.prepare_data(out, model_dir, size)
        todo = [runs.eval_run("eval_untouched", size, model_dir, data, model_dir, info={"codec": "untouched"})]
        names = set(kept)
        if earlier and (earlier["host"]["cpu"], earlier["host"]["torch"]) != (host["cpu"], host["torch"]):
            # another machine made the reused runs: bf16's first seed again here, what mixing them costs
            again = runs.train_run("bf16", seeds[0], size, model_dir, data, out)
            todo.append(dataclasses.replace(again, name=runs.CONTROL + again.name))
        for depth, listed in plan.items():
            for seed in seeds:
                for codec in listed:
                    run = runs.train_run(codec, seed, size, model_dir, data, out, depth)
                    if run.name not in names:  # bf16 is one run for every depth; reused runs are not run
                        names.add(run.name)
                        todo.append(run)
        if args.pipeline:
            todo.append(runs.pipeline_run(args.pipeline, seeds[0], size, model_dir, data, args.depth))
        execute_all(todo, out, jobs=args.jobs, env=ONE_THREAD)
    except ReproduceError as err:
        print(f"real_model: {err}", file=sys.stderr)
        return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())
