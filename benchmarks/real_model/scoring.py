"""The real-model study's numbers (``build``): its runs read and scored, the same way for every codec.

Scoring, the same for every codec, at every pipeline depth, on two evaluations of every validation (``runs.TRAFFIC``):
**uncompressed** (the model on its own: what a user who serves it on one machine gets) and **through the
codecs** (what a user who serves it through the same compressed pipeline gets).

* **The target**: bf16's mean validation loss over its seeds at ``target_step``, where its curve still falls (the
  page gives the fall per step there, ``slope``).
* **Steps to target**: where a run's curve first reaches the target, interpolated between validations
  (``score.crossing``). A run that does not reach it within its ``iters`` steps has none: its row says "missed
  within N steps", with no multiplier.
* **Steps vs bf16**: the mean over seeds of a codec's steps over bf16's with the same seed (same data order),
  with a two-sided 95% Student-t interval; only when every seed reached the target.
* **Along the curve**: at each validation N of a codec's run, the step M at which bf16's same-seed curve reached the
  same loss (``score.equivalent_steps``, never extrapolated); each seed's mean N / M, then the mean over seeds with
  its interval. It does not hang on one loss level.
* **Damage at equal steps**: every run ends with the damage corpus (never trained on) after the same number of
  steps; a codec's loss there against bf16's model of the same seed (paired relative difference, interval; "within
  noise" when it holds 0), uncompressed and through the codecs, with the greedy next-token accuracy.
* **Projected T** on the ProtocolNanoGPT setup (``benchmarks.speedrun.projection``): the codec's bytes at
  ``[1024, 8, 1024]`` through the schedule simulator, times the bf16 record's steps x the multiplier, with the
  multiplier's interval.
* **Evaluation noise**: per validation, the paired difference of two runs' per-micro-batch losses on the same
  held-out samples; its standard error against the gaps being judged. **Resolution**: bf16's steps to target from
  every validation against every other one.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import statistics
from pathlib import Path

import torch

from ..common import score
from ..common.codecs import CODECS, busiest_nbytes, forward_codecs
from ..common.runner import read_log, read_meta
from ..speedrun import projection
from . import runs

REFERENCE_SHAPE = (1024, 8, 1024)  # the bits every page quotes: the ProtocolNanoGPT message
TRAFFIC_LABEL = {"uncompressed": "served on its own (evaluated uncompressed)",
                 "compressed": "served through the compressed pipeline (evaluated through the codecs)"}
MORE_DAMAGE = "more damage than bf16's"


def bits(codec: str, shape, stages: int = 8) -> tuple[float, float]:
    """(forward, backward) wire bits per value of one bf16 message of ``shape`` (headers included); forward with
    per-boundary bits: the mean over the ``stages - 1`` boundaries."""
    from megatron_tah.config import TahConfig

    config = TahConfig(**CODECS[codec])
    values = shape[0] * shape[1] * shape[2]
    forward = [8 * c.wire_nbytes(shape, torch.bfloat16) / values for c in forward_codecs(config, stages)]
    return sum(forward) / len(forward), 8 * config.backward_codec().wire_nbytes(shape, torch.bfloat16) / values


LOSSLESS = Path("docs/data/lossless.json")  # benchmarks.lossless: each codec set's coded share on SmolLM2's messages


def seeds_all_in(row: dict) -> bool:
    """Whether a whole-run table row (``seeds`` finished, ``planned_seeds`` registered) has every planned seed."""
    planned = set(row.get("planned_seeds", ()))
    return bool(planned) and len(row.get("seeds", ())) >= len(planned)


def serving_bits(codec: str) -> int | None:
    """The forward bits a serving candidate evaluates through the pipeline at (``--tah-eval-forward-bits``), or None
    when it evaluates through its training codec."""
    return CODECS.get(codec, {}).get("tah_eval_forward_bits")


def training_fields(codec: str) -> dict:
    """The fields a candidate trains with: a serving candidate's without its evaluation bits."""
    return {k: v for k, v in CODECS[codec].items() if k != "tah_eval_forward_bits"}


@functools.cache
def _lossless_rows(lossless: Path) -> list[dict]:
    return json.loads(lossless.read_text())["rows"]  # (read once per page, not once per row)


