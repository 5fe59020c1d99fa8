"""A codec's encode and decode replayed from CUDA graphs: one capture per (op, shape, dtype, device).

Pipeline shapes are static, so the launches of one encode (or decode) are the same every message;
``GraphedCodec(codec)`` runs the first call of each (op, shape, dtype, device) eagerly on a side
stream (torch's warm-up rule; its result is that call's result), captures the same call once on that
stream into a ``torch.cuda.CUDAGraph`` with static input and output buffers, and from then on copies the
input in, replays, and copies the output out: no Python work per tile or section, a few launches per
call. A capture never waits for the device (``CudaGraphs.capture``): it may happen mid-schedule, with
this rank's NCCL sends and receives in flight.

What a replay costs beyond the kernels: one device copy of the input into the static buffer and one
of the output out of it (the caller owns what it gets back; the static buffers are overwritten by the
next replay). Messages above ``MAX_GRAPH_NUMEL`` elements stay eager: there the kernels dominate and
the copies would cost more than the launches saved.

Eager fallback, with one log line per codec object and reason (``GraphedCodec.eager_reasons``; wrappers
given one ``logged`` set, as the pipeline's link ends are, log each reason once between them):

* tensors not on a CUDA device (``CudaGraphs.unavailable``);
* ``none``: its encode and decode are one copy each, which a replay's copies in and out would triple;
* a codec class with ``graph_capturable = False`` (AQ-SGD: per-sample buffers indexed by host ids);
* stochastic rounding (``codec.stateful`` for a codec with ``rounding_noise``): each encode draws a new
  seed on the host, which a replay would repeat;
* decode with ``checks == "full"``: the header is read on the host, a sync per call (``defer_checks()``);
* a capture that raises (a host sync nobody declared): the error's first line is logged, and that op
  stays eager for every shape of the codec; the thread's stream and the allocator are left as before.

A ``GraphedCodec`` stands where its codec stood: every attribute it does not define is the codec's
(``wire_nbytes``, ``checksum``, ``raise_deferred_errors``, ``state_dict``, ``last_rotated``, ...), and
``defer_checks`` sets the codec's mode and forgets what was captured under the old one. ``place_codec``
is how the places (pipeline links, TP/DP collectives) and ``scripts/profile_codecs.py`` build one.

Deferred checks stay exact under replay: the host part (the buffer's length, and raising a count that
earlier decodes left on the device) runs eagerly every call; the header comparison and the payload's
corruption counts are device ops inside the graph, adding into the codec's ``DeferredErrors`` tensor.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from .base import Codec
from .errors import CodecError, check_dtype, check_shape

logger = logging.getLogger(__name__)

MAX_GRAPH_NUMEL = 1 << 22  # elements; larger messages stay eager (kernel-bound: copies would cost more)
MAX_GRAPHS = 32  # captures a GraphedCodec keeps (one per op, shape, dtype, device); then it starts over


class CudaGraphs:
    """How graphs are made: ``torch.cuda.CUDAGraph`` (tests inject an object with the same two methods)."""

    @staticmethod
    def unavailable(device: torch.device) -> str | None:
        """Why no graph can be captured for tensors on ``device``, or None."""
        if device.type != "cuda":
            return f"tensors on {device.type.upper()}: CUDA graphs need a CUDA device"
        return None

    @staticmethod
    def capture(fn: Callable[[], object], device: torch.device) -> Callable[[], None]:
        """Run ``fn`` once on a side stream (the warm-up), capture a second call of it on that stream, and
        return the graph's ``replay``.

        Not ``torch.cuda.graph``, for two reasons found in its source (torch 2.11-2.14): entering it runs
        ``torch.cuda.synchronize()`` and ``empty_cache()``, a device-wide stall per new (op, shape) that,
        mid-schedule, waits for this rank's posted NCCL kernels (a hang when their peers wait on us); and
        when ``capture_end`` raises, its exit skips restoring the stream, so the thread stays on the side
        stream. Here nothing waits for the device (the caller's stream waits for the warm-up, on the
        device), the thread's stream is restored however the capture ends, and a failed capture is ended
        and its memory pool handed back before the error propagates (``_end_failed_capture``). The
        warm-up's result, allocated on the side stream, is marked as used by the caller's stream.
        """
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            warm_up = fn()
        current.wait_stream(side)  # the caller reads the warm-up's result after it, on the device
        if isinstance(warm_up, torch.Tensor) and warm_up.is_cuda:
            warm_up.record_stream(current)  # made on the side stream, freed by the caller
        graph = torch.cuda.CUDAGraph()
        pool = torch.cuda.graph_pool_handle()
        # thread_local: only this thread's calls are checked; a training run's other threads (NCCL's watchdog
        # querying events, gloo, data loaders) may keep calling CUDA while this one captures.
        with torch.cuda.stream(side):  # restores the thread's stream on every way out
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                fn()
            except BaseException:
                _end_failed_capture(graph, pool, device)
                raise
            try:
                graph.capture_end()
            except BaseException:
                _release_pool(pool, device)
                raise
        return graph.replay


def _end_failed_capture(graph, pool, device: torch.device) -> None:
    """End the capture that ``fn`` broke (the stream stays in capture mode until then) and free its pool.

    ``capture_end`` on an invalidated capture raises (``cudaErrorStreamCaptureInvalidated``) after ending
    it; that error is dropped here, the caller re-raises ``fn``'s own. When it succeeds instead (``fn``
    raised before touching the device), the graph owns the pool and releases it when it is dropped."""
    try:
        graph.capture_end()
    except Exception:  # noqa: BLE001 - the capture is broken; fn's error is the one to report
        _release_pool(pool, device)


def _release_pool(pool, device: torch.device) -> None:
    """Undo ``capture_begin``'s routing of allocations to ``pool`` when ``capture_end`` failed before undoing it.

    torch's ``CUDAGraph::capture_end`` raises at ``cudaStreamEndCapture`` before ``endAllocateToPool``, and
    its ``reset`` releases the pool only after a capture that ended: left alone, the caching allocator
    keeps a capture "underway" and stops recycling blocks used across streams (``process_events`` is
    skipped while captures are underway), so memory grows until an out-of-memory flush. When
    ``endAllocateToPool`` says nothing is routed any more, ``capture_end`` got past it and the graph
    owns the pool."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        torch._C._cuda_endAllocateToPool(index, pool)
    except RuntimeError:
        return
    torch._C._cuda_releasePool(index, pool)


