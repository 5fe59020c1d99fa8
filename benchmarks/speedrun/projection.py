"""Projected seconds per step and time to target of each codec on the ProtocolNanoGPT setup.

The setup is the dense bf16 record's (``simulate.RECORDS[0]``): 8 stages, micro-batch 8 x 64,
sequence 1024, width 1024, 539 ms per step without the slow link, 200 Mb/s and 50 ms per message.
For each codec the messages are its exact ``wire_nbytes`` at ``[1024, 8, 1024]`` bf16, and its
encode / decode time is added to the compute where ``docs/benchmarks/<gpu>.json`` measured it
(``scripts/bench_codecs.py``): the sender's encode ends its forward (backward) before the message
is stamped, the receiver's decode starts its forward (backward). A shape that was not measured
takes the measurement at the nearest element count, scaled by the element-count ratio, and says
so. Steps = the bf16 record's 2925 x a steps multiplier per codec (default 1: at equal steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import math
import pathlib

import torch

from megatron_tah.codecs import get_codec
from megatron_tah.config import TahConfig

from . import simulate
from ..common.codecs import CODECS as RUN_CODECS
from ..common.codecs import NEEDS_LINK, ONE_DIRECTION, busiest_nbytes, entropy_coded

ROOT = pathlib.Path(__file__).resolve().parents[2]
MEASUREMENTS = ROOT / "docs" / "benchmarks" / "nvidia-h100-80gb-hbm3.json"
SETUP = simulate.RECORDS[0]  # dense bf16: the setup every codec is projected onto
HIDDEN = 1024
SHAPE = (SETUP.seq, SETUP.micro_batch, HIDDEN)

# name -> TahConfig fields: the speedrun's codecs (``common.codecs.CODECS``; "none" is its bf16, megatron_tah's uncompressed
# path: raw bf16 behind a 16-byte header) but those that choose per link and those entropy-coded (their bytes are
# measured, not known at this shape: docs/CODECS.md projects the coder from real messages) and the one-direction
# measurements
CODECS = {"none": {}, **{name: fields for name, fields in RUN_CODECS.items()
                         if name != "bf16" and name not in NEEDS_LINK + ONE_DIRECTION and not entropy_coded(name)}}


@dataclasses.dataclass(frozen=True)
class CodecTime:
    """Encode and decode seconds of one message, and where the numbers come from."""

    encode_s: float
    decode_s: float
    source: str


@functools.lru_cache(maxsize=1)
def _bench_labels() -> dict:
    """``scripts/bench_codecs.py``'s label -> (codec name, options): the names its JSON rows carry."""
    spec = importlib.util.spec_from_file_location("_bench_codecs", ROOT / "scripts" / "bench_codecs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CODECS


def measured_label(codec) -> str | None:
    """The benchmark label whose codec has ``codec``'s name and options, if there is one."""
    for label, (name, options) in _bench_labels().items():
        if name == codec.name and get_codec(name, **options).config() == codec.config():
            return label
    return None


def codec_time(codec, shape=SHAPE, measurements: dict | None = None) -> CodecTime:
    """Encode and decode seconds of one ``shape`` bf16 message (the Triton path where it was timed)."""
    if measurements is None:
        measurements = json.loads(MEASUREMENTS.read_text())
    label = measured_label(codec)
    rows = [r for r in measurements["results"] if r["codec"] == label and r["op"] in ("encode", "decode")]
    if label is None or not rows:
        return CodecTime(0.0, 0.0, "not measured (codec time left out)")
    numel = math.prod(shape)
    near = min({tuple(r["shape"]) for r in rows}, key=lambda s: abs(math.log(numel / math.prod(s))))
    scale = numel / math.prod(near)
    us = {}
    for op in ("encode", "decode"):
        at = [r for r in rows if tuple(r["shape"]) == near and r["op"] == op]
        best = next((r for r in at if r["backend"] == "triton"), at[0])
        us[op] = best["us"] * scale
    where = (f"measured at {list(near)}" if near == tuple(shape)
             else f"scaled x{scale:.2f} by element count from {list(near)}")
    return CodecTime(us["encode"] * 1e-6, us["decode"] * 1e-6, f"{label} ({best['backend']}), {where}")


def compute_at(micro_batches: int) -> tuple[float, float]:
    """Forward / backward compute seconds of one micro-batch when the setup's global batch is split into
    ``micro_batches``: the setup's (``simulate.compute_per_micro_batch``) scaled by the tokens per micro-batch
    (linear in tokens: a larger micro-batch gets no efficiency credit)."""
    f, b = simulate.compute_per_micro_batch(SETUP.step_no_link_s, SETUP.stages, SETUP.micro_batches)
    scale = SETUP.micro_batches / micro_batches
    return f * scale, b * scale


def message_shape(micro_batches: int) -> tuple[int, int, int]:
    """``[seq, micro-batch, hidden]`` of one message when the setup's global batch is split into ``micro_batches``."""
    sequences = SETUP.micro_batch * SETUP.micro_batches
    if micro_batches < 1 or sequences % micro_batches:
        raise ValueError(f"{micro_batches} micro-batches do not split the setup's {sequences} sequences per step")
    return (SETUP.seq, sequences // micro_batches, HIDDEN)


def _stage_times(fwd_time: CodecTime, bwd_time: CodecTime, micro_batches: int = SETUP.micro_batches
                 ) -> tuple[list[float], list[float]]:
    """Per-stage forward / backward seconds: the compute at ``micro_batches`` plus each encode on its sender and
    each decode on its receiver (activations go to ``s + 1``, gradients to ``s - 1``)."""
    f, b = compute_at(micro_batches)
    n = SETUP.stages
    fwd = [f + fwd_time.encode_s * (s < n - 1) + fwd_time.decode_s * (s > 0) for s in range(n)]
    bwd = [b + bwd_time.encode_s * (s > 0) + bwd_time.decode_s * (s < n - 1) for s in range(n)]
    return fwd, bwd


def _with_coder(t: CodecTime, per_byte: CodecTime, nbytes: int) -> CodecTime:
    """``t`` plus a coder's encode and decode of a codec buffer of ``nbytes`` at ``per_byte``'s seconds per byte."""
    return CodecTime(t.encode_s + per_byte.encode_s * nbytes, t.decode_s + per_byte.decode_s * nbytes,
                     f"{t.source} + {per_byte.source}")


def project(steps_multiplier: dict[str, float] | None = None, codecs: dict[str, dict] | None = None,
            measurements: dict | None = None, base_steps: int = SETUP.steps_to_target,
            multiplier_label: str = "given multiplier", labels: dict[str, str] | None = None,
            byte_scale: dict[str, tuple[float, float]] | None = None,
            micro_batches: int = SETUP.micro_batches, not_projected: dict[str, str] | None = None,
            coder_seconds_per_byte: dict[str, tuple[CodecTime, CodecTime]] | None = None) -> list[dict]:
    """One row per codec: bits, bytes per token, codec time, s/step, steps and T on the setup, its global batch
    split into ``micro_batches`` (the setup's 64 by default; the steps do not change with the split).

    ``steps_multiplier[name]`` scales the bf16 record's steps to target; a codec without one gets
    1.0, labelled "at equal steps", the others ``labels[name]`` or else ``multiplier_label`` (say where they
    were measured). ``byte_scale[name]``: (forward, backward) factors on the codec's wire bytes, a what-if
    (``benchmarks.lossless``: an entropy coder after the codec). ``not_projected[name]``: the codec's row has its
    bytes and s/step but no steps and no T (None), ``steps_label`` saying why (it missed the target).
    ``coder_seconds_per_byte[name]``: (forward, backward) encode and decode seconds per byte of the codec's buffer
    of a lossless coder after the codec, added to the codec's times (scaled by each message's codec bytes).
    """
    not_projected = not_projected or {}
    labels = labels or {}
    steps_multiplier = steps_multiplier or {}
    codecs = CODECS if codecs is None else codecs
    if measurements is None:
        measurements = json.loads(MEASUREMENTS.read_text())
    shape = message_shape(micro_batches)
    tokens = shape[0] * shape[1]
    rows = []
    for name, fields in codecs.items():
        cfg = TahConfig(**fields)
        fwd_codec, bwd_codec = cfg.forward_codec(), cfg.backward_codec()
        fwd_bytes = busiest_nbytes(cfg, shape, SETUP.stages)  # per-boundary bits: the link that sets the pace
        bwd_bytes = bwd_codec.wire_nbytes(shape, torch.bfloat16)
        if byte_scale and name in byte_scale:
            fwd_bytes, bwd_bytes = (round(n * f) for n, f in zip((fwd_bytes, bwd_bytes), byte_scale[name]))
        t_f, t_b = codec_time(fwd_codec, shape, measurements), codec_time(bwd_codec, shape, measurements)
        if coder_seconds_per_byte and name in coder_seconds_per_byte:
            per_byte = coder_seconds_per_byte[name]
            t_f, t_b = (_with_coder(t, c, codec.wire_nbytes(shape, torch.bfloat16))
                        for t, c, codec in ((t_f, per_byte[0], fwd_codec), (t_b, per_byte[1], bwd_codec)))
        fwd_s, bwd_s = _stage_times(t_f, t_b, micro_batches)
        args = (SETUP.stages, micro_batches)
        link = (fwd_bytes, bwd_bytes, simulate.BANDWIDTH_BPS, simulate.LATENCY_S)
        step = simulate.simulate_step(*args, fwd_s, bwd_s, *link)
        f0, b0 = compute_at(micro_batches)
        step_no_codec = simulate.simulate_step(*args, f0, b0, *link)
        mult = None if name in not_projected else steps_multiplier.get(name)
        steps = None if name in not_projected else base_steps * (1.0 if mult is None else mult)
        rows.append(dict(
            codec=name, micro_batches=micro_batches, micro_batch=shape[1],
            forward_bits=fwd_bytes * 8 / math.prod(shape), backward_bits=bwd_bytes * 8 / math.prod(shape),
            forward_bytes_per_token=fwd_bytes / tokens, backward_bytes_per_token=bwd_bytes / tokens,
            bytes_per_token=(fwd_bytes + bwd_bytes) / tokens,
            forward_codec_s=t_f.encode_s + t_f.decode_s, backward_codec_s=t_b.encode_s + t_b.decode_s,
            codec_time_source=f"forward {t_f.source}; backward {t_b.source}",
            s_per_step=step, s_per_step_without_codec_time=step_no_codec,
            steps_multiplier=mult if mult is not None or name in not_projected else 1.0,
            steps_label=not_projected.get(name) or ("at equal steps" if mult is None else
                                                    labels.get(name, multiplier_label)),
            steps=steps, T=None if steps is None else steps * step))
    base = next((r["T"] for r in rows if r["codec"] == "none"), None)
    for r in rows:
        r["T_vs_none"] = r["T"] / base if base and r["T"] is not None else None
    return rows


def record_rows() -> list[dict]:
    """The published records beside the model's seconds per step for them."""
    return [dict(record=r.name, bytes_per_token=2 * r.bytes_per_token, micro_batch=r.micro_batch,
                 micro_batches=r.micro_batches, step_no_link_s=r.step_no_link_s,
                 published_s_per_step=r.published_s_per_step, simulated_s_per_step=simulate.simulate_record(r),
                 steps=r.steps_to_target, T=r.published_T) for r in simulate.RECORDS]


def format_table(rows: list[dict], records: list[dict]) -> str:
    """Plain text: the projection, then the published records."""
    out = [f"Projection on the ProtocolNanoGPT setup ({SETUP.stages} stages, {SETUP.micro_batches} x "
           f"[{SETUP.seq}, {SETUP.micro_batch}, {HIDDEN}] bf16, {simulate.BANDWIDTH_BPS / 1e6:g} Mb/s, "
           f"{simulate.LATENCY_S * 1e3:g} ms, {SETUP.step_no_link_s * 1e3:g} ms/step of compute):",
           f"{'codec':<12}{'fwd bits':>9}{'bwd bits':>9}{'B/token':>9}{'codec ms':>9}{'s/step':>9}{'no codec':>9}"
           f"{'steps':>8}{'T (s)':>10}{'T/none':>8}  steps from"]
    for r in rows:
        ratio = f"{r['T_vs_none']:.3f}" if r["T_vs_none"] else "-"
        out.append(f"{r['codec']:<12}{r['forward_bits']:>9.2f}{r['backward_bits']:>9.2f}{r['bytes_per_token']:>9.1f}"
                   f"{(r['forward_codec_s'] + r['backward_codec_s']) * 1e3:>9.2f}{r['s_per_step']:>9.2f}"
                   f"{r['s_per_step_without_codec_time']:>9.2f}"
                   f"{r['steps']:>8.0f}{r['T']:>10.0f}{ratio:>8}  {r['steps_label']}")
    out.append("codec ms: encode + decode of one forward and one backward message (encode on the sender, decode "
               "on the receiver); no codec: s/step with the codec time left out")
    out += [f"  {r['codec']}: {r['codec_time_source']}" for r in rows]
    out += ["", "Published records (8x H100) and the model's s/step from their inputs:",
            f"{'record':<12}{'B/token':>9}{'mbs x M':>9}{'ms/step':>9}{'s/step':>9}{'model':>9}"
            f"{'steps':>8}{'T (s)':>10}"]
    for r in records:
        out.append(f"{r['record']:<12}{r['bytes_per_token']:>9.0f}{r['micro_batch']:>4} x {r['micro_batches']:<3}"
                   f"{r['step_no_link_s'] * 1e3:>8.0f}{r['published_s_per_step']:>9.3f}"
                   f"{r['simulated_s_per_step']:>9.3f}"
                   f"{r['steps']:>8}{r['T']:>10.0f}")
    return "\n".join(out)


def _multipliers(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--steps-multiplier takes CODEC=X, got {item!r}")
        out[name] = float(value)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.speedrun.projection", description=__doc__.split("\n")[0])
    parser.add_argument("--project", action="store_true", help="print each codec's projection beside the records")
    parser.add_argument("--steps-multiplier", nargs="*", default=[], metavar="CODEC=X",
                        help="steps to target as a multiple of the bf16 record's 2925 (default 1: at equal "
                             "steps); implies --project")
    args = parser.parse_args(argv)
    print("Calibration: simulated against published s/step (inputs: the records' bytes, micro-batches, "
          "step time without the slow link)")
    for row in simulate.calibration_rows():
        print(f"  {row['record']:<12} published {row['published_s']:8.3f}  simulated {row['simulated_s']:8.3f} "
              f"({row['error']:+.2%}; sends not blocking: {row['simulated_nonblocking_s']:.3f})")
    if args.project or args.steps_multiplier:
        print()
        print(format_table(project(_multipliers(args.steps_multiplier)), record_rows()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
