"""The real-model study's numbers (``build``) and its page (``write_page``: markdown, JSON, plots).

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
import textwrap
from pathlib import Path
from typing import NamedTuple

import torch

from ..pages import save_data
from ..reproduce.runner import read_log, read_meta
from ..speedrun import projection, score
from ..speedrun.runs import CODECS, busiest_nbytes, forward_codecs
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


# ----- reading the runs ----------------------------------------------------------------------------------------
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


# ----- choosing ------------------------------------------------------------------------------------------------
def _t_ratio(a: dict, b: dict, traffic: str) -> score.Comparison | None:
    """A's projected T over B's, paired by seed (steps ratio x s/step ratio), on one evaluation."""
    sa = {int(k): v for k, v in a[traffic]["steps_by_seed"].items() if v is not None}
    sb = {int(k): v for k, v in b[traffic]["steps_by_seed"].items() if v is not None}
    if not set(sa) & set(sb):
        return None
    return score.compare(sa, sb, a["projected_s_per_step"] / b["projected_s_per_step"])


TIE = 0.05
"""How much larger a candidate's mean projected T may be than the best's and still tie with it (``recommended``)."""
USE = {"uncompressed": "model served on its own", "compressed": "served through the compressed pipeline"}


def rule_text() -> str:
    """The rule ``recommended`` applies, in the words the page and the README both print."""
    return ("The choice per depth and use: of the presets that reached the target in every seed (two or more) without "
            "more damage than bf16's at equal steps, both on that use's own evaluation (served through the pipeline: "
            "through the codecs, where runs trained as usual and served at more forward bits, "
            "`--tah-eval-forward-bits`, compete too), the lowest projected T; another within noise of it (the paired "
            f"interval of the T ratio holds 1) and within {TIE:.0%} of it ties, and of the tied the fewest bits on the "
            "busiest link win, then the lowest projected T.")


def candidates(rows: list[dict], traffic: str) -> list[dict]:
    """The rows ``recommended`` chooses among for one use: the presets, and for a model served through the pipeline
    (``compressed``) also the serving candidates (``serving_bits``: trained as usual, evaluated at more bits)."""
    from megatron_tah.config.presets import PRESETS

    return [r for r in rows if r["codec"] != "bf16" and (
        r["codec"] in PRESETS or (traffic == "compressed" and serving_bits(r["codec"]) is not None))]


def qualifies(row: dict, traffic: str) -> bool:
    """Whether ``row`` reached the target in every seed (two or more) on the evaluation ``traffic`` without more
    damage than bf16's at equal steps on that same evaluation."""
    m = row[traffic]
    return m["multiplier"] is not None and len(row["seeds"]) >= 2 and m["damage_verdict"] != MORE_DAMAGE


def recommended(rows: list[dict], traffic: str = "uncompressed") -> str | None:
    """The codec a user should choose on ``rows`` (one depth) for one use (``traffic``), by ``rule_text``: of the
    ``candidates`` that ``qualify``, the lowest projected T; another within noise of it (paired interval of the T
    ratio holds 1) and within ``TIE`` of it ties; of the tied, the fewest bits on the busiest link, then the lowest
    projected T (None: none qualified). (With few seeds the interval of a T ratio can hold 1 for a candidate far
    slower on average: ``TIE`` keeps such a one out.)"""
    fits = [r for r in candidates(rows, traffic) if qualifies(r, traffic)]
    if not fits:
        return None
    best = min(fits, key=lambda r: r[traffic]["projected_T"])
    tied = [r for r in fits if r is best or ((c := _t_ratio(r, best, traffic)) is not None
                                            and c.verdict in ("within noise", "one seed")
                                            and r[traffic]["projected_T"] <= (1 + TIE) * best[traffic]["projected_T"])]
    return min(tied, key=lambda r: (round(r["busiest_bits"], 2), r[traffic]["projected_T"]))["codec"]


