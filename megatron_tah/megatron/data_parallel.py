"""Data-parallel gradient reduction through a codec (AGoQ's QuanGrad): ``--tah-dp-codec int8``.

``install(place)`` wraps megatron-core's ``_ParamAndGradBucketGroup.start_grad_sync``
(``distributed/param_and_grad_buffer.py``; ``finish_grad_sync`` and the backward hooks call it
through the class). The original still does all of megatron-core's bookkeeping -- first-batch
and predecessor handling, NaN/large-gradient checks, gradient scaling, the choice of collective,
group and coalescing -- while, for the duration of the call only, the two collectives it issues
are compressed:

* without the distributed optimizer, ``torch.distributed.all_reduce(bucket.grad_data, ...)``
  (and the all-reduce across distributed-optimizer instances): ``collectives.all_reduce`` --
  an all-to-all of 8-bit shards, fp32 dequantize-and-sum, the 8-bit sums all-gathered;
* with it, the module's pluggable ``dist_reduce_scatter_func`` (the hook megatron-core itself
  uses for ``reduce_scatter_with_fp32_accumulation``): ``collectives.reduce_scatter``, every
  rank keeping the fp32 sum of its shard (cast to the buffer's dtype).

The call-time replacements are the module-level ``torch`` -- by a view of it whose
``distributed.all_reduce`` compresses, everything else delegated -- and ``dist_reduce_scatter_func``,
both through a temporary ``Patches`` that the wrapper restores before returning. The compressed
collectives complete before ``start_grad_sync`` returns, so with ``--overlap-grad-reduce`` the
handle Megatron keeps is already complete (no overlap with the rest of the backward pass).
The codec checks headers on the device (``megatron_tah.install`` compared every rank's settings) and, unless
``--tah-eager-codecs``, replays its calls from CUDA graphs per shard shape (``codecs.core.graphs.place_codec``);
shards above ``graphs.MAX_GRAPH_NUMEL`` elements (megatron-core's default buckets) stay eager, logged once.
Statistics: stream ``dp_backward``.

Not covered: keeping the gradients themselves in 8 bits (megatron-core's buffers stay fp32 or
bf16), Megatron-FSDP and torch FSDP2 (other code paths), the distributed optimizer's parameter
all-gather (parameters, not gradients).
"""

from __future__ import annotations

import functools
import types

import torch

from ..codecs import Codec
from ..codecs.core.graphs import place_codec
from ..config import TahConfig
from . import collectives
from .collectives import Done
from .patching import Patches, resolve
from .place_spec import PlaceSpec
from .stats import Stream

BUFFER_MODULE = "megatron.core.distributed.param_and_grad_buffer"
BUCKET_GROUP = f"{BUFFER_MODULE}:_ParamAndGradBucketGroup"
SUM = torch.distributed.ReduceOp.SUM


class _CompressingDistributed(types.ModuleType):
    """``torch.distributed`` as ``start_grad_sync`` sees it while the place is installed."""

    def __init__(self, place):
        super().__init__("torch.distributed (megatron_tah gradient reduction)")
        self._place = place

    def __getattr__(self, name):
        return getattr(torch.distributed, name)

    def all_reduce(self, tensor, op=SUM, group=None, async_op=False):
        if not collectives.compressible(tensor, op):
            return torch.distributed.all_reduce(tensor, op=op, group=group, async_op=async_op)
        place = self._place
        rel_error = place.measure("backward", tensor)
        wait = place.wait(group, "data-parallel int8 ")
        place.record("backward", collectives.all_reduce(place.codec, tensor, group, op, wait), rel_error)
        return Done() if async_op else None


class _TorchView(types.ModuleType):
    """A module's ``torch`` with ``distributed`` replaced (every other attribute is the module's own ``torch``)."""

    def __init__(self, base, distributed):
        super().__init__("torch (megatron_tah gradient reduction)")
        self._base = base
        self.distributed = distributed

    def __getattr__(self, name):
        return getattr(self._base, name)


def _reduce_scatter(place, original, output, input, op=SUM, group=None, async_op=False):
    if not collectives.compressible(input, op):
        return original(output, input, op=op, group=group, async_op=async_op)
    rel_error = place.measure("backward", input)
    wait = place.wait(group, "data-parallel int8 ")
    place.record("backward", collectives.reduce_scatter(place.codec, output, input, group, op, wait), rel_error)
    return Done() if async_op else None


def _compressing(place):
    def make(original):
        def start_grad_sync(self, *args, **kwargs):
            module = resolve(BUFFER_MODULE)
            during = Patches()
            during.replace(module, "torch", _TorchView(module.torch, _CompressingDistributed(place)),
                           why="the bucket's collectives through the int8 codec, during one call")
            during.replace(module, "dist_reduce_scatter_func",
                           functools.partial(_reduce_scatter, place, module.dist_reduce_scatter_func),
                           why="the bucket's reduce-scatter through the int8 codec, during one call")
            try:
                return original(self, *args, **kwargs)
            finally:
                during.restore()

        return start_grad_sync

    return make


def install(place) -> None:
    """Compress megatron-core's data-parallel gradient reduction with ``place.codec``."""
    collectives.check_codec(place.codec)
    place.codec = place_codec(place.codec, place.config.tah_eager_codecs)  # CUDA graphs per message shape
    place.patches.wrap(BUCKET_GROUP, "start_grad_sync", _compressing(place),
                       why="reduce data-parallel gradients through the int8 codec (AGoQ QuanGrad)")


def codec(config: TahConfig) -> Codec | None:
    """The gradient codec, 8-bit in blocks of ``tah_int8_block_size`` (None: megatron-core's reduction is left
    alone)."""
    return None if config.tah_dp_codec == "none" else config.build_codec(config.tah_dp_codec, 8,
                                                                         config.tah_int8_block_size)


PLACE = PlaceSpec(
    name="dp", option="tah_dp_codec", install=install, codec=codec,
    streams=(Stream("dp_backward", "dp", "backward", "dp grad"),),
    settings=lambda config: codec(config).describe(),
)
