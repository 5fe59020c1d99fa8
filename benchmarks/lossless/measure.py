"""``python -m benchmarks.lossless``: how many of each preset's wire bytes the lossless coder after it saves.

A codec buffer has a fixed size (``wire_nbytes``), but its codes are not uniformly distributed, so an
entropy coder after the codec carries the same buffer in fewer bytes (``--tah-entropy-coding``:
``megatron_tah.codecs.core.entropy``). Lossless: the decoded tensor is bit-identical, so a codec's steps to a
target loss (docs/SPEEDRUN.md) do not change, only its bytes. This measures what each coder sends and costs
(``--coders``: every coder of ``entropy.CODERS``, its size against the order-0 bound, its encode and decode time and
the link rate below which it pays), what the default coder and ``zlib`` on the host cost against what they save
(``host_entropy``, ``host_zlib``) and the projected T with the coded bytes and the coder's time (``projected``),
on real models' messages (``benchmarks.common.real_activations``: SmolLM2-135M's hidden states after the layers
where PP 4 cuts it, and the gradients of its language-model loss with respect to them), per preset and
direction (the forward codec on the hidden state, the backward codec on its gradient):

* ``order0``: the buffer's order-0 entropy section by section (``buffer_entropy_bits``): a packed-code
  section as symbols of its codec's bits, every other section (scales, zero points, the basis) and the
  header as bytes. What a static per-section entropy coder (Huffman, ANS) approaches, its tables excluded.
* ``coded``: what ``entropy.encode`` with its default coder sends (tables and mode bytes included);
* ``zlib``: the whole buffer through the standard library's ``zlib`` at level 9 (a byte-wise coder on
  bit-packed codes: a library's result, not a bound).

Prints a markdown table; ``--write PAGE`` puts it between ``<!-- lossless:begin -->`` and
``<!-- lossless:end -->`` markers and writes ``docs/data/lossless.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import zlib
from datetime import date
from pathlib import Path

import torch

from megatron_tah.codecs import Codec
from megatron_tah.codecs.core import entropy
from megatron_tah.config import TahConfig, candidate_fields
from megatron_tah.link import frames

from . import coders
from ..common.codec_rows import STUDIED_PRESETS as PRESETS
from .coders import buffer_entropy_bits, entropy_bits  # noqa: F401 (the order-0 bound, read from here too)
from ..common.pages import replace_block
from ..common.runner import host_info
from ..common.real_activations import CACHE, MODELS, boundaries, corpus_text

CANDIDATES = ("channel4_h3", "channel3_h3", "lowrank_h3", "lowrank_h3_t32", "lowrank_h3_rn", "lowrank_g2")
"""The real-model study's candidates near 6 bits both ways (``benchmarks.common.codecs.CODECS``), measured beside the
presets: the coder's bits with the steps their runs measured answer the study's 6-bit goal (docs/REAL_MODEL.md)."""
MODEL = "smollm2-135m"
TOKENS = 1024
DATA = Path("docs/data/lossless.json")
HOST_PRESET = "lowrank_h3_rn"  # the messages the host coders' costs are measured on: the study's leading candidate
SPLIT = 32  # micro-batches of the setup's step the last projection column splits it into (docs/SPEEDRUN.md)


def messages(model: str = MODEL, tokens: int = TOKENS) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{layer: (hidden state, loss gradient)} as ``[tokens, 1, hidden]`` bf16 at ``model``'s PP 4 cuts: one
    forward and backward of the causal language-model loss on the corpus (cached under ``CACHE``)."""
    path = CACHE / f"{model}_{tokens}_grad.pt"
    if path.is_file():
        return torch.load(path)
    entry = MODELS[model]
    tokenizer, net = entry.load()
    net.eval()
    ids = tokenizer(corpus_text(), return_tensors="pt", add_special_tokens=False).input_ids[0, :tokens]
    out = net(ids[None], labels=ids[None], output_hidden_states=True)
    layers = len(out.hidden_states) - 1
    cuts = boundaries(layers)
    for i in cuts:
        out.hidden_states[i].retain_grad()
    (out.loss * tokens).backward()  # the gradient of the summed loss: per-token scale, as a pipeline sends it
    found = {i: (out.hidden_states[i].detach()[0, :, None, :].to(torch.bfloat16).contiguous(),
                 out.hidden_states[i].grad[0, :, None, :].to(torch.bfloat16).contiguous()) for i in cuts}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(found, path)
    return found