def coded_bits(codec: str, forward: float, backward: float, lossless: Path = LOSSLESS) -> float | None:
    """Bits both ways with ``--tah-entropy-coding``: each direction's wire bits (``forward``, ``backward``) scaled by
    the share the lossless coder kept of that codec set's buffers on SmolLM2-135M's messages (``benchmarks.lossless``,
    matched by its training fields), plus the NCCL frames' margin (on gloo each message goes at its own length);
    None when it was not measured."""
    from megatron_tah.link import frames

    if codec == "bf16" or not lossless.is_file():
        return None
    trained = training_fields(codec)
    rows = [r for r in _lossless_rows(lossless) if r["preset"] in CODECS and training_fields(r["preset"]) == trained]
    share = {r["direction"]: r["coded"] / r["bits"] for r in rows}
    if set(share) != {"forward", "backward"}:
        return None
    return (forward * share["forward"] + backward * share["backward"]) * (1 + frames.MARGIN)


def busiest_bits(codec: str, shape, stages: int = 8) -> float:
    """Forward + backward bits per value of the busiest link (with bits per boundary: the boundary with most)."""
    from megatron_tah.config import TahConfig

    config = TahConfig(**CODECS[codec])
    values = shape[0] * shape[1] * shape[2]
    return 8 * (busiest_nbytes(config, shape, stages) + config.backward_codec().wire_nbytes(shape, torch.bfloat16)) \
        / values


def _paired(values: dict, base: dict, relative: bool = False) -> score.Interval | None:
    seeds = sorted(set(values) & set(base))
    if not seeds:
        return None
    return score.mean_interval([(values[s] / base[s] - 1) if relative else values[s] - base[s] for s in seeds])


def verdict(delta: score.Interval | None) -> str:
    """What a paired difference of damage says: "more damage" (interval above 0), "less damage" (below), "within
    noise" (holds 0), or "one seed" (no interval)."""
    if delta is None:
        return "–"
    if delta.n < 2:
        return "one seed"
    if delta.low > 0:
        return MORE_DAMAGE
    if delta.high < 0:
        return "less damage than bf16's"
    return "within noise"


def _interval_fields(prefix: str, interval: score.Interval | None) -> dict:
    if interval is None:
        return {prefix: None, f"{prefix}_low": None, f"{prefix}_high": None}
    return {prefix: interval.mean, f"{prefix}_low": interval.low, f"{prefix}_high": interval.high}


def read_curves(out: Path, plan: dict[int, list[str]], seeds: list[int], earlier: dict | None = None) -> dict:
    """{run name: {"codec", "seed", "depth", "uncompressed": curve, "codec": curve, "damage": {traffic: evaluation},
    "ms"}} of every complete training run of ``plan`` ({depth: codecs}); a run not finished under ``out`` is taken
    from ``earlier`` (an earlier page's JSON, :func:`reusable`) when it has it."""
    curves = {}
    kept = (earlier or {}).get("curves", {})
    for depth, codecs in plan.items():
        for codec in codecs:
            for seed in seeds:
                name = runs.run_name(codec, seed, depth)
                path = out / f"{name}.jsonl"
                records = read_log(path) if name not in curves and path.is_file() else []
                if not any("test_loss" in r for r in records):  # not run or not finished here
                    if name in kept and name not in curves:
                        curves[name] = {**kept[name], "reused": True}
                    continue
                curves[name] = {"codec": codec, "seed": seed, "depth": None if codec == "bf16" else depth,
                                **{t: runs.validations(records, t) for t in runs.TRAFFIC},
                                "damage": {t: runs.evaluation(records, t) for t in runs.TRAFFIC},
                                "ms": statistics.median([r["ms"] for r in records if r.get("ms")] or [0.0])}
    return curves


def reusable(path: Path, size: runs.Size) -> dict:
    """An earlier page's JSON (``write_page``) whose runs' curves a study reuses instead of running them again:
    refused unless it was written for the same size, schedule and model."""
    earlier = json.loads(Path(path).read_text())
    if earlier.get("setup") != size.setup() or earlier.get("model") != runs.MODELS[size.model].description:
        raise ValueError(f"{path}: its runs were made with {earlier.get('setup')} on {earlier.get('model')!r}, "
                         f"not this study's {size.setup()} on {runs.MODELS[size.model].description!r}")
    return earlier


