"""Megatron-LM GPT pretraining and fine-tuning with compressed pipeline traffic.

    torchrun --nproc-per-node 4 -m megatron_tah.pretrain_gpt <Megatron-LM flags> <--tah-* flags>
    torchrun ... -m megatron_tah.pretrain_gpt ... --load CKPT --finetune      # fine-tuning

Megatron-LM's own training loop (``megatron.training.pretrain``: optimizer, LR schedule,
checkpoints, evaluation, logging, TensorBoard) with megatron_tah's plugin installed
(``--tah-*`` flags, compressing pipeline transports, statistics in the log line, per-iteration
JSON with ``--tah-log-json``); without a ``--tah-*`` flag nothing is compressed and the run is
Megatron's own (``--tah-preset paper``: TAH-Quant). What this script adds is what Megatron-LM's ``pretrain_gpt.py``
adds to the loop, written here because the megatron-core wheel does not ship that script:

* the model: megatron.training's ``GPTModelConfig`` built from the arguments
  (``gpt_config_from_args``), as Megatron-LM's 0.19 ``pretrain_gpt.py`` does;
* ``forward_step``: a batch from the data iterator on the first and last stage (broadcast over the
  tensor-parallel group when it has more than one rank), the model's forward, and the masked
  token loss ``(sum over tokens, number of tokens)`` with Megatron's NaN/Inf check;
* the datasets: megatron-core's ``GPTDataset`` through ``BlendedMegatronDatasetBuilder`` from
  ``--data-path``/``--split`` or ``--{train,valid,test}-data-path``.

``--fixed-epoch-samples`` cuts the training and validation splits into
one epoch of samples each and revisits the same samples every epoch in a new seeded order, each
with a stable id: AQ-SGD (``--tah-forward-codec aqsgd``) keys its per-sample buffers by that id
and turns the flag on. Without it the data are Megatron's (``GPTDataset`` reshuffles documents
across epochs, so no window recurs). ``--fixed-validation`` evaluates on the same samples every time,
``--eval-data-seed`` on the same samples whatever ``--seed`` is, and ``--eval-token-accuracy`` adds the greedy
next-token accuracy to the evaluations' report.

On a machine without CUDA pass ``--transformer-impl local --distributed-backend gloo``; the
plugin applies the CPU shims (``megatron_tah.megatron.cpu_shims``). Pre-tokenized GPT-2 data
need no tokenizer files: ``--tokenizer-type NullTokenizer --vocab-size 50257`` (GPT-2's
``<|endoftext|>``, id 50256, is then the end-of-document token).
"""

from __future__ import annotations

import sys
from functools import partial

import numpy as np
import torch


def add_script_arguments(parser):
    group = parser.add_argument_group(title="megatron_tah.pretrain_gpt")
    group.add_argument("--fixed-epoch-samples", action="store_true",
                       help="Revisit one epoch of fixed samples every epoch (new order), each with a stable "
                            "sample id; implied by --tah-forward-codec aqsgd.")
    group.add_argument("--fixed-validation", action="store_true",
                       help="Every evaluation reads the same eval-iters x global-batch-size validation samples "
                            "(the first ones of the validation split), so that validation losses of one run, "
                            "and of runs with the same seed, compare on the same tokens.")
    group.add_argument("--eval-data-seed", type=int, default=None,
                       help="Validation and test samples chosen by this seed alone (default: by --seed and the "
                            "schedule's length, as Megatron sizes the splits from --train-iters), so that runs with "
                            "any seed and schedule evaluate on the same samples; with --fixed-validation and "
                            "--valid-data-path / --test-data-path.")
    group.add_argument("--eval-token-accuracy", action="store_true",
                       help="Evaluations also report the share of tokens whose most likely next token is the label "
                            "(greedy next-token accuracy, 'token accuracy'); the loss is then computed from the "
                            "logits here (fp32 cross entropy). Tensor-parallel size 1 only.")
    return parser


def validate_script_args(args) -> None:
    """This script's flags against Megatron's (a ``ValueError`` naming them)."""
    if args.eval_token_accuracy and args.tensor_model_parallel_size > 1:
        raise ValueError("--eval-token-accuracy needs --tensor-model-parallel-size 1 (the logits are split over "
                         f"{args.tensor_model_parallel_size} ranks)")
    if args.eval_data_seed is not None and not (args.valid_data_path or args.test_data_path):
        raise ValueError("--eval-data-seed needs --valid-data-path or --test-data-path (evaluation data of their own)")
    if args.eval_data_seed is not None and not args.fixed_validation:
        raise ValueError("--eval-data-seed needs --fixed-validation (without it every evaluation reads new samples, "
                         "as many as the schedule has evaluations)")


