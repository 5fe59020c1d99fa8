#!/usr/bin/env python
"""What ``--tah-forward-codec auto`` would pick per direction at a message shape and a few link rates.

Measures the default candidates' encode/decode seconds, wire bytes and round-trip error on this
machine (``megatron_tah.link.measure.CodecCostTable``), then asks a fresh ``Chooser`` at
each rate (one measurement, no hysteresis history). Prints one table per direction.

    OMP_NUM_THREADS=1 python scripts/auto_choice.py                  # the demo's [64, 4, 128] bf16
    python scripts/auto_choice.py --shape 1024,1,1600 --device cuda  # CUDA events instead of wall time

On a CPU shared with other processes, leave OMP_NUM_THREADS at 1: torch's worker threads then
dominate small codec calls (measured here: ``none`` encode 10-30 ms instead of 0.02 ms).
"""

from __future__ import annotations

import argparse

import torch

from megatron_tah.config import AutoSettings
from megatron_tah.link.choice import Chooser
from megatron_tah.link.measure import CodecCostTable
from megatron_tah.units import parse_bandwidth


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="64,4,128", help="message shape [s,b,h] (default: the demo's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rates", default="1mbit,100mbit,1gbit,10gbit,1000tbit", help="link rates to ask about")
    p.add_argument("--calls", type=int, default=5, help="timed calls per candidate (the fastest counts)")
    args = p.parse_args()
    shape = tuple(int(d) for d in args.shape.split(","))
    settings = AutoSettings()
    for direction in ("forward", "backward"):
        table = CodecCostTable.for_direction(settings, direction, shape, torch.bfloat16, args.device,
                                             calls=args.calls)
        print(f"{direction} {list(shape)} bf16 on {args.device}")
        for cost in table.costs.values():
            print(f"  {cost.name:8s} encode {cost.encode_s * 1e3:8.3f} ms  decode {cost.decode_s * 1e3:8.3f} ms  "
                  f"{cost.wire_nbytes:9d} B  error {cost.error:.4f}")
        for rate in args.rates.split(","):
            chooser = Chooser(table, settings)
            print(f"  at {rate:>9s}: {chooser.update(parse_bandwidth(rate))}  (error floor {chooser.floor():.4f})")


if __name__ == "__main__":
    main()
