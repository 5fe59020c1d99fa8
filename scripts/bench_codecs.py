#!/usr/bin/env python
"""Time every codec's encode and decode (fused Triton path and torch reference) beside a device copy.

For each shape (bf16 ``[s, b, h]`` pipeline tensors by default) and codec, runs encode then
decode of the same message many times over a pool of distinct inputs (larger than twice the
GPU's L2 cache, so the cache is not what is measured), after a warm-up, and reports the median
of each: microseconds, effective GB/s (bytes read + bytes written: input + wire for encode,
wire + output for decode), that bandwidth as a % of a device-to-device copy of the input, and
the speed-up over the codec's own torch reference. Decodes run as the pipeline runs them: into a
preallocated output, with the header checked on the device (``Codec.defer_checks``). The table
is printed, and written as JSON (device name, date, versions) and Markdown.

``--checksum`` also times every codec with the payload checksum on (``Codec(checksum=True)``,
``--tah-wire-checksum``), and the checksum's own work on the codec's buffer: the sender's (compute it,
write the header field) and the receiver's (compute it, compare on the device). Its cost is that work
over the codec's encode + decode time without it, the number the option's default is decided by
(on when under 2%; see ``codecs/core/checksum.py``).

    python scripts/bench_codecs.py                       # CUDA, the default shapes -> docs/benchmarks/<gpu>.json
    python scripts/bench_codecs.py --device cpu --quick  # smoke test: tiny shapes, wall-clock timer
    python scripts/bench_codecs.py --device cpu --checksum --backends torch --shapes 64x4x128 1024x1x1600

On CUDA the timer is CUDA events; on CPU ``time.perf_counter`` (the Triton path runs there
only under TRITON_INTERPRET=1, and its timings then mean nothing). No megatron-core needed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import platform
import re
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from megatron_tah.codecs import CodecError, get_codec  # noqa: E402
from megatron_tah.codecs.core.samples import activation_like  # noqa: E402

# The large message, the demo's (make demo: seq 64, micro-batch 4, hidden 128), GPT2-XL (seq 1024, mb 1).
SHAPES = [(2048, 8, 8192), (64, 4, 128), (1024, 1, 1600)]
QUICK_SHAPES = [(64, 1, 256), (32, 2, 320)]
# label -> (codec name, config); aqsgd is timed with a sender and a receiver object in step.
CODECS = {
    "none": ("none", {}),
    "fixedpoint-b6-g32": ("fixedpoint", {"bits": 6, "tile_size": 32}),
    "fixedpoint-b4-g64": ("fixedpoint", {"bits": 4, "tile_size": 64}),
    "tah": ("tah", {}),
    "tah-tile": ("tah", {"allocation": "tile"}),
    "tah-g128": ("tah", {"tile_size": 128}),
    "fp8": ("fp8", {"group_size": 128}),
    "hadint-b4-g64": ("hadint", {"bits": 4, "tile_size": 64}),
    "hadint-b4-g64-sr": ("hadint", {"bits": 4, "tile_size": 64, "stochastic_rounding": True}),
    "lowrank-r16-c6-b3": ("lowrank", {"bits": 3, "tile_size": 64, "rank": 16, "coef_bits": 6}),
    "aqsgd": ("aqsgd", {"bits": 4, "tile_size": 64}),
}
DEFAULT_L2_BYTES = 50 << 20


class Timer:
    """Marks on a timeline: CUDA events on a GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def elapsed_us(self, start, end) -> float:
        return start.elapsed_time(end) * 1e3 if self.cuda else (end - start) * 1e6


def input_pool(shape, dtype, device, l2_bytes: int, max_count: int) -> list[torch.Tensor]:
    """Distinct activation-like inputs whose total size exceeds twice the L2 cache (at least 2)."""
    base = activation_like(shape, dtype=dtype, seed=0).to(device)
    nbytes = base.numel() * base.element_size()
    count = max(2, min(max_count, math.ceil(2 * l2_bytes / nbytes)))
    return [base] + [torch.roll(base, shifts=i, dims=0) for i in range(1, count)]


def time_copy(pool, timer, warmup, iters) -> float:
    dst = torch.empty_like(pool[0])
    for i in range(warmup):
        dst.copy_(pool[i % len(pool)])
    timer.sync()
    marks = []
    for i in range(iters):
        start = timer.mark()
        dst.copy_(pool[i % len(pool)])
        marks.append((start, timer.mark()))
    timer.sync()
    return statistics.median(timer.elapsed_us(a, b) for a, b in marks)