def flag_line(codec: str) -> str:
    """The flags that train (and serve) as ``codec`` did: ``--tah-preset NAME`` where its training is a preset's,
    else its fields as flags; a serving candidate adds ``--tah-eval-forward-bits N``."""
    from megatron_tah.config.presets import PRESETS
    from megatron_tah.megatron.arguments import fields_flags

    trained = training_fields(codec)
    preset = trained["tah_preset"] if set(trained) == {"tah_preset"} else next(
        (name for name, p in PRESETS.items() if name != "none" and dict(p) == trained), None)
    flags = ["--tah-preset", preset] if preset else fields_flags(trained)
    bits = serving_bits(codec)
    return " ".join(flags + ([] if bits is None else ["--tah-eval-forward-bits", str(bits)]))


# ----- the page ----------------------------------------------------------------------------------------------
def _interval(mean, low, high, digits=2, suffix="", percent=False) -> str:
    if mean is None:
        return "–"
    f = (lambda v: f"{100 * v:+.{digits}f}%") if percent else (lambda v: f"{v:.{digits}f}{suffix}")
    if low == high:  # one value: no interval
        return f(mean)
    return f"{f(mean)} [{f(low)}, {f(high)}]"


def steps_text(m: dict) -> str:
    if m["steps"] is None:
        missed = [s for s, v in m["steps_by_seed"].items() if v is None]
        return f"missed within {m['missed_within']} steps (seed {', '.join(missed)})"
    return _interval(m["steps"], m["steps_low"], m["steps_high"], 1)


def multiplier_text(m: dict) -> str:
    if m["multiplier"] is None:
        missed = [s for s, v in m["steps_by_seed"].items() if v is None]
        return f"missed within {m['missed_within']} steps ({len(missed)} of {len(m['steps_by_seed'])} seeds)"
    one = " (one seed)" if len(m["steps_by_seed"]) == 1 else ""
    return _interval(m["multiplier"], m["multiplier_low"], m["multiplier_high"], suffix="x") + one


def along_text(m: dict) -> str:
    return "–" if m["along"] is None else _interval(m["along"], m["along_low"], m["along_high"], suffix="x")


def damage_text(m: dict, codec: str) -> str:
    if codec == "bf16":
        return "–"
    return _interval(m["damage_vs_bf16"], m["damage_vs_bf16_low"], m["damage_vs_bf16_high"], percent=True) \
        + f" ({m['damage_verdict']})"


def t_text(m: dict) -> str:
    if m["projected_T"] is None:
        return "–"
    if m["projected_T_low"] == m["projected_T_high"]:
        return f"{m['projected_T']:,.0f}"
    return f"{m['projected_T']:,.0f} [{m['projected_T_low']:,.0f}, {m['projected_T_high']:,.0f}]"


def table_markdown(rows: list[dict], traffic: str) -> str:
    lines = ["| codec | bits fwd + bwd at [1024, 8, 1024] | seeds | steps to target | steps vs bf16 | along the curve | "
             "damage vs bf16 at equal steps | vs untouched | greedy accuracy | projected T (s) |",
             "|---|---:|---:|---|---|---|---|---:|---:|---:|"]
    for r in rows:
        m = r[traffic]
        accuracy = "–" if m["damage_accuracy"] is None else f"{100 * m['damage_accuracy']:.2f}%"
        untouched = "–" if m["damage_vs_untouched"] is None else f"{100 * m['damage_vs_untouched']:+.2f}%"
        lines.append(f"| {r['codec']} | {r['forward_bits']:.2f} + {r['backward_bits']:.2f} | {len(r['seeds'])} | "
                     f"{steps_text(m)} | {multiplier_text(m)} | {along_text(m)} | {damage_text(m, r['codec'])} | "
                     f"{untouched} | {accuracy} | {t_text(m)} |")
    return "\n".join(lines)


def depths_markdown(result: dict) -> str:
    """One table over every depth: each codec's steps multiplier on both evaluations and its damage."""
    lines = ["| depth | codec | bits fwd + bwd | seeds | steps vs bf16, uncompressed | steps vs bf16, through the "
             "codecs | damage vs bf16 at equal steps (uncompressed) |", "|---:|---|---:|---:|---|---|---|"]
    tables = {str(result["depth"]): result["table"], **result["depths"]}
    for depth in sorted(tables, key=int):
        for r in tables[depth]:
            if r["codec"] == "bf16":
                continue
            lines.append(f"| {depth} | {r['codec']} | {r['forward_bits']:.2f} + {r['backward_bits']:.2f} | "
                         f"{len(r['seeds'])} | {multiplier_text(r['uncompressed'])} | {multiplier_text(r['compressed'])} | "
                         f"{damage_text(r['uncompressed'], r['codec'])} |")
    return "\n".join(lines)