def measure(codec: Codec, x: torch.Tensor, coder: str = entropy.DEFAULT_CODER) -> dict:
    """Wire bits per value of ``codec`` on ``x`` and what each lossless coder would send instead (``coded``:
    ``megatron_tah.codecs.core.entropy`` with ``coder``)."""
    buf = codec.encode(x)
    values, shape = x.numel(), tuple(x.shape)
    coded = entropy.encode(codec, buf, shape, x.dtype, coder)
    if not torch.equal(entropy.decode(codec, coded, shape, x.dtype, coder), buf):
        raise RuntimeError(f"the entropy coder did not give back {codec.describe()}'s buffer")
    return {"bits": 8 * buf.numel() / values,
            "order0": buffer_entropy_bits(codec, buf, shape, x.dtype) / values,
            "coded": 8 * coded.numel() / values,
            "zlib": 8 * len(zlib.compress(buf.numpy().tobytes(), 9)) / values}


def _host_cost(found: dict, preset: str, repeats: int, code, uncode) -> dict:
    """What a lossless coder costs on this machine's CPU against what it saves on the slow link, for one
    ``preset`` message each way at the ProtocolNanoGPT shape: ``code(codec, buf, shape)`` -> its bytes and
    ``uncode(codec, coded, shape)`` timed on the preset's buffer of every cut (forward codec on the hidden
    states, backward on the gradients; the best of ``repeats``), their rates scaled to that message."""
    import time

    from ..speedrun import projection, simulate

    config = TahConfig(**fields(preset))
    out = {"preset": preset}
    for direction, codec, index in (("forward", config.forward_codec(), 0), ("backward", config.backward_codec(), 1)):
        raw = coded_nbytes = 0
        compress = decompress = 0.0
        for layer, pair in found.items():
            x = pair[index]
            buf = codec.salt_rounding(f"{preset}.{layer}").encode(x)
            best = [math.inf, math.inf]
            for _ in range(repeats):
                start = time.perf_counter()
                coded = code(codec, buf, tuple(x.shape))
                middle = time.perf_counter()
                uncode(codec, coded, tuple(x.shape))
                best = [min(best[0], middle - start), min(best[1], time.perf_counter() - middle)]
            raw, coded_nbytes = raw + buf.numel(), coded_nbytes + len(coded)
            compress, decompress = compress + best[0], decompress + best[1]
        nbytes = codec.wire_nbytes(projection.SHAPE, torch.bfloat16)
        saved = 1 - coded_nbytes / raw
        out[direction] = {"compress_mb_s": raw / compress / 1e6, "decompress_mb_s": raw / decompress / 1e6,
                          "saved": saved, "message_bytes": nbytes,
                          "coder_ms": 1e3 * nbytes * (compress + decompress) / raw,
                          "link_saved_ms": 1e3 * 8 * nbytes * saved / simulate.BANDWIDTH_BPS}
    return out


def host_zlib(found: dict, preset: str = HOST_PRESET, repeats: int = 3) -> dict:
    """``_host_cost`` of zlib at level 1 (its fastest) on each buffer's bytes."""
    return {**_host_cost(found, preset, repeats, lambda codec, buf, shape: zlib.compress(buf.numpy().tobytes(), 1),
                         lambda codec, coded, shape: zlib.decompress(coded)), "level": 1}


def host_entropy(found: dict, preset: str = HOST_PRESET, repeats: int = 3, coder: str = entropy.DEFAULT_CODER) -> dict:
    """``_host_cost`` of ``megatron_tah.codecs.core.entropy`` with ``coder`` (on this CPU)."""
    dtype = torch.bfloat16
    return {**_host_cost(found, preset, repeats,
                         lambda codec, buf, shape: entropy.encode(codec, buf, shape, dtype, coder),
                         lambda codec, coded, shape: entropy.decode(codec, coded, shape, dtype, coder)),
            "threads": torch.get_num_threads(), "coder": coder}


def fields(name: str) -> dict:
    """The ``TahConfig`` fields of a preset, one of ``auto``'s candidates or a study candidate."""
    from ..common.codecs import CODECS

    return dict(CODECS[name]) if name in CODECS else candidate_fields(name)


