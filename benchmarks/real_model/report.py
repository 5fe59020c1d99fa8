"""The real-model study's numbers (``build``) and its page (``write_page``: markdown, JSON, plot).

Scoring, the same for every codec:

* **Steps to target**: the first validation at or below the target (``benchmarks.speedrun.score``). A run
  that does not reach it within ``max_factor`` schedules has no steps and its row says "missed within N
  steps", with no multiplier.
* **Steps vs bf16**: the mean over seeds of a codec's steps over bf16's with the same seed (same data order),
  with a two-sided 95% Student-t interval; only when every seed reached the target.
* **Damage**: the model where the run stopped (bf16: where each seed first reached the target), evaluated
  uncompressed on the damage corpus; its loss against bf16's fine-tuned model of the same seed (paired, with
  its interval; "within noise" when it holds 0) and against the untouched checkpoint. A codec whose paired
  interval lies above 0 damages the model more than fine-tuning does, and its row says so.
* **Projected T** on the ProtocolNanoGPT setup (``benchmarks.speedrun.projection``): the codec's bytes at
  ``[1024, 8, 1024]`` through the schedule simulator, times the bf16 record's steps x this study's multiplier.
"""

from __future__ import annotations

import datetime
import json
import statistics
from pathlib import Path

import torch

from ..pages import save_data
from ..reproduce.runner import read_log, read_meta
from ..speedrun import projection, score
from ..speedrun.runs import CODECS, busiest_nbytes, forward_codecs
from . import runs

REFERENCE_SHAPE = (1024, 8, 1024)  # the bits every page quotes: the ProtocolNanoGPT message


def bits(codec: str, shape, stages: int = 8) -> tuple[float, float]:
    """(forward, backward) wire bits per value of one bf16 message of ``shape`` (headers included); forward with
    per-boundary bits: the mean over the ``stages - 1`` boundaries."""
    from megatron_tah.config import TahConfig

    config = TahConfig(**CODECS[codec])
    values = shape[0] * shape[1] * shape[2]
    forward = [8 * c.wire_nbytes(shape, torch.bfloat16) / values for c in forward_codecs(config, stages)]
    return sum(forward) / len(forward), 8 * config.backward_codec().wire_nbytes(shape, torch.bfloat16) / values


def _paired(values: dict[int, float], base: dict[int, float], relative: bool = False) -> score.Interval | None:
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
        return "more damage than bf16's fine-tune"
    if delta.high < 0:
        return "less damage than bf16's fine-tune"
    return "within noise"


