"""A pipeline message's life: posted from its buffers, held until finished, its length read, its second message.

* :class:`Message`: one posted message of the transport -- which link end it is on, what is posted (``buf``: the
  message of ``wire.py``, or with host staging its host copy from when it is posted), the ``Work`` and the time
  the transfer completed; a receive also holds the codec it decodes with and Megatron's receive tensor
  (``target``). Once the transfer is complete the transport (``transport.PipelineTransport.finish``) has a
  receive ``read`` (its length, its trailer), hands it through its link end's steps and decodes it.
* :class:`Handle`: what the unbatched transport returns in place of a ``Work``.
* :class:`Outbox`: the unbatched path's posted messages, held until each is finished, so that no posted
  ``Work`` is ever dropped. gloo sends by rendezvous: until the receiver's ready-to-receive arrives, a send
  holds only a weak reference to its buffer, and a send whose ``Work`` is destroyed before then is never sent
  (every later message on that connection then stalls behind it); a gloo send reads as complete only once
  waited for. So every message the unbatched transport posts stays in the outbox until it is finished --
  waited through the transport's bounded wait (``peer.PeerWatch``), then ``finish``ed -- in one of these ways:

  - by its handle (``Handle.wait``: Megatron waits for it);
  - at the first call of a later training iteration (``reap``): a send of an earlier iteration whose handle was
    never waited for (the interleaved schedule leaves its last forward send's) is waited then. Its receiver
    posts that receive within that same iteration, needing nothing more from this rank, so the wait ends;
  - at a later call, whatever the iteration (``reap``; also where it is unknown: a training loop of the user's
    own): a send never waited for once a later send on the same link has finished. A connection delivers in
    order, so the receiver has taken it already and its wait returns at once;
  - at uninstall (``drain``): every send not yet finished, before the transport is dropped.

  Finished messages leave at the next call, so the outbox holds at most about one iteration's messages, with or
  without Megatron's iteration.
* A complete receive's length (``Message.read_length``): its link end's steps say how much of it the message
  filled (``Step.received_nbytes``: an exact message is shorter than its receive, ``frames.py``) and how many
  bytes follow it as a second message (``Step.follow_nbytes``: a framed message's overflow).
* Second messages (``post_rests``): those of one batched call, once its messages are complete, in one batch
  posted in the same order on both ends -- activations first, then gradients, each in the call's message order;
  gloo also tags them by direction (``rest_tag``), NCCL matches them by that order. Each ``Work`` belongs to its
  message (``Message.rest_work``) and is waited, bounded, with it by the transport before the call returns. Only
  batched calls carry second messages: an unbatched one refuses them (``Step.check_unbatched``).
* Host staging (:class:`HostStaging`): wire buffers of CUDA tensors through pinned host memory, for gloo's
  send/recv. gloo's ``send``/``recv`` read and write the tensor's memory from the host, so a CUDA tensor fails
  (``writev ... Bad address``). A link end stages the codec's *encoded* uint8 wire buffer instead, so
  compression shrinks the PCIe copies as much as the link's bytes; the uncompressed ``none`` codec goes the same
  way, so bf16 against a codec is a fair comparison.

  Send (``HostStaging.stage_send(wire)``): the side stream waits for the current stream (where the codec
  encoded), copies the wire buffer into a pinned host buffer and records an event; ``StagedSend.host()`` waits
  for that event and returns the host buffer for ``dist.isend``; the message calls ``release()`` once the
  send's ``Work`` is complete.

  Receive (``HostStaging.stage_recv(nbytes)``): ``StagedRecv.host`` is a pinned host buffer for ``dist.irecv``;
  once the receive's ``Work`` is complete, ``to_device(n)`` copies its first ``n`` bytes (the message, which may
  be shorter than the receive; asynchronously, on the current stream) into a device wire buffer, which the codec
  decodes into Megatron's receive tensor on the same stream; then ``release()``.

  Buffers are pooled per size class (``size_class``: the byte count rounded up to 1/16 of its octave): a later
  message of a size reuses an earlier one's buffers once released, and messages whose lengths vary
  (entropy-coded, sent at their own length) share a few (``allocations`` counts buffers ever made). A released
  host buffer that a copy still reads or writes carries that copy's event; it is handed out again only after
  the event completes. torch's own caching host allocator would also reuse pinned blocks, but it cannot know
  when gloo is done with one; the pool is told (``release``). On CPU tensors (CI, or no CUDA) the same code runs
  with unpinned buffers and plain copies.
"""

