"""The values the product reads from the studies: ``megatron_tah/config/measured.json`` (package data).

    python -m benchmarks.measured    # rewrite it from the committed pages' JSON (docs/data/speedrun.json, depth.json)

Its ``steps_multiplier`` holds, per pipeline depth, ``auto``'s steps multipliers (``config/auto.py``): a row
``{"multipliers": {candidate: steps to the target loss / bf16's}, "at_least": [the candidates whose multiplier is a
lower bound], "page", "command", "date", "host"}``, the last four saying where the numbers come from. A multiplier
measured to the target is kept to 3 decimals, a lower bound to 2: for a speedrun codec that missed the target, the
longest schedule N it ran over bf16's steps to target on the same seed, the smallest over the seeds that missed
(``benchmarks.speedrun.score.missed_bound``). The speedrun (depth 8: every ``auto`` candidate it scored) and the
depth study (depth 4: ``paper``) write their row with their page (``write_row``), keeping the other rows;
``tests/test_auto_depth.py`` checks the file against the pages.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_tah.config import CANDIDATES

from .speedrun.frontier import lower_bound

ROOT = Path(__file__).resolve().parents[1]
MEASURED = Path("megatron_tah") / "config" / "measured.json"  # under a checkout's root
SPEEDRUN = {"page": "docs/data/speedrun.json", "command": "python -m benchmarks.speedrun --write docs/SPEEDRUN.md"}
DEPTH = {"page": "docs/data/depth.json", "command": "python -m benchmarks.depth --write docs/DEPTH.md"}
DEPTH_ROWS = {4: "paper_pp4"}  # the depth study's row standing for paper at each depth the speedrun does not run
DECIMALS, BOUND_DECIMALS = 3, 2  # a measured multiplier's, a lower bound's


def _row(multipliers: dict[str, float], at_least: set[str], source: dict, result: dict, command: str | None) -> dict:
    return {"multipliers": multipliers, "at_least": sorted(at_least), "page": source["page"],
            "command": command or source["command"], "date": result["date"], "host": result["host"]}


def speedrun_row(result: dict, command: str | None = None) -> tuple[int, dict]:
    """(depth, row) of a speedrun result (its page's JSON): each ``auto`` candidate it scored, with its steps
    multiplier or, when it missed the target, the measured lower bound (``frontier.lower_bound``)."""
    multipliers, at_least = {}, set()
    for r in result["table"]:
        if r["codec"] not in CANDIDATES:
            continue
        if r["multiplier"]:
            multipliers[r["codec"]] = round(r["multiplier"], DECIMALS)
        elif lower_bound(r):
            multipliers[r["codec"]] = round(lower_bound(r), BOUND_DECIMALS)
            at_least.add(r["codec"])
    return result["setup"]["stages"], _row(multipliers, at_least, SPEEDRUN, result, command)


def depth_rows(result: dict, command: str | None = None) -> dict[int, dict]:
    """{depth: row} of a depth-study result: ``paper``'s lower bound at each depth of ``DEPTH_ROWS``."""
    return {depth: _row({"paper": round(result["rows"][name]["multiplier_at_least"], BOUND_DECIMALS)}, {"paper"},
                        DEPTH, result, command)
            for depth, name in DEPTH_ROWS.items() if result["rows"].get(name, {}).get("multiplier_at_least")}


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
    speedrun = json.loads((ROOT / SPEEDRUN["page"]).read_text())
    rows = {**depth_rows(json.loads((ROOT / DEPTH["page"]).read_text())), **dict([speedrun_row(speedrun)])}
    for depth, row in rows.items():
        write_row(depth, row, ROOT / MEASURED)
    print(f"[measured] wrote {MEASURED} (depths {', '.join(map(str, sorted(rows)))})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
