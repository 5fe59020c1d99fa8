"""Per-rank traffic statistics: what the compressing transports and collectives sent, per stream.

A *stream* (:class:`Stream`) is one place and direction, declared by the place (``places.streams()``
gathers them): the pipeline's activations (``"forward"``) and activation gradients
(``"backward"``), the tensor-parallel collectives' forward and backward traffic (``"tp_forward"``,
``"tp_backward"``) and the data-parallel gradient reduction (``"dp_backward"``). A :class:`Stats`
sink holds one rank's counters of the streams declared to it (``declare``); the installed one is
``registry.REGISTRY.stats``, handed to every place. The pipeline transport calls its
``record_send`` once per message, the compressed collectives ``record_collective`` once per
collective. ``collect()`` returns (and by default resets) this rank's totals since the last
collect, i.e. one iteration when the training log collects every iteration::

    {"forward":  {"messages", "raw_bytes", "wire_bytes", "ratio", "rel_error", "rotated_fraction",
                  "rel_error_samples", "rotated_samples", "encode_seconds", "decode_seconds"},
     "backward": {...same keys...},  "tp_forward": {...},  "tp_backward": {...},  "dp_backward": {...},
     "links": {(src_global_rank, dst_global_rank): wire_bytes},
     "link_errors": {(src_global_rank, dst_global_rank): (rel_error_sum, rel_error_samples)},
     "buffer_bytes": bytes held in per-sample codec buffers (AQ-SGD) now,
     "saved_memory": {global_rank: {"bits", "raw_bytes", "stored_bytes"}},
     "auto": {(src_global_rank, dst_global_rank): {"codec", "rate_bps", "spread_bps"}},
     "wan": {category: {"ops", "bytes", "codec_bytes"}},
     "places": {place: {name: value}}}

``wan`` is the WAN ledger (``ledger.py`` records it): bytes this rank handed to operations that cross a
pipeline-stage boundary, per ``WAN_CATEGORIES`` (``pipeline``: point-to-point sends to another stage, the
pipeline's messages; ``embedding``: the embedding group's traffic, the tied word-embedding gradient;
``dp``: data-parallel groups that span stages; ``other``: every other collective whose group spans stages --
loss, grad norm, timers, the statistics' own reduction), ``ops`` the operations counted and
``codec_bytes`` the part of ``bytes`` that went through a megatron_tah codec: pipeline messages smaller
than their tensor (``record_send``: a codec other than ``none``) and what a compressing place sends inside
``codec_traffic()``.

``places``: each installed place's own levels, read from the sink's ``sources`` (a place's ``statistics`` hook,
``place_spec.PlaceSpec``) at every ``collect``; summed over ranks, the later one kept by ``merge`` (levels, not counts).

``auto`` (``--tah-*-codec auto``): per pipeline link, the codec its sender used last and the last
measured rate and spread of the link (None before the first measurement); a level, not a count.

For a collective, ``messages`` counts collectives, ``wire_bytes`` is what this rank handed to
the network for other ranks (codec buffers) and ``raw_bytes`` what the same exchange would
carry uncompressed (the tensor's own dtype). ``saved_memory`` (from the sink's
``memory_source``, LAAQ) is this rank's peak since the last collect of the bytes that
transformer layers saved for backward, as stored and as they would have been stored
(``raw_bytes``); it is empty when nothing measures it.

``raw_bytes`` is numel * element size of the tensors Megatron asked to send,
``ratio`` = raw / wire (None without messages). ``rel_error`` is the mean of the sampled
``||x - decode(encode(x))|| / ||x||`` and ``rotated_fraction`` the mean fraction of tiles
rotated (TAH-Quant); both None when nothing was sampled. ``link_errors`` keeps the sampled errors
per pipeline link (a stage boundary and its direction), for the error per boundary (``link_rel_errors``). ``encode_seconds`` /
``decode_seconds`` are the time spent in the codec's ``encode`` / ``decode`` for this
direction's messages (CUDA: between CUDA events around the call, the kernels' time).
Values recorded as device tensors or CUDA-event intervals stay pending until ``collect``. ``buffer_bytes``
comes from the sink's ``buffer_source`` (the pipeline transport's codecs), 0 without one.
``apart()`` counts a block (an evaluation) on its own, leaving the counters from before it untouched.
``reduce_to_last_rank`` sums the totals (and gathers ``saved_memory``) over the pipeline group
(a collective: every rank of the group calls it) and ``format_for_log`` renders a Megatron-style
log fragment, per iteration or as totals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator

import torch

from ..codecs.core import timing
from ..config import CANDIDATES
from .bounded import collective_wait

DIRECTIONS = ("forward", "backward")  # the pipeline's streams: its messages' directions
_MEMORY = ("bits", "raw_bytes", "stored_bytes")
# Per stream, in this order, in the reduction tensor.
_SUMS = ("messages", "raw_bytes", "wire_bytes", "rel_error_sum", "rel_error_samples",
         "rotated_sum", "rotated_samples", "encode_seconds", "decode_seconds")
_NOT_STREAMS = ("links", "link_errors", "auto", "buffer_bytes", "saved_memory", "wan", "places")  # collect()'s others
WAN_CATEGORIES = ("pipeline", "embedding", "dp", "other")
"""The WAN ledger's categories (``wan`` in ``collect()``), in the reduction's order."""
_WAN_SUMS = ("ops", "bytes", "codec_bytes")


@dataclasses.dataclass(frozen=True)
class Stream:
    """One statistics stream: its key in ``collect()``'s result, the place and direction it counts, and its
    label in the log line (``tah <label> MB``)."""

    key: str
    place: str
    direction: str
    label: str


def stream_keys(stats: dict) -> list[str]:
    """The stream keys of a ``collect`` / ``reduce_to_last_rank`` result, in the sink's declaration order."""
    return [key for key in stats if key not in _NOT_STREAMS]