def build(size: runs.Size, target: float, codecs: list[str], seeds: list[int], out: Path, host: dict,
          pipeline: str | None = None) -> dict:
    """Everything the page shows, from the runs under ``out``."""
    out = Path(out)
    evals = {}
    for path in sorted(out.glob("eval_*.jsonl")):
        evals[path.stem] = runs.evaluation(read_log(path))
    curves, stops = {}, {}
    for codec in codecs:
        for seed in seeds:
            name = runs.run_name(codec, seed)
            records = read_log(out / f"{name}.jsonl")
            curves[name] = {"codec": codec, "seed": seed, "validations": runs.validations(records),
                            "ms": statistics.median([r["ms"] for r in records if r.get("ms")] or [0.0])}
    untouched = evals.get("eval_untouched")
    base_steps = {s: score.steps_to_target(curves[runs.run_name("bf16", s)]["validations"], target) for s in seeds}
    base_damage = {s: evals[f"eval_{runs.run_name('bf16', s)}"]["damage_loss"] for s in seeds}
    base_mean = statistics.fmean(base_steps.values())
    rows = []
    for codec in codecs:
        steps, damage, accuracy, valid = {}, {}, {}, {}
        longest = {}
        for seed in seeds:
            name = runs.run_name(codec, seed)
            steps[seed] = score.steps_to_target(curves[name]["validations"], target)
            longest[seed] = curves[name]["validations"][-1][0] if curves[name]["validations"] else 0
            e = evals[f"eval_{name}"]
            damage[seed], accuracy[seed], valid[seed] = e["damage_loss"], e["damage_accuracy"], e["valid_loss"]
        fwd, bwd = bits(codec, REFERENCE_SHAPE, size.stages)
        sfwd, sbwd = bits(codec, (size.seq, size.micro_batch, _hidden(out)), size.stages)
        row = {"codec": codec, "seeds": seeds, "forward_bits": fwd, "backward_bits": bwd,
               "study_forward_bits": sfwd, "study_backward_bits": sbwd,
               "steps_by_seed": {str(s): steps[s] for s in seeds},
               "damage_by_seed": {str(s): damage[s] for s in seeds},
               "damage_loss": statistics.fmean(damage.values()),
               "damage_accuracy": statistics.fmean(a for a in accuracy.values() if a is not None)
               if any(a is not None for a in accuracy.values()) else None,
               "valid_loss_uncompressed": statistics.fmean(valid.values())}
        if all(v is not None for v in steps.values()):
            interval = score.mean_interval([steps[s] for s in seeds])
            ratio = score.paired_ratio(steps, base_steps)
            row.update(steps=interval.mean, steps_low=interval.low, steps_high=interval.high,
                       multiplier=ratio.mean, multiplier_low=ratio.low, multiplier_high=ratio.high, missed_within=None)
        else:
            row.update(steps=None, multiplier=None, missed_within=max(longest.values()))
        delta = _paired(damage, base_damage, relative=True)
        row.update(damage_vs_bf16=None if delta is None else delta.mean,
                   damage_vs_bf16_low=None if delta is None else delta.low,
                   damage_vs_bf16_high=None if delta is None else delta.high,
                   damage_verdict="–" if codec == "bf16" else verdict(delta),
                   damage_vs_untouched=(row["damage_loss"] / untouched["damage_loss"] - 1) if untouched else None)
        rows.append(row)
    projected = {r["codec"]: r for r in projection.project(
        {c: r["multiplier"] for r in rows for c in [r["codec"]] if r["multiplier"] is not None},
        codecs={("none" if r["codec"] == "bf16" else r["codec"]): CODECS[r["codec"]] for r in rows},
        multiplier_label="measured on SmolLM2-135M")}
    for row in rows:
        p = projected["none" if row["codec"] == "bf16" else row["codec"]]
        row["projected_T"] = p["T"] if row["multiplier"] is not None or row["codec"] == "bf16" else None
        row["projected_s_per_step"] = p["s_per_step"]
    metas = [m for m in (read_meta(out, p.stem[:-5] if p.stem.endswith(".meta") else p.stem)
                         for p in out.glob("*.meta.json")) if m]
    result = {"date": datetime.date.today().isoformat(), "host": host, "size": size.name, "setup": size.setup(),
              "model": runs.MODELS[size.model].description, "target": target, "table": rows,
              "untouched": untouched, "curves": curves, "bf16_steps_mean": base_mean,
              "boundaries": runs.boundaries(runs.num_layers(out / "model"), size.stages),
              "run_hours": sum(m.get("seconds", 0) for m in metas) / 3600,
              "s_per_step": statistics.median(c["ms"] for c in curves.values() if c["codec"] == "bf16") / 1e3,
              "runs": len(metas)}
    if pipeline:
        result["pipeline"] = pipeline_check(out, pipeline, seeds, curves)
    return result


def _hidden(out: Path) -> int:
    flags = runs.model_flags(out / "model")
    return int(flags[flags.index("--hidden-size") + 1])


def pipeline_check(out: Path, codec: str, seeds: list[int], curves: dict) -> dict:
    """The real pipeline's validation curve against the emulated run of the same codec and seed, on the
    iterations both validated, beside the spread between the emulated seeds there."""
    records = read_log(out / f"pipeline_{codec}_s{seeds[0]}.jsonl")
    piped = dict(runs.validations(records))
    emulated = dict(curves[runs.run_name(codec, seeds[0])]["validations"])
    common = sorted(set(piped) & set(emulated))
    diffs = [piped[i] - emulated[i] for i in common]
    spread = []
    for i in common:
        at = [dict(curves[runs.run_name(codec, s)]["validations"]).get(i) for s in seeds]
        at = [a for a in at if a is not None]
        if len(at) > 1:
            spread.append(statistics.stdev(at))
    return {"codec": codec, "seed": seeds[0], "iterations": common, "pipeline": [piped[i] for i in common],
            "emulated": [emulated[i] for i in common], "max_abs_diff": max(map(abs, diffs)) if diffs else None,
            "mean_diff": statistics.fmean(diffs) if diffs else None,
            "seed_spread": statistics.fmean(spread) if spread else None,
            "ms": statistics.median([r["ms"] for r in records if r.get("ms")] or [0.0])}


