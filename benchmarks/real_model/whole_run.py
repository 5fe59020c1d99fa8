"""The whole-run study's scores and page, from the runs of a registered plan (``plan.py``, ``whole_run.toml``).

What it adds to the short study's scoring (``scoring.py``: target, steps to it, damage at equal steps, bits):

* **The ratio along the run**, at each of the plan's ``points`` and on both evaluations: per seed, the point p over
  the step at which bf16 (same seed, served on its own) reached the codec's loss at p (``score.crossing``,
  interpolated, never extrapolated); a loss below bf16's end loss is censored: the ratio is at most p / bf16's last
  step, and that bound stands in for it (the interval then leans against the codec); one above bf16's first
  validation has none. The mean over seeds with its 95% interval where every seed has a ratio.
* **The end of the run** (the last point): where a preset is judged. **Trend**: the paired difference of each
  seed's end ratio and its first point's: "grows" (interval above 0), "shrinks" (below) or "holds" (holds 0).
* **The loss gap at equal steps** at every validation, both evaluations: codec minus bf16, paired by seed.
* **A seed that misses** the target within the run counts: the row says how many missed and is not a candidate.
* **The rule** (the plan's ``[rule]``) picks a preset per depth and use; the goals name the figure that fails.
* **The real pipeline** (the plan's pipeline stages): its losses against the emulation's at equal steps, within
  ``PIPELINE_TOLERANCE``; the bits its WAN ledger counted per value, forward + backward, at the run's shape.
"""

from __future__ import annotations

import datetime
import json
import math
import shlex
from pathlib import Path

from ..common.pages import save_data
from ..common.runner import read_log, read_meta
from ..common import score
from . import report, runs, scoring, verdicts
from .plan import Plan

PIPELINE_TOLERANCE = 0.02
"""The largest |real pipeline - emulation| validation loss at equal steps (same seed, both evaluations) that agrees."""


# ----- along the run -------------------------------------------------------------------------------------------
def ratio_at(curve: list, base: list, point: int) -> tuple[float | None, str]:
    """(ratio, how) of a codec's curve against bf16's at step ``point``: ``how`` is "" (measured), "censored" (the
    codec's loss lies below bf16's last validation: the ratio is at most the value given), "above" (above bf16's
    first validation: none) or "missing" (no validation at ``point``)."""
    loss = dict(curve).get(point)
    if loss is None:
        return None, "missing"
    base = sorted(base)
    if loss > base[0][1]:
        return None, "above"
    m = score.crossing(base, loss)
    if m is None:
        return point / base[-1][0], "censored"
    return point / m, ""


def along(curves: dict, names: dict[int, str], bf16: dict[int, str], traffic: str, points: tuple[int, ...]) -> dict:
    """{point: {"by_seed", "how", "mean", "low", "high", "censored"}} of one codec on one evaluation."""
    found = {}
    for point in points:
        by_seed, how = {}, {}
        for seed, name in names.items():
            value, kind = ratio_at(curves[name][traffic], curves[bf16[seed]]["uncompressed"], point)
            by_seed[str(seed)], how[str(seed)] = value, kind
        measured = [v for v in by_seed.values() if v is not None]  # a censored seed at its bound: at most that
        whole = len(measured) == len(by_seed)
        interval = score.mean_interval(measured) if whole and measured else None
        found[str(point)] = {"by_seed": by_seed, "how": how, "censored": sorted(s for s, k in how.items() if k),
                             **scoring._interval_fields("ratio", interval)}
    return found


def trend(points: dict) -> dict:
    """The paired change of each seed's ratio from the first point to the last: its interval and verdict."""
    keys = sorted(points, key=int)
    first, last = points[keys[0]], points[keys[-1]]
    seeds = [s for s in last["by_seed"] if last["by_seed"][s] is not None and first["by_seed"].get(s) is not None]
    if len(seeds) < 2:
        return {"change": None, "change_low": None, "change_high": None, "verdict": "–"}
    interval = score.mean_interval([last["by_seed"][s] - first["by_seed"][s] for s in seeds])
    verdict = "grows" if interval.low > 0 else "shrinks" if interval.high < 0 else "holds (within noise)"
    return {**scoring._interval_fields("change", interval), "verdict": verdict, "from": int(keys[0]),
            "to": int(keys[-1])}


