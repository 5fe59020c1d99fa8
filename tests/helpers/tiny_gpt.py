"""A tiny megatron-core GPT for the multi-rank tests of the tensor-parallel, data-parallel and
activation-memory places: built and trained inside each rank, with megatron-core's own
schedules, DDP and optimizer where a test asks for them. fp32, no dropout, CPU shims on.

``build(tp, pp, sp=False, ...)`` initialises model parallelism and returns the model;
``train(run, iterations)`` runs ``iterations`` schedule steps and returns the last stage's losses
per iteration and the gradients of the last step. ``sequence_parallel`` needs a norm that knows
about it; megatron-core's torch norm refuses it (TE/Apex provide one), so ``SequenceParallelNorm``
marks its parameters the way those do and ``train`` all-reduces their gradients over the
tensor-parallel group, as ``finalize_model_grads`` does.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

HIDDEN, HEADS, SEQ, VOCAB, MICRO_BATCH, MICRO_BATCHES = 128, 4, 32, 128, 2, 4


class SequenceParallelNorm(torch.nn.LayerNorm):
    def __init__(self, config, hidden_size, eps=1e-5, **unused):
        super().__init__(hidden_size, eps=eps)
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel


def learnable_micro_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One learnable micro-batch (token t+1 = 5 t + 3 s mod VOCAB from a random start): (tokens, labels)."""
    start = torch.randint(0, VOCAB, (MICRO_BATCH, 1), generator=g)
    steps = torch.arange(SEQ + 1).unsqueeze(0)
    tokens = (start * 5 ** (steps % 4) + 3 * steps) % VOCAB
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def batches(seed: int):
    """MICRO_BATCHES learnable micro-batches, fixed for a seed."""
    g = torch.Generator().manual_seed(seed)
    return [learnable_micro_batch(g) for _ in range(MICRO_BATCHES)]


def forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    return language_model_step(model, tokens, labels)


def language_model_step(model, tokens, labels):
    """Megatron's forward step on one micro-batch (causal mask): the model's output and the mean-loss function."""
    positions = torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, SEQ)
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    output = model(tokens, positions, mask, labels=labels)

    def loss_func(per_token):
        loss = per_token.float().mean()
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def build(tp: int = 1, pp: int = 1, sp: bool = False, layers: int = 2, seed: int = 7, tied: bool = False):
    """A GPTModel on this rank's share of ``tp`` x ``pp`` (data parallel: the remaining ranks); ``tied``: the
    output layer shares the word embedding (Megatron-LM's default; megatron-core's ``GPTModel`` unties)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_tah.megatron.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS, use_cpu_initialization=True,
        pipeline_dtype=torch.float32, params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp,
        bias_dropout_fusion=False)
    spec = get_gpt_layer_local_spec()
    if sp:
        spec.submodules = dataclasses.replace(spec.submodules, input_layernorm=SequenceParallelNorm,
                                              pre_mlp_layernorm=SequenceParallelNorm)
        spec = TransformerBlockSubmodules(layer_specs=[spec] * (layers // pp), layer_norm=SequenceParallelNorm)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=tied,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage())


def wrap_ddp(model, distributed_optimizer: bool, lr: float):
    """megatron-core's DistributedDataParallel around ``model`` and its optimizer (Adam)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer,
                                               grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, use_distributed_optimizer=distributed_optimizer,
                        clip_grad=0.0), [ddp], use_gloo_process_groups=False)
    return ddp, optimizer


def train(model, iterations: int, lr: float = 0.0, seed: int = 1234, ddp_optimizer=None):
    """Run ``iterations`` steps; returns (last-stage losses per iteration, this rank's gradients after the last).

    ``model`` is a GPTModel (plain Adam on its parameters, gradients all-reduced over the
    tensor-parallel group for sequence-parallel norms) or, with ``ddp_optimizer``, the DDP module
    (megatron-core's optimizer; ``finalize_model_grads`` reduces the gradients)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    params = [p for p in model.parameters()]
    optimizer = ddp_optimizer or (torch.optim.Adam(params, lr=lr) if lr else None)
    losses = []
    for _ in range(iterations):
        if ddp_optimizer is not None:
            model.zero_grad_buffer()
            optimizer.zero_grad()
        else:
            for p in params:
                p.grad = None
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches(seed)), model=model,
            num_microbatches=MICRO_BATCHES, seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=False)
        losses.append([float(d["loss"]) for d in out])
        if ddp_optimizer is not None:
            finalize_model_grads([model])
        else:
            group = parallel_state.get_tensor_model_parallel_group()
            for p in params:
                if getattr(p, "sequence_parallel", False) and p.grad is not None:
                    torch.distributed.all_reduce(p.grad, group=group)
        if optimizer is not None:
            optimizer.step()
    grads = {}
    for name, p in model.named_parameters():
        grad = getattr(p, "main_grad", None) if ddp_optimizer is not None else p.grad
        if grad is not None:
            grads[name] = grad.detach().clone()
    return losses, grads


def same(a, b) -> bool:
    """Bit-identical losses and gradients (results of ``train``)."""
    (la, ga), (lb, gb) = a, b
    return la == lb and ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga)


class WireSpy:
    """Counts the bytes ``megatron_tah.megatron.collectives`` hands to ``all_to_all_single`` /
    ``all_gather`` (the two collectives the compressed path uses) for *other* ranks, and their dtypes.
    Calls from elsewhere (e.g. the pipeline transports' configuration check) are not counted."""

    ORIGIN = "megatron_tah.megatron.collectives"

    def __init__(self):
        self.nbytes = 0
        self.calls = []

    def __enter__(self):
        dist = torch.distributed
        self._a2a, self._ag = dist.all_to_all_single, dist.all_gather
        spy = self

        def ours() -> bool:
            return sys._getframe(2).f_globals.get("__name__") == spy.ORIGIN

        def all_to_all_single(output, input, *args, group=None, **kwargs):
            if ours():
                size = dist.get_world_size(group)
                spy.nbytes += input.numel() * input.element_size() * (size - 1) // size
                spy.calls.append(("all_to_all_single", input.dtype))
            return spy._a2a(output, input, *args, group=group, **kwargs)

        def all_gather(tensor_list, tensor, group=None, async_op=False):
            if ours():
                spy.nbytes += tensor.numel() * tensor.element_size() * (len(tensor_list) - 1)
                spy.calls.append(("all_gather", tensor.dtype))
            return spy._ag(tensor_list, tensor, group=group, async_op=async_op)

        dist.all_to_all_single, dist.all_gather = all_to_all_single, all_gather
        return self

    def __exit__(self, *exc):
        torch.distributed.all_to_all_single, torch.distributed.all_gather = self._a2a, self._ag

    @property
    def uint8_only(self) -> bool:
        return all(dtype == torch.uint8 for _, dtype in self.calls)


def plain(value):
    """Tensors as lists (results cross the process boundary as plain data)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    return value
