"""Compact GPT trainer on megatron-core pipelines: ``python -m megatron_tah.train``.

For machines without a Megatron-LM checkout. One process per pipeline stage
(started here with ``spawn``, or by ``torchrun`` / ``python -m
megatron_tah.slow_link`` through the usual ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT`` variables), gloo on CPU and NCCL on GPUs,
megatron-core's ``GPTModel`` (local layer spec) and 1F1B schedule, with the
pipeline traffic compressed by :func:`megatron_tah.megatron.patch.install`. Flags: see
``trainer_args``. The last stage prints one Megatron-style line per iteration
and, with ``--log-json PATH``, writes one JSON object per line::

    {"iteration", "consumed_samples", "lm_loss", "lr", "grad_norm", "ms", "tokens_per_s",
     "fwd_raw_bytes", "fwd_wire_bytes", "bwd_raw_bytes", "bwd_wire_bytes", "compression_ratio",
     "codec_ms", "buffer_bytes", "tah": {...stats.collect()...}, ["valid_loss", "valid_ppl"]}

Byte counts and ``codec_ms`` (encode + decode wall time) are per iteration and summed over
all stages (both directions); ``buffer_bytes`` is what AQ-SGD's per-sample buffers hold on
all stages after the iteration (0 for the other codecs).
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import socket
import sys
import time

import numpy as np
import torch

from . import checkpoint
from .trainer_args import parse_args, split_bounds


# ----------------------------------------------------------------------------- data
class TokenSamples:
    """Fixed-length samples cut from the concatenated documents of an indexed dataset.

    Sample ``i`` is tokens ``[i*s, i*s + s + 1)`` of the stream (``s`` = seq
    length); ``split`` selects a contiguous fraction of the samples (a
    train/valid split of one dataset). Sample ``i``'s id, ``id_base + i``, is
    stable across epochs and runs (AQ-SGD keys its buffers by it); ``id_base``
    defaults to the split's first sample, so ids of two splits never collide.
    """

    def __init__(self, prefix: str, seq_length: int, split: tuple[float, float] | None = None,
                 id_base: int | None = None):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        ds = IndexedDataset(prefix)
        # Kept in the file's dtype (uint16 for GPT-2); batches are converted to int64.
        self.tokens = np.concatenate([np.asarray(ds[i]) for i in range(len(ds))])
        self.prefix = prefix
        self.seq_length = seq_length
        total = (len(self.tokens) - 1) // seq_length
        first, count = 0, total
        if split is not None:
            first = int(total * split[0])
            count = max(0, int(total * split[1]) - first)
        if count < 1:
            raise checkpoint.RunError(f"dataset {prefix}: {len(self.tokens)} tokens give no samples of "
                                      f"{seq_length + 1} tokens in this split")
        self.first, self.count = first, count
        self.id_base = first if id_base is None else id_base

    def __len__(self) -> int:
        return self.count

    def check_vocab(self, vocab_size: int) -> None:
        top = int(self.tokens.max())
        if top >= vocab_size:
            raise checkpoint.RunError(f"dataset {self.prefix} holds token id {top}, outside the vocabulary of "
                                      f"{vocab_size} (tokenized with another vocabulary? check --vocab-size)")

    def sample(self, i: int) -> np.ndarray:
        start = (self.first + i) * self.seq_length
        return self.tokens[start: start + self.seq_length + 1]


def batches(data: TokenSamples, micro_batch_size: int, consumed: int, seed: int | None, device):
    """Endless micro-batches from sample number ``consumed`` on; a new permutation per epoch (``seed``)."""
    n = len(data)
    position = torch.arange(data.seq_length, device=device).unsqueeze(0).expand(micro_batch_size, -1)
    perm, perm_epoch = None, -1
    while True:
        ids = []
        for c in range(consumed, consumed + micro_batch_size):
            epoch, pos = divmod(c, n)
            if seed is not None and epoch != perm_epoch:
                perm, perm_epoch = np.random.default_rng(seed + epoch).permutation(n), epoch
            ids.append(int(perm[pos]) if seed is not None else pos)
        consumed += micro_batch_size
        chunk = torch.from_numpy(np.stack([data.sample(i) for i in ids]).astype(np.int64)).to(device)
        yield {"tokens": chunk[:, :-1].contiguous(), "labels": chunk[:, 1:].contiguous(), "position_ids": position,
               "sample_ids": torch.tensor([data.id_base + i for i in ids], dtype=torch.long)}


# ----------------------------------------------------------------------------- model and optimizer
def build_model(args, device, dtype):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, pipeline_dtype=dtype,
        params_dtype=dtype, bf16=args.bf16, use_cpu_initialization=True,
    )
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
    )
    model = model.to(device)
    if args.bf16:  # as Megatron does: bf16 module, fp32 logits/losses on the last stage
        from megatron.core.transformer.module import Float16Module

        return Float16Module(config, model)
    return model


class MasterAdam:
    """AdamW over fp32 master weights (the parameters themselves unless they are bf16).

    No weight decay on biases and norms (1-D parameters), as in Megatron.
    ``clip_and_step`` clips by the gradient norm over all pipeline stages.
    """

    def __init__(self, model, args):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone() if p.dtype != torch.float32 else p for p in self.params]
        groups = [{"params": [m for m in self.master if m.dim() > 1], "weight_decay": args.weight_decay},
                  {"params": [m for m in self.master if m.dim() <= 1], "weight_decay": 0.0}]
        self.adam = torch.optim.AdamW(groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                                      eps=args.adam_eps)
        self.clip = args.clip_grad

    def clip_and_step(self, lr: float, group) -> float:
        for p, m in zip(self.params, self.master):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
        grads = [m.grad for m in self.master if m.grad is not None]
        sq = torch.zeros((), dtype=torch.float32, device=self.master[0].device)
        for g in grads:
            sq += g.pow(2).sum()
        torch.distributed.all_reduce(sq, group=group)
        norm = float(sq.sqrt())
        if self.clip > 0 and norm > self.clip:
            for g in grads:
                g.mul_(self.clip / (norm + 1e-6))
        for group_ in self.adam.param_groups:
            group_["lr"] = lr
        self.adam.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                if m is not p:
                    p.copy_(m)
        return norm

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict:
        master = [m.detach().clone() for m, p in zip(self.master, self.params) if m is not p]
        return {"adam": self.adam.state_dict(), "master": master}

    def load_state_dict(self, state: dict) -> None:
        self.adam.load_state_dict(state["adam"])
        copies = iter(state["master"])
        with torch.no_grad():
            for m, p in zip(self.master, self.params):
                if m is not p:
                    m.copy_(next(copies))

    def sync_from_model(self) -> None:
        with torch.no_grad():
            for m, p in zip(self.master, self.params):
                if m is not p:
                    m.copy_(p.float())


def learning_rate(args, iteration: int) -> float:
    """Linear warmup to ``--lr``, then constant, linear or cosine decay to ``--min-lr``."""
    if args.lr_warmup_iters and iteration <= args.lr_warmup_iters:
        return args.lr * iteration / args.lr_warmup_iters
    span = max(1, args.train_iters - args.lr_warmup_iters)
    frac = min(1.0, (iteration - 1 - args.lr_warmup_iters) / span)  # iteration 1 after warmup runs at --lr
    if args.lr_decay_style == "constant":
        return args.lr
    if args.lr_decay_style == "linear":
        return args.min_lr + (args.lr - args.min_lr) * (1 - frac)
    return args.min_lr + (args.lr - args.min_lr) * 0.5 * (1 + math.cos(math.pi * frac))


# ----------------------------------------------------------------------------- steps
def _loss_func(loss_mask, output_tensor):
    losses = output_tensor.float()
    loss = (losses * loss_mask).sum() / loss_mask.sum()
    # The schedule divides the returned loss in place: report a copy.
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(state, data_iterator, model):
    from megatron.core import parallel_state

    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    batch = next(data_iterator) if (first or last) else None
    if first and state["push_ids"] is not None:
        state["push_ids"](batch["sample_ids"])
    tokens = batch["tokens"] if first else None
    positions = batch["position_ids"] if first else None
    labels = batch["labels"] if last else None
    # Causal mask, True = masked (Megatron's convention); passed explicitly, as its default is built on CUDA.
    output = model(tokens, positions, state["causal_mask"], labels=labels)
    mask = torch.ones_like(labels, dtype=torch.float32) if last else None
    return output, functools.partial(_loss_func, mask)


def run_schedule(args, model, iterator, state, forward_only: bool) -> float | None:
    """One global batch through the pipeline; the mean lm loss on the last stage, None elsewhere."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    losses = get_forward_backward_func()(
        forward_step_func=functools.partial(_forward_step, state), data_iterator=iterator, model=[model],
        num_microbatches=args.num_microbatches, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, forward_only=forward_only)
    if not losses:
        return None
    return float(torch.stack([d["lm loss"].float() for d in losses]).mean())