# ----- the page ----------------------------------------------------------------------------------------------
def _interval(mean, low, high, digits=2, suffix="", percent=False) -> str:
    if mean is None:
        return "–"
    f = (lambda v: f"{100 * v:+.{digits}f}%") if percent else (lambda v: f"{v:.{digits}f}{suffix}")
    return f"{f(mean)} [{f(low)}, {f(high)}]"


def steps_text(row: dict) -> str:
    if row["steps"] is None:
        missed = [s for s, v in row["steps_by_seed"].items() if v is None]
        return f"missed within {row['missed_within']} steps (seed {', '.join(missed)})"
    return _interval(row["steps"], row["steps_low"], row["steps_high"], 0)


def multiplier_text(row: dict) -> str:
    return "–" if row["multiplier"] is None else _interval(row["multiplier"], row["multiplier_low"],
                                                          row["multiplier_high"], suffix="x")


def table_markdown(result: dict) -> str:
    lines = ["| codec | bits fwd + bwd at [1024, 8, 1024] | steps to target | steps vs bf16 | damage-corpus loss | "
             "vs bf16's fine-tune | vs untouched | greedy accuracy | projected T (s) |",
             "|---|---:|---|---|---:|---|---:|---:|---:|"]
    for r in result["table"]:
        vs = "–" if r["codec"] == "bf16" else (
            _interval(r["damage_vs_bf16"], r["damage_vs_bf16_low"], r["damage_vs_bf16_high"], percent=True)
            + f" ({r['damage_verdict']})")
        accuracy = "–" if r["damage_accuracy"] is None else f"{100 * r['damage_accuracy']:.2f}%"
        projected = "–" if r["projected_T"] is None else f"{r['projected_T']:,.0f}"
        lines.append(f"| {r['codec']} | {r['forward_bits']:.2f} + {r['backward_bits']:.2f} | {steps_text(r)} | "
                     f"{multiplier_text(r)} | {r['damage_loss']:.4f} | {vs} | "
                     f"{100 * r['damage_vs_untouched']:+.2f}% | {accuracy} | {projected} |")
    return "\n".join(lines)


def recommended(result: dict) -> str | None:
    """The codec the real model supports: of those whose every seed reached the target without more damage than
    bf16's fine-tune, the one with the lowest projected T, and of equal T (to the second) the one with the fewest
    bits both ways (what the links carry in all; with bits per boundary T charges the busiest link) (None: none
    did)."""
    fits = [r for r in result["table"] if r["codec"] != "bf16" and r["multiplier"] is not None
            and r["damage_verdict"] != "more damage than bf16's fine-tune" and r["projected_T"] is not None]
    return min(fits, key=lambda r: (round(r["projected_T"]), r["forward_bits"] + r["backward_bits"]))["codec"] \
        if fits else None


def bf16_fall_text(result: dict) -> str:
    """How much each bf16 seed's validation loss still fell over the two evaluation intervals before the target's
    step (the schedule's 92%)."""
    setup = result["setup"]
    end = max(i for i in range(0, setup["iters"] + 1, setup["eval_interval"]) if i <= 0.92 * setup["iters"])
    start = end - 2 * setup["eval_interval"]
    falls = []
    for curve in result["curves"].values():
        if curve["codec"] == "bf16":
            at = dict(curve["validations"])
            falls.append(f"{at[start] - at[end]:+.3f}")
    return f"bf16's validation loss fell by {', '.join(falls)} from step {start} to step {end}, per seed"


def frontier_text(result: dict) -> str:
    """The codecs by bits both ways at the reference shape, each with its steps, and the best point."""
    rows = sorted((r for r in result["table"] if r["codec"] != "bf16"),
                  key=lambda r: r["forward_bits"] + r["backward_bits"])
    parts = [f"`{r['codec']}` {r['forward_bits'] + r['backward_bits']:.2f} bits: "
             + (f"missed within {r['missed_within']} steps" if r["multiplier"] is None else multiplier_text(r))
             for r in rows]
    best = recommended(result)
    verdict = (f"The point with the lowest projected T among those that reached the target without more damage than "
               f"bf16's fine-tune (of equal T, the fewest bits): `{best}`." if best else "No codec reached the target without more damage than "
               "bf16's fine-tune.")
    return ("Bits per value forward + backward at [1024, 8, 1024], fewest first, and the steps each needed against "
            "bf16's: " + "; ".join(parts) + ". " + verdict)


PLACEMENTS = ("channel_h4", "channel_b_h4", "channel5_h4", "channel_b5_h4")
"""The candidates that differ only in where the forward bits go: 6 everywhere, 6 or 5 by the sensitivity, 5
everywhere, and 5 on average with 4 where 4 bits cost least alone."""


