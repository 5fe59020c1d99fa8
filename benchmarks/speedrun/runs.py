"""The CPU speedrun's runs: the model, the codecs, the loss runs and the timing runs (Megatron's own loop).

Every run is ``python -m megatron_tah.pretrain_gpt`` at pipeline depth 8, one transformer layer per
stage (``benchmarks.reproduce.runner``: torchrun, gloo, the CPU flags), on the shipped Shakespeare corpus
tokenized with GPT-2's BPE and its ids compacted to the 8190 most frequent plus ``<unk>`` and the
end-of-document (``python -m megatron_tah.data --vocab-limit 8192``: the output layer of the full
50257-id vocabulary was 80% of this model's compute). Input embedding and output layer are untied, as in
the reference model: tied, Megatron all-reduces their gradients between the first and the last stage
every iteration, outside the pipeline.

* A **loss run** trains without a slow link (a codec's numerics do not depend on the link), validating
  every ``eval_interval`` iterations on the same ``eval_iters`` batches each time (``--fixed-validation``)
  twice (``--tah-eval-traffic both``): through the codecs, as the reference evaluates (``valid_loss``), then
  uncompressed (``valid_loss_uncompressed``: the model on its own). bf16 has no codec: its one evaluation is both;
  ``auto`` validates through its codecs only (it chooses from the traffic it measures on its links).
* A **timing run** trains ``timing_iters`` iterations of the same model behind the emulated inbound wire
  (``--tah-emulate-wire inbound``: one wire per rank, the WAN yardstick's meter) and never validates; its
  per-iteration wall times give the steady seconds per step (``score.steady_seconds``).
* ``auto`` chooses its codecs from the link it measures, so its loss run runs behind the same emulated
  wire as its timing run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

from megatron_tah.config import PRESETS, candidate_fields

from ..reproduce.runner import Run

CODECS: dict[str, dict] = {
    "bf16": {},  # uncompressed: megatron_tah's none codec (the raw bf16 message behind a 16-byte header)
    "paper": {"tah_preset": "paper"},
    "hadint4": {"tah_preset": "hadint4"},
    "lowrank": {"tah_preset": "lowrank"},
    # lowrank trained, evaluated (served) with its residual at 5 bits
    "lowrank_s5": {"tah_preset": "lowrank", "tah_eval_forward_bits": 5},
    # auto's candidates that are no preset: lowrank with 8 directions, per-channel codecs (their fields: config.auto)
    "lowrank8": candidate_fields("lowrank8"),
    # lowrank both ways, the gradients' residual rounded stochastically (unbiased): 3.38 bits each way at
    # [1024, 8, 1024]. The toy's gradients hold 0.87 of their energy in 16 directions, SmolLM2's 0.28
    # (docs/CODECS.md): a toy-only candidate, not a preset.
    "lowrank2": {"tah_forward_codec": "lowrank", "tah_forward_bits": 3, "tah_tile_size": 64,
                 "tah_lowrank_rank": 16, "tah_lowrank_coef_bits": 6, "tah_backward_codec": "lowrank",
                 "tah_backward_bits": 3, "tah_backward_tile_size": 64, "tah_backward_stochastic_rounding": True},
    # the lowrank_h3_rn preset: lowrank's activations with Hadamard INT3 gradients rounded to nearest, 3.38 + 3.25
    # bits at [1024, 8, 1024]; a gradient codec that does not lean on a few directions (docs/CODECS.md). Beside it,
    # its gradients rounded stochastically (unbiased, about 1.4x the rounding error), and those with a bf16 scale
    # per 32 values instead of 64 (finer steps where a tile holds a large value: 3.38 + 3.50 bits). Its runs name
    # the fields, as they did before it was a preset.
    "lowrank_h3_rn": dict(PRESETS["lowrank_h3_rn"]),
    "lowrank_h3": {**PRESETS["lowrank_h3_rn"], "tah_backward_stochastic_rounding": True},
    "lowrank_h3_t32": {**PRESETS["lowrank_h3_rn"], "tah_backward_stochastic_rounding": True,
                       "tah_backward_tile_size": 32},
    # the channel_h4 preset: per-channel 6-bit activations with each sequence's largest token sent apart (a real
    # model's attention sink would set every channel's range), Hadamard INT4 gradients as hadint4's: 6.02 + 4.25
    # bits at [1024, 8, 1024]; on a real model its gradients err as on the toy, its activations 1.7x more
    # (docs/CODECS.md). Its runs name the fields, as they did before it was a preset.
    "channel_h4": dict(PRESETS["channel_h4"]),
    # the same with 5-, 4- and 3-bit activations: 5.02, 4.02 and 3.02 + 4.25 bits
    **{f"channel{bits}_h4": {**PRESETS["channel_h4"], "tah_forward_bits": bits} for bits in (5, 4, 3)},
    # 5-bit activations and Hadamard INT3 gradients: 5.02 + 3.25 bits
    "channel5_h3": {**PRESETS["channel_h4"], "tah_forward_bits": 5, "tah_backward_bits": 3},
    # channel_h4 through the lossless coder (--tah-entropy-coding): the same values, fewer bytes
    "channel_h4_ec": {**PRESETS["channel_h4"], "tah_entropy_coding": True},
    "fixedpoint4": candidate_fields("fixedpoint4"),
    "channel": candidate_fields("channel"),
    "channel6": candidate_fields("channel6"),
    "channel9": candidate_fields("channel9"),
    # between channel and channel9: 5-bit activations (the forward codec carries the PP 8 penalty, docs/DEPTH.md)
    "channel_f5": {"tah_forward_codec": "channel", "tah_forward_bits": 5, "tah_backward_codec": "channel",
                   "tah_backward_bits": 3, "tah_backward_stochastic_rounding": True},
    # lowrank's activations with per-channel stochastically rounded gradients (as channel9's): 3 bits, 6.38 bits
    # both ways at [1024, 8, 1024]; 2 bits, 5.38 (the candidate for <= 6 bits)
    **{f"lowrank_g{bits}": {"tah_forward_codec": "lowrank", "tah_forward_bits": 3, "tah_tile_size": 64,
                            "tah_lowrank_rank": 16, "tah_lowrank_coef_bits": 6, "tah_backward_codec": "channel",
                            "tah_backward_bits": bits, "tah_backward_stochastic_rounding": True} for bits in (3, 2)},
    # channel_h4's activations with per-channel 3-bit stochastically rounded gradients: 6.02 + 3.00 bits at
    # [1024, 8, 1024] (per direction: a real model's gradients err below the batch-to-batch noise at 3 bits,
    # docs/REAL_MODEL.md)
    "channel_h4_g3": {**PRESETS["channel_h4"], "tah_backward_codec": "channel", "tah_backward_bits": 3,
                      "tah_backward_tile_size": 32},
    # the channel_b_h4 preset: channel5_h4 with 6 bits at the two boundaries that cost SmolLM2-135M most at 5 bits
    # (after layers 3 and 23 of 30, the first and sixth of depth 8's seven; python -m benchmarks.real_model.sensitivity):
    # 5.31 + 4.25 bits
    "channel_b_h4": dict(PRESETS["channel_b_h4"]),
    # the same with Hadamard INT3 gradients (3.25 bits; on SmolLM2 they err less than per-channel 3-bit ones):
    # 5.31 + 3.25 bits
    "channel_b_h3": {**PRESETS["channel_b_h4"], "tah_backward_bits": 3},
    # channel5_h4's mean bits placed by the same measure: 6 where 5 bits cost most alone, 4 where 4 bits cost least
    # (after layers 11 and 19): 5.02 + 4.25 bits on average, as channel5_h4's
    "channel_b5_h4": {**PRESETS["channel_b_h4"], "tah_boundary_bits": "6,5,4,5,4,6,5"},
    # about 6 bits both ways at [1024, 8, 1024]: channel_h4's activations at 4 bits with per-channel 2-bit
    # stochastically rounded gradients (4.02 + 2.00)
    "channel4_g2": {**PRESETS["channel_h4"], "tah_forward_bits": 4, "tah_backward_codec": "channel",
                    "tah_backward_bits": 2, "tah_backward_tile_size": 32},
    # channel_h4's activations at 4 and 3 bits with Hadamard INT3 gradients rounded stochastically (per-channel
    # gradients at 2-3 bits cost SmolLM2 steps even evaluated uncompressed, Hadamard INT4 ones did not):
    # 4.02 + 3.25 and 3.02 + 3.25 bits at [1024, 8, 1024]
    "channel4_h3": {**PRESETS["channel_h4"], "tah_forward_bits": 4, "tah_backward_bits": 3},
    "channel3_h3": {**PRESETS["channel_h4"], "tah_forward_bits": 3, "tah_backward_bits": 3},
    # trained as channel4_h3, evaluated (served) through the pipeline at 6 bits: the bits inference needs
    "channel4_h3_s6": {**PRESETS["channel_h4"], "tah_forward_bits": 4, "tah_backward_bits": 3,
                       "tah_eval_forward_bits": 6},
    "auto": {"tah_forward_codec": "auto", "tah_backward_codec": "auto"},
}
"""Codec name -> the ``TahConfig`` fields of its runs (``codec_flags``: as ``--tah-*`` flags)."""
# trained as lowrank_h3_rn, evaluated (served) through the pipeline with lowrank's residual at 8 bits
CODECS["lowrank_h3_rn_s8"] = {**CODECS["lowrank_h3_rn"], "tah_eval_forward_bits": 8}
# lowrank_h3_rn one direction at a time (the other uncompressed): each direction's share of its steps multiplier
CODECS["lowrank_h3_rn_fwd"] = {**CODECS["lowrank_h3_rn"], "tah_backward_codec": "none"}
CODECS["lowrank_h3_rn_bwd"] = {**CODECS["lowrank_h3_rn"], "tah_forward_codec": "none"}

VOCAB = 8192
"""The compact vocabulary's size (``prepare_data``): 8190 most frequent GPT-2 ids, ``<unk>`` and end-of-document."""

