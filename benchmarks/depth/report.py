"""The depth study's page: tables and plots from the runs of ``python -m benchmarks.depth``."""

from __future__ import annotations

import datetime
import json
import statistics
from pathlib import Path

from ..common.runner import read_log
from ..common import pages, score

GROUPS = {
    "depth": "Depth: the paper's configuration at 1, 3 and 7 boundaries (pipeline depth 2, 4, 8)",
    "direction": "Direction: forward codec alone, backward codec alone (pipeline depth 8)",
    "boundary": "Position: the paper's forward codec at a single boundary",
    "forward": "Forward codecs at pipeline depth 8 (gradients uncompressed)",
    "backward": "Backward codecs at pipeline depth 8 (activations uncompressed)",
    "remedy": "Remedies at pipeline depth 8 (both directions)",
    "seeds": "Second seed",
    "width": "Width: the paper's configuration at hidden 256 and 512 (4 heads; gaps against the same width's uncompressed run)",
}


def summarize(study, out: Path) -> dict:
    """Final validation loss, the sampled round-trip errors and rms per boundary (last quarter of the run)."""
    records = read_log(out / f"{study.name}.jsonl")
    validations = [(r["iteration"], r["valid_loss"]) for r in records if "valid_loss" in r]
    errors: dict[str, dict[int, list]] = {"forward": {}, "backward": {}}
    path = out / f"{study.name}.errors.jsonl"
    samples = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    last = {d: max((s["call"] for s in samples if s["direction"] == d), default=0) for d in errors}
    for s in samples:
        if s["call"] >= 0.75 * last[s["direction"]]:
            errors[s["direction"]].setdefault(s["boundary"], []).append(s)
    per_boundary = {d: {k: {"rel_error": statistics.fmean(x["rel_error"] for x in v),
                            "rms": statistics.fmean(x["rms"] for x in v)} for k, v in sorted(by.items())}
                    for d, by in errors.items()}
    return {"name": study.name, "group": study.group, "label": study.label, "seed": study.seed,
            "hidden": study.hidden, "final_loss": validations[-1][1], "validations": validations,
            "per_boundary": per_boundary}


def _mean(values):
    values = list(values)
    return statistics.fmean(values) if values else None


def build(studies, out: Path, host: dict) -> dict:
    done = [s for s in studies if (out / f"{s.name}.done").is_file()]
    rows = {s.name: summarize(s, out) for s in done}
    # the uncompressed run of the same seed and width is each run's reference
    base = {(r["seed"], r["hidden"]): r for r in rows.values() if r["name"].startswith("none")}
    for r in rows.values():
        ref = base.get((r["seed"], r["hidden"]))
        r["gap"] = r["final_loss"] - ref["final_loss"] if ref else None
        # the uncompressed run first validated at or below this run's final loss at step `at`:
        # this run needed at least schedule / at times its steps for that loss
        at = next((i for i, loss in (ref["validations"] if ref else []) if loss <= r["final_loss"]), None)
        r["multiplier_at_least"] = r["validations"][-1][0] / at if at and r["gap"] and r["gap"] > 0 else None
        fwd = r["per_boundary"]["forward"]
        r["forward_error"] = _mean(v["rel_error"] for v in fwd.values())
        r["backward_error"] = _mean(v["rel_error"] for v in r["per_boundary"]["backward"].values())
        r["last_rms"] = fwd[max(fwd)]["rms"] if fwd else None
    return {"date": datetime.date.today().isoformat(), "host": host, "rows": rows}


