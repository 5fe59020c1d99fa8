"""A place megatron_tah compresses: its declaration (``PlaceSpec``) and what it has installed (``Place``).

Every place module (``pipeline_parallel``, ``tensor_parallel``, ``data_parallel``, ``embedding``,
``activation_memory``, ``ledger``) ends with one ``PLACE = PlaceSpec(...)``, as every codec file starts with
its ``DECLARATION``: the ``TahConfig`` field that turns it on, how its codec is built, its statistics, the
settings text ranks must agree on, its install / uninstall, and its own hooks -- its checks of the
configuration and of Megatron's arguments, its start-up lines. ``places.py`` builds its table from those
declarations, runs their hooks (the flags' validation and the plugin's start-up call it) and makes one
:class:`Place` per place that is on.

``direction()`` tells a place's patches whether they run in the forward or the backward pass.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable

import torch

from ..codecs import Codec, CodecError, codec_declaration
from ..codecs.core.graphs import GraphedCodec, eager
from ..config import TahConfig
from .bounded import collective_wait
from .collectives import Traffic
from .patching import Patches
from .stats import Stats, Stream


def direction() -> str:
    """"backward" while autograd runs a backward pass on this thread (its graph task), else "forward"."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    if task is None:  # a torch without it: backward functions run with gradients off
        return "forward" if torch.is_grad_enabled() else "backward"
    return "backward" if task() != -1 else "forward"


@dataclasses.dataclass(frozen=True)
class PlaceSpec:
    """What a place declares about itself (one per place module, ``PLACE``).

    ``name``: the place ("pp", "tp", ...). ``option``: the ``TahConfig`` field that turns it on (its value
    ``"none"``: off), None: always on. ``codec``: builds the place's codec from the config (None: the
    module builds its own). ``streams``: its statistics streams (the log line's columns). ``settings``: the
    text of its settings, which every rank must share (None: the place checks its peers itself, as the
    pipeline does). ``install(place)`` replaces megatron-core functions through ``place.patches`` only;
    ``uninstall(place)``, if any, runs before those patches are restored.

    Its hooks, each optional (``places.py`` runs the first three for every place, on or off):

    * ``check(config)``: raise ``ValueError`` naming the field and value when ``config`` cannot run the place
      (no Megatron needed; ``validate`` runs it after the checks of the place's codec);
    * ``check_args(config, args)``: raise ``ValueError`` (one line, naming the flags) when Megatron's parsed
      arguments leave the place nothing to do or go around it; run while Megatron validates its arguments;
    * ``startup(config, args)``: the lines printed once at start-up (warnings, what the place does);
    * ``statistics(place)``: an installed place's own levels, ``{name: value}`` with the same names on every
      rank, read whenever the statistics are collected and summed over the pipeline's ranks (the log line's
      ``tah <place> <name>``, the JSON record's ``places``).
    """

    name: str
    option: str | None
    install: Callable[["Place"], None]
    codec: Callable[[TahConfig], Codec | None] | None = None
    streams: tuple[Stream, ...] = ()
    settings: Callable[[TahConfig], str] | None = None
    uninstall: Callable[["Place"], None] | None = None
    check: Callable[[TahConfig], None] | None = None
    check_args: Callable[[TahConfig, Any], None] | None = None
    startup: Callable[[TahConfig, Any], list[str]] | None = None
    statistics: Callable[["Place"], dict[str, float]] | None = None

    def __post_init__(self):
        for stream in self.streams:
            if stream.place != self.name:
                raise ValueError(f"place {self.name!r}: stream {stream.key!r} counts place {stream.place!r}")

    def is_on(self, config: TahConfig) -> bool:
        return self.option is None or getattr(config, self.option) != "none"

    def validate(self, config: TahConfig) -> None:
        """``ValueError`` naming the field and value when ``config`` cannot run this place: its codec, when on,
        must build and, with ``tah_backend = 'triton'``, have a kernel; then the place's own ``check``. Its option
        must be a field of ``config`` (a ``TahConfig``: its field line declares the option's values)."""
        if self.option is not None and self.option not in {f.name for f in dataclasses.fields(config)}:
            raise ValueError(f"place {self.name!r}: option = {self.option!r} is not a field of {type(config).__name__}")
        if self.codec is not None and self.is_on(config):
            name = getattr(config, self.option)
            try:
                codec = self.codec(config)
            except CodecError as err:
                raise ValueError(f"{self.option} = {name!r}: {err}") from None
            if config.tah_backend == "triton" and not codec_declaration(codec.name).kernel:
                raise ValueError(f"tah_backend = 'triton' with {self.option} = {name!r}: it has no Triton kernel; "
                                 "use auto or torch")
        if self.check is not None:
            self.check(config)


@dataclasses.dataclass
class Place:
    """What one place has installed: its configuration, codec, patches, statistics sink and counters."""

    name: str
    config: TahConfig
    codec: Codec | GraphedCodec | None  # tp, dp: the collectives' codec (``graphs.place_codec``)
    patches: Patches = dataclasses.field(default_factory=Patches)
    stats: Stats = dataclasses.field(default_factory=Stats)  # installed places: REGISTRY.stats
    calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    state: dict = dataclasses.field(default_factory=dict)  # whatever the place's module keeps
    transport: Any = None  # the object the patches call into, when not the place (pp: the link's transport)

    def measure(self, direction: str, x: torch.Tensor) -> float | None:
        """On every ``tah_error_sample_interval``-th collective of ``direction``: the codec's relative
        round-trip error on ``x`` (this rank's input, before the collective); otherwise None."""
        interval = self.config.tah_error_sample_interval
        if not interval or self.calls[direction] % interval:
            return None
        with torch.no_grad():
            x = x.detach().float()
            norm = x.norm()
            codec = eager(self.codec)  # a sample: not worth graphs of its own
            y = codec.decode(codec.encode(x), x.shape, x.dtype)
            return float((x - y).norm() / norm) if norm > 0 else 0.0

    def wait(self, group, what: str):
        """The bounded ``wait(work, what)`` of this place's collectives on ``group`` (``bounded.collective_wait``;
        ``what``: the place in the error, e.g. "data-parallel int8 ")."""
        return collective_wait(self.config, group, self.state.setdefault("answered", set()), what)

    def record(self, direction: str, traffic: Traffic, rel_error: float | None = None) -> None:
        """Count one collective of ``direction`` in the statistics (stream ``<place>_<direction>``)."""
        self.calls[direction] += 1
        self.stats.record_collective(self.name, direction, traffic.raw_nbytes, traffic.wire_nbytes, rel_error,
                                     traffic.encode_seconds, traffic.decode_seconds)
