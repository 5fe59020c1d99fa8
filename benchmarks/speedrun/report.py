"""The speedrun's page (``write_page``: markdown, JSON, plot) from ``scoring.build``'s result; ``python -m
benchmarks.speedrun.report --from-json`` renders it again from its JSON, nothing run."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from ..common import pages, score
from ..common.codecs import CODECS, NEEDS_LINK, ONE_DIRECTION, entropy_coded
from ..common.pages import save_data
from . import check, frontier, projection, runs
from .scoring import build, losses_from_page
from .verdicts import SETTLED_SEEDS, best_split, compare_T, split_verdict

LOSS_RUNS_TEXT = {
    "emulated": "Each loss run is one process: Megatron's loop at pipeline depth 1 with the codecs applied after layers "
                "1-7, where the 8-stage pipeline splits (`benchmarks/depth/boundaries.py`: the same codec calls on "
                "the same tensors, forward and backward, one codec object per boundary and direction), about 8x "
                "cheaper on this CPU than one process per stage; initialisation differs from the pipeline's (Megatron "
                "seeds each pipeline rank differently), so its curves are statistically, not bitwise, the pipeline's "
                "(`--loss-runs pipeline` runs the real pipeline). `auto`'s loss runs are the real pipeline, one process "
                "per stage over gloo behind the emulated wire (its choice depends on the link), and its steps are "
                "paired with a bf16 pipeline run of the same seed without the link (the dashed line of the plot), so "
                "that the pipeline's initialisation does not enter its multiplier.",
    "pipeline": "Each loss run is the real pipeline: one process per stage over gloo.",
}


TIMING_TEXT = {
    "simulated": "Seconds per step are the schedule simulator's (below) for the measured bf16 compute step and each "
                 "codec's exact message bytes each way on that wire; codec compute is not counted (on this CPU the "
                 "Triton interpreter, not a GPU, would run it); `auto`'s bytes are those it sent per message in the "
                 "second half of its loss run, once its choices settled. `--timing measured` runs a timing run per "
                 "codec behind the emulated wire instead.",
    "measured": "Seconds per step are measured: a timing run per codec behind the emulated wire. Steady: the first "
                "three consecutive 10-step windows whose means agree within 1%, their median (the reference's rule; "
                "\"not steady\": the median of the last 30 steps).",
}


def _fmt(value, digits=2, suffix=""):
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def _steps_text(row: dict) -> str:
    if row["steps"] is None:
        reached = [f"{v} (seed {s})" for s, v in row["steps_by_seed"].items() if v is not None]
        return score.missed_text(row["missed_within"], seeds=True) + (f"; reached: {', '.join(reached)}" if reached else "")
    longer = sorted({v for v in row.get("bf16_schedule_by_seed", {}).values()} - {min(row["schedule_by_seed"].values())})
    on = f"; schedule {', '.join(map(str, longer))} for some seeds" if longer else ""
    if len(row["seeds"]) == 1:
        return f"{row['steps']:.0f} (one seed{on})"
    return f"{row['steps']:.0f} [{row['steps_low']:.0f}, {row['steps_high']:.0f}]{on}"


def _multiplier_text(row: dict) -> str:
    if row["multiplier"] is None:
        return "–"
    if len(row["seeds"]) == 1:
        return f"{row['multiplier']:.2f}x"
    return f"{row['multiplier']:.2f}x [{row['multiplier_low']:.2f}, {row['multiplier_high']:.2f}]"


def choices_text(result: dict) -> str:
    """What a codec that chooses from the link sent with, per direction (its share of the run's iterations x links)."""
    lines = []
    for r in result["table"]:
        for direction, shares in r.get("choices", {}).items():
            listed = ", ".join(f"`{codec}` {'< 1' if share < 0.005 else f'{100 * share:.0f}'}%"
                               for codec, share in shares.items())
            lines.append(f"`{r['codec']}` sent the {'activations' if direction == 'forward' else 'gradients'} with "
                         f"{listed} of its iterations x links.")
    return " ".join(lines)


def _reused_text(result: dict) -> str:
    """How the page was made besides its own runs: the page whose runs and compute step it reused, its rendering."""
    reused, rendered = result.get("reused"), result.get("rendered")
    return ((f", reusing the loss runs and the compute step of `--from-page {reused['page']}`" if reused else "")
            + (f"; rendered again from its JSON on {rendered} (`python -m benchmarks.speedrun.report --from-json`)"
               if rendered else ""))


def _on_its_own_text(row: dict) -> str:
    """Steps vs bf16 evaluated uncompressed: the multiplier, where each seed missed, or "not measured" (runs that
    validated through the codecs only)."""
    own = row.get("uncompressed")
    if row["codec"] == "bf16":
        return "1"
    if not own:
        return "not measured"
    if own["multiplier"] is not None:
        return _multiplier_text({**own, "seeds": row["seeds"]})
    return score.missed_text(own["missed_within"], seeds=True) if own["missed_within"] else "–"


def table_markdown(result: dict) -> str:
    rows = ["| codec | fwd bits | bwd bits | bytes/token | steps to target | steps vs bf16 | steps vs bf16, evaluated "
            "uncompressed | s/step | T (s) | T vs bf16 |", "|---|---:|---:|---:|---|---|---|---:|---:|---:|"]
    for r in result["table"]:
        steady = "" if r["steady"] else " (not steady)"
        rows.append(f"| {r['codec']} | {r['forward_bits']:.2f} | {r['backward_bits']:.2f} | {r['bytes_per_token']:.1f} | "
                    f"{_steps_text(r)} | {_multiplier_text(r)} | {_on_its_own_text(r)} | {r['s_per_step']:.3f}{steady} | "
                    f"{_fmt(r['T'], 0)} | {_fmt(r['T_vs_bf16'], 3, 'x')} |")
    return "\n".join(rows)


def projection_markdown(result: dict) -> str:
    rows = ["| codec | fwd bits | bwd bits | bytes/token | s/step | steps (multiplier) | T (s) | T vs bf16 record |",
            "|---|---:|---:|---:|---:|---|---:|---:|"]
    bf16_record = result["records"][0]["T"]
    for r in result["projection"]:
        steps, T = ((f"– ({r['steps_label']})", "– | –") if r["T"] is None else
                    (f"{r['steps']:.0f} ({r['steps_multiplier']:.2f}x, {r['steps_label']})",
                     f"{r['T']:,.0f} | {r['T'] / bf16_record:.3f}x"))
        rows.append(f"| {r['codec']} | {r['forward_bits']:.2f} | {r['backward_bits']:.2f} | {r['bytes_per_token']:.0f} | "
                    f"{r['s_per_step']:.2f} | {steps} | {T} |")
    for rec in result["records"]:
        rows.append(f"| record: {rec['record']} | | | {rec['bytes_per_token']:.0f} | {rec['published_s_per_step']:.2f} "
                    f"(model: {rec['simulated_s_per_step']:.2f}) | {rec['steps']} (published) | {rec['T']:,.0f} | "
                    f"{rec['T'] / bf16_record:.3f}x |")
    return "\n".join(rows)


def splits_markdown(result: dict) -> str:
    """s/step per codec at each micro-batch count of the setup's global batch, and the best split's T."""
    splits = sorted(int(m) for m in result.get("projection_splits", {}))
    if not splits:
        return "(not computed for this page)"
    rows = ["| codec | " + " | ".join(f"s/step at {m} x {projection.SETUP.micro_batch * projection.SETUP.micro_batches // m}"
                                     for m in splits) + f" | best split | T there (s) | vs {projection.SETUP.micro_batches} micro-batches |",
            "|---|" + "---:|" * len(splits) + "---|---:|---:|"]
    for r in result["projection"]:
        best = best_split(result, r["codec"])
        cells = [next(x for x in result["projection_splits"][str(m)] if x["codec"] == r["codec"])["s_per_step"]
                 for m in splits]
        rows.append(f"| {r['codec']} | " + " | ".join(f"{c:.2f}" for c in cells) +
                    (" | – | – | – |" if best is None else
                     f" | {best['micro_batches']} x {best['micro_batch']} | {best['T']:,.0f} | {best['vs_setup']:.3f}x |"))
    return "\n".join(rows)


def check_markdown(result: dict) -> str:
    """The schedule simulator against timing runs (``check.py``'s committed result) and what it says of the best
    projected split, or how to get it."""
    checked = check.load()
    if checked is None:
        return "Not run for this page: `python -m benchmarks.speedrun.check --write` times the real pipeline."
    return check.render(checked) + "\n\n" + split_verdict(result, checked)


def plot(result: dict, path: Path) -> None:
    """Validation loss against simulated wall-clock time (iteration x the codec's steady s/step), one line per
    codec (its first seed, every schedule it ran), the target as a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seconds = {r["codec"]: r["s_per_step"] for r in result["table"]}
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.set_prop_cycle(color=plt.cm.tab20.colors)  # more codecs than the default cycle's 10 colours
    for codec in seconds:
        curves = [c for c in result["curves"].values() if c["codec"] == codec]
        if not curves:
            continue
        first = min(c["seed"] for c in curves)
        for c in sorted((c for c in curves if c["seed"] == first), key=lambda c: c["iters"]):
            its, losses = zip(*c["validations"])
            kind = ", pipeline" if c.get("pipeline") and codec not in NEEDS_LINK else ""  # auto's twin
            ax.plot([i * seconds[codec] / 3600 for i in its], losses, label=f"{codec} ({c['iters']} steps{kind})",
                    linestyle="--" if kind else "-")
    ax.axhline(result["target"], color="black", linestyle=":", label=f"target {result['target']:.3f}")
    ax.set_xlabel("simulated wall-clock time (h): iteration x steady s/step behind the emulated wire")
    ax.set_ylabel("validation loss (fixed batches, through the codec)")
    ax.set_ylim(result["target"] - 0.3, result["target"] + 1.2)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_page(result: dict, page: Path) -> None:
    """``page`` (markdown), with its JSON and plot under ``docs/data/`` beside it."""
    page = Path(page)
    data, stem = save_data(result, page, plot)
    frontier.plot(result, data / f"{stem}_frontier.png")
    template = pages.template(__file__)
    page.write_text(template.format(
        headline=headline_text(result), **_page_fields(result, stem)))


def _against(a: dict, b: dict) -> str:
    found = compare_T(a, b)
    return f"T ratio {found.text()}" if found else "no common seed to compare"


def headline_text(result: dict) -> str:
    """The page's first line: the codec with the lowest T among those run with ``SETTLED_SEEDS`` seeds (or with the
    most seeds any codec has) against the next lowest of those, any codec with fewer seeds and a lower T beside it
    against the best (paired intervals of the T ratio); or within which schedule each codec missed the target."""
    scored = [r for r in result["table"] if r["T_vs_bf16"] is not None and r["codec"] != "bf16"]
    most = min(SETTLED_SEEDS, max((len(r["seeds"]) for r in scored), default=0))
    settled = sorted((r for r in scored if len(r["seeds"]) >= most), key=lambda r: r["T"])
    if settled:
        best = settled[0]
        lower = sorted((r for r in scored if r["T"] < best["T"]), key=lambda r: r["T"])
        seeds = lambda r: "one seed" if len(r["seeds"]) == 1 else f"{len(r['seeds'])} seeds"  # noqa: E731
        text = (f"**Best: `{best['codec']}`, T = {best['T_vs_bf16']:.3f}x bf16's** ({best['forward_bits']:.2f} + "
                f"{best['backward_bits']:.2f} bits per value, steps {_multiplier_text(best)} bf16's, {seeds(best)})")
        if len(settled) > 1:
            text += (f"; against the next, `{settled[1]['codec']}` (T = {settled[1]['T_vs_bf16']:.3f}x bf16's): "
                     f"{_against(best, settled[1])}")
        return text + "." + "".join(
            f" Lower, on fewer seeds: `{r['codec']}`, T = {r['T_vs_bf16']:.3f}x ({r['forward_bits']:.2f} + "
            f"{r['backward_bits']:.2f} bits, steps {_multiplier_text(r)}, {seeds(r)}); against `{best['codec']}`: "
            f"{_against(r, best)}." for r in lower)
    missed = [r for r in result["table"] if r.get("missed_within")]
    return ("No codec reached the target within bf16's schedule. " + "; ".join(
        f"`{r['codec']}` ({r['forward_bits']:.2f} + {r['backward_bits']:.2f} bits per value) "
        f"{score.missed_text(r['missed_within'], seeds=True)}" for r in missed) + ".")


def provenance_text(result: dict) -> str:
    """Where the page's measurements were made: the loss runs per (date, CPU), and the compute step."""
    counts: dict[tuple[str, str], int] = {}
    for curve in result["curves"].values():
        where = curve.get("measured") or {"date": result["date"], "cpu": result["host"]["cpu"]}
        counts[where["date"], where["cpu"]] = counts.get((where["date"], where["cpu"]), 0) + 1
    compute = result.get("compute_measured") or {"date": result["date"], "cpu": result["host"]["cpu"]}
    return ("Loss runs measured " + ", ".join(f"{n} on {date} ({cpu})" for (date, cpu), n in sorted(counts.items()))
            + f"; the compute step, which sets the wire and every s/step, on {compute['date']} ({compute['cpu']}).")