NEEDS_LINK = ("auto",)
"""Codecs whose loss runs must see the emulated link (their choice depends on it)."""


def entropy_coded(codec: str) -> bool:
    """Whether ``codec``'s messages go through the lossless coder: their sizes vary, so they are measured."""
    return bool(CODECS[codec].get("tah_entropy_coding"))


def emulated_for(codec: str, emulated: bool) -> bool:
    """Whether ``codec``'s loss runs use emulated boundaries when the page's do (``emulated``): a codec that
    chooses from the link (``NEEDS_LINK``) runs the real pipeline even then, and so do the bf16 runs its steps
    are paired with."""
    return emulated and codec not in NEEDS_LINK


def codec_flags(codec: str) -> list[str]:
    """``CODECS[codec]`` as Megatron flags: ``tah_tile_size`` -> ``--tah-tile-size``; a true bool is its bare flag."""
    from megatron_tah.megatron.arguments import fields_flags

    return fields_flags(CODECS[codec])


def forward_codecs(config, stages: int) -> list:
    """The forward codec of each of the ``stages - 1`` boundaries of a pipeline of ``stages`` (one and the same
    unless ``--tah-boundary-bits`` gives each its bits)."""
    return [config.forward_codec(i, stages - 1) for i in range(max(stages - 1, 1))] if config.boundary_bits() \
        else [config.forward_codec()]


