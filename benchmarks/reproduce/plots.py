"""PNG plots of the reproduction (matplotlib, Agg backend, ~100 dpi so each file stays well under 200 KB)."""

from __future__ import annotations

from pathlib import Path

DATA = "data"
"""The folder under docs/ that holds the plots (and the parity record): a page in docs/ links ``data/<name>``."""

COLORS = {"none": "black", "none_bf16": "tab:gray", "tah": "tab:red", "tah_bf16": "tab:pink",
          "fixedpoint4": "tab:blue", "fixedpoint3": "tab:cyan", "aqsgd": "tab:green", "fp8": "tab:purple"}


def link(path: Path) -> str:
    """The Markdown target of ``path`` (a file in docs/data/) from a page in docs/."""
    return f"{DATA}/{Path(path).name}"


def _save(fig, path: Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def loss_curves(rows: dict[str, dict], path: Path, title: str, prefix: str = "") -> Path:
    """Validation loss (markers) and smoothed training loss (thin lines) per run; ``rows`` from ``convergence.collect``."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, row in rows.items():
        codec = name.removeprefix(prefix)
        color = COLORS.get(codec)
        records = row["records"]
        it = [r["iteration"] for r in records]
        loss = [r["lm_loss"] for r in records]
        k = max(1, len(loss) // 20)
        smooth = [sum(loss[max(0, i - k + 1): i + 1]) / len(loss[max(0, i - k + 1): i + 1]) for i in range(len(loss))]
        label = row["meta"].get("label") or codec
        axes[0].plot(it, smooth, color=color, lw=1.0, label=label)
        valid = [r for r in records if "valid_loss" in r]
        axes[1].plot([r["iteration"] for r in valid], [r["valid_loss"] for r in valid], "o-", ms=3, lw=1.0,
                     color=color, label=label)
    axes[0].set_title("training loss (moving average)", fontsize=9)
    axes[1].set_title("validation loss", fontsize=9)
    for ax in axes:
        ax.set_xlabel("iteration")
        ax.set_ylabel("lm loss")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    # Zoom the validation panel on the last two thirds, where the curves separate.
    finals = [r["valid_loss"] for row in rows.values() for r in row["records"][len(row["records"]) // 3:]
              if "valid_loss" in r]
    if finals:
        lo, hi = min(finals), max(finals)
        axes[1].set_ylim(lo - 0.1 * (hi - lo + 1e-3) - 0.02, hi + 0.6 * (hi - lo + 1e-3) + 0.02)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


def throughput(table: dict, path: Path, labels: dict[str, str]) -> Path:
    """tokens/s vs link rate (log x) per codec, and measured speed-up vs the bound for TAH-Quant."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    rates = sorted(table["rates"].values(), key=lambda e: e["rate_bps"])
    codecs = [c for c in labels if any(c in e["rows"] and e["rows"][c] for e in rates)]
    for codec in codecs:
        pts = [(e["rate_bps"] / 1e6, e["rows"][codec]["tokens_per_s"]) for e in rates if e["rows"].get(codec)]
        axes[0].plot(*zip(*pts), "o-", ms=3, color=COLORS.get(codec), label=labels[codec])
    unthrottled = (table["compute"].get("none") or {}).get("tokens_per_s")
    if unthrottled:
        axes[0].axhline(unthrottled, color="black", ls=":", lw=0.8, label="fp32, unthrottled loopback")
    axes[0].set_xscale("log")
    axes[0].set_xlabel("link rate (Mbit/s)")
    axes[0].set_ylabel("tokens/s")
    axes[0].set_title("throughput vs link rate (PP %d, real tc links)" % table["pipeline"], fontsize=9)
    axes[0].legend(fontsize=7)
    for codec in ("tah", "fixedpoint4", "aqsgd", "fp8"):
        pts = [(e["rate_bps"] / 1e6, e["rows"][codec]["speedup"], e["rows"][codec]["bound"]) for e in rates
               if e["rows"].get(codec) and e["rows"][codec].get("speedup")]
        if not pts:
            continue
        x, s, b = zip(*pts)
        axes[1].plot(x, s, "o-", ms=3, color=COLORS.get(codec), label=f"{labels[codec]}: measured")
        if codec == "tah":
            axes[1].plot(x, b, "s--", ms=3, color=COLORS.get(codec), alpha=0.6, label=f"{labels[codec]}: bound")
    axes[1].axhline(1.0, color="black", lw=0.6)
    axes[1].set_xscale("log")
    axes[1].set_xlabel("link rate (Mbit/s)")
    axes[1].set_ylabel("speed-up over fp32")
    axes[1].set_title("speed-up over uncompressed fp32", fontsize=9)
    axes[1].legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


def parity_gaps(points: dict[int, list[tuple[str, list[float], tuple[float, float] | None]]], path: Path,
                goal: float, limit: float) -> Path:
    """One panel per width, one row per candidate: every same-seed gap (dots), their mean and 95% interval
    (black), against zero, the goal and the limit (fractions). ``points[hidden]``: ``(label, gaps, interval)``."""
    plt = _pyplot()
    widths = sorted(points)
    labels = list(dict.fromkeys(label for rows in points.values() for label, _, _ in rows))
    fig, axes = plt.subplots(1, len(widths), figsize=(11, 1.4 + 0.45 * len(labels)), sharey=True, squeeze=False)
    for ax, hidden in zip(axes[0], widths):
        for label, gaps, interval in points[hidden]:
            y = labels.index(label)
            ax.plot([100 * g for g in gaps], [y + 0.12] * len(gaps), "o", ms=4, color="tab:blue", alpha=0.6)
            if interval is not None:
                ax.plot([100 * interval[0], 100 * interval[1]], [y - 0.12] * 2, color="black", lw=1.5)
            ax.plot([100 * sum(gaps) / len(gaps)], [y - 0.12], "D", ms=5, color="black")
        ax.axvline(0.0, color="black", lw=0.6)
        ax.axvline(100 * goal, color="tab:green", ls="--", lw=0.8, label=f"goal: mean <= {100 * goal:g}%")
        ax.axvline(100 * limit, color="tab:red", ls=":", lw=0.8, label=f"goal: interval below {100 * limit:g}%")
        ax.set_xlabel("late validation loss gap to uncompressed, same seed (%)", fontsize=8)
        ax.set_title(f"hidden {hidden}", fontsize=9)
        ax.grid(alpha=0.3, axis="x")
    axes[0][0].set_yticks(range(len(labels)), [label.replace(", ", ",\n", 1) for label in labels], fontsize=7)
    axes[0][0].set_ylim(len(labels) - 0.5, -0.5)
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.suptitle("same-seed gaps: seeds (blue), mean and 95% interval (black)", fontsize=9)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


def gap_against_error(points: dict[int, list[tuple[str, float, float]]], crossings: dict[int, float], path: Path,
                      goal: float) -> Path:
    """Forward-only gap (%) against the forward round-trip error, one colour per width: each run (labelled),
    joined in order of error, the goal, and where the gap crosses it (``crossings[hidden]``: an error).
    ``points[hidden]``: ``(label, error, gap)``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for (hidden, rows), color in zip(sorted(points.items()), ("tab:blue", "tab:orange", "tab:green")):
        rows = sorted(rows, key=lambda row: row[1])
        ax.plot([e for _, e, _ in rows], [100 * g for _, _, g in rows], "o-", lw=0.8, color=color,
                label=f"hidden {hidden}")
        for label, error, gap in rows:
            ax.annotate(label, (error, 100 * gap), fontsize=7, xytext=(4, -3), textcoords="offset points")
        if hidden in crossings:
            ax.axvline(crossings[hidden], color=color, ls="--", lw=0.8,
                       label=f"hidden {hidden}: {100 * goal:g}% at error {crossings[hidden]:.3f}")
    ax.axhline(100 * goal, color="tab:green", ls=":", lw=0.8, label=f"goal: {100 * goal:g}%")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]))
    ax.set_xlabel("forward relative round-trip error (mean over the forward links)", fontsize=8)
    ax.set_ylabel("late validation loss gap, same seed (%)", fontsize=8)
    ax.set_title("forward codec alone (uncompressed backward)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path