def placement_text(result: dict) -> str:
    """The steps and damage of the :data:`PLACEMENTS` the study ran ("" for fewer than two)."""
    rows = [r for name in PLACEMENTS for r in result["table"] if r["codec"] == name]
    if len(rows) < 2:
        return ""
    from megatron_tah.config import TahConfig

    values = REFERENCE_SHAPE[0] * REFERENCE_SHAPE[1] * REFERENCE_SHAPE[2]
    busiest = {r["codec"]: 8 * busiest_nbytes(TahConfig(**CODECS[r["codec"]]), REFERENCE_SHAPE,
                                              result["setup"]["stages"]) / values for r in rows}
    parts = [f"`{r['codec']}` ({r['forward_bits']:.2f} bits forward on average, busiest link "
             f"{busiest[r['codec']]:.2f}): "
             + (f"missed within {r['missed_within']} steps" if r["multiplier"] is None else multiplier_text(r))
             + ", " + (r["damage_verdict"] if r["damage_verdict"].endswith("fine-tune") else
                       f"damage {r['damage_verdict']}") for r in rows]
    return "Where the forward bits go, at the same gradients: " + "; ".join(parts) + "."


def readme_table(result: dict, page: str = "docs/REAL_MODEL.md") -> str:
    """The README's summary of ``result``: bf16 and every ``--tah-preset`` the study measured, with its bits, steps vs
    bf16, damage vs bf16's fine-tune and projected T, each linked to the page that measured it (the page has the
    other candidates; ``test_readme_claims`` compares the two)."""
    from megatron_tah.config.presets import PRESETS

    lines = ["| preset | bits fwd + bwd at [1024, 8, 1024] | steps to target vs bf16 (95% interval) | "
             "damage vs bf16's fine-tune | projected T (s) |", "|---|---:|---|---|---:|"]
    for r in (r for r in result["table"] if r["codec"] == "bf16" or r["codec"] in PRESETS):
        name = "bf16 (uncompressed)" if r["codec"] == "bf16" else f"`{r['codec']}`"
        steps = "1" if r["codec"] == "bf16" else (
            f"missed within {r['missed_within']} steps" if r["multiplier"] is None else multiplier_text(r))
        damage = "–" if r["codec"] == "bf16" else (
            _interval(r["damage_vs_bf16"], r["damage_vs_bf16_low"], r["damage_vs_bf16_high"], percent=True)
            + f" ({r['damage_verdict']})")
        projected = "–" if r["projected_T"] is None else f"{r['projected_T']:,.0f}"
        lines.append(f"| [{name}]({page}) | {r['forward_bits']:.2f} + {r['backward_bits']:.2f} | {steps} | {damage} | "
                     f"{projected} |")
    return "\n".join(lines)


