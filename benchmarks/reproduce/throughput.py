"""Throughput vs link rate, and the bound implied by compute time and bytes per iteration.

Model (stated in docs/RESULTS.md). One iteration of 1F1B with ``p`` stages and ``m``
micro-batches sends, per stage boundary, ``m`` activation messages forward and ``m``
gradient messages backward. Each stage has one rate-limited egress (its ``eth0``; the
hub port towards it limits its ingress the same way), so a middle stage pushes
``m * (A + G)`` bytes per iteration through its link, where ``A``/``G`` are the wire
sizes of one forward/backward message; with ``p = 2`` the two stages send ``m*A`` and
``m*G`` in parallel. The plugin logs ``fwd_wire_bytes = m (p-1) A`` summed over stages,
so the busiest link carries::

    critical_bytes = (fwd + bwd) / (p - 1)   if p > 2,    max(fwd, bwd)   if p == 2

and takes ``t = critical_bytes * 8 / rate`` seconds. Compute and communication are
taken as not overlapping (gloo's p2p waits block the stage, and the 1F1B chain passes
every message through the critical path), so an iteration takes ``c + t`` with ``c``
the measured iteration time of the uncompressed run on an unthrottled link. The
speed-up bound of a codec over fp32 is ``(c + t_raw) / (c + t_wire)``; it ignores the
codec's own encode/decode time, which the measured speed-up pays.

Runs: every codec of :data:`CODECS` once unthrottled (``c``), then at every rate of
:data:`RATES` over real namespaced links, then the "paper regime": the rate at which
fp32 traffic takes :data:`PAPER_REGIME_FACTOR` times ``c`` (computed from the
unthrottled fp32 run), for fp32/bf16 uncompressed and TAH-Quant on fp32/bf16 pipelines.
Data: a synthetic token stream (vocabulary 1024): throughput does not depend on the
tokens, and a GPT-2 output layer (50k) would make a CPU run compute-bound.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from megatron_tah.units import parse_bandwidth

from .convergence import BACKWARD_6BIT
from ..common.runner import Run, execute_all, host_info, load_average, read_log, read_meta, say, steady

MODEL_TEXT = (
    "In 1F1B with `p` stages and `m` micro-batches, every stage boundary carries `m` activation messages "
    "forward and `m` gradient messages backward per iteration. Each stage has one rate-limited egress (its "
    "`eth0`; the hub port towards it limits its ingress the same way), so a middle stage pushes `m (A + G)` "
    "bytes per iteration through its link (`A`, `G`: wire bytes of one forward / backward message); with "
    "`p = 2` the two stages send `m A` and `m G` at the same time. The plugin logs bytes summed over stages "
    "(`fwd = m (p-1) A`), so the busiest link carries `(fwd + bwd) / (p - 1)` bytes (`max(fwd, bwd)` for "
    "`p = 2`), which take `bytes * 8 / rate` seconds if the link never idles. It does idle: Megatron's "
    "1F1B issues blocking send/recv pairs, so a middle stage talks to one neighbour at a time, and the "
    "pipeline fill and drain add messages that nothing overlaps. So `t = k * bytes * 8 / rate`, where the "
    "serialization factor `k = (T_fp32 - c) / (raw bytes * 8 / rate)` (at least 1) is measured on the "
    "uncompressed fp32 run at the same rate and applied to every codec at that rate: at 100 Mbit/s and in "
    "the paper regime the fp32 run spends more than bytes/rate on the link, at 300 Mbit/s-1 Gbit/s it spends "
    "less than bytes/rate beyond `c` (part of the transfer overlaps compute), where `k = 1` (the goal's "
    "bytes-only formula) is used. Compute and communication are taken as not overlapping (gloo's p2p waits "
    "block the stage), so an iteration takes `c + t`, with `c` the measured iteration time of the "
    "uncompressed fp32 run on an unthrottled loopback link. The speed-up bound of a codec is "
    "`(c + t_raw) / (c + t_wire)` with `t_raw` from the fp32 bytes and `t_wire` from the codec's bytes; it "
    "ignores the codec's own encode/decode time, which the measured run pays (column *codec ms*: encode + "
    "decode time summed over the stages, from the plugin's log). The bytes-only bound (`k = 1`) is shown "
    "too; it is never higher than the bound used.")

RATES = ("100mbit", "1gbit", "300mbit", "500mbit", "10gbit")
"""The paper's rates plus 10 Gbit/s, in the order they are run (most informative first)."""
PAPER_REGIME_FACTOR = 40.0
"""fp32 link time / compute time at the "paper regime" rate (the task asks for >= 20)."""