# ----- data ----------------------------------------------------------------------------------
class RepeatedSamples(torch.utils.data.Dataset):
    """``num_samples`` items cycling over the first ``period`` items of ``samples`` (``--fixed-validation``)."""

    def __init__(self, samples, num_samples: int, period: int):
        if period > len(samples):
            raise ValueError(f"--fixed-validation needs {period} validation samples (eval-iters x global-batch-size), "
                             f"the validation split has {len(samples)}")
        self.samples, self.num_samples, self.period = samples, int(num_samples), int(period)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        return self.samples[int(index) % self.period]


class RevisitedSamples(torch.utils.data.Dataset):
    """``num_samples`` items drawn epoch by epoch from one epoch of ``samples``, in a new seeded order
    per epoch; every item gets ``"sample_ids"`` = its index in ``samples`` + ``id_base``."""

    def __init__(self, samples, num_samples: int, seed: int, id_base: int = 0):
        self.samples, self.num_samples, self.seed, self.id_base = samples, int(num_samples), int(seed), int(id_base)
        self._order = (None, None)

    def __len__(self) -> int:
        return self.num_samples

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng(self.seed + epoch).permutation(len(self.samples)))
        return self._order[1]

    def __getitem__(self, index: int) -> dict:
        epoch, position = divmod(int(index), len(self.samples))
        sample = int(self._permutation(epoch)[position])
        item = dict(self.samples[sample])
        item["sample_ids"] = torch.tensor(sample + self.id_base, dtype=torch.long)
        return item


def _dataset_config(args, seed: int | None = None, splits: tuple[bool, bool, bool] = (True, True, True)):
    """Megatron's GPT dataset config from the arguments; ``seed`` (default ``--seed``) orders the samples,
    ``splits`` keeps the (train, valid, test) data paths given (``--{train,valid,test}-data-path``)."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    if blend_per_split is not None:
        blend_per_split = [b if keep else None for b, keep in zip(blend_per_split, splits)]
    return GPTDatasetConfig(
        random_seed=args.seed if seed is None else seed, sequence_length=args.seq_length, blend=blend,
        blend_per_split=blend_per_split,
        split=args.split, tokenizer=build_tokenizer(args), reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader, path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files, num_dataset_builder_threads=args.num_dataset_builder_threads,
    )


def uses_fixed_epoch_samples(args) -> bool:
    from megatron_tah.megatron.arguments import tah_config_from_args

    return bool(getattr(args, "fixed_epoch_samples", False)) or tah_config_from_args(args).forward_codec().needs_sample_ids


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's GPT datasets (``GPTDataset``), or one revisited epoch of them (``--fixed-epoch-samples``)."""
    from megatron.core import mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.training import get_args, print_rank_0

    args = get_args()
    fixed = uses_fixed_epoch_samples(args)
    sizes = [None, None, train_val_test_num_samples[2]] if fixed else train_val_test_num_samples
    on_rank = lambda: mpu.get_tensor_model_parallel_rank() == 0  # noqa: E731
    eval_data_seed = getattr(args, "eval_data_seed", None)  # absent where a checkout's own script parsed the flags
    if eval_data_seed is None:
        train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, sizes, on_rank, _dataset_config(args)).build()
    else:  # the evaluation splits in an order of their own, sized by one evaluation: the same for every seed and
        # schedule (Megatron sizes a split by all the evaluations of the schedule, and a size of more epochs than
        # one shuffles its samples otherwise)
        train, _, _ = BlendedMegatronDatasetBuilder(
            GPTDataset, sizes, on_rank, _dataset_config(args, splits=(True, False, False))).build()
        one = args.eval_iters * args.global_batch_size
        _, valid, test = BlendedMegatronDatasetBuilder(
            GPTDataset, [sizes[0], one, one], on_rank, _dataset_config(args, eval_data_seed, (False, True, True))
        ).build()
    if getattr(args, "fixed_validation", False) and valid is not None:
        valid = RepeatedSamples(valid, max(len(valid), train_val_test_num_samples[1]),
                                args.eval_iters * args.global_batch_size)
        print_rank_0(f"> --fixed-validation: every evaluation reads the same {valid.period} validation samples")
    if not fixed:
        return train, valid, test
    if train is not None:
        print_rank_0(f"> --fixed-epoch-samples: {len(train)} training samples revisited every epoch, "
                     f"{len(valid) if valid is not None else 0} validation samples")
        train = RevisitedSamples(train, train_val_test_num_samples[0], args.seed)
        if valid is not None:
            valid = RevisitedSamples(valid, train_val_test_num_samples[1], args.seed, id_base=len(train.samples))
    return train, valid, test


