"""A complete receive's length, and the second messages of a batched call (a framed message's overflow).

``read_length(m)``: once a receive is complete, its link end's steps say how much of it the message filled
(``Step.received_nbytes``: an exact message is shorter than its receive, ``frames.py``) and how many bytes
follow it as a second message (``Step.follow_nbytes``: a framed message's overflow).

``post_rests(messages)``: the second messages of one batched call, once its messages are complete, in one
batch posted in the same order on both ends -- activations first, then gradients, each in the call's message
order; gloo also tags them by direction (``rest_tag``), NCCL matches them by that order. Each ``Work`` belongs
to its message (``Message.rest_work``) and is waited, bounded, with it by the transport before the call
returns. Only batched calls carry second messages: an unbatched one refuses them (``Step.check_unbatched``).
"""

from __future__ import annotations

import torch

from .message import Message
from .peer import posted_batch

__all__ = ["each_work", "post_rests", "read_length", "rest_tag"]


def rest_tag(direction: str) -> int:
    """The tag of a message's second message (gloo matches by it; NCCL by order)."""
    return 1 if direction == "forward" else 2


def read_length(m: Message) -> int:
    """A complete receive: its length (``m.received``) and the bytes that follow it as a second message (asked
    once: ``m.rest_nbytes``; ``m.rest`` is their buffer)."""
    nbytes = m.buf.numel() - m.extra_nbytes
    for step in m.link.steps:
        nbytes = step.received_nbytes(m, nbytes)
    m.received(nbytes + m.extra_nbytes)
    m.rest_nbytes = sum(step.follow_nbytes(m) for step in m.link.steps)
    if m.rest_nbytes:
        m.rest = torch.empty(m.rest_nbytes, dtype=torch.uint8, device=m.buf.device)
    return m.rest_nbytes


def post_rests(messages) -> list[Message]:
    """Post the second messages of one batched call's complete ``messages`` (the sends' as they are, the
    receives' into new buffers); returns the messages that have one, each with its ``rest_work``."""
    dist = torch.distributed
    ops, owners = [], []
    for direction in ("forward", "backward"):
        for m in messages:
            if m.link.direction != direction or m.group is None:
                continue
            if (read_length(m) if m.is_recv else m.rest is not None):
                post = dist.irecv if m.is_recv else dist.isend
                ops.append(dist.P2POp(post, m.rest, m.link.peer, m.group, tag=rest_tag(direction)))
                owners.append(m)
    for m, work in zip(owners, posted_batch(ops) if ops else ()):
        m.rest_work = work
    return owners
