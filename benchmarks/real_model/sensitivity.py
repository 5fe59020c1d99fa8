"""Where a real model needs bits: each pipeline boundary's cost measured alone, on the pretrained model.

    python -m benchmarks.real_model.sensitivity --out docs/data/real_model_sensitivity.json  # SmolLM2-135M, depth 8

No training: the pretrained model (``benchmarks.common.real_activations``' SmolLM2-135M, fp32, through
``transformers``) reads ``batches`` x ``seq`` tokens of the shipped Shakespeare corpus's held-out documents (the
study's validation split, ``megatron_tah.data.held_out_files``; the study's micro-batch:
one sequence per message, ``[seq, 1, hidden]`` as Megatron's pipeline sends it, bf16), and at the layers after
which a pipeline of ``stages`` splits it (``runs.boundaries``) the hidden state goes through a codec's round trip:

* **forward**: the loss increase when only boundary ``k``'s activations go through the forward codec at ``b``
  bits (all others exact), and when all boundaries do: the one-at-a-time gap that per-boundary bit widths
  (``--tah-boundary-bits``) are chosen from;
* **backward**: the relative error of the first stage's transformer layers' parameter gradient (it has come
  back through every boundary) when every boundary's activation gradient goes through the backward codec at
  ``b`` bits, against the same measure between two batches' exact gradients (the noise stochastic gradient
  descent lives with anyway).

Each figure is the mean over the batches with its standard error. The codecs are ``TahConfig``'s, built
from its fields (``--forward`` / ``--backward`` JSON), with the bit width of each row.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from megatron_tah.config import TahConfig

from .runs import boundaries


def _mean_se(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var / n)


class RoundTrips:
    """Forward hooks on ``layers`` (modules) that put their hidden state through ``codecs[(layer, direction)]``:
    forward ``decode(encode(x))``; backward the same on the gradient (an autograd function). ``active``: the
    (layer, direction) pairs that go through a codec now."""

    def __init__(self, modules: dict[int, torch.nn.Module]):
        self.codecs: dict[tuple[int, str], object] = {}
        self.active: set[tuple[int, str]] = set()
        self.handles = [module.register_forward_hook(self._hook(layer)) for layer, module in modules.items()]

    def round_trip(self, layer: int, direction: str, x: torch.Tensor) -> torch.Tensor:
        if (layer, direction) not in self.active:
            return x
        codec = self.codecs[(layer, direction)]
        msg = x.detach().transpose(0, 1).contiguous().to(torch.bfloat16)  # [b, s, h] -> Megatron's [s, b, h]
        y = codec.decode(codec.encode(msg), msg.shape, msg.dtype)
        return y.transpose(0, 1).to(x.dtype)

    def _hook(self, layer: int):
        trips = self

        class Trip(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return trips.round_trip(layer, "forward", x)

            @staticmethod
            def backward(ctx, grad):
                return trips.round_trip(layer, "backward", grad.contiguous())

        def hook(module, inputs, output):
            if isinstance(output, tuple):
                return (Trip.apply(output[0]), *output[1:])
            return Trip.apply(output)

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _batches(tokenizer, seq: int, count: int) -> list[torch.Tensor]:
    """``count`` sequences of ``seq + 1`` tokens from the held-out Shakespeare documents, in order."""
    from megatron_tah.data import held_out_files, read_text

    text = "\n".join(read_text(path) for path in held_out_files("shakespeare"))
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    if ids.numel() < seq * count + 1:
        raise ValueError(f"the held-out documents give {ids.numel()} tokens, fewer than {seq * count + 1}")
    return [ids[i * seq:(i + 1) * seq + 1] for i in range(count)]


def measure(forward: dict, backward: dict, bits: list[int], backward_bits: list[int], stages: int = 8,
            seq: int = 128, batches: int = 8, model: str = "smollm2-135m", load=None) -> dict:
    """The forward one-at-a-time gaps and the backward gradient errors (the module docstring) as a dict;
    ``load``: a callable giving (tokenizer, Llama-shaped ``transformers`` model) instead of ``model``'s."""
    from ..common.real_activations import MODELS

    tokenizer, net = (load or MODELS[model].load)()
    net.eval()
    layers = net.model.layers
    cuts = boundaries(len(layers), stages)
    trips = RoundTrips({k: layers[k - 1] for k in cuts})
    data = _batches(tokenizer, seq, batches)

    def loss_of(ids):
        return net(ids[None], labels=ids[None]).loss  # transformers shifts the labels: seq next-token predictions

    def set_codecs(direction: str, fields: dict, b: int) -> None:
        key = "tah_forward_bits" if direction == "forward" else "tah_backward_bits"
        config = TahConfig(**{**fields, key: b})
        for k in cuts:
            codec = config.forward_codec() if direction == "forward" else config.backward_codec()
            trips.codecs[(k, direction)] = codec.salt_rounding(f"{direction}:{k}")

    started = time.time()
    with torch.no_grad():
        trips.active = set()
        exact = [float(loss_of(ids)) for ids in data]
        rows = []
        for b in bits:
            set_codecs("forward", forward, b)
            for where in [*cuts, "all"]:
                trips.active = {(k, "forward") for k in (cuts if where == "all" else [where])}
                gaps = [float(loss_of(ids)) - e for ids, e in zip(data, exact)]
                mean, se = _mean_se(gaps)
                rows.append({"bits": b, "boundary": where, "gap": mean, "se": se})
                print(f"[sensitivity] forward {b} bits at {where}: loss {mean:+.4f} +- {se:.4f}", flush=True)
    trips.active = set()
    # the first stage's transformer layers: their gradient has come back through every boundary
    params = [p for layer in layers[:cuts[0]] for p in layer.parameters() if p.requires_grad]

    def gradient(ids) -> torch.Tensor:
        net.zero_grad(set_to_none=True)
        loss_of(ids).backward()
        return torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])

    exact_grads = [gradient(ids) for ids in data]
    between = [float((a - b).norm() / b.norm()) for a, b in zip(exact_grads[1:], exact_grads[:-1])]
    grad_rows = []
    for b in backward_bits:
        set_codecs("backward", backward, b)
        trips.active = {(k, "backward") for k in cuts}
        errors = [float((gradient(ids) - g).norm() / g.norm()) for ids, g in zip(data, exact_grads)]
        mean, se = _mean_se(errors)
        grad_rows.append({"bits": b, "rel_error": mean, "se": se})
        print(f"[sensitivity] backward {b} bits at every boundary: gradient error {mean:.4f} +- {se:.4f}", flush=True)
    trips.remove()
    mean, se = _mean_se(between)
    return {"model": model, "stages": stages, "boundaries": cuts, "seq": seq, "batches": batches,
            "forward_fields": forward, "backward_fields": backward, "exact_loss": _mean_se(exact)[0],
            "forward": rows, "backward": grad_rows, "between_batches": {"rel_error": mean, "se": se},
            "seconds": round(time.time() - started, 1)}