def make_pair(name, config, backend, checksum=False):
    """(encode(x) -> buf, decode(buf, out) -> out) for one codec and backend, as the pipeline calls them."""
    sender = get_codec(name, backend=backend, checksum=checksum, **config)
    receiver = get_codec(name, backend=backend, checksum=checksum, **config) if name == "aqsgd" else sender
    receiver.defer_checks()
    if name != "aqsgd":
        return sender.encode, lambda buf, out: receiver.decode(buf, out.shape, out.dtype, out=out)
    ids = {}

    def encode(x):
        key = (x.shape[1], x.device)
        if key not in ids:
            ids[key] = torch.arange(x.shape[1], device=x.device)
        return sender.encode(x, sample_ids=ids[key])

    return encode, lambda buf, out: receiver.decode(buf, out.shape, out.dtype, out=out)


def time_codec(name, config, backend, pool, timer, warmup, iters, checksum=False) -> tuple[float, float, int]:
    """Median encode and decode microseconds, and the wire size in bytes."""
    encode, decode = make_pair(name, config, backend, checksum)
    out = torch.empty_like(pool[0])
    for i in range(warmup):
        decode(encode(pool[i % len(pool)]), out)
    timer.sync()
    marks = []
    for i in range(iters):
        start = timer.mark()
        buf = encode(pool[i % len(pool)])
        mid = timer.mark()
        decode(buf, out)
        marks.append((start, mid, timer.mark()))
    timer.sync()
    enc = statistics.median(timer.elapsed_us(a, b) for a, b, _ in marks)
    dec = statistics.median(timer.elapsed_us(b, c) for _, b, c in marks)
    return enc, dec, buf.numel()


def time_checksum(name, config, backend, pool, timer, warmup, iters) -> tuple[float, float]:
    """Median microseconds of the checksum's work on one of the codec's buffers: the sender's
    (``write_checksum``) and the receiver's deferred check (``checksum_mismatch``)."""
    encode, _ = make_pair(name, config, backend, checksum=True)
    codec = get_codec(name, backend=backend, checksum=True, **config)
    bufs = [encode(x) for x in pool[: max(2, min(len(pool), 8))]]
    for i in range(warmup):
        codec.write_checksum(bufs[i % len(bufs)])
        codec.checksum_mismatch(bufs[i % len(bufs)])
    timer.sync()
    marks = []
    for i in range(iters):
        buf = bufs[i % len(bufs)]
        start = timer.mark()
        codec.write_checksum(buf)
        mid = timer.mark()
        codec.checksum_mismatch(buf)
        marks.append((start, mid, timer.mark()))
    timer.sync()
    return (statistics.median(timer.elapsed_us(a, b) for a, b, _ in marks),
            statistics.median(timer.elapsed_us(b, c) for _, b, c in marks))


def checksum_rows(shape, label, name, config, backend, measured, pool, timer, warmup, iters,
                  checksum_iters) -> list[dict]:
    """Rows of the codec with the checksum on, and of the checksum's own cost (% of encode + decode without it)."""
    enc_off, dec_off, wire = measured
    enc_on, dec_on, _ = time_codec(name, config, backend, pool, timer, warmup, iters, checksum=True)
    write_us, check_us = time_checksum(name, config, backend, pool, timer, warmup, checksum_iters)
    codec_us = enc_off + dec_off
    common = dict(shape=list(shape), codec=label, backend=backend, wire_bytes=wire, speedup_vs_torch=None,
                  bits_per_element=8.0 * wire / pool[0].numel(), checksum=True)
    return [dict(common, op="encode", us=enc_on, pct_of_codec=100.0 * (enc_on - enc_off) / enc_off),
            dict(common, op="decode", us=dec_on, pct_of_codec=100.0 * (dec_on - dec_off) / dec_off),
            dict(common, op="checksum-write", us=write_us, pct_of_codec=100.0 * write_us / codec_us),
            dict(common, op="checksum-check", us=check_us, pct_of_codec=100.0 * check_us / codec_us),
            dict(common, op="checksum-cost", us=write_us + check_us, codec_us=codec_us,
                 with_checksum_us=enc_on + dec_on, pct_of_codec=100.0 * (write_us + check_us) / codec_us)]


