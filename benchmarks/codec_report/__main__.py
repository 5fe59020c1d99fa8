"""Codec comparison table: ``python -m benchmarks.codec_report [--shape S B H] [--dtype bf16] [--seed 0]``.

``--real [--models NAME ...] [--tokens N] [--docs DIR]``: instead, every codec and preset on hidden
states of real pretrained models (``benchmarks/codec_report/real.py``; writes ``docs/real_activations.md`` and ``docs/data/real_activations.*``).

Further options: ``--repeats N`` (timed runs, median; default 3), ``--device cuda``,
``--backend triton|auto`` (default ``torch``, the reference).

For one activation-like tensor (``samples.activation_like``, default ``[1024, 4, 4096]`` bf16)
prints, per codec: bits per element on the wire (16-byte header included), compression ratio
vs bf16 and vs fp32, relative error ``||x - decode(encode(x))|| / ||x||`` (in fp64) and the
median encode / decode time (torch reference on CPU unless ``--device``/``--backend`` say
otherwise; the first call is a warm-up and not timed).

aqsgd is stateful, so it is measured on a fresh sender/receiver pair with
``warmup_samples=0`` and sample ids ``0..b-1``: the *first visit* row is the first message
(a delta against ``m = 0``, i.e. fixedpoint 4-bit/64 plus the ids), the *revisit* row is the
same tensor sent again for the same ids (a delta against the ``m`` the first message left);
its times are those of the revisit message, including each end's buffer update.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from typing import Callable, Sequence

import torch

from megatron_tah.codecs import get_codec, load_all_codecs
from megatron_tah.codecs.core.samples import activation_like

from ..common.codec_rows import AQSGD_OPTIONS, STATELESS_ROWS, stateless_rows  # noqa: F401  (STATELESS_ROWS re-exported)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}



@dataclasses.dataclass
class Row:
    label: str
    nbytes: int
    bits_per_element: float
    rel_error: float
    encode_ms: float
    decode_ms: float

    @property
    def ratio_bf16(self) -> float:
        return 16.0 / self.bits_per_element

    @property
    def ratio_fp32(self) -> float:
        return 32.0 / self.bits_per_element


def relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    x64 = x.double()
    return ((y.double() - x64).norm() / x64.norm()).item()


def _timed(fn: Callable[[], object], device: torch.device) -> tuple[object, float]:
    """``fn()`` and its wall time in ms (synchronised on CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, 1e3 * (time.perf_counter() - start)


def _median_ms(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    return statistics.median(_timed(fn, device)[1] for _ in range(repeats))


def measure_stateless(label, name, options, x, repeats, backend) -> Row:
    codec = get_codec(name, backend=backend, **options)
    buf = codec.encode(x)
    y = codec.decode(buf, x.shape, x.dtype)
    if buf.numel() != codec.wire_nbytes(x.shape, x.dtype):
        raise RuntimeError(f"{label}: encode gave {buf.numel()} bytes, wire_nbytes says "
                           f"{codec.wire_nbytes(x.shape, x.dtype)}")
    enc = _median_ms(lambda: codec.encode(x), repeats, x.device)
    dec = _median_ms(lambda: codec.decode(buf, x.shape, x.dtype), repeats, x.device)
    return Row(label, buf.numel(), codec.bits_per_element(buf.numel(), x.shape), relative_error(x, y), enc, dec)


def measure_aqsgd(x, repeats, backend) -> tuple[list[Row], int]:
    """The first-visit and revisit rows, and the bytes one link end's buffer holds."""
    ids = torch.arange(x.shape[1], device=x.device)
    enc_times, dec_times = [], []
    for attempt in range(repeats + 1):  # a fresh pair each time; attempt 0 is a warm-up
        sender, receiver = (get_codec("aqsgd", backend=backend, **AQSGD_OPTIONS) for _ in range(2))
        first = sender.encode(x, sample_ids=ids)
        y_first = receiver.decode(first, x.shape, x.dtype)
        again, enc_ms = _timed(lambda: sender.encode(x, sample_ids=ids), x.device)
        y_again, dec_ms = _timed(lambda: receiver.decode(again, x.shape, x.dtype), x.device)
        if attempt:
            enc_times.append(enc_ms)
            dec_times.append(dec_ms)
    bits = sender.bits_per_element
    rows = [
        Row("aqsgd 4b/64 first visit", first.numel(), bits(first.numel(), x.shape), relative_error(x, y_first),
            math.nan, math.nan),
        Row("aqsgd 4b/64 revisit", again.numel(), bits(again.numel(), x.shape), relative_error(x, y_again),
            statistics.median(enc_times), statistics.median(dec_times)),
    ]
    return rows, receiver.buffer_nbytes()


def measure(shape: Sequence[int] = (1024, 4, 4096), dtype: torch.dtype = torch.bfloat16, seed: int = 0,
            repeats: int = 3, device: str = "cpu", backend: str = "torch") -> tuple[list[Row], int]:
    """Every row of the table, and the aqsgd buffer size per link end in bytes."""
    if len(shape) != 3:
        raise ValueError(f"--shape takes three sizes S B H, got {list(shape)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    load_all_codecs()
    x = activation_like(tuple(shape), dtype, seed=seed, device=device)
    rows = [measure_stateless(label, name, options, x, repeats, backend) for label, name, options in stateless_rows()]
    aqsgd_rows, buffer_nbytes = measure_aqsgd(x, repeats, backend)
    return rows + aqsgd_rows, buffer_nbytes


def format_table(rows: list[Row]) -> str:
    header = ("codec", "bits/elem", "vs bf16", "vs fp32", "rel. error", "encode ms", "decode ms")
    lines = [header]
    for r in rows:
        lines.append((r.label, f"{r.bits_per_element:.3f}", f"{r.ratio_bf16:.2f}x", f"{r.ratio_fp32:.2f}x",
                      f"{r.rel_error:.2e}", _ms(r.encode_ms), _ms(r.decode_ms)))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
            for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.codec_report", description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs=3, default=[1024, 4, 4096], metavar=("S", "B", "H"))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", choices=("torch", "triton", "auto"), default="torch")
    parser.add_argument("--real", action="store_true", help="measure on real models' hidden states instead")
    parser.add_argument("--models", nargs="+", default=None, help="--real: model names (default: all)")
    parser.add_argument("--tokens", type=int, default=1024, help="--real: tokens per message")
    parser.add_argument("--docs", default="docs", help="--real: folder of the outputs")
    args = parser.parse_args(argv)
    if args.real:
        from pathlib import Path

        from ..common import real_activations
        from . import real as real_report

        models = args.models or list(real_activations.MODELS)
        unknown = sorted(set(models) - set(real_activations.MODELS))
        if unknown:
            parser.error(f"unknown model(s) {unknown}: choose from {sorted(real_activations.MODELS)}")
        return real_report.main(models, args.tokens, Path(args.docs))
    dtype = DTYPES[args.dtype]
    rows, buffer_nbytes = measure(args.shape, dtype, args.seed, args.repeats, args.device, args.backend)
    s, b, h = args.shape
    print(f"shape [{s}, {b}, {h}] {args.dtype}, activation-like data (seed {args.seed}), "
          f"{args.backend} backend on {args.device}, median of {args.repeats}")
    print(format_table(rows))
    print(f"aqsgd: fresh sender/receiver, warmup_samples=0, ids 0..{b - 1}; first visit = delta against m=0; "
          f"revisit = the same tensor again (delta against m); each link end then holds "
          f"{buffer_nbytes / 2**20:.1f} MiB of buffer ({b} samples x {s} x {h} fp32).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
