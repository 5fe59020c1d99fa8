"""``python -m benchmarks.codec_report --real``: every codec's bits and error on real models' hidden states.

For each model of ``benchmarks.common.real_activations.MODELS`` (or ``--models``) and each of its pipeline
boundaries (the layers after which PP 2 / PP 4 would cut it), the captured message ``[1024, 1, hidden]``
bf16 goes through every row of :func:`rows`: the codec table's stateless rows, Hadamard INT at 3 to 6
bits (the per-bit reference), and each of ``PRESETS``' forward codec as ``TahConfig`` builds it.
Measured per row: bits per value on the wire (header included), the relative error
``||x - y|| / ||x||`` over the message (fp64; the parity study's ``link_rel_error``), the mean over
tokens of ``||x_t - y_t|| / ||x_t||`` (one token of huge norm -- SmolLM2's first, an attention sink --
does not decide it), and for each preset whether both its errors are at most Hadamard INT's at the same
bits (log-linear between the 3..6-bit points). Also the energy share of the message's top-k principal
directions (``benchmarks.common.energy.energy_share``), with and without the message's first token.

Writes ``docs/data/real_activations.json``, ``docs/real_activations.md`` and ``docs/data/real_activations.png``
(error against bits per model and layer, each layer's frontier drawn through its Pareto-optimal rows).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import torch

from megatron_tah.codecs import Codec, get_codec, load_all_codecs
from megatron_tah.config import candidate_fields

from ..common.codec_rows import STUDIED_PRESETS
from ..common.energy import energy_share



def _forward_fields(preset: str) -> dict:
    from megatron_tah.config import PRESETS as PRODUCT_PRESETS

    return {k: v for k, v in PRODUCT_PRESETS[preset].fields.items() if "backward" not in k}


def _own_forward(name: str, earlier: tuple[str, ...]) -> bool:
    from megatron_tah.config import PRESETS as PRODUCT_PRESETS

    return name not in PRODUCT_PRESETS or all(_forward_fields(name) != _forward_fields(q) for q in earlier
                                              if q in PRODUCT_PRESETS)


PRESETS = tuple(p for i, p in enumerate(STUDIED_PRESETS) if _own_forward(p, STUDIED_PRESETS[:i]))
"""The report's "preset" rows: ``STUDIED_PRESETS``' forward codecs, less a ``--tah-preset`` that sends with an earlier
preset's (``lowrank_h3_rn``: ``lowrank``'s; docs/CODECS.md names whose)."""
HADINT_BITS = (3, 4, 5, 6)
ERRORS = ("rel_error", "token_rel_error")


def rows() -> list[tuple[str, Callable[[], Codec]]]:
    """(label, codec factory) in table order: the codec table's rows, hadint 3..6 bits, the presets' forward."""
    from megatron_tah.config import TahConfig

    from ..common.codec_rows import stateless_rows

    load_all_codecs()
    out = [(label, lambda n=name, o=options: get_codec(n, **o)) for label, name, options in stateless_rows()]
    labels = {label for label, _ in out}
    out += [(f"hadint {b}b/64", lambda b=b: get_codec("hadint", bits=b, tile_size=64)) for b in HADINT_BITS
            if f"hadint {b}b/64" not in labels]
    out += [(f"preset {p}", lambda p=p: TahConfig(**candidate_fields(p)).forward_codec()) for p in PRESETS]
    return out


def _errors(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    x64, d = x.double().reshape(-1, x.shape[-1]), (y.double() - x.double()).reshape(-1, x.shape[-1])
    per_token = d.norm(dim=1) / x64.norm(dim=1).clamp_min(1e-30)
    return (d.norm() / x64.norm()).item(), per_token.mean().item()


def measure_message(x: torch.Tensor, table=None) -> list[dict]:
    """One dict per row: label, bits, rel_error, token_rel_error."""
    out = []
    for label, make in table or rows():
        codec = make()
        buf = codec.encode(x)
        if buf.numel() != codec.wire_nbytes(x.shape, x.dtype):
            raise RuntimeError(f"{label}: encode gave {buf.numel()} bytes, wire_nbytes says "
                               f"{codec.wire_nbytes(x.shape, x.dtype)}")
        rel, tok = _errors(x, codec.decode(buf, x.shape, x.dtype))
        out.append({"label": label, "bits": codec.bits_per_element(buf.numel(), x.shape), "rel_error": rel,
                    "token_rel_error": tok})
    return out


def hadint_error_at(points: list[dict], bits: float, key: str = "rel_error") -> float:
    """Hadamard INT's error at ``bits``, log-linear between its measured points (extrapolated at the ends)."""
    pts = sorted((p["bits"], math.log(max(p[key], 1e-30))) for p in points if p["label"].startswith("hadint ")
                 and "stochastic" not in p["label"])
    if len(pts) < 2:
        raise ValueError("need Hadamard INT at two bit widths at least")
    i = max(1, min(len(pts) - 1, next((j for j, (b, _) in enumerate(pts) if b >= bits), len(pts) - 1)))
    (b0, e0), (b1, e1) = pts[i - 1], pts[i]
    return math.exp(e0 + (e1 - e0) * (bits - b0) / (b1 - b0))