def evaluate(args, model, valid, device, state) -> float | None:
    """Mean validation loss over ``--eval-iters`` fixed batches (last stage; None elsewhere)."""
    model.eval()
    it = batches(valid, args.micro_batch_size, 0, None, device)
    with torch.no_grad():
        values = [run_schedule(args, model, it, state, forward_only=True) for _ in range(args.eval_iters)]
    model.train()
    return None if values[0] is None else float(np.mean(values))


# ----------------------------------------------------------------------------- logging
def _traffic(stats: dict) -> dict:
    out = {}
    for direction, key in (("forward", "fwd"), ("backward", "bwd")):
        entry = stats.get(direction) or {}
        out[f"{key}_raw_bytes"] = int(entry.get("raw_bytes", 0))
        out[f"{key}_wire_bytes"] = int(entry.get("wire_bytes", 0))
    wire = out["fwd_wire_bytes"] + out["bwd_wire_bytes"]
    out["compression_ratio"] = (out["fwd_raw_bytes"] + out["bwd_raw_bytes"]) / wire if wire else None
    # encode + decode time summed over the stages (not the critical path), and AQ-SGD's buffer.
    out["codec_ms"] = 1e3 * sum((stats.get(d) or {}).get(k, 0.0) for d in ("forward", "backward")
                                for k in ("encode_seconds", "decode_seconds"))
    out["buffer_bytes"] = int(stats.get("buffer_bytes", 0))
    return out