def gbps(nbytes: int, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e9 if us > 0 else float("nan")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def triton_available_on(device: torch.device) -> bool:
    from megatron_tah.kernels.common import kernel_device

    return kernel_device() == device.type


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must look like 4096x1x4096, got {text!r}") from None
    if len(shape) != 3 or min(shape) <= 0:
        raise argparse.ArgumentTypeError(f"shape must be three positive sizes s x b x h, got {text!r}")
    return shape


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda (CUDA events) or cpu (perf_counter; a smoke test, not a measurement)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few runs (a smoke test)")
    parser.add_argument("--shapes", type=parse_shape, nargs="+", help="shapes like 4096x1x4096 (default: see SHAPES)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--codecs", nargs="+", choices=list(CODECS), default=list(CODECS))
    parser.add_argument("--backends", nargs="+", choices=["triton", "torch"], default=["triton", "torch"])
    parser.add_argument("--warmup", type=int, help="untimed runs per measurement (default 10; quick: 2)")
    parser.add_argument("--iters", type=int, help="timed runs per Triton/copy measurement (default 50; quick: 5)")
    parser.add_argument("--ref-iters", type=int, default=5, help="timed runs per torch-reference measurement")
    parser.add_argument("--max-pool", type=int, default=64, help="most distinct inputs per shape")
    parser.add_argument("--checksum", action="store_true",
                        help="also time each codec with the payload checksum on, and the checksum's own cost")
    parser.add_argument("--out", type=pathlib.Path,
                        help="JSON report (default docs/benchmarks/<gpu>.json on CUDA, runs/bench_codecs.json on CPU)")
    parser.add_argument("--markdown", type=pathlib.Path, help="Markdown table (default: the JSON path with .md)")
    args = parser.parse_args(argv)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 10)
    args.iters = args.iters if args.iters is not None else (5 if args.quick else 50)
    if args.warmup < 0 or args.iters < 1 or args.ref_iters < 1:
        parser.error(f"--warmup must be >= 0 and --iters, --ref-iters >= 1, got {args.warmup}, {args.iters}, "
                     f"{args.ref_iters}")
    args.shapes = args.shapes or (QUICK_SHAPES if args.quick else SHAPES)
    return args


def run(args) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device here; use --device cpu --quick for a smoke test")
    dtype = getattr(torch, args.dtype)
    backends = [b for b in args.backends if b == "torch" or triton_available_on(device)]
    if "triton" in args.backends and "triton" not in backends:
        print(f"note: the Triton path cannot run on {device.type} here (needs CUDA or TRITON_INTERPRET=1); "
              "timing the torch reference only", file=sys.stderr)
    l2_bytes = DEFAULT_L2_BYTES
    if device.type == "cuda":
        l2_bytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", DEFAULT_L2_BYTES)
    timer = Timer(device)
    rows = []
    for shape in args.shapes:
        pool = input_pool(shape, dtype, device, l2_bytes, args.max_pool)
        in_bytes = pool[0].numel() * pool[0].element_size()
        copy_us = time_copy(pool, timer, args.warmup, args.iters)
        copy_gbps = gbps(2 * in_bytes, copy_us)
        rows.append(dict(shape=list(shape), codec="copy", backend="torch", op="copy", us=copy_us,
                         gbps=copy_gbps, pct_copy=100.0, speedup_vs_torch=None, wire_bytes=in_bytes,
                         bits_per_element=8.0 * in_bytes / pool[0].numel()))
        for label in args.codecs:
            name, config = CODECS[label]
            measured = {}
            for backend in backends:
                iters = args.iters if backend == "triton" else args.ref_iters
                warmup = args.warmup if backend == "triton" else min(args.warmup, 2)
                try:
                    measured[backend] = time_codec(name, config, backend, pool, timer, warmup, iters)
                except CodecError as err:
                    if "no Triton path" not in str(err):
                        raise
                    continue  # e.g. none: a copy, nothing to fuse
            for backend, (enc_us, dec_us, wire) in measured.items():
                for op, us in (("encode", enc_us), ("decode", dec_us)):
                    rate = gbps(in_bytes + wire, us)
                    ref = measured.get("torch")
                    ref_us = None if ref is None else ref[0 if op == "encode" else 1]
                    rows.append(dict(shape=list(shape), codec=label, backend=backend, op=op, us=us, gbps=rate,
                                     pct_copy=100.0 * rate / copy_gbps,
                                     speedup_vs_torch=None if ref_us is None else ref_us / us,
                                     wire_bytes=wire, bits_per_element=8.0 * wire / pool[0].numel(),
                                     checksum=False))
                if args.checksum:
                    iters = args.iters if backend == "triton" else args.ref_iters
                    warmup = args.warmup if backend == "triton" else min(args.warmup, 2)
                    rows += checksum_rows(shape, label, name, CODECS[label][1], backend, measured[backend], pool,
                                          timer, warmup, iters, args.iters)
        del pool
    return {
        "device": device_name(device),
        "device_type": device.type,
        "timer": "cuda events" if device.type == "cuda" else "perf_counter",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "dtype": args.dtype,
        "warmup": args.warmup,
        "iters": args.iters,
        "ref_iters": args.ref_iters,
        "statistic": "median",
        "results": rows,
    }