def presets_by_depth(result: dict) -> dict[str, dict[str, str | None]]:
    """{depth: {traffic: the recommended preset}} over every depth the study ran."""
    tables = {str(result["depth"]): result["table"], **result["depths"]}
    return {d: {t: recommended(rows, t) for t in runs.TRAFFIC} for d, rows in sorted(tables.items(), key=lambda x: int(x[0]))}


def frontier_text(result: dict) -> str:
    """The codecs by bits both ways at the reference shape, each with its steps on both evaluations."""
    rows = sorted((r for r in result["table"] if r["codec"] != "bf16"),
                  key=lambda r: r["forward_bits"] + r["backward_bits"])
    parts = [f"`{r['codec']}` {r['forward_bits'] + r['backward_bits']:.2f} bits: "
             f"{multiplier_text(r['uncompressed'])} uncompressed, {multiplier_text(r['compressed'])} through the codecs, "
             f"damage {r['uncompressed']['damage_verdict']}" for r in rows]
    return "Bits per value forward + backward at [1024, 8, 1024], fewest first: " + "; ".join(parts) + "."


class Goal(NamedTuple):
    """A goal of the study at its main depth: bits both ways at most; on the uncompressed evaluation a mean steps
    multiplier at most ``steps`` (and its interval's upper end at most ``steps_high``); damage vs bf16 at equal steps
    at most ``damage`` (its interval's upper end); with ``serving``, the same training evaluated through the
    pipeline at its serving bits (``--tah-eval-forward-bits``) at most that multiplier; with ``projected_t``, its
    projected ProtocolNanoGPT T (served on its own) at most that many seconds; with ``toy``, its T on the toy's CPU
    speedrun (docs/SPEEDRUN.md) at most that fraction of bf16's."""
    bits: float
    steps: float
    steps_high: float | None
    damage: float
    serving: float | None = None
    projected_t: float | None = None
    toy: float | None = None


GOALS = (Goal(8.0, 1.05, None, 0.005), Goal(6.0, 1.10, 1.20, 0.005, serving=1.05, projected_t=80_000.0, toy=0.35))
"""The study's goals, each answered by ``goals_text``."""


def fewest_bits(row: dict) -> float:
    """Bits both ways at the reference shape, with the lossless coder where it was measured and sends fewer."""
    wire = row["forward_bits"] + row["backward_bits"]
    return min(wire, row.get("coded_bits") or wire)


def bits_text(row: dict) -> str:
    wire, fewest = row["forward_bits"] + row["backward_bits"], fewest_bits(row)
    return f"{wire:.2f} bits, {fewest:.2f} with `--tah-entropy-coding`" if fewest < wire else f"{wire:.2f} bits"


def meets(row: dict, bits: float, multiplier: float, damage: float, multiplier_high: float | None = None) -> bool:
    """Whether ``row`` meets a goal: its bits (with the lossless coder where measured), its mean multiplier (and its
    interval's upper end, with ``multiplier_high``) and the upper end of its damage interval vs bf16
    (uncompressed), over two or more seeds."""
    m = row["uncompressed"]
    return (row["codec"] != "bf16" and len(row["seeds"]) >= 2 and fewest_bits(row) <= bits
            and m["multiplier"] is not None and m["multiplier"] <= multiplier
            and (multiplier_high is None or (m.get("multiplier_high") or math.inf) <= multiplier_high)
            and m["damage_vs_bf16_high"] is not None and m["damage_vs_bf16_high"] <= damage)


def serves(row: dict, multiplier: float) -> bool:
    """Whether ``row``, a candidate evaluated through the pipeline at its serving bits, reached the target there in
    at most ``multiplier`` bf16's steps on average, over two or more seeds."""
    m = row["compressed"]
    return (serving_bits(row["codec"]) is not None and len(row["seeds"]) >= 2
            and m["multiplier"] is not None and m["multiplier"] <= multiplier)


