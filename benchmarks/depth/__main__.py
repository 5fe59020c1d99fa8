"""``python -m benchmarks.depth``: where a codec's loss penalty comes from, by depth, direction, boundary and codec.

    python -m benchmarks.depth --write docs/DEPTH.md     # every study run missing under --out, then the page
    python -m benchmarks.depth --only paper_pp8,none     # some runs only

Every run is Megatron's loop (``megatron_tah.pretrain_gpt``) in one process with emulated pipeline boundaries
(``boundaries.py``): the speedrun's model (8 layers of hidden 128, bf16, untied embeddings, the compact-vocabulary
corpus, validation on fixed batches through the codecs) over a schedule of ``ITERS`` steps of 4 micro-batches
of 4 sequences, with the forward and backward codecs after the layers a pipeline of depth 2, 4 or 8 would split
at. A run's gap is its final validation loss minus the uncompressed run's with the same seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ..common.runner import host_info
from ..speedrun import runs as speedrun_runs

ITERS = 250
SIZE = dataclasses.replace(speedrun_runs.SIZES["full"], micro_batch=4, micro_batches=4, iters=ITERS, eval_interval=25,
                           eval_iters=8)
PP8, PP4, PP2 = "1,2,3,4,5,6,7", "2,4,6", "4"
PAPER = {"tah_preset": "paper"}


def fixedpoint(bits, tile=64, rounding=False):
    return {"tah_forward_codec": "fixedpoint", "tah_forward_bits": bits, "tah_tile_size": tile,
            "tah_stochastic_rounding": rounding}


def hadint(bits, rounding=False):
    return {"tah_forward_codec": "hadint", "tah_forward_bits": bits, "tah_tile_size": 64,
            "tah_stochastic_rounding": rounding}


def channel(bits):
    return {"tah_forward_codec": "channel", "tah_forward_bits": bits}


def backward(codec, bits, tile=32, rounding=True):
    fields = {"tah_backward_codec": codec, "tah_backward_bits": bits, "tah_backward_stochastic_rounding": rounding}
    return fields if codec == "channel" else {**fields, "tah_backward_tile_size": tile}


@dataclasses.dataclass(frozen=True)
class Study:
    name: str
    group: str
    label: str
    boundaries: str = ""
    forward: dict = dataclasses.field(default_factory=dict)
    backward: dict = dataclasses.field(default_factory=dict)
    seed: int = 1234
    per_boundary: dict = dataclasses.field(default_factory=dict)
    warmup_iters: int = 0
    hidden: int = SIZE.hidden


STUDIES = [
    Study("none", "depth", "uncompressed"),
    Study("none_s1235", "seeds", "uncompressed, seed 1235", seed=1235),
    Study("paper_pp2", "depth", "paper, PP 2", PP2, PAPER, PAPER),
    Study("paper_pp4", "depth", "paper, PP 4", PP4, PAPER, PAPER),
    Study("paper_pp8", "depth", "paper, PP 8", PP8, PAPER, PAPER),
    Study("paper_fwd_pp8", "direction", "paper's forward codec only, PP 8", PP8, PAPER),
    Study("paper_bwd_pp8", "direction", "paper's backward codec only, PP 8", PP8, {}, PAPER),
    Study("paper_fwd_b1", "boundary", "paper's forward codec at boundary 1 only", "1", PAPER),
    Study("paper_fwd_b4", "boundary", "paper's forward codec at boundary 4 only", "4", PAPER),
    Study("paper_fwd_b7", "boundary", "paper's forward codec at boundary 7 only", "7", PAPER),
    *[Study(f"fixedpoint{b}_pp8", "forward", f"fixedpoint {b}-bit, tile 64", PP8, fixedpoint(b)) for b in (8, 6, 5, 4)],
    Study("fixedpoint3_pp8", "forward", "fixedpoint 3-bit, tile 32", PP8, fixedpoint(3, 32)),
    *[Study(f"hadint{b}_pp8", "forward", f"hadint {b}-bit", PP8, hadint(b)) for b in (8, 6, 5, 4)],
    Study("hadint4sr_pp8", "forward", "hadint 4-bit, stochastic rounding", PP8, hadint(4, True)),
    Study("tah_norotation_pp8", "forward", "TAH-Quant without rotations", PP8,
          {"tah_forward_codec": "tah", "tah_outlier_threshold": float("inf")}),
    *[Study(f"channel{b}_pp8", "forward", f"channel {b}-bit", PP8, channel(b)) for b in (5, 4, 3)],
    Study("channel4_pp8_s1235", "seeds", "channel 4-bit, seed 1235", PP8, channel(4), seed=1235),
    Study("bwd_fixedpoint4sr_pp8", "backward", "fixedpoint 4-bit SR, tile 32", PP8, {}, backward("fixedpoint", 4)),
    Study("bwd_hadint3sr_pp8", "backward", "hadint 3-bit SR", PP8, {}, backward("hadint", 3, 64)),
    Study("bwd_fixedpoint2sr_pp8", "backward", "fixedpoint 2-bit SR, tile 128", PP8, {}, backward("fixedpoint", 2, 128)),
    *[Study(f"bwd_channel{b}sr_pp8", "backward", f"channel {b}-bit SR", PP8, {}, backward("channel", b)) for b in (3, 2)],
    Study("paper_warmup50_pp8", "remedy", "paper, first 50 steps uncompressed", PP8, PAPER, PAPER, warmup_iters=50),
    Study("paper_last4_6bit_pp8", "remedy", "paper, boundaries 4-7 at fixedpoint 6-bit", PP8, PAPER, PAPER,
          per_boundary={k: fixedpoint(6) for k in (4, 5, 6, 7)}),
    Study("channel4_fixedpoint4sr_pp8", "remedy", "channel 4-bit, fixedpoint 4-bit SR gradients", PP8, channel(4),
          backward("fixedpoint", 4)),
    Study("channel4_channel2sr_pp8", "remedy", "channel 4-bit, channel 2-bit SR gradients", PP8, channel(4),
          backward("channel", 2)),
    *[study for hidden in (256, 512) for study in (
        Study(f"none_h{hidden}", "width", f"uncompressed, hidden {hidden}", hidden=hidden),
        Study(f"paper_pp4_h{hidden}", "width", f"paper, PP 4, hidden {hidden}", PP4, PAPER, PAPER, hidden=hidden),
        Study(f"paper_pp8_h{hidden}", "width", f"paper, PP 8, hidden {hidden}", PP8, PAPER, PAPER, hidden=hidden))],
]


def command(study: Study, out: Path, data: list[str]) -> list[str]:
    size = dataclasses.replace(SIZE, hidden=study.hidden)
    flags = [*size.model_flags(ITERS), *data, "--seed", str(study.seed), "--eval-interval", str(SIZE.eval_interval),
             "--eval-iters", str(SIZE.eval_iters), "--fixed-validation", "--log-interval", str(SIZE.eval_interval),
             "--tah-log-json", str(out / f"{study.name}.jsonl"),
             "--transformer-impl", "local", "--distributed-backend", "gloo", "--no-gradient-accumulation-fusion",
             "--no-persist-layer-norm"]
    return [sys.executable, "-m", "benchmarks.depth.run", "--boundaries", study.boundaries,
            "--forward", json.dumps(study.forward), "--backward", json.dumps(study.backward),
            "--per-boundary", json.dumps(study.per_boundary), "--warmup-iters", str(study.warmup_iters),
            "--log", str(out / f"{study.name}.errors.jsonl"), "--", *flags]


def execute(studies: list[Study], out: Path, data: list[str], jobs: int) -> None:
    """Run the studies without a complete record under ``out``, ``jobs`` at a time (one process each,
    ``OMP_NUM_THREADS=1``)."""
    pending = [s for s in studies if not (out / f"{s.name}.done").is_file()]
    running: list[tuple[Study, subprocess.Popen, float]] = []
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    while pending or running:
        while pending and len(running) < jobs:
            study = pending.pop(0)
            for stale in (out / f"{study.name}.jsonl", out / f"{study.name}.errors.jsonl"):
                stale.unlink(missing_ok=True)
            log = open(out / f"{study.name}.log", "w")
            running.append((study, subprocess.Popen(command(study, out, data), stdout=log, stderr=subprocess.STDOUT,
                                                    env=env), time.time()))
            print(f"[depth] start {study.name}", flush=True)
        time.sleep(2)
        for item in list(running):
            study, proc, start = item
            if proc.poll() is None:
                continue
            running.remove(item)
            if proc.returncode != 0:
                raise RuntimeError(f"depth run {study.name} failed ({proc.returncode}); see {out / study.name}.log")
            (out / f"{study.name}.done").write_text(json.dumps({"seconds": time.time() - start}) + "\n")
            print(f"[depth] done  {study.name} in {time.time() - start:.0f} s", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.depth", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/depth"))
    parser.add_argument("--only", help="comma list of study names, run in that order (default: all)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--write", type=Path, help="write the page here (its JSON and plots under docs/data/)")
    args = parser.parse_args(argv)
    studies = STUDIES
    if args.only:
        names = [name for name in args.only.split(",") if name]
        by_name = {s.name: s for s in STUDIES}
        unknown = sorted(set(names) - set(by_name))
        if unknown:
            parser.error(f"--only: unknown studies {unknown}")
        studies = [by_name[name] for name in dict.fromkeys(names)]  # in the order given
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)

    prefix, vocab = speedrun_runs.prepare_data(out.parent / "speedrun", speedrun_runs.SIZES["full"])
    execute(studies, out, speedrun_runs.data_flags(prefix, vocab), args.jobs)
    if args.write:
        from .report import write_page

        write_page(STUDIES, out, args.write, host_info())
        print(f"[depth] wrote {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
