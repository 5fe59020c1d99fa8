"""Megatron's point-to-point calls as a 2-stage pipeline's tests make them."""
from __future__ import annotations

import torch


def p2p_call(rank: int, batched: bool, send: torch.Tensor | None, received: torch.Tensor | None,
             wait: bool = True):
    """One call of Megatron's ``_batched_p2p_ops`` / ``_p2p_ops`` on a 2-stage pipeline: stage 0 sends ``send``
    (activations) to stage 1 and receives ``received`` (gradients) from it, stage 1 the other way round.
    ``wait``: wait for the handles (unbatched). Returns the handles."""
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    call = dict(tensor_send_prev=None, tensor_recv_prev=None, tensor_send_next=None, tensor_recv_next=None,
                group=torch.distributed.group.WORLD, prev_pipeline_rank=1 - rank, next_pipeline_rank=1 - rank)
    if rank == 0:
        call.update(tensor_send_next=send, tensor_recv_next=received)
    else:
        call.update(tensor_recv_prev=received, tensor_send_prev=send)
    handles = (p2p._batched_p2p_ops if batched else p2p._p2p_ops)(**call)
    for handle in (handles.values() if isinstance(handles, dict) and wait else ()):
        handle.wait()
    return handles


def transport_call(transport, batched: bool, **call) -> None:
    """``call`` through ``transport``'s own batched or unbatched op, its handles waited for."""
    if batched:
        transport.batched_p2p_ops(**call)
    else:
        for handle in transport.p2p_ops(**call).values():
            handle.wait()
