"""Where each curve of a speedrun page was measured, reconstructed once from the page JSON's git history.

    python -m benchmarks.speedrun.provenance    # fills docs/data/speedrun.json's curves that lack ``measured``

Pages written since carry it (``report.build``: each curve's ``measured: {"date", "cpu"}``, kept through
``--from-page``). For the pages before, a curve's provenance is the date and ``host.cpu`` of the first committed
page JSON that holds it, unless that page lists it among its ``reused`` runs, in which case the page before's;
the compute step's is that of the first page with the same compute step.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = Path("docs") / "data" / "speedrun.json"


def _where(page: dict) -> dict:
    return {"date": page["date"], "cpu": page["host"]["cpu"]}


def first_measured(pages: list[dict]) -> tuple[dict[str, dict], dict | None]:
    """({curve name: {"date", "cpu"}}, the compute step's) from the committed versions of a page JSON, oldest first."""
    found, compute, before = {}, None, None
    for page in pages:
        reused = set((page.get("reused") or {}).get("runs", ()))
        for name in page["curves"]:
            if name not in found:
                found[name] = _where(before) if name in reused and before is not None else _where(page)
        if compute is None or compute[0] != page["compute_s_per_step"]:
            compute = (page["compute_s_per_step"], _where(page))
        before = page
    return found, compute[1] if compute else None


def history(page: Path = PAGE, repo: Path = ROOT) -> list[dict]:
    """Every committed version of ``page`` (a path in ``repo``), oldest first."""
    git = lambda *args: subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,  # noqa: E731
                                       text=True).stdout
    commits = git("log", "--reverse", "--format=%H", "--", page.as_posix()).split()
    return [json.loads(git("show", f"{commit}:{page.as_posix()}")) for commit in commits]


def fill(data: dict, pages: list[dict]) -> list[str]:
    """Put the reconstructed provenance into ``data``'s curves that lack one (and its compute step's); returns the
    curves history does not hold (left as they are)."""
    found, compute = first_measured(pages)
    for name, curve in data["curves"].items():
        if "measured" not in curve and name in found:
            curve["measured"] = found[name]
    if "compute_measured" not in data and compute:
        data["compute_measured"] = compute
    return sorted(name for name, curve in data["curves"].items() if "measured" not in curve)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.speedrun.provenance", description=__doc__.split("\n")[0])
    parser.add_argument("--page", type=Path, default=PAGE, help="the page JSON, a path in the repository")
    args = parser.parse_args(argv)
    path = ROOT / args.page
    data = json.loads(path.read_text())
    unknown = fill(data, history(args.page))
    path.write_text(json.dumps(data, indent=1) + "\n")
    from .report import provenance_text

    print(f"[provenance] {provenance_text(data)} Not in the history: {', '.join(unknown) or 'none'}.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