def gaps(curves: dict, names: dict[int, str], bf16: dict[int, str], traffic: str) -> list[dict]:
    """At every validation both have: the codec's loss minus bf16's (same seed, served on its own), its interval."""
    steps = sorted(set.intersection(*(set(dict(curves[n][traffic])) for n in names.values()),
                                    *(set(dict(curves[bf16[s]]["uncompressed"])) for s in names)))
    found = []
    for step in steps:
        diffs = [dict(curves[n][traffic])[step] - dict(curves[bf16[s]]["uncompressed"])[step] for s, n in names.items()]
        interval = score.mean_interval(diffs)
        found.append({"step": step, **scoring._interval_fields("gap", interval), "n": interval.n})
    return found


# ----- the pipeline check and the ledger's bits ----------------------------------------------------------------
def ledger_bits(records: list[dict]) -> dict | None:
    """Bits per value the WAN ledger counted over a pipeline run's training steps, forward and backward (the
    activations were bf16: 16 bits raw)."""
    totals = {k: sum(r.get(k) or 0 for r in records if "lm_loss" in r)
              for k in ("fwd_raw_bytes", "fwd_wire_bytes", "bwd_raw_bytes", "bwd_wire_bytes")}
    if not totals["fwd_raw_bytes"] or not totals["bwd_raw_bytes"]:
        return None
    forward = 16 * totals["fwd_wire_bytes"] / totals["fwd_raw_bytes"]
    backward = 16 * totals["bwd_wire_bytes"] / totals["bwd_raw_bytes"]
    return {"forward": forward, "backward": backward, "both": forward + backward}


def parted_at(a: list[dict], b: list[dict], tolerance: float = 1e-6) -> int | None:
    """The first training iteration whose loss differs between two runs' records by more than ``tolerance``
    (relative): where a real pipeline and its emulation part (None: never, over the iterations both logged)."""
    losses = {r["iteration"]: r["lm_loss"] for r in b if "lm_loss" in r}
    for r in sorted((r for r in a if "lm_loss" in r), key=lambda r: r["iteration"]):
        other = losses.get(r["iteration"])
        if other is not None and abs(r["lm_loss"] - other) > tolerance * abs(other):
            return int(r["iteration"])
    return None


def pipeline_checks(plan: Plan, out: Path, curves: dict) -> list[dict]:
    """Every finished pipeline run of the plan against its emulated run (same codec, seed, depth)."""
    found = []
    for stage in (s for s in plan.stages if s.kind == "pipeline"):
        for depth in stage.depths:
            for codec in stage.codecs:
                for seed in stage.seeds:
                    name = runs.pipeline_name(codec, seed, depth, stage.tag)
                    meta = read_meta(out, name)
                    if not meta or meta.get("status") != 0:
                        continue
                    records = read_log(out / f"{name}.jsonl")
                    if runs.run_name(codec, seed, depth) in curves:
                        check = scoring.pipeline_check(out, codec, [seed], curves, depth, name)
                        diffs = [check[t]["max_abs_diff"] for t in runs.TRAFFIC if check[t]["max_abs_diff"] is not None]
                        agrees = bool(diffs) and max(diffs) <= PIPELINE_TOLERANCE
                        check["parted_at"] = parted_at(records, read_log(out / f"{runs.run_name(codec, seed, depth)}.jsonl"))
                    else:  # its emulated run has not finished: the bits now, the losses later
                        check = {"codec": codec, "seed": seed, "depth": depth, **{t: None for t in runs.TRAFFIC}}
                        agrees = None
                    check.update(stage=stage.name, flags=list(stage.flags), exit=stage.exit, commit=meta.get("commit"),
                                 ledger_bits=ledger_bits(records), shape=[plan.size.seq, plan.size.micro_batch],
                                 agrees=agrees)
                    found.append(check)
    return found


# ----- the toy, pretraining from scratch -----------------------------------------------------------------------
TOY_FRACTION = 0.92  # the toy's target rule (benchmarks.common.score.target_loss): bf16's worst seed at 92%