def pareto(points: list[dict], key: str = "rel_error") -> list[dict]:
    """The rows no other row beats on both bits and error (fewer or equal bits with less error), by bits."""
    front, best = [], math.inf
    for p in sorted(points, key=lambda p: (p["bits"], p[key])):
        if p[key] < best:
            front.append(p)
            best = p[key]
    return front


def measure(models: dict[str, tuple[int, dict[int, torch.Tensor]]], table=None) -> dict:
    """``{"models": [{"name", "layers": int, ... "layers": [{layer, shape, share, rows, presets}]}]}``."""
    result = {"models": []}
    table = table or rows()
    presets_only = [(label, make) for label, make in table if label.startswith("preset ")]
    for name, (num_layers, messages) in models.items():
        layers = []
        for layer, x in sorted(messages.items()):
            measured = measure_message(x, table)
            # the presets again on the message without its first token (an attention sink in decoder LMs)
            without = {p["label"]: p for p in measure_message(x[1:], presets_only)}
            presets = {}
            for p in measured:
                if p["label"].startswith("preset "):
                    ref = {key: hadint_error_at(measured, p["bits"], key) for key in ERRORS}
                    presets[p["label"][7:]] = {
                        "bits": p["bits"], **{key: p[key] for key in ERRORS},
                        **{f"hadint_{key}_at_bits": ref[key] for key in ERRORS},
                        # (1 + 1e-9): hadint4 against its own point, through exp(log(.))
                        "as_good_per_bit": all(p[key] <= ref[key] * (1 + 1e-9) for key in ERRORS),
                        "token_rel_error_without_first": without[p["label"]]["token_rel_error"]}
            layers.append({"layer": layer, "shape": list(x.shape),
                           "share": {str(k): s for k, s in energy_share(x.float()).items()},
                           "share_without_first": {str(k): s for k, s in energy_share(x[1:].float()).items()},
                           "rows": measured, "presets": presets})
        result["models"].append({"name": name, "num_layers": num_layers, "layers": layers})
    return result