def _jsonable(stats: dict) -> dict:
    """``stats.collect()`` output with its ``(src, dst)`` link keys written as ``"src->dst"``."""
    out = {k: v for k, v in stats.items() if k != "links"}
    out["links"] = {f"{src}->{dst}": n for (src, dst), n in stats.get("links", {}).items()}
    return out


def log_line(args, rec: dict, tah_text: str) -> str:
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    mb = (rec["fwd_wire_bytes"] + rec["bwd_wire_bytes"]) / 1e6
    ratio = "n/a" if rec["compression_ratio"] is None else f"{rec['compression_ratio']:.2f}x"
    return (f" [{now}] iteration {rec['iteration']:8d}/{args.train_iters:8d} | consumed samples: "
            f"{rec['consumed_samples']:10d} | elapsed time per iteration (ms): {rec['ms']:.1f} | tokens per second: "
            f"{rec['tokens_per_s']:.0f} | learning rate: {rec['lr']:.6E} | global batch size: "
            f"{args.global_batch_size:5d} | lm loss: {rec['lm_loss']:.6E} | grad norm: {rec['grad_norm']:.3f} | "
            f"MB sent: {mb:.3f} | compression: {ratio} |{tah_text}")


def validation_banner(iteration: int, loss: float) -> str:
    text = (f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | "
            f"lm loss PPL: {math.exp(min(loss, 700)):.6E} | ")
    return "-" * len(text) + "\n" + text + "\n" + "-" * len(text)


