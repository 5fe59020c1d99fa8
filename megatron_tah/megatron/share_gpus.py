"""Several pipeline ranks on one GPU: ``local_rank % device_count``.

When a node has fewer GPUs than local ranks (``LOCAL_WORLD_SIZE``), rank ``r`` uses device
``device_for(r, torch.cuda.device_count())``. The mode is on when asked for (``share_gpus=True``,
the ``--tah-share-gpus`` flag) or, automatically, when the local ranks outnumber the devices
(Megatron would fail at ``set_device`` otherwise); ``decide()`` logs one line saying which.

What megatron.training needs to accept it (shims, line numbers of megatron-core 0.19.2, applied
by ``install()`` only in this mode, removed exactly by ``Patches.restore()``):

1. ``initialize.py:282-283`` ``torch.cuda.set_device(args.local_rank)`` and
   ``device_id = torch.device(f'cuda:{args.local_rank}')``: ``_initialize_distributed`` runs with
   ``args.local_rank`` set to the shared device index (restored when it returns), so both lines
   name a device that exists.
2. ``initialize.py:336`` ``'backend': args.distributed_backend``: NCCL refuses two ranks on one
   GPU (``ncclInvalidUsage: Duplicate GPU detected``), so a requested ``nccl`` becomes ``gloo``
   (one log line); ``gloo`` is kept; any other backend raises ``ValueError``.

Which backend carries what in this mode (every group Megatron creates inherits the world's
default backend, ``gloo``):

* pipeline p2p: gloo's ``send``/``recv`` read the tensor's address on the host, so CUDA tensors fail
  (``writev ... Bad address``); the transport stages the codec's wire buffer through pinned host
  memory (``staging.HostStaging``), the uncompressed ``none`` codec included.
* collectives on CUDA tensors -- the loss all-reduce (``average_losses_across_data_parallel_group``),
  the grad-norm all-reduce (``clip_grads.py``), the tied-embedding gradient all-reduce, timers'
  all-gather, broadcasts: torch's ``ProcessGroupGloo`` implements ``allreduce``, ``broadcast``,
  ``allgather``, ``reduce``, ``gather`` and ``scatter`` for CUDA tensors by copying through pinned
  host memory (``AsyncAllreduceCUDAWork`` etc. in ``ProcessGroupGloo.cpp``), and
  ``reduce_scatter_tensor`` (DDP with data parallelism) through an all-reduce. Known from torch's
  source; not yet run on a GPU in this project (no GPU in the session that wrote this).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from .patching import Patches

logger = logging.getLogger(__name__)

INITIALIZE = "megatron.training.initialize"
SHARED_BACKEND = "gloo"


def device_for(local_rank: int, device_count: int) -> int:
    """The CUDA device index of ``local_rank`` when ``device_count`` GPUs are shared round-robin."""
    if not isinstance(local_rank, int) or local_rank < 0:
        raise ValueError(f"local_rank = {local_rank!r}: must be an integer >= 0")
    if not isinstance(device_count, int) or device_count < 1:
        raise ValueError(f"device_count = {device_count!r}: sharing GPUs needs at least one CUDA device")
    return local_rank % device_count


@dataclasses.dataclass(frozen=True)
class ShareGpus:
    """The mode's setting: ``share_gpus`` True turns it on; False leaves it to the automatic check."""

    share_gpus: bool = False
    """Run several local ranks per GPU (``local_rank % device_count``); on automatically when the
    node's local ranks outnumber its GPUs."""


def local_world_size() -> int:
    """Local ranks on this node (torchrun's and slow_link's ``LOCAL_WORLD_SIZE``; 1 when unset)."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "1")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE = {value!r} is not an integer") from None


def decide(requested: bool, local_ranks: int, device_count: int) -> bool:
    """Whether the mode is on; logs one line when it is (and why). No CUDA device: always off."""
    if device_count < 1:
        return False
    automatic = local_ranks > device_count
    if not (requested or automatic):
        return False
    why = "--tah-share-gpus" if requested else f"{local_ranks} local ranks > {device_count} GPUs"
    logger.warning("megatron_tah: %d local ranks share %d GPU(s), device = local_rank %% %d (%s); "
                   "pipeline traffic over gloo through pinned host memory", local_ranks, device_count,
                   device_count, why)
    return True


def shared_backend(requested: str) -> str:
    """The process-group backend in this mode: ``gloo`` (NCCL refuses two ranks on one GPU)."""
    if requested == SHARED_BACKEND:
        return requested
    if requested == "nccl":
        logger.warning("megatron_tah: --distributed-backend nccl -> gloo (NCCL refuses two ranks on one GPU)")
        return SHARED_BACKEND
    raise ValueError(f"--distributed-backend {requested}: ranks sharing a GPU need gloo (or nccl, replaced by gloo)")


def _on_shared_device(original):
    def _initialize_distributed(*args, **kwargs):
        margs = resolve_args()
        local_rank = margs.local_rank
        margs.distributed_backend = shared_backend(margs.distributed_backend)
        margs.local_rank = device_for(local_rank, torch.cuda.device_count())
        try:
            return original(*args, **kwargs)
        finally:
            margs.local_rank = local_rank

    return _initialize_distributed


def resolve_args():
    from megatron.training.global_vars import get_args

    return get_args()


def install(patches: Patches, settings: ShareGpus | object) -> bool:
    """Apply this mode's shims to ``patches`` when it is on (per ``decide``); returns whether it is.

    ``settings`` is anything with a ``share_gpus`` attribute (:class:`ShareGpus`, ``TahConfig`` once
    the flag exists, Megatron's args). Call before ``initialize_megatron``; ``patches.restore()``
    removes the shims.
    """
    requested = bool(getattr(settings, "share_gpus", getattr(settings, "tah_share_gpus", False)))
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested and count < 1:
        raise ValueError("--tah-share-gpus needs a CUDA device (none is visible here)")
    if not decide(requested, local_world_size(), count):
        return False
    patches.wrap(INITIALIZE, "_initialize_distributed", _on_shared_device)
    return True