def toy_rows(path: Path) -> dict[str, dict]:
    """The toy speedrun page's rows by codec (its JSON at ``path``), or none where there is no such file."""
    return {r["codec"]: r for r in json.loads(Path(path).read_text())["table"]} if Path(path).is_file() else {}


def _projected_t_text(rows: list[dict], seconds: float) -> str:
    """The projected-T goal over the candidates that met the bits goal, and why not where none does."""
    goal = f"**Its projected ProtocolNanoGPT T (served on its own; an estimate) at most {seconds:,.0f} s:**"
    if not rows:
        return f"- {goal} no candidate met the goal above."
    fits = [r for r in rows if (r["uncompressed"]["projected_T"] or math.inf) <= seconds]
    if fits:
        return f"- {goal} met by " + ", ".join(f"`{r['codec']}` ({t_text(r['uncompressed'])} s)" for r in fits) + "."
    why = []
    for r in rows:
        alone = r["projected_s_per_step"] * projection.SETUP.steps_to_target  # its wire at bf16's steps
        why.append(f"`{r['codec']}`: {t_text(r['uncompressed'])} s; at bf16's steps its seconds per step alone give "
                   f"{alone:,.0f} s" + (" (its steps multiplier makes the difference)" if alone <= seconds else
                                        " (above the goal whatever its steps)"))
    return f"- {goal} not met: " + "; ".join(why) + "."


def _toy_text(rows: list[dict], toy: dict[str, dict], fraction: float) -> str:
    """The toy speedrun's goal over the candidates that met the bits goal (their rows of the toy's page)."""
    goal = f"**On the toy's CPU speedrun (docs/SPEEDRUN.md), T at most {fraction:.2f}x bf16's:**"
    if not rows:
        return f"- {goal} no candidate met the goal above."
    if not toy:
        return f"- {goal} the toy speedrun's JSON was not found beside this page."
    bf16, parts, met = toy.get("bf16"), [], []
    for r in (r for r in rows if serving_bits(r["codec"]) is None):
        row = toy.get(r["codec"])
        if row is None:
            parts.append(f"`{r['codec']}`: not run on the toy")
            continue
        wire = row["s_per_step"] / bf16["s_per_step"] if bf16 else None
        if row.get("T_vs_bf16") is None:
            reached = score.missed_text(row.get("missed_within") or {})
        else:
            m = row["multiplier"]
            steps = _interval(m, row.get("multiplier_low", m), row.get("multiplier_high", m), suffix="x")
            reached = f"T {row['T_vs_bf16']:.3f}x bf16's (steps {steps})"
            met += [r["codec"]] if row["T_vs_bf16"] <= fraction else []
        parts.append(f"`{r['codec']}` ({len(row['seeds'])} seed{'s' if len(row['seeds']) > 1 else ''}): {reached}"
                     + (f"; its seconds per step alone are {wire:.3f}x bf16's" if wire is not None else ""))
    verdict = "met by " + ", ".join(f"`{c}`" for c in met) if met else "not met"
    return f"- {goal} {verdict}" + (": " + "; ".join(parts) + "." if parts else ".")


