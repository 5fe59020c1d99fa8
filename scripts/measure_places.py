#!/usr/bin/env python
"""Measure the tensor-parallel (TACO), data-parallel (QuanGrad) and activation-memory (LAAQ) places on CPU.

    python scripts/measure_places.py                      # everything (about 15 min on 2 busy cores)
    python scripts/measure_places.py --only collectives   # or: tp dp laaq, any subset

1. **collectives**: two gloo ranks run ``megatron_tah.megatron.collectives`` on activation-like
   ``[s, b, h]`` tensors (fp8) and gradient-like 1-D buckets (int8): relative error of all-gather,
   reduce-scatter and all-reduce against the exact (fp64) result, and bytes on the wire vs the
   same exchange uncompressed.
2. **Megatron-LM runs**: ``python -m megatron_tah.pretrain_gpt`` under torchrun (gloo, the CPU
   shims, Shakespeare data from ``python -m megatron_tah.data --corpus shakespeare --output-prefix
   data/shakespeare``), each setting twice from the same seed -- uncompressed, then with the place
   on -- reading the ``--tah-log-json`` records: training loss (mean of the last 10 iterations),
   validation loss at the end, bytes per iteration of each stream and their ratio, the sampled
   codec round-trip error, median iteration and codec time, and LAAQ's peak saved-tensor memory
   per pipeline stage.

Prints Markdown tables; writes every number to ``<out>/summary.json`` (default ``runs/places``).
CPU timings on a shared machine are indicative only; nothing here measures GPU speed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "4", "--global-batch-size", "16",
         "--lr", "1e-3", "--transformer-impl", "local", "--distributed-backend", "gloo",
         "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "50257", "--log-interval", "10", "--eval-interval", "100000", "--eval-iters", "4",
         "--seed", "1234"]
# name -> (processes, flags of both runs, flags of the compressed run)
RUNS = {
    "tp": [("TP=2", 2, ["--tensor-model-parallel-size", "2"], ["--tah-tp-codec", "fp8"])],
    "dp": [("DP=2, all-reduce", 2, [], ["--tah-dp-codec", "int8"]),
           ("DP=2, distributed optimizer", 2, ["--use-distributed-optimizer"], ["--tah-dp-codec", "int8"])],
    "laaq": [("PP=1", 1, [], ["--tah-activation-memory", "laaq"]),
             ("PP=2", 2, ["--pipeline-model-parallel-size", "2", "--tah-forward-codec", "none",
                          "--tah-backward-codec", "none"], ["--tah-activation-memory", "laaq"])],
}
STREAMS = {"tp": ("tp_forward", "tp_backward"), "dp": ("dp_backward",), "laaq": ()}


# ----- 1. collectives ---------------------------------------------------------------------------
def _collective_rank(rank: int, init_file: str, out_file: str) -> None:
    from megatron_tah.codecs import get_codec
    from megatron_tah.codecs.core.samples import activation_like
    from megatron_tah.megatron import collectives

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    n, rows = 2, []

    def rel(x, exact):
        return float((x.double() - exact).norm() / exact.norm())

    def gradient_like(seed):  # per-parameter scales spanning three orders of magnitude
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(1 << 20, generator=g) * torch.logspace(-3, 0, 64).repeat_interleave(1 << 14)).float()

    for label, codec, make in (("fp8 G=128, activations [256, 4, 1024] bf16", get_codec("fp8"),
                                lambda r: activation_like((256, 4, 1024), torch.bfloat16, seed=r)),
                               ("int8 B=128, 1-D gradient bucket (1M, fp32)", get_codec("int8"), gradient_like)):
        xs = [make(r) for r in range(n)]
        me = xs[rank]
        gathered = torch.empty((n * me.shape[0], *me.shape[1:]), dtype=me.dtype)
        t_ag = collectives.all_gather(codec, gathered, me)
        chunk = torch.empty_like(me.chunk(n)[0])
        t_rs = collectives.reduce_scatter(codec, chunk, me)
        reduced = me.clone()
        t_ar = collectives.all_reduce(codec, reduced)
        exact_sum = sum(x.double() for x in xs)
        rows.append({"data": label,
                     "all_gather": (rel(gathered, torch.cat(xs).double()), t_ag.raw_nbytes / t_ag.wire_nbytes),
                     "reduce_scatter": (rel(chunk, exact_sum.chunk(n)[rank]), t_rs.raw_nbytes / t_rs.wire_nbytes),
                     "all_reduce": (rel(reduced, exact_sum), t_ar.raw_nbytes / t_ar.wire_nbytes)})
    if rank == 0:
        pathlib.Path(out_file).write_text(json.dumps(rows))
    torch.distributed.destroy_process_group()


def measure_collectives() -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        torch.multiprocessing.spawn(_collective_rank, args=(os.path.join(tmp, "init"), out), nprocs=2)
        return json.loads(pathlib.Path(out).read_text())


# ----- 2. Megatron-LM runs --------------------------------------------------------------------------
def _train(name: str, nproc: int, flags: list[str], iters: int, out: pathlib.Path, port: int) -> list[dict]:
    log_json = out / f"{name}.jsonl"
    log_json.unlink(missing_ok=True)
    data = ["--train-data-path", "data/shakespeare_train_text_document",
            "--valid-data-path", "data/shakespeare_valid_text_document"]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(port), "-m", "megatron_tah.pretrain_gpt", *MODEL, *data,
               "--train-iters", str(iters), "--tah-log-json", str(log_json), *flags]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    with open(out / f"{name}.log", "w") as log:
        subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return [json.loads(line) for line in log_json.read_text().splitlines()]


def _summary(records: list[dict], streams) -> dict:
    train = [r for r in records if "lm_loss" in r]
    valid = [r["valid_loss"] for r in records if "valid_loss" in r]
    later = train[3:] or train
    result = {"train_loss": statistics.mean(r["lm_loss"] for r in train[-10:]),
              "valid_loss": valid[-1] if valid else None,
              "ms_per_iteration": statistics.median(r["ms"] for r in later if r["ms"]),
              "codec_ms_per_iteration": statistics.median(r["codec_ms"] for r in later)}
    for stream in streams:
        stats = [r["tah"][stream] for r in later]
        errors = [r["tah"][stream]["rel_error"] for r in train if r["tah"][stream]["rel_error"] is not None]
        result[stream] = {"raw_bytes": stats[-1]["raw_bytes"], "wire_bytes": stats[-1]["wire_bytes"],
                          "ratio": stats[-1]["ratio"], "rel_error": statistics.mean(errors) if errors else None}
    memory = train[-1].get("saved_memory") or {}
    result["saved_memory"] = {stage: {**peaks, "saved": 1 - peaks["stored_bytes"] / peaks["raw_bytes"]}
                              for stage, peaks in memory.items()}
    return result


def measure_runs(places: list[str], iters: int, out: pathlib.Path) -> dict:
    if not (ROOT / "data" / "shakespeare_train_text_document.bin").exists():
        raise SystemExit("data/shakespeare_*.bin missing: run python -m megatron_tah.data --corpus shakespeare "
                         "--output-prefix data/shakespeare first")
    results, port = {}, 29700
    for place in places:
        for label, nproc, common, compressed in RUNS[place]:
            tag = f"{place} {label}"
            slug = tag.replace(" ", "_").replace(",", "").replace("=", "")
            print(f"... {tag}: uncompressed, then {' '.join(compressed)}", flush=True)
            base = _summary(_train(slug + "_base", nproc, common, iters, out, port), ())
            ours = _summary(_train(slug + "_tah", nproc, common + compressed, iters, out, port + 1), STREAMS[place])
            results[tag] = {"processes": nproc, "flags": common, "compressed_flags": compressed,
                            "base": base, "compressed": ours}
            port += 2
    return results


# ----- report ---------------------------------------------------------------------------------------
def _fmt(value, spec=".3f"):
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def print_tables(collective_rows, runs, iters) -> None:
    if collective_rows:
        print("\n| data | all-gather err | reduce-scatter err | all-reduce err | bytes ratio (AG / RS / AR) |")
        print("|---|---|---|---|---|")
        for row in collective_rows:
            errors = " | ".join(f"{row[k][0]:.2e}" for k in ("all_gather", "reduce_scatter", "all_reduce"))
            ratios = " / ".join(f"{row[k][1]:.2f}x" for k in ("all_gather", "reduce_scatter", "all_reduce"))
            print(f"| {row['data']} | {errors} | {ratios} |")
    if not runs:
        return
    print(f"\n{iters} iterations each. Loss: mean training loss of the last 10 iterations; valid: at the end.")
    print("| run | stream | wire MB/iter (raw) | ratio | codec err | train loss base -> ours | valid loss base -> ours "
          "| ms/iter base -> ours | codec ms/iter |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tag, r in runs.items():
        base, ours = r["base"], r["compressed"]
        streams = [k for k in ours if k.startswith(("tp_", "dp_"))] or ["-"]
        for stream in streams:
            s = ours.get(stream)
            traffic = (f"{s['wire_bytes'] / 1e6:.3f} ({s['raw_bytes'] / 1e6:.3f}) | {s['ratio']:.2f}x | "
                       f"{_fmt(s['rel_error'], '.1e')}") if s else "- | - | -"
            print(f"| {tag} ({' '.join(r['compressed_flags'])}) | {stream} | {traffic} | "
                  f"{base['train_loss']:.4f} -> {ours['train_loss']:.4f} | "
                  f"{_fmt(base['valid_loss'], '.4f')} -> {_fmt(ours['valid_loss'], '.4f')} | "
                  f"{base['ms_per_iteration']:.0f} -> {ours['ms_per_iteration']:.0f} | "
                  f"{ours['codec_ms_per_iteration']:.1f} |")
    memory = {tag: r["compressed"]["saved_memory"] for tag, r in runs.items() if r["compressed"]["saved_memory"]}
    if memory:
        print("\n| run | stage (global rank) | bits | peak saved-tensor MB without -> with LAAQ | saved |")
        print("|---|---|---|---|---|")
        for tag, stages in memory.items():
            for stage, m in sorted(stages.items()):
                print(f"| {tag} | {stage} | {m['bits']} | {m['raw_bytes'] / 1e6:.2f} -> {m['stored_bytes'] / 1e6:.2f} "
                      f"| {100 * m['saved']:.0f} % |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=["collectives", *RUNS], default=["collectives", *RUNS])
    parser.add_argument("--iters", type=int, default=60, help="training iterations per run")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "runs" / "places")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    collective_rows = measure_collectives() if "collectives" in args.only else []
    runs = measure_runs([p for p in RUNS if p in args.only], args.iters, args.out)
    summary = {"iterations": args.iters, "torch": torch.__version__, "collectives": collective_rows, "runs": runs}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print_tables(collective_rows, runs, args.iters)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