def run(model: str = MODEL, presets=None) -> dict:
    """Every preset's and ``CANDIDATES``' forward codec on the hidden states and backward codec on the gradients,
    every cut."""
    found = messages(model)
    rows = []
    for preset in presets or dict.fromkeys((*PRESETS, *CANDIDATES)):  # a candidate that is a preset: once
        config = TahConfig(**fields(preset))
        for direction, codec, index in (("forward", config.forward_codec(), 0),
                                        ("backward", config.backward_codec(), 1)):
            per_cut = {layer: measure(codec.salt_rounding(f"{preset}.{layer}"), pair[index])
                       for layer, pair in found.items()}
            bits = "/".join(str(b) for b in codec.code_sections().values())
            rows.append({"preset": preset, "direction": direction, "codec": f"{codec.name} {bits}-bit",
                         **{k: sum(m[k] for m in per_cut.values()) / len(per_cut)
                            for k in ("bits", "order0", "coded", "zlib")},
                         "by_layer": {str(layer): m for layer, m in per_cut.items()}})
    return {"model": model, "tokens": TOKENS, "cuts": sorted(found), "rows": rows, "host_zlib": host_zlib(found),
            "host_entropy": host_entropy(found),
            "date": date.today().isoformat(), "host": host_info()["cpu"]}


def projected(result: dict, speedrun: Path = Path("docs/data/speedrun.json"), depth: int = 8) -> list[dict]:
    """Each preset whose steps multiplier the speedrun measured (``speedrun``'s table), and each candidate whose
    multiplier the real-model study measured at ``depth`` (``megatron_tah.config.auto.STEPS_MULTIPLIER``),
    projected on the ProtocolNanoGPT setup (``benchmarks.speedrun.projection``) as it is, with its wire bytes
    scaled per direction by the share ``megatron_tah.codecs.core.entropy`` kept of them here plus the frames' margin
    (``--tah-entropy-coding``'s frames hold the largest of a link's recent coded sizes plus ``frames.MARGIN``), and
    with that coder's encode and decode time too (``host_entropy``'s rates on this CPU, per byte of codec buffer,
    added on the sender and the receiver as the codec's own time is)."""
    from megatron_tah.config.auto import STEPS_MULTIPLIER

    from ..speedrun import projection

    measured = {row["codec"]: (row["multiplier"], "the toy speedrun") for row in
                json.loads(speedrun.read_text())["table"] if row.get("multiplier") and row["codec"] in PRESETS}
    for name, multiplier in STEPS_MULTIPLIER.get(depth, {}).items():
        if name in CANDIDATES and name not in measured:
            measured[name] = (multiplier, f"the real-model study at depth {depth}")
    share = {}
    for row in result["rows"]:
        share.setdefault(row["preset"], {})[row["direction"]] = row["coded"] / row["bits"] * (1 + frames.MARGIN)
    codecs = {name: projection.CODECS[name] for name in measured if name in share and name in projection.CODECS}
    scale = {name: (share[name]["forward"], share[name]["backward"]) for name in codecs}
    host = result["host_entropy"]
    per_byte = tuple(projection.CodecTime(1e-6 / host[d]["compress_mb_s"], 1e-6 / host[d]["decompress_mb_s"],
                                          f"{host['coder']} on the host") for d in ("forward", "backward"))
    timed = {name: per_byte for name in codecs}
    steps = {name: m for name, (m, _) in measured.items()}
    as_is = {r["codec"]: r for r in projection.project(steps, codecs)}
    coded = {r["codec"]: r for r in projection.project(steps, codecs, byte_scale=scale)}
    paid = {r["codec"]: r for r in projection.project(steps, codecs, byte_scale=scale, coder_seconds_per_byte=timed)}
    split = {r["codec"]: r for r in projection.project(steps, codecs, byte_scale=scale, micro_batches=SPLIT,
                                                        coder_seconds_per_byte=timed)}
    return [{"preset": name, "multiplier": measured[name][0], "multiplier_from": measured[name][1],
             "bits": as_is[name]["forward_bits"] + as_is[name]["backward_bits"],
             "bits_coded": coded[name]["forward_bits"] + coded[name]["backward_bits"],
             "s_per_step": as_is[name]["s_per_step"], "s_per_step_coded": coded[name]["s_per_step"],
             "s_per_step_coder_time": paid[name]["s_per_step"], "T": as_is[name]["T"], "T_coded": coded[name]["T"],
             "T_coder_time": paid[name]["T"], "split": SPLIT, "T_coded_split": split[name]["T"]}
            for name in codecs]