def goals_text(result: dict, toy: dict[str, dict] | None = None) -> str:
    """Each goal (``GOALS``) at the main depth: the candidates that meet it, or the closest ones and why not;
    ``toy``: the toy speedrun's rows by codec (``toy_rows``), for a goal on the toy."""
    lines = []
    rows = [r for r in result["table"] if r["codec"] != "bf16"]
    for g in GOALS:
        upper = f"upper end at most {g.steps_high:.2f}x; " if g.steps_high else ""
        goal = (f"**At most {g.bits:g} bits both ways, at most {g.steps:.2f}x bf16's steps ({upper}model served on its "
                f"own), damage at most {100 * g.damage:.1f}% above bf16's (upper end of its interval):**")
        met = [r for r in rows if meets(r, g.bits, g.steps, g.damage, g.steps_high)]
        if met:
            lines.append(f"- {goal} met by " + ", ".join(f"`{r['codec']}` ({bits_text(r)})" for r in met) + ".")
        else:
            within = sorted((r for r in rows if fewest_bits(r) <= g.bits), key=fewest_bits)
            why = "; ".join(f"`{r['codec']}` ({bits_text(r)}; {len(r['seeds'])} seed"
                            f"{'s' if len(r['seeds']) > 1 else ''}): {multiplier_text(r['uncompressed'])}, damage "
                            f"{damage_text(r['uncompressed'], r['codec'])}"
                            for r in within) or "no candidate run had so few bits"
            lines.append(f"- {goal} not met. Within the bits: {why}.")
        if g.serving is None:
            continue
        goal = (f"**The same, served through the pipeline at its serving bits (`--tah-eval-forward-bits`) in at most "
                f"{g.serving:.2f}x bf16's steps:**")
        serving = [r for r in met if serving_bits(r["codec"]) is not None]
        if any(serves(r, g.serving) for r in serving):
            lines.append(f"- {goal} met by " + ", ".join(
                f"`{r['codec']}` ({multiplier_text(r['compressed'])} through the pipeline at "
                f"{serving_bits(r['codec'])} forward bits)"
                for r in serving if serves(r, g.serving)) + ".")
        else:
            why = "; ".join(_serving_short(r, g.serving) for r in serving)
            lines.append(f"- {goal} not met" + (f": {why}." if why else ": no candidate that meets the goal above "
                                                                       "was evaluated at serving bits."))
        if g.projected_t is not None:
            lines.append(_projected_t_text([r for r in met if serving_bits(r["codec"]) is None], g.projected_t))
        if g.toy is not None:
            lines.append(_toy_text(met, toy or {}, g.toy))
    return "\n".join(lines)


def _serving_short(row: dict, multiplier: float) -> str:
    """Why ``row`` misses the serving goal: its multiplier through the pipeline, beside the same runs' served on its
    own; where that one's lower end is above the goal, the steps are the training's, not the serving codec's."""
    own = row["uncompressed"]
    text = (f"`{row['codec']}`: {multiplier_text(row['compressed'])} through the pipeline at "
            f"{serving_bits(row['codec'])} forward bits, {multiplier_text(own)} served on its own (the same runs)")
    if (own.get("multiplier_low") or 0) > multiplier and len(row["seeds"]) >= 2:
        text += (f": the training itself takes more than {multiplier:.2f}x bf16's steps, whatever the pipeline "
                 "serves at")
    return text


def serving_text(result: dict) -> str:
    """The candidates evaluated through the pipeline at other forward bits than they train with
    (``--tah-eval-forward-bits``): both metrics, beside the same training evaluated through its own codec when run."""
    by_codec = {r["codec"]: r for r in result["table"]}
    parts = []
    for row in result["table"]:
        if (bits := serving_bits(row["codec"])) is None:
            continue
        trained = training_fields(row["codec"])
        base = next((c for c, f in CODECS.items() if f == trained and c in by_codec), None)
        text = (f"`{row['codec']}` trains at {row['forward_bits']:.2f} + {row['backward_bits']:.2f} bits and evaluates "
                f"through the pipeline at {bits} forward bits: "
                f"{multiplier_text(row['uncompressed'])} bf16's steps served on its own, "
                f"{multiplier_text(row['compressed'])} served through the pipeline, damage through the pipeline "
                f"{damage_text(row['compressed'], row['codec'])}")
        if base:
            text += (f"; the same training evaluated through its own codec (`{base}`): "
                     f"{multiplier_text(by_codec[base]['compressed'])}")
        parts.append(text + ".")
    if not parts:
        return "No run of this page evaluates at other bits than it trains with (`--tah-eval-forward-bits`)."
    return "\n".join(f"- {p}" for p in parts)


def pipeline_text(result: dict) -> str:
    check = result.get("pipeline")
    if not check:
        return "Not run for this page (`--pipeline CODEC` runs it)."
    u, c = check["uncompressed"], check["compressed"]
    return (f"`{check['codec']}` with seed {check['seed']} ran as the real {check['depth']}-stage pipeline "
            f"(one process per stage over gloo, `python -m megatron_tah.pretrain_gpt` with "
            f"`--pipeline-model-parallel-size {check['depth']}` and `--tah-eval-traffic both`). Over the "
            f"{len(c['iterations'])} validations both runs made, its loss through the codecs differs from the emulated "
            f"run's of the same seed by at most {c['max_abs_diff']:.4f} (mean {c['mean_diff']:+.4f}), uncompressed by "
            f"at most {u['max_abs_diff']:.4f} (mean {u['mean_diff']:+.4f}); the emulated seeds' standard deviation "
            f"at those validations is {c['seed_spread']:.4f} on average. Its median step took "
            f"{check['ms'] / 1e3:.1f} s ({check['depth']} processes on the machine's cores).")


