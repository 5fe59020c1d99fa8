"""One posted message of the pipeline transport, the handle the unbatched transport returns for it, and the
plan of one of a transport call's messages before it is made (``MessagePlan``).

A :class:`Message` is data: which link end it is on, what is posted (``buf``: the message of
``wire.py``, or with host staging its host copy from when it is posted), the ``Work`` and the time the transfer completed;
a receive also holds the codec it decodes with and Megatron's receive tensor (``target``). The
transport (``transport.PipelineTransport.finish``) acts on it once the transfer is complete.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

import torch

from .staging import HostStaging
from .wire import codec_buffer, read_trailer, stamp_sent_at


class MessagePlan(NamedTuple):
    """One of a transport call's four messages, by Megatron's ``name`` for it ("send_next", "recv_prev", ...):
    its link's ``direction`` and ``peer`` (world rank), its ``stages`` (sender, receiver), and the tensor it sends
    (``send``) or receives into (``recv``); neither: not in this call."""

    name: str
    direction: str
    peer: int
    stages: tuple[int, int]
    send: torch.Tensor | None = None
    recv: torch.Tensor | None = None


class Message:
    """A send (``target`` None) or a receive posted on ``link``; ``extra_nbytes``: the trailer's bytes after the
    codec buffer (0: none); ``stages``: (sender, receiver) pipeline stages, for errors."""

    def __init__(self, link, buf: torch.Tensor, *, target: torch.Tensor | None = None, codec=None,
                 staging=None, extra_nbytes: int = 0, stages=(None, None), last_stage: bool = False,
                 rest: torch.Tensor | None = None, exact: bool = False, iteration: int | None = None):
        self.link, self.buf, self.target, self.codec = link, buf, target, codec
        self.staging, self.extra_nbytes = staging, extra_nbytes
        self.stages, self.last_stage, self.iteration = stages, last_stage, iteration
        # ``exact``: a receive posts the most the message can be and learns its length once complete (``received``)
        self.exact = exact
        # ``rest``: a second message right behind this one (a framed message's overflow, frames.py; batched calls
        # only): a send's from the start, a receive's once its size is known (``rest_nbytes``, asked of the link
        # end's steps); ``rest_work``: its posted transfer, waited with the message's own
        self.rest, self.rest_nbytes, self.rest_work = rest, None, None
        self._trailer: bytes | None = None
        self.group = None  # the process group it was posted on
        self.work = None
        self.bounded = True  # whether waits pass --tah-peer-timeout-s to ``work.wait`` (gloo; ``peer.py``)
        self.done = False
        self.failed = False  # its wait raised (a peer timed out or died): never waited again
        self.completed_at: float | None = None
        self.timed = False  # ``work`` times itself (NCCL, ``completion.time_works``)

    @classmethod
    def send(cls, link, message: torch.Tensor, host: HostStaging | None, **kwargs) -> "Message":
        """A send of ``message`` (on the device); with ``host`` it is posted from a pinned host copy, whose
        device-to-host copy ``stamp`` waits for when the message is posted: encodes queued in between
        (the call's other send) overlap it."""
        staging = None if host is None else host.stage_send(message)
        return cls(link, message, staging=staging, **kwargs)

    @classmethod
    def receive(cls, link, target: torch.Tensor, codec, body_nbytes: int, extra_nbytes: int,
                host: HostStaging | None, **kwargs) -> "Message":
        """A receive for ``target``, decoded by ``codec``, of ``body_nbytes`` (the codec buffer, or what the link
        end's steps make of it) plus ``extra_nbytes``, into a host buffer with ``host``."""
        nbytes = body_nbytes + extra_nbytes
        if host is not None:
            staging = host.stage_recv(nbytes)
            return cls(link, staging.host, target=target, codec=codec, staging=staging, extra_nbytes=extra_nbytes,
                       **kwargs)
        buf = torch.empty(nbytes, dtype=torch.uint8, device=target.device)
        return cls(link, buf, target=target, codec=codec, extra_nbytes=extra_nbytes, **kwargs)

    @property
    def is_recv(self) -> bool:
        return self.target is not None

    def stamp(self) -> None:
        """Just before posting: a staged send's ``buf`` becomes its host copy, once complete (gloo reads it);
        a send's trailer gets the time it is sent (``wire.stamp_sent_at``)."""
        if not self.is_recv and self.staging is not None:
            self.buf = self.staging.host()
        if not self.is_recv and self.extra_nbytes:
            stamp_sent_at(self.buf)

    def poll(self) -> None:
        if self.completed_at is None and self.work is not None and self.work.is_completed():
            self.completed_at = time.monotonic()

    def trailer(self) -> bytes:
        """A complete receive's trailer, read on the host at the first call; on a GPU that read waited for the
        data, so the completion time is then."""
        if self._trailer is None:
            self._trailer = read_trailer(self.buf)
            if self.buf.is_cuda:
                self.completed_at = time.monotonic()
        return self._trailer

    def received(self, nbytes: int) -> None:
        """A complete receive's message is its first ``nbytes`` (an exact one: fewer than posted); ``buf`` becomes
        those, so that its trailer is its last bytes."""
        if nbytes > self.buf.numel():
            raise ValueError(f"a message of {nbytes} bytes in a receive of {self.buf.numel()}")
        self.buf = self.buf[:nbytes]

    def codec_buffer(self) -> torch.Tensor:
        """A complete receive's codec buffer on the device (copied from the host buffer when staged)."""
        wire = self.buf if self.staging is None else self.staging.to_device(self.buf.numel())
        return codec_buffer(wire, self.extra_nbytes)

    def release(self) -> None:
        """The transfer is complete (and a receive's decode enqueued): return the staging buffers, drop ``buf``."""
        if self.staging is not None:
            self.staging.release()
            self.staging = None
        self.buf = None


class Handle:
    """What the unbatched transport returns in place of a ``Work``: ``wait()`` waits (through ``wait``, the
    transport's bounded wait), then ``finish``es; a wait that raised marks its message ``failed``."""

    def __init__(self, message: Message, finish: Callable[[Message], None], wait: Callable[[Message], None]):
        self.message, self._finish, self._wait = message, finish, wait

    def wait(self, timeout=None):
        msg = self.message
        if not msg.done:
            msg.poll()
            try:
                self._wait(msg)
            except BaseException:
                msg.failed = True
                raise
            if msg.completed_at is None:
                msg.completed_at = time.monotonic()
            self._finish(msg)
        return True

    def is_completed(self) -> bool:
        return self.message.done or self.message.work.is_completed()