CODECS = {
    "none": ("uncompressed fp32", ["--tah-forward-codec", "none", "--tah-backward-codec", "none"]),
    "none_bf16": ("uncompressed bf16", ["--tah-forward-codec", "none", "--tah-backward-codec", "none", "--bf16"]),
    "fixedpoint4": ("fixedpoint 4-bit fwd, 6-bit bwd", ["--tah-forward-codec", "fixedpoint", "--tah-forward-bits", "4", *BACKWARD_6BIT]),
    "aqsgd": ("AQ-SGD 4-bit fwd, 6-bit bwd", ["--tah-forward-codec", "aqsgd", "--tah-forward-bits", "4", *BACKWARD_6BIT]),
    "tah": ("TAH-Quant fwd, 6-bit bwd", ["--tah-forward-codec", "tah", *BACKWARD_6BIT]),
    "fp8": ("fp8 both ways", ["--tah-forward-codec", "fp8", "--tah-backward-codec", "fp8"]),
    # auto: each link measures its rate and the candidates' costs and chooses (fp32 messages).
    "auto": ("auto (chosen per link)", ["--tah-forward-codec", "auto", "--tah-backward-codec", "auto"]),
    # ... and on a bf16 pipeline, compared with uncompressed bf16 (a bf16 pipeline also computes at another speed).
    "auto_bf16": ("auto (chosen per link), bf16 pipeline",
                  ["--tah-forward-codec", "auto", "--tah-backward-codec", "auto", "--bf16"]),
}
PAPER_CODECS = {"none": CODECS["none"], "none_bf16": CODECS["none_bf16"], "tah": CODECS["tah"],
                "tah_bf16": ("TAH-Quant fwd, 6-bit bwd, bf16 pipeline", [*CODECS["tah"][1], "--bf16"]),
                "auto": CODECS["auto"], "auto_bf16": CODECS["auto_bf16"]}
FIXED_FP32 = ("none", "fixedpoint4", "aqsgd", "tah", "fp8")
REPEATED, REPEATS = ("none_bf16", "auto_bf16"), 3
"""Runs repeated at every rate but the paper regime's (``NAME_rep2``, ``NAME_rep3``, in pairs), and how many
runs each then has: on the bf16 pipeline auto and uncompressed bf16 differ by less than single runs do."""
"""The fixed codecs of the fp32 pipeline that ``auto`` is compared with (the goal: >= 0.97x the best of those run)."""

SIZES = {
    # PP 4, one layer per stage, 1024 tokens per micro-batch, 4 micro-batches per iteration.
    "full": {"model": ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
                       "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "4", "--global-batch-size", "16"],
             "pipeline": 4, "iters": 30, "paper_iters": 10, "tokens": 400_000},
    "tiny": {"model": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2",
                       "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4"],
             "pipeline": 2, "iters": 4, "paper_iters": 4, "tokens": 20_000, "rates": ("10mbit",)},
}
VOCAB = 1024
COMMON = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", "128",
          "--split", "100,0,0", "--eval-iters", "0", "--eval-interval", "1000000", "--lr", "1e-4", "--lr-decay-style", "constant",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--untie-embeddings-and-output-weights"]


def synthetic_data(prefix: Path, tokens: int, seed: int = 0) -> str:
    """A one-document indexed dataset of uniform random ids in ``[0, VOCAB)``, made once."""
    prefix = Path(prefix)
    if Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file():
        return str(prefix)
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    ids = np.random.default_rng(seed).integers(0, VOCAB, tokens, dtype=np.int64)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(VOCAB))
    builder.add_item(torch.from_numpy(ids))
    builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