def versions() -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "cuda": torch.version.cuda}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def _speedup(value) -> str:
    return "-" if value is None else f"{value:.1f}x"


def format_table(report: dict) -> str:
    header = (f"{'shape':>16} {'codec':>18} {'backend':>7} {'op':>6} {'us':>10} {'GB/s':>8} {'% copy':>7} "
              f"{'x torch':>8} {'bits/el':>7}")
    lines = [f"{report['device']} ({report['timer']}, median, {report['dtype']})", header]
    for row in report["results"]:
        if row.get("checksum"):
            continue
        shape = "x".join(str(d) for d in row["shape"])
        lines.append(f"{shape:>16} {row['codec']:>18} {row['backend']:>7} {row['op']:>6} {row['us']:>10.1f} "
                     f"{row['gbps']:>8.1f} {row['pct_copy']:>7.1f} {_speedup(row['speedup_vs_torch']):>8} "
                     f"{row['bits_per_element']:>7.2f}")
    costs = [row for row in report["results"] if row.get("checksum")]
    if costs:
        lines += ["", "payload checksum: codec us without / with it (encode + decode), the checksum's own us "
                  "(sender + receiver) and that as % of the codec's time",
                  f"{'shape':>16} {'codec':>18} {'backend':>7} {'codec us':>10} {'with us':>10} {'sum us':>8} "
                  f"{'cost %':>7}"]
        for row in costs:
            if row["op"] == "checksum-cost":
                shape = "x".join(str(d) for d in row["shape"])
                lines.append(f"{shape:>16} {row['codec']:>18} {row['backend']:>7} {row['codec_us']:>10.1f} "
                             f"{row['with_checksum_us']:>10.1f} {row['us']:>8.1f} {row['pct_of_codec']:>7.2f}")
    return "\n".join(lines)


def format_markdown(report: dict) -> str:
    """One row per shape and codec (Triton path): encode and decode GB/s, % of a device copy, x the torch reference."""
    lines = [f"# Codec throughput on {report['device']}", "",
             f"{report['date']}; torch {report['versions']['torch']}, Triton {report['versions']['triton']}, "
             f"CUDA {report['versions']['cuda']}; {report['dtype']} inputs; {report['timer']}, median of "
             f"{report['iters']} (torch reference: {report['ref_iters']}). GB/s = (input + wire bytes) / time; "
             "% copy = that rate over a device-to-device copy's (2 x input bytes / time).", "",
             "| shape | codec | bits/el | encode us | encode GB/s | % copy | x torch | decode us | decode GB/s | "
             "% copy | x torch |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    rows = {}
    for row in report["results"]:
        if row.get("checksum"):
            continue
        if row["backend"] == "triton" or row["codec"] == "copy":
            rows.setdefault((tuple(row["shape"]), row["codec"]), {})[row["op"]] = row
    for (shape, codec), ops in rows.items():
        name = "x".join(map(str, shape))
        if codec == "copy":
            c = ops["copy"]
            lines.append(f"| {name} | device copy | {c['bits_per_element']:.2f} | {c['us']:.1f} | {c['gbps']:.0f} | "
                         "100 | - | | | | |")
            continue
        e, d = ops["encode"], ops["decode"]
        lines.append(f"| {name} | {codec} | {e['bits_per_element']:.2f} | {e['us']:.1f} | {e['gbps']:.0f} | "
                     f"{e['pct_copy']:.0f} | {_speedup(e['speedup_vs_torch'])} | {d['us']:.1f} | {d['gbps']:.0f} | "
                     f"{d['pct_copy']:.0f} | {_speedup(d['speedup_vs_torch'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    report = run(args)
    print(format_table(report))
    out = args.out
    if out is None:
        out = (pathlib.Path("docs/benchmarks") / f"{slug(report['device'])}.json" if report["device_type"] == "cuda"
               else pathlib.Path("runs/bench_codecs.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    markdown = args.markdown or out.with_suffix(".md")
    markdown.write_text(format_markdown(report))
    print(f"wrote {out} and {markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
