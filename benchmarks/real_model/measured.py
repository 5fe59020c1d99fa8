"""The values the product reads from the studies: ``megatron_tah/config/measured.json`` (package data).

    python -m benchmarks.real_model.measured    # rewrite it from the committed real-model page's JSON (docs/data/real_model.json)

Its ``steps_multiplier`` holds, per pipeline depth, ``auto``'s steps multipliers (``config/auto.py``): a row
``{"multipliers": {candidate: steps to the target loss / bf16's}, "at_least": [the candidates whose multiplier is a
lower bound], "page", "command", "date", "host"}``, the last four saying where the numbers come from. They are the
real-model study's (SmolLM2-135M at each depth it ran, docs/REAL_MODEL.md), on the evaluation of a model served on
its own (uncompressed): what the codecs did to training. A multiplier measured to the target is kept to 3 decimals,
a lower bound to 2: for a codec that missed the target, its run's steps over bf16's steps to target on the same
seed, the smallest over the seeds that missed. The study writes the rows with its page (``write_beside``);
``tests/studies/test_auto_depth.py`` checks the file against the page.

Its ``direction_shares`` holds, per depth, how ``auto`` splits a candidate's multiplier between the directions
(``config/auto.py``): the whole-run study's one-direction runs (``direction_shares``), written with its page.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from megatron_tah.config import CANDIDATES

ROOT = Path(__file__).resolve().parents[2]
MEASURED = Path("megatron_tah") / "config" / "measured.json"  # under a checkout's root
REAL_MODEL = {"page": "docs/data/real_model.json",
              "command": "python -m benchmarks.real_model --write docs/REAL_MODEL.md"}
WHOLE_RUN = {"page": "docs/data/whole_run.json",
             "command": "python -m benchmarks.real_model --plan benchmarks/real_model/whole_run.toml --write "
                        "docs/WHOLE_RUN.md"}
DECIMALS, BOUND_DECIMALS = 3, 2  # a measured multiplier's, a lower bound's
TRAFFIC = "uncompressed"  # the evaluation auto's charges come from: what the codecs did to training


def lower_bound(row: dict, bf16: dict) -> float | None:
    """A codec row that missed the target (on ``TRAFFIC``): its steps (``missed_within``) over bf16's steps to target
    on each seed that missed, the smallest; None when it did not miss."""
    metric = row[TRAFFIC]
    if metric["multiplier"] is not None or not metric["missed_within"]:
        return None
    base = bf16[TRAFFIC]["steps_by_seed"]
    bounds = [metric["missed_within"] / base[s] for s, v in metric["steps_by_seed"].items() if v is None and base.get(s)]
    return min(bounds) if bounds else None


def real_model_rows(result: dict, command: str | None = None) -> dict[int, dict]:
    """{depth: row} of a real-model result (its page's JSON): each ``auto`` candidate it ran at that depth, with its
    steps multiplier or, when it missed the target, the lower bound."""
    rows = {}
    tables = {str(result["depth"]): result["table"], **result.get("depths", {})}
    for depth, table in tables.items():
        bf16 = next(r for r in table if r["codec"] == "bf16")
        multipliers, at_least = {}, set()
        for r in table:
            if r["codec"] not in CANDIDATES:
                continue
            if r[TRAFFIC]["multiplier"] is not None:
                multipliers[r["codec"]] = round(r[TRAFFIC]["multiplier"], DECIMALS)
            elif lower_bound(r, bf16) is not None:
                multipliers[r["codec"]] = round(lower_bound(r, bf16), BOUND_DECIMALS)
                at_least.add(r["codec"])
        if multipliers:
            rows[int(depth)] = {"multipliers": multipliers, "at_least": sorted(at_least),
                                "page": REAL_MODEL["page"], "command": command or REAL_MODEL["command"],
                                "date": result["date"], "host": result["host"]}
    return rows


ONE_DIRECTION = ("_fwd", "_bwd")  # the whole-run study's one-direction runs of a candidate: "<candidate>_fwd"...


def direction_shares(result: dict) -> dict[int, dict]:
    """{depth: {"shares": {candidate: forward share}, "ratios": {candidate: [forward, backward]}, "page", "date",
    "host"}} from a whole-run result (its page's JSON): for each candidate that ran one direction at a time at a
    depth (``<candidate>_fwd``: activations through its codec, gradients uncompressed; ``_bwd`` the other way), the
    forward direction's share of the logarithm of its steps multiplier, ``ln f / (ln f + ln b)`` of the two runs'
    end-of-run equivalent-steps ratios on ``TRAFFIC`` (each at least 1: a direction that cost no steps takes no
    share); none where both cost none, or where a run's ratio is missing."""
    found = {}
    for depth, rows in result.get("tables", {}).items():
        by_codec = {r["codec"]: r for r in rows}
        shares, ratios = {}, {}
        for candidate in CANDIDATES:
            pair = [by_codec.get(candidate + end) for end in ONE_DIRECTION]
            if None in pair:
                continue
            ends = [r[TRAFFIC]["points"].get(str(max(map(int, r[TRAFFIC]["points"]))), {}).get("ratio") for r in pair]
            if None in ends:
                continue
            logs = [math.log(max(1.0, e)) for e in ends]
            if sum(logs) > 0:
                shares[candidate] = round(logs[0] / sum(logs), DECIMALS)
                ratios[candidate] = [round(e, DECIMALS) for e in ends]
        if shares:
            found[int(depth)] = {"shares": shares, "ratios": ratios, "page": WHOLE_RUN["page"],
                                 "command": WHOLE_RUN["command"], "date": result["date"]}
    return found


def write_shares(path: Path, rows: dict[int, dict]) -> None:
    """Put ``rows`` ({depth: row} of ``direction_shares``) under ``direction_shares`` in the measured file ``path``,
    keeping everything else."""
    data = json.loads(path.read_text())
    merged = {**data.get("direction_shares", {}), **{str(d): row for d, row in rows.items()}}
    data["direction_shares"] = {key: merged[key] for key in sorted(merged, key=int)}
    path.write_text(json.dumps(data, indent=1) + "\n")


def write_row(depth: int, row: dict, path: Path) -> None:
    """Put ``row`` at ``depth`` in the measured file ``path``, keeping its other rows (depths in order)."""
    data = json.loads(path.read_text()) if path.exists() else {"steps_multiplier": {}}
    rows = {**data["steps_multiplier"], str(depth): row}
    data["steps_multiplier"] = {key: rows[key] for key in sorted(rows, key=int)}
    path.write_text(json.dumps(data, indent=1) + "\n")


def write_beside(page: Path, rows: dict[int, dict]) -> Path | None:
    """Write ``rows`` ({depth: row}) into the measured file of the checkout whose ``docs/`` holds ``page``, the page
    a study just wrote; returns that file (None, nothing written: the page is elsewhere, e.g. a trial run's)."""
    path = Path(page).resolve().parent.parent / MEASURED
    if not path.exists():
        return None
    for depth, row in rows.items():
        write_row(depth, row, path)
    return path


def main() -> int:
    rows = real_model_rows(json.loads((ROOT / REAL_MODEL["page"]).read_text()))
    path = ROOT / MEASURED
    path.write_text(json.dumps({"steps_multiplier": {}}, indent=1) + "\n")  # only the study's rows
    for depth, row in rows.items():
        write_row(depth, row, path)
    print(f"[measured] wrote {MEASURED} (depths {', '.join(map(str, sorted(rows)))})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