# ----------------------------------------------------------------------------- the model
def critical_bytes(fwd_bytes: float, bwd_bytes: float, pipeline: int) -> float:
    """Bytes per iteration through the busiest stage's link (see the module docstring)."""
    if pipeline < 2:
        raise ValueError(f"pipeline = {pipeline}: needs at least 2 stages to send anything")
    if pipeline == 2:
        return max(fwd_bytes, bwd_bytes)
    return (fwd_bytes + bwd_bytes) / (pipeline - 1)


def link_seconds(nbytes: float, rate_bps: float) -> float:
    if rate_bps <= 0:
        raise ValueError(f"rate_bps = {rate_bps}: must be > 0")
    return nbytes * 8.0 / rate_bps


def speedup_bound(c: float, t_raw: float, t_wire: float) -> float:
    """``(c + t_raw) / (c + t_wire)``: the speed-up if only the bytes changed."""
    if c < 0 or t_raw < 0 or t_wire < 0 or c + t_wire == 0:
        raise ValueError(f"need c, t_raw, t_wire >= 0 and c + t_wire > 0, got {c}, {t_raw}, {t_wire}")
    return (c + t_raw) / (c + t_wire)


def serialization_factor(fp32_iteration_s: float, c: float, t_raw: float) -> float:
    """``k``: how many times the busiest link's fp32 bytes/rate the fp32 run actually spent on the link.

    ``k = (T_fp32 - c) / t_raw`` from the measured fp32 iteration at this rate, at least 1 (the
    bytes-only estimate); 1F1B's blocking send/recv pairs and the pipeline fill and drain make it > 1.
    """
    if t_raw <= 0:
        raise ValueError(f"t_raw = {t_raw}: must be > 0")
    return max(1.0, (fp32_iteration_s - c) / t_raw)


def regime_rate(c: float, raw_critical_bytes: float, factor: float = PAPER_REGIME_FACTOR) -> float:
    """Link rate (bit/s) at which ``raw_critical_bytes`` take ``factor * c`` seconds."""
    if c <= 0 or raw_critical_bytes <= 0 or factor <= 0:
        raise ValueError(f"need c, bytes, factor > 0, got {c}, {raw_critical_bytes}, {factor}")
    return raw_critical_bytes * 8.0 / (factor * c)


def rate_text(bps: float) -> str:
    """``"4.2mbit"``-style text Megatron's --tah-* flags and netns_link accept (kbit precision)."""
    return f"{round(bps / 1e3)}kbit"


def run_stats(records: list[dict], pipeline: int) -> dict:
    """Median ms and tokens/s over the steady iterations, mean bytes per iteration, critical bytes."""
    s = steady(records)
    out = {"ms": statistics.median(r["ms"] for r in s),
           "tokens_per_s": statistics.median(r["tokens_per_s"] for r in s),
           # encode + decode time summed over the stages (logs written before it was logged: None)
           "codec_ms": statistics.median(r["codec_ms"] for r in s) if all("codec_ms" in r for r in s) else None}
    for key in ("fwd_raw_bytes", "fwd_wire_bytes", "bwd_raw_bytes", "bwd_wire_bytes"):
        out[key] = statistics.mean(r[key] for r in s)
    out["critical_raw_bytes"] = critical_bytes(out["fwd_raw_bytes"], out["bwd_raw_bytes"], pipeline)
    out["critical_wire_bytes"] = critical_bytes(out["fwd_wire_bytes"], out["bwd_wire_bytes"], pipeline)
    # auto runs: the codec each link ("0->1", ...) used last
    out["auto"] = {link: entry["codec"] for link, entry in (records[-1].get("auto") or {}).items()}
    return out


# ----------------------------------------------------------------------------- the runs
def _runs(size: str, data: str, codecs: dict, rate: str | None, link: str, prefix: str) -> list[Run]:
    cfg = SIZES[size]
    # The paper-regime runs take seconds per iteration: fewer of them.
    iters = cfg["paper_iters"] if prefix == "paper_" else cfg["iters"]
    runs = []
    for name, (label, flags) in codecs.items():
        cmd = [*cfg["model"], *COMMON, "--data-path", data, "--train-iters", str(iters), *flags]
        use_rate = rate
        if rate is not None and link == "emulate":
            cmd += ["--tah-emulate-bandwidth", rate]
            use_rate = None
        runs.append(Run(f"{prefix}{name}", cmd, cfg["pipeline"], rate=use_rate, label=label,
                        info={"codec": name, "rate": rate, "link": link if rate else "unthrottled"}))
    return runs


