"""Pipeline boundaries emulated in one process: Megatron's loop at pipeline depth 1 with the pipeline's codecs
after chosen transformer layers.

A boundary after layer ``k`` makes layer ``k``'s output what the next stage of a pipeline split there would
receive: the forward codec's ``decode(encode(x))``; and the gradient flowing back through it what the
previous stage would receive: the backward codec's ``decode(encode(g))`` -- the same tensors, the same codec
calls (one codec object per boundary and direction, as one per link end) and the same order of micro-batches
as a real pipeline of that depth, without one process per stage. Boundaries after layers ``1..7`` of an
8-layer model are a pipeline of 8 stages of one layer. Not the same bits as a real pipeline: Megatron seeds
each pipeline rank's initialisation differently.

``Boundaries.install()`` wraps ``megatron.core.transformer.transformer_layer.TransformerLayer.forward`` (looked
up at call time by every layer) and ``megatron_tah.megatron.pipeline_parallel.evaluation`` (the switch
``--tah-eval-traffic`` turns on the pipeline's links for an evaluation: inside it with ``uncompressed``, the
boundaries pass their messages untouched, as the pipeline's links send raw; inside it without, a forward config
with ``tah_eval_forward_bits`` sends activations through its evaluation codec, as the links do) through
``megatron_tah.megatron.patching.Patches``; ``restore()`` undoes both.
Every ``sample_every``-th call of a boundary and direction appends ``{"boundary", "direction", "call",
"rel_error", "rms"}`` (the codec's relative round-trip error on that message and the message's rms) to
``log``, a JSON-lines file. With ``capture`` (a folder), the first ``capture_per`` messages of each boundary
and direction in each training iteration of ``capture_at`` are saved there as they enter the codec,
``i<iteration>_b<layer>_<direction>_<n>.pt`` (``torch.save`` of the tensor: the study of how codecs' errors
on this model compare with a real model's, ``benchmarks.transfer``).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from megatron_tah.config import TahConfig
from megatron_tah.megatron.patching import Patches

LAYER_MODULE = "megatron.core.transformer.transformer_layer"
PIPELINE_MODULE = "megatron_tah.megatron.pipeline_parallel"


def _iteration() -> int:
    from megatron.training.global_vars import get_args

    return int(getattr(get_args(), "curr_iteration", 0) or 0)


class _RoundTrip(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, boundaries, layer):
        ctx.boundaries, ctx.layer = boundaries, layer
        return boundaries.round_trip(layer, "forward", x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.boundaries.round_trip(ctx.layer, "backward", grad.contiguous()), None, None


class Boundaries:
    """Boundaries after ``layers`` (1-based layer numbers) with the forward codec of ``TahConfig(**forward)``
    and the backward codec of ``TahConfig(**backward)``; ``per_boundary`` {layer: TahConfig fields} overrides
    the forward codec at single boundaries (``tah_boundary_bits`` in a config: each boundary's bits, as on
    the pipeline's links); the first ``warmup_iters`` training iterations (Megatron's
    ``args.curr_iteration``) send uncompressed, as ``--tah-warmup-iters`` does."""

    def __init__(self, layers, forward: dict, backward: dict, log: str | Path | None = None, sample_every: int = 10,
                 per_boundary: dict | None = None, warmup_iters: int = 0, capture: str | Path | None = None,
                 capture_at=(), capture_per: int = 1):
        self.layers = frozenset(int(k) for k in layers)
        self.configs = {"forward": TahConfig(**forward), "backward": TahConfig(**backward)}
        self.per_boundary = {int(k): TahConfig(**v) for k, v in (per_boundary or {}).items()}
        self.warmup_iters = int(warmup_iters)
        self.codecs: dict[tuple[int, str], object] = {}
        self.calls: dict[tuple[int, str], int] = {}
        self.log, self.sample_every = (None if log is None else Path(log)), sample_every
        self.capture, self.capture_at = (None if capture is None else Path(capture)), frozenset(map(int, capture_at))
        self.capture_per, self.captured = int(capture_per), {}
        self.evaluating = self.uncompressed = False
        """Inside an evaluation; inside one that ``--tah-eval-traffic`` sends uncompressed: messages pass untouched
        (otherwise activations go through the evaluation codec where the config has one, ``eval_codec``)."""
        self.patches = Patches()

    def _config(self, layer: int, direction: str) -> TahConfig:
        return self.per_boundary.get(layer, self.configs[direction]) if direction == "forward" \
            else self.configs[direction]

    def codec(self, layer: int, direction: str):
        key = (layer, direction)
        if key not in self.codecs:
            config = self._config(layer, direction)
            cuts = sorted(self.layers)  # boundary i of len(cuts): --tah-boundary-bits' entry, as on a pipeline link
            codec = config.forward_codec(cuts.index(layer), len(cuts)) if direction == "forward" \
                else config.backward_codec()
            self.codecs[key] = codec.salt_rounding(f"{direction}:{layer}")  # as a pipeline's link ends: own noise
        return self.codecs[key]

    def eval_codec(self, layer: int, direction: str):
        """The boundary's codec in evaluations through the codecs: its forward config's (``per_boundary``'s where
        given) evaluation codec (``TahConfig.eval_forward_codec``: its bits at every boundary, as on the links);
        None: the training one."""
        if direction != "forward":
            return None
        key = (layer, "eval")
        if key not in self.codecs:
            codec = self._config(layer, direction).eval_forward_codec()
            self.codecs[key] = None if codec is None else codec.salt_rounding(f"{direction}:{layer}:eval")
        return self.codecs[key]

    def _save(self, layer: int, direction: str, x: torch.Tensor) -> None:
        iteration = _iteration()
        key = (iteration, layer, direction)
        n = self.captured.get(key, 0)
        if iteration in self.capture_at and n < self.capture_per:
            self.captured[key] = n + 1
            self.capture.mkdir(parents=True, exist_ok=True)
            torch.save(x.detach().cpu().clone(), self.capture / f"i{iteration}_b{layer}_{direction}_{n}.pt")

    def round_trip(self, layer: int, direction: str, x: torch.Tensor) -> torch.Tensor:
        if self.capture is not None:
            self._save(layer, direction, x)
        codec = self.codec(layer, direction)
        if codec.name == "none" or self.uncompressed or (self.warmup_iters and _iteration() < self.warmup_iters):
            return x
        if self.evaluating:
            codec = self.eval_codec(layer, direction) or codec
        x = x.detach()
        y = codec.decode(codec.encode(x), x.shape, x.dtype)
        key = (layer, direction)
        self.calls[key] = self.calls.get(key, 0) + 1
        if self.log is not None and (self.calls[key] - 1) % self.sample_every == 0:
            xf = x.float()
            record = {"boundary": layer, "direction": direction, "call": self.calls[key],
                      "rel_error": float((y.float() - xf).norm() / xf.norm().clamp_min(1e-30)),
                      "rms": float(xf.pow(2).mean().sqrt())}
            with open(self.log, "a") as f:
                f.write(json.dumps(record) + "\n")
        return y

    def install(self) -> None:
        boundaries = self

        def make(original):
            def forward(layer, *args, **kwargs):
                out, context = original(layer, *args, **kwargs)
                if layer.layer_number in boundaries.layers:
                    out = _RoundTrip.apply(out, boundaries, layer.layer_number)
                return out, context

            return forward

        self.patches.wrap(f"{LAYER_MODULE}:TransformerLayer", "forward", make)

        def make_evaluation(original):
            @contextlib.contextmanager
            def evaluation(uncompressed: bool):
                before = boundaries.evaluating, boundaries.uncompressed
                boundaries.evaluating, boundaries.uncompressed = True, bool(uncompressed)
                try:
                    with original(uncompressed):
                        yield
                finally:
                    boundaries.evaluating, boundaries.uncompressed = before

            return evaluation

        self.patches.wrap(PIPELINE_MODULE, "evaluation", make_evaluation)

    def restore(self) -> None:
        self.patches.restore()
