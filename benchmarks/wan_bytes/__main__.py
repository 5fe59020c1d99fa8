"""``python -m benchmarks.wan_bytes RUN_DIR [RUN_DIR ...]``: the WAN ledger of pretraining runs, as a table.

Each ``RUN_DIR`` is a run of ``scripts/pretrain_gpt.sh`` (its ``OUT``), read from its ``log.jsonl``: the
training records from iteration ``--from`` (default 2: the first iteration holds start-up traffic, the
weights' initial all-reduce and the configuration handshake) on. Per run: the median wall seconds per
iteration (with min and max), the WAN bytes per iteration of the last record (every byte that crossed a
stage boundary, summed over stages) per category, the share that went through a codec, the last
``lm_loss``.

Prints Markdown rows (``docs/WAN_BYTES.md``) and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

CATEGORIES = ("pipeline", "embedding", "dp", "other")


def summarize(run: Path, first: int = 2) -> dict:
    """The numbers of one run directory (module docstring)."""
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines() if line.strip()]
    records = [r for r in records if "wan" in r and r["iteration"] >= first and r.get("ms") is not None]
    if not records:
        raise SystemExit(f"wan_bytes: {run}/log.jsonl has no training record from iteration {first}")
    seconds = [r["ms"] / 1000 for r in records]
    last = records[-1]
    return {"run": run.name, "iterations": (records[0]["iteration"], last["iteration"]),
            "s_per_iter": statistics.median(seconds), "min": min(seconds), "max": max(seconds),
            "wan_bytes": last["wan_bytes"], "codec_bytes": last["wan_codec_bytes"],
            "bytes": {c: last["wan"][c]["bytes"] for c in CATEGORIES}, "lm_loss": last.get("lm_loss")}


def row(s: dict) -> str:
    """One Markdown row: run, s/iter (min-max), WAN MB/iter, pipeline, embedding, other, codec share, loss."""
    mb = {c: s["bytes"][c] / 1e6 for c in CATEGORIES}
    share = 100 * s["codec_bytes"] / s["wan_bytes"] if s["wan_bytes"] else 0.0
    return (f"| {s['run']} | {s['s_per_iter']:.2f} ({s['min']:.2f}-{s['max']:.2f}) | {s['wan_bytes'] / 1e6:.3f} | "
            f"{mb['pipeline']:.3f} | {mb['embedding']:.3f} | {mb['other'] + mb['dp']:.4f} | {share:.1f}% | "
            f"{s['lm_loss']:.4f} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--from", dest="first", type=int, default=2, help="first iteration counted (default 2)")
    args = parser.parse_args(argv)
    print("| run | s/iter, median (min-max) | WAN MB/iter | pipeline | embedding | other | through a codec | lm loss |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for run in args.runs:
        print(row(summarize(run, args.first)))


if __name__ == "__main__":
    main()
