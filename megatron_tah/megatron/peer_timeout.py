"""``--tah-peer-timeout-s`` in Megatron's training loop: every wait on another stage is bounded, and a stage that
stops names what it waited for.

The pipeline transport bounds its own waits (``link/peer.py``). The rest of a training iteration waits on
other stages in collectives -- the optimizer's gradient-norm all-reduce over the model-parallel group, the
log's statistics, the data-parallel reduction --, bounded by each process group's timeout, Megatron's
``--distributed-timeout-minutes`` (10 minutes by default). ``install(patches)`` wraps three functions of
``megatron.training.training`` (looked up by name at call time):

* ``train_step``: after the first training step of this process has returned (start-up done: kernels
  compiled, auto's costs measured), every process group Megatron made (``parallel_state``'s list, the default
  group included) gets ``--tah-peer-timeout-s`` as its timeout, once; NCCL's watchdog and gloo's waits then
  stop a collective that waits longer. Not when the user gave Megatron's own
  ``--distributed-timeout-seconds-after-init`` (Megatron applies that one) or the bound is 0.
* ``save_checkpoint_and_time``: while a checkpoint is written the groups get ``--distributed-timeout-minutes``
  back (a stage writing a large shard to slow storage keeps the others in a barrier), then the bound again.
* ``train``: a failure of the backend (a timeout, a closed connection) that reaches the training loop from
  a collective is raised again as ``link.peer.PeerTimeoutError`` / ``PeerLostError`` naming this stage, the
  iteration and when data last arrived from each neighbouring stage (the one silent longest is the one to
  look at); the transport's own errors already name their link and pass unchanged. Whatever error ends the
  loop, the rank records it for the restart loop (``failures.py``: which rank's error stopped the run).

What it set is ``registry.REGISTRY.bounded_groups`` (the timeout in seconds, None: Megatron's own).
"""

from __future__ import annotations

import datetime
import os
import re

import torch

from ..link.peer import LinkError, PeerLostError, PeerTimeoutError
from . import failures
from .pipeline_parallel import installed_transport
from .registry import REGISTRY

TRAINING = "megatron.training.training"
BACKEND_FAILURE = re.compile(r"gloo|nccl|timed out|connection (closed|reset)|broken pipe", re.IGNORECASE)


def _bound(args) -> float | None:
    """The bound this module applies to the process groups, or None (off, or Megatron's own option given)."""
    config = REGISTRY.config
    if config is None or not config.tah_peer_timeout_s or args is None:
        return None
    if getattr(args, "distributed_timeout_seconds_after_init", None) is not None:
        return None  # the user chose Megatron's own after-start timeout
    return float(config.tah_peer_timeout_s)


def _megatron_args():
    try:
        from megatron.training.global_vars import get_args

        return get_args()
    except (ImportError, AssertionError):
        return None


def set_group_timeouts(timeout: datetime.timedelta) -> int:
    """Give every process group of Megatron's (``parallel_state``'s list; the default group when it has none)
    ``timeout``; returns how many."""
    from megatron.core import parallel_state

    groups = getattr(parallel_state, "_global_process_group_list", None) or [None]
    set_timeout = getattr(torch.distributed, "set_timeout", None)
    if set_timeout is None:  # torch < 2.8
        set_timeout = torch.distributed.distributed_c10d._set_pg_timeout
    for group in groups:
        set_timeout(timeout, group)
    return len(groups)


def _bounding_after_the_first_step(original):
    def train_step(*args, **kwargs):
        result = original(*args, **kwargs)
        margs = _megatron_args()
        bound = _bound(margs)
        if bound is not None and REGISTRY.bounded_groups is None:
            count = set_group_timeouts(datetime.timedelta(seconds=bound))
            REGISTRY.bounded_groups = bound
            if torch.distributed.get_rank() == 0:
                print(f"> megatron_tah: {count} process groups now time out after {bound:g} s "
                      "(--tah-peer-timeout-s; checkpoint saves keep --distributed-timeout-minutes)", flush=True)
        return result

    return train_step


def _saving_with_the_start_up_timeout(original):
    def save_checkpoint_and_time(*args, **kwargs):
        bound = REGISTRY.bounded_groups
        margs = _megatron_args()
        if bound is None or margs is None:
            return original(*args, **kwargs)
        set_group_timeouts(datetime.timedelta(minutes=margs.distributed_timeout_minutes))
        try:
            return original(*args, **kwargs)
        finally:
            set_group_timeouts(datetime.timedelta(seconds=bound))

    return save_checkpoint_and_time


def named_failure(err: BaseException, iteration: int | None) -> LinkError | None:
    """``err`` (a backend failure in a collective) as a ``LinkError`` naming this stage, the iteration and when
    each neighbour was last heard from; None when it is not a backend failure or already names its link."""
    if isinstance(err, LinkError) or not isinstance(err, RuntimeError):
        return None
    if not (isinstance(err, getattr(torch.distributed, "DistError", ())) or BACKEND_FAILURE.search(str(err))):
        return None
    if type(err).__name__ in ("PayloadChecksumError", "WireFormatError", "CodecMismatchError"):
        return None
    transport = installed_transport()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else None
    heard = "no pipeline transport installed"
    if transport is not None:
        peers = transport.peers
        heard = "; ".join(f"from world rank {peer}: {peers.last_heard(peer)}" for peer in sorted(peers.heard)) or \
            "nothing yet"
    timed_out = "timed out" in str(err).lower() or "timeout" in str(err).lower()
    what = "timed out" if timed_out else "failed"
    bound = REGISTRY.bounded_groups
    limit = f" (process groups' timeout: {bound:g} s, --tah-peer-timeout-s)" if bound is not None and timed_out else ""
    where = f"world rank {rank}" + ("" if iteration is None else f", iteration {iteration}")
    text = (f"megatron_tah: {where}: a collective between stages {what}{limit} ({type(err).__name__}: "
            f"{str(err).strip()}); data last arrived {heard}. A stage is frozen, cut off or dead; this rank "
            "stops so that the job can be restarted from its last checkpoint")
    cls = PeerTimeoutError if timed_out else PeerLostError
    return cls(text, link=None, ranks=None, iteration=iteration, waited_s=None, last_heard_s=None)


def _naming_failures(original):
    def train(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except Exception as err:
            margs = _megatron_args()
            named = named_failure(err, None if margs is None else getattr(margs, "curr_iteration", None))
            stopped = err if named is None else named
            failures.record(stopped, _rank(), secondary=isinstance(stopped, PeerLostError))
            if named is None:
                raise
            raise named from err

    return train


def _rank() -> int:
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def install(patches) -> None:
    """Wrap ``train_step``, ``save_checkpoint_and_time`` and ``train`` (each acts only while a configuration with a
    bound is installed)."""
    patches.wrap(TRAINING, "train_step", _bounding_after_the_first_step,
                 why="after the first step, bound the process groups' waits by --tah-peer-timeout-s")
    patches.wrap(TRAINING, "save_checkpoint_and_time", _saving_with_the_start_up_timeout,
                 why="checkpoint saves keep --distributed-timeout-minutes")
    patches.wrap(TRAINING, "train", _naming_failures, why="a failed collective names the link and iteration")
