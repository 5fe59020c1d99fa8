"""``python -m benchmarks.transfer``: a codec's round-trip error on the speedrun's toy model against a real model's.

The speedrun (docs/SPEEDRUN.md) measures steps to target on a toy GPT (8 layers of width 128) and projects them
onto the ProtocolNanoGPT setup. A steps multiplier carries over only as far as the codec's errors do: a codec
whose error on a real model's messages is well above its error on the toy's was judged on easier data. Per
speedrun codec and direction, this measures the mean relative round-trip error ``||y - x|| / ||x||`` and the
share of the messages' energy in their top 16 principal directions (what ``lowrank`` sends apart), both over
the tokens after a sequence's first (SmolLM2's first token is an attention sink whose norm dwarfs the others':
with it, a message's error is mostly that token's; the codec still codes the whole message):

* toy: the messages entering the codecs in a bf16 speedrun loss run (``benchmarks.depth`` boundaries after
  layers 1-7, seed 1234, the first micro-batch of iterations ``CAPTURE_AT``), activations forward and
  activation gradients backward (``capture``: about 6 minutes on 2 cores, kept under ``--toy``);
* real: SmolLM2-135M's hidden states after layers 7, 15 and 22 and its language-model loss's gradients
  there, 1024 tokens of the shipped corpus (``benchmarks.lossless.measure.messages``; ``make real-models``).

One codec object per boundary and direction, fed that boundary's messages in order (``lowrank`` tracks its basis
across them, as on a link; stochastic rounding salted per boundary). Prints the table; ``--write PAGE`` replaces
the page's ``<!-- transfer:begin -->`` block and writes ``docs/data/transfer.json`` (the results and that block).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections import defaultdict
from datetime import date
from pathlib import Path

import torch

from megatron_tah.config import TahConfig

from ..common.pages import replace_block
from ..common.energy import energy_share
from ..common.score import missed_text

CAPTURE_AT = (100, 250, 400)  # iterations of the 500-step schedule whose first micro-batch is captured
SEED = 1234
TOY_SHAPE = (64, 1, 128)
REAL_SHAPE = (1024, 1, 576)
SKIP = ("bf16", "auto")  # uncompressed; chooses per link (no fixed codec to measure)
DATA = Path("docs/data/transfer.json")
OPTIMISTIC = 1.5  # real error / toy error above which the toy judged a direction on easier data
DIRECTIONS = ("forward", "backward")
_NAME = re.compile(r"i(\d+)_b(\d+)_(forward|backward)_(\d+)\.pt")


def capture_command(toy: Path, out: Path, python: str = sys.executable) -> list[str]:
    """The bf16 speedrun loss run (full size, ``SEED``) that saves its messages and its log under ``toy`` and stops
    after the last iteration of ``CAPTURE_AT`` (Megatron's ``--exit-interval``); its data prepared under ``out``."""
    from ..speedrun import runs

    size = runs.SIZES["full"]
    prefix, vocab = runs.prepare_data(out, size)
    run = runs.loss_run("bf16", SEED, size, runs.data_flags(prefix, vocab), emulated=True)
    command = run.command(toy, python)  # its log beside the messages, not over the speedrun's run of that name
    cut = command.index("--")
    ours = ["--capture", str(toy), "--capture-at", ",".join(map(str, CAPTURE_AT))]
    # Megatron exits once a step brings its count to a multiple of the interval: after the step numbered max
    return [*command[:cut], *ours, *command[cut:], "--exit-interval", str(max(CAPTURE_AT) + 1)]


def toy_messages(folder: Path) -> dict[tuple[int, str], list[torch.Tensor]]:
    """{(boundary, direction): its captured messages in iteration order} from ``folder``."""
    found = defaultdict(list)
    for path in folder.glob("*.pt"):
        match = _NAME.fullmatch(path.name)
        if match:
            iteration, layer, direction, n = match.groups()
            found[(int(layer), direction)].append(((int(iteration), int(n)), path))
    if not found:
        raise FileNotFoundError(f"no captured messages (i<iteration>_b<layer>_<direction>_<n>.pt) in {folder}")
    return {key: [torch.load(path) for _, path in sorted(items)] for key, items in sorted(found.items())}


def real_messages() -> dict[tuple[int, str], list[torch.Tensor]]:
    """{(layer, direction): [message]} of SmolLM2-135M (``benchmarks.lossless.measure.messages``)."""
    from ..lossless.measure import messages

    return {(layer, direction): [pair[i]] for layer, pair in sorted(messages().items())
            for i, direction in enumerate(DIRECTIONS)}


def measure(fields: dict, found: dict[tuple[int, str], list[torch.Tensor]]) -> dict[str, float]:
    """Mean relative round-trip error per direction of ``TahConfig(**fields)``'s codecs over ``found``'s messages."""
    config, errors = TahConfig(**fields), defaultdict(list)
    for (layer, direction), xs in found.items():
        codec = (config.forward_codec() if direction == "forward" else config.backward_codec())
        codec = codec.salt_rounding(f"{direction}:{layer}")
        for x in xs:
            xf = x.float()[1:]  # [sequence, batch, hidden]: the tokens after the first
            y = codec.decode(codec.encode(x), x.shape, x.dtype).float()[1:]
            errors[direction].append(float((y - xf).norm() / xf.norm()))
    return {d: sum(v) / len(v) for d, v in errors.items()}


def shares(found: dict[tuple[int, str], list[torch.Tensor]], k: int = 16) -> dict[str, float]:
    """Mean share of the messages' energy in their top ``k`` principal directions, per direction."""
    out = defaultdict(list)
    for (_, direction), xs in found.items():
        out[direction] += [energy_share(x.float()[1:], (k,))[k] for x in xs]
    return {d: sum(v) / len(v) for d, v in out.items()}


def bits(fields: dict, shape) -> dict[str, float]:
    config = TahConfig(**fields)
    n = torch.Size(shape).numel()
    return {d: 8 * codec.wire_nbytes(shape, torch.bfloat16) / n
            for d, codec in zip(DIRECTIONS, (config.forward_codec(), config.backward_codec()))}


def run(toy: dict, real: dict, codecs: dict[str, dict], speedrun: dict | None = None) -> dict:
    """One row per codec: bits, errors and their ratio per direction, and the speedrun's steps multiplier."""
    steps = {r["codec"]: r for r in (speedrun or {}).get("table", [])}
    rows = []
    for name, fields in codecs.items():
        if name in SKIP:
            continue
        on_toy, on_real = measure(fields, toy), measure(fields, real)
        row = {"codec": name, "toy_bits": bits(fields, TOY_SHAPE), "real_bits": bits(fields, REAL_SHAPE),
               "toy_error": on_toy, "real_error": on_real,
               "ratio": {d: on_real[d] / on_toy[d] for d in DIRECTIONS}}
        measured = steps.get(name, {})
        row["multiplier"] = measured.get("multiplier")
        row["missed_within"] = measured.get("missed_within")
        rows.append(row)
    return {"rows": rows, "toy_share16": shares(toy), "real_share16": shares(real),
            "capture_at": list(CAPTURE_AT), "seed": SEED, "date": date.today().isoformat()}


def _steps(row: dict) -> str:
    if row.get("multiplier"):
        return f"{row['multiplier']:.2f}x"
    if row.get("missed_within"):
        return missed_text(row["missed_within"])
    return "not run"


def table(result: dict) -> str:
    """The measured block: how it was measured, one row per codec, and what it says."""
    toy, real = result["toy_share16"], result["real_share16"]
    lines = [f"Measured by `python -m benchmarks.transfer --write docs/CODECS.md` ({result['date']}): each speedrun "
             f"codec's mean relative round-trip error on the toy's messages (a bf16 speedrun loss run, seed "
             f"{result['seed']}, boundaries after layers 1-7, the first micro-batch of iterations "
             f"{', '.join(map(str, result['capture_at']))}: `{list(TOY_SHAPE)}`) and on SmolLM2-135M's (after layers "
             f"7, 15, 22, the language-model loss's gradients there: `{list(REAL_SHAPE)}`), over the tokens after "
             "the first (SmolLM2's first token is an attention sink); bits per value at those shapes. Leaving out "
             "the first token, the top 16 principal directions hold "
             f"{toy['forward']:.2f} of the toy's activations' energy and {toy['backward']:.2f} of its gradients', "
             f"{real['forward']:.2f} and {real['backward']:.2f} of SmolLM2's.", "",
             "| codec | forward bits toy / real | forward error toy / real | backward bits toy / real | "
             "backward error toy / real | steps vs bf16 (speedrun) |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        cells = []
        for d in DIRECTIONS:
            flag = f" **({r['ratio'][d]:.1f}x)**" if r["ratio"][d] > OPTIMISTIC else ""
            cells += [f"{r['toy_bits'][d]:.2f} / {r['real_bits'][d]:.2f}",
                      f"{r['toy_error'][d]:.3f} / {r['real_error'][d]:.3f}{flag}"]
        lines.append(f"| {r['codec']} | " + " | ".join(cells) + f" | {_steps(r)} |")
    held = [f"`{r['codec']}`" for r in result["rows"] if all(r["ratio"][d] <= OPTIMISTIC for d in DIRECTIONS)]
    lines += ["", f"In bold: a real error more than {OPTIMISTIC}x the toy's (the factor in brackets). There the speedrun "
              "judged the codec on messages it codes better than a real model's, so its steps multiplier probably "
              "understates what a real model needs. Both directions hold up for "
              + (" and ".join([", ".join(held[:-1]), held[-1]] if len(held) > 1 else held) or "no codec") + "."]
    return "\n".join(lines)


def main(argv=None) -> None:
    from ..common.codecs import CODECS

    parser = argparse.ArgumentParser(prog="python -m benchmarks.transfer", description=__doc__.split("\n")[0])
    parser.add_argument("--toy", type=Path, default=Path("runs/transfer/toy"),
                        help="folder of the toy's captured messages (captured first if it holds none)")
    parser.add_argument("--out", type=Path, default=Path("runs/speedrun"), help="where the speedrun's data is")
    parser.add_argument("--codecs", default=",".join(c for c in CODECS if c not in SKIP))
    parser.add_argument("--write", type=Path, help="the page whose transfer block to replace")
    args = parser.parse_args(argv)
    if not any(args.toy.glob("*.pt")):
        command = capture_command(args.toy, args.out)
        print("capturing the toy's messages:", " ".join(command), flush=True)
        subprocess.run(command, check=True)
    unknown = [c for c in args.codecs.split(",") if c not in CODECS]
    if unknown:
        raise SystemExit(f"unknown codecs {unknown}: choose from {', '.join(CODECS)}")
    speedrun = Path("docs/data/speedrun.json")
    result = run(toy_messages(args.toy), real_messages(), {c: CODECS[c] for c in args.codecs.split(",")},
                 json.loads(speedrun.read_text()) if speedrun.is_file() else None)
    block = table(result)
    print(block)
    if args.write:
        DATA.write_text(json.dumps({**result, "table": block}, indent=1) + "\n")  # the page's figures on record
        args.write.write_text(replace_block(args.write.read_text(), "transfer", block))


if __name__ == "__main__":
    main()
