"""Several pipeline ranks on one GPU: ``local_rank % device_count``, gloo, host-staged pipeline traffic.

Rank ``r`` uses device ``device_for(local_rank, torch.cuda.device_count())`` of the devices it sees.
The mode is on when asked for (the ``--tah-share-gpus`` flag, ``TahConfig.tah_share_gpus``) or,
automatically, when two ranks' devices are one GPU: every rank puts the UUID of its device into the
rendezvous store and reads everyone's (``exchange_identities``) before any process group exists, so
ranks given one GPU each through ``CUDA_VISIBLE_DEVICES`` (each sees one device, numbered 0, while
``LOCAL_WORLD_SIZE`` says 4) keep NCCL: only their device index is remapped. One log line says which.

What megatron.training needs to accept it (shims, line numbers of megatron-core 0.19.2): the plugin
wraps ``_initialize_distributed`` (``install()``, undone exactly by ``Patches.restore()``); the wrapper,
which runs after Megatron parsed the flags, decides and applies:

1. ``initialize.py:282-283`` ``torch.cuda.set_device(args.local_rank)`` and
   ``device_id = torch.device(f'cuda:{args.local_rank}')``: ``_initialize_distributed`` runs with
   ``args.local_rank`` set to the device index (restored when it returns) whenever it differs from
   the local rank, so both lines name a device that exists -- shared or not.
2. The store: on a GPU, unless the world is up already or fake, the wrapper makes the rendezvous
   store that ``init_process_group`` would make from ``env://`` (``torch.distributed.rendezvous``,
   prefixed ``default_pg`` as torch does), exchanges the identities through it and passes it on as
   Megatron's ``store`` argument: one rendezvous. A store Megatron was given (in-process restart) is used.
3. In the mode only: ``initialize.py:336`` ``'backend': args.distributed_backend``: NCCL refuses two
   ranks on one GPU (``ncclInvalidUsage: Duplicate GPU detected``), so a requested ``nccl`` becomes
   ``gloo`` (one log line); ``gloo`` is kept; any other backend raises ``ValueError``.
   ``--pipeline-model-parallel-comm-backend nccl`` (``initialize.py:374``, a separate NCCL group for the
   pipeline) is dropped so the pipeline groups inherit gloo (one log line); ``ucc`` raises ``ValueError``.
4. In the mode only (on the CPU too, so that CI runs the same path): ``param_and_grad_buffer.py:702``
   (and ``:504``, ``:737``) wrap DDP's gradient collectives in ``torch.distributed._coalescing_manager``,
   which issues ``allreduce_coalesced`` -- a CPU-only call in gloo (``ProcessGroupGloo::allreduce_coalesced:
   unsupported device type cuda``, seen on an H100 at the first iteration's gradient sync). That module's
   ``_coalescing_manager`` becomes :func:`one_collective_at_a_time`: the same collectives, one by one.
5. In the mode only: megatron-core's ``P2PCommunicator._communicate_shapes`` (variable sequence lengths,
   ``config.variable_seq_lengths`` or a standalone MTP stage) sends CUDA shape tensors over the gloo
   pipeline group itself, outside the compressing transport, which gloo cannot read (``Bad address``):
   it is replaced by a call that raises, naming the cause, at the first such exchange.

Which backend carries what in this mode (every group Megatron creates inherits the world's
default backend, ``gloo``):

* pipeline p2p: gloo's ``send``/``recv`` read the tensor's address on the host, so CUDA tensors fail
  (``writev ... Bad address``); the transport stages the codec's wire buffer through pinned host
  memory (``link.message.HostStaging``), the uncompressed ``none`` codec included.
* collectives on CUDA tensors -- the loss all-reduce (``average_losses_across_data_parallel_group``),
  the grad-norm all-reduce (``clip_grads.py``), the tied-embedding gradient all-reduce, timers'
  all-gather, broadcasts: torch's ``ProcessGroupGloo`` implements ``allreduce``, ``broadcast``,
  ``allgather``, ``reduce``, ``gather`` and ``scatter`` for CUDA tensors by copying through pinned
  host memory (``AsyncAllreduceCUDAWork`` etc. in ``ProcessGroupGloo.cpp``), but not their
  ``*_coalesced`` forms (item 4). ``scripts/gpu_check.sh share`` runs PP 4 and PP 2 x DP 2 on one GPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
from datetime import timedelta
from typing import Sequence

import torch

from .patching import Patches

logger = logging.getLogger(__name__)

INITIALIZE = "megatron.training.initialize"
GRAD_BUFFER = "megatron.core.distributed.param_and_grad_buffer"
P2P_COMMUNICATOR = "megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator"
SHARED_BACKEND = "gloo"
IDENTITY_KEY = "megatron_tah/share_gpus/device/{rank}"


def device_for(local_rank: int, device_count: int) -> int:
    """The CUDA device index of ``local_rank`` when ``device_count`` GPUs are shared round-robin."""
    if not isinstance(local_rank, int) or local_rank < 0:
        raise ValueError(f"local_rank = {local_rank!r}: must be an integer >= 0")
    if not isinstance(device_count, int) or device_count < 1:
        raise ValueError(f"device_count = {device_count!r}: sharing GPUs needs at least one CUDA device")
    return local_rank % device_count


def local_world_size() -> int:
    """Local ranks on this node (torchrun's and netns_link's ``LOCAL_WORLD_SIZE``; 1 when unset)."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "1")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE = {value!r} is not an integer") from None


