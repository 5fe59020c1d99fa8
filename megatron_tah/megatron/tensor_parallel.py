"""Tensor-parallel collectives through a codec (TACO): ``--tah-tp-codec fp8``.

``install(place)`` replaces, in megatron-core's ``tensor_parallel`` package, what its layers call
at run time for tensor-parallel traffic (every replacement goes through ``place.patches``):

* ``mappings._reduce`` -- the all-reduce behind ``reduce_from_tensor_model_parallel_region``
  (RowParallelLinear's and VocabParallelEmbedding's forward) and the backward of
  ``copy_to_tensor_model_parallel_region``: ``collectives.all_reduce`` in place;
* ``dist_all_gather_func`` and ``dist_reduce_scatter_func`` of ``mappings`` (behind
  ``_gather_along_first_dim``, ``_gather_along_last_dim``, ``_reduce_scatter_along_first_dim``
  and ``_reduce_scatter_along_last_dim``: the sequence-parallel regions) and of ``layers``
  (ColumnParallelLinear's all-gather of its input with sequence parallelism, in forward and
  again for the weight gradient, and the reduce-scatter of its input gradient):
  ``collectives.all_gather`` / ``collectives.reduce_scatter``;
* ``layers.linear_with_grad_accumulation_and_async_allreduce`` and ``linear_with_frozen_weight``:
  ColumnParallelLinear's input-gradient all-reduce (``allreduce_dgrad``, without sequence
  parallelism) is issued by these functions with ``torch.distributed.all_reduce`` directly; the
  replacement passes the input through ``copy_to_tensor_model_parallel_region`` instead (its
  backward is the ``_reduce`` above -- Megatron's own arrangement when that all-reduce is not
  fused) and calls the original with ``allreduce_dgrad=False``. The all-reduce then no longer
  overlaps the weight-gradient GEMM.

What stays megatron-core's: tensors the codec cannot take (integer or bool dtypes), reductions
other than SUM/AVG, single-rank groups, the uneven-split variants (``output_split_sizes`` /
``input_split_sizes``, MoE), all-to-all, and the vocab-parallel cross entropy's own all-reduces.
The codec checks headers on the device (``megatron_tah.install`` compared every rank's settings) and, unless
``--tah-eager-codecs``, replays its calls from CUDA graphs, one per (op, shape, dtype): TP messages have
the shapes of the layers' activations (``codecs.core.graphs.place_codec``; eager on CPU, with one log line).
Statistics: stream ``tp_forward`` for collectives run during the forward pass, ``tp_backward``
during backward (autograd's graph task), with bytes as ``collectives.Traffic`` counts them.
"""

from __future__ import annotations

import inspect

import torch

from ..codecs import Codec
from ..codecs.core.graphs import place_codec
from ..config import TahConfig
from . import collectives
from .collectives import Done
from .patching import resolve
from .place_spec import PlaceSpec, direction
from .stats import Stream

MAPPINGS = "megatron.core.tensor_parallel.mappings"
LAYERS = "megatron.core.tensor_parallel.layers"
LINEAR_FUNCTIONS = ("linear_with_grad_accumulation_and_async_allreduce", "linear_with_frozen_weight")


def _takes(tensor: torch.Tensor, group, op=None) -> bool:
    return group is not None and group.size() > 1 and collectives.compressible(tensor, op)


def _reducing(place):
    def make(original):
        def _reduce(input_, group):
            if not _takes(input_, group):
                return original(input_, group)
            input_ = input_.contiguous()
            where = direction()
            rel_error = place.measure(where, input_)
            wait = place.wait(group, "tensor-parallel fp8 ")
            place.record(where, collectives.all_reduce(place.codec, input_, group, wait=wait), rel_error)
            return input_

        return _reduce

    return make


def _gathering(place):
    def make(original):
        def dist_all_gather_func(output_tensor, input_tensor, group=None, async_op=False):
            group = group if group is not None else torch.distributed.group.WORLD
            if not _takes(input_tensor, group):
                return original(output_tensor, input_tensor, group=group, async_op=async_op)
            where = direction()
            rel_error = place.measure(where, input_tensor)
            wait = place.wait(group, "tensor-parallel fp8 ")
            place.record(where, collectives.all_gather(place.codec, output_tensor, input_tensor, group, wait),
                         rel_error)
            return Done() if async_op else None

        return dist_all_gather_func

    return make


def _scattering(place):
    def make(original):
        def dist_reduce_scatter_func(output, input, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
            group = group if group is not None else torch.distributed.group.WORLD
            if not _takes(input, group, op):
                return original(output, input, op=op, group=group, async_op=async_op)
            where = direction()
            rel_error = place.measure(where, input)
            wait = place.wait(group, "tensor-parallel fp8 ")
            place.record(where, collectives.reduce_scatter(place.codec, output, input, group, op, wait), rel_error)
            return Done() if async_op else None

        return dist_reduce_scatter_func

    return make


def _dgrad_through_reduce(original):
    """ColumnParallelLinear's input-gradient all-reduce through ``copy_to_tensor_model_parallel_region``."""
    signature = inspect.signature(original)

    def linear(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        if not bound.arguments.get("allreduce_dgrad"):
            return original(*args, **kwargs)
        mappings = resolve(MAPPINGS)
        bound.arguments["input"] = mappings.copy_to_tensor_model_parallel_region(
            bound.arguments["input"], group=bound.arguments.get("tp_group"))
        bound.arguments["allreduce_dgrad"] = False
        return original(*bound.args, **bound.kwargs)

    return linear


def install(place) -> None:
    """Route megatron-core's tensor-parallel collectives through ``place.codec``."""
    collectives.check_codec(place.codec)
    place.codec = place_codec(place.codec, place.config.tah_eager_codecs)  # CUDA graphs per message shape
    patches = place.patches
    patches.wrap(MAPPINGS, "_reduce", _reducing(place), why="tensor-parallel all-reduce of FP8 shards (TACO)")
    for module in (MAPPINGS, LAYERS):
        patches.wrap(module, "dist_all_gather_func", _gathering(place), why="tensor-parallel all-gather in FP8 (TACO)")
        patches.wrap(module, "dist_reduce_scatter_func", _scattering(place),
                     why="tensor-parallel reduce-scatter of FP8 shards (TACO)")
    for name in LINEAR_FUNCTIONS:
        patches.wrap(LAYERS, name, _dgrad_through_reduce,
                     why="the input-gradient all-reduce through the FP8 all-reduce")


def codec(config: TahConfig) -> Codec | None:
    """The collectives' codec, 8-bit in groups of ``tah_fp8_group_size`` (None: megatron-core's are left alone)."""
    return None if config.tah_tp_codec == "none" else config.build_codec(config.tah_tp_codec, 8,
                                                                         config.tah_fp8_group_size)


PLACE = PlaceSpec(
    name="tp", option="tah_tp_codec", install=install, codec=codec,
    streams=(Stream("tp_forward", "tp", "forward", "tp fwd"), Stream("tp_backward", "tp", "backward", "tp bwd")),
    settings=lambda config: codec(config).describe(),
)
