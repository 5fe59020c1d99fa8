"""``make demo``: TAH-Quant vs an uncompressed bf16 pipeline, both in Megatron-LM's training loop.

Steps: tokenize the Shakespeare corpus (once, into ``data/``), then train the same 2-stage GPT
three times with ``python -m megatron_tah.pretrain_gpt`` (``megatron.training.pretrain``; same seed, data
order, bf16 compute and link): once uncompressed -- the bf16 pipeline a Megatron user runs today --,
once with TAH-Quant activations and 6-bit activation gradients, and once with ``auto`` (each link
measures its rate and the codecs' costs and chooses, ``link/auto.py``). ``--rate unlimited``
is the second setting: no slow link, where auto should choose ``none``. Written under ``--out``
(default ``runs/demo/``)::

    bf16.jsonl, tah.jsonl, auto.jsonl   per-iteration records of each run (the plugin's --tah-log-json)
    bf16.log, tah.log, auto.log         each run's Megatron output
    table.md                  tokens/s, ms/iter, MB on the wire per iteration, bytes vs bf16, speed-up,
                              final validation loss and perplexity
    loss_curves.png           each run's training and validation loss against iterations, and its validation
                              loss against wall-clock seconds
    summary.json              the table's numbers, the checks, sizes and link mode

The link runs at a rate where, on this machine, moving bf16 activations takes longer than
computing them (as it does for GPU pipelines over 100 Mbit/s - 1 Gbit/s links: a 2-core CPU
computes about a thousand times slower than a GPU, so the rate is scaled down accordingly; the
table shows both times). It is real when possible (root, ``ip`` and ``tc``: one network namespace
per stage, ``megatron_tah.netns_link``); otherwise every pipeline message is delayed in-process as
if sent at the rate (``--tah-emulate-bandwidth``), and the demo says so. The 4 layers are split 3/1
(``--decoder-first-pipeline-num-layers 3``) because the last stage also computes the 50k-word
output layer, and the input embedding and output layer are separate weights
(``--untie-embeddings-and-output-weights``, as in LLaMA-style models): tied, Megatron all-reduces
their 50k x hidden gradient between the first and the last stage every iteration, 25 MB here
against 0.5 MB of activations. A third, short run (``compute``: uncompressed, no slow link) measures
how long this machine computes an iteration; beside the link time of each run's measured bytes it says
whether the machine was compute-bound (a busy machine computes slower, and fewer bytes then buy little).

Checks printed at the end (exit status 1 if one fails, else 0): TAH-Quant sends at most 40% of the bf16
pipeline's bytes, its validation loss is within 2% of the bf16 run's, and both runs learn. The speed-up
is reported against its goal (1.5x in tokens/s) but, being a measurement of the machine, never fails
the demo; so is auto's (the codec each link chose, and its tokens/s at least TAH-Quant's less 5% on the slow
link, bf16's less 5% at ``--rate unlimited``: faster passes). While a run trains, its progress (iteration, loss, elapsed, ETA) is
printed from its log; the ETA counts measured iterations only (Megatron's time per iteration since its previous
log line), none on the first line.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from .megatron.run_log import read_records

RUNS = {
    "bf16": ["--tah-forward-codec", "none", "--tah-backward-codec", "none"],
    "tah": ["--tah-forward-codec", "tah", "--tah-backward-codec", "fixedpoint"],
    "auto": ["--tah-forward-codec", "auto", "--tah-backward-codec", "auto"],
}
LABELS = {"bf16": "uncompressed bf16", "tah": "TAH-Quant fwd + 6-bit bwd", "auto": "auto (chosen per link)"}
UNLIMITED = "unlimited"  # --rate: no slow link (auto must choose none)
AUTO_TOKENS_TOLERANCE = 0.05  # how much slower auto may be than the run it should match (TAH-Quant on a slow link,
# bf16 unlimited); faster is fine
MAX_BYTES_VS_BF16 = 0.40
MAX_VALID_LOSS_GAP = 0.02
MIN_SPEEDUP = 1.5
FAILING_CHECKS = ("bytes_vs_bf16", "valid_loss_gap", "both_learn")  # wrong bytes or loss: exit status 1
COMPUTE_RUN, COMPUTE_RUN_ITERS = "compute", 12  # the link-free, uncompressed run that measures compute per iteration
PROGRESS_SECONDS = 15.0  # how often a run's log is read for progress


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_tah.demo", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    p.add_argument("--data-prefix", default="data/shakespeare", help="tokenized corpus prefix (made if missing)")
    p.add_argument("--max-docs", type=int, default=None, help="tokenize only the first N plays (quick runs)")
    p.add_argument("--max-tokens", type=int, default=None, help="cap on tokens per split (quick runs)")
    p.add_argument("--rate", default="1mbit", help="link rate (default 1mbit); unlimited: no slow link, where "
                   "auto must choose none")
    p.add_argument("--link", choices=("auto", "netns", "emulate"), default="auto",
                   help="auto: network namespaces when root with ip/tc, else in-process emulation")
    p.add_argument("--train-iters", type=int, default=80)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--first-stage-layers", type=int, default=3, help="layers on stage 0 (the rest on stage 1)")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-interval", type=int, default=20)
    p.add_argument("--eval-iters", type=int, default=4)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--no-speed-check", action="store_true", help="report the speed-up without comparing it with "
                   "the goal (scaled-down runs, where start-up dominates); it never sets the exit status")
    return p


def _say(text: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {text}", flush=True)


def prepare_data(args) -> str:
    """Tokenize Shakespeare into ``args.data_prefix`` unless both splits exist; returns the prefix."""
    from .data import DataError, prepare

    prefix = args.data_prefix
    if all(Path(f"{prefix}_{s}_text_document.{e}").is_file() for s in ("train", "valid") for e in ("bin", "idx")):
        _say(f"data: using {prefix}_{{train,valid}}_text_document (delete them to re-tokenize)")
        return prefix
    _say("data: tokenizing the Shakespeare corpus with GPT-2 BPE ...")
    try:
        info = prepare("shakespeare", prefix, max_docs=args.max_docs, max_tokens=args.max_tokens)
    except DataError as err:
        raise SystemExit(f"demo: error: {err}") from None
    _say(f"data: {info['train']['tokens']:,} train / {info['valid']['tokens']:,} valid tokens "
         f"in {info['seconds']:.0f} s")
    return prefix


def choose_link(mode: str, rate: str = "100mbit") -> str:
    """``"netns"`` or ``"emulate"``; in ``auto`` mode, builds the namespaces once to be sure, and says why
    it falls back to the emulation."""
    from .netns_link import SlowLinks, require_netns

    if mode == "emulate":
        return "emulate"
    try:
        require_netns()
        if mode == "auto":  # root with ip/tc is not enough in a container without NET_ADMIN
            with SlowLinks(2, rate):
                pass
        return "netns"
    except (RuntimeError, OSError, subprocess.CalledProcessError) as err:
        if mode == "netns":
            raise SystemExit(f"demo: error: {err}") from None
        _say(f"link: real slow links unavailable ({str(err).strip()}); using the in-process emulation "
             "(--tah-emulate-bandwidth): each message is delayed by its size / rate")
        return "emulate"


def train_flags(args, name: str, prefix: str, out: Path, link: str) -> list[str]:
    """Megatron flags of one run (the same for both but the codecs)."""
    from .pretrain_gpt import CPU_FLAGS, GPT2_DATA_FLAGS

    flags = ["--pipeline-model-parallel-size", "2", "--bf16", *CPU_FLAGS, *GPT2_DATA_FLAGS,
             "--train-data-path", f"{prefix}_train_text_document", "--valid-data-path", f"{prefix}_valid_text_document",
             "--max-position-embeddings", str(args.seq_length), "--lr-warmup-iters", str(max(1, args.train_iters // 20)),
             "--lr-decay-style", "cosine", "--min-lr", str(args.lr / 10), "--weight-decay", "0.01", "--clip-grad", "1.0",
             "--decoder-first-pipeline-num-layers", str(args.first_stage_layers),
             "--untie-embeddings-and-output-weights",
             "--tah-log-json", str(out / f"{name}.jsonl"), *RUNS["bf16" if name == COMPUTE_RUN else name]]
    for flag in ("train_iters", "num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "global_batch_size", "lr", "eval_interval", "eval_iters", "log_interval"):
        flags += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    if link == "emulate" and args.rate != UNLIMITED:
        flags += ["--tah-emulate-bandwidth", args.rate]
    if args.rate != UNLIMITED and name != COMPUTE_RUN:  # a slow link: payload checksums on, as the scripts have them
        flags += ["--tah-wire-checksum"]
    return flags


# Megatron's iteration line: " [date] iteration       20/      80 | ... | elapsed time per iteration (ms): 812.3 | ...
# | lm loss: 7.123456E+00 | ..." (lm loss is missing on lines of skipped iterations).
_ITERATION_LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?elapsed time per iteration \(ms\): ([\d.]+)"
                             r"(?:.*?lm loss: ([-+.\dEe]+|nan|inf))?")


def parse_progress(log_text: str) -> dict | None:
    """The last iteration line of a Megatron log: ``iteration``, ``total``, ``ms_per_iter``, ``lm_loss``
    (None when the line has none); None before the first iteration line."""
    matches = list(_ITERATION_LINE.finditer(log_text))
    if not matches:
        return None
    iteration, total, ms, loss = matches[-1].groups()
    return {"iteration": int(iteration), "total": int(total), "ms_per_iter": float(ms),
            "lm_loss": None if loss is None else float(loss)}


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def progress_line(name: str, progress: dict, elapsed_s: float, measured: bool = True) -> str:
    """``name: iteration 20/80, lm loss 7.12, 1m05s elapsed, ETA 0m48s``: the ETA is Megatron's own measure of the
    iterations since its previous log line (``ms_per_iter``) times the iterations left. ``measured`` False (the
    run's first log line, whose iterations include the first one's set-up): no ETA yet, as the line says."""
    done, total = progress["iteration"], progress["total"]
    loss = "" if progress["lm_loss"] is None else f", lm loss {progress['lm_loss']:.3f}"
    eta = (f"ETA {_minutes(progress['ms_per_iter'] / 1e3 * (total - done))}" if measured
           else "ETA after the next log line")
    return f"{name}: iteration {done}/{total}{loss}, {_minutes(elapsed_s)} elapsed, {eta}"


def _with_progress(name: str, log_path: Path, start_run) -> int:
    """Run ``start_run()`` (returns an exit status) in a thread, printing ``log_path``'s progress meanwhile: an ETA
    from the second iteration line on (the first's time includes start-up work)."""
    status: list[int] = []
    worker = threading.Thread(target=lambda: status.append(start_run()), daemon=True)
    start, first, shown = time.perf_counter(), None, None
    worker.start()
    while worker.is_alive():
        worker.join(PROGRESS_SECONDS)
        progress = parse_progress(log_path.read_text(errors="replace")) if log_path.is_file() else None
        if progress is not None and progress["iteration"] != shown:
            shown = progress["iteration"]
            first = shown if first is None else first
            _say(progress_line(name, progress, time.perf_counter() - start, measured=shown != first))
    return status[0] if status else 1


def run_training(flags: list[str], link: str, rate: str, log_path: Path, name: str = "run") -> int:
    """One run, its output in ``log_path`` and its progress printed: torchrun on loopback, or one namespace
    per stage."""
    return _with_progress(name, log_path, lambda: _run_training(flags, link, rate, log_path))


def _run_training(flags: list[str], link: str, rate: str, log_path: Path) -> int:
    from .pretrain_gpt import command, stage_command

    with open(log_path, "w") as log:
        if link != "netns":  # "emulate" (its flags delay messages) or "loopback" (no slow link)
            return subprocess.call(command(2, flags), stdout=log, stderr=subprocess.STDOUT)
        from .netns_link import SlowLinks, run_stages

        try:
            links = SlowLinks(2, rate).__enter__()
        except (RuntimeError, OSError, subprocess.CalledProcessError) as err:
            _say(f"link: could not build network namespaces ({err}); rerun with --link emulate")
            return 1
        try:
            return run_stages(links, stage_command(flags), stdout=log, stderr=subprocess.STDOUT)
        finally:
            links.close()


def summarize(records: list[dict], rate_bps: float) -> dict:
    """Table row of one run: medians over training iterations after the first three (start-up).

    ``link_ms_per_iter`` is the time the iteration's bytes need at the link rate (serialized);
    the runs compute in bf16, so the raw bytes are the bf16 pipeline's.
    """
    training = records
    steady = training[3:] or training
    raw = statistics.mean(r["fwd_raw_bytes"] + r["bwd_raw_bytes"] for r in steady)
    wire = statistics.mean(r["fwd_wire_bytes"] + r["bwd_wire_bytes"] for r in steady)
    valid = [r for r in records if "valid_loss" in r]
    if not valid or raw == 0:
        raise SystemExit("demo: error: a run logged no validation loss or no pipeline traffic")
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady if r["tokens_per_s"]),
        "ms_per_iter": statistics.median(r["ms"] for r in steady if r["ms"]),
        "wire_mb_per_iter": wire / 1e6,
        "link_ms_per_iter": wire * 8 / rate_bps * 1e3,
        "raw_bf16_mb_per_iter": raw / 1e6,
        "bytes_vs_bf16": wire / raw,
        "codec_ms_per_iter": statistics.median(r["codec_ms"] for r in steady),
        "first_loss": training[0]["lm_loss"],
        "final_train_loss": statistics.mean(r["lm_loss"] for r in training[-5:]),
        "valid_loss": valid[-1]["valid_loss"],
        "valid_ppl": valid[-1]["valid_ppl"],
        "auto_codecs": {link: item["codec"] for link, item in records[-1].get("auto", {}).items()},
    }