def pipeline_text(result: dict) -> str:
    check = result.get("pipeline")
    if not check:
        return "Not run for this page (`--pipeline CODEC` runs it)."
    return (f"`{check['codec']}` with seed {check['seed']} ran as the real {result['setup']['stages']}-stage pipeline "
            f"(one process per stage over gloo, `python -m megatron_tah.pretrain_gpt` with "
            f"`--pipeline-model-parallel-size {result['setup']['stages']}`) for bf16's schedule. Over the "
            f"{len(check['iterations'])} validations both runs made, its loss differs from the emulated run's of the "
            f"same seed by at most {check['max_abs_diff']:.4f} (mean {check['mean_diff']:+.4f}); the emulated seeds' "
            f"standard deviation at those validations is {check['seed_spread']:.4f} on average. Its median step took "
            f"{check['ms'] / 1e3:.1f} s ({result['setup']['stages']} processes on the machine's cores).")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {}
    for name, curve in sorted(result["curves"].items()):
        codec = curve["codec"]
        color = colors.setdefault(codec, f"C{len(colors)}")
        xs, ys = zip(*curve["validations"]) if curve["validations"] else ((), ())
        ax.plot(xs, ys, color=color, alpha=0.8, lw=1, label=codec if codec not in ax.get_legend_handles_labels()[1]
                else None)
    check = result.get("pipeline")
    if check:
        ax.plot(check["iterations"], check["pipeline"], "k--", lw=1, label=f"{check['codec']} (real pipeline)")
    ax.axhline(result["target"], color="grey", ls=":", label=f"target {result['target']:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (held-out Shakespeare, through the codecs)")
    ax.set_title(f"{result['model'].split(' (')[0]}, pipeline depth {result['setup']['stages']} (emulated)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_frontier(result: dict, path: Path) -> None:
    """Bits both ways at the reference shape against the steps multiplier (with its interval) per codec; a codec
    that missed the target sits above the plot's top line, marked "missed"."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["table"] if r["codec"] != "bf16"]
    reached = [r for r in rows if r["multiplier"] is not None]
    top = max([r["multiplier_high"] for r in reached] + [1.5]) + 0.3
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for r in rows:
        x = r["forward_bits"] + r["backward_bits"]
        if r["multiplier"] is None:
            ax.plot([x], [top], "v", color="C3")
            ax.annotate(f"{r['codec']} (missed)", (x, top), textcoords="offset points", xytext=(0, 6), fontsize=7,
                        rotation=90, ha="center", va="bottom")
        else:
            ax.errorbar([x], [r["multiplier"]], yerr=[[r["multiplier"] - r["multiplier_low"]],
                                                       [r["multiplier_high"] - r["multiplier"]]], fmt="o", color="C0",
                        capsize=3)
            ax.annotate(r["codec"], (x, r["multiplier"]), textcoords="offset points", xytext=(5, 3), fontsize=7)
    ax.axhline(1.0, color="grey", ls=":", label="bf16's steps")
    ax.set_ylim(top=top + 1.6)  # room for the missed codecs' names
    ax.set_xlabel("bits per value, forward + backward, at [1024, 8, 1024]")
    ax.set_ylabel("steps to target vs bf16 (95% interval)")
    ax.set_title("bits against steps on the real model")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_page(result: dict, page: Path) -> None:
    """``page`` (markdown), with its JSON and plot under ``docs/data/`` beside it."""
    page = Path(page)
    data, stem = save_data(result, page, plot)
    plot_frontier(result, data / f"{stem}_frontier.png")
    setup = result["setup"]
    untouched = result["untouched"] or {}
    template = (Path(__file__).parent / "page.md").read_text()
    page.write_text(template.format(
        date=result["date"], size=result["size"], size_note=runs.SIZES[result["size"]].note, cpu=result["host"]["cpu"],
        cores=result["host"]["cores"], json=f"data/{stem}.json",
        plot=f"data/{stem}.png", model=result["model"], target=f"{result['target']:.3f}",
        boundaries=", ".join(map(str, result["boundaries"])), stages=setup["stages"], seq=setup["seq"],
        micro_batches=setup["micro_batches"], tokens=setup["seq"] * setup["micro_batch"] * setup["micro_batches"],
        iters=setup["iters"], lr=f"{setup['lr']:g}", warmup=setup["warmup"], eval_interval=setup["eval_interval"],
        eval_tokens=setup["eval_iters"] * setup["micro_batches"] * setup["micro_batch"] * setup["seq"],
        damage_tokens=setup["damage_eval_iters"] * setup["micro_batches"] * setup["micro_batch"] * setup["seq"],
        max_steps=int(setup["max_factor"] * setup["iters"]), max_factor=f"{setup['max_factor']:g}",
        seeds=", ".join(str(s) for s in result["table"][0]["seeds"]), table=table_markdown(result),
        untouched_damage=f"{untouched.get('damage_loss', float('nan')):.4f}",
        untouched_valid=f"{untouched.get('valid_loss', float('nan')):.4f}",
        untouched_accuracy=f"{100 * (untouched.get('damage_accuracy') or 0):.2f}%",
        s_per_step=f"{result['s_per_step']:.2f}", run_hours=f"{result['run_hours']:.1f}", runs=result["runs"],
        bf16_steps=f"{result['bf16_steps_mean']:.0f}", pipeline=pipeline_text(result),
        frontier=frontier_text(result), frontier_plot=f"data/{stem}_frontier.png", bf16_fall=bf16_fall_text(result),
        sensitivity_json=f"data/{stem}_sensitivity.json", sensitivity=sensitivity_text(data / f"{stem}_sensitivity.json"),
        placement=placement_text(result)))


def sensitivity_text(path: Path) -> str:
    """The section from the sensitivity probe's JSON (``sensitivity.save``) at ``path``, or how to make it."""
    from .sensitivity import costliest, markdown

    if not Path(path).is_file():
        return "Not measured for this page (`python -m benchmarks.real_model.sensitivity --out ...` measures it)."
    results = json.loads(Path(path).read_text())["runs"]
    return markdown(results) + "\n\n" + costliest(results)