def control(out: Path, curves: dict, target: float) -> dict | None:
    """bf16 trained again on this machine (``runs.CONTROL`` + its name) against its reused curve from the earlier page's
    machine, at the validations both have: what mixing the two machines' runs costs in training, not only in one
    evaluation. None without such a run."""
    for path in sorted(out.glob(f"{runs.CONTROL}*.jsonl")):
        if path.name.endswith(".evals.jsonl"):  # its per-sample losses
            continue
        name, records = path.name[len(runs.CONTROL):-len(".jsonl")], read_log(path)
        if name not in curves or not curves[name].get("reused") or not any("test_loss" in r for r in records):
            continue
        here, there = dict(runs.validations(records, "uncompressed")), dict(curves[name]["uncompressed"])
        diffs = [here[i] - there[i] for i in sorted(set(here) & set(there))]
        if not diffs:
            continue
        return {"run": name, "validations": len(diffs), "mean_diff": statistics.fmean(diffs),
                "max_abs_diff": max(abs(d) for d in diffs),
                "steps_here": score.crossing(sorted(here.items()), target),
                "steps_there": score.crossing(sorted(there.items()), target),
                "damage_diff": runs.evaluation(records)["damage_loss"] - curves[name]["damage"]["uncompressed"]["damage_loss"]}
    return None


def target_and_slope(base: list[list[tuple[int, float]]], step: int, window: int = 4) -> tuple[float, float]:
    """bf16's mean validation loss at ``step`` (each seed's curve interpolated there) and the mean curve's
    least-squares fall per step over the validations within ``window`` steps of it (positive: still falling; the
    window must hold two validations)."""
    def at(curve, x):
        points = sorted(curve)
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if x0 <= x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        raise ValueError(f"step {x} is outside a bf16 curve's validations {points[0][0]}..{points[-1][0]}")

    target = statistics.fmean(at(c, step) for c in base)
    steps = sorted({i for c in base for i, _ in c if abs(i - step) <= window})
    if len(steps) < 2:
        raise ValueError(f"fewer than two bf16 validations within {window} steps of step {step}: no slope")
    means = [statistics.fmean(at(c, i) for c in base) for i in steps]
    mx, my = statistics.fmean(steps), statistics.fmean(means)
    slope = sum((x - mx) * (y - my) for x, y in zip(steps, means)) / sum((x - mx) ** 2 for x in steps)
    return round(target, 4), -slope


def metric(curves: dict, names: dict[int, str], base_names: dict[int, str], traffic: str, target: float,
           iters: int) -> dict:
    """One codec's steps on one evaluation (``traffic``): per seed, to the target and along the curve."""
    steps = {s: score.crossing(curves[n][traffic], target) for s, n in names.items()}
    base = {s: score.crossing(curves[base_names[s]]["uncompressed"], target) for s in names}
    along = {}
    for s, n in names.items():
        pairs = score.equivalent_steps(curves[n][traffic], curves[base_names[s]]["uncompressed"])
        if pairs:
            along[s] = statistics.fmean(n_ / m for n_, m in pairs)
    row = {"steps_by_seed": {str(s): v for s, v in steps.items()},
           "along_by_seed": {str(s): v for s, v in along.items()}, "missed_within": None}
    reached = all(v is not None for v in steps.values()) and all(base.values())
    row.update(_interval_fields("steps", score.mean_interval(list(steps.values())) if reached else None))
    row.update(_interval_fields("multiplier", score.paired_ratio(steps, base) if reached else None))
    row.update(_interval_fields("along", score.mean_interval(list(along.values())) if along else None))
    if not reached:
        row["missed_within"] = iters
    return row


def noise(curves: dict, out: Path, bf16: dict[int, str], target_slope: float) -> dict:
    """Evaluation noise: at every validation of every codec run, the standard error of the mean paired difference
    of its per-micro-batch losses (uncompressed) and bf16's same-seed ones on the same samples; its median, in loss
    and in steps of bf16's fall per step at the target, beside the median |gap| it is judged against."""
    errors, gaps = [], []
    for name, curve in curves.items():
        if curve["codec"] == "bf16":
            continue
        mine = runs.eval_losses(out / f"{name}.evals.jsonl")
        theirs = runs.eval_losses(out / f"{bf16[curve['seed']]}.evals.jsonl")
        for (iteration, split, traffic), losses in mine.items():
            base = theirs.get((iteration, split, "codec"))
            if split != "valid" or traffic != "uncompressed" or not base or len(base) != len(losses) or len(losses) < 2:
                continue
            diffs = [a - b for a, b in zip(losses, base)]
            errors.append(statistics.stdev(diffs) / math.sqrt(len(diffs)))
            gaps.append(abs(statistics.fmean(diffs)))
    if not errors:
        return {}
    median = statistics.median(errors)
    return {"pairs": len(errors), "samples": None, "median_se": median, "max_se": max(errors),
            "median_gap": statistics.median(gaps), "se_in_steps": median / target_slope if target_slope > 0 else None}