def _codec_text(fields: dict, direction: str) -> str:
    config = TahConfig(**fields)
    codec = config.forward_codec() if direction == "forward" else config.backward_codec()
    return codec.describe().replace(f"bits={codec.bits}, ", "") if hasattr(codec, "bits") else codec.describe()


def markdown(results: list[dict]) -> str:
    """The page's section: the forward gaps per boundary and bit width, then the gradients' errors, from the
    ``results`` of :func:`measure` (several: one per codec measured)."""
    lines = []
    for result in results:
        if not result["forward"]:
            continue
        cuts = result["boundaries"]
        lines += [f"Forward: {_codec_text(result['forward_fields'], 'forward')} at one boundary at a time (the layer "
                  f"after which it sits) and at all {len(cuts)}; the mean loss increase over {result['batches']} "
                  f"sequences of {result['seq']} tokens (exact loss {result['exact_loss']:.3f}), +- its standard "
                  "error:", "",
                  "| bits | " + " | ".join(f"after {k}" for k in cuts) + " | all |",
                  "|---:|" + "---:|" * (len(cuts) + 1)]
        for b in sorted({r["bits"] for r in result["forward"]}):
            at = {r["boundary"]: r for r in result["forward"] if r["bits"] == b}
            cells = [f"{at[k]['gap']:+.4f} +- {at[k]['se']:.4f}" for k in [*cuts, "all"]]
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
        lines.append("")
    for result in results:
        if not result["backward"]:
            continue
        between = result["between_batches"]
        errors = ", ".join(f"{r['bits']} bits {r['rel_error']:.3f} +- {r['se']:.3f}" for r in result["backward"])
        lines += [f"Backward: {_codec_text(result['backward_fields'], 'backward')} at every boundary: the first "
                  f"stage's layers' gradient errs by {errors} (relative, over {result['batches']} sequences); two "
                  f"batches' exact gradients differ by {between['rel_error']:.3f} +- {between['se']:.3f}.", ""]
    return "\n".join(lines).strip()