def _page_fields(result: dict, stem: str) -> dict:
    link, setup = result["link"], result["setup"]
    modes = result.get("modes", {"loss_runs": "pipeline", "timing": "measured"})
    return dict(
        loss_runs=LOSS_RUNS_TEXT[modes["loss_runs"]], timing=TIMING_TEXT[modes["timing"]],
        max_factor=f"{modes.get('max_factor', 4.0):g}",
        longer=(f"; `--longer` applied them to {', '.join(f'`{c}`' for c in modes['longer'])} only: the other codecs "
                f"that missed ran no longer schedule" if modes.get("longer") else ""),
        seeds=", ".join(sorted({str(s) for r in result["table"] for s in r["seeds"]})),
        not_run=", ".join(f"`{c}`" for c in CODECS if c not in {r["codec"] for r in result["table"]}
                          and not entropy_coded(c) and c not in ONE_DIRECTION) or "none",
        date=result["date"], cpu=result["host"]["cpu"], cores=result["host"]["cores"],
        reused=_reused_text(result), provenance=provenance_text(result),
        parameters=f"{runs.SIZES[result['size']].parameters():,}",
        parameters_m=f"{runs.SIZES[result['size']].parameters() / 1e6:.2f}M",
        target=f"{result['target']:.3f}", compute=f"{result['compute_s_per_step']:.3f}",
        rate=f"{link['rate_bps'] / 1e6:.4g}", latency=f"{1e3 * link['latency_s']:.2f}",
        iters=setup["iters"], eval_interval=setup["eval_interval"], eval_iters=setup["eval_iters"],
        micro_batches=setup["micro_batches"], table=table_markdown(result), projection=projection_markdown(result),
        splits=splits_markdown(result), schedule_check=check_markdown(result),
        frontier=frontier.markdown(result), frontier_plot=f"data/{stem}_frontier.png",
        frontier_best=frontier.best_text(result), choices=choices_text(result),
        plot=f"data/{stem}.png", json=f"data/{stem}.json")


