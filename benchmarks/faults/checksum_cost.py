"""The payload checksum's cost against the step time, on the demo and the speedrun: the slow link's yardstick.

    python -m benchmarks.faults.checksum_cost            # prints the table (about a minute)

For each setting and codec: the sender's checksum (``Codec.write_checksum``) and the receiver's check
(``Codec.checksum_mismatch``) on that codec's real buffer at the setting's message shape (median of ``REPEATS``
calls each, on this machine, one thread), times the messages the busiest stage sends and receives per step
(``PP`` 2: each stage sends and receives one message per micro-batch; a middle stage of a deeper pipeline, two
of each), over that setting's step time as measured: the demo's from docs/DEMO.md's table (ms/iter at 1 Mbit/s),
the speedrun's from docs/data/speedrun.json (s/step behind its emulated inbound wire). An upper bound: the sums
are counted as if no link time hid them.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
REPEATS = 41
DEMO_ROW = "TAH-Quant fwd + 6-bit bwd"  # docs/DEMO.md's slow-link table: the default codec pair
SPEEDRUN_CODECS = ("bf16", "paper", "channel9")


def demo_setting(page: Path = ROOT / "docs" / "DEMO.md") -> dict:
    """The demo at 1 Mbit/s: PP 2, messages [64, 4, 128] bf16, 4 micro-batches, the paper pair; its ms/iter."""
    row = next(line for line in page.read_text().splitlines() if line.startswith(f"| {DEMO_ROW} |"))
    ms = float(row.split("|")[4])
    return {"name": "demo, 1 Mbit/s", "stages": 2, "shape": (64, 4, 128), "micro_batches": 4,
            "runs": {"paper": {"fields": {"tah_preset": "paper"}, "step_s": ms / 1e3}}}


def speedrun_setting(page: Path = ROOT / "docs" / "data" / "speedrun.json") -> dict:
    """The speedrun: PP 8, messages [seq, micro-batch, hidden] bf16, its micro-batches; each codec's s/step."""
    from benchmarks.common.codecs import CODECS

    data = json.loads(page.read_text())
    setup = data["setup"]
    steps = {row["codec"]: row["s_per_step"] for row in data["table"]}
    return {"name": "speedrun, PP 8", "stages": setup["stages"],
            "shape": (setup["seq"], setup["micro_batch"], setup["hidden"]), "micro_batches": setup["micro_batches"],
            "runs": {codec: {"fields": CODECS[codec], "step_s": steps[codec]} for codec in SPEEDRUN_CODECS
                     if codec in steps}}


def checksum_seconds(codec, shape: tuple[int, ...], dtype=torch.bfloat16) -> tuple[float, float]:
    """Median seconds of ``codec``'s sender checksum and receiver check on its buffer for a tensor of ``shape``."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    buf = codec.encode(x)
    send, check = [], []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        codec.write_checksum(buf)
        t1 = time.perf_counter()
        if codec.checksum_mismatch(buf):
            raise RuntimeError("the checksum of an unchanged buffer does not match")
        t2 = time.perf_counter()
        send.append(t1 - t0)
        check.append(t2 - t1)
    return statistics.median(send), statistics.median(check)


def measure(settings: list[dict] | None = None) -> list[dict]:
    """One row per setting and codec: per-message checksum time, messages per step, share of the step."""
    from megatron_tah.config import TahConfig

    torch.set_num_threads(1)
    rows = []
    for setting in settings or [demo_setting(), speedrun_setting()]:
        m = setting["micro_batches"]
        for name, run in setting["runs"].items():
            config = TahConfig(**run["fields"], tah_backend="torch", tah_wire_checksum=True)
            (send_f, check_f), (send_b, check_b) = (checksum_seconds(codec, setting["shape"])
                                                    for codec in (config.forward_codec(), config.backward_codec()))
            if setting["stages"] == 2:  # stage 0 sends activations, checks gradients; stage 1 the other way round
                seconds, messages = m * max(send_f + check_b, check_f + send_b), 2 * m
            else:  # a middle stage: both, both ways
                seconds, messages = m * (send_f + check_f + send_b + check_b), 4 * m
            rows.append({"setting": setting["name"], "codec": name, "shape": list(setting["shape"]),
                         "messages_per_step": messages, "checksum_ms_per_step": 1e3 * seconds,
                         "step_s": run["step_s"], "share": seconds / run["step_s"]})
    return rows


def table_markdown(rows: list[dict]) -> str:
    lines = ["| setting | codec | message | messages a stage sends + receives per step | checksum ms per step "
             "| step (measured) | share of the step |", "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        lines.append(f"| {r['setting']} | {r['codec']} | [{shape}] bf16 | {r['messages_per_step']} | "
                     f"{r['checksum_ms_per_step']:.2f} | {r['step_s']:.2f} s | {100 * r['share']:.3f}% |")
    return "\n".join(lines)


def main() -> int:
    rows = measure()
    print(table_markdown(rows))
    worst = max(r["share"] for r in rows)
    print(f"largest share: {100 * worst:.3f}% of a step (rule: on by default on slow links when under 1%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
