"""The real-model page's plots: the steps multipliers by codec, the ratio along the run, the bits-steps frontier."""

from __future__ import annotations

import statistics
from pathlib import Path

from ..common import score
from . import runs
from .scoring import TRAFFIC_LABEL


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
