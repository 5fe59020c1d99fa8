"""A fake CUDA runtime for CPU tests of code that drives streams, events and graph captures.

``FakeCuda(monkeypatch)`` replaces, for one test, what megatron_tah calls in ``torch.cuda``
(``Stream``, ``stream``, ``current_stream``, ``current_device``, ``Event``, ``CUDAGraph``,
``graph_pool_handle``, ``synchronize``, ``empty_cache``, ``is_current_stream_capturing``) and the
caching allocator's pool calls in ``torch._C``, and records what was done with them:

* ``current``: the current stream per device index; ``stream(s)`` contexts set and restore it the way
  torch's ``StreamContext`` does, so a test sees which stream a thread is left on;
* ``syncs`` / ``empties``: device-wide synchronisations and cache flushes (each one a stall of every
  stream of the device, NCCL's included);
* ``events``: ``(event, stream)`` for every ``Event.record``, the stream it was recorded on;
* ``routing``: the memory pools that allocations of a capturing stream are still routed to (a
  capture adds its pool at ``capture_begin``; ``capture_end`` removes it only when it succeeds, as
  torch's ``CUDAGraph::capture_end`` does; ``torch._C._cuda_endAllocateToPool`` removes it) and
  ``released``: the pools given back with ``torch._C._cuda_releasePool``;
* ``capturing``: the streams in capture mode (``is_current_stream_capturing``).

``fail_capture_end``: the message ``CUDAGraph.capture_end`` raises (None: captures succeed), as a
capture that met a host sync or a pageable copy does. The data stays on the CPU: kernels run when
they are called, a replay does nothing.
"""

from __future__ import annotations

import itertools

import torch


class FakeStream:
    def __init__(self, cuda: "FakeCuda", device: torch.device, name: str):
        self.cuda, self.device, self.name = cuda, device, name
        self.waited: list[FakeStream] = []

    def wait_stream(self, other: "FakeStream") -> None:
        self.waited.append(other)

    def __repr__(self) -> str:
        return f"<stream {self.name} on {self.device}>"


class FakeStreamContext:
    """``torch.cuda.StreamContext``: sets the stream on ``__enter__``, restores it on ``__exit__`` only (a
    context whose ``__exit__`` is skipped leaves the thread on its stream, as torch's does)."""

    def __init__(self, cuda: "FakeCuda", stream: FakeStream | None):
        self.cuda, self.stream, self.previous = cuda, stream, None

    def __enter__(self):
        if self.stream is not None:
            self.previous = self.cuda.current[self.stream.device.index]
            self.cuda.current[self.stream.device.index] = self.stream

    def __exit__(self, *exc):
        if self.stream is not None:
            self.cuda.current[self.stream.device.index] = self.previous


class FakeEvent:
    def __init__(self, cuda: "FakeCuda", enable_timing: bool = False):
        self.cuda, self.enable_timing, self.stream = cuda, enable_timing, None

    def record(self, stream: FakeStream | None = None) -> None:
        self.stream = self.cuda.current_stream() if stream is None else stream
        self.cuda.events.append((self, self.stream))

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "FakeEvent") -> float:
        return 1.0


class FakeCuda:
    def __init__(self, monkeypatch, devices: int = 2):
        self.devices = devices
        self.device_index = 0
        self.current = {i: FakeStream(self, torch.device("cuda", i), f"default{i}") for i in range(devices)}
        self.syncs = self.empties = 0
        self.events: list[tuple[FakeEvent, FakeStream]] = []
        self.routing: set = set()
        self.released: list = []
        self.capturing: dict = {}  # stream -> pool
        self.fail_capture_end: str | None = None
        self.graphs: list = []
        self._pools = itertools.count(1)
        self._streams = itertools.count(1)
        cuda = self

        class CUDAGraph:
            """``torch.cuda.CUDAGraph``'s capture calls, with torch's bookkeeping of the capture stream and pool."""

            def __init__(self, keep_graph: bool = False):
                self.stream, self.pool, self.captured, self.replays = None, None, False, 0
                cuda.graphs.append(self)

            def capture_begin(self, pool=None, capture_error_mode: str = "global", **unused):
                self.stream = cuda.current_stream()
                if self.stream.name.startswith("default"):
                    raise RuntimeError("CUDA graphs must be captured on a non-default stream.")
                self.pool = pool if pool is not None else (next(cuda._pools), 0)
                self.mode = capture_error_mode
                cuda.routing.add(self.pool)
                cuda.capturing[self.stream] = self.pool

            def capture_end(self):
                if cuda.current_stream() is not self.stream:
                    raise RuntimeError("Capture must end on the same stream it began on.")
                cuda.capturing.pop(self.stream, None)  # cudaStreamEndCapture ends the capture either way
                if cuda.fail_capture_end is not None:
                    raise RuntimeError(cuda.fail_capture_end)
                cuda.routing.discard(self.pool)
                self.captured = True

            def replay(self):
                if not self.captured:
                    raise RuntimeError("Called CUDAGraph::replay without a preceding successful capture.")
                self.replays += 1

        def end_allocate_to_pool(device, pool):
            if pool not in cuda.routing:
                raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
            cuda.routing.discard(pool)

        patches = {
            "Stream": self.Stream, "stream": self.stream, "current_stream": self.current_stream,
            "current_device": lambda: self.device_index, "set_stream": self.set_stream,
            "Event": lambda enable_timing=False, **kw: FakeEvent(self, enable_timing),
            "CUDAGraph": CUDAGraph, "graph_pool_handle": lambda: (0, next(self._pools)),
            "synchronize": self.synchronize, "empty_cache": self.empty_cache,
            "is_current_stream_capturing": lambda: self.current_stream() in self.capturing,
        }
        for name, value in patches.items():
            monkeypatch.setattr(torch.cuda, name, value)
        monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end_allocate_to_pool, raising=False)
        monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda device, pool: self.released.append(pool),
                            raising=False)
        monkeypatch.setattr(torch._C, "_host_emptyCache", self.empty_cache, raising=False)
        monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", None)  # torch.cuda.graph's lazy class state

    # ----- torch.cuda's stream API --------------------------------------------------------------
    def _index(self, device) -> int:
        if device is None:
            return self.device_index
        if isinstance(device, int):
            return device
        device = torch.device(device)
        return self.device_index if device.index is None else device.index

    def Stream(self, device=None, priority: int = 0, **unused) -> FakeStream:  # noqa: N802 (torch's name)
        return FakeStream(self, torch.device("cuda", self._index(device)), f"side{next(self._streams)}")

    def current_stream(self, device=None) -> FakeStream:
        return self.current[self._index(device)]

    def set_stream(self, stream: FakeStream) -> None:
        self.current[stream.device.index] = stream

    def stream(self, stream: FakeStream | None) -> "FakeStreamContext":
        return FakeStreamContext(self, stream)

    def synchronize(self, device=None) -> None:
        self.syncs += 1

    def empty_cache(self) -> None:
        self.empties += 1

    # ----- for assertions ------------------------------------------------------------------------
    def on_default_streams(self) -> bool:
        return all(s.name.startswith("default") for s in self.current.values())