def toy_points(steps: int, interval: int) -> tuple[int, ...]:
    """A quarter, half, three quarters of a toy run and its end, on its validations (multiples of ``interval``)."""
    return tuple(sorted({max(interval, round(steps * k / 4 / interval) * interval) for k in (1, 2, 3)} | {steps}))


def toy_results(plan: Plan, out: Path) -> list[dict]:
    """Each toy stage's finished loss runs under ``out``, on both evaluations: the target (the toy's rule on this
    schedule: bf16's worst seed's validation loss at 92% of it), each seed's steps to it against bf16's with the
    same seed (interpolated; a seed that misses: None), the equivalent-steps ratio along the run (``along``) and the
    loss gap at equal steps (``gaps``)."""
    from ..speedrun import runs as toy

    found = []
    for stage in (s for s in plan.stages if s.kind == "toy"):
        size = plan.toy_size()
        curves, names = {}, {}
        for seed in stage.seeds:
            for codec in stage.codecs:
                name = toy.loss_run_name(codec, seed, stage.steps, size, emulated=True)
                meta = read_meta(out, name)
                if not meta or meta.get("status") != 0:
                    continue
                records = read_log(out / f"{name}.jsonl")
                if records[-1]["iteration"] < stage.steps:
                    continue
                through = toy.validations(records, "valid_loss")
                curves[name] = {"compressed": through,
                                "uncompressed": toy.validations(records, "valid_loss_uncompressed") or through}
                names.setdefault(codec, {})[seed] = name
        entry = {"stage": stage.name, "steps": stage.steps, "planned": len(stage.seeds) * len(stage.codecs),
                 "finished": len(curves), "rows": []}
        found.append(entry)
        bf16 = names.get("bf16", {})
        if not bf16:
            continue
        target = score.target_loss([curves[n]["uncompressed"] for n in bf16.values()], stage.steps, TOY_FRACTION)
        points = toy_points(stage.steps, size.eval_interval)
        entry.update(target=target, points=list(points))
        for codec in (c for c in stage.codecs if c != "bf16" and c in names):
            mine = {s: n for s, n in names[codec].items() if s in bf16}
            if not mine:
                continue
            row = {"codec": codec, "seeds": sorted(mine)}
            for traffic in runs.TRAFFIC:
                steps = {}
                for seed, name in mine.items():
                    own = score.crossing(curves[name][traffic], target)
                    base = score.crossing(curves[bf16[seed]]["uncompressed"], target)
                    steps[str(seed)] = {"steps": own, "bf16": base,
                                        "ratio": None if own is None or not base else own / base}
                gap = gaps(curves, mine, bf16, traffic)
                row[traffic] = {"to_target": steps, "points": along(curves, mine, bf16, traffic, points),
                                "end_gap": gap[-1] if gap else None}
            entry["rows"].append(row)
    return found


def toy_markdown(entry: dict) -> list[str]:
    """A toy stage's section of the page."""
    lines = [f"## The toy, pretraining from scratch (stage {entry['stage']})", "",
             f"{entry['finished']} of {entry['planned']} runs finished ({entry['steps']} steps, emulated boundaries)."]
    if "target" not in entry:
        return lines + [""]
    lines += [f"Target: bf16's worst seed's validation loss at {TOY_FRACTION:.0%} of the run: {entry['target']:.3f}. "
              "Steps to it per seed (codec / bf16 with the same seed, bf16 evaluated as it is), the ratio along the run "
              "and the gap at its end (codec minus bf16, same seed):", "",
              "| codec | evaluation | steps to target (ratio) per seed | "
              + " | ".join(f"ratio at {p}" for p in entry["points"]) + " | gap at the end |",
              "|---|---|---|" + "---|" * len(entry["points"]) + "---|"]
    for row in entry["rows"]:
        for traffic in runs.TRAFFIC:
            r = row[traffic]
            seeds = "; ".join(f"{seed}: " + (f"{v['steps']:.0f} / {v['bf16']:.0f} ({v['ratio']:.2f}x)"
                                              if v["ratio"] is not None else f"missed within {entry['steps']}")
                              for seed, v in r["to_target"].items())
            gap = r["end_gap"]
            end = "–" if gap is None else (f"{gap['gap']:+.4f}" + (f" [{gap['gap_low']:+.4f}, {gap['gap_high']:+.4f}]"
                                                                    if gap.get("gap_low") is not None else ""))
            lines.append(f"| `{row['codec']}` | {SHORT_LABEL[traffic].lower()} | {seeds} | "
                         + " | ".join(_ratio(r["points"][str(p)]) for p in entry["points"]) + f" | {end} |")
    return lines + [""]