def wait_for_quiet(max_load: float, timeout_s: float = 900.0) -> float:
    """Wait (up to ``timeout_s``) for the 1-minute load average to drop below ``max_load``; returns it."""
    start = time.monotonic()
    while max_load > 0 and load_average() >= max_load and time.monotonic() - start < timeout_s:
        say(f"load average {load_average():.1f} >= {max_load}: waiting for a quiet machine before timing")
        time.sleep(30)
    return load_average()


def measure_links(rates, out: Path, n_stages: int) -> dict:
    """Achieved TCP rate per requested rate (``netns_link.measure``), saved to ``out``."""
    from megatron_tah.netns_link import measure

    result = json.loads(out.read_text()) if out.is_file() else {}
    for rate in rates:
        if rate not in result:
            nbytes = int(min(32 << 20, max(1 << 20, parse_bandwidth(rate) / 8 * 0.5)))
            result[rate] = measure(rate, nbytes=nbytes, n_stages=n_stages)
            out.write_text(json.dumps(result, indent=1))
    return result


def run(root: Path, size: str = "full", link: str = "netns", max_load: float = 3.0, max_wait: float = 900.0,
        force: bool = False) -> None:
    """All throughput runs (unthrottled, the rate sweep, the paper regime) under ``root/throughput``."""
    out = Path(root) / "throughput"
    out.mkdir(parents=True, exist_ok=True)
    cfg = SIZES[size]
    data = synthetic_data(Path(root) / "data" / f"synthetic_{size}", cfg["tokens"])
    load = wait_for_quiet(max_load, max_wait)
    say(f"throughput: load average {load:.2f} at start")
    (out / "machine.json").write_text(json.dumps(machine_info(load, None), indent=1))
    execute_all(_runs(size, data, CODECS, None, link, "c_"), out, jobs=1, force=force)
    base = run_stats(read_log(out / "c_none.jsonl"), cfg["pipeline"])
    rate_bps = regime_rate(base["ms"] / 1e3, base["critical_raw_bytes"])
    paper_rate = rate_text(rate_bps)
    (out / "paper_regime.json").write_text(json.dumps(
        {"rate": paper_rate, "rate_bps": parse_bandwidth(paper_rate), "factor": PAPER_REGIME_FACTOR,
         "c_ms": base["ms"], "critical_raw_bytes": base["critical_raw_bytes"]}, indent=1))
    say(f"paper regime: c = {base['ms']:.1f} ms, fp32 critical bytes {base['critical_raw_bytes'] / 1e6:.2f} MB "
        f"-> {paper_rate}")
    rates = cfg.get("rates", RATES)
    if link == "netns":
        measure_links([*rates, paper_rate], out / "links.json", cfg["pipeline"])
    execute_all(_runs(size, data, PAPER_CODECS, paper_rate, link, "paper_"), out, jobs=1, force=force)
    for rate in rates:
        execute_all(_runs(size, data, CODECS, rate, link, f"r{rate}_"), out, jobs=1, force=force)
    for rate, prefix in [(None, "c_"), *((rate, f"r{rate}_") for rate in rates)]:
        execute_all(_runs(size, data, repeated_codecs(), rate, link, prefix), out, jobs=1, force=force)
    (out / "machine.json").write_text(json.dumps(machine_info(load, load_average()), indent=1))


def repeated_codecs() -> dict:
    """``{NAME_repK: CODECS[NAME]}`` for the repeats of :data:`REPEATED`, pair by pair."""
    return {f"{name}_rep{k}": CODECS[name] for k in range(2, REPEATS + 1) for name in REPEATED}