def reused_text(result: dict) -> str:
    """The runs whose curves come from an earlier page's JSON (``--from-page``), or nothing."""
    r = result.get("reused")
    if not r:
        return ""
    text = (f"; the curves of {r['runs']} more runs are this page's JSON of {r['date']} (`--from-page`: the same "
            f"schedule and model; that page's {r['earlier_runs']} runs took {r['run_hours']:.1f} hours")
    if (r["host"]["cpu"], r["host"]["torch"]) != (result["host"]["cpu"], result["host"]["torch"]):
        text += f", on {r['host']['cpu']} with torch {r['host']['torch']}"
        now, then = result.get("untouched"), r.get("untouched")
        if now and then:  # the same evaluation of the same weights on both machines: what mixing them costs
            text += (f"; the untouched model's evaluation differs between the two machines by "
                     f"{now['valid_loss'] - then['valid_loss']:+.4f} (validation) and "
                     f"{now['damage_loss'] - then['damage_loss']:+.4f} (damage corpus)")
    c = r.get("control")
    if c:  # bf16 trained again here: the same comparison after training
        steps = (f"; it reaches the target in {c['steps_here']:.1f} steps against {c['steps_there']:.1f}"
                 if c["steps_here"] is not None and c["steps_there"] is not None else "")
        text += (f"; `{c['run']}` trained again here: its {c['validations']} validations differ from the earlier "
                 f"machine's by {c['mean_diff']:+.4f} on average (largest {c['max_abs_diff']:.4f}), its damage "
                 f"corpus loss by {c['damage_diff']:+.4f}{steps}")
    return text + ")"


def noise_text(result: dict) -> str:
    n, r = result.get("noise") or {}, result.get("resolution") or {}
    parts = []
    if n:
        parts.append(
            f"Each validation reads the same {n['samples']} held-out sequences ({result['setup']['eval_iters']} "
            f"batches, {result['setup']['eval_iters'] * result['setup']['micro_batches'] * result['setup']['seq']:,} "
            f"tokens) in every run. Over {n['pairs']} validations of the codecs' runs, the standard error of the "
            f"paired difference to bf16's model of the same seed (per-sequence losses, uncompressed) has median "
            f"{n['median_se']:.4f} (largest {n['max_se']:.4f}), against a median gap of {n['median_gap']:.4f}; at "
            f"the target bf16 falls {result['target_slope']:.4f} per step, so that noise is "
            f"{n['se_in_steps']:.2f} steps.")
    if r:
        parts.append(
            f"Validations every {r['interval']} steps, steps to target interpolated between them: read from every "
            f"other validation instead, bf16's steps to target move by {r['mean_diff_steps']:.2f} steps on average "
            f"(at most {r['max_diff_steps']:.2f}, {100 * r['max_diff_fraction']:.1f}% of its steps).")
    return " ".join(parts) or "Not measured."