# ----- choosing ------------------------------------------------------------------------------------------------
def end(row: dict, traffic: str) -> dict:
    return row[traffic]["points"][str(max(int(p) for p in row[traffic]["points"]))]


def eligible(row: dict, traffic: str, rule: dict) -> str:
    """"" when ``row`` may be chosen on ``traffic`` by the plan's rule, else why not."""
    m, e = row[traffic], end(row, traffic)
    if row["codec"] == "bf16":
        return "the baseline"
    if not verdicts.candidates([row], traffic):  # the short study's candidates: presets, serving runs in the pipeline
        return "not a preset" + (" (a serving variant: judged through the pipeline)" if traffic == "uncompressed"
                                 and scoring.serving_bits(row["codec"]) is not None else "")
    if m["missed_within"] is not None:
        return "missed the target in " + ", ".join(k for k, v in m["steps_by_seed"].items() if v is None)
    if len(row["seeds"]) < 2:
        return "one seed"
    if e["ratio"] is None:
        return "no end-of-run ratio (a seed above bf16's curve there)"
    if e["ratio_high"] > rule["ratio_high"]:
        return f"end-of-run ratio's upper end {e['ratio_high']:.2f} > {rule['ratio_high']:.2f}"
    if m["damage_vs_bf16_low"] is not None and m["damage_vs_bf16_low"] > 0:
        return "more damage than bf16's"
    return ""


def choose(rows: list[dict], traffic: str, rule: dict) -> str | None:
    """The plan's rule: among the eligible, those within ``tie`` of the lowest mean end-of-run ratio; of these
    the fewest bits on the busiest link, then the lowest projected T."""
    candidates = [r for r in rows if not eligible(r, traffic, rule)]
    if not candidates:
        return None
    best = min(end(r, traffic)["ratio"] for r in candidates)
    tied = [r for r in candidates if end(r, traffic)["ratio"] <= best + rule["tie"]]
    tied.sort(key=lambda r: (r["busiest_bits"], r[traffic].get("projected_T") or math.inf))
    return tied[0]["codec"]


def goal(row: dict, rule: dict, checks: list[dict], traffic: str = "uncompressed") -> list[str]:
    """What fails of the plan's goal for ``row`` on ``traffic`` ([] when it meets it): the end-of-run ratio and
    damage on that evaluation; served on its own also the bits both ways on the WAN ledger of a real pipeline run
    with the coder (``checks``: the page's pipeline runs). Served through the pipeline the goal is the ratio with
    the preset's serving bits: no ledger figure."""
    fails = []
    e = end(row, traffic)
    if e["ratio"] is None or e["ratio"] > rule["goal_ratio"] or e["ratio_high"] > rule["ratio_high"]:
        fails.append("end-of-run ratio " + ("none" if e["ratio"] is None else
                                            f"{e['ratio']:.2f} [{e['ratio_low']:.2f}, {e['ratio_high']:.2f}]"))
    high = row[traffic]["damage_vs_bf16_high"]
    if high is None or high > rule["goal_damage"]:
        fails.append("damage " + ("not measured over 2 seeds" if high is None else f"up to {100 * high:+.2f}%"))
    if traffic != "uncompressed":
        return fails
    ledger = [c["ledger_bits"]["both"] for c in checks if c["codec"] == row["codec"] and c["depth"] == row["depth"]
              and c["ledger_bits"] and "--tah-entropy-coding" in c["flags"]]
    if not ledger:
        fails.append("no real pipeline run with the coder yet (WAN ledger bits)")
    elif max(ledger) > rule["goal_bits"]:
        fails.append(f"{max(ledger):.2f} bits both ways on the WAN ledger")
    return fails


