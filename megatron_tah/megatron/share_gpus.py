"""Several pipeline ranks on one GPU: ``local_rank % device_count``.

When a node has fewer GPUs than local ranks (``LOCAL_WORLD_SIZE``), rank ``r`` uses device
``device_for(r, torch.cuda.device_count())``. The mode is on when asked for (the ``--tah-share-gpus``
flag, ``TahConfig.tah_share_gpus``) or, automatically, when the local ranks outnumber the devices
(Megatron would fail at ``set_device`` otherwise); ``decide()`` logs one line saying which.

What megatron.training needs to accept it (shims, line numbers of megatron-core 0.19.2): the plugin
wraps ``_initialize_distributed`` (``install()``, undone exactly by ``Patches.restore()``); the wrapper,
which runs after Megatron parsed the flags, decides (``enabled()``) and applies these only in this mode:

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


def enabled(requested: bool) -> bool:
    """Whether this rank runs in the mode, per ``decide`` with this node's local ranks and CUDA devices.

    Asked for (``--tah-share-gpus``) where no CUDA device is visible: the ranks run on the CPU, so there
    is no device to share; one log line says so and the mode's shims stay off (the pipeline transport
    still stages its messages through host buffers: ``TahConfig.tah_share_gpus``, what CI runs).
    """
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested and count < 1:
        logger.warning("megatron_tah: --tah-share-gpus without a CUDA device: the ranks run on the CPU; "
                       "pipeline messages are staged through host buffers as with shared GPUs")
        return False
    return decide(requested, local_world_size(), count)


def _sharing_gpus_when_on(original):
    def _initialize_distributed(*args, **kwargs):
        margs = resolve_args()
        if not enabled(bool(getattr(margs, "tah_share_gpus", False))):
            return original(*args, **kwargs)
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


def install(patches: Patches) -> None:
    """Wrap Megatron's ``_initialize_distributed`` through ``patches`` (``restore()`` removes it).

    It runs inside ``initialize_megatron`` after the arguments are parsed, so the wrapper reads
    ``--tah-share-gpus`` (``args.tah_share_gpus``) there and asks ``enabled``; when the mode is off it
    calls Megatron's function unchanged, when on it applies the shims of the module docstring.
    Installed by the plugin (``plugin.install_megatron_lm_plugin``); idempotent.
    """
    patches.wrap(INITIALIZE, "_initialize_distributed", _sharing_gpus_when_on)
