"""Bits against steps: which codecs no other beats in both (``frontier``), its table, sentence and plot.

A codec is beaten when another sends at most its bits at the reference's shape in fewer steps beyond noise: the
paired interval of their steps ratio over common seeds (``score.compare``) lies below 1. A codec that missed the
target is beaten when another with at most its bits has a multiplier interval below its lower bound
(``score.missed_bound``); otherwise whether it is on the frontier is unknown.
"""

from __future__ import annotations

from pathlib import Path

from ..common import score

PROJECTION_NAMES = {"bf16": "none"}  # speedrun codec -> projection.CODECS name, where they differ
GOAL_BITS, GOAL_STEPS = 6.0, 1.05  # the goal's corner: at most these bits both ways and steps vs bf16


def by_seed(row: dict, key: str) -> dict[int, float]:
    """A row's per-seed mapping (``multiplier_by_seed``, ...) with integer seeds; {} where the row has none."""
    return {int(s): v for s, v in (row.get(key) or {}).items() if v is not None}


def lower_bound(row: dict) -> float | None:
    """A row that missed the target: its measured lower bound, N / bf16's steps on the same seed (``score``)."""
    return score.missed_bound(row.get("missed_within") or {}, row.get("bf16_steps_by_seed") or {})


def _compare(a: dict, b: dict, scale: float = 1.0) -> score.Comparison | None:
    """Frontier rows ``a`` against ``b``: their per-seed multipliers compared (None: no common seed)."""
    return score.compare(a["by_seed"], b["by_seed"], scale) if set(a["by_seed"]) & set(b["by_seed"]) else None


def _beats(a: dict, b: dict) -> bool:
    """Whether ``a`` takes fewer steps than ``b`` beyond noise: their paired steps ratio's interval lies below 1."""
    found = _compare(a, b)
    return found is not None and found.verdict == "lower"


def frontier(result: dict) -> list[dict]:
    """Round-trip bits against the steps multiplier, one row per codec of the page that the projection holds, by bits
    at the reference's message shape. ``on_frontier``: True when no other codec with at most its bits takes fewer
    steps beyond noise (``close``: those with fewer steps within noise), False when one does (``beaten_by``), None
    for a codec that missed the target and that none beats."""
    projected = {r["codec"]: r for r in result["projection"]}
    rows = []
    for r in result["table"]:
        ref = projected.get(PROJECTION_NAMES.get(r["codec"], r["codec"]))
        if ref is None:
            continue
        rows.append({"codec": r["codec"], "seeds": len(r["seeds"]), "bits_cpu": r["forward_bits"] + r["backward_bits"],
                     "bits": ref["forward_bits"] + ref["backward_bits"], "multiplier": r["multiplier"],
                     "multiplier_low": r.get("multiplier_low"), "multiplier_high": r.get("multiplier_high"),
                     "by_seed": by_seed(r, "multiplier_by_seed"), "missed_within": r.get("missed_within"),
                     "lower_bound": lower_bound(r), "projected_T": ref["T"],
                     "projected_s_per_step": ref["s_per_step"]})
    for row in rows:
        cheaper = [o for o in rows if o is not row and o["multiplier"] is not None and o["bits"] <= row["bits"]]
        if row["multiplier"] is not None:
            fewer = [o for o in cheaper if o["multiplier"] < row["multiplier"]]
            beaten = [o for o in fewer if _beats(o, row)]
            row["close"] = [o["codec"] for o in fewer if o not in beaten]
        else:
            bound = row["lower_bound"]
            beaten = [o for o in cheaper if bound and o["seeds"] > 1 and o["multiplier_high"] < bound]
            row["close"] = []
        row["beaten_by"] = [o["codec"] for o in beaten]
        row["on_frontier"] = False if beaten else (True if row["multiplier"] is not None else None)
    return sorted(rows, key=lambda r: r["bits"])


def verdict_text(row: dict) -> str:
    names = lambda codecs: ", ".join(f"`{c}`" for c in codecs)  # noqa: E731
    if row["on_frontier"] is False:
        return f"no: {names(row['beaten_by'])} (fewer bits, fewer steps beyond noise)"
    if row["on_frontier"] is None:
        return "unknown (missed)"
    return f"yes; fewer bits and steps within noise: {names(row['close'])}" if row["close"] else "yes"


