"""``python -m benchmarks.reproduce PART [--out runs/reproduce] [--jobs N] [--size full|tiny]``.

PART: data, throughput, convergence, ablations, seeds, long, parity, parity-seeds, parity-compact, memory, report,
parity-report
(the parity study alone, from the committed run record ``docs/data/parity_runs.json`` and the logs here: docs/PARITY.md,
and section 4b of an existing docs/RESULTS.md, a pointer to it; the other sections need every part's logs). ``--size tiny`` is the CI
smoke configuration (seconds per run; its report goes to ``OUT/docs`` unless ``--docs``).
Exit status 0 when the part completed, 1 when a run failed, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from . import convergence, parity, parity_report
from ..common.runner import ReproduceError, execute_all, say

PARTS = ("data", "throughput", "convergence", "ablations", "seeds", "long", "parity", "parity-seeds", "parity-compact",
         "memory", "report", "parity-report")
TRAINING_PARTS = {"convergence": lambda root, size: convergence.pretrain_runs(root, size)
                  + convergence.finetune_runs(root, size),
                  "ablations": convergence.ablation_runs, "seeds": convergence.seed_runs,
                  "long": convergence.long_runs, "parity": parity.parity_runs,
                  "parity-seeds": parity.more_seed_runs, "parity-compact": parity.compact_runs}
SEEDED_PARTS = ("parity", "parity-seeds", "parity-compact")  # the parts that take --seeds / --widths


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.reproduce", description=__doc__.split("\n")[0])
    p.add_argument("part", choices=PARTS)
    p.add_argument("--out", default="runs/reproduce", help="results root (default runs/reproduce)")
    p.add_argument("--size", choices=sorted(convergence.SIZES), default="full")
    p.add_argument("--jobs", type=int, default=2, help="training runs at a time (convergence, ablations, seeds, long, parity)")
    p.add_argument("--force", action="store_true", help="rerun runs that already completed")
    p.add_argument("--only", default=None, help="training parts: comma-separated run names to run")
    p.add_argument("--seeds", default=None,
                   help="parity, parity-seeds, parity-compact: comma-separated seeds to run instead of the part's own")
    p.add_argument("--widths", default=None,
                   help="parity, parity-seeds, parity-compact: comma-separated hidden sizes to run instead of "
                        f"{','.join(map(str, parity.WIDTHS))}")
    p.add_argument("--docs", default=None, help="report, parity-report: output directory (default docs/, or OUT/docs for tiny)")
    p.add_argument("--link", choices=("netns", "emulate"), default="netns",
                   help="throughput: real namespaced links (root) or the in-process emulation")
    p.add_argument("--max-load", type=float, default=3.0,
                   help="throughput: wait until the 1-minute load average is below this (0: do not wait)")
    p.add_argument("--max-wait", type=float, default=900.0,
                   help="throughput: give up waiting for a quiet machine after this many seconds (default 900)")
    return p


def _select(runs, only: str):
    """The runs named in the comma-separated ``only`` (their ``after`` dependencies must already be done)."""
    wanted = [n.strip() for n in only.split(",") if n.strip()]
    known = {r.name: r for r in runs}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise ValueError(f"--only {only}: no run named {', '.join(unknown)} (known: {', '.join(known)})")
    return [dataclasses.replace(known[n], after=()) for n in wanted]


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{flag} {text}: expected comma-separated integers") from None
    if not values:
        raise ValueError(f"{flag} {text}: empty")
    return values


def _parity_choice(args) -> dict:
    """``--seeds`` / ``--widths`` as keyword arguments of the parity parts' run lists (refused elsewhere)."""
    chosen = {name: _ints(getattr(args, name), f"--{name}") for name in ("seeds", "widths")
              if getattr(args, name) is not None}
    if chosen and args.part not in SEEDED_PARTS:
        raise ValueError(f"--{next(iter(chosen))} applies to the parts {', '.join(SEEDED_PARTS)}, not {args.part}")
    return chosen


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.jobs < 1:
        print(f"error: --jobs {args.jobs}: must be >= 1", file=sys.stderr)
        return 2
    root = Path(args.out)
    try:
        if args.part == "data" or args.part == "memory" or args.part in TRAINING_PARTS:
            convergence.prepare_data(root, args.size)
        if args.part == "parity-compact":
            convergence.prepare_data(root, args.size, protocol=parity.COMPACT)
        if args.part in TRAINING_PARTS:
            runs = TRAINING_PARTS[args.part](root, args.size, **_parity_choice(args))
            if args.only:
                runs = _select(runs, args.only)
            execute_all(runs, root / "convergence", jobs=args.jobs, force=args.force)
        elif args.part == "memory":
            from . import memory

            memory.run(root, args.size)
        elif args.part == "throughput":
            from . import throughput

            throughput.run(root, args.size, link=args.link, max_load=args.max_load, max_wait=args.max_wait,
                           force=args.force)
            if args.size == "full":
                from . import report

                docs = Path(args.docs) if args.docs else Path("docs")
                if report.refresh_throughput_section(root, docs, args.size):
                    say(f"rewrote section 1 (throughput) of {docs / 'RESULTS.md'} from {root / 'throughput'}")
        elif args.part in ("report", "parity-report"):
            from . import report

            docs = Path(args.docs) if args.docs else (Path("docs") if args.size == "full" else root / "docs")
            path = (report.write(root, docs, args.size) if args.part == "report"
                    else parity_report.write_page(root / "convergence", docs, args.size))
            say(f"wrote {path}")
            if args.part == "parity-report" and report.refresh_compact_section(docs, args.size):
                say(f"rewrote section 4b (the low-noise protocol: a pointer to PARITY.md) of {docs / 'RESULTS.md'}")
    except ReproduceError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