# ----- deciding from device identities ------------------------------------------------------------
def device_identity(index: int) -> str:
    """The GPU behind device ``index`` of this process: its UUID, the same whatever ``CUDA_VISIBLE_DEVICES``
    numbered it and unique across machines."""
    return str(torch.cuda.get_device_properties(index).uuid)


def exchange_identities(store, rank: int, world_size: int, identity: str) -> list[str]:
    """Every rank's device identity, by rank: a collective over ``store`` (each rank sets its own key and
    waits for all ``world_size`` of them, within the store's timeout)."""
    store.set(IDENTITY_KEY.format(rank=rank), identity)
    keys = [IDENTITY_KEY.format(rank=r) for r in range(world_size)]
    store.wait(keys)
    return [value.decode() for value in store.multi_get(keys)]


def sharing(identities: Sequence[str]) -> tuple[int, int, str] | None:
    """The first two ranks whose devices are one GPU, ``(rank, rank, identity)``; None when every rank has its own."""
    first: dict[str, int] = {}
    for rank, identity in enumerate(identities):
        if identity in first:
            return first[identity], rank, identity
        first[identity] = rank
    return None


def rendezvous_store(margs):
    """The store ``init_process_group`` makes from ``env://`` (prefixed as torch prefixes it), made early."""
    timeout = timedelta(minutes=margs.distributed_timeout_minutes)
    store, _, _ = next(torch.distributed.rendezvous("env://", margs.rank, margs.world_size, timeout=timeout))
    store.set_timeout(timeout)
    return torch.distributed.PrefixStore("default_pg", store)


# ----- what the mode changes ------------------------------------------------------------------------
def shared_backend(requested: str) -> str:
    """The process-group backend in this mode: ``gloo`` (NCCL refuses two ranks on one GPU)."""
    if requested == SHARED_BACKEND:
        return requested
    if requested == "nccl":
        logger.warning("megatron_tah: --distributed-backend nccl -> gloo (NCCL refuses two ranks on one GPU)")
        return SHARED_BACKEND
    raise ValueError(f"--distributed-backend {requested}: ranks sharing a GPU need gloo (or nccl, replaced by gloo)")


def shared_pipeline_backend(requested: str | None) -> None:
    """``--pipeline-model-parallel-comm-backend`` in this mode: none (the pipeline groups inherit gloo)."""
    if requested is None:
        return None
    if requested == "nccl":
        logger.warning("megatron_tah: --pipeline-model-parallel-comm-backend nccl dropped: ranks sharing a GPU "
                       "send pipeline traffic over gloo through pinned host memory")
        return None
    raise ValueError(f"--pipeline-model-parallel-comm-backend {requested}: ranks sharing a GPU send pipeline "
                     "traffic over gloo; leave the flag unset (or nccl, dropped)")


def _refusing_variable_shapes(original):
    def _communicate_shapes(*args, **kwargs):
        raise RuntimeError(
            "megatron_tah: ranks sharing a GPU (--tah-share-gpus, or two ranks on one GPU) cannot exchange "
            "variable sequence lengths: megatron-core sends the shapes as CUDA tensors over the gloo pipeline "
            "group (config.variable_seq_lengths, or a standalone MTP stage in --pipeline-model-parallel-layout), "
            "which gloo cannot read. Use a fixed sequence length, or one GPU per rank.")

    return _communicate_shapes


@contextlib.contextmanager
def one_collective_at_a_time(group=None, device=None, async_ops=False):
    """``torch.distributed._coalescing_manager`` without the coalesced call gloo lacks for CUDA tensors.

    Collectives called inside are recorded as torch records them (``pg_coalesce_state``) and issued on
    exit one by one -- ``all_reduce(t)``, ``all_gather_into_tensor(out, in)``, ``reduce_scatter_tensor(out,
    in)`` -- each a single collective that gloo runs on CUDA tensors through host memory. Same results
    as the coalesced call; with ``async_ops`` the yielded manager holds every handle (``wait()`` waits for
    all), otherwise each call has finished when the block exits. ``device`` (the old per-call style) is
    not supported with gloo and is refused."""
    from torch.distributed import distributed_c10d as c10d

    if device is not None:
        raise ValueError("megatron_tah: a device-style coalescing block on a shared GPU (gloo) is not supported")
    group = group if group is not None else c10d._get_default_group()
    state = c10d._world.pg_coalesce_state
    if state.get(group):
        raise RuntimeError("megatron_tah: a coalescing block opened inside another on the same group")
    state[group] = []
    manager = c10d._CoalescingManager()
    try:
        yield manager
    finally:
        recorded = state.pop(group, [])
    for op in recorded:
        if op.dst_tensor is None:  # all_reduce
            work = op.op(op.tensor, op=op.redop, group=group, async_op=async_ops)
        elif op.redop is None:  # all-gather into a tensor
            work = op.op(op.dst_tensor, op.tensor, group=group, async_op=async_ops)
        else:  # reduce-scatter into a tensor
            work = op.op(op.dst_tensor, op.tensor, op=op.redop, group=group, async_op=async_ops)
        if async_ops:
            manager.append(work)


