#!/usr/bin/env python
"""Predicted iteration time and speed-up of each codec for GPT-2 XL and a 7B-class GPT on H100s over slow links.

Writes the tables of docs/PERFORMANCE.md (between its ``<!-- tables -->`` markers; the model and its
sources are described there). Inputs, all stated in the output:

* compute: model FLOPs per iteration (Narayanan et al., SC'21: ``72 B s L h^2 (1 + s/(6h) + V/(12 L h))``
  without recomputation) at 47% MFU of an H100 SXM's 989 dense BF16 TFLOP/s (the Megatron-LM
  README's best published utilisation on H100), spread over the pipeline stages;
* bytes on the wire: ``codec.wire_nbytes`` of every micro-batch's ``[s, mb, h]`` message; the busiest
  link (a middle stage's egress) carries ``M (A + G)`` bytes per iteration;
* codec time: a **static bound** from ``scripts/kernel_report.py`` (sm_90 instructions per element at
  29.6e12 thread-instructions/s, or the bytes at 3.35 TB/s of HBM3, whichever is slower, per kernel)
  -- not a GPU measurement; launch overheads are not in it (the launch counts are listed).

    python scripts/performance_model.py               # compile what it needs (about 2 minutes), print
    python scripts/performance_model.py --write       # ... and update docs/PERFORMANCE.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from megatron_tah.codecs import get_codec  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "PERFORMANCE.md"
BEGIN, END = "<!-- tables:begin -->", "<!-- tables:end -->"

PEAK_FLOPS = 989e12  # H100 SXM dense BF16 (NVIDIA H100 datasheet)
MFU = 0.47  # best published Megatron-Core utilisation on H100 (NVIDIA/Megatron-LM README)
ISSUE_RATE = 29.6e12  # thread-instructions per second, H100 SXM
HBM_BYTES = 3.35e12  # H100 SXM HBM3 bandwidth (NVIDIA H100 datasheet)
RATES = (("100 Mbit/s", 100e6), ("1 Gbit/s", 1e9), ("10 Gbit/s", 10e9))


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    layers: int
    hidden: int
    seq: int
    vocab: int
    stages: int
    micro_batch: int
    micro_batches: int

    def flops(self) -> float:
        b = self.micro_batch * self.micro_batches
        s, h, L, V = self.seq, self.hidden, self.layers, self.vocab
        return 72 * b * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))

    def compute_seconds(self, mfu: float = MFU) -> float:
        return self.flops() / (self.stages * PEAK_FLOPS * mfu)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.seq, self.micro_batch, self.hidden)

    @property
    def params(self) -> float:
        return 12 * self.layers * self.hidden**2 + self.vocab * self.hidden


MODELS = [
    Model("GPT-2 XL", layers=48, hidden=1600, seq=1024, vocab=50257, stages=8, micro_batch=1, micro_batches=32),
    Model("7B-class GPT", layers=32, hidden=4096, seq=4096, vocab=32000, stages=4, micro_batch=1, micro_batches=16),
]

# label -> (forward codec, options, backward codec, options, pipeline dtype)
SETUPS = {
    "uncompressed fp32": ("none", {}, "none", {}, torch.float32),
    "uncompressed bf16": ("none", {}, "none", {}, torch.bfloat16),
    "TAH-Quant fwd + 6-bit bwd (default)": ("tah", {}, "fixedpoint", {"bits": 6, "tile_size": 32}, torch.bfloat16),
    "fixedpoint 4-bit fwd + 6-bit bwd": ("fixedpoint", {"bits": 4, "tile_size": 64}, "fixedpoint",
                                         {"bits": 6, "tile_size": 32}, torch.bfloat16),
    "fp8 both ways": ("fp8", {}, "fp8", {}, torch.bfloat16),
}
REPORT_CONFIGS = {"tah": "tah G64 4/3 token", ("fixedpoint", 6, 32): "fixedpoint G32 6b",
                  ("fixedpoint", 4, 64): "fixedpoint G64 4b", "fp8": "fp8 G128"}


def kernel_report(shape) -> list[dict]:
    """sm_90 results of scripts/kernel_report.py for the codecs above at ``shape`` (bf16)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "report.json"
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_report.py"), "--targets", "90",
                        "--configs", "model", "--shape", ",".join(map(str, shape)), "--json", str(out)],
                       check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["results"]


def codec_seconds(results: list[dict], config: str, elements: int, in_bytes: int, wire_bytes: int,
                  op: str) -> float:
    """Static time of one encode or decode: over its elementwise kernels, the slower of instructions and bytes."""
    seconds = 0.0
    for r in results:
        name = r["kernel"]
        if r["config"] != config or not r["per_element"]:
            continue
        if (op == "encode") != ("encode" in name or "partials" in name):
            continue
        share = 0.8 if " high " in name else 0.2 if " low " in name else 1.0  # tah: 80/20 of the tiles
        moved = (in_bytes if "partials" in name else in_bytes + wire_bytes) * share
        seconds += max(elements * share * r["per_element"] / ISSUE_RATE, moved / HBM_BYTES)
    return seconds