def markdown(result: dict, descriptions: dict[str, str] | None = None) -> str:
    lines = ["# Codecs on real activations", "",
             "Generated by `python -m benchmarks.codec_report --real` (see `benchmarks/codec_report/real.py`). Messages: "
             "the hidden state after a model's layer L for the first 1024 tokens of the shipped Shakespeare corpus, "
             "as a `[1024, 1, hidden]` bf16 tensor; L = the cuts of PP 4 (and PP 2 at the middle). *rel. error*: "
             "over the message; *token error*: mean over tokens; *top-16 share*: energy in the message's 16 "
             "principal directions. A preset is *as good per bit* as Hadamard INT when both its errors are at "
             "most Hadamard INT's at the same bits (log-linear between 3, 4, 5 and 6 bits).", ""]
    for model in result["models"]:
        lines += [f"## {model['name']}", ""]
        if descriptions and model["name"] in descriptions:
            lines += [descriptions[model["name"]], ""]
        for layer in model["layers"]:
            lines += [f"### after layer {layer['layer']} of {model['num_layers']} (top-16 share "
                      f"{layer['share']['16']:.3f}, top-8 {layer['share']['8']:.3f}; without the first token "
                      f"{layer['share_without_first']['16']:.3f} and {layer['share_without_first']['8']:.3f})", "",
                      "| codec | bits/value | rel. error | token error |", "|---|---|---|---|"]
            lines += [f"| {r['label']} | {r['bits']:.3f} | {r['rel_error']:.3e} | {r['token_rel_error']:.3e} |"
                      for r in layer["rows"]]
            lines += ["", "| preset | bits | rel. error | Hadamard INT's at those bits | token error | "
                      "Hadamard INT's at those bits | as good per bit | token error, message without its first token |",
                      "|---|---|---|---|---|---|---|---|"]
            lines += [f"| {n} | {p['bits']:.3f} | {p['rel_error']:.3e} | {p['hadint_rel_error_at_bits']:.3e} | "
                      f"{p['token_rel_error']:.3e} | {p['hadint_token_rel_error_at_bits']:.3e} | "
                      f"{'yes' if p['as_good_per_bit'] else 'no'} | {p['token_rel_error_without_first']:.3e} |"
                      for n, p in layer["presets"].items()]
            lines.append("")
    lines += ["## Presets over every model and layer", "", *summary_table(result)]
    return "\n".join(lines) + "\n"


def summary_table(result: dict) -> list[str]:
    """Per preset and model: bits, both errors (ranges over the layers) and the per-bit verdict."""
    lines = ["| preset | model | bits | rel. error | token error | as good per bit as Hadamard INT | "
             "token error without the first token |", "|---|---|---|---|---|---|---|"]
    for model in result["models"]:
        for name, s in preset_summary({"models": [model]}).items():
            lines.append(f"| {name} | {model['name']} | {_range(s['bits'], '.2f')} | {_range(s['rel_error'])} | "
                         f"{_range(s['token_rel_error'])} | {s['as_good']} of {s['layers']} layers | "
                         f"{_range(s['token_rel_error_without_first'])} |")
    return lines


def _range(lo_hi: list[float], spec: str = ".3f") -> str:
    lo, hi = (format(v, spec) for v in lo_hi)
    return lo if lo == hi else f"{lo} to {hi}"


def preset_summary(result: dict) -> dict[str, dict]:
    """Per preset over every model and layer: [min, max] of bits and of each error, layers as good per bit."""
    out = {}
    for model in result["models"]:
        for layer in model["layers"]:
            for name, p in layer["presets"].items():
                keys = ("bits", *ERRORS, "token_rel_error_without_first")
                s = out.setdefault(name, {**{k: [math.inf, -math.inf] for k in keys}, "as_good": 0, "layers": 0})
                for key in keys:
                    s[key] = [min(s[key][0], p[key]), max(s[key][1], p[key])]
                s["as_good"] += int(p["as_good_per_bit"])
                s["layers"] += 1
    return out


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    fig, axes = plt.subplots(2, len(models), figsize=(6.5 * len(models), 9.5), squeeze=False)
    for (ax, model), key in [(a, k) for k, row in zip(ERRORS, axes) for a in zip(row, models)]:
        for i, layer in enumerate(model["layers"]):
            pts = [r for r in layer["rows"] if r["bits"] < 16]
            ax.scatter([r["bits"] for r in pts], [r[key] for r in pts], s=14, color=f"C{i}", alpha=0.6)
            front = pareto(pts, key)
            ax.plot([r["bits"] for r in front], [r[key] for r in front], "-", color=f"C{i}",
                    label=f"after layer {layer['layer']}: frontier")
            for name, p in layer["presets"].items():
                ax.scatter([p["bits"]], [p[key]], marker="*", s=90, color=f"C{i}", edgecolor="k")
                if i == 0:
                    ax.annotate(name, (p["bits"], p[key]), fontsize=7, xytext=(4, 4), textcoords="offset points")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bits per value on the wire")
        ax.set_ylabel("relative error over the message" if key == "rel_error" else "relative error, mean over tokens")
        ax.set_title(f"{model['name']} ({model['num_layers']} layers): presets starred")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def write(result: dict, docs: Path, descriptions: dict[str, str] | None = None) -> list[Path]:
    (docs / "data").mkdir(parents=True, exist_ok=True)
    paths = [docs / "data" / "real_activations.json", docs / "real_activations.md",
             docs / "data" / "real_activations.png"]
    paths[0].write_text(json.dumps(result, indent=1) + "\n")
    paths[1].write_text(markdown(result, descriptions))
    plot(result, paths[2])
    return paths