class _Capture:
    """Static buffers of one captured call and the replay that refills them.

    ``output`` is the static output a replay writes (what the captured call returned); the warm-up's
    result is the first call's and goes to that call's caller, not kept here."""

    def __init__(self, inputs: torch.Tensor):
        self.inputs = inputs
        self.output: torch.Tensor | None = None
        self.replay: Callable[[], None] | None = None


class GraphedCodec:
    """``encode``/``decode`` of ``codec`` (same contract as ``Codec``'s) through captured graphs where possible.

    ``captured``: the keys ``(op, shape, dtype, device)`` replayed from a graph; ``eager_reasons``: the
    reason per key that runs eagerly. ``graphs`` is how graphs are made (``CudaGraphs``).
    """

    def __init__(self, codec: Codec, graphs=CudaGraphs, max_numel: int = MAX_GRAPH_NUMEL,
                 logged: set | None = None):
        if isinstance(codec, GraphedCodec) or not isinstance(codec, Codec):
            raise CodecError(f"GraphedCodec wraps a Codec, got {type(codec).__name__}")
        self.codec = codec
        self.graphs = graphs
        self.max_numel = int(max_numel)
        self._captures: dict[tuple, _Capture] = {}
        self.eager_reasons: dict[tuple, str] = {}
        self._failed: dict[str, str] = {}  # op -> why its capture failed: that op stays eager for every shape
        self._logged: set[str] = set() if logged is None else logged  # the reasons logged

    def __getattr__(self, name):
        if name == "codec":  # (not set yet: while unpickling or copying)
            raise AttributeError(name)
        return getattr(self.codec, name)

    def __repr__(self) -> str:
        return f"<graphed {self.codec!r}>"

    @property
    def captured(self) -> list[tuple]:
        return list(self._captures)

    def defer_checks(self, mode: str = "deferred") -> "GraphedCodec":
        """``codec.defer_checks(mode)``; captures and reasons made under the previous mode are dropped."""
        self.codec.defer_checks(mode)
        self._captures.clear()
        self.eager_reasons.clear()
        self._failed.clear()
        return self

    # ----- when to capture -----------------------------------------------------------------------
    def why_eager(self, op: str, shape: tuple[int, ...], device: torch.device) -> str | None:
        """Why ``op`` at ``shape`` on ``device`` cannot be replayed from a graph (None: it can)."""
        codec = self.codec
        reason = self.graphs.unavailable(device)
        if reason:
            return reason
        if op in self._failed:
            return self._failed[op]
        if type(codec).graph_no_gain:
            return type(codec).graph_no_gain
        if not type(codec).graph_capturable:
            return f"{codec.name} is not capturable ({type(codec).graph_blocker})"
        if op == "encode" and getattr(getattr(codec, "rounding_noise", None), "enabled", False):
            return "stochastic rounding draws a new host-side seed per encode (a replay would repeat it)"
        if op == "decode" and codec.checks == "full":
            return "full checks read the header on the host (a sync per decode); call codec.defer_checks()"
        numel = 1
        for d in shape:
            numel *= d
        if numel > self.max_numel:
            return f"{numel} elements > max_numel {self.max_numel}: kernel-bound, the graph's copies would cost more"
        return None

    def _eager(self, key: tuple, reason: str) -> None:
        self.eager_reasons[key] = reason
        if reason not in self._logged:
            self._logged.add(reason)
            logger.info("megatron_tah: %s %s runs eagerly, no CUDA graph: %s", self.codec.describe(), key[0], reason)

    def _lookup(self, key: tuple, op: str, shape, device) -> _Capture | None:
        """The capture for ``key``, or None (eager) after logging why; a new key is checked once."""
        if key in self._captures:
            return self._captures[key]
        if key not in self.eager_reasons:
            reason = self.why_eager(op, shape, device)
            if reason:
                self._eager(key, reason)
        return None

    def _capture(self, key: tuple, inputs: torch.Tensor, run: Callable[[], torch.Tensor],
                 device) -> torch.Tensor | None:
        """Capture ``run`` (reads ``inputs``, returns the static output) after its warm-up; log and stay eager
        if that fails. Returns the warm-up's result (this call's result; None when the warm-up did not finish).

        A failed capture turns ``key``'s op eager for every shape of this codec: what breaks a capture (a host
        sync, a pageable copy) is in the op's code, and each new shape would fail again, one warm-up and one
        broken capture each."""
        capture = _Capture(inputs)
        warm_up: list[torch.Tensor] = []  # the first call's result, until it is returned
        calls = [0]

        def fn():
            result = run()
            calls[0] += 1
            if calls[0] == 1:
                warm_up.append(result)
            else:
                capture.output = result  # the capture's call: the buffer a replay writes
            return result

        if len(self._captures) >= MAX_GRAPHS:  # shapes that keep changing: start over
            self._captures.clear()
        try:
            capture.replay = self.graphs.capture(fn, device)
        except Exception as error:  # noqa: BLE001 - any capture failure means eager, said once
            first_line = (str(error).splitlines() or [""])[0][:200]
            self._failed[key[0]] = f"capture failed: {type(error).__name__}: {first_line}"
            self._eager(key, self._failed[key[0]])
        else:
            self._captures[key] = capture
        return warm_up.pop() if warm_up else None  # (not kept: the caller owns it)

    # ----- the codec's contract --------------------------------------------------------------------
    def encode(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        """``codec.encode(x)``, from a graph once this (shape, dtype, device) was seen: a new buffer.

        Keyword arguments (AQ-SGD's ``sample_ids``) go to the codec's own encode, which then runs eagerly."""
        if not isinstance(x, torch.Tensor):
            raise CodecError(f"encode takes a torch.Tensor, got {type(x).__name__}")
        key = ("encode", tuple(x.shape), x.dtype, str(x.device))
        capture = self._lookup(key, "encode", key[1], x.device)
        if kwargs:
            if capture is not None or key not in self.eager_reasons:
                raise CodecError(f"{self.codec.describe()}: encode arguments {sorted(kwargs)} need an eager codec")
            return self.codec.encode(x, **kwargs)
        if capture is not None:
            capture.inputs.copy_(x)
            capture.replay()
            return capture.output.clone()
        if key in self.eager_reasons:
            return self.codec.encode(x)
        check_shape(x.shape)
        check_dtype(x.dtype)
        static_x = x.detach().clone(memory_format=torch.contiguous_format)
        result = self._capture(key, static_x, lambda: self.codec.encode(static_x), x.device)
        # The warm-up encoded x (its buffer is this call's result): encoding it again would advance a codec's state.
        return result if result is not None else self.codec.encode(x)

    def decode(self, buf: torch.Tensor, shape: Sequence[int], dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """``codec.decode(buf, shape, dtype, out)``, from a graph once this (shape, dtype, device) was seen."""
        shape = check_shape(shape)
        key = ("decode", shape, dtype, str(buf.device) if isinstance(buf, torch.Tensor) else "?")
        if not isinstance(buf, torch.Tensor) or key in self.eager_reasons:
            return self.codec.decode(buf, shape, dtype, out=out)
        if out is not None and (tuple(out.shape) != shape or out.dtype != dtype or out.device != buf.device):
            return self.codec.decode(buf, shape, dtype, out=out)  # (raises, naming what differs)
        capture = self._lookup(key, "decode", shape, buf.device)
        if capture is None and key in self.eager_reasons:
            return self.codec.decode(buf, shape, dtype, out=out)
        codec = self.codec
        layout = codec.layout(shape, dtype)
        codec._check_length(buf, shape, dtype, layout)  # host-only checks, every call
        if codec.checks == "deferred":
            codec.raise_deferred_errors(buf.device)
        if capture is None:
            check_dtype(dtype)
            static_buf = buf.detach().clone()
            static_out = torch.empty(shape, dtype=dtype, device=buf.device)
            run = lambda: codec.decode_on_device(static_buf, shape, dtype, static_out)  # noqa: E731
            result = self._capture(key, static_buf, run, buf.device)
            if result is None:
                return codec.decode(buf, shape, dtype, out=out)
            # (result: the warm-up decoded buf into the static output)
        else:
            capture.inputs.copy_(buf)
            capture.replay()
            result = capture.output
        if out is None:
            return result.clone()
        return out.copy_(result)


def place_codec(codec: Codec, eager: bool = False, graphs=CudaGraphs, logged: set | None = None):
    """``codec`` as a place calls it: checks deferred (the place has compared its ends' configurations) and,
    unless ``eager`` (``--tah-eager-codecs``), replayed from CUDA graphs (a ``GraphedCodec``)."""
    codec.defer_checks()
    return codec if eager else GraphedCodec(codec, graphs, logged=logged)


def eager(codec) -> Codec:
    """The codec behind ``codec`` (itself when it is not a ``GraphedCodec``): for calls not worth a graph."""
    return codec.codec if isinstance(codec, GraphedCodec) else codec