def busiest_nbytes(config, shape, stages: int) -> int:
    """Wire bytes of the largest forward message of a bf16 ``shape`` among the pipeline's boundaries: the link
    that sets the pipeline's pace when every link has the same rate (per-boundary bits differ per link)."""
    import torch

    return max(c.wire_nbytes(shape, torch.bfloat16) for c in forward_codecs(config, stages))


def message_nbytes(codec: str, size: "Size") -> tuple[int, int]:
    """Wire bytes of one message of ``size`` (one micro-batch's activations at a boundary), (forward, backward):
    the codecs' own ``wire_nbytes`` for a bf16 message (forward: the busiest boundary's, ``busiest_nbytes``)."""
    import torch

    from megatron_tah.config import TahConfig

    if codec in NEEDS_LINK:
        raise ValueError(f"{codec} chooses its codecs from the link it measures: its bytes are measured, not known")
    if entropy_coded(codec):
        raise ValueError(f"{codec}'s messages are entropy-coded: their bytes are measured, not known")
    config = TahConfig(**CODECS[codec])
    return (busiest_nbytes(config, size.message_shape, size.stages),
            config.backward_codec().wire_nbytes(size.message_shape, torch.bfloat16))


@dataclasses.dataclass(frozen=True)
class Size:
    """One speedrun size: the model, the schedule, validation and timing."""

    name: str
    hidden: int = 128
    heads: int = 4
    seq: int = 64
    micro_batch: int = 1
    micro_batches: int = 16
    iters: int = 500
    eval_interval: int = 10
    eval_iters: int = 8
    timing_iters: int = 60
    lr: float = 1e-3
    stages: int = 8

    def setup(self) -> dict:
        """What a page records of this size (and ``--from-page`` checks)."""
        return {"stages": self.stages, "hidden": self.hidden, "seq": self.seq, "micro_batch": self.micro_batch,
                "micro_batches": self.micro_batches, "iters": self.iters, "eval_interval": self.eval_interval,
                "eval_iters": self.eval_iters}

    def parameters(self, vocab: int = VOCAB, divisible_by: int = 128) -> int:
        """The model's parameter count, as Megatron builds it from ``model_flags`` (local spec: LayerNorms and linear
        layers with biases, learned absolute positions, a 4x MLP): the word embedding (``vocab`` padded to a multiple
        of ``divisible_by``, Megatron's ``--make-vocab-size-divisible-by``), the positions, ``stages`` layers of
        ``12 h^2 + 13 h``, the final LayerNorm and the untied output layer."""
        padded = -(-vocab // divisible_by) * divisible_by
        h = self.hidden
        layer = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (4 * h * h + 4 * h) + (4 * h * h + h)
        return padded * h + self.seq * h + self.stages * layer + 2 * h + padded * h

    @property
    def message_shape(self) -> tuple[int, int, int]:
        return (self.seq, self.micro_batch, self.hidden)

    def model_flags(self, iters: int) -> list[str]:
        warmup = max(1, min(10, iters // 10))
        return ["--num-layers", str(self.stages), "--hidden-size", str(self.hidden),
                "--num-attention-heads", str(self.heads), "--seq-length", str(self.seq),
                "--max-position-embeddings", str(self.seq), "--micro-batch-size", str(self.micro_batch),
                "--global-batch-size", str(self.micro_batch * self.micro_batches), "--train-iters", str(iters),
                "--lr", str(self.lr), "--lr-warmup-iters", str(warmup), "--lr-decay-style", "cosine",
                "--weight-decay", "0.01", "--clip-grad", "1.0", "--bf16", "--untie-embeddings-and-output-weights"]


SIZES = {
    "full": Size("full"),
    # CI: the same machinery and rules, a few iterations of a 2-stage, narrower model.
    "tiny": Size("tiny", hidden=64, heads=2, seq=32, micro_batches=4, iters=12, eval_interval=3, eval_iters=1,
                 timing_iters=12, stages=2),
}


def prepare_data(out: Path, size: Size) -> tuple[Path, int]:
    """The shipped corpus tokenized with the speedrun's compact vocabulary under ``out/data`` (once): (prefix, vocab)."""
    from megatron_tah.data import prepare

    prefix, vocab = out / "data" / "speedrun", VOCAB
    if not Path(f"{prefix}_valid_text_document.idx").is_file():
        max_tokens = None if size.name == "full" else 40_000
        prepare("shakespeare", prefix, vocab_limit=vocab, max_tokens=max_tokens)
    return prefix, vocab


def data_flags(prefix: Path, vocab: int) -> list[str]:
    return ["--train-data-path", f"{prefix}_train_text_document", "--valid-data-path", f"{prefix}_valid_text_document",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab)]


@dataclasses.dataclass(frozen=True)
class Link:
    """The emulated inbound wire of the timing runs (and auto's loss runs)."""

    rate_bps: float
    latency_s: float

    def flags(self) -> list[str]:
        return ["--tah-emulate-bandwidth", f"{self.rate_bps / 1e3:.3f}kbit",
                "--tah-emulate-latency-ms", f"{1e3 * self.latency_s:.3f}", "--tah-emulate-wire", "inbound"]


def loss_run_name(codec: str, seed: int, iters: int, size: Size, emulated: bool = False) -> str:
    stem = f"{'emulated' if emulated else 'loss'}_{codec}_s{seed}"
    return f"{stem}_{iters}" if iters != size.iters else stem


@dataclasses.dataclass
class EmulatedRun(Run):
    """A loss run in one process: Megatron's loop at pipeline depth 1 with the codecs at the layers after which
    a pipeline of ``stages`` would split (``python -m benchmarks.depth.run``, ``benchmarks/depth/boundaries.py``):
    the same codec calls on the same tensors as the pipeline, without one process per stage."""

    stages: int = 8

    def command(self, out_dir: Path, python: str = sys.executable) -> list[str]:
        from megatron_tah.pretrain_gpt import CPU_FLAGS

        fields = json.dumps(CODECS[self.info["codec"]])
        return [python, "-m", "benchmarks.depth.run", "--boundaries", ",".join(map(str, range(1, self.stages))),
                "--forward", fields, "--backward", fields, "--", *CPU_FLAGS, *self.flags,
                "--tah-log-json", str(Path(out_dir) / f"{self.name}.jsonl")]


def loss_run(codec: str, seed: int, size: Size, data: list[str], iters: int | None = None,
             link: Link | None = None, emulated: bool = False) -> Run:
    """A loss run of ``codec`` with ``seed`` over a schedule of ``iters`` (default: the size's); ``emulated``:
    in one process with emulated boundaries (``EmulatedRun``) instead of one process per stage."""
    iters = iters or size.iters
    flags = [*size.model_flags(iters), *data, "--seed", str(seed), "--eval-interval", str(size.eval_interval),
             "--eval-iters", str(size.eval_iters), "--fixed-validation", "--log-interval", str(size.eval_interval)]
    if codec != "bf16" and codec not in NEEDS_LINK:  # auto: an uncompressed evaluation would change what it measures
        flags += ["--tah-eval-traffic", "both"]
    info = {"codec": codec, "seed": seed, "iters": iters, "kind": "loss", "emulated": emulated}
    name = loss_run_name(codec, seed, iters, size, emulated)
    if emulated:
        if codec in NEEDS_LINK:
            raise ValueError(f"{codec}'s loss run needs the pipeline's links (its choice depends on them); "
                             f"it cannot run with emulated boundaries")
        return EmulatedRun(name, flags, 1, label=codec, info=info, stages=size.stages)
    flags += codec_flags(codec)
    if codec in NEEDS_LINK:
        if link is None:
            raise ValueError(f"{codec}'s loss run needs the emulated link (its choice depends on it)")
        flags += link.flags()
    return Run(name, flags, size.stages, label=codec, info=info)


def timing_run(codec: str, size: Size, data: list[str], link: Link | None, seed: int = 1234) -> Run:
    """``timing_iters`` iterations of ``codec`` behind ``link`` (None: no slow link), no validation."""
    flags = [*size.model_flags(size.timing_iters), *data, "--seed", str(seed), "--eval-iters", "0",
             "--eval-interval", str(10 * size.timing_iters), "--log-interval", "10", *codec_flags(codec)]
    if link is not None:
        flags += link.flags()
    name = f"time_{codec}" if link is not None else f"time_{codec}_nolink"
    return Run(name, flags, size.stages, label=codec, info={"codec": codec, "kind": "timing"})


def validations(records: list[dict], key: str = "valid_loss") -> list[tuple[int, float]]:
    """(iteration, validation loss) of a loss run's records (``runner.read_log``): through the codecs
    (``valid_loss``) or uncompressed (``valid_loss_uncompressed``; none in a run that did not validate so)."""
    return [(r["iteration"], r[key]) for r in records if key in r and math.isfinite(r[key])]


def step_seconds(records: list[dict]) -> list[float]:
    """Wall seconds of each training iteration after the first (``ms`` of the records)."""
    return [r["ms"] / 1e3 for r in records if r.get("ms") is not None]


def step_records(records: list[dict]) -> list[dict]:
    """The training iterations' records of a run's log (not its validations)."""
    return [r for r in records if "fwd_wire_bytes" in r and r.get("fwd_wire_bytes") is not None]


def bytes_per_iteration(records: list[dict], skip: int = 2) -> tuple[float, float]:
    """Mean (forward, backward) wire bytes per iteration, all links summed, after ``skip`` iterations."""
    steps = step_records(records)
    rest = steps[skip:] or steps
    fwd = sum(r.get("fwd_wire_bytes", 0) for r in rest) / len(rest)
    bwd = sum(r.get("bwd_wire_bytes", 0) for r in rest) / len(rest)
    return fwd, bwd


def auto_choices(records: list[dict]) -> dict[str, dict[str, float]]:
    """What ``auto`` sent with: {direction: {codec: share of the (iteration, link) pairs of the run}}, from the
    per-link choices each training record carries (``"i->j"``: forward when j > i)."""
    counts: dict[str, dict[str, int]] = {"forward": {}, "backward": {}}
    for record in step_records(records):
        for link, choice in (record.get("auto") or {}).items():
            src, dst = (int(x) for x in link.split("->"))
            direction = counts["forward" if dst > src else "backward"]
            direction[choice["codec"]] = direction.get(choice["codec"], 0) + 1
    return {d: {codec: n / sum(c.values()) for codec, n in sorted(c.items(), key=lambda kv: -kv[1])}
            for d, c in counts.items() if c}