# ----------------------------------------------------------------------------- the run
def quiet_imports() -> None:
    """Silence megatron-core's notices about optional packages this trainer does not use (TE, Apex, absl)."""
    import logging
    import warnings

    for text in ("Transformer Engine and Apex are not installed", "Apex is not installed", "absl.logging is not",
                 "full scope is deprecated"):
        warnings.filterwarnings("ignore", message=text)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def _setup(args):
    """Process group, megatron parallel state, shims, seeds, patch. Returns (device, rank, world)."""
    from megatron.core import parallel_state, tensor_parallel

    from .megatron import patch

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != args.pipeline_model_parallel_size:
        raise checkpoint.RunError(f"WORLD_SIZE {world} != --pipeline-model-parallel-size "
                                  f"{args.pipeline_model_parallel_size}: one process per stage (no data parallelism "
                                  "in the compact trainer)")
    backend = args.distributed_backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        from .megatron.cpu_shims import apply_cpu_shims

        apply_cpu_shims()
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    torch.distributed.init_process_group(backend=backend, rank=rank, world_size=world,
                                         timeout=datetime.timedelta(minutes=10))
    parallel_state.initialize_model_parallel(1, args.pipeline_model_parallel_size)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    patch.install(args.tah_config)
    return device, rank, world


def _link_text(args) -> str:
    if args.tah_config.tah_emulate_bandwidth:
        return f"emulated {args.tah_config.tah_emulate_bandwidth}"
    if os.environ.get("MTAH_LINK_RATE_BPS"):  # set by megatron_tah.slow_link
        return f"{float(os.environ['MTAH_LINK_RATE_BPS']) / 1e6:g} Mbit/s (tc in network namespaces)"
    return "unthrottled"


