#!/usr/bin/env python
"""The pipeline throughput table of scripts/gpu_pipeline.sh: Markdown + JSON + PNG under docs/benchmarks/.

Input: a run directory with one folder per run, each holding ``meta.json`` (written by
gpu_pipeline.sh: ``pp``, ``rate``, ``codec``, ``link``, ``gpu``, ``layers_per_stage``,
``micro_batches``, ``warmup``), ``log.jsonl`` (``--tah-log-json``: one record per iteration, see
``megatron_tah/megatron/run_log.py``) and ``stdout.log`` (Megatron's ``[Rank r] ... max allocated:``
memory lines). ``calib_pp1`` is one stage alone on the GPU (PP=1, the same layers per stage).

Per run, over the iterations after ``warmup`` (medians of per-iteration values):

* tokens/s, and the speed-up over bf16 at the same PP and rate;
* MB on the wire per iteration (``fwd_wire_bytes + bwd_wire_bytes``: every link, both directions);
* codec ms per iteration (``codec_ms``: encode + decode, CUDA events, summed over the stages);
* link ms per iteration: the busiest link direction's bytes (``max(fwd, bwd) / (PP - 1)``) at the
  link rate -- the time tc needs for them;
* peak GPU memory: the largest ``max allocated`` of one stage, and the sum over the stages (the GPU
  they share holds all of them).

Projection to one GPU per stage, from ``scripts/performance_model.py``'s ``iteration_seconds``:
``C + codec_ms / PP + link ms`` where ``C`` is the compute of one stage measured *alone* (the
``calib_pp1`` run's iteration time; it also holds the embedding and the output layer, so it
overstates a middle stage). Stages sharing one GPU serialise their kernels and share its host
threads; the projection removes that by taking the stage's compute from the run where it had the
GPU to itself, so the stages of the projected pipeline run side by side. The bound beside each row is
the speed-up over bf16 that these measured times allow (projected bf16 time / projected time); the
measured speed-up's fraction of it is the goal's ">= 85% of the bound".

    python scripts/gpu_pipeline_table.py runs/gpu_pipeline --out-dir docs/benchmarks
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from megatron_tah.units import parse_bandwidth  # noqa: E402

CODEC_LABELS = {"bf16": "uncompressed bf16", "tah": "TAH-Quant (default)", "hadint4": "--tah-preset hadint4",
                "lowrank": "--tah-preset lowrank"}
_MEMORY = re.compile(r"\[Rank (\d+)\].*?max allocated: ([0-9.]+)")


def iteration_seconds(compute_s: float, link_bytes: float, rate_bps: float, codec_s: float) -> float:
    from performance_model import iteration_seconds as model  # imports torch: only when projecting

    return model(compute_s, link_bytes, rate_bps, codec_s)


def _records(run: pathlib.Path, warmup: int) -> list[dict]:
    from megatron_tah.megatron.run_log import read_records

    path = run / "log.jsonl"
    if not path.exists():
        return []
    return [r for r in read_records(str(path)) if r["iteration"] > warmup and r.get("ms")]


def peak_memory_mb(stdout: pathlib.Path) -> dict[int, float]:
    """``{rank: max allocated MB}`` from Megatron's memory report lines (the largest per rank)."""
    peaks: dict[int, float] = {}
    if stdout.exists():
        for rank, mb in _MEMORY.findall(stdout.read_text(errors="replace")):
            peaks[int(rank)] = max(peaks.get(int(rank), 0.0), float(mb))
    return peaks


def summarise(run: pathlib.Path) -> dict | None:
    """One run's row (see the module docstring); None when it left no counted iteration."""
    meta = json.loads((run / "meta.json").read_text())
    records = _records(run, meta["warmup"])
    if not records:
        return None
    pp = meta["pp"]
    ms = statistics.median(r["ms"] for r in records)
    fwd = statistics.median(r["fwd_wire_bytes"] for r in records)
    bwd = statistics.median(r["bwd_wire_bytes"] for r in records)
    rate_bps = parse_bandwidth(meta["rate"]) if meta["rate"] else None
    busiest = max(fwd, bwd) / (pp - 1) if pp > 1 else 0.0
    peaks = peak_memory_mb(run / "stdout.log")
    return {**meta, "iterations": len(records), "ms": ms,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records),
            "tokens_per_iteration": records[0]["tokens_per_s"] * records[0]["ms"] / 1e3,
            "wire_mb": (fwd + bwd) / 1e6, "busiest_link_bytes": busiest,
            "codec_ms": statistics.median(r["codec_ms"] for r in records),
            "link_ms": busiest * 8 / rate_bps * 1e3 if rate_bps else 0.0,
            "peak_mb_stage": max(peaks.values()) if peaks else None,
            "peak_mb_total": sum(peaks.values()) if peaks else None}


def build_rows(run_dir: pathlib.Path) -> tuple[list[dict], dict | None]:
    """Rows of every run with a speed-up, bound and projection; and the calibration run."""
    runs = {p.name: summarise(p) for p in sorted(run_dir.iterdir()) if (p / "meta.json").exists()}
    calib = runs.pop("calib_pp1", None)
    rows = [r for r in runs.values() if r is not None]
    compute_ms = calib["ms"] if calib else None
    for row in rows:
        if compute_ms is not None:
            row["projected_ms"] = 1e3 * iteration_seconds(compute_ms / 1e3, row["busiest_link_bytes"],
                                                          parse_bandwidth(row["rate"]), row["codec_ms"] / row["pp"] / 1e3)
            row["projected_tokens_per_s"] = row["tokens_per_iteration"] / row["projected_ms"] * 1e3
    for row in rows:
        base = next((b for b in rows if b["codec"] == "bf16" and b["pp"] == row["pp"] and b["rate"] == row["rate"]), None)
        row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"] if base else None
        row["bound"] = base["projected_ms"] / row["projected_ms"] if base and "projected_ms" in row else None
        row["of_bound"] = row["speedup"] / row["bound"] if row["speedup"] and row["bound"] else None
    rows.sort(key=lambda r: (r["pp"], parse_bandwidth(r["rate"]), list(CODEC_LABELS).index(r["codec"])))
    return rows, calib