def table(rows: dict[str, dict]) -> str:
    base = rows["bf16"]["tokens_per_s"]
    head = ("| run | tokens/s | speed-up | ms/iter | MB on wire/iter | link ms/iter | bytes vs bf16 "
            "| valid loss | valid ppl |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    return head + "".join(
        f"| {LABELS[n]} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base:.2f}x | {r['ms_per_iter']:.0f} | "
        f"{r['wire_mb_per_iter']:.3f} | {r['link_ms_per_iter']:.0f} | {100 * r['bytes_vs_bf16']:.1f}% | "
        f"{r['valid_loss']:.4f} | {r['valid_ppl']:.1f} |\n" for n, r in rows.items())


def elapsed_seconds(records: list[dict]) -> list[float]:
    """Each record's wall-clock seconds since the run's first iteration: the running sum of ``ms`` (the wall time
    since the previous record; none for the first, whose time holds the run's start-up)."""
    total, out = 0.0, []
    for r in records:
        total += (r.get("ms") or 0.0) / 1e3
        out.append(total)
    return out


def plot(logs: dict[str, list[dict]], path: Path, title: str) -> None:
    """Two panels: each run's training and validation loss against the iteration, and its validation loss against
    the wall-clock seconds since its first iteration (``elapsed_seconds``: what a faster link buys)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, clock) = plt.subplots(1, 2, figsize=(12, 4.2))
    for (name, records), color in zip(logs.items(), ("tab:blue", "tab:red", "tab:green")):
        ax.plot([r["iteration"] for r in records], [r["lm_loss"] for r in records], color=color, alpha=0.8,
                lw=1.2, label=f"{LABELS[name]}: train")
        valid = [(r, s) for r, s in zip(records, elapsed_seconds(records)) if "valid_loss" in r]
        ax.plot([r["iteration"] for r, _ in valid], [r["valid_loss"] for r, _ in valid], "o--", color=color, ms=4,
                label=f"{LABELS[name]}: validation")
        clock.plot([s for _, s in valid], [r["valid_loss"] for r, _ in valid], "o--", color=color, ms=4,
                   label=f"{LABELS[name]}: validation")
    ax.set_xlabel("iteration")
    clock.set_xlabel("seconds since the first iteration (wall clock)")
    for axis, name in ((ax, "against iterations"), (clock, "against wall-clock time")):
        axis.set_ylabel("lm loss")
        axis.set_title(name, fontsize=9)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def checks(rows: dict[str, dict], speed_check: bool = True, unlimited: bool = False) -> dict[str, dict]:
    """Bytes and loss checks (``ok``; :data:`FAILING_CHECKS`) and the speed-up against its goal (``met``,
    reported only)."""
    tah, bf16 = rows["tah"], rows["bf16"]
    gap = abs(tah["valid_loss"] - bf16["valid_loss"]) / bf16["valid_loss"]
    speedup = tah["tokens_per_s"] / bf16["tokens_per_s"]
    return {
        "bytes_vs_bf16": {"value": tah["bytes_vs_bf16"], "limit": MAX_BYTES_VS_BF16,
                          "ok": tah["bytes_vs_bf16"] <= MAX_BYTES_VS_BF16},
        "valid_loss_gap": {"value": gap, "limit": MAX_VALID_LOSS_GAP, "ok": gap <= MAX_VALID_LOSS_GAP},
        "both_learn": {"value": [r["final_train_loss"] < r["first_loss"] for r in rows.values()],
                       "ok": all(r["final_train_loss"] < r["first_loss"] for r in rows.values())},
        "speedup": {"value": speedup, "goal": MIN_SPEEDUP, "met": speedup >= MIN_SPEEDUP, "checked": speed_check},
        **({"auto": auto_check(rows, unlimited)} if "auto" in rows else {}),
    }


def auto_check(rows: dict[str, dict], unlimited: bool) -> dict:
    """What auto chose per link (its last record) against what it should: a compressing codec matching
    TAH-Quant's tokens/s on a slow link, ``none`` matching bf16's on an unlimited one (``met``; reported,
    a measurement of the machine like the speed-up, it never sets the exit status)."""
    codecs = rows["auto"]["auto_codecs"]
    target = "bf16" if unlimited else "tah"
    ratio = rows["auto"]["tokens_per_s"] / rows[target]["tokens_per_s"]
    chose = bool(codecs) and all((c == "none") == unlimited for c in codecs.values())
    return {"codecs": codecs, "matches": target, "tokens_ratio": ratio, "chose_right": chose,
            "met": chose and ratio >= 1 - AUTO_TOKENS_TOLERANCE}


def auto_line(a: dict, unlimited: bool) -> str:
    """The printed line of :func:`auto_check`'s result ``a``: what auto chose, its tokens/s over the run it should
    match, and the goal (faster, or at most ``AUTO_TOKENS_TOLERANCE`` slower, with the right kind of codec)."""
    chose = ", ".join(f"{k}: {v}" for k, v in a["codecs"].items()) or "nothing"
    kind = "none (uncompressed)" if unlimited else "a compressing codec"
    return (f"measured: auto chose {chose}; its tokens/s over {LABELS[a['matches']]}'s: {a['tokens_ratio']:.2f}x "
            f"(goal: {kind}, as fast or at most {100 * AUTO_TOKENS_TOLERANCE:.0f}% slower: "
            f"{'met' if a['met'] else 'not met'}; a measurement, not a check)")


def exit_status(verdict: dict[str, dict]) -> int:
    """1 when the bytes or the loss are wrong (:data:`FAILING_CHECKS`), else 0 whatever the speed-up."""
    return 0 if all(verdict[name]["ok"] for name in FAILING_CHECKS) else 1


def compute_vs_link(compute_ms: float, rows: dict[str, dict]) -> dict:
    """Measured compute per iteration (the link-free run) against each run's link time per iteration.

    ``compute_bound``: an iteration computes at least as long as the bf16 pipeline's bytes take on the
    link. ``expected_speedup``: the range of TAH-Quant's speed-up between link time fully serialized
    with compute, ``(c + l_bf16) / (c + l_tah)``, and fully overlapped, ``max(c, l_bf16) / max(c, l_tah)``.
    """
    bf16, tah = rows["bf16"]["link_ms_per_iter"], rows["tah"]["link_ms_per_iter"]
    serialized, overlapped = (compute_ms + bf16) / (compute_ms + tah), max(compute_ms, bf16) / max(compute_ms, tah)
    return {"compute_ms_per_iter": compute_ms, "bf16_link_ms_per_iter": bf16, "tah_link_ms_per_iter": tah,
            "compute_bound": compute_ms >= bf16,
            "expected_speedup": [min(serialized, overlapped), max(serialized, overlapped)]}


def compute_statement(c: dict) -> str:
    low, high = c["expected_speedup"]
    kind = ("compute-bound: computing an iteration takes at least as long as moving the bf16 pipeline's bytes, "
            "so fewer bytes buy little" if c["compute_bound"] else
            "link-bound: moving the bf16 pipeline's bytes takes longer than computing an iteration")
    return (f"machine: {c['compute_ms_per_iter']:.0f} ms of compute per iteration (measured without a slow link) vs "
            f"{c['bf16_link_ms_per_iter']:.0f} ms (bf16) / {c['tah_link_ms_per_iter']:.0f} ms (TAH-Quant) of link "
            f"time per iteration (measured bytes at the link rate): {kind}; expected TAH-Quant speed-up "
            f"{low:.2f}x-{high:.2f}x")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prefix = prepare_data(args)
    from .megatron.cpu_shims import bf16_instructions

    if not bf16_instructions():  # the runs compute in bf16 (--bf16)
        _say("note: this CPU has no bf16 instructions torch uses (AVX512-BF16 or AMX): the runs' bf16 matrix "
             "products are computed in fp32 and rounded to bf16 (a CPU shim, docs/PATCHES.md), as fast as fp32")
    link = "loopback" if args.rate == UNLIMITED else choose_link(args.link, args.rate)
    link_text = {"netns": f"{args.rate}, network namespaces + tc", "emulate": f"{args.rate}, in-process emulation",
                 "loopback": "unlimited (loopback, no slow link)"}[link]
    logs = {}
    for i, name in enumerate(RUNS, 1):
        _say(f"run {i}/{len(RUNS)}: {LABELS[name]}, Megatron-LM's pretrain() on 2 stages over a {link_text} link, "
             f"{args.train_iters} iterations (output: {out / name}.log)")
        (out / f"{name}.jsonl").unlink(missing_ok=True)
        status = run_training(train_flags(args, name, prefix, out, link), link, args.rate, out / f"{name}.log", name)
        if status != 0:
            _say(f"run {name} failed with status {status}; the end of {out / name}.log:")
            print("".join((out / f"{name}.log").read_text().splitlines(keepends=True)[-20:]))
            return status or 1
        logs[name] = read_records(out / f"{name}.jsonl")
        _say(f"run {name}: done")
    from .units import parse_bandwidth

    unlimited = args.rate == UNLIMITED
    rate_bps = float("inf") if unlimited else parse_bandwidth(args.rate)
    rows = {name: summarize(records, rate_bps) for name, records in logs.items()}
    text = table(rows)
    verdict = checks(rows, speed_check=not args.no_speed_check, unlimited=unlimited)
    compute = None if unlimited else measure_compute(args, prefix, out, rows)
    plot(logs, out / "loss_curves.png", f"GPT {args.num_layers}x{args.hidden_size} bf16, 2 stages, {link_text}")
    (out / "table.md").write_text(f"Link: {link_text}\n\n{text}")
    summary = {"rows": rows, "checks": verdict, "compute": compute, "link": link, "rate": args.rate,
               "args": {k: v for k, v in vars(args).items()}, "seconds": time.perf_counter() - start}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\nlink: {link_text}\n{text}")
    c = verdict
    print(f"check: TAH-Quant bytes (fwd + bwd) vs the uncompressed bf16 pipeline: "
          f"{100 * c['bytes_vs_bf16']['value']:.1f}% (limit {100 * MAX_BYTES_VS_BF16:.0f}%): "
          f"{'PASS' if c['bytes_vs_bf16']['ok'] else 'FAIL'}")
    print(f"check: validation loss gap vs bf16: {100 * c['valid_loss_gap']['value']:.2f}% "
          f"(limit {100 * MAX_VALID_LOSS_GAP:.0f}%): {'PASS' if c['valid_loss_gap']['ok'] else 'FAIL'}")
    print(f"check: both runs learn (train loss falls): {'PASS' if c['both_learn']['ok'] else 'FAIL'}")
    speed = c["speedup"]
    goal = (("goal met" if speed["met"] else "goal not met") if speed["checked"]
            else "not compared with the goal (--no-speed-check)")
    print(f"measured: TAH-Quant tokens/s vs bf16: {speed['value']:.2f}x (goal {MIN_SPEEDUP}x: {goal}; "
          "a measurement of this machine, not a check)")
    if "auto" in c:
        print(auto_line(c["auto"], unlimited))
    if compute is not None and not unlimited:
        print(compute_statement(compute))
    print(f"wrote {out / 'table.md'}, {out / 'loss_curves.png'}, {out / 'summary.json'} "
          f"({(time.perf_counter() - start) / 60:.1f} min)")
    return exit_status(verdict)


def measure_compute(args, prefix: str, out: Path, rows: dict[str, dict]) -> dict | None:
    """The link-free run (:data:`COMPUTE_RUN`): :func:`compute_vs_link` of its median ms per iteration;
    None (said) when it fails."""
    quick = argparse.Namespace(**{**vars(args), "train_iters": COMPUTE_RUN_ITERS, "eval_interval": COMPUTE_RUN_ITERS})
    _say(f"run {COMPUTE_RUN}: uncompressed, no slow link, {COMPUTE_RUN_ITERS} iterations: this machine's compute "
         f"per iteration (output: {out / COMPUTE_RUN}.log)")
    (out / f"{COMPUTE_RUN}.jsonl").unlink(missing_ok=True)
    log = out / f"{COMPUTE_RUN}.log"
    status = run_training(train_flags(quick, COMPUTE_RUN, prefix, out, "loopback"), "loopback", args.rate, log,
                          COMPUTE_RUN)
    records = read_records(out / f"{COMPUTE_RUN}.jsonl") if status == 0 else []
    times = [r["ms"] for r in records[3:] if r["ms"]]
    if not times:
        _say(f"run {COMPUTE_RUN} failed (status {status}); see {log}: no compute-bound statement")
        return None
    return compute_vs_link(statistics.median(times), rows)


if __name__ == "__main__":
    sys.exit(main())
