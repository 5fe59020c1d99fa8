"""``make demo``: uncompressed vs TAH-Quant pipeline training of a small GPT over a 100 Mbps link.

Steps: tokenize the Shakespeare corpus (once, into ``data/``), train the same
2-stage GPT twice with :mod:`megatron_tah.train` (same seed, data order and
link) -- ``--tah-forward-codec none --tah-backward-codec none``, then the
defaults (TAH-Quant forward, 6-bit fixed point backward) -- and write under
``--out`` (default ``runs/demo/``)::

    none.jsonl, tah.jsonl     per-iteration records of each run (see megatron_tah.train)
    table.md                  codec, tokens/s, MB on the wire per iteration, bytes vs bf16 and fp32,
                              final validation loss and perplexity
    loss_curves.png           training and validation loss of both runs
    summary.json              the table's numbers, the checks, sizes and link mode

The link is real when possible (root, ``ip`` and ``tc``: one network namespace
per stage, ``megatron_tah.slow_link``); otherwise every pipeline message is
delayed in-process as if sent at the rate (``--tah-emulate-bandwidth``), and the
demo says so. Checks printed at the end (exit status 1 if one fails): the
TAH-Quant run sends at most 40% of the bytes an uncompressed bf16 pipeline
sends, and its validation loss is within 2% of the uncompressed run's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

RUNS = {
    "none": ["--tah-forward-codec", "none", "--tah-backward-codec", "none"],
    "tah": ["--tah-forward-codec", "tah", "--tah-backward-codec", "fixedpoint"],
}
LABELS = {"none": "uncompressed (fp32)", "tah": "TAH-Quant fwd + 6-bit bwd"}
MAX_BYTES_VS_BF16 = 0.40
MAX_VALID_LOSS_GAP = 0.02


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_tah.demo", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    p.add_argument("--data-prefix", default="data/shakespeare", help="tokenized corpus prefix (made if missing)")
    p.add_argument("--max-docs", type=int, default=None, help="tokenize only the first N plays (quick runs)")
    p.add_argument("--max-tokens", type=int, default=None, help="cap on tokens per split (quick runs)")
    p.add_argument("--rate", default="100mbit", help="link rate (default 100mbit)")
    p.add_argument("--link", choices=("auto", "netns", "emulate"), default="auto",
                   help="auto: network namespaces when root with ip/tc, else in-process emulation")
    p.add_argument("--train-iters", type=int, default=160)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-interval", type=int, default=20)
    p.add_argument("--eval-iters", type=int, default=4)
    p.add_argument("--log-interval", type=int, default=10)
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
    from .slow_link import SlowLinks, require_netns

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


def train_command(args, name: str, prefix: str, out: Path, link: str) -> list[str]:
    cmd = [sys.executable, "-m", "megatron_tah.train", "--data-path", prefix,
           "--pipeline-model-parallel-size", "2", "--log-json", str(out / f"{name}.jsonl")]
    for flag in ("train_iters", "num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "global_batch_size", "lr", "eval_interval", "eval_iters", "log_interval"):
        cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    cmd += ["--lr-warmup-iters", str(max(1, args.train_iters // 20)), *RUNS[name]]
    if link == "emulate":
        cmd += ["--tah-emulate-bandwidth", args.rate]
    return cmd


def run_training(cmd: list[str], link: str, rate: str) -> int:
    if link == "emulate":
        return subprocess.call(cmd)
    from .slow_link import SlowLinks, run_stages

    try:
        links = SlowLinks(2, rate).__enter__()
    except (RuntimeError, OSError, subprocess.CalledProcessError) as err:
        _say(f"link: could not build network namespaces ({err}); rerun with --link emulate")
        return 1
    try:
        return run_stages(links, cmd)
    finally:
        links.close()


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(records: list[dict], rate_bps: float) -> dict:
    """Table row of one run: medians over iterations after the first two (start-up).

    ``link_ms_per_iter`` is the time the iteration's bytes need at the link rate (serialized).
    """
    steady = records[2:] or records
    raw = statistics.mean(r["fwd_raw_bytes"] + r["bwd_raw_bytes"] for r in steady)
    wire = statistics.mean(r["fwd_wire_bytes"] + r["bwd_wire_bytes"] for r in steady)
    valid = [r for r in records if "valid_loss" in r]
    if not valid or raw == 0:
        raise SystemExit("demo: error: a run logged no validation loss or no pipeline traffic")
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "ms_per_iter": statistics.median(r["ms"] for r in steady),
        "wire_mb_per_iter": wire / 1e6,
        "link_ms_per_iter": wire * 8 / rate_bps * 1e3,
        "raw_fp32_mb_per_iter": raw / 1e6,
        "bytes_vs_bf16": wire / (raw / 2),  # the runs' pipeline dtype is fp32: bf16 sends half of raw
        "bytes_vs_fp32": wire / raw,
        "first_loss": records[0]["lm_loss"],
        "final_train_loss": statistics.mean(r["lm_loss"] for r in records[-5:]),
        "valid_loss": valid[-1]["valid_loss"],
        "valid_ppl": valid[-1]["valid_ppl"],
    }


def table(rows: dict[str, dict]) -> str:
    head = ("| run | tokens/s | ms/iter | MB on wire/iter | link ms/iter | bytes vs bf16 | bytes vs fp32 "
            "| valid loss | valid ppl |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    return head + "".join(
        f"| {LABELS[n]} | {r['tokens_per_s']:.0f} | {r['ms_per_iter']:.0f} | {r['wire_mb_per_iter']:.3f} | {r['link_ms_per_iter']:.0f} | "
        f"{100 * r['bytes_vs_bf16']:.1f}% | {100 * r['bytes_vs_fp32']:.1f}% | {r['valid_loss']:.4f} | "
        f"{r['valid_ppl']:.1f} |\n" for n, r in rows.items())


def plot(logs: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for (name, records), color in zip(logs.items(), ("tab:blue", "tab:red")):
        ax.plot([r["iteration"] for r in records], [r["lm_loss"] for r in records], color=color, alpha=0.8,
                lw=1.2, label=f"{LABELS[name]}: train")
        valid = [r for r in records if "valid_loss" in r]
        ax.plot([r["iteration"] for r in valid], [r["valid_loss"] for r in valid], "o--", color=color, ms=4,
                label=f"{LABELS[name]}: validation")
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def checks(rows: dict[str, dict]) -> dict[str, dict]:
    tah, none = rows["tah"], rows["none"]
    gap = abs(tah["valid_loss"] - none["valid_loss"]) / none["valid_loss"]
    return {
        "bytes_vs_bf16": {"value": tah["bytes_vs_bf16"], "limit": MAX_BYTES_VS_BF16,
                          "ok": tah["bytes_vs_bf16"] <= MAX_BYTES_VS_BF16},
        "valid_loss_gap": {"value": gap, "limit": MAX_VALID_LOSS_GAP, "ok": gap <= MAX_VALID_LOSS_GAP},
        "both_learn": {"value": [r["final_train_loss"] < r["first_loss"] for r in rows.values()],
                       "ok": all(r["final_train_loss"] < r["first_loss"] for r in rows.values())},
    }


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from .train import quiet_imports

    quiet_imports()
    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prefix = prepare_data(args)
    link = choose_link(args.link, args.rate)
    logs = {}
    for i, name in enumerate(RUNS, 1):
        _say(f"run {i}/{len(RUNS)}: {LABELS[name]}, 2 stages over a {args.rate} link "
             f"({'network namespaces + tc' if link == 'netns' else 'in-process emulation'}), "
             f"{args.train_iters} iterations")
        status = run_training(train_command(args, name, prefix, out, link), link, args.rate)
        if status != 0:
            _say(f"run {name} failed with status {status}")
            return status
        logs[name] = read_log(out / f"{name}.jsonl")
    from .config import parse_bandwidth

    rows = {name: summarize(records, parse_bandwidth(args.rate)) for name, records in logs.items()}
    text = table(rows)
    verdict = checks(rows)
    link_text = f"{args.rate}, {'network namespaces + tc' if link == 'netns' else 'in-process emulation'}"
    plot(logs, out / "loss_curves.png", f"GPT {args.num_layers}x{args.hidden_size}, 2 stages, {link_text}")
    (out / "table.md").write_text(f"Link: {link_text}\n\n{text}")
    summary = {"rows": rows, "checks": verdict, "link": link, "rate": args.rate,
               "args": {k: v for k, v in vars(args).items()}, "seconds": time.perf_counter() - start}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\nlink: {link_text}\n{text}")
    c = verdict
    print(f"check: TAH-Quant bytes (fwd + bwd) vs an uncompressed bf16 pipeline: "
          f"{100 * c['bytes_vs_bf16']['value']:.1f}% (limit {100 * MAX_BYTES_VS_BF16:.0f}%): "
          f"{'PASS' if c['bytes_vs_bf16']['ok'] else 'FAIL'}")
    print(f"check: validation loss gap vs uncompressed: {100 * c['valid_loss_gap']['value']:.2f}% "
          f"(limit {100 * MAX_VALID_LOSS_GAP:.0f}%): {'PASS' if c['valid_loss_gap']['ok'] else 'FAIL'}")
    print(f"check: both runs learn (train loss falls): {'PASS' if c['both_learn']['ok'] else 'FAIL'}")
    print(f"wrote {out / 'table.md'}, {out / 'loss_curves.png'}, {out / 'summary.json'} "
          f"({(time.perf_counter() - start) / 60:.1f} min)")
    return 0 if all(v["ok"] for v in verdict.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