def render(data: dict) -> dict:
    """The page's result again from its JSON (``data``), nothing run: its curves, target, compute step, wire, s/step
    per codec, date and host as they are, the table, headline and projection by the rules of this module."""
    steady = {r["codec"]: {"seconds": r["s_per_step"], "steady": r["steady"]} for r in data["table"]}
    result = build(runs.SIZES[data["size"]], data["target"], data["compute_s_per_step"], runs.Link(**data["link"]),
                   losses_from_page(data), steady, data["host"], data.get("modes"), date=data["date"],
                   compute_measured=data.get("compute_measured"))
    reused = {key: data["reused"][key] for key in ("page", "runs")} if data.get("reused") else None
    return {**result, **({"reused": reused} if reused else {}), "rendered": datetime.date.today().isoformat()}


def publish(result: dict, page: Path, module: str, argv: list[str]) -> None:
    """``write_page``, saying what it wrote (auto's steps charges come from the real model's study, not the toy's)."""
    write_page(result, page)
    print(f"[speedrun] wrote {page}")


def main(argv=None) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m benchmarks.speedrun.report",
                                     description="Render the speedrun's page again from its JSON; nothing runs.")
    parser.add_argument("--from-json", type=Path, required=True, help="a page's JSON (docs/data/speedrun.json)")
    parser.add_argument("--write", type=Path, help="write the page here (its JSON and plots under docs/data/)")
    args = parser.parse_args(argv)
    result = render(json.loads(args.from_json.read_text()))
    if args.write:
        publish(result, args.write, "benchmarks.speedrun.report", sys.argv[1:] if argv is None else argv)
    else:
        print(headline_text(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