def presets_text(result: dict, depths=None, flag: bool = False) -> str:
    """The choice per depth and per use (``presets_by_depth``) as a table; ``depths`` adds rows for depths the study
    did not run ("not measured on the real model"); ``flag`` writes each choice's ``flag_line`` (the README's)."""
    from megatron_tah.config.presets import PRESETS

    picks = presets_by_depth(result)
    tables = {str(result["depth"]): result["table"], **result["depths"]}
    lines = [f"| pipeline depth | {USE['uncompressed']} | {USE['compressed']} |", "|---:|---|---|"]
    for depth in sorted({*picks, *map(str, depths or ())}, key=int):
        if depth not in picks:
            lines.append(f"| {depth} | not measured on the real model | not measured on the real model |")
            continue
        seeds = max((len(r["seeds"]) for r in tables[depth] if r["codec"] in PRESETS), default=0)
        none = ("none qualified: none (uncompressed)" if seeds >= 2 else
                "not chosen: the presets ran with one seed here (" + ", ".join(
                    f"`{r['codec']}` {multiplier_text(r['uncompressed'])}" for r in tables[depth]
                    if r["codec"] in PRESETS) + ")")
        cells = [none if picks[depth][t] is None
                 else (f"`{flag_line(picks[depth][t])}`" if flag else f"`{picks[depth][t]}`") for t in runs.TRAFFIC]
        lines.append(f"| {depth} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _wrap(text: str, width: int = 120) -> str:
    return "\n".join(textwrap.fill(p, width, break_long_words=False, break_on_hyphens=False) if p else p
                     for p in text.split("\n"))


def plot(result: dict, path: Path) -> None:
    """Validation loss per codec and seed at the main depth, both evaluations (two panels)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    colors = {}
    for ax, traffic in zip(axes, runs.TRAFFIC):
        seen = set()
        for name, curve in sorted(result["curves"].items()):
            if curve["depth"] not in (None, result["depth"]):
                continue
            color = colors.setdefault(curve["codec"], f"C{len(colors) % 10}")
            xs, ys = zip(*curve[traffic]) if curve[traffic] else ((), ())
            ax.plot(xs, ys, color=color, alpha=0.7, lw=1, label=None if curve["codec"] in seen else curve["codec"])
            seen.add(curve["codec"])
        ax.axhline(result["target"], color="grey", ls=":", label=f"target {result['target']:.3f}")
        ax.set_xlabel("step")
        ax.set_title(TRAFFIC_LABEL[traffic], fontsize=9)
    axes[0].set_ylabel("validation loss (held-out Shakespeare)")
    axes[1].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{result['model'].split(' (')[0]}, pipeline depth {result['depth']} (emulated)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_along(result: dict, path: Path) -> None:
    """N / M along the curve (uncompressed) at the main depth: each codec's mean over seeds per validation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bf16 = {c["seed"]: c for c in result["curves"].values() if c["codec"] == "bf16"}
    fig, ax = plt.subplots(figsize=(8, 5))
    for k, row in enumerate(r for r in result["table"] if r["codec"] != "bf16"):
        by_step: dict[int, list[float]] = {}
        for curve in result["curves"].values():
            if curve["codec"] == row["codec"] and curve["depth"] == result["depth"] and curve["seed"] in bf16:
                for n, m in score.equivalent_steps(curve["uncompressed"], bf16[curve["seed"]]["uncompressed"]):
                    by_step.setdefault(n, []).append(n / m)
        xs = sorted(by_step)
        ax.plot(xs, [statistics.fmean(by_step[x]) for x in xs], marker=".", color=f"C{k % 10}", label=row["codec"])
    ax.axhline(1.0, color="grey", ls=":")
    ax.set_xlabel("step N of the codec's run")
    ax.set_ylabel("N / M: M = bf16's step at the same loss (mean over seeds)")
    ax.set_title("steps multiplier along the curve, evaluated uncompressed")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_frontier(result: dict, path: Path) -> None:
    """Bits both ways at the reference shape against the steps multiplier (with its interval) per codec, on both
    evaluations; a codec that missed the target sits above the plot's top line, marked "missed"."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["table"] if r["codec"] != "bf16"]
    reached = [r[t] for r in rows for t in runs.TRAFFIC if r[t]["multiplier"] is not None]
    top = max([m["multiplier_high"] for m in reached] + [1.5]) + 0.3
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for k, traffic in enumerate(runs.TRAFFIC):
        shift, marker = (-0.04, "o") if traffic == "uncompressed" else (0.04, "s")
        for r in rows:
            x, m = r["forward_bits"] + r["backward_bits"] + shift, r[traffic]
            if m["multiplier"] is None:
                ax.plot([x], [top], "v", color=f"C{k}")
                if traffic == "uncompressed":
                    ax.annotate(f"{r['codec']} (missed)", (x, top), textcoords="offset points", xytext=(0, 6),
                                fontsize=7, rotation=90, ha="center", va="bottom")
            else:
                ax.errorbar([x], [m["multiplier"]], yerr=[[m["multiplier"] - m["multiplier_low"]],
                                                           [m["multiplier_high"] - m["multiplier"]]], fmt=marker,
                            color=f"C{k}", capsize=3, label=TRAFFIC_LABEL[traffic] if r is rows[0] else None)
                if traffic == "uncompressed":
                    ax.annotate(r["codec"], (x, m["multiplier"]), textcoords="offset points", xytext=(5, 3), fontsize=7)
    ax.axhline(1.0, color="grey", ls=":", label="bf16's steps")
    ax.set_ylim(top=top + 1.6)
    ax.set_xlabel("bits per value, forward + backward, at [1024, 8, 1024]")
    ax.set_ylabel("steps to target vs bf16 (95% interval)")
    ax.set_title("bits against steps on the real model")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_page(result: dict, page: Path) -> None:
    """``page`` (markdown), with its JSON and plots under ``docs/data/`` beside it."""
    page = Path(page)
    data, stem = save_data(result, page, plot)
    plot_frontier(result, data / f"{stem}_frontier.png")
    plot_along(result, data / f"{stem}_along.png")
    setup = result["setup"]
    untouched = result["untouched"] or {}
    template = (Path(__file__).parent / "page.md").read_text()
    bf16 = result["bf16_steps"]
    page.write_text(template.format(
        date=result["date"], command=result.get("command", "python -m benchmarks.real_model"), size=result["size"], size_note=runs.SIZES[result["size"]].note, cpu=result["host"]["cpu"],
        cores=result["host"]["cores"], json=f"data/{stem}.json", plot=f"data/{stem}.png", model=result["model"],
        target=f"{result['target']:.4f}", target_step=setup["target_step"], slope=f"{result['target_slope']:.4f}",
        depth=result["depth"], boundaries=", ".join(map(str, result["boundaries"][str(result["depth"])])),
        other_boundaries="; ".join(f"depth {d}: after layers {', '.join(map(str, b))}"
                                   for d, b in result["boundaries"].items() if d != str(result["depth"])) or "none",
        seq=setup["seq"], micro_batches=setup["micro_batches"],
        tokens=setup["seq"] * setup["micro_batch"] * setup["micro_batches"], iters=setup["iters"],
        lr=f"{setup['lr']:g}", warmup=setup["warmup"], eval_interval=setup["eval_interval"],
        eval_from=setup["eval_from"],
        eval_tokens=setup["eval_iters"] * setup["micro_batches"] * setup["micro_batch"] * setup["seq"],
        seeds=", ".join(map(str, result["seeds"])),
        table_uncompressed=table_markdown(result["table"], "uncompressed"),
        table_codec=table_markdown(result["table"], "compressed"), depths_table=depths_markdown(result),
        rule=_wrap(rule_text()), presets=presets_text(result),
        goals=goals_text(result, toy_rows(data / "speedrun.json")),
        serving=serving_text(result),
        untouched_damage=f"{untouched.get('damage_loss', float('nan')):.4f}",
        untouched_valid=f"{untouched.get('valid_loss', float('nan')):.4f}",
        untouched_accuracy=f"{100 * (untouched.get('damage_accuracy') or 0):.2f}%",
        s_per_step=f"{result['s_per_step']:.2f}", run_hours=f"{result['run_hours']:.1f}", runs=result["runs"],
        reused=reused_text(result), json_from_root=f"{page.parent.name}/data/{stem}.json",
        bf16_steps=_interval(bf16["mean"], bf16["low"], bf16["high"], 1), noise=noise_text(result),
        pipeline=pipeline_text(result), frontier=frontier_text(result), frontier_plot=f"data/{stem}_frontier.png",
        along_plot=f"data/{stem}_along.png", sensitivity_json=f"data/{stem}_sensitivity.json",
        sensitivity=sensitivity_text(data / f"{stem}_sensitivity.json")))


def sensitivity_text(path: Path) -> str:
    """The section from the sensitivity probe's JSON (``sensitivity.save``) at ``path``, or how to make it."""
    from .sensitivity import costliest, markdown

    if not Path(path).is_file():
        return "Not measured for this page (`python -m benchmarks.real_model.sensitivity --out ...` measures it)."
    results = json.loads(Path(path).read_text())["runs"]
    return markdown(results) + "\n\n" + costliest(results)