def train(args) -> None:
    """Train on this process's stage (process group environment must be set)."""
    from megatron.core import parallel_state

    from .megatron import patch
    from .megatron import stats as tah_stats

    device, _, _ = _setup(args)
    stage, last = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.is_pipeline_last_stage()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = build_model(args, device, dtype)
    core = getattr(model, "module", model)  # checkpoints hold the unwrapped GPTModel's weights
    optimizer = MasterAdam(model, args)
    iteration, consumed = 0, 0
    if args.load:
        iteration, consumed = checkpoint.load(args.load, stage, core, optimizer, args)
        if args.finetune or args.no_load_optim:
            optimizer.sync_from_model()
    needs_data = parallel_state.is_pipeline_first_stage() or last
    train_data = valid_data = None
    if needs_data:
        if args.valid_prefix is None:
            train_data = TokenSamples(args.train_prefix, args.seq_length, split_bounds(args.split, 0))
            valid_data = TokenSamples(args.train_prefix, args.seq_length, split_bounds(args.split, 1))
        else:
            train_data = TokenSamples(args.train_prefix, args.seq_length)
            valid_data = TokenSamples(args.valid_prefix, args.seq_length, id_base=len(train_data))
        for data in (train_data, valid_data):
            data.check_vocab(args.vocab_size_unpadded)
    push = None
    if args.tah_config.tah_forward_codec == "aqsgd":
        push = patch.push_sample_ids
    causal = torch.triu(torch.ones(args.seq_length, args.seq_length, device=device, dtype=torch.bool), diagonal=1)
    state = {"push_ids": push, "causal_mask": causal.view(1, 1, args.seq_length, args.seq_length)}
    n_params = torch.tensor([sum(p.numel() for p in model.parameters())], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(n_params)
    if last:
        print(f"> compact GPT: {int(n_params.item()):,} parameters, {args.num_layers} layers over "
              f"{args.pipeline_model_parallel_size} stages, vocab {args.padded_vocab_size}, seq {args.seq_length}, "
              f"micro batch {args.micro_batch_size} x {args.num_microbatches}, {device.type}, "
              f"forward codec {args.tah_config.tah_forward_codec}, backward codec "
              f"{args.tah_config.tah_backward_codec}, link {_link_text(args)}"
              + (f", resumed at iteration {iteration}" if iteration else ""), flush=True)
    log = open(args.log_json, "a" if iteration else "w") if (last and args.log_json) else None
    train_it = batches(train_data, args.micro_batch_size, consumed, args.seed, device) if needs_data else None
    tokens_per_iter = args.global_batch_size * args.seq_length
    tah_stats.collect(reset=True)
    try:
        while iteration < args.train_iters:
            iteration += 1
            start = time.perf_counter()
            optimizer.zero_grad()
            loss = run_schedule(args, model, train_it, state, forward_only=False)
            lr = learning_rate(args, iteration)
            grad_norm = optimizer.clip_and_step(lr, pp_group)
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            consumed += args.global_batch_size
            reduced = tah_stats.reduce_to_last_rank(tah_stats.collect(reset=True))
            evaluated = (args.eval_interval and iteration % args.eval_interval == 0) or iteration == args.train_iters
            valid_loss = evaluate(args, model, valid_data, device, state) if evaluated else None
            tah_stats.collect(reset=True)  # validation traffic is not part of the iteration's bytes
            if args.save and ((args.save_interval and iteration % args.save_interval == 0)
                              or iteration == args.train_iters):
                checkpoint.save(args.save, stage, iteration, consumed, core, optimizer, args,
                                barrier=lambda: torch.distributed.barrier())
            if not last:
                continue
            rec = {"iteration": iteration, "consumed_samples": consumed, "lm_loss": loss, "lr": lr,
                   "grad_norm": grad_norm, "ms": elapsed * 1e3, "tokens_per_s": tokens_per_iter / elapsed,
                   **_traffic(reduced), "tah": _jsonable(reduced)}
            if valid_loss is not None:
                rec.update(valid_loss=valid_loss, valid_ppl=math.exp(min(valid_loss, 700)))
            if not args.quiet and (iteration % max(1, args.log_interval) == 0 or iteration == args.train_iters):
                print(log_line(args, rec, tah_stats.format_for_log(reduced)), flush=True)
            if valid_loss is not None and not args.quiet:
                print(validation_banner(iteration, valid_loss), flush=True)
            if log:
                log.write(json.dumps(rec, default=float) + "\n")
                log.flush()
    finally:
        if log:
            log.close()
        patch.uninstall()
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------- launching
def _die_with_parent() -> None:
    """Linux: have the kernel kill this stage process when its launcher dies (no orphaned stages)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the launcher died before prctl took effect
        os._exit(1)


def _worker(local_rank: int, args, port: int) -> None:
    _die_with_parent()
    quiet_imports()
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(args.pipeline_model_parallel_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _run_or_exit(args)


def _run_or_exit(args) -> None:
    try:
        train(args)
    except checkpoint.RunError as err:  # other failures keep their traceback
        print(f"error (rank {os.environ.get('RANK')}): {err}", file=sys.stderr, flush=True)
        sys.exit(2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    quiet_imports()
    args = parse_args(argv)
    if args.load:
        try:
            checkpoint.latest_iteration(args.load)
        except checkpoint.RunError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun or slow_link started us
        _run_or_exit(args)
        return
    import torch.multiprocessing as mp

    try:
        mp.start_processes(_worker, args=(args, _free_port()), nprocs=args.pipeline_model_parallel_size,
                           start_method="spawn")
    except mp.ProcessExitedException as err:
        sys.exit(err.exit_code if err.exit_code and err.exit_code > 0 else 1)
    except mp.ProcessRaisedException as err:
        print(f"error: a stage process failed:\n{err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
