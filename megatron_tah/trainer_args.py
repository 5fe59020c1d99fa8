"""Command line of the compact trainer (``python -m megatron_tah.train``).

Flags follow Megatron-LM's names and meanings (``--num-layers``,
``--micro-batch-size``, ``--data-path``, ``--save``/``--load``/``--finetune``,
...) plus every ``--tah-*`` flag of :class:`megatron_tah.config.TahConfig`.
``parse_args`` validates everything that can be checked before processes
start (sizes, divisibility, data and vocabulary files) and exits with status 2
and one ``error:`` line naming the offending value, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from .megatron.arguments import add_tah_arguments, tah_config_from_args

DATA_SUFFIXES = (".bin", ".idx")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 * hidden size")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: seq length")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--bf16", action="store_true", help="bf16 parameters and pipeline messages (fp32 master weights)")


def _add_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=16)
    g.add_argument("--train-iters", type=int, default=100)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="cosine")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    g.add_argument("--seed", type=int, default=1234)


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=2)
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="only 1 is supported here")
    g.add_argument("--distributed-backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: nccl when CUDA is available, gloo otherwise")
    g.add_argument("--nproc", type=int, default=None,
                   help="processes to spawn when not started by torchrun (default: pipeline size)")


def _add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", default=None,
                   help="indexed dataset prefix (PREFIX.bin/.idx, split by --split), or the prefix given to "
                        "`python -m megatron_tah.data --output-prefix` (uses PREFIX_{train,valid}_text_document)")
    g.add_argument("--train-data-path", default=None, help="training dataset prefix (with --valid-data-path)")
    g.add_argument("--valid-data-path", default=None, help="validation dataset prefix")
    g.add_argument("--split", default="969,30,1", help="train,valid,test weights when one dataset is given")
    g.add_argument("--tokenizer-type", choices=("GPT2BPETokenizer", "NullTokenizer"), default="GPT2BPETokenizer")
    g.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json (default: the bundled GPT-2 files)")
    g.add_argument("--merge-file", default=None, help="GPT-2 merges.txt (default: the bundled GPT-2 files)")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: number of token ids")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)


def _add_logging_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging, evaluation, checkpoints")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--log-json", default=None, help="write one JSON record per iteration to this file")
    g.add_argument("--eval-interval", type=int, default=50, help="validate every N iterations (0: only at the end)")
    g.add_argument("--eval-iters", type=int, default=4, help="validation batches per evaluation")
    g.add_argument("--save", default=None, help="checkpoint directory")
    g.add_argument("--save-interval", type=int, default=0, help="save every N iterations (0: only at the end)")
    g.add_argument("--load", default=None, help="resume from this checkpoint directory (latest iteration)")
    g.add_argument("--finetune", action="store_true",
                   help="with --load: load weights only, reset iteration count and optimizer")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--quiet", action="store_true", help="no per-iteration lines (JSON log still written)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megatron_tah.train",
        description="Compact GPT pretraining/fine-tuning on megatron-core pipelines with compressed p2p traffic.",
    )
    _add_model_args(p)
    _add_training_args(p)
    _add_parallel_args(p)
    _add_data_args(p)
    _add_logging_args(p)
    add_tah_arguments(p)
    return p


def _dataset_exists(prefix: str) -> bool:
    return all(Path(prefix + s).is_file() for s in DATA_SUFFIXES)


def resolve_data_paths(args) -> tuple[str, str | None]:
    """(train prefix, valid prefix or None: split the train set); raises ValueError naming missing files."""
    if args.train_data_path or args.valid_data_path:
        if not (args.train_data_path and args.valid_data_path):
            raise ValueError("--train-data-path and --valid-data-path go together")
        pairs = [args.train_data_path, args.valid_data_path]
    elif args.data_path:
        prefix = args.data_path
        for s in DATA_SUFFIXES:  # accept "corpus.bin" for "corpus"
            prefix = prefix.removesuffix(s)
        if _dataset_exists(prefix):
            return prefix, None
        pairs = [f"{prefix}_train_text_document", f"{prefix}_valid_text_document"]
        if not all(_dataset_exists(x) for x in pairs):
            raise ValueError(
                f"--data-path {args.data_path}: found neither {prefix}.bin/.idx nor {pairs[0]}.bin/.idx and "
                f"{pairs[1]}.bin/.idx (prepare data with `python -m megatron_tah.data --corpus shakespeare "
                f"--output-prefix {prefix}`)")
        return pairs[0], pairs[1]
    else:
        raise ValueError("no data: give --data-path (or --train-data-path and --valid-data-path)")
    for x in pairs:
        if not _dataset_exists(x):
            raise ValueError(f"dataset {x}: {x}.bin or {x}.idx not found")
    return pairs[0], pairs[1]


def resolve_vocab_size(args) -> int:
    """Tokenizer vocabulary size (before padding); checks the vocab and merge files exist."""
    if args.tokenizer_type == "NullTokenizer":
        if not args.vocab_size or args.vocab_size < 2:
            raise ValueError(f"--tokenizer-type NullTokenizer needs --vocab-size >= 2, got {args.vocab_size}")
        return args.vocab_size
    if args.vocab_file is None or args.merge_file is None:
        from .data import default_vocab_files

        vocab, merges = default_vocab_files()
        args.vocab_file = args.vocab_file or str(vocab)
        args.merge_file = args.merge_file or str(merges)
    for flag, path in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
        if not Path(path).is_file():
            raise ValueError(f"{flag} {path}: file not found")
    try:
        with open(args.vocab_file, encoding="utf-8") as f:
            return len(json.load(f))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"--vocab-file {args.vocab_file}: not a GPT-2 vocab.json ({err})") from None


def split_bounds(split: str, part: int) -> tuple[float, float]:
    """Fractions ``[start, end)`` of part 0 (train), 1 (valid) or 2 (test) under Megatron's ``--split`` weights."""
    try:
        weights = [float(w) for w in split.replace("/", ",").split(",")]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or min(weights) < 0 or sum(weights) <= 0:
        raise ValueError(f"--split {split!r}: give up to three non-negative weights, e.g. 969,30,1")
    weights += [0.0] * (3 - len(weights))
    bounds = [sum(weights[:k]) / sum(weights) for k in range(4)]
    return bounds[part], bounds[part + 1]