def machine_info(load_start: float, load_end: float | None) -> dict:
    return {**host_info(), "load_start": load_start, "load_end": load_end,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


# ----------------------------------------------------------------------------- analysis
def table_rows(out: Path, size: str = "full") -> dict:
    """Everything the report needs: per (rate, codec) stats, bounds, speed-ups; missing runs are skipped."""
    out = Path(out)
    p = SIZES[size]["pipeline"]

    def stats(name):
        path = out / f"{name}.jsonl"
        return run_stats(read_log(path), p) if path.is_file() else None

    compute = {name: stats(f"c_{name}") for name in CODECS}
    base = compute.get("none")

    def repeats(prefix):  # every run of each repeated codec at one link, the first run included
        runs = {name: [stats(f"{prefix}{name}"), *(stats(f"{prefix}{name}_rep{k}") for k in range(2, REPEATS + 1))]
                for name in REPEATED}
        return {name: [r for r in rs if r] for name, rs in runs.items()}

    result = {"compute": compute, "rates": {}, "paper": None, "pipeline": p, "compute_repeats": repeats("c_")}
    if base is None:
        return result
    c = base["ms"] / 1e3
    regime = json.loads((out / "paper_regime.json").read_text()) if (out / "paper_regime.json").is_file() else None
    sweeps = [(rate, f"r{rate}_", CODECS) for rate in SIZES[size].get("rates", RATES)]
    # k is measured per rate on that rate's fp32 run (see MODEL_TEXT); the paper-regime value is kept
    # for reference.
    k_paper = None
    if regime and stats("paper_none"):
        k_paper = serialization_factor(stats("paper_none")["ms"] / 1e3, c,
                                       link_seconds(base["critical_raw_bytes"], regime["rate_bps"]))
        sweeps.insert(0, (regime["rate"], "paper_", PAPER_CODECS))
    elif regime:
        sweeps.insert(0, (regime["rate"], "paper_", PAPER_CODECS))
    result["k"] = k_paper
    for rate, prefix, codecs in sweeps:
        bps = parse_bandwidth(rate)
        rows = {name: stats(f"{prefix}{name}") for name in codecs}
        ref, ref16 = rows.get("none"), rows.get("none_bf16")
        t_raw = link_seconds(base["critical_raw_bytes"], bps)
        k_fit = serialization_factor(ref["ms"] / 1e3, c, t_raw) if ref else None
        k = k_fit if k_fit is not None else 1.0
        for name, row in rows.items():
            if row is None:
                continue
            # The bound uses the fp32 compute time c, fp32 raw bytes and this run's own wire bytes,
            # with the link time scaled by the factor k measured on the fp32 run at this rate.
            row["t_wire_s"] = link_seconds(row["critical_wire_bytes"], bps)
            row["bound_bytes_only"] = speedup_bound(c, t_raw, row["t_wire_s"])
            row["bound"] = speedup_bound(c, k * t_raw, k * row["t_wire_s"])
            row["model_ms"] = 1e3 * (c + k * row["t_wire_s"])
            own_c = compute.get(name)  # this codec's own unthrottled time, when measured
            row["k_run"] = ((row["ms"] - own_c["ms"]) / 1e3 / row["t_wire_s"]
                            if own_c and row["t_wire_s"] > 0 else None)
            row["speedup"] = row["tokens_per_s"] / ref["tokens_per_s"] if ref else None
            row["vs_bf16"] = row["tokens_per_s"] / ref16["tokens_per_s"] if ref16 else None
            row["of_bound"] = row["speedup"] / row["bound"] if row["speedup"] else None
            meta = read_meta(out, f"{prefix}{name}") or {}
            row["load"] = meta.get("load_before")
        key = "paper" if prefix == "paper_" else rate
        entry = {"rate": rate, "rate_bps": bps, "t_raw_s": t_raw, "rows": rows, "c_s": c, "k": k, "k_fit": k_fit,
                 "repeats": repeats(prefix) if prefix != "paper_" else {}}
        if key == "paper":
            result["paper"] = {**entry, **(regime or {})}
        else:
            result["rates"][rate] = entry
    links = out / "links.json"
    result["links"] = json.loads(links.read_text()) if links.is_file() else {}
    machine = out / "machine.json"
    result["machine"] = json.loads(machine.read_text()) if machine.is_file() else None
    return result
