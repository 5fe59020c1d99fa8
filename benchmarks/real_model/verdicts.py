"""What the real-model study's numbers decide: the preset it recommends per depth and use (``recommended``, by
``rule_text``) and whether a row meets the goals (``GOALS``, ``meets``, ``serves``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

from ..common import score
from .scoring import MORE_DAMAGE, serving_bits, training_fields


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
