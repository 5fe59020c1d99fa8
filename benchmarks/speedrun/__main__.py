"""``python -m benchmarks.speedrun``: time to a target loss over a WAN, on this machine, per codec.

    python -m benchmarks.speedrun                         # the full size: 500-step loss runs, two at a time
                                                          # (25-35 minutes a pair on the 2-core machine)
    python -m benchmarks.speedrun --size tiny --out /tmp/s  # the same machinery in about 2 minutes
    python -m benchmarks.speedrun --write docs/SPEEDRUN.md  # run what is missing, then write the page
    python -m benchmarks.speedrun --from-page docs/data/speedrun.json --codecs bf16,channel9 --write ...
                                                          # the page's runs reused: only channel9 runs

What it does, in order (runs already complete under ``--out`` are not run again):

1. tokenizes the shipped corpus with a compact vocabulary (``runs.py``);
2. runs the uncompressed bf16 loss runs (every seed), and fixes the target loss from them
   (``score.target_loss``: the worst bf16 seed's validation loss at 92% of the schedule);
3. times bf16 without a slow link (the compute per step), and scales the emulated inbound wire to it:
   the latency takes ``LATENCY_SHARE`` of bf16's step, as at the reference (6.4 of 100 s), and the rate
   makes bf16's step ``LINK_BOUND`` times its compute, both solved with the schedule simulator
   (``simulate.py``) from the measured compute and bf16's exact message bytes;
4. runs every codec's loss runs; a codec that misses the target runs a longer schedule of the same shape
   (``longer_schedule``: long enough for the loss it reached, at most ``MAX_FACTOR`` times), and so does
   bf16 with the same seed: the codec's steps there count against bf16's on the same schedule; every codec
   alike unless ``--longer`` names some (the page says which); one that still misses is "missed within N
   steps", with no multiplier;
5. times every codec behind the emulated wire (``score.steady_seconds``);
6. scores T = steps to target x steady s/step, with intervals over seeds, projects the ProtocolNanoGPT
   setup with the measured steps multipliers (``projection.py``) and, with ``--write``, writes the page,
   its JSON and its plot (``auto``'s steps charges come from the real-model study, ``benchmarks/real_model/measured.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from ..common.runner import ReproduceError, execute_all, host_info, read_log
from ..common import score
from ..common.codecs import CODECS, NEEDS_LINK, entropy_coded
from . import runs, simulate

LINK_BOUND = 8.0  # bf16's step behind the emulated wire / its compute step (the issue asks >= 5)
LATENCY_SHARE = 0.064  # share of bf16's step that is latency: 2 M messages x 50 ms of 100.475 s at the reference
MAX_FACTOR = 4.0  # the longest schedule a codec that misses the target runs, in schedules of bf16
DEFAULT_SEEDS = (1234, 1235, 1236)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # loss runs side by side: torch's default threads each contend for the cores
DEFAULT_CODECS = ("bf16", "paper", "channel", "channel6", "channel9", "channel_f5", "hadint4", "lowrank", "lowrank8",
                  "lowrank2", "lowrank_h3", "channel_h4", "channel5_h4", "channel4_h4", "channel3_h4", "lowrank_g3", "lowrank_g2", "fixedpoint4", "auto")  # auto: a pipeline run behind the wire (~100 min)


def seeds_by_codec(seeds: list[int], multi_seed: str):
    """codec -> its seeds: bf16 and the ``--multi-seed`` codecs every seed (``CODEC=S1+S2``: those), others the first."""
    multi = {"bf16": list(seeds)}
    for item in filter(None, multi_seed.split(",")):
        name, _, named = item.partition("=")
        multi[name] = [int(x) for x in named.split("+")] if named else list(seeds)
    return lambda codec: multi.get(codec, list(seeds[:1]))


def restore_from_page(page: Path, out: Path, size: runs.Size) -> tuple[float, dict]:
    """The loss runs a written page already holds, made complete runs under ``out`` again (each curve of its
    JSON as a log of validation records, its meta marked ``from_page`` and keeping where the curve was measured),
    so that only new runs run; returns the page's measured compute seconds per step (no new compute run: every
    codec's s/step stays comparable) and what was reused (the page, the runs restored, where the compute step was
    measured). A page without per-curve provenance: its date and machine stand for its curves'. Refused when the
    page was made at another size or setup."""
    data = json.loads(Path(page).read_text())
    setup = size.setup()
    if data.get("size") != size.name or data.get("setup") != setup:
        raise ReproduceError(f"{page}: made at size {data.get('size')} with {data.get('setup')}, not {size.name} "
                             f"with {setup}; run without --from-page")
    out.mkdir(parents=True, exist_ok=True)
    restored, page_measured = [], {"date": data.get("date"), "cpu": data.get("host", {}).get("cpu")}
    for name, curve in data["curves"].items():
        log, meta = out / f"{name}.jsonl", out / f"{name}.meta.json"
        if meta.is_file():
            if json.loads(meta.read_text()).get("from_page"):
                restored.append(name)  # restored by an earlier call
            continue  # a run of this machine wins
        uncompressed = dict(curve.get("validations_uncompressed") or [])  # a codec's second evaluation, if made
        log.write_text("".join(json.dumps({"iteration": i, "lm_loss": None, "valid_loss": v,
                                           **({"valid_loss_uncompressed": uncompressed[i]} if i in uncompressed else {})})
                               + "\n" for i, v in curve["validations"]))
        info = {"codec": curve["codec"], "seed": curve["seed"], "iters": curve["iters"], "kind": "loss",
                "emulated": name.startswith("emulated_")}
        measured = {key: curve[key] for key in ("bytes", "choices") if key in curve}  # a pipeline run's, kept
        meta.write_text(json.dumps({"name": name, "status": 0, "from_page": str(page), "info": info,
                                    "provenance": curve.get("measured") or page_measured,
                                    **({"measured": measured} if measured else {})}, indent=1))
        restored.append(name)
    reused = {"page": Path(page).as_posix(), "runs": restored,
              "compute_measured": data.get("compute_measured") or page_measured}
    return float(data["compute_s_per_step"]), reused


def scale_link(compute_step_s: float, size: runs.Size, message_nbytes: int) -> runs.Link:
    """The emulated wire that makes bf16 ``LINK_BOUND`` times its compute, ``LATENCY_SHARE`` of it latency."""
    stages, m = size.stages, size.micro_batches
    f, b = simulate.compute_per_micro_batch(compute_step_s, stages, m)
    target = LINK_BOUND * compute_step_s
    latency = LATENCY_SHARE * target / (2 * m)
    step = lambda rate: simulate.simulate_step(stages, m, f, b, message_nbytes, message_nbytes, rate, latency)  # noqa: E731
    low, high = 1e3, 1e12  # bits/s: the step falls as the rate grows
    for _ in range(100):
        mid = (low * high) ** 0.5
        low, high = (mid, high) if step(mid) > target else (low, mid)
    return runs.Link(rate_bps=high, latency_s=latency)


def loss_results(run_list, out: Path, size: runs.Size) -> dict:
    """{run name: its info, validations and (forward, backward) wire bytes per iteration}: measured on the
    pipeline's links, or the codecs' exact message bytes x messages per iteration for emulated boundaries."""
    results = {}
    messages = (size.stages - 1) * size.micro_batches
    for r in run_list:
        records = read_log(out / f"{r.name}.jsonl")
        chooses = r.info["codec"] in NEEDS_LINK  # its bytes once its choices settled: the run's second half
        meta = json.loads((out / f"{r.name}.meta.json").read_text())
        restored = meta.get("measured")  # --from-page: kept there
        if r.info["emulated"]:
            measured = {"bytes": tuple(messages * n for n in runs.message_nbytes(r.info["codec"], size))}
        elif restored:
            measured = {"bytes": tuple(restored["bytes"]), **({"choices": restored["choices"]} if chooses else {})}
        else:
            measured = {"bytes": runs.bytes_per_iteration(records, len(runs.step_records(records)) // 2 if chooses else 2),
                        **({"choices": runs.auto_choices(records)} if chooses else {})}
        where = meta.get("provenance") or (  # --from-page: the curve's own; a run of this machine: its start
            {"date": meta["started"][:10], "cpu": meta["host"]["cpu"]} if "started" in meta and "host" in meta else None)
        # the model on its own: bf16's one evaluation is both; a codec's second evaluation (none in older runs)
        uncompressed = runs.validations(records, "valid_loss" if r.info["codec"] == "bf16" else "valid_loss_uncompressed")
        results[r.name] = {**r.info, "validations": runs.validations(records), **measured,
                           **({"validations_uncompressed": uncompressed} if uncompressed else {}),
                           **({"measured": where} if where else {})}
    return results


def longer_schedule(codec_run: dict, base_run: dict, iters: int, eval_interval: int,
                    max_factor: float = MAX_FACTOR) -> int:
    """The schedule to try for a run that missed the target: the codec reached by the end of ``iters`` the loss
    bf16 (same seed) had at some iteration i; it should reach bf16's target in about ``iters * iters / i``
    steps; 15% more, a multiple of the validation interval, at most ``max_factor`` times ``iters``."""
    final = codec_run["validations"][-1][1]
    reached = score.steps_to_target(base_run["validations"], final) or iters
    factor = min(max_factor, max(1.25, 1.15 * iters / reached))
    return math.ceil(iters * factor / eval_interval) * eval_interval


def already_run(out: Path, name: str, bf16_name: str, iters: int, most: int) -> int | None:
    """The shortest longer schedule (over ``iters``, at most ``most`` steps) that run ``name`` and its bf16 twin
    ``bf16_name`` already ran to completion under ``out`` (``<name>_<steps>``, an earlier call's choice): used,
    not run again."""
    done = []
    for meta in Path(out).glob(f"{name}_*.meta.json"):
        suffix = meta.name[len(name) + 1:-len(".meta.json")]
        twin = Path(out) / f"{bf16_name}_{suffix}.meta.json"
        if suffix.isdigit() and iters < int(suffix) <= most and twin.is_file() \
                and all(json.loads(m.read_text()).get("status") == 0 for m in (meta, twin)):
            done.append(int(suffix))
    return min(done) if done else None


def run_losses(codecs, seeds_for, size, data, out, jobs, link, target=None, base=None, emulated=False,
               max_factor=MAX_FACTOR, longer_for=None) -> dict:
    """Every codec's loss runs; with ``target``, each run that missed it once more over a longer schedule
    (``longer_schedule``, from the same seed's bf16 run in ``base``), and again 1.5x longer if that missed,
    never beyond ``max_factor`` schedules (1: no longer schedules); only codecs in ``longer_for`` (None: all).
    A codec that chooses from the link runs the real pipeline even when the others are emulated, and so does a
    bf16 twin of each of its seeds (without the link): its steps count against bf16's of the same kind of run."""
    todo = []
    for c in codecs:
        own = runs.emulated_for(c, emulated)
        for s in seeds_for(c):
            run = runs.loss_run(c, s, size, data, link=link, emulated=own)
            if own != emulated:
                pair = runs.loss_run("bf16", s, size, data, emulated=own)
                todo += [pair] if pair.name not in {r.name for r in todo} else []
            bf16_name = runs.loss_run_name("bf16", s, size.iters, size, own)
            longer = None if c == "bf16" or (Path(out) / f"{run.name}.meta.json").is_file() \
                else already_run(out, run.name, bf16_name, size.iters, int(max_factor * size.iters))
            if longer is None:
                todo.append(run)
            else:  # only a longer schedule ran (with its bf16 twin): it stands for this seed, the twin beside it
                twin = runs.loss_run("bf16", s, size, data, iters=longer, emulated=own)
                todo += [runs.loss_run(c, s, size, data, iters=longer, link=link, emulated=own)]
                todo += [twin] if twin.name not in {r.name for r in todo} else []
    execute_all(todo, out, jobs=jobs, env=ONE_THREAD)
    results = loss_results(todo, out, size)
    missed = lambda run: score.steps_to_target(results[run.name]["validations"], target) is None  # noqa: E731
    pending = [r for r in todo if target is not None and r.info["codec"] != "bf16" and missed(r)
               and (longer_for is None or r.info["codec"] in longer_for)]
    for attempt in range(2):
        if not pending:
            break
        longer = []
        for r in pending:
            bf16 = base[runs.loss_run_name("bf16", r.info["seed"], size.iters, size, emulated)]
            iters = longer_schedule(results[r.name], bf16, size.iters, size.eval_interval, max_factor) if attempt == 0 \
                else min(int(max_factor * size.iters), int(round(1.5 * r.info["iters"] / size.eval_interval)) * size.eval_interval)
            iters = already_run(out, r.name, runs.loss_run_name("bf16", r.info["seed"], size.iters, size,
                                                                 r.info["emulated"]),
                                r.info["iters"], int(max_factor * size.iters)) or iters
            if iters > r.info["iters"] and max_factor > 1:
                longer.append(runs.loss_run(r.info["codec"], r.info["seed"], size, data, iters=iters, link=link,
                                            emulated=r.info["emulated"]))
                same = runs.loss_run("bf16", r.info["seed"], size, data, iters=iters, emulated=r.info["emulated"])
                if same.name not in {x.name for x in longer}:  # bf16 on the same schedule: the fair comparison
                    longer.append(same)
        execute_all(longer, out, jobs=jobs, env=ONE_THREAD)
        results.update(loss_results(longer, out, size))
        pending = [r for r in longer if missed(r)]
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.speedrun", description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(runs.SIZES), default="full")
    parser.add_argument("--out", type=Path, default=Path("runs/speedrun"))
    parser.add_argument("--codecs", default=",".join(DEFAULT_CODECS), help="comma list of " + ", ".join(CODECS))
    parser.add_argument("--seeds", default=",".join(map(str, DEFAULT_SEEDS)), help="seeds of bf16 and --multi-seed codecs")
    parser.add_argument("--multi-seed", default="paper,channel,channel9",
                        help="codecs besides bf16 run with every seed (comma list); CODEC=S1+S2 names its seeds")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (each is 8 processes)")
    parser.add_argument("--loss-runs", choices=("emulated", "pipeline"), default="emulated",
                        help="emulated: one process per run, the boundaries' codecs emulated (benchmarks/depth); "
                             "pipeline: one process per stage (about 8x the CPU time)")
    parser.add_argument("--timing", choices=("simulated", "measured"), default="simulated",
                        help="simulated: the schedule simulator from the measured compute step and each codec's "
                             "exact message bytes; measured: a timing run per codec behind the emulated wire")
    parser.add_argument("--max-factor", type=float, default=MAX_FACTOR,
                        help="longest schedule a codec that misses the target runs, in bf16's schedules (1: none)")
    parser.add_argument("--longer", help="codecs that run longer schedules when they miss (comma list; default: all)")
    parser.add_argument("--write", type=Path, help="write the page here (its JSON and plot under docs/data/)")
    parser.add_argument("--from-page", type=Path,
                        help="a page's JSON (docs/data/speedrun.json): its loss runs and compute step are reused, "
                             "only runs it lacks run")
    args = parser.parse_args(argv)
    size = runs.SIZES[args.size]
    emulated = args.loss_runs == "emulated"
    codecs = [c for c in args.codecs.split(",") if c]
    unknown = sorted(set(codecs) - set(CODECS))
    if unknown or "bf16" not in codecs:
        parser.error(f"--codecs: unknown {unknown}" if unknown else "--codecs must include bf16 (the baseline)")
    coded = [c for c in codecs if entropy_coded(c)]
    if coded:
        parser.error(f"--codecs: {coded} entropy-code their messages: the same steps as their codec, bytes measured "
                     "on the pipeline; time them with python -m benchmarks.speedrun.check")
    seeds = [int(s) for s in args.seeds.split(",")]
    seeds_for = seeds_by_codec(seeds, args.multi_seed)
    out = args.out.resolve()
    try:
        page_compute_s, reused = restore_from_page(args.from_page, out, size) if args.from_page else (None, None)
        prefix, vocab = runs.prepare_data(out, size)
        data = runs.data_flags(prefix, vocab)
        base = run_losses(["bf16"], seeds_for, size, data, out, args.jobs, None, emulated=emulated)
        target = score.target_loss([r["validations"] for r in base.values()], size.iters)
        if page_compute_s is not None:
            compute_s = page_compute_s
        else:
            compute = runs.timing_run("bf16", size, data, None)
            execute_all([compute], out, jobs=1)
            compute_step = score.steady_seconds(runs.step_seconds(read_log(out / f"{compute.name}.jsonl")), skip=2)
            compute_s = compute_step.seconds if compute_step else _median_tail(out / f"{compute.name}.jsonl")
        link = scale_link(compute_s, size, runs.message_nbytes("bf16", size)[0])
        print(f"[speedrun] target loss {target:.3f}; compute {compute_s:.3f} s/step; emulated inbound wire "
              f"{link.rate_bps / 1e6:.4g} Mbit/s, {1e3 * link.latency_s:.2f} ms", flush=True)
        losses = {**base, **run_losses([c for c in codecs if c != "bf16"], seeds_for, size, data, out, args.jobs,
                                       link, target, base, emulated=emulated, max_factor=args.max_factor,
                                       longer_for=set(args.longer.split(",")) if args.longer else None)}
        steady = simulated_steps(codecs, size, compute_s, link, losses) if args.timing == "simulated" else {}
        timings = [runs.timing_run(c, size, data, link) for c in codecs if c not in steady]
        execute_all(timings, out, jobs=1)  # one at a time: they measure time
        for t in timings:
            times = runs.step_seconds(read_log(out / f"{t.name}.jsonl"))
            found = score.steady_seconds(times, skip=2)
            steady[t.info["codec"]] = {"seconds": found.seconds if found else _median_of_last(times),
                                       "steady": found is not None, "times": times}
    except ReproduceError as err:
        print(f"speedrun: {err}", file=sys.stderr)
        return 1
    from .report import publish
    from .scoring import build

    result = build(size, target, compute_s, link, losses, steady, host_info(),
                   modes={"loss_runs": args.loss_runs, "timing": args.timing, "max_factor": args.max_factor,
                          **({"longer": args.longer.split(",")} if args.longer else {})},
                   compute_measured=reused["compute_measured"] if reused else None)
    if reused:
        result["reused"] = {key: reused[key] for key in ("page", "runs")}
    print(json.dumps(result["table"], indent=1))
    if args.write:
        publish(result, args.write, "benchmarks.speedrun", sys.argv[1:] if argv is None else argv)
    return 0


def simulated_steps(codecs, size: runs.Size, compute_s: float, link: runs.Link, losses: dict) -> dict:
    """{codec: steady seconds per step} from the schedule simulator: bf16's measured compute per step, the
    codec's exact message bytes each way (a codec that chooses from the link: the mean bytes per message of the
    second half of its first loss run, ``loss_results``), the emulated wire (codec compute not counted)."""
    f, b = simulate.compute_per_micro_batch(compute_s, size.stages, size.micro_batches)
    messages = (size.stages - 1) * size.micro_batches
    steady = {}
    for codec in codecs:
        if codec in NEEDS_LINK:
            first = min((r for r in losses.values() if r["codec"] == codec), key=lambda r: (r["iters"], r["seed"]))
            fwd, bwd = (n / messages for n in first["bytes"])
        else:
            fwd, bwd = runs.message_nbytes(codec, size)
        seconds = simulate.simulate_step(size.stages, size.micro_batches, f, b, fwd, bwd, link.rate_bps,
                                         link.latency_s)
        steady[codec] = {"seconds": seconds, "steady": True, "times": [], "simulated": True}
    return steady


def _median_of_last(times: list[float], n: int = 30) -> float:
    import statistics

    return statistics.median(times[-n:])


def _median_tail(path: Path) -> float:
    return _median_of_last(runs.step_seconds(read_log(path)))


if __name__ == "__main__":
    raise SystemExit(main())
