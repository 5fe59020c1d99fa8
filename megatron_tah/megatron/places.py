"""The places megatron_tah compresses, and the one installer of all of them (``megatron_tah.install``).

=====================  ================================  ===============================================
place                  option (``TahConfig``)            what it replaces (module)
=====================  ================================  ===============================================
``pp`` (TAH-Quant)     always; codecs ``tah_forward_*``  pipeline p2p transports (``pipeline_parallel``)
                       and ``tah_backward_*``
``tp`` (TACO)          ``tah_tp_codec``: fp8             tensor-parallel collectives (``tensor_parallel``)
``dp`` (QuanGrad)      ``tah_dp_codec``: int8            gradient reduction (``data_parallel``)
``activation_memory``  ``tah_activation_memory``: laaq   tensors saved for backward (``activation_memory``)
=====================  ================================  ===============================================

``install(config, **overrides)`` applies the CPU shims when CUDA is absent (``cpu_shims``), then
checks that every rank was given the same settings for the collective places: when
``torch.distributed`` is initialised it all-gathers each rank's ``settings`` over the default group
(every rank that installs takes part, whatever its settings) and raises :class:`PlaceMismatchError`
on every rank if any differ, naming them, instead of letting one rank wait in a collective the
others never join (the pipeline checks its neighbours itself, per group: ``handshake``). It then
builds one :class:`Place` per place that is on and lets the place's module install its patches
into ``place.patches``. A place that is off installs nothing, so megatron-core's own code runs
unchanged. Everything installed is recorded in ``registry.REGISTRY`` (``config``, ``places``);
``uninstall()`` restores every patch exactly, newest first. Installing the same configuration
again is a no-op; another configuration replaces every place (fresh codecs, counters, queues).

How to add a place:

1. its option: a ``TahConfig`` field (``"none"``: off) and, with a codec, a ``TahConfig`` method
   building it (``config.py``; the ``--tah-*`` flag follows from the field);
2. a module here with ``install(place)`` that replaces megatron-core functions only through
   ``place.patches`` and counts traffic with ``place.record`` (optionally ``uninstall(place)``,
   run before the patches are restored); tests in ``tests/test_<module>.py``;
3. a row in ``PLACES`` below, its streams in ``stats.STREAMS`` and its entry in ``settings``.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import logging
from typing import Any

import torch

from ..codecs import Codec
from ..codecs.graphs import GraphedCodec, eager
from ..config import TahConfig
from . import cpu_shims
from .collectives import Traffic
from .patching import Patches
from .registry import REGISTRY
from .stats import Stats

logger = logging.getLogger(__name__)

# place -> (module under megatron_tah.megatron, TahConfig field that turns it on (None: always on),
#           TahConfig method that builds its codec (None: the module builds its own))
PLACES = {
    "pp": ("pipeline_parallel", None, None),
    "tp": ("tensor_parallel", "tah_tp_codec", "tp_codec"),
    "dp": ("data_parallel", "tah_dp_codec", "dp_codec"),
    "activation_memory": ("activation_memory", "tah_activation_memory", None),
}


def direction() -> str:
    """"backward" while autograd runs a backward pass on this thread (its graph task), else "forward"."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    if task is None:  # a torch without it: backward functions run with gradients off
        return "forward" if torch.is_grad_enabled() else "backward"
    return "backward" if task() != -1 else "forward"


class PlaceMismatchError(RuntimeError):
    """Ranks were given different settings for a place whose traffic they share."""


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
    transport: Any = None  # the object the patches call into, when not the place (pp: PipelineTransport)

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

    def record(self, direction: str, traffic: Traffic, rel_error: float | None = None) -> None:
        """Count one collective of ``direction`` in the statistics (stream ``<place>_<direction>``)."""
        self.calls[direction] += 1
        self.stats.record_collective(self.name, direction, traffic.raw_nbytes, traffic.wire_nbytes, rel_error,
                                     traffic.encode_seconds, traffic.decode_seconds)


def settings(config: TahConfig) -> dict[str, str]:
    """Each collective place's settings as text ("none" when off): what ranks must agree on."""
    laaq = "none"
    if config.tah_activation_memory != "none":
        laaq = (f"{config.tah_activation_memory}(bits={config.tah_laaq_bits}, "
                f"block_size={config.tah_laaq_block_size})")
    tp, dp = config.tp_codec(), config.dp_codec()
    return {"tp": tp.describe() if tp else "none", "dp": dp.describe() if dp else "none", "activation_memory": laaq}


def check_ranks_agree(config: TahConfig, group=None) -> None:
    """Raise PlaceMismatchError on every rank of ``group`` (default: all) unless all have the same settings."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return
    mine = settings(config)
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    differing = sorted({place for record in everyone for place in mine if record[place] != mine[place]})
    if not differing and all(record == everyone[0] for record in everyone):
        return
    places = differing or sorted(mine)
    lines = "; ".join(f"rank {r}: " + ", ".join(f"{p}={record[p]}" for p in places) for r, record in enumerate(everyone))
    raise PlaceMismatchError(
        f"megatron_tah: ranks were given different settings for {', '.join(places)} ({lines}). "
        "Every rank must run with the same --tah-* flags (TahConfig).")


def _config(config: TahConfig | None, overrides: dict) -> TahConfig:
    config = config if config is not None else TahConfig()
    if not overrides:
        return config
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(TahConfig)})
    if unknown:
        raise ValueError(f"megatron_tah.install: unknown option(s) {unknown}; options are TahConfig fields "
                         f"such as tah_forward_codec, tah_backward_codec")
    return dataclasses.replace(config, **overrides)


def install(config: TahConfig | None = None, **overrides) -> None:
    """Install every place that ``config`` (default ``TahConfig()``, with ``overrides``: TahConfig
    fields) turns on -- the pipeline always -- after checking that ranks agree (idempotent)."""
    config = _config(config, overrides)
    if REGISTRY.config is not None and REGISTRY.config == config:
        return
    cpu_shims.hold_cpu_shims("install")
    _remove_places()
    try:
        check_ranks_agree(config)
        for name, (module_name, option, make_codec) in PLACES.items():
            if option is not None and getattr(config, option) == "none":
                continue
            codec = getattr(config, make_codec)() if make_codec else None
            place = Place(name, config, codec, stats=REGISTRY.stats)
            REGISTRY.places[name] = place
            importlib.import_module(f"{__package__}.{module_name}").install(place)
            if name in settings(config):
                logger.info("megatron_tah: %s compressed (%s)", name, settings(config)[name])
    except Exception:
        uninstall()
        raise
    REGISTRY.config = config


def _remove_places() -> None:
    for name in reversed(list(REGISTRY.places)):
        place = REGISTRY.places.pop(name)
        finish = getattr(importlib.import_module(f"{__package__}.{PLACES[name][0]}"), "uninstall", None)
        if finish is not None:
            finish(place)
        place.patches.restore()
    REGISTRY.config = None


def uninstall() -> None:
    """Restore everything ``install`` replaced, CPU shims included (no-op when nothing is installed)."""
    _remove_places()
    cpu_shims.release_cpu_shims("install")


def installed(name: str) -> Place | None:
    """The installed :class:`Place` called ``name`` (None when that place is off)."""
    return REGISTRY.places.get(name)