def _fmt(value, digits=3, signed=False):
    if value is None:
        return "–"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def tables(result: dict) -> str:
    parts = []
    for group, title in GROUPS.items():
        rows = [r for r in result["rows"].values() if r["group"] == group]
        if not rows:
            continue
        parts.append(f"### {title}\n\n| run | final loss | gap | steps vs uncompressed | fwd error | bwd error | "
                     "rms at the last boundary |\n|---|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            steps = f">= {r['multiplier_at_least']:.2f}x" if r.get("multiplier_at_least") else "–"
            parts.append(f"| {r['label']} (`{r['name']}`) | {r['final_loss']:.4f} | {_fmt(r['gap'], 4, True)} | {steps} | "
                         f"{_fmt(r['forward_error'])} | {_fmt(r['backward_error'])} | {_fmt(r['last_rms'], 2)} |")
        parts.append("")
    return "\n".join(parts)


def boundary_table(result: dict, name: str = "paper_pp8") -> str:
    """Per boundary of one run: the forward codec's relative round-trip error, the rms of what it sent (so the
    absolute error, their product), and the backward codec's relative error (last quarter of training)."""
    row = result["rows"].get(name)
    if row is None or not row["per_boundary"]["forward"]:
        return f"(`{name}` not run)"
    fwd, bwd = row["per_boundary"]["forward"], row["per_boundary"]["backward"]
    lines = [f"Per boundary of `{name}` ({row['label']}), last quarter of training:", "",
             "| boundary (after layer) | fwd error | rms sent | fwd error x rms | bwd error |",
             "|---:|---:|---:|---:|---:|"]
    for k in sorted(fwd, key=int):
        v = fwd[k]
        lines.append(f"| {k} | {v['rel_error']:.3f} | {v['rms']:.2f} | {v['rel_error'] * v['rms']:.3f} | "
                     f"{_fmt(bwd.get(k, {}).get('rel_error'))} |")
    return "\n".join(lines)


def plots(result: dict, data: Path) -> dict[str, str]:
    """The page's plots from the runs there are: the curves by depth always; gap against forward error and the
    rms along the pipeline when forward-codec studies ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = {"curves": "data/depth_curves.png"}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in ("none", "paper_pp2", "paper_pp4", "paper_pp8", "paper_fwd_pp8", "paper_bwd_pp8"):
        if name in rows:
            its, losses = zip(*rows[name]["validations"])
            ax.plot(its, losses, label=rows[name]["label"])
    ax.set_xlabel("iteration")
    ax.set_ylabel("validation loss (fixed batches, through the codecs)")
    ax.set_ylim(min(r["final_loss"] for r in rows.values()) - 0.1, 6.8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(data / names["curves"].split("/")[1], dpi=110)
    plt.close(fig)
    forward = [r for r in rows.values() if r["group"] == "forward" and r["gap"] is not None]
    if not forward:
        return names
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for family, marker in (("fixedpoint", "o"), ("hadint", "s"), ("channel", "^")):
        pts = sorted((r["forward_error"], r["gap"]) for r in forward
                     if r["name"].startswith(family) and "sr" not in r["name"])
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=family)
    for r in rows.values():
        if r["name"] in ("paper_fwd_pp8", "hadint4sr_pp8", "tah_norotation_pp8") and r["gap"] is not None:
            ax.scatter([r["forward_error"]], [r["gap"]], marker="x")
            ax.annotate(r["name"], (r["forward_error"], r["gap"]), fontsize=7)
    ax.axhline(0, color="grey", linewidth=0.5)
    ax.set_xlabel("relative round-trip error of the forward codec (sampled, last quarter of training)")
    ax.set_ylabel("final validation loss - uncompressed")
    ax.set_title("Forward codecs at pipeline depth 8")
    ax.legend()
    fig.tight_layout()
    fig.savefig(data / "depth_gap_vs_error.png", dpi=110)
    plt.close(fig)
    names["gap_vs_error"] = "data/depth_gap_vs_error.png"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in ("fixedpoint8_pp8", "channel4_pp8", "fixedpoint4_pp8", "hadint4_pp8", "paper_fwd_pp8", "hadint4sr_pp8"):
        if name in rows and rows[name]["per_boundary"]["forward"]:
            fwd = rows[name]["per_boundary"]["forward"]
            ax.plot(list(fwd), [v["rms"] for v in fwd.values()], marker="o", label=rows[name]["label"])
    ax.set_yscale("log")
    ax.set_xlabel("boundary (after layer k)")
    ax.set_ylabel("rms of the activations sent (last quarter of training)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(data / "depth_rms.png", dpi=110)
    plt.close(fig)
    names["rms"] = "data/depth_rms.png"
    return names


def write_page(studies, out: Path, page: Path, host: dict) -> dict:
    """``page`` (markdown), with its JSON and plots under ``docs/data/`` beside it; returns the JSON's result."""
    result = build(studies, out, host)
    page = Path(page)
    data = page.parent / "data"
    data.mkdir(parents=True, exist_ok=True)
    (data / "depth.json").write_text(json.dumps(result, indent=1) + "\n")
    images = plots(result, data)
    rows = result["rows"]

    def gap(name):
        return _fmt(rows[name]["gap"], 3, True) if name in rows and rows[name]["gap"] is not None else "–"

    def value(name, key, digits=3):
        return _fmt(rows[name][key], digits) if name in rows else "–"

    template = pages.template(__file__)
    not_run = [st.name for st in studies if st.name not in rows]
    def steps(name):
        m = rows.get(name, {}).get("multiplier_at_least")
        return f"{m:.2f}" if m else "not run"

    at_pp8 = rows.get("paper_pp8", {}).get("multiplier_at_least")
    fields = {"date": result["date"], **{f"steps_{n}": steps(n) for n in rows},
              "steps_at_pp8": f"{rows['paper_pp8']['validations'][-1][0] / at_pp8:.0f}" if at_pp8 else "not run", "cpu": host["cpu"], "cores": host["cores"], "tables": tables(result), **images,
              "not_run": ", ".join(f"`{name}`" for name in not_run) or "none",
              "only": (" --only " + ",".join(st.name for st in studies if st.name in rows)) if not_run else "",
              "gap_none_s1235_vs": (_fmt(rows["none_s1235"]["final_loss"] - rows["none"]["final_loss"], 3, True)
                                    if "none" in rows and "none_s1235" in rows else "not run"),
              **{f"gap_{n}": gap(n) for n in rows}, **{f"err_{n}": value(n, "forward_error") for n in rows},
              **{f"rms_{n}": value(n, "last_rms", 2) for n in rows}, "per_boundary": boundary_table(result),
              "remedies": remedies(page.parent / "data" / "speedrun.json"), "position": position_reading(rows),
              "width": width_reading(rows), "bwd_share": _share(rows, "paper_bwd_pp8", "paper_fwd_pp8")}
    page.write_text(template.format_map(_Missing(fields)))
    return result


def position_reading(rows: dict) -> str:
    """What the one-boundary runs say against the run with all seven boundaries (forward codec alone)."""
    names = ("paper_fwd_b1", "paper_fwd_b4", "paper_fwd_b7")
    if not all(n in rows and rows[n]["gap"] is not None for n in (*names, "paper_fwd_pp8")):
        return "The one-boundary runs have not run for this page."
    gaps = {n: rows[n]["gap"] for n in names}
    added = 7 * statistics.fmean(gaps.values())
    ratio = rows["paper_fwd_pp8"]["gap"] / added if added > 0 else None
    worst = max(gaps, key=gaps.get)
    verdict = ("the seven boundaries cost more together than their costs added: they compound" if ratio and ratio > 1.5
               else "the seven boundaries cost about what their costs added" if ratio and ratio >= 0.67
               else "the seven boundaries cost less together than their costs added" if ratio
               else "one boundary alone costs nothing measurable here")
    return (f"Seven times the mean one-boundary gap is {added:+.3f}, against {rows['paper_fwd_pp8']['gap']:+.3f} for "
            f"all seven at once" + (f" ({ratio:.1f}x)" if ratio else "") + f": {verdict}; the costliest single "
            f"boundary is the one after layer {worst.rsplit('b', 1)[1]} (one seed each: a gap's own noise is "
            f"not measured here).")


def _share(rows: dict, part: str, whole: str) -> str:
    """The backward codec's gap alone as a share of the forward codec's alone (empty without both)."""
    if not all(n in rows and rows[n]["gap"] is not None for n in (part, whole)) or rows[whole]["gap"] <= 0:
        return ""
    share = max(rows[part]["gap"], 0.0) / rows[whole]["gap"]
    return f"The 6-bit gradients alone cost {share:.0%} of what the activations' codec alone costs."


def width_reading(rows: dict) -> str:
    """Whether the depth-8 gap shrinks with width (the runs at hidden 128, 256, 512)."""
    names = ("paper_pp8", "paper_pp8_h256", "paper_pp8_h512")
    gaps = [rows[n]["gap"] for n in names if n in rows and rows[n]["gap"] is not None]
    if len(gaps) < 2:
        return "The wider runs have not run for this page."
    lo, hi = min(gaps), max(gaps)
    if hi - lo <= 0.25 * abs(statistics.fmean(gaps)):
        trend = f"stays about the same at every width ({lo:+.3f} to {hi:+.3f}): it does not fade as the model widens"
    elif all(b < a for a, b in zip(gaps, gaps[1:])):
        trend = "shrinks with every doubling of the width"
    elif all(b > a for a, b in zip(gaps, gaps[1:])):
        trend = "grows with the width"
    else:
        trend = "does not move one way with the width"
    return f"At PP 8 the gap {trend} (one seed each)."


def remedies(speedrun_json: Path) -> str:
    """The remedies' steps to target at depth 8, as the speedrun measured them (its committed JSON)."""
    if not speedrun_json.is_file():
        return "(the speedrun's page, docs/SPEEDRUN.md, has not been written)"
    rows = {r["codec"]: r for r in json.loads(speedrun_json.read_text())["table"]}

    def steps(codec):
        r = rows.get(codec)
        if r is None:
            return "not run"
        if r.get("multiplier") is None:
            return score.missed_text(r["missed_within"]) if r.get("missed_within") else "missed"
        interval = (f" [{r['multiplier_low']:.2f}, {r['multiplier_high']:.2f}] ({len(r['seeds'])} seeds)"
                    if len(r["seeds"]) > 1 else " (one seed)")
        return f"{r['multiplier']:.2f}x{interval}"

    return (f"per-channel activations at 4, 5 and 6 bits (3-bit stochastically rounded gradients: `channel`, "
            f"`channel_f5`, `channel9`): {steps('channel')}; {steps('channel_f5')}; {steps('channel9')} bf16's "
            f"steps; the same at 3, 4, 5 and 6 bits with each sequence's largest token sent apart and Hadamard INT4 "
            f"gradients (`channel3_h4`, `channel4_h4`, `channel5_h4`, `channel_h4`): {steps('channel3_h4')}; "
            f"{steps('channel4_h4')}; {steps('channel5_h4')}; {steps('channel_h4')}; `lowrank` (the message's 16 "
            f"principal directions apart, the residual at 3 bits): {steps('lowrank')}; `paper`: {steps('paper')}; "
            f"`hadint4`: {steps('hadint4')}")


class _Missing(dict):
    """Template fields; a study not run (yet) reads as "not run"."""

    def __missing__(self, key):
        return "not run"
