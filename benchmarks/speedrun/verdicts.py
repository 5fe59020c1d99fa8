"""What the speedrun's page concludes from ``scoring.build``'s result: T compared between two codecs, the best
micro-batch split, and whether that split is a recommendation or an estimate."""

from __future__ import annotations

from ..common import score
from . import check, frontier, projection
from .scoring import MEASURED

def best_split(result: dict, codec: str) -> dict | None:
    """``codec``'s projection at the micro-batch count with the lowest T (``projection_splits``), with
    ``micro_batches`` and ``vs_setup`` (its T over the setup's own split's); None without splits, codec or T (not
    projected)."""
    at = {int(m): next((r for r in rows if r["codec"] == codec), None)
          for m, rows in result.get("projection_splits", {}).items()}
    at = {m: r for m, r in at.items() if r is not None and r["T"] is not None}
    own = at.get(projection.SETUP.micro_batches)
    if not at or own is None:
        return None
    m = min(at, key=lambda k: at[k]["T"])
    return {**at[m], "micro_batches": m, "vs_setup": at[m]["T"] / own["T"]}


def split_verdict(result: dict, checked: dict) -> str:
    """The lowest projected T's split against the simulator's error in the micro-batch dependence (``checked``): a
    gain less than twice the largest error in a measured step ratio is called an estimate, not a recommendation.
    Among the codecs whose steps this page measured (not those projected at equal steps or from elsewhere)."""
    best = min((b for r in result["projection"] if r["codec"] != "none" and r["steps_label"] == MEASURED
                for b in [best_split(result, r["codec"])] if b), key=lambda b: b["T"], default=None)
    ratios = check.split_ratios(checked)
    if best is None or not ratios:
        return ""
    own = projection.SETUP.micro_batches
    if best["micro_batches"] == own:
        return f"The lowest projected T, `{best['codec']}`'s, is at the setup's own {own} micro-batches."
    gain, worst = 1 - best["vs_setup"], max(ratios, key=lambda r: abs(r["error"]))
    favours = all(r["error"] < 0 for r in ratios if r["codec"] != "bf16")
    return (f"The lowest projected T is `{best['codec']}`'s at {best['micro_batches']} micro-batches of "
            f"{best['micro_batch']}: {best['T']:,.0f} s, {gain:.1%} under its {own}-micro-batch projection. In the "
            f"timing runs the simulator's step ratio between micro-batch counts erred by up to "
            f"{abs(worst['error']):.1%} (`{worst['codec']}`)"
            + (", always in favour of fewer micro-batches for the compressed codecs (their compute behind the link "
               "is uncertain where stages share 2 cores)" if favours else "")
            + (", so the split's gain is an estimate of that precision, not a recommendation: a GPU timing run "
               "settles it." if abs(worst["error"]) >= gain / 2 else
               "; the split's gain is larger than that error."))


SETTLED_SEEDS = 3
"""Seeds a codec needs to be the page's headline (fewer: named beside it when its T is lower)."""


def compare_T(a: dict, b: dict) -> score.Comparison | None:
    """Row ``a``'s T against row ``b``'s: their same-seed steps ratio times their s/step ratio, over common seeds
    (``score.compare``); None without a common seed."""
    mine, other = frontier.by_seed(a, "multiplier_by_seed"), frontier.by_seed(b, "multiplier_by_seed")
    return score.compare(mine, other, a["s_per_step"] / b["s_per_step"]) if set(mine) & set(other) else None