from __future__ import annotations

import collections
import time
from typing import Callable

import torch

from .peer import posted_batch
from .wire import codec_buffer, read_trailer, stamp_sent_at

__all__ = ["Handle", "HostStaging", "Message", "Outbox", "StagedRecv", "StagedSend", "post_rests", "rest_tag",
           "size_class"]


# ----- host staging ------------------------------------------------------------------------------------------
def size_class(nbytes: int) -> int:
    """The pooled size a buffer of ``nbytes`` comes from: ``nbytes`` rounded up to a multiple of 1/16 of its
    octave (of 64 bytes at least), so that messages of varying lengths (entropy-coded) reuse a few buffers, from
    1 KiB on at most 1/16 larger."""
    if nbytes <= 64:
        return 64 if nbytes else 0
    step = 1 << max(6, nbytes.bit_length() - 5)
    return -(-nbytes // step) * step


class _Pool:
    """Buffers of ``nbytes`` uint8 on one device (or pinned host memory), handed out and returned: each the first
    ``nbytes`` of a pooled buffer of its size class (``size_class``)."""

    def __init__(self, device: torch.device, pin: bool):
        self.device, self.pin = device, pin
        self.free: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self.allocations = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes = {nbytes!r}: a wire buffer size is an integer >= 0")
        size = size_class(nbytes)
        free = self.free[size]
        if free:
            buf, event = free.popleft()
            if event is not None:
                event.synchronize()  # a copy still used it: wait (copies of a message are short)
            return buf[:nbytes]
        self.allocations += 1
        return torch.empty(size, dtype=torch.uint8, device=self.device, pin_memory=self.pin)[:nbytes]

    def release(self, buf: torch.Tensor, event=None) -> None:
        """Return a buffer ``acquire`` handed out (its pooled buffer goes back)."""
        pooled = buf if buf._base is None else buf._base
        self.free[pooled.numel()].append((pooled, event))


class StagedSend:
    """An outgoing wire buffer on its way to pinned host memory."""

    def __init__(self, staging: "HostStaging", buf: torch.Tensor, event):
        self._staging, self._buf, self._event = staging, buf, event

    def host(self) -> torch.Tensor:
        """The host buffer, once the copy is complete (waits for it): what ``dist.isend`` sends."""
        if self._buf is None:
            raise RuntimeError("StagedSend used after release()")
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._buf

    def release(self) -> None:
        """Return the host buffer to the pool; call once the send's ``Work`` is complete."""
        if self._buf is not None:
            self._staging._host.release(self._buf, self._event)
            self._buf = None


class StagedRecv:
    """An incoming wire buffer: ``host`` for ``dist.irecv``, then ``to_device()`` for the codec."""

    def __init__(self, staging: "HostStaging", host: torch.Tensor):
        self._staging, self.host, self._device_buf, self._event = staging, host, None, None

    def to_device(self, nbytes: int | None = None) -> torch.Tensor:
        """Copy the received bytes (the receive must be complete; its first ``nbytes``, None: all) to a device
        wire buffer, on the current stream; decode from it on the same stream."""
        if self.host is None:
            raise RuntimeError("StagedRecv used after release()")
        staging = self._staging
        nbytes = self.host.numel() if nbytes is None else nbytes
        if self._device_buf is None:
            self._device_buf = staging._device.acquire(self.host.numel())
            if staging.cuda:
                self._device_buf[:nbytes].copy_(self.host[:nbytes], non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record(torch.cuda.current_stream(staging.device))
            else:
                self._device_buf[:nbytes].copy_(self.host[:nbytes])
        return self._device_buf[:nbytes]

    def release(self) -> None:
        """Return both buffers (call after the decode is enqueued on the current stream)."""
        staging = self._staging
        if self.host is not None:
            staging._host.release(self.host, self._event)
            self.host = None
        if self._device_buf is not None:
            staging._device.release(self._device_buf)  # reused in stream order on this stream
            self._device_buf = None


class HostStaging:
    """Pinned host staging of wire buffers for one link end on ``device`` (see the module docstring)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and not torch.cuda.is_available():
            raise RuntimeError(f"HostStaging({self.device}): CUDA is not available here")
        if self.cuda and self.device.index is None:  # "cuda": the current device, as tensors on it name it
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._host = _Pool(torch.device("cpu"), pin=self.cuda)
        self._device = _Pool(self.device, pin=False)
        self._side = torch.cuda.Stream(self.device) if self.cuda else None

    @property
    def allocations(self) -> int:
        """Buffers ever allocated (host and device); constant once every size has been seen."""
        return self._host.allocations + self._device.allocations

    def stage_send(self, wire: torch.Tensor) -> StagedSend:
        """Start copying ``wire`` (uint8, 1-D, on this device) to a pinned host buffer."""
        if wire.dtype != torch.uint8 or wire.dim() != 1:
            raise ValueError(f"a wire buffer is a 1-D uint8 tensor, got {wire.dtype} of shape {tuple(wire.shape)}")
        if wire.device != self.device:
            raise ValueError(f"wire buffer on {wire.device}, this staging is for {self.device}")
        host = self._host.acquire(wire.numel())
        if not self.cuda:
            host.copy_(wire)
            return StagedSend(self, host, None)
        self._side.wait_stream(torch.cuda.current_stream(self.device))  # the encode is done
        with torch.cuda.stream(self._side):
            host.copy_(wire, non_blocking=True)
            wire.record_stream(self._side)  # the allocator keeps ``wire`` until the copy is done
            event = torch.cuda.Event()
            event.record(self._side)
        return StagedSend(self, host, event)

    def stage_recv(self, nbytes: int) -> StagedRecv:
        """A host buffer of ``nbytes`` for ``dist.irecv``."""
        return StagedRecv(self, self._host.acquire(nbytes))


# ----- the message -----------------------------------------------------------------------------------------
class Message:
    """A send (``target`` None) or a receive posted on ``link``; ``extra_nbytes``: the trailer's bytes after the
    codec buffer (0: none); ``stages``: (sender, receiver) pipeline stages, for errors."""

    def __init__(self, link, buf: torch.Tensor, *, target: torch.Tensor | None = None, codec=None,
                 staging=None, extra_nbytes: int = 0, stages=(None, None), last_stage: bool = False,
                 rest: torch.Tensor | None = None, exact: bool = False, iteration: int | None = None):
        self.link, self.buf, self.target, self.codec = link, buf, target, codec
        self.staging, self.extra_nbytes = staging, extra_nbytes
        self.stages, self.last_stage, self.iteration = stages, last_stage, iteration
        # ``exact``: a receive posts the most the message can be and learns its length once complete (``read_length``)
        self.exact = exact
        # ``rest``: a second message right behind this one (a framed message's overflow, frames.py; batched calls
        # only): a send's from the start, a receive's once its size is known (``rest_nbytes``, asked of the link
        # end's steps); ``rest_work``: its posted transfer, waited with the message's own
        self.rest, self.rest_nbytes, self.rest_work = rest, None, None
        self.trailer: bytes | None = None  # a complete receive's trailer, read on the host (``read``)
        self.group = None  # the process group it was posted on
        self.work = None
        self.bounded = True  # whether waits pass --tah-peer-timeout-s to ``work.wait`` (gloo; ``peer.py``)
        self.done = False
        self.failed = False  # its wait raised (a peer timed out or died): never waited again
        self.completed_at: float | None = None
        self.timed = False  # ``work`` times itself (NCCL, ``wire.time_works``)

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

    def read(self) -> None:
        """A complete receive, read once: its length (``read_length``, unless its second message asked it
        already) and its trailer (when it has one), read on the host; on a GPU that read waited for the data,
        so the completion time is then. An unbatched message cannot have a second message."""
        if self.rest_nbytes is None and self.read_length():  # (unbatched: refused in check_unbatched)
            raise RuntimeError("megatron_tah: an unbatched message announced a second message")
        if self.extra_nbytes:
            self.trailer = read_trailer(self.buf)
            if self.buf.is_cuda:
                self.completed_at = time.monotonic()

    def read_length(self) -> int:
        """A complete receive's length and the bytes that follow it as a second message (asked once:
        ``rest_nbytes``; ``rest`` is their buffer), as its link end's steps say: the message is the first
        bytes of ``buf`` (an exact one: fewer than posted), which becomes those, its trailer its last bytes."""
        nbytes = self.buf.numel() - self.extra_nbytes
        for step in self.link.steps:
            nbytes = step.received_nbytes(self, nbytes)
        nbytes += self.extra_nbytes
        if nbytes > self.buf.numel():
            raise ValueError(f"a message of {nbytes} bytes in a receive of {self.buf.numel()}")
        self.buf = self.buf[:nbytes]
        self.rest_nbytes = sum(step.follow_nbytes(self) for step in self.link.steps)
        if self.rest_nbytes:
            self.rest = torch.empty(self.rest_nbytes, dtype=torch.uint8, device=self.buf.device)
        return self.rest_nbytes

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


# ----- the outbox ------------------------------------------------------------------------------------------
class Outbox:
    """The handles (``message.Handle``) of the messages one transport posted on the unbatched path and has not
    yet seen finished."""

    def __init__(self):
        self.handles: list[Handle] = []

    def post(self, handle: Handle) -> None:
        self.handles.append(handle)

    def reap(self, iteration: int | None) -> None:
        """At the start of a transport call (training ``iteration``, None: unknown): stamp the complete messages'
        completion, finish the sends posted at an earlier iteration and those followed by a finished send on their
        link, and drop the finished and the failed."""
        for handle in self.handles:
            m = handle.message
            if not (m.done or m.failed):
                m.poll()
        overtaken = set()  # links with a later send finished (walked newest first)
        for handle in reversed(self.handles):
            m = handle.message
            if m.is_recv or m.failed:
                continue
            if not m.done:
                earlier = None not in (iteration, m.iteration) and m.iteration < iteration
                if earlier or id(m.link) in overtaken:
                    handle.wait()
            if m.done:
                overtaken.add(id(m.link))
        self.handles[:] = [h for h in self.handles if not (h.message.done or h.message.failed)]

    def drain(self) -> None:
        """Finish every send not yet finished (each wait bounded as the transport's are; the first that fails
        raises, and the rest are not waited for); then drop them all. Not a message whose wait already failed (its
        peer is gone), nor a receive never waited for (Megatron's schedules wait for every receive they post)."""
        try:
            for handle in self.handles:
                if not (handle.message.is_recv or handle.message.failed):
                    handle.wait()
        finally:
            self.handles.clear()

    def holdings(self) -> dict[str, int]:
        """What it holds now: messages (each with its ``Work``) and the bytes of their buffers."""
        held = [h.message for h in self.handles if not (h.message.done or h.message.failed)]
        return {"messages": len(held),
                "works": sum((m.work is not None) + (m.rest_work is not None) for m in held),
                "bytes": sum((0 if m.buf is None else m.buf.numel()) + (0 if m.rest is None else m.rest.numel())
                             for m in held)}


# ----- second messages -----------------------------------------------------------------------------------
def rest_tag(direction: str) -> int:
    """The tag of a message's second message (gloo matches by it; NCCL by order)."""
    return 1 if direction == "forward" else 2


def post_rests(messages) -> list[Message]:
    """Post the second messages of one batched call's complete ``messages`` (the sends' as they are, the
    receives' into new buffers); returns the messages that have one, each with its ``rest_work``."""
    dist = torch.distributed
    ops, owners = [], []
    for direction in ("forward", "backward"):
        for m in messages:
            if m.link.direction != direction or m.group is None:
                continue
            if (m.read_length() if m.is_recv else m.rest is not None):
                post = dist.irecv if m.is_recv else dist.isend
                ops.append(dist.P2POp(post, m.rest, m.link.peer, m.group, tag=rest_tag(direction)))
                owners.append(m)
    for m, work in zip(owners, posted_batch(ops) if ops else ()):
        m.rest_work = work
    return owners
