"""The real-model study's page (``write_page``: markdown from ``page.md``, JSON, plots) and its text, from the numbers
(``scoring.build``) and the verdicts (``verdicts``)."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

from ..common import pages, score
from ..common.codecs import CODECS
from ..common.pages import save_data
from ..speedrun import projection
from . import runs
from .plots import plot, plot_along, plot_frontier
from .scoring import serving_bits, training_fields
from .verdicts import GOALS, USE, bits_text, fewest_bits, flag_line, meets, recommended, rule_text, serves, toy_rows


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


def presets_text(result: dict, depths=None, flag: bool = False, override: dict | None = None) -> str:
    """The choice per depth and per use (``presets_by_depth``) as a table; ``depths`` adds rows for depths the study
    did not run ("not measured on the real model"); ``flag`` writes each choice's ``flag_line`` (the README's);
    ``override``: {depth: {use: choice}} from another study (the whole run's verdict) in place of this one's."""
    from megatron_tah.config.presets import PRESETS

    picks = {**presets_by_depth(result), **(override or {})}
    tables = {str(result["depth"]): result["table"], **result["depths"]}
    lines = [f"| pipeline depth | {USE['uncompressed']} | {USE['compressed']} |", "|---:|---|---|"]
    for depth in sorted({*picks, *map(str, depths or ())}, key=int):
        if depth not in picks:
            lines.append(f"| {depth} | not measured on the real model | not measured on the real model |")
            continue
        seeds = max((len(r["seeds"]) for r in tables.get(depth, []) if r["codec"] in PRESETS), default=0)
        none = ("none qualified: none (uncompressed)" if seeds >= 2 else
                "not chosen: the presets ran with one seed here (" + ", ".join(
                    f"`{r['codec']}` {multiplier_text(r['uncompressed'])}" for r in tables[depth]
                    if r["codec"] in PRESETS) + ")")
        if depth in (override or {}):
            none = "none met the whole run's rule: none (uncompressed)"
        cells = [none if picks[depth][t] is None
                 else (f"`{flag_line(picks[depth][t])}`" if flag else f"`{picks[depth][t]}`") for t in runs.TRAFFIC]
        lines.append(f"| {depth} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _wrap(text: str, width: int = 120) -> str:
    return "\n".join(textwrap.fill(p, width, break_long_words=False, break_on_hyphens=False) if p else p
                     for p in text.split("\n"))


def write_page(result: dict, page: Path) -> None:
    """``page`` (markdown), with its JSON and plots under ``docs/data/`` beside it."""
    page = Path(page)
    data, stem = save_data(result, page, plot)
    plot_frontier(result, data / f"{stem}_frontier.png")
    plot_along(result, data / f"{stem}_along.png")
    setup = result["setup"]
    untouched = result["untouched"] or {}
    template = pages.template(__file__)
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