train_valid_test_datasets_provider.is_distributed = True  # built on TP rank 0 of every stage that reads data


# ----- forward step --------------------------------------------------------------------------
BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def get_batch(data_iterator, vp_stage=None):
    """The micro-batch on the first and last stage (``None`` elsewhere); pushes AQ-SGD sample ids."""
    from megatron.core import mpu
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    if not is_first_or_last_pipeline_stage(vp_stage):
        return dict.fromkeys(BATCH_KEYS)
    args = get_args()
    batch = {}
    if mpu.get_tensor_model_parallel_rank() == 0:
        batch = next(data_iterator)
        if "sample_ids" in batch and mpu.is_pipeline_first_stage(ignore_virtual=True):
            from megatron_tah.megatron.pipeline_parallel import push_sample_ids

            push_sample_ids(batch["sample_ids"])
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        batch = {key: None if batch.get(key) is None else batch[key].to(device, non_blocking=True)
                 for key in BATCH_KEYS}
    if mpu.get_tensor_model_parallel_world_size() > 1:
        from megatron.core.utils import get_batch_on_this_tp_rank

        batch = get_batch_on_this_tp_rank(
            batch, has_cu_seqlens=False, is_hybrid_cp=False,
            create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
            broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
            broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size,
            tp_rank=mpu.get_tensor_model_parallel_rank(), micro_batch_size=args.micro_batch_size,
            seq_length=args.seq_length, mtp_on_this_rank=False,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            is_pipeline_first_stage=mpu.is_pipeline_first_stage(), is_pipeline_last_stage=mpu.is_pipeline_last_stage())
    return batch


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, labels: torch.Tensor | None = None):
    """Masked token loss: ``(sum, number of tokens, {"lm loss": [sum, tokens]})``, Megatron's reporting.

    ``output_tensor``: the model's per-token losses; with ``labels``, its logits ``[b, s, vocab]`` instead,
    from which the fp32 cross entropy and the greedy next-token accuracy (``"token accuracy"``) are computed."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    mask = loss_mask.view(-1).float()
    extra = {}
    if labels is None:
        losses = output_tensor.view(-1).float()
    else:
        logits = output_tensor.float().reshape(-1, output_tensor.shape[-1])
        losses = torch.nn.functional.cross_entropy(logits, labels.reshape(-1), reduction="none")
        correct = (logits.argmax(dim=-1) == labels.reshape(-1)).float()
        extra["token accuracy"] = torch.stack([torch.sum(correct * mask), mask.sum()]).detach()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    if get_args().check_for_nan_in_loss_and_grad:
        checker = get_rerun_state_machine()
        for rejected, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            checker.validate_result(result=loss, rejection_func=rejected, tolerance=0.0, fatal=True,
                                    message=f"found {what} in local forward loss calculation")
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)]), **extra}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_args

    batch = get_batch(data_iterator, get_attr_wrapped_model(model, "vp_stage"))
    accuracy = getattr(get_args(), "eval_token_accuracy", False) and not model.training  # evaluations only
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=None if accuracy else batch["labels"], loss_mask=batch["loss_mask"])
    return output, partial(loss_func, batch["loss_mask"], labels=batch["labels"] if accuracy else None)


# ----- running it ------------------------------------------------------------------------------
CPU_FLAGS = ("--transformer-impl", "local", "--distributed-backend", "gloo", "--no-gradient-accumulation-fusion",
             "--no-persist-layer-norm")
"""Megatron flags for a CPU run: local layers, gloo, and the two any run without Apex needs."""

GPT2_DATA_FLAGS = ("--tokenizer-type", "NullTokenizer", "--vocab-size", "50257")
"""Pre-tokenized GPT-2 ids (``python -m megatron_tah.data``) without tokenizer files."""


def command(stages: int, flags: list[str], python: str = sys.executable) -> list[str]:
    """This entry with one process per stage on this host (``torchrun --standalone``: a free port)."""
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(stages),
            "-m", "megatron_tah.pretrain_gpt", *flags]


def stage_command(flags: list[str], python: str = sys.executable) -> list[str]:
    """One stage's process, for launchers that set RANK/WORLD_SIZE/MASTER_* themselves (netns_link)."""
    return [python, "-m", "megatron_tah.pretrain_gpt", *flags]


# ----- entry ---------------------------------------------------------------------------------
def main() -> None:
    from megatron_tah.megatron.plugin import install_megatron_lm_plugin

    install_megatron_lm_plugin()
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(extra_args_provider=add_script_arguments)
    try:
        validate_script_args(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    main()
