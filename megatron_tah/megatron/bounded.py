"""The places' collectives bounded by ``--tah-peer-timeout-s``, in Megatron's loop or a loop of the user's own.

``collective_wait(config, group, what, answered)`` is the ``wait(work, what)`` a place hands the compressed
collectives (``collectives.py``) and its other exchanges: on gloo it waits for the collective's ``Work`` with a
timeout of ``--tah-peer-timeout-s`` (``Work.wait(timeout)``: gloo raises after it, collectives and
point-to-point alike), plus ``--tah-peer-start-up-s`` for the group's first collective (``answered``: the
groups that have completed one, kept by the place), and raises ``link.peer.PeerTimeoutError`` /
``PeerLostError`` naming the collective, the group's world ranks, the ranks that did not answer and
Megatron's iteration (None outside Megatron). A bound of 0 leaves the process group's timeout.

On NCCL a ``Work.wait(timeout)`` would turn the stream wait into a host-blocking one: there the process group's
timeout bounds the collective, enforced by NCCL's watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, on by default,
ends the process), set to ``--tah-peer-timeout-s`` by ``peer_timeout.py`` after the first training step.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..config import TahConfig
from ..link.peer import wait_collective


def iteration() -> int | None:
    """Megatron's ``args.curr_iteration``; None outside Megatron's training (its arguments are not set)."""
    try:
        from megatron.training.global_vars import get_args

        return int(getattr(get_args(), "curr_iteration", 0) or 0)
    except (ImportError, AssertionError):
        return None


def group_ranks(group) -> list[int]:
    """The world ranks of ``group`` (None: the default group), in group order."""
    dist = torch.distributed
    size = dist.get_world_size(group)
    return [dist.get_global_rank(group, i) if group is not None else i for i in range(size)]


def collective_wait(config: TahConfig, group, answered: set | None = None,
                    prefix: str = "") -> Callable[[object, str], None]:
    """``wait(work, what)`` for a collective posted on ``group`` (module docstring); ``prefix`` names the place
    in the error (``"data-parallel int8 "``)."""
    dist = torch.distributed
    answered = set() if answered is None else answered
    key = id(group)
    bounded = dist.get_backend(group) == "gloo"

    def wait(work, what: str) -> None:
        first = key not in answered
        wait_collective(work, timeout_s=config.tah_peer_timeout_s if bounded else 0.0, what=prefix + what,
                        ranks=group_ranks(group), me=dist.get_rank(), iteration=iteration(),
                        start_up_s=config.tah_peer_start_up_s if first else 0.0)
        answered.add(key)

    return wait
