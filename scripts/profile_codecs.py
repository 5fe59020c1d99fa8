#!/usr/bin/env python
"""Where a codec's encode/decode time goes on a GPU: the host launching kernels vs the device running them.

For each codec (fused Triton path, deferred checks) at one shape, after a warm-up, per call and for two
paths, ``eager`` (the codec's own call) and ``graph`` (``megatron_tah.codecs.core.graphs.place_codec``, the
``GraphedCodec`` the pipeline's links and the TP/DP collectives call: the call replayed from a CUDA graph,
its input and output copies included):
  * ``host``: microseconds the host spends in the call (perf_counter, the device idle beforehand);
  * ``device``: CUDA-event time of the call on the stream, as ``scripts/bench_codecs.py`` measures it.
    When eager ``device`` is close to ``host`` the host (Python, launch latency) is the bottleneck;
  * ``gpu``/``launches``: the device kernels' summed durations and count in one eager call (torch.profiler);
  * ``%copy``: the graph path's bytes moved per second against a device copy of the input.
A path that cannot be replayed prints "-" and GraphedCodec's one log line says why.

    python scripts/profile_codecs.py --shape 1024x1x1600 --json out.json

Needs a CUDA GPU; no megatron-core.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench_codecs import CODECS, parse_shape  # noqa: E402
from megatron_tah.codecs import get_codec  # noqa: E402
from megatron_tah.codecs.core.graphs import place_codec  # noqa: E402
from megatron_tah.codecs.core.samples import activation_like  # noqa: E402


def event_time_us(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def kernel_times(fn) -> tuple[float, int, dict[str, float]]:
    """Total device-kernel microseconds, launch count and per-kernel time for one call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = collections.defaultdict(float)
    launches = 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            duration = getattr(event, "device_time", None) or event.cuda_time
            per_kernel[event.name[:60]] += duration
            launches += 1
    return sum(per_kernel.values()), launches, dict(per_kernel)


def host_time_us(fn, iters: int) -> float:
    """Median host microseconds of one call of ``fn``, the device idle before each (no sync inside the timing)."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--shape", type=parse_shape, default=(1024, 1, 1600))
    parser.add_argument("--codecs", nargs="+", default=[k for k in CODECS if k not in ("none", "aqsgd")],
                        choices=sorted(CODECS), metavar="CODEC", help=f"of {', '.join(CODECS)}")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args(argv)
    if args.iters < 1:
        parser.error(f"--iters must be at least 1, got {args.iters}")
    return args


HEADER = (f"{'codec':>20} {'op':>6} {'eager host':>10} {'eager dev':>9} {'gpu us':>8} {'launches':>8} "
          f"{'graph host':>10} {'graph dev':>9} {'%copy':>6}")


def format_row(row: dict) -> str:
    """One line of the table (microseconds; "-" where a path did not run)."""
    def cell(value, width, spec=".1f"):
        return f"{value:{width}{spec}}" if value is not None else f"{'-':>{width}}"

    return (f"{row['codec']:>20} {row['op']:>6} {cell(row['eager_host_us'], 10)} {cell(row['eager_device_us'], 9)} "
            f"{cell(row['gpu_us'], 8)} {cell(row['launches'], 8, 'd')} {cell(row['graph_host_us'], 10)} "
            f"{cell(row['graph_device_us'], 9)} {cell(row['graph_pct_copy'], 5, '.0f')}{'%' if row['graph_pct_copy'] else ' '}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_codecs: needs a CUDA GPU")
    logging.basicConfig(level=logging.INFO, format="  %(message)s")

    x = activation_like(args.shape, dtype=torch.bfloat16, seed=0).cuda()
    nbytes = x.numel() * x.element_size()
    copy_dst = torch.empty_like(x)
    copy_us = event_time_us(lambda: copy_dst.copy_(x), args.iters)
    print(f"{torch.cuda.get_device_name()}, shape {list(args.shape)} bf16, device copy {copy_us:.1f} us")
    print(HEADER)
    rows = []
    for label in args.codecs:
        name, config = CODECS[label]
        if name == "aqsgd":
            print(f"{label:>20}: needs sample ids (bench_codecs.py times it); not capturable")
            continue
        codec = place_codec(get_codec(name, backend="triton", **config), eager=True)
        graphed = place_codec(get_codec(name, backend="triton", **config))  # as the pipeline's links and TP/DP
        out = torch.empty_like(x)
        buf = codec.encode(x)
        paths = {
            "encode": (lambda: codec.encode(x), lambda: graphed.encode(x)),
            "decode": (lambda: codec.decode(buf, x.shape, x.dtype, out=out),
                       lambda: graphed.decode(buf, x.shape, x.dtype, out=out)),
        }
        for op, (eager, graph) in paths.items():
            for _ in range(5):
                eager()
                graph()
            key = (op, tuple(x.shape), x.dtype, str(x.device))
            replayed = key in graphed.captured
            gpu, launches, per_kernel = kernel_times(eager)
            row = {"codec": label, "op": op, "eager_host_us": host_time_us(eager, args.iters),
                   "eager_device_us": event_time_us(eager, args.iters), "gpu_us": gpu, "launches": launches,
                   "graph_host_us": host_time_us(graph, args.iters) if replayed else None,
                   "graph_device_us": event_time_us(graph, args.iters) if replayed else None,
                   "graph_eager_reason": graphed.eager_reasons.get(key), "kernels_us": per_kernel}
            moved = nbytes + buf.numel()
            row["graph_pct_copy"] = (100 * (moved / row["graph_device_us"]) / (2 * nbytes / copy_us)
                                     if replayed else None)
            print(format_row(row))
            top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:4]
            print("      " + "; ".join(f"{k} {v:.1f}" for k, v in top))
            rows.append(row)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "shape": list(args.shape),
                                         "copy_us": copy_us, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