def costliest(results: list[dict], count: int = 2) -> str:
    """Per forward bit width, the ``count`` boundaries that cost most alone, and how the sum of the one-at-a-time
    costs compares with all boundaries at once (the boundaries compound when the second is larger)."""
    parts = []
    for result in results:
        for b in sorted({r["bits"] for r in result["forward"]}):
            alone = sorted((r for r in result["forward"] if r["bits"] == b and r["boundary"] != "all"),
                           key=lambda r: -r["gap"])
            both = next(r["gap"] for r in result["forward"] if r["bits"] == b and r["boundary"] == "all")
            top = ", ".join(f"after {r['boundary']} ({r['gap']:+.4f})" for r in alone[:count])
            parts.append(f"{b} bits: {top}; one at a time they sum to {sum(r['gap'] for r in alone):+.4f}, "
                         f"all at once {both:+.4f}")
    return ("The costliest boundaries alone, per bit width: " + "; ".join(parts) + ".") if parts else ""


def save(result: dict, path: Path) -> None:
    """Add ``result`` to the JSON file ``path`` (``{"runs": [...]}``), replacing a run of the same codec fields."""
    path = Path(path)
    saved = json.loads(path.read_text())["runs"] if path.is_file() else []
    key = (json.dumps(result["forward_fields"], sort_keys=True), json.dumps(result["backward_fields"], sort_keys=True),
           bool(result["forward"]), bool(result["backward"]))
    kept = [r for r in saved if (json.dumps(r["forward_fields"], sort_keys=True),
                                 json.dumps(r["backward_fields"], sort_keys=True), bool(r["forward"]),
                                 bool(r["backward"])) != key]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"runs": [*kept, result]}, indent=1) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.real_model.sensitivity",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--forward", default='{"tah_forward_codec": "channel", "tah_channel_outlier_tokens": 1}',
                        help="TahConfig fields of the forward codec, JSON (its bits: --bits)")
    parser.add_argument("--backward", default='{"tah_backward_codec": "hadint", "tah_backward_tile_size": 64, '
                        '"tah_backward_stochastic_rounding": true}', help="TahConfig fields of the backward codec")
    parser.add_argument("--bits", default="2,3,4,5,6", help="forward bit widths, comma list (empty: none)")
    parser.add_argument("--backward-bits", default="3,4", help="backward bit widths, comma list (empty: none)")
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--out", type=Path, help="add the result to this JSON file's runs (the page's: "
                        "docs/data/real_model_sensitivity.json)")
    args = parser.parse_args(argv)
    result = measure(json.loads(args.forward), json.loads(args.backward), [int(b) for b in args.bits.split(",") if b],
                     [int(b) for b in args.backward_bits.split(",") if b], stages=args.stages, seq=args.seq,
                     batches=args.batches)
    if args.out:
        save(result, args.out)
    print(markdown([result]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