def resolution(curves: dict, target: float, interval: int) -> dict:
    """bf16's steps to target from every validation against from every other one (twice the spacing): how far
    interpolation between validations moves a step count."""
    diffs, steps = [], []
    for curve in (c for c in curves.values() if c["codec"] == "bf16"):
        points = curve["uncompressed"]
        every = score.crossing(points, target)
        start = points[0][0]
        sparse = score.crossing([(i, v) for i, v in points if (i - start) % (2 * interval) == 0], target)
        if every is not None and sparse is not None:
            diffs.append(abs(every - sparse))
            steps.append(every)
    if not diffs:
        return {}
    return {"interval": interval, "max_diff_steps": max(diffs), "mean_diff_steps": statistics.fmean(diffs),
            "max_diff_fraction": max(d / s for d, s in zip(diffs, steps))}


def build(size: runs.Size, plan: dict[int, list[str]], seeds: list[int], out: Path, host: dict, depth: int = 8,
          pipeline: str | None = None, earlier: dict | None = None) -> dict:
    """Everything the page shows, from the runs under ``out`` (and those of ``earlier``, an earlier page's JSON,
    not run here): ``plan`` is {pipeline depth: codecs}, ``depth`` the main table's."""
    out = Path(out)
    curves = read_curves(out, plan, seeds, earlier)
    bf16 = {s: runs.run_name("bf16", s) for s in seeds if runs.run_name("bf16", s) in curves}
    if len(bf16) < 2:
        raise ValueError(f"the study needs at least two finished bf16 runs under {out}, found {len(bf16)}")
    untouched = runs.evaluation(read_log(out / "eval_untouched.jsonl")) if (out / "eval_untouched.jsonl").is_file() \
        else None
    target, slope = target_and_slope([curves[n]["uncompressed"] for n in bf16.values()], size.target_step)
    base_steps = {s: score.crossing(curves[n]["uncompressed"], target) for s, n in bf16.items()}
    tables = {}
    for d, codecs in plan.items():
        rows = []
        for codec in codecs:
            names = {s: runs.run_name(codec, s, d) for s in bf16 if runs.run_name(codec, s, d) in curves}
            if not names:
                continue
            rows.append(codec_row(codec, d, names, bf16, curves, target, size, out, untouched))
        project(rows, d)
        tables[str(d)] = rows
    metas = [m for m in (read_meta(out, p.name[:-len(".meta.json")]) for p in out.glob("*.meta.json")) if m]
    result = {"date": datetime.date.today().isoformat(), "host": host, "size": size.name, "setup": size.setup(),
              "model": runs.MODELS[size.model].description, "target": target, "target_slope": slope, "depth": depth,
              "table": tables[str(depth)], "depths": {k: v for k, v in tables.items() if k != str(depth)},
              "untouched": untouched, "curves": curves,
              "bf16_steps": dataclass_dict(score.mean_interval(list(base_steps.values()))),
              "boundaries": {str(d): runs.boundaries(runs.num_layers(out / "model"), d) for d in plan},
              "noise": noise(curves, out, bf16, slope) or dict((earlier or {}).get("noise") or {}), "resolution": resolution(curves, target, size.eval_interval),
              "run_hours": sum(m.get("seconds", 0) for m in metas) / 3600,
              "s_per_step": statistics.median(curves[n]["ms"] for n in bf16.values()) / 1e3,
              "runs": len(metas), "seeds": sorted(bf16)}
    reused = sorted(n for n, c in curves.items() if c.get("reused"))
    if reused:  # their curves only: their per-sample losses (noise) and run time stay with the earlier page
        result["reused"] = {"runs": len(reused), "date": earlier["date"], "run_hours": earlier["run_hours"],
                            "earlier_runs": earlier["runs"], "names": reused, "host": earlier["host"],
                            "untouched": earlier.get("untouched"), "control": control(out, curves, target)}
    if result["noise"]:
        result["noise"]["samples"] = size.eval_iters * size.micro_batches
    if pipeline:
        result["pipeline"] = pipeline_check(out, pipeline, seeds, curves, depth)
    return result


def dataclass_dict(interval: score.Interval) -> dict:
    return {"mean": interval.mean, "low": interval.low, "high": interval.high, "n": interval.n}