def _f(value, fmt: str, missing: str = "-") -> str:
    return missing if value is None else format(value, fmt)


def goals(rows: list[dict]) -> list[str]:
    """The pipeline goals, each with its verdict from the rows."""
    out = []
    for pp in sorted({r["pp"] for r in rows}):
        tah = next((r for r in rows if r["pp"] == pp and r["codec"] == "tah" and parse_bandwidth(r["rate"]) == 1e8), None)
        if tah and tah["speedup"]:
            out.append(f"- PP {pp}, 100 Mbit/s: TAH-Quant {tah['speedup']:.2f}x over bf16 "
                       f"({'meets' if tah['speedup'] >= 3.0 else 'misses'} >= 3.0x)")
        for rate in sorted({r["rate"] for r in rows if r["pp"] == pp}, key=parse_bandwidth):
            at = [r for r in rows if r["pp"] == pp and r["rate"] == rate and r["codec"] != "bf16" and r["speedup"]]
            if at:
                best = max(at, key=lambda r: r["speedup"])
                verdict = "not slower" if best["speedup"] >= 0.97 else "slower"
                bound = "" if best["of_bound"] is None else f"; {best['of_bound']:.0%} of its bound"
                out.append(f"- PP {pp}, {rate}: best codec {CODEC_LABELS[best['codec']]} at {best['speedup']:.2f}x "
                           f"({verdict} than bf16 by more than 3%{bound})")
    return out


def markdown(rows: list[dict], calib: dict | None) -> str:
    gpu = rows[0]["gpu"] if rows else (calib or {}).get("gpu", "?")
    link = rows[0]["link"] if rows else "?"
    head = [f"# Pipeline throughput on one {gpu} (stages sharing the GPU)", "",
            "Written by `scripts/gpu_pipeline.sh` -> `scripts/gpu_pipeline_table.py` (see their docstrings). "
            f"GPT-2-XL-shaped stages: hidden 1600, 25 heads, seq 1024, micro-batch 1, bf16, "
            f"{rows[0]['layers_per_stage'] if rows else '?'} layers per stage, "
            f"{rows[0]['micro_batches'] if rows else '?'} micro-batches per iteration; links by "
            f"{'tc in network namespaces' if link == 'netns' else 'the in-process emulation'}; medians over "
            f"{rows[0]['iterations'] if rows else '?'} iterations after {rows[0]['warmup'] if rows else '?'} warm-up ones.",
            "",
            f"One stage alone (PP=1, the calibration run): **{_f(calib and calib['ms'], '.0f')} ms** per iteration -- "
            "the per-stage compute of the projection, which gives each stage its own GPU.", "",
            "| PP | link | codec | tokens/s | speed-up vs bf16 | bound (measured times) | of bound | MB/iter on wire "
            "| codec ms/iter | link ms/iter | peak GB (stage / all) | projected tokens/s, 1 GPU per stage |",
            "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        peak = "-" if r["peak_mb_stage"] is None else f"{r['peak_mb_stage'] / 1024:.1f} / {r['peak_mb_total'] / 1024:.1f}"
        head.append(f"| {r['pp']} | {r['rate']} | {CODEC_LABELS[r['codec']]} | {r['tokens_per_s']:.0f} | "
                    f"{_f(r['speedup'], '.2f')}x | {_f(r['bound'], '.2f')}x | {_f(r['of_bound'], '.0%')} | "
                    f"{r['wire_mb']:.1f} | {r['codec_ms']:.1f} | {r['link_ms']:.0f} | {peak} | "
                    f"{_f(r.get('projected_tokens_per_s'), '.0f')} |")
    return "\n".join(head + ["", "## Goals", "", *goals(rows), ""])


def plot(rows: list[dict], path: pathlib.Path) -> bool:
    """tokens/s against link rate, one line per codec, one panel per PP; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    pps = sorted({r["pp"] for r in rows})
    fig, axes = plt.subplots(1, len(pps), figsize=(5.5 * len(pps), 4), squeeze=False)
    for ax, pp in zip(axes[0], pps):
        for codec, label in CODEC_LABELS.items():
            pts = sorted((parse_bandwidth(r["rate"]), r["tokens_per_s"]) for r in rows if r["pp"] == pp and r["codec"] == codec)
            if pts:
                ax.plot([p[0] / 1e9 for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log")
        ax.set_xlabel("link rate (Gbit/s)")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"PP {pp} on one {rows[0]['gpu']}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def gpu_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=pathlib.Path)
    parser.add_argument("--out-dir", type=pathlib.Path, default=ROOT / "docs" / "benchmarks")
    args = parser.parse_args(argv)
    rows, calib = build_rows(args.run_dir)
    if not rows:
        print(f"gpu_pipeline_table: no run in {args.run_dir} left a counted iteration", file=sys.stderr)
        return 1
    stem = args.out_dir / f"{gpu_slug(rows[0]['gpu'])}-pipeline"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    text = markdown(rows, calib)
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps({"calibration": calib, "rows": rows}, indent=1) + "\n")
    drew = plot(rows, stem.with_suffix(".png"))
    print(text)
    print(f"wrote {stem}.md, .json" + (", .png" if drew else " (no PNG: matplotlib missing)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