def table(result: dict) -> str:
    """The measured block: how it was measured, one row per preset and direction, both directions summed."""
    desc = MODELS[result["model"]].description
    lines = [f"Measured by `python -m benchmarks.lossless --write docs/CODECS.md` ({result['date']}, after `make "
             f"real-models`): {desc}, "
             f"the first {result['tokens']} tokens of the shipped corpus; each preset's (and the real-model study's "
             "candidates near 6 bits both ways: " + ", ".join(f"`{c}`" for c in CANDIDATES) + ") forward codec on the hidden "
             f"state after layers {', '.join(map(str, result['cuts']))} and its backward codec on the language-model "
             f"loss's gradient there (`[{result['tokens']}, 1, hidden]` bf16; means over the cuts). Bits per value; "
             "*order-0*: each section's order-0 entropy (codes as symbols of their bits, the rest as bytes); "
             f"*coded*: what `megatron_tah.codecs.core.entropy` sent with its default coder (`{entropy.DEFAULT_CODER}`, "
             "each section coded on its own, its tables included; decoded back bit for bit); "
             "*zlib*: the buffer through zlib level 9.", "",
             "| preset | direction | codec | wire bits | order-0 | saved | coded | saved | zlib | saved |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    both: dict[str, list[float]] = {}
    for row in result["rows"]:
        saved = lambda k: f"{1 - row[k] / row['bits']:.0%}"  # noqa: E731
        lines.append(f"| {row['preset']} | {row['direction']} | {row['codec']} | {row['bits']:.2f} | "
                     f"{row['order0']:.2f} | {saved('order0')} | {row['coded']:.2f} | {saved('coded')} | "
                     f"{row['zlib']:.2f} | {saved('zlib')} |")
        sums = both.setdefault(row["preset"], [0.0, 0.0, 0.0])
        sums[0] += row["bits"]
        sums[1] += row["order0"]
        sums[2] += row["coded"]
    lines += ["", "Both directions together (wire bits -> order-0 / coded): " + "; ".join(
        f"{p} {b:.2f} -> {o:.2f} / {c:.2f} ({1 - c / b:.0%} fewer coded)" for p, (b, o, c) in both.items()) + "."]
    if result.get("projected"):
        coder = result["host_entropy"]["coder"]
        lines += ["", "On the ProtocolNanoGPT setup (docs/SPEEDRUN.md's projection: `[1024, 8, 1024]` messages, 8 stages, "
                  "200 Mb/s, 50 ms), each direction's wire bytes scaled by the coded share above (measured at 1024 x "
                  f"576) and the frames' {frames.MARGIN:.0%} margin; *and its time*: the {coder} coder's encode and "
                  f"decode added to the codec's on the sender and the receiver, at the rates measured below on "
                  f"{result.get('host', 'this CPU')} (one thread; the codec's own time is the H100's, so this is a GPU "
                  "codec with the coder on its host). Steps: the bf16 record's 2,925 x the multiplier, from where it "
                  "was measured:", "",
                  "| preset | steps multiplier | bits both ways | coded | s/step | coded | coded, and its time | "
                  f"T (s) | coded | coded, and its time | coded and its time, {SPLIT} micro-batches |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['preset']} | {r['multiplier']:.2f}x ({r.get('multiplier_from', 'the toy speedrun')}) | "
                  f"{r['bits']:.2f} | {r['bits_coded']:.2f} | {r['s_per_step']:.2f} | {r['s_per_step_coded']:.2f} | "
                  f"{r.get('s_per_step_coder_time', float('nan')):.2f} | {r['T']:,.0f} | {r['T_coded']:,.0f} | "
                  f"{r.get('T_coder_time', float('nan')):,.0f} | {r['T_coded_split']:,.0f} |" for r in result["projected"]]
        from ..speedrun.projection import SETUP as setup

        sequences = setup.micro_batch * setup.micro_batches
        lines += ["", f"The last column also splits the step's {sequences} sequences into {SPLIT} micro-batches of "
                  f"{sequences // SPLIT} instead of {setup.micro_batches} of {setup.micro_batch} (docs/SPEEDRUN.md, "
                  f"\"Fewer, larger micro-batches\")."]
    if result.get("host_zlib"):
        lines += ["", host_zlib_text(result["host_zlib"], result.get("host", "this CPU"))]
    if result.get("host_entropy"):
        lines += ["", host_entropy_text(result["host_entropy"], result.get("host", "this CPU"))]
    return "\n".join(lines)


def _cost_parts(h: dict, coder: str) -> str:
    return "; ".join(f"{d} ({h[d]['message_bytes'] / 1e6:.2f} MB): {coder} saves {h[d]['saved']:.0%}, "
                     f"{h[d]['link_saved_ms']:.0f} ms of the 200 Mb/s link, and costs {h[d]['coder_ms']:.0f} ms to "
                     f"compress ({h[d]['compress_mb_s']:.0f} MB/s) and decompress ({h[d]['decompress_mb_s']:.0f} MB/s)"
                     for d in ("forward", "backward"))


def _pays(h: dict) -> bool:
    return all(h[d]["coder_ms"] < h[d]["link_saved_ms"] for d in ("forward", "backward"))


def host_zlib_text(h: dict, host: str) -> str:
    """zlib's cost on the whole buffer against its saving, one sentence per direction: the general-purpose
    yardstick the entropy coder below is measured against."""
    pays = _pays(h)
    return (f"zlib on the whole buffer {'pays' if pays else 'does not pay'}. zlib at level {h['level']} (its fastest) "
            f"on one core of {host}, per `{h['preset']}` message at `[1024, 8, 1024]`: " + _cost_parts(h, "zlib")
            + ". It sees the codes bit-packed, where they straddle bytes; the entropy coder below codes them as "
            "symbols.")


def host_entropy_text(h: dict, host: str) -> str:
    """This project's coder's cost on the CPU against its saving, one sentence per direction."""
    pays = _pays(h)
    verdict = "pays" if pays else "does not pay"
    threads = f"{h['threads']} thread" + ("s" if h["threads"] != 1 else "")
    return (f"`megatron_tah.codecs.core.entropy` with its {h.get('coder', 'huffman')} coder on {host} ({threads}) "
            f"{verdict} on the setup's 200 Mb/s link, per `{h['preset']}` message at `[1024, 8, 1024]`: "
            + _cost_parts(h, "it") + ".")


CODERS_DATA = Path("docs/data/lossless_coders.json")
CODER_PRESETS = ("lowrank_h3_rn", "lowrank", "hadint4", "paper")  # the study's leading candidate and presets


def coders_report(model: str = MODEL, presets=None, write: Path | None = None, only: bool = False) -> str:
    """``benchmarks.lossless.coders``' rows for ``presets`` (default ``CODER_PRESETS``) on ``model``'s messages at both
    shapes; with ``write``, its ``lossless_coders`` block and ``CODERS_DATA`` (``only``: run as ``--coders``)."""
    found = messages(model)
    names = presets or CODER_PRESETS
    result = {"model": model, "date": date.today().isoformat(), "host": host_info()["cpu"],
              "threads": torch.get_num_threads(),
              "rows": coders.rows(found, {name: TahConfig(**fields(name)) for name in names})}
    command = "python -m benchmarks.lossless" + (" --coders" if only else "") + (f" --write {write}" if write else "")
    block = coders.table(result["rows"], f"{result['host']} ({result['date']})", command)
    if write:
        CODERS_DATA.write_text(json.dumps(result, indent=1) + "\n")
        write.write_text(replace_block(write.read_text(), "lossless_coders", block))
    return block


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=MODEL, choices=sorted(MODELS))
    parser.add_argument("--presets", default=None, help="comma list (default: every preset)")
    parser.add_argument("--write", type=Path, default=None, help="the page whose lossless block to replace")
    parser.add_argument("--coders", action="store_true", help="only each coder's size, time and break-even rate per "
                        "preset and shape (its own block and docs/data/lossless_coders.json)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # one core: the coders' rates per core
    coder_block = coders_report(args.model, args.presets.split(",") if args.presets else None, args.write, args.coders)
    print(coder_block)
    if args.coders:
        return
    result = run(args.model, args.presets.split(",") if args.presets else None)
    result["projected"] = projected(result)
    block = table(result)
    print(block)
    if args.write:
        DATA.write_text(json.dumps(result, indent=1) + "\n")
        args.write.write_text(replace_block(args.write.read_text(), "lossless", block))
    if not math.isfinite(sum(r["order0"] for r in result["rows"])):
        raise SystemExit("a non-finite entropy: see the table")