def _empty(streams) -> dict:
    return {key: dict.fromkeys(_SUMS, 0.0) for key in streams}


def _empty_wan() -> dict:
    return {category: dict.fromkeys(_WAN_SUMS, 0) for category in WAN_CATEGORIES}


def wan_totals(stats: dict) -> tuple[int, int]:
    """(bytes, codec bytes) of a result's WAN ledger, over every category ((0, 0) without one)."""
    wan = stats.get("wan") or {}
    return sum(c["bytes"] for c in wan.values()), sum(c["codec_bytes"] for c in wan.values())


def _this_rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Stats:
    """One rank's counters since the last ``collect`` (the sink every place records into; the
    installed one is ``registry.REGISTRY.stats``). Thread-safe.

    ``streams``: the :class:`Stream` s counted (more with ``declare``). ``buffer_source``: a callable
    returning the bytes held in per-sample codec buffers (the pipeline transport's), None: 0.
    ``memory_source``: a callable ``source(reset)`` returning saved-tensor peaks
    ``{"bits", "raw_bytes", "stored_bytes"}`` or None (LAAQ's), None: nothing measured. ``sources``: per
    installed place, a callable returning its own levels ``{name: value}`` (``places.install`` sets them).
    """

    def __init__(self, streams: Iterable[Stream] = ()):
        self._lock = threading.Lock()
        self.streams: dict[str, Stream] = {}
        self._totals: dict[str, dict] = {}
        self.declare(streams)
        self._links: dict[tuple[int, int], int] = {}  # (src, dst) -> wire bytes
        self._link_errors: dict[tuple[int, int], tuple] = {}  # (src, dst) -> (sum of sampled rel. errors, samples)
        self._auto: dict[tuple[int, int], dict] = {}  # (src, dst) -> auto's codec and measured rate
        self._wan = _empty_wan()  # category -> ops, bytes, codec bytes crossing a stage boundary
        self._codec_traffic = threading.local()  # .depth: inside codec_traffic() on this thread
        self.buffer_source = None
        self.memory_source = None
        self.sources: dict[str, Callable[[], dict[str, float]]] = {}

    def declare(self, streams: Iterable[Stream]) -> None:
        """Count ``streams`` from now on (a stream already declared is kept as it is)."""
        with self._lock:
            for stream in streams:
                if self.streams.setdefault(stream.key, stream) != stream:
                    raise ValueError(f"stream {stream.key!r} declared twice, differently: {self.streams[stream.key]} "
                                     f"and {stream}")
                self._totals.setdefault(stream.key, dict.fromkeys(_SUMS, 0.0))

    def stream_key(self, place: str, direction: str) -> str:
        """The key of the declared stream of ``place`` ("pp", "tp", "dp") and ``direction`` ("forward", "backward")."""
        for key, stream in self.streams.items():
            if (stream.place, stream.direction) == (place, direction):
                return key
        raise ValueError(f"no statistics stream for place {place!r}, direction {direction!r}")

    def _check(self, key: str) -> None:
        if key not in self._totals:
            raise ValueError(f"direction must be one of the declared streams {', '.join(self.streams) or '(none)'}, "
                             f"got {key!r}")

    def record_send(self, direction: str, raw_nbytes: int, wire_nbytes: int, peer: int,
                    rel_error: float | None = None, rotated_fraction: float | None = None) -> None:
        """Count one pipeline message of ``direction`` sent by this rank to world rank ``peer``."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
        self._check(direction)
        with self._lock:
            t = self._totals[direction]
            t["messages"] += 1
            t["raw_bytes"] += int(raw_nbytes)
            t["wire_bytes"] += int(wire_nbytes)
            if rel_error is not None:  # floats or 0-d device tensors: summed without a sync (codecs.core.timing)
                t["rel_error_sum"] = timing.add(t["rel_error_sum"], rel_error)
                t["rel_error_samples"] += 1
            if rotated_fraction is not None:
                t["rotated_sum"] = timing.add(t["rotated_sum"], rotated_fraction)
                t["rotated_samples"] += 1
            if wire_nbytes < raw_nbytes:  # through a codec that compresses (not none): its bytes cross a stage
                self._wan["pipeline"]["codec_bytes"] += int(wire_nbytes)
            key = (_this_rank(), int(peer))
            self._links[key] = self._links.get(key, 0) + int(wire_nbytes)
            if rel_error is not None:
                total, samples = self._link_errors.get(key, (0.0, 0))
                self._link_errors[key] = (timing.add(total, rel_error), samples + 1)

    def record_auto(self, peer: int, codec: str, rate_bps: float | None, spread_bps: float | None) -> None:
        """An auto link end of this rank sent to world rank ``peer`` with candidate ``codec``; the last
        measured rate of that link and its spread in bit/s (None: not measured yet)."""
        with self._lock:
            self._auto[(_this_rank(), int(peer))] = {"codec": codec, "rate_bps": rate_bps, "spread_bps": spread_bps}

    def record_collective(self, place: str, direction: str, raw_nbytes: int, wire_nbytes: int,
                          rel_error: float | None = None, encode_seconds: float = 0.0,
                          decode_seconds: float = 0.0) -> None:
        """Count one compressed collective of ``place`` ("tp", "dp") run in ``direction`` on this rank."""
        key = self.stream_key(place, direction)
        with self._lock:
            t = self._totals[key]
            t["messages"] += 1
            t["raw_bytes"] += int(raw_nbytes)
            t["wire_bytes"] += int(wire_nbytes)
            if rel_error is not None:
                t["rel_error_sum"] = timing.add(t["rel_error_sum"], rel_error)
                t["rel_error_samples"] += 1
            t["encode_seconds"] = timing.add(t["encode_seconds"], encode_seconds)
            t["decode_seconds"] = timing.add(t["decode_seconds"], decode_seconds)

    def record_wan(self, category: str, nbytes: int, codec: bool = False) -> None:
        """Count one operation of this rank that crosses a pipeline-stage boundary: ``nbytes`` billed to it
        (``ledger.py`` says how); they are codec bytes when ``codec`` or sent inside ``codec_traffic()``."""
        if category not in self._wan:
            raise ValueError(f"WAN category must be one of {', '.join(WAN_CATEGORIES)}, got {category!r}")
        codec = codec or self.in_codec_traffic
        with self._lock:
            sums = self._wan[category]
            sums["ops"] += 1
            sums["bytes"] += int(nbytes)
            if codec:
                sums["codec_bytes"] += int(nbytes)

    @contextlib.contextmanager
    def codec_traffic(self) -> Iterator[None]:
        """What this thread sends inside the block is a codec's buffers (for the WAN ledger's compressed share)."""
        self._codec_traffic.depth = getattr(self._codec_traffic, "depth", 0) + 1
        try:
            yield
        finally:
            self._codec_traffic.depth -= 1

    @property
    def in_codec_traffic(self) -> bool:
        """Whether this thread is inside ``codec_traffic()``."""
        return getattr(self._codec_traffic, "depth", 0) > 0

    def record_codec_time(self, direction: str, encode_seconds: float = 0.0, decode_seconds: float = 0.0) -> None:
        """Add time spent encoding (sends) or decoding (receives) ``direction``'s messages on this rank
        (``direction``: a declared stream's key; seconds as floats or pending ``codecs.core.timing.Stopwatch`` intervals)."""
        self._check(direction)
        with self._lock:
            t = self._totals[direction]
            t["encode_seconds"] = timing.add(t["encode_seconds"], encode_seconds)
            t["decode_seconds"] = timing.add(t["decode_seconds"], decode_seconds)

    @contextlib.contextmanager
    def apart(self) -> Iterator["Stats"]:
        """Count what the block records on its own: inside it the counters start empty, so ``collect``
        there returns the block's traffic only (``saved_memory`` is not read there: the saved-tensor
        peak keeps measuring across the block). On leaving, the counters from before the block are
        added back to whatever the block left uncollected: nothing is lost or counted twice."""
        with self._lock:
            before = self._totals, self._links, self._link_errors, self._wan
            memory_source, self.memory_source = self.memory_source, None
            self._totals, self._links, self._link_errors, self._wan = _empty(self.streams), {}, {}, _empty_wan()
        try:
            yield self
        finally:
            with self._lock:
                self.memory_source = memory_source
                totals, links, link_errors, wan = before
                for category, sums in wan.items():
                    for key, value in sums.items():
                        self._wan[category][key] += value
                for stream, sums in totals.items():
                    for key, value in sums.items():
                        self._totals[stream][key] = timing.add(self._totals[stream][key], value)
                for link, nbytes in links.items():
                    self._links[link] = self._links.get(link, 0) + nbytes
                for link, (value, samples) in link_errors.items():
                    total, count = self._link_errors.get(link, (0.0, 0))
                    self._link_errors[link] = (timing.add(total, value), count + samples)

    def format_for_log(self, stats: dict, iterations: int | None = None, streams: Iterable[str] | None = None) -> str:
        """The module's ``format_for_log`` of ``stats`` with the labels of this sink's streams."""
        return format_for_log(stats, {key: stream.label for key, stream in self.streams.items()}, iterations, streams)

    def collect(self, reset: bool = True) -> dict:
        """This rank's statistics since the last reset (see the module docstring for the layout)."""
        with self._lock:
            result = {d: _summarise(self._totals[d]) for d in self.streams}
            result["links"] = dict(self._links)
            result["link_errors"] = {k: (timing.to_float(v), n) for k, (v, n) in self._link_errors.items()}
            result["auto"] = {k: dict(v) for k, v in self._auto.items()}
            result["wan"] = {category: dict(sums) for category, sums in self._wan.items()}
            result["buffer_bytes"] = int(self.buffer_source()) if self.buffer_source is not None else 0
            memory = self.memory_source(reset) if self.memory_source is not None else None
            result["saved_memory"] = {_this_rank(): {k: int(memory[k]) for k in _MEMORY}} if memory else {}
            result["places"] = {place: {name: float(value) for name, value in read().items()}
                                for place, read in self.sources.items()}
            if reset:
                self._totals, self._links, self._link_errors, self._auto = _empty(self.streams), {}, {}, {}
                self._wan = _empty_wan()
        return result


def _summarise(sums: dict) -> dict:
    sums = {key: timing.to_float(value) for key, value in sums.items()}  # the one wait for the device
    raw, wire = int(sums["raw_bytes"]), int(sums["wire_bytes"])
    err_n, rot_n = int(sums["rel_error_samples"]), int(sums["rotated_samples"])
    return {
        "messages": int(sums["messages"]),
        "raw_bytes": raw,
        "wire_bytes": wire,
        "ratio": raw / wire if wire else None,
        "rel_error": sums["rel_error_sum"] / err_n if err_n else None,
        "rotated_fraction": sums["rotated_sum"] / rot_n if rot_n else None,
        "rel_error_samples": err_n,
        "rotated_samples": rot_n,
        "encode_seconds": float(sums["encode_seconds"]),
        "decode_seconds": float(sums["decode_seconds"]),
    }


def _to_sums(summary: dict) -> dict:
    """Inverse of ``_summarise`` (means back to sums) for reductions."""
    sums = {k: float(summary[k]) for k in ("messages", "raw_bytes", "wire_bytes", "rel_error_samples",
                                           "rotated_samples", "encode_seconds", "decode_seconds")}
    sums["rel_error_sum"] = (summary["rel_error"] or 0.0) * summary["rel_error_samples"]
    sums["rotated_sum"] = (summary["rotated_fraction"] or 0.0) * summary["rotated_samples"]
    return sums


def merge(total: dict | None, more: dict) -> dict:
    """Sum two results of ``collect`` / ``reduce_to_last_rank`` (``total`` may be None); ``buffer_bytes``
    is the later one's (it is a level, not a count), ``saved_memory`` the larger peak per rank."""
    if total is None:
        return more
    result = {}
    for d in stream_keys(more):
        a, b = _to_sums(total[d]), _to_sums(more[d])
        result[d] = _summarise({k: a[k] + b[k] for k in _SUMS})
    links = dict(total["links"])
    for link, nbytes in more["links"].items():
        links[link] = links.get(link, 0) + nbytes
    result["links"] = links
    errors = dict(total.get("link_errors", {}))
    for link, (value, samples) in more.get("link_errors", {}).items():
        old_value, old_samples = errors.get(link, (0.0, 0))
        errors[link] = (old_value + value, old_samples + samples)
    result["link_errors"] = errors
    result["buffer_bytes"] = more.get("buffer_bytes", 0)
    memory = {rank: dict(peaks) for rank, peaks in total.get("saved_memory", {}).items()}
    for rank, peaks in more.get("saved_memory", {}).items():
        old = memory.get(rank)
        memory[rank] = dict(peaks) if old is None or peaks["stored_bytes"] >= old["stored_bytes"] else old
    result["saved_memory"] = memory
    result["auto"] = {**total.get("auto", {}), **more.get("auto", {})}
    result["places"] = more.get("places", {})
    wan = _empty_wan()
    for part in (total, more):
        for category, sums in (part.get("wan") or {}).items():
            for key, value in sums.items():
                wan[category][key] += value
    result["wan"] = wan
    return result


def _default_group():
    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return parallel_state.get_pipeline_model_parallel_group()
    except ImportError:
        pass
    return None


_ANSWERED: set = set()  # the groups whose statistics reduction has completed once (their start-up is over)


def reduce_to_last_rank(stats: dict, group=None, config=None) -> dict:
    """Sum ``stats`` (from ``collect``) over ``group`` (default: the pipeline group, else WORLD); with ``config``
    (a ``TahConfig``) the reduction is bounded by its ``--tah-peer-timeout-s`` (``bounded.collective_wait``).

    A collective: every rank of the group must call it. The result is valid on the group's
    last rank (where Megatron's TensorBoard/wandb writers live); other ranks get their input back.
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return stats
    group = group if group is not None else _default_group()
    size = dist.get_world_size(group)
    me = dist.get_rank(group)
    ranks = [dist.get_global_rank(group, i) if group is not None else i for i in range(size)]
    index = {g: i for i, g in enumerate(ranks)}
    streams = stream_keys(stats)  # (the same on every rank: each declares places.streams())
    scalars = [_to_sums(stats[d])[k] for d in streams for k in _SUMS] + [float(stats.get("buffer_bytes", 0))]
    links = torch.zeros(3, size * size, dtype=torch.float64)  # wire bytes, error sums, error samples
    for (src, dst), nbytes in stats["links"].items():
        if src not in index or dst not in index:
            raise ValueError(f"link {src}->{dst} is not inside the reduction group (world ranks {ranks})")
        links[0, index[src] * size + index[dst]] += nbytes
    for (src, dst), (value, samples) in stats.get("link_errors", {}).items():
        if src in index and dst in index:
            links[1:, index[src] * size + index[dst]] += torch.tensor([value, samples], dtype=torch.float64)
    links = links.reshape(-1)
    memory = torch.zeros(size * len(_MEMORY), dtype=torch.float64)  # per rank: bits, raw, stored (0: none)
    for rank, peaks in stats.get("saved_memory", {}).items():
        if rank in index:
            memory[index[rank] * len(_MEMORY):(index[rank] + 1) * len(_MEMORY)] = torch.tensor(
                [float(peaks[k]) for k in _MEMORY], dtype=torch.float64)
    auto = torch.zeros(3, size * size, dtype=torch.float64)  # per link: candidate index + 1, rate, spread
    for (src, dst), item in stats.get("auto", {}).items():
        if src in index and dst in index:
            auto[:, index[src] * size + index[dst]] = torch.tensor(
                [CANDIDATES.index(item["codec"]) + 1, item["rate_bps"] or 0.0, item["spread_bps"] or 0.0])
    wan = stats.get("wan") or _empty_wan()
    ledger = torch.tensor([float(wan[c][k]) for c in WAN_CATEGORIES for k in _WAN_SUMS], dtype=torch.float64)
    own = stats.get("places", {})  # (the same places and names on every rank)
    levels = torch.tensor([value for values in own.values() for value in values.values()], dtype=torch.float64)
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    packed = torch.cat([torch.tensor(scalars, dtype=torch.float64), links, memory, auto.reshape(-1), ledger,
                        levels]).to(device)
    last = ranks[-1]
    work = dist.reduce(packed, dst=last, op=dist.ReduceOp.SUM, group=group, async_op=True)
    if config is None:
        work.wait()
    else:
        collective_wait(config, group, _ANSWERED, "statistics ")(work, "reduction to the last stage")
    if me != size - 1:
        return stats
    packed = packed.cpu()
    n = len(_SUMS)
    result = {d: _summarise(dict(zip(_SUMS, packed[i * n:(i + 1) * n].tolist())))
              for i, d in enumerate(streams)}
    result["buffer_bytes"] = int(packed[len(scalars) - 1])
    matrix, error_sums, samples = packed[len(scalars):len(scalars) + 3 * size * size].reshape(3, size, size)
    result["links"] = {(ranks[s], ranks[t]): int(matrix[s, t]) for s, t in matrix.nonzero().tolist()}
    result["link_errors"] = {(ranks[s], ranks[t]): (float(error_sums[s, t]), int(samples[s, t]))
                             for s, t in samples.nonzero().tolist()}
    start = len(scalars) + 3 * size * size
    peaks = packed[start:start + size * len(_MEMORY)].reshape(size, len(_MEMORY)).tolist()
    result["saved_memory"] = {ranks[i]: dict(zip(_MEMORY, map(int, row))) for i, row in enumerate(peaks) if row[0]}
    start += size * len(_MEMORY)
    codec, rate, spread = packed[start:start + 3 * size * size].reshape(3, size, size)
    result["auto"] = {(ranks[s], ranks[t]): {"codec": CANDIDATES[int(codec[s, t]) - 1],
                                             "rate_bps": float(rate[s, t]) or None,
                                             "spread_bps": float(spread[s, t]) if rate[s, t] else None}
                      for s, t in codec.nonzero().tolist()}
    start += 3 * size * size
    rows = packed[start:start + len(ledger)].reshape(len(WAN_CATEGORIES), len(_WAN_SUMS)).tolist()
    result["wan"] = {c: {k: int(v) for k, v in zip(_WAN_SUMS, row)} for c, row in zip(WAN_CATEGORIES, rows)}
    summed = iter(packed[start + len(ledger):].tolist())
    result["places"] = {place: {name: next(summed) for name in values} for place, values in own.items()}
    return result


def link_rel_errors(stats: dict) -> dict[str, float]:
    """Mean sampled round-trip error per pipeline link, ``{"src->dst": error}`` (world ranks; links
    without a sample are left out)."""
    return {f"{src}->{dst}": value / samples
            for (src, dst), (value, samples) in sorted(stats.get("link_errors", {}).items()) if samples}


def format_for_log(stats: dict, labels: dict[str, str], iterations: int | None = None,
                   streams: Iterable[str] | None = None) -> str:
    """Megatron-style fragment of ``streams`` (stream keys; None: every stream of ``stats``) with messages,
    each named by its label in ``labels`` (stream key -> label; ``Stats.format_for_log`` gives its streams'; MB =
    1e6 wire bytes).

    ``iterations``: the training iterations ``stats`` cover; the counts are divided by it, as Megatron's own
    items are (`` tah fwd MB/iter: 1.234 | tah fwd ratio: 3.62x | ... | tah codec ms/iter: 2.0 |``).
    None: the totals (`` tah fwd MB: ... | tah codec ms: ...``, e.g. an evaluation's).
    ``wan MB`` (first, when anything crossed a stage boundary) is the WAN ledger's bytes, all categories, and
    ``wan compressed`` the share of them that went through a codec (``wan`` in the module docstring).
    ``tah codec ms`` is encode + decode time summed over the ranks reduced (not a critical path);
    ``tah buffer MB`` (a level) appears when a per-sample buffer (AQ-SGD) holds data, ``tah saved MB`` (peak
    bytes saved for backward, as stored / as they would have been, summed over stages) with LAAQ; ``tah <place>
    <name>`` each non-zero level a place's ``statistics`` hook reports (``places``).
    """
    if iterations is not None and iterations < 1:
        raise ValueError(f"iterations must be >= 1 (or None for totals), got {iterations}")
    per, unit = (iterations, "/iter") if iterations is not None else (1, "")
    streams = stream_keys(stats) if streams is None else streams
    shown = [d for d in streams if stats[d]["messages"]]
    parts = []
    wan, codec = wan_totals(stats)
    if wan:
        parts.append(f"wan MB{unit}: {wan / per / 1e6:.3f}")
        parts.append(f"wan compressed: {100 * codec / wan:.1f}%")
    for d in shown:
        s, short = stats[d], labels[d]
        parts.append(f"tah {short} MB{unit}: {s['wire_bytes'] / per / 1e6:.3f}")
        parts.append(f"tah {short} ratio: {s['ratio']:.2f}x")
        if s["rel_error"] is not None:
            parts.append(f"tah {short} rel err: {s['rel_error']:.1E}")
        if s["rotated_fraction"] is not None:
            parts.append(f"tah {short} rotated: {s['rotated_fraction']:.3f}")
    codec_seconds = sum(stats[d].get("encode_seconds", 0.0) + stats[d].get("decode_seconds", 0.0) for d in shown)
    if codec_seconds:
        parts.append(f"tah codec ms{unit}: {codec_seconds / per * 1e3:.1f}")
    if stats.get("buffer_bytes"):
        parts.append(f"tah buffer MB: {stats['buffer_bytes'] / 1e6:.1f}")
    for (src, dst), item in sorted(stats.get("auto", {}).items()):
        rate = "rate not measured yet" if item["rate_bps"] is None else f"{item['rate_bps'] / 1e6:.4g} Mbit/s"
        parts.append(f"tah auto {src}->{dst}: {item['codec']} at {rate}")
    memory = stats.get("saved_memory") or {}
    if memory:
        stored = sum(m["stored_bytes"] for m in memory.values()) / 1e6
        raw = sum(m["raw_bytes"] for m in memory.values()) / 1e6
        parts.append(f"tah saved MB: {stored:.1f}/{raw:.1f}")
    parts += [f"tah {place} {name}: {value:.4g}" for place, values in stats.get("places", {}).items()
              for name, value in values.items() if value]
    return "".join(f" {p} |" for p in parts)