class _KernelCount(TorchDispatchMode):
    """Counts the torch ops that launch a kernel (views and allocations do not)."""

    FREE = {"view", "_unsafe_view", "slice", "select", "detach", "empty", "lift_fresh", "alias", "t", "expand",
            "as_strided", "reshape", "unsqueeze", "squeeze", "permute", "transpose"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in self.FREE:
            self.count += 1
        return func(*args, **(kwargs or {}))


def launches(codec, shape, dtype) -> int:
    """Kernel launches of one encode plus one decode on the pipeline's hot path (checks deferred), steady state."""
    from megatron_tah.kernels import common

    codec.defer_checks()
    x = torch.empty(shape, dtype=dtype, device="meta")
    out = torch.empty_like(x)
    with common.recording():
        codec.decode(codec.encode(x), shape, dtype, out=out)  # fills the per-shape caches
    counter = _KernelCount()
    with common.recording() as recorded, counter:
        codec.decode(codec.encode(x), shape, dtype, out=out)
    return counter.count + len(recorded)


def model_rows(model: Model) -> list[dict]:
    results = kernel_report(model.shape)
    elements = model.seq * model.micro_batch * model.hidden
    rows = []
    for label, (fwd, fwd_opts, bwd, bwd_opts, dtype) in SETUPS.items():
        row = {"setup": label, "launches": 0, "codec_s": 0.0, "bytes": 0}
        for name, options in ((fwd, fwd_opts), (bwd, bwd_opts)):
            codec = get_codec(name, **options)
            wire = codec.wire_nbytes(model.shape, dtype)
            row["bytes"] += model.micro_batches * wire
            if name == "none":
                continue
            key = name if name in ("tah", "fp8") else (name, options["bits"], options["tile_size"])
            for op in ("encode", "decode"):
                row["codec_s"] += model.micro_batches * codec_seconds(
                    results, REPORT_CONFIGS[key], elements, elements * dtype.itemsize, wire, op)
            row["launches"] += launches(get_codec(name, backend="triton", **options), model.shape, dtype)
        row["message_mb"] = (row["bytes"] / model.micro_batches / 2) / 1e6
        rows.append(row)
    return rows


def iteration_seconds(compute_s: float, link_bytes: float, rate_bps: float, codec_s: float) -> float:
    """The model's iteration time: a stage's compute, its busiest link's bytes at ``rate_bps`` and its
    codec time, added (the link and the codec are not overlapped with compute)."""
    return compute_s + link_bytes * 8 / rate_bps + codec_s


LOW_MFU = 0.25  # a sensitivity case: small models rarely reach the published best


def format_tables(models) -> str:
    out = []
    sensitivity = ["### Sensitivity: the same at 25% MFU (compute time x 1.88)", "",
                   "| model | setup | " + " | ".join(f"speed-up vs bf16 @ {name}" for name, _ in RATES) + " |",
                   "|---|---|" + "---:|" * len(RATES)]
    for model in models:
        rows = model_rows(model)
        slow = model.compute_seconds(LOW_MFU)
        bf16 = next(r for r in rows if r["setup"] == "uncompressed bf16")
        for row in rows:
            cells = []
            for _, rate in RATES:
                t_bf16 = iteration_seconds(slow, bf16["bytes"], rate, 0.0)
                cells.append(f"{t_bf16 / iteration_seconds(slow, row['bytes'], rate, row['codec_s']):.2f}x")
            sensitivity.append(f"| {model.name} | {row['setup']} | " + " | ".join(cells) + " |")
        c = model.compute_seconds()
        base = {name: None for name, _ in RATES}
        lines = [
            f"### {model.name}: L={model.layers}, h={model.hidden}, s={model.seq}, V={model.vocab} "
            f"(~{model.params / 1e9:.1f}B parameters), {model.stages} stages x 1 H100, micro-batch "
            f"{model.micro_batch}, {model.micro_batches} micro-batches per iteration",
            "",
            f"Compute per iteration: {model.flops() / 1e15:.1f} PFLOP -> **{c * 1e3:.0f} ms** at {MFU:.0%} MFU "
            f"on {model.stages} H100s.",
            "",
            "| setup | MB per message (fwd+bwd avg) | busiest link MB / iter | codec ms / iter (static) | "
            "launches / msg pair | " + " | ".join(f"iter s @ {name}" for name, _ in RATES) + " | "
            + " | ".join(f"speed-up vs bf16 @ {name}" for name, _ in RATES) + " |",
            "|---|---:|---:|---:|---:|" + "---:|" * (2 * len(RATES)),
        ]
        table = []
        for row in rows:
            times = [iteration_seconds(c, row["bytes"], rate, row["codec_s"]) for _, rate in RATES]
            table.append((row, times))
            if row["setup"] == "uncompressed bf16":
                base = dict(zip((n for n, _ in RATES), times))
        for row, times in table:
            speedups = [base[name] / t for (name, _), t in zip(RATES, times)]
            lines.append(f"| {row['setup']} | {row['message_mb']:.2f} | {row['bytes'] / 1e6:.1f} | "
                         f"{row['codec_s'] * 1e3:.2f} | {row['launches'] or '-'} | "
                         + " | ".join(f"{t:.3f}" for t in times) + " | "
                         + " | ".join(f"{s:.2f}x" for s in speedups) + " |")
        out.append("\n".join(lines))
    out.append("\n".join(sensitivity))
    return "\n\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"replace the tables in {DOC.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    tables = format_tables(MODELS)
    print(tables)
    if args.write:
        text = DOC.read_text()
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        DOC.write_text(f"{head}{BEGIN}\n{tables}\n{END}{tail}")
        print(f"updated {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
