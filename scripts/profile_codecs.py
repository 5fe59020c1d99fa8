#!/usr/bin/env python
"""Where a codec's encode/decode time goes on a GPU: kernels on the device vs the host launching them.

For each codec (fused Triton path) at one shape, after a warm-up:
  * ``wall``: CUDA-event time of one call, as ``scripts/bench_codecs.py`` measures it;
  * ``gpu``: the sum of the device kernels' durations in that call (torch.profiler), and the number
    of kernel launches. When ``wall`` is well above ``gpu`` the host (Python and launch latency) is
    the bottleneck, not the kernels;
  * ``graph``: CUDA-event time of the same call replayed as a CUDA graph (no host work per call);
    "-" when the call cannot be captured (a host sync on the path).

    python scripts/profile_codecs.py --shape 2048x8x8192 --json out.json

Needs a CUDA GPU; no megatron-core.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench_codecs import CODECS, make_pair, parse_shape  # noqa: E402
from megatron_tah.codecs.samples import activation_like  # noqa: E402


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


def graph_time_us(fn, iters: int) -> float | None:
    """Event time of ``fn`` replayed as a CUDA graph; None when it cannot be captured."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - report why, not fail the whole profile
        print(f"  (no CUDA graph: {type(error).__name__}: {str(error).splitlines()[0][:100]})")
        torch.cuda.synchronize()
        return None
    return event_time_us(graph.replay, iters)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=parse_shape, default=(2048, 8, 8192))
    parser.add_argument("--codecs", nargs="+", default=[k for k in CODECS if k not in ("none", "aqsgd")])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_codecs: needs a CUDA GPU")

    x = activation_like(args.shape, dtype=torch.bfloat16, seed=0).cuda()
    nbytes = x.numel() * x.element_size()
    copy_dst = torch.empty_like(x)
    copy_us = event_time_us(lambda: copy_dst.copy_(x), args.iters)
    print(f"{torch.cuda.get_device_name()}, shape {list(args.shape)} bf16, device copy {copy_us:.1f} us")
    print(f"{'codec':>20} {'op':>6} {'wall us':>9} {'gpu us':>9} {'launches':>8} {'graph us':>9} {'graph %copy':>11}")
    rows = []
    for label in args.codecs:
        name, config = CODECS[label]
        encode, decode = make_pair(name, config, "triton")
        out = torch.empty_like(x)
        buf = encode(x)
        decode(buf, out)
        wire = {"encode": buf}

        def run_encode():
            wire["encode"] = encode(x)

        ops = {"encode": run_encode, "decode": lambda: decode(buf, out)}
        for op, fn in ops.items():
            for _ in range(5):
                fn()
            wall = event_time_us(fn, args.iters)
            gpu, launches, per_kernel = kernel_times(fn)
            graph = graph_time_us(fn, args.iters)
            moved = nbytes + buf.numel()
            pct = 100 * (moved / graph) / (2 * nbytes / copy_us) if graph else None
            print(f"{label:>20} {op:>6} {wall:9.1f} {gpu:9.1f} {launches:8d} "
                  f"{(f'{graph:9.1f}' if graph else '        -')} {(f'{pct:10.0f}%' if pct else '          -')}")
            top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:4]
            print("      " + "; ".join(f"{k} {v:.1f}" for k, v in top))
            rows.append({"codec": label, "op": op, "wall_us": wall, "gpu_us": gpu, "launches": launches,
                         "graph_us": graph, "graph_pct_copy": pct, "kernels_us": per_kernel})
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "shape": list(args.shape),
                                         "copy_us": copy_us, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