def markdown(result: dict) -> str:
    rows = ["| codec | bits both ways, `[1024, 8, 1024]` | at `[64, 1, 128]` | steps vs bf16 | seeds | "
            "projected T (s) | on the frontier |",
            "|---|---:|---:|---|---:|---:|---|"]
    for r in frontier(result):
        if r["multiplier"] is None:
            steps = score.missed_text(r["missed_within"])
        elif r["seeds"] > 1:
            steps = f"{r['multiplier']:.2f}x [{r['multiplier_low']:.2f}, {r['multiplier_high']:.2f}]"
        else:
            steps = f"{r['multiplier']:.2f}x (one seed)"
        T = "–" if r["projected_T"] is None else f"{r['projected_T']:,.0f}"
        rows.append(f"| {r['codec']} | {r['bits']:.2f} | {r['bits_cpu']:.2f} | {steps} | {r['seeds']} | {T} | "
                    f"{verdict_text(r)} |")
    return "\n".join(rows)


def best_text(result: dict) -> str:
    """The frontier's point with the lowest projected T, against the next lowest (paired interval of the projected T
    ratio), and the points in the goal's corner."""
    points = sorted((r for r in frontier(result) if r["on_frontier"] and r["codec"] != "bf16"),
                    key=lambda r: r["projected_T"])
    if not points:
        return "No compressed codec reached the target: the frontier is bf16 alone."
    best = points[0]
    text = (f"The frontier's point with the lowest projected T is `{best['codec']}` ({best['bits']:.2f} bits, "
            f"{best['multiplier']:.2f}x the steps, {best['projected_T']:,.0f} s)")
    if len(points) > 1:
        other = points[1]
        ratio = _compare(best, other, best["projected_s_per_step"] / other["projected_s_per_step"])
        text += (f"; against the next, `{other['codec']}` ({other['projected_T']:,.0f} s), its projected T is "
                 + (ratio.text() if ratio else "not comparable (no common seed)"))
    goal = [r for r in points if r["bits"] <= GOAL_BITS and r["multiplier"] <= GOAL_STEPS]
    return text + ("; in the goal's corner: " + ", ".join(f"`{r['codec']}`" for r in goal) + "." if goal else
                   "; no codec measured here is in the goal's corner.")


def plot(result: dict, path: Path) -> None:
    """Steps multiplier against round-trip bits at the reference's shape, one colour per codec (legend): circles
    on the frontier, squares beaten, bars the interval over seeds, triangles a codec that missed the target (at its
    lower bound, N / bf16's steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    colours = plt.get_cmap("tab20").colors
    for i, r in enumerate(frontier(result)):
        colour = colours[i % len(colours)]
        if r["multiplier"] is not None:
            low, high = r["multiplier_low"], r["multiplier_high"]
            err = [[r["multiplier"] - low], [high - r["multiplier"]]] if r["seeds"] > 1 else None
            ax.errorbar([r["bits"]], [r["multiplier"]], yerr=err, fmt="o" if r["on_frontier"] else "s", color=colour,
                        capsize=3, label=f"{r['codec']} ({r['multiplier']:.2f}x)")
        elif r["lower_bound"]:
            ax.plot([r["bits"]], [r["lower_bound"]], marker="^", linestyle="", color=colour,
                    label=f"{r['codec']} ({score.missed_text(r['missed_within'])})")
    ax.fill_between([0, GOAL_BITS], 0, GOAL_STEPS, color="C2", alpha=0.15,
                    label=f"goal: <= {GOAL_BITS:g} bits, <= {GOAL_STEPS:g}x")
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_xscale("log", base=2)
    ax.set_xlim(4, 40)
    ax.set_xticks([4, 6, 8, 12, 16, 32], ["4", "6", "8", "12", "16", "32"])
    ax.set_ylim(0.8, None)
    ax.set_xlabel("wire bits per value, forward + backward, at [1024, 8, 1024]")
    ax.set_ylabel("steps to target / bf16's, PP 8")
    ax.set_title("circles: frontier; squares: beaten; bars: 95% interval; "
                 "triangles: missed (at N / bf16's steps, a lower bound)", fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