def share_collectives(patches: Patches) -> None:
    """DDP's gradient collectives one at a time (item 4 of the module docstring); ``restore()`` undoes it."""
    if patches.original(GRAD_BUFFER, "_coalescing_manager") is not one_collective_at_a_time:
        patches.replace(GRAD_BUFFER, "_coalescing_manager", one_collective_at_a_time,
                        why="ranks sharing a GPU run DDP's gradient collectives one at a time (gloo)")


# ----- the wrapper -------------------------------------------------------------------------------------
def _visible_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _decide(margs, requested: bool, device: int, store):
    """(why the mode is on, or None; the store to hand to Megatron)."""
    if requested:
        return "--tah-share-gpus", store
    if store is None:
        store = rendezvous_store(margs)
    pair = sharing(exchange_identities(store, margs.rank, margs.world_size, device_identity(device)))
    if pair is None:
        return None, store
    return f"ranks {pair[0]} and {pair[1]} are both on GPU {pair[2]}", store


def _sharing_gpus_when_on(original, patches: Patches):
    def _initialize_distributed(get_embedding_ranks, get_position_embedding_ranks, store=None, *args, **kwargs):
        def call(with_store):
            return original(get_embedding_ranks, get_position_embedding_ranks, with_store, *args, **kwargs)

        margs = resolve_args()
        requested = bool(getattr(margs, "tah_share_gpus", False))
        count = _visible_devices()
        if count < 1:
            if requested:
                logger.warning("megatron_tah: --tah-share-gpus without a CUDA device: the ranks run on the CPU; "
                               "pipeline messages are staged through host buffers as with shared GPUs")
                share_collectives(patches)
            return call(store)
        if torch.distributed.is_initialized() or getattr(margs, "fake_process_group", False):
            return call(store)  # nothing to decide: the world is up (or fake)
        local_rank = margs.local_rank
        device = device_for(local_rank, count)
        why, store = _decide(margs, requested, device, store)
        if why is not None:
            logger.warning("megatron_tah: ranks share GPUs (%s): %d local ranks, %d GPU(s) seen, device = "
                           "local_rank %% %d; gloo, pipeline traffic through pinned host memory",
                           why, local_world_size(), count, count)
            margs.distributed_backend = shared_backend(margs.distributed_backend)
            margs.pipeline_model_parallel_comm_backend = shared_pipeline_backend(
                getattr(margs, "pipeline_model_parallel_comm_backend", None))
            share_collectives(patches)
            if hasattr(resolve_p2p_communicator(), "_communicate_shapes"):
                patches.wrap(P2P_COMMUNICATOR, "_communicate_shapes", _refusing_variable_shapes,
                             why="variable sequence lengths are refused when ranks share a GPU")
        elif device != local_rank:
            logger.warning("megatron_tah: local_rank %d sees %d GPU(s), device %d; every rank has its own GPU "
                           "(%s), backend unchanged", local_rank, count, device,
                           os.environ.get("CUDA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES unset"))
        margs.local_rank = device
        try:
            return call(store)
        finally:
            margs.local_rank = local_rank

    return _initialize_distributed


def resolve_args():
    from megatron.training.global_vars import get_args

    return get_args()


def resolve_p2p_communicator():
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    return P2PCommunicator


def install(patches: Patches) -> None:
    """Wrap Megatron's ``_initialize_distributed`` through ``patches`` (``restore()`` removes it, and the
    variable-shape refusal the mode adds).

    It runs inside ``initialize_megatron`` after the arguments are parsed, so the wrapper reads
    ``--tah-share-gpus`` (``args.tah_share_gpus``) there; when no rank shares a GPU it calls Megatron's
    function with the device index and the store it made, when they do it applies the shims of the module
    docstring. Installed by the plugin (``plugin.install_megatron_lm_plugin``); idempotent.
    """
    patches.wrap(INITIALIZE, "_initialize_distributed", lambda original: _sharing_gpus_when_on(original, patches),
                 why="ranks sharing a GPU: its device, gloo, staged pipeline messages")