def padded_vocab_size(size: int, divisible_by: int) -> int:
    return (size + divisible_by - 1) // divisible_by * divisible_by


def _check_sizes(a) -> None:
    positive = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                "global_batch_size", "train_iters", "pipeline_model_parallel_size", "make_vocab_size_divisible_by")
    for name in positive:
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} = {getattr(a, name)}: must be >= 1")
    for name in ("eval_interval", "eval_iters", "save_interval", "log_interval", "lr_warmup_iters"):
        if getattr(a, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} = {getattr(a, name)}: must be >= 0")
    if a.tensor_model_parallel_size != 1:
        raise ValueError(f"--tensor-model-parallel-size {a.tensor_model_parallel_size}: the compact trainer "
                         "supports 1 (use Megatron-LM's pretrain_gpt.py for tensor parallelism)")
    pp = a.pipeline_model_parallel_size
    if a.num_layers % pp:
        raise ValueError(f"--num-layers {a.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    if a.hidden_size % a.num_attention_heads:
        raise ValueError(f"--hidden-size {a.hidden_size} is not divisible by "
                         f"--num-attention-heads {a.num_attention_heads}")
    if a.global_batch_size % a.micro_batch_size:
        raise ValueError(f"--global-batch-size {a.global_batch_size} is not divisible by "
                         f"--micro-batch-size {a.micro_batch_size}")
    if a.nproc is not None and a.nproc != pp:
        raise ValueError(f"--nproc {a.nproc}: one process per stage, so it must equal "
                         f"--pipeline-model-parallel-size {pp} (no data parallelism here)")
    if a.max_position_embeddings is not None and a.max_position_embeddings < a.seq_length:
        raise ValueError(f"--max-position-embeddings {a.max_position_embeddings} < --seq-length {a.seq_length}")
    if a.finetune and not a.load:
        raise ValueError("--finetune needs --load (the pretraining checkpoint)")
    if a.load and not Path(a.load).is_dir():
        raise ValueError(f"--load {a.load}: directory not found")
    if a.lr <= 0 or a.min_lr < 0 or a.min_lr > a.lr:
        raise ValueError(f"--lr {a.lr} / --min-lr {a.min_lr}: need 0 <= min-lr <= lr and lr > 0")


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and validate; on bad input print ``error: ...`` and exit with status 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_sizes(args)
        args.tah_config = tah_config_from_args(args)
        args.train_prefix, args.valid_prefix = resolve_data_paths(args)
        if args.valid_prefix is None and split_bounds(args.split, 1)[0] == split_bounds(args.split, 1)[1]:
            raise ValueError(f"--split {args.split}: one dataset is given, so its validation share must be > 0")
        args.vocab_size_unpadded = resolve_vocab_size(args)
    except ValueError as err:
        parser.error(str(err))
    args.padded_vocab_size = padded_vocab_size(args.vocab_size_unpadded, args.make_vocab_size_divisible_by)
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    args.num_microbatches = args.global_batch_size // args.micro_batch_size
    for name in ("save", "load", "log_json"):
        if getattr(args, name):
            setattr(args, name, os.path.abspath(getattr(args, name)))
    return args