def goal_text(rows: list[dict], chosen: str | None, traffic: str, rule: dict, final: bool = True) -> str:
    """The page's line on the plan's goal for the rule's choice on ``traffic`` (each figure that fails named); "so
    far" until the depth's verdict is in (``final``)."""
    what = (f"end-of-run ratio <= {rule['goal_ratio']:.2f}x with its upper end <= {rule['ratio_high']:.2f}x, damage "
            f"within {100 * rule['goal_damage']:g}% of bf16's" +
            (f", <= {rule['goal_bits']:g} bits both ways on the WAN ledger of a real pipeline run with the coder"
             if traffic == "uncompressed" else ", with its serving bits"))
    if chosen is None:
        return (f"The plan's goal ({what}): no preset is eligible, so none meets it here; bf16 (uncompressed) stays."
                if final else f"The plan's goal ({what}): no preset is eligible so far.")
    fails = next(r for r in rows if r["codec"] == chosen)[traffic]["goal_fails"]
    so_far = "" if final else " so far"
    return (f"The plan's goal ({what}): `{chosen}` " +
            (f"does not meet it{so_far}: {'; '.join(fails)}." if fails else f"meets it{so_far}."))


# ----- the whole study -----------------------------------------------------------------------------------------
def build(plan: Plan, out: Path) -> dict:
    """Everything the page shows, from the plan's runs finished under ``out`` (a study going on: what is done)."""
    out = Path(out)
    depth_codecs = plan.depth_codecs()
    curves = scoring.read_curves(out, depth_codecs, list(plan.seeds))
    bf16 = {s: runs.run_name("bf16", s) for s in plan.seeds if runs.run_name("bf16", s) in curves}
    names = {s.name: plan.toy_run_names(s) if s.kind == "toy" else plan.run_names(s) for s in plan.stages}
    planned = {n for listed in names.values() for n in listed}
    result = {"date": datetime.date.today().isoformat(), "plan": str(plan.path.name), "plan_name": plan.name,
              "registered": plan.registered, "schedule": plan.schedule, "machine": plan.machine,
              "setup": plan.size.setup(), "model": runs.MODELS[plan.size.model].description, "seeds": list(plan.seeds),
              "points": list(plan.points), "rule": plan.rule, "budget": plan.budget,
              "stages": [{"name": st.name, "what": st.what, "kind": st.kind, "runs": names[st.name], "after": st.after,
                          "added": st.added} for st in plan.stages],
              "tables": {}, "chosen": {}, "final": {}}
    result["finished"] = finished_runs(out)
    result.update(planned=len(planned), planned_finished=len(planned & set(result["finished"])))
    result["toy"] = toy_results(plan, out)
    if not bf16:  # one seed scores (its intervals say "one seed"): a study going on shows where it stands
        result["note"] = f"no bf16 run finished under {out} yet: nothing scored"
        return result
    untouched = runs.evaluation(read_log(out / "eval_untouched.jsonl")) if (out / "eval_untouched.jsonl").is_file() \
        else None
    target, slope = scoring.target_and_slope([curves[n]["uncompressed"] for n in bf16.values()], plan.target_step,
                                            window=max(4, plan.size.eval_interval))  # the validations either side
    result.update(target=target, target_slope=slope, curves=curves)
    checks = pipeline_checks(plan, out, curves)
    result["pipeline"] = checks
    for depth, codecs in depth_codecs.items():
        rows = []
        for codec in codecs:
            names = {s: runs.run_name(codec, s, depth) for s in bf16 if runs.run_name(codec, s, depth) in curves}
            if not names:
                continue
            row = scoring.codec_row(codec, depth, names, bf16, curves, target, plan.size, out, untouched)
            for traffic in runs.TRAFFIC:
                points = along(curves, names, bf16, traffic, plan.points)
                gap = gaps(curves, names, bf16, traffic)
                every = along(curves, names, bf16, traffic, tuple(g["step"] for g in gap))
                row[traffic].update(points=points, trend=trend(points), gaps=gap,
                                    ratios=[[int(k), v["ratio"], v["ratio_low"], v["ratio_high"]]
                                            for k, v in every.items() if v["ratio"] is not None])
            row["planned_seeds"] = [s for st in plan.stages if st.kind == "emulated" and depth in st.depths
                                    and (codec in st.codecs or codec == "bf16") for s in st.seeds]
            for traffic in runs.TRAFFIC:
                row[traffic]["eligible"] = eligible(row, traffic, plan.rule)
                row[traffic]["goal_fails"] = [] if codec == "bf16" else goal(row, plan.rule, checks, traffic)
            rows.append(row)
        scoring.project(rows, depth)
        result["tables"][str(depth)] = rows
        result["chosen"][str(depth)] = {t: choose(rows, t, plan.rule) for t in runs.TRAFFIC}
        result["final"][str(depth)] = verdict_in(rows, codecs)
    return result


