"""When does lowrank help? The energy share of a message's top-k principal directions.

The measure is ``benchmarks.common.energy.energy_share``.

``python -m benchmarks.spectrum run --hidden 128 [--iters 150]`` trains the parity study's compact
protocol (``benchmarks.reproduce.convergence``: 4 layers, PP 4, 4096-id vocabulary, micro batch 4 x
128 tokens; uncompressed, seed 1234; ``--iters`` replaces its 300 iterations, the cosine schedule
shrinks with it) in Megatron's loop, each stage process started through ``benchmarks.spectrum.hook``,
which records the shares of the first activation message each stage sends in every ``--every``-th
iteration (``runs/spectrum/h<hidden>/rank<r>.jsonl``). ``python -m benchmarks.spectrum plot`` draws
those records beside the shares of the real models' hidden states (``docs/data/real_activations.json``,
from ``python -m benchmarks.codec_report --real``) into ``docs/data/spectrum.png`` and ``docs/data/spectrum.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from .hook import ENV_EVERY, ENV_OUT


# ----------------------------------------------------------------------------- training runs
def run_command(hidden: int, iters: int, out: Path, python: str = sys.executable) -> list[str]:
    """The compact protocol's uncompressed seed-1234 run at ``hidden``, its stages through the hook."""
    from ..reproduce import convergence

    run = convergence.pretrain_runs(out / "reproduce", "full", codecs=("none",), hidden=hidden,
                                    protocol="compact")[0]
    flags = list(run.flags)
    flags[flags.index("--train-iters") + 1] = str(iters)
    run.flags = flags
    command = run.command(out / f"h{hidden}", python)
    command[command.index("megatron_tah.pretrain_gpt")] = "benchmarks.spectrum.hook"
    return command


def run(hidden: int, iters: int, every: int, out: Path) -> Path:
    """Train once (see the module doc) and return the folder of its records."""
    from ..reproduce import convergence

    convergence.prepare_data(out / "reproduce", "full", "compact")
    folder = out / f"h{hidden}"
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("rank*.jsonl"):
        old.unlink()
    env = {**os.environ, ENV_OUT: str(folder), ENV_EVERY: str(every),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path.cwd()), os.environ.get("PYTHONPATH")]))}
    with open(folder / "train.log", "w") as log:
        subprocess.run(run_command(hidden, iters, out), env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return folder


def read_records(folder: Path) -> list[dict]:
    """Every record of a run's ``rank*.jsonl`` files, ordered by (iteration, rank)."""
    records = [json.loads(line) for path in sorted(Path(folder).glob("rank*.jsonl"))
               for line in path.read_text().splitlines() if line.strip()]
    return sorted(records, key=lambda r: (r["iteration"], r["rank"]))


# ----------------------------------------------------------------------------- plot
def summary(runs: dict[int, list[dict]], real: dict | None) -> dict:
    """The plotted numbers: per width and boundary (sending stage) the shares against iteration;
    per real model and layer its shares."""
    out = {"training": {}, "real": {}, "real_without_first": {}}
    for hidden, records in runs.items():
        for r in records:
            out["training"].setdefault(str(hidden), {}).setdefault(f"{r['rank']}->{r['rank'] + 1}", []).append(
                {"iteration": r["iteration"], "shape": r["shape"], "share": r["share"]})
    for model in (real or {}).get("models", []):
        out["real"][model["name"]] = {str(layer["layer"]): layer["share"] for layer in model["layers"]}
        out["real_without_first"][model["name"]] = {str(layer["layer"]): layer["share_without_first"]
                                                    for layer in model["layers"]}
    return out


def plot(data: dict, png: Path, k: int = 16) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11.5, 4.8))
    styles = {"0->1": "-", "1->2": "--", "2->3": ":"}
    for i, (hidden, links) in enumerate(sorted(data["training"].items(), key=lambda kv: int(kv[0]))):
        for link, points in sorted(links.items()):
            ax.plot([p["iteration"] for p in points], [p["share"][str(k)] for p in points], styles.get(link, "-"),
                    color=f"C{i}", label=f"study, hidden {hidden}, boundary {link}")
    right = max((p["iteration"] for links in data["training"].values() for pts in links.values() for p in pts),
                default=1)
    for j, (name, layers) in enumerate(data["real"].items()):
        shares = [s[str(k)] for s in layers.values()]
        ax.hlines(shares, right * 1.02, right * 1.12, color=f"C{4 + j}", lw=2,
                  label=f"{name}: pipeline boundaries ({min(shares):.2f} to {max(shares):.2f})")
        body = [s[str(k)] for s in data["real_without_first"].get(name, {}).values()]
        if body:
            ax.hlines(body, right * 1.14, right * 1.24, color=f"C{4 + j}", lw=2, linestyles="dotted",
                      label=f"{name}, without the first token ({min(body):.2f} to {max(body):.2f})")
    ax.set_xlabel("training iteration (study); real models on the right")
    ax.set_ylabel(f"energy share of the top {k} principal directions")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("Message energy in the top-16 directions (what lowrank sends apart)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.spectrum", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="one training run with the recording hook")
    r.add_argument("--hidden", type=int, required=True)
    r.add_argument("--iters", type=int, default=150)
    r.add_argument("--every", type=int, default=10, help="record one message per stage every N iterations")
    r.add_argument("--out", type=Path, default=Path("runs/spectrum"))
    g = sub.add_parser("plot", help="docs/data/spectrum.{png,json} from the runs and docs/data/real_activations.json")
    g.add_argument("--out", type=Path, default=Path("runs/spectrum"))
    g.add_argument("--docs", type=Path, default=Path("docs"))
    args = p.parse_args(argv)
    if args.command == "run":
        if args.iters < 1 or args.every < 1:
            p.error("--iters and --every must be >= 1")
        print(run(args.hidden, args.iters, args.every, args.out))
        return 0
    runs = {int(f.name[1:]): read_records(f) for f in sorted(args.out.glob("h*")) if f.is_dir()}
    runs = {h: recs for h, recs in runs.items() if recs}
    data_dir = args.docs / "data"
    real_path = data_dir / "real_activations.json"
    real = json.loads(real_path.read_text()) if real_path.is_file() else None
    data = summary(runs, real)
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "spectrum.json").write_text(json.dumps(data, indent=1) + "\n")
    plot(data, data_dir / "spectrum.png")
    print(data_dir / "spectrum.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