def codec_row(codec: str, depth: int, names: dict[int, str], bf16: dict[int, str], curves: dict, target: float,
              size: runs.Size, out: Path, untouched: dict | None) -> dict:
    fwd, bwd = bits(codec, REFERENCE_SHAPE, depth)
    sfwd, sbwd = bits(codec, (size.seq, size.micro_batch, _hidden(out)), depth)
    row = {"codec": codec, "depth": depth, "seeds": sorted(names), "forward_bits": fwd, "backward_bits": bwd,
           "busiest_bits": busiest_bits(codec, REFERENCE_SHAPE, depth), "coded_bits": coded_bits(codec, fwd, bwd),
           "study_forward_bits": sfwd, "study_backward_bits": sbwd}
    for traffic in runs.TRAFFIC:
        row[traffic] = metric(curves, names, bf16, traffic, target, size.iters)
    for traffic in runs.TRAFFIC:
        damage = {s: curves[n]["damage"][traffic]["damage_loss"] for s, n in names.items()}
        base = {s: curves[bf16[s]]["damage"]["uncompressed"]["damage_loss"] for s in names}
        delta = None if codec == "bf16" else _paired(damage, base, relative=True)
        accuracy = [curves[n]["damage"][traffic]["damage_accuracy"] for n in names.values()]
        row[traffic].update(
            damage_by_seed={str(s): v for s, v in damage.items()}, damage_loss=statistics.fmean(damage.values()),
            damage_accuracy=statistics.fmean(accuracy) if None not in accuracy else None,
            **_interval_fields("damage_vs_bf16", delta),
            damage_verdict="–" if codec == "bf16" else verdict(delta),
            damage_vs_untouched=(statistics.fmean(damage.values()) / untouched["damage_loss"] - 1) if untouched
            else None)
    return row


def project(rows: list[dict], depth: int) -> None:
    """Each row's projected T (bf16: the record's; a codec: per evaluation, with its multiplier's interval)."""
    base = projection.SETUP.steps_to_target
    projected = {r["codec"]: r for r in projection.project(
        {}, codecs={("none" if r["codec"] == "bf16" else r["codec"]): CODECS[r["codec"]] for r in rows},
        multiplier_label="measured on SmolLM2-135M")}
    for row in rows:
        s_per_step = projected["none" if row["codec"] == "bf16" else row["codec"]]["s_per_step"]
        row["projected_s_per_step"] = s_per_step
        for traffic in runs.TRAFFIC:
            m = row[traffic]
            if row["codec"] == "bf16":
                m.update(projected_T=s_per_step * base, projected_T_low=s_per_step * base,
                         projected_T_high=s_per_step * base)
            elif m["multiplier"] is not None:
                m.update(projected_T=s_per_step * base * m["multiplier"],
                         projected_T_low=s_per_step * base * m["multiplier_low"],
                         projected_T_high=s_per_step * base * m["multiplier_high"])
            else:
                m.update(projected_T=None, projected_T_low=None, projected_T_high=None)


def _hidden(out: Path) -> int:
    flags = runs.model_flags(out / "model")
    return int(flags[flags.index("--hidden-size") + 1])


def pipeline_check(out: Path, codec: str, seeds: list[int], curves: dict, depth: int, name: str | None = None) -> dict:
    """The real pipeline's validation curves (both evaluations) against the emulated run of the same codec and seed,
    on the iterations both validated, beside the spread between the emulated seeds there; ``name``: the pipeline
    run's (default ``runs.pipeline_name`` without a tag)."""
    records = read_log(out / f"{name or runs.pipeline_name(codec, seeds[0], depth)}.jsonl")
    emulated_name = runs.run_name(codec, seeds[0], depth)
    found = {"codec": codec, "seed": seeds[0], "depth": depth,
             "ms": statistics.median([r["ms"] for r in records if r.get("ms")] or [0.0])}
    for traffic in runs.TRAFFIC:
        piped = dict(runs.validations(records, traffic))
        emulated = dict(curves[emulated_name][traffic])
        common = sorted(set(piped) & set(emulated))
        diffs = [piped[i] - emulated[i] for i in common]
        spread = []
        for i in common:
            at = [dict(c[traffic]).get(i) for c in curves.values() if c["codec"] == codec and c["depth"] == depth]
            at = [a for a in at if a is not None]
            if len(at) > 1:
                spread.append(statistics.stdev(at))
        found[traffic] = {"iterations": common, "pipeline": [piped[i] for i in common],
                          "emulated": [emulated[i] for i in common],
                          "max_abs_diff": max(map(abs, diffs)) if diffs else None,
                          "mean_diff": statistics.fmean(diffs) if diffs else None,
                          "seed_spread": statistics.fmean(spread) if spread else None}
    return found