def main(models: list[str], tokens: int, docs: Path) -> int:
    from ..common import real_activations

    captured = {name: real_activations.capture(name, tokens) for name in models}
    result = measure(captured)
    result["tokens"] = tokens
    descriptions = {name: real_activations.MODELS[name].description for name in models}
    for model in result["models"]:
        model["description"] = descriptions[model["name"]]
    for path in write(result, docs, descriptions):
        print(path)
    print("\n".join(summary_table(result)))
    return 0


def parity_section(docs: Path) -> list[str]:
    """docs/PARITY.md's section on real activations and the spectrum (from ``docs/data/real_activations.json``
    and ``docs/data/spectrum.json``; empty when neither was written)."""
    docs = Path(docs)
    real_path, spec_path = docs / "data" / "real_activations.json", docs / "data" / "spectrum.json"
    if not real_path.is_file() and not spec_path.is_file():
        return []
    lines = ["## Real activations and the spectrum of messages", ""]
    if real_path.is_file():
        result = json.loads(real_path.read_text())
        lines += ["Every codec and each preset's forward codec on hidden states of real pretrained models "
                  f"(`python -m benchmarks.codec_report --real`; per layer: [real_activations.md](real_activations.md)): "
                  f"{result.get('tokens', 1024)} tokens of the shipped Shakespeare corpus as one `[tokens, 1, hidden]` "
                  "bf16 message, cut where PP 4 would cut the model. " + "; ".join(
                      f"{m['name']}: {m.get('description', '')}" for m in result["models"]) + ". *rel. error* is "
                  "over the message (as the study's link error), *token error* the mean over tokens; *as good "
                  "per bit*: both at most Hadamard INT's at the same bits.", "", *summary_table(result)]
        lines += ["", "The forward error at which the low-noise protocol's gap reaches 0.5% is in *The forward's "
                  "gap against its bits* above; compare it with this table's errors."]
        lines += ["", "![error against bits on real activations](data/real_activations.png)", ""]
    if spec_path.is_file():
        data = json.loads(spec_path.read_text())
        lines += ["Energy share of a message's top 16 principal directions (what `lowrank` sends apart; "
                  "`benchmarks/spectrum/`): the study's uncompressed compact-protocol run (seed 1234) per width "
                  "and boundary against iteration, next to the real models' boundaries. Runs: "
                  "`python -m benchmarks.spectrum run --hidden H --iters 300` for H in "
                  + ", ".join(sorted(data["training"], key=int)) + "; `python -m benchmarks.spectrum plot`.", "",
                  "| messages | top-8 share | top-16 share | top-16 share without the first token |",
                  "|---|---|---|---|"]
        for hidden, links in sorted(data["training"].items(), key=lambda kv: int(kv[0])):
            late = [p for pts in links.values() for p in pts if p["iteration"] >= max(q["iteration"] for q in pts) / 2]
            lo16, hi16 = min(p["share"]["16"] for p in late), max(p["share"]["16"] for p in late)
            lo8, hi8 = min(p["share"]["8"] for p in late), max(p["share"]["8"] for p in late)
            lines.append(f"| study, hidden {hidden}, second half of training, every boundary | {lo8:.3f} to {hi8:.3f} "
                         f"| {lo16:.3f} to {hi16:.3f} | |")
        for name, layers in data["real"].items():
            for layer, share in layers.items():
                body = data.get("real_without_first", {}).get(name, {}).get(layer, {}).get("16")
                lines.append(f"| {name}, after layer {layer} | {share['8']:.3f} | {share['16']:.3f} | "
                             f"{'' if body is None else format(body, '.3f')} |")
        lines += ["", "![top-16 energy share](data/spectrum.png)", ""]
    return lines
