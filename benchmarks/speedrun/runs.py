"""The CPU speedrun's runs: the model, the codecs, the loss runs and the timing runs (Megatron's own loop).

Every run is ``python -m megatron_tah.pretrain_gpt`` at pipeline depth 8, one transformer layer per
stage (``benchmarks.common.runner``: torchrun, gloo, the CPU flags), on the shipped Shakespeare corpus
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

from ..common.codecs import CODECS, NEEDS_LINK, busiest_nbytes, codec_flags, entropy_coded
from ..common.runner import Run

VOCAB = 8192
"""The compact vocabulary's size (``prepare_data``): 8190 most frequent GPT-2 ids, ``<unk>`` and end-of-document."""

def emulated_for(codec: str, emulated: bool) -> bool:
    """Whether ``codec``'s loss runs use emulated boundaries when the page's do (``emulated``): a codec that
    chooses from the link (``NEEDS_LINK``) runs the real pipeline even then, and so do the bf16 runs its steps
    are paired with."""
    return emulated and codec not in NEEDS_LINK


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