def finished_runs(out: Path) -> dict:
    """{run name: {"seconds", "commit", "cpu"}} of every run finished under ``out``."""
    found = {}
    for path in sorted(Path(out).glob("*.meta.json")):
        meta = json.loads(path.read_text())
        if meta.get("status") == 0:
            found[meta["name"]] = {"seconds": meta.get("seconds"), "commit": meta.get("commit"),
                                   "cpu": (meta.get("host") or {}).get("cpu")}
    return found


# ----- the page ------------------------------------------------------------------------------------------------
def _ratio(p: dict) -> str:
    if p["ratio"] is not None:
        bound = f" ({len(p['censored'])} censored at <=)" if p["censored"] else ""
        return (f"{p['ratio']:.2f}x [{p['ratio_low']:.2f}, {p['ratio_high']:.2f}]" if len(p["by_seed"]) > 1
                else f"{p['ratio']:.2f}x (one seed)") + bound
    parts = []
    for seed, kind in sorted(p["how"].items()):
        value = p["by_seed"][seed]
        parts.append(f"{seed}: " + {"censored": f"<= {value:.2f}x" if value else "censored",
                                    "above": "above bf16's first", "missing": "not run", "": f"{value:.2f}x"}[kind])
    return "; ".join(parts) or "–"


def table_markdown(rows: list[dict], traffic: str, points: list[int]) -> str:
    head = ["preset", "seeds", *(f"ratio at {p}" for p in points), "trend", "damage at the end", "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        if row["codec"] == "bf16":
            continue
        m = row[traffic]
        damage = m["damage_vs_bf16"]
        damage_text = "–" if damage is None else report._interval(damage, m["damage_vs_bf16_low"],
                                                                   m["damage_vs_bf16_high"], 2, "%", percent=True)
        reason = m["eligible"]
        cells = [f"`{row['codec']}`", f"{len(row['seeds'])} of {len(set(row['planned_seeds']))}",
                 *(_ratio(m["points"][str(p)]) for p in points), m["trend"]["verdict"], damage_text,
                 "candidate" if not reason else reason]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gaps_markdown(rows: list[dict], traffic: str, points: list[int]) -> str:
    head = ["preset", *(f"at {p}" for p in points)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        if row["codec"] == "bf16":
            continue
        at = {g["step"]: g for g in row[traffic]["gaps"]}
        cells = [f"`{row['codec']}`"]
        for p in points:
            g = at.get(p)
            cells.append("–" if g is None else f"{g['gap']:+.4f}" + ("" if g["n"] < 2 else
                                                                     f" [{g['gap_low']:+.4f}, {g['gap_high']:+.4f}]"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


SHORT_LABEL = {"uncompressed": "Evaluated uncompressed", "compressed": "Evaluated through the codecs"}


def pipeline_line(c: dict, goal_bits: float) -> str:
    """One pipeline check on the page: where the two runs' losses lie furthest apart, the validations outside the
    tolerance, and the ledger's bits against the goal."""
    parts = []
    for t in runs.TRAFFIC:
        check = c[t]
        if check is None or check["max_abs_diff"] is None:
            continue
        diffs = [(abs(p - e), i) for i, p, e in zip(check["iterations"], check["pipeline"], check["emulated"])]
        worst, at = max(diffs)
        out = [i for d, i in diffs if d > PIPELINE_TOLERANCE]
        parts.append(f"{SHORT_LABEL[t]}: largest {worst:.4f} (step {at}), mean pipeline - emulation "
                     f"{check['mean_diff']:+.4f}" + (f", outside at step(s) {', '.join(map(str, out))}" if out else ""))
    bits = c["ledger_bits"]
    ledger = (f"{bits['forward']:.2f} + {bits['backward']:.2f} = {bits['both']:.3f} bits per value "
              f"({'within' if bits['both'] <= goal_bits else 'above'} {goal_bits:g})") if bits else "–"
    parted = c.get("parted_at")
    apart = ("" if c["agrees"] is None or "parted_at" not in c else
             f". The training losses are the same to 6 digits until iteration {parted - 1}, apart from iteration "
             f"{parted} on" if parted else ". The training losses are the same to 6 digits at every iteration")
    return (f"- `{c['codec']}` at depth {c['depth']} (stage {c.get('stage', '?')}, "
            f"{' '.join(c['flags']) or 'no further flags'}, {c['exit']} steps, commit {str(c['commit'])[:10]}): "
            + ("its emulated run has not finished: no comparison yet" if c["agrees"] is None else
               f"**{'agrees' if c['agrees'] else 'does not agree'}** within {PIPELINE_TOLERANCE}. " + "; ".join(parts))
            + apart
            + f". WAN ledger: {ledger} at "
            f"[{c['shape'][0]}, {c['shape'][1]}, hidden].")


def verdict_in(rows: list[dict], codecs: list[str]) -> bool:
    """Whether the plan's verdict at a depth is in: bf16 and every codec planned there that the rule may choose
    (``codecs``' presets and serving variants; not the one-direction measurements) have every planned seed."""
    from megatron_tah.config.presets import PRESETS

    done = {r["codec"] for r in rows if scoring.seeds_all_in(r)}
    return all(c in done for c in codecs if c == "bf16" or c in PRESETS or scoring.serving_bits(c) is not None)


def chosen_text(chosen: str | None, final: bool) -> str:
    """The rule's choice at a depth; named as a study going on until its verdict is in (``final``)."""
    if final:
        return f"Chosen by the rule: {chosen or 'none'}."
    return ("Chosen by the rule so far (not the plan's verdict until every planned seed of every codec here is in): "
            f"{chosen or 'none yet'}.")


def write_page(result: dict, page: Path, command: str) -> None:
    """``page`` with its JSON and plot under ``docs/data/``."""
    result["command"] = command
    page = Path(page)
    data, stem = save_data(result, page, plot)
    lines = [f"# The whole run: {result['model'].split(' (')[0]}, {result['schedule']}", "",
             f"Written by `{command}` on {result['date']} from the runs of the plan registered on "
             f"{result['registered']} ([benchmarks/real_model/{result['plan']}](../benchmarks/real_model/{result['plan']})); "
             f"its JSON: [data/{stem}.json](data/{stem}.json). Runs finished: {result['planned_finished']} of "
             f"{result['planned']} planned (machine: {result['machine']}).", ""]
    if result["planned_finished"] < result["planned"]:
        lines += [f"**A study going on**: {result['planned_finished']} of {result['planned']} planned runs are in. "
                  "Figures over fewer seeds than planned are not the plan's verdict; a seed that missed counts.", ""]
    lines += ["## Where the study stands", ""]
    for st in result["stages"]:
        done = [n for n in st["runs"] if n in result["finished"]]
        commits = sorted({str(result["finished"][n]["commit"])[:10] for n in done})
        cpus = sorted({str(result["finished"][n]["cpu"]) for n in done})
        lines.append(f"- Stage {st['name']} ({st['kind']}): " + (f"{st['what']}. " if st["what"] else "")
                     + f"{len(done)} of {len(st['runs'])} runs finished"
                     + (f" (commit {', '.join(commits)}; {', '.join(cpus)})" if done else "")
                     + (f". Waits for: {st['after']}" if st["after"] and not done else "")
                     + (f". **Added after results:** {st['added']}" if st["added"] else "") + ".")
    lines.append("")
    if "target" not in result:
        lines += [result.get("note", ""), ""]
    else:
        lines += [f"Target: bf16's mean validation loss at step {result['setup']['target_step']}: "
                  f"{result['target']:.4f} (falling {result['target_slope']:.4f} per step there). Rule: "
                  f"{result['rule']['text']}.", "", f"![ratio along the run](data/{stem}.png)", ""]
        for depth, rows in result["tables"].items():
            if all(r["codec"] == "bf16" for r in rows):
                continue  # no codec of this depth finished yet
            for traffic in runs.TRAFFIC:
                lines += [f"## Depth {depth}, {scoring.TRAFFIC_LABEL[traffic]}", "",
                          table_markdown(rows, traffic, result["points"]), "",
                          "Loss gap at equal steps (codec minus bf16, same seed; bf16 served on its own):", "",
                          gaps_markdown(rows, traffic, result["points"]), "",
                          chosen_text(result["chosen"][depth][traffic], result["final"][depth]), "",
                          goal_text(rows, result["chosen"][depth][traffic], traffic, result["rule"],
                                    result["final"][depth]), ""]
        if result["pipeline"]:
            lines += ["## The real pipeline", "",
                      f"Each run against its emulated run (same codec, seed and depth) at every validation both ways; "
                      f"the plan's tolerance: {PIPELINE_TOLERANCE} absolute at every validation. Bits: the WAN "
                      f"ledger's over the run's training steps (goal: <= {result['rule']['goal_bits']:g} both ways).",
                      ""]
            lines += [pipeline_line(c, result["rule"]["goal_bits"]) for c in result["pipeline"]]
            lines.append("")
    for entry in result.get("toy", []):
        lines += toy_markdown(entry)
    page.write_text("\n".join(lines) + "\n")


PLOT_RANGE = (0.5, 10.0)  # the ratio axis (log): a band of two seeds may reach below 0 or far above; drawn clipped


def plot(result: dict, path: Path) -> None:
    """The ratio at every validation per codec at each depth (mean over seeds, band: its 95% interval clipped to
    ``PLOT_RANGE``; dashed: the plan's points; red: the plan's goal), both evaluations, on a log axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    tables = {d: rows for d, rows in (result.get("tables") or {}).items() if any(r["codec"] != "bf16" for r in rows)}
    fig, axes = plt.subplots(max(len(tables), 1), 2, figsize=(12, 4 * max(len(tables), 1)), squeeze=False)
    for k, (depth, rows) in enumerate(tables.items()):
        for ax, traffic in zip(axes[k], runs.TRAFFIC):
            for c, row in enumerate(r for r in rows if r["codec"] != "bf16"):
                ratios = row[traffic]["ratios"]
                if ratios:
                    xs, means, lows, highs = zip(*ratios)
                    ax.plot(xs, means, color=f"C{c % 10}", label=row["codec"])
                    lows = [max(PLOT_RANGE[0], m if v is None else v) for v, m in zip(lows, means)]
                    highs = [min(PLOT_RANGE[1], m if v is None else v) for v, m in zip(highs, means)]
                    ax.fill_between(xs, lows, highs, color=f"C{c % 10}", alpha=0.15)
            for point in result["points"]:
                ax.axvline(point, color="grey", lw=0.5, ls="--")
            ax.axhline(1.0, color="grey", ls=":")
            ax.axhline(result["rule"]["goal_ratio"], color="red", lw=0.8, ls=":", label="the plan's goal")
            ax.set_yscale("log")
            ax.set_ylim(*PLOT_RANGE)
            ax.set_yticks([0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0])
            ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%gx"))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_title(f"depth {depth}, {scoring.TRAFFIC_LABEL[traffic]}", fontsize=9)
            ax.set_xlabel("step")
            ax.set_ylabel("equivalent-steps ratio vs bf16")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main_write(plan: Plan, out: Path, page: Path, argv) -> None:
    import sys

    from . import measured

    result = build(plan, out)
    command = shlex.join(["python", "-m", "benchmarks.real_model", *(sys.argv[1:] if argv is None else argv)])
    write_page(result, page, command)
    print(f"[real_model] wrote {page}")
    shares = measured.direction_shares(result)
    target = Path(page).resolve().parent.parent / measured.MEASURED
    if shares and target.exists():  # auto's split of each multiplier between the directions
        measured.write_shares(target, shares)
        print(f"[real_model] wrote {target}")
