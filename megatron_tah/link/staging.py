"""Wire buffers of CUDA tensors through pinned host memory, for gloo's send/recv.

gloo's ``send``/``recv`` read and write the tensor's memory from the host, so a CUDA tensor fails
(``writev ... Bad address``). A link end stages the codec's *encoded* uint8 wire buffer instead,
so compression shrinks the PCIe copies as much as the link's bytes; the uncompressed ``none``
codec goes the same way, so bf16 against a codec is a fair comparison.

Send (``HostStaging.stage_send(wire)``): the side stream waits for the current stream (where the
codec encoded), copies the wire buffer into a pinned host buffer and records an event;
``StagedSend.host()`` waits for that event and returns the host buffer for ``dist.isend``; the
transport calls ``release()`` once the send's ``Work`` is complete.

Receive (``HostStaging.stage_recv(nbytes)``): ``StagedRecv.host`` is a pinned host buffer for
``dist.irecv``; once the receive's ``Work`` is complete, ``to_device(n)`` copies its first ``n`` bytes (the
message, which may be shorter than the receive; asynchronously, on the current stream) into a device wire
buffer, which the codec decodes into Megatron's receive tensor on the same stream; then ``release()``.

Buffers are pooled per size class (``size_class``: the byte count rounded up to 1/16 of its octave): a
later message of a size reuses an earlier one's buffers once released, and messages whose lengths vary
(entropy-coded, sent at their own length) share a few (``allocations`` counts buffers ever made). A
released host buffer that a copy still
reads or writes carries that copy's event; it is handed out again only after the event completes.
torch's own caching host allocator would also reuse pinned blocks, but it cannot know when gloo
is done with one; the pool is told (``release``). On CPU tensors (CI, or no CUDA) the same code
runs with unpinned buffers and plain copies.
"""

from __future__ import annotations

import collections

import torch


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
