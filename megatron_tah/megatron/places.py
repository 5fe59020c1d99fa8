"""The compression places beyond the pipeline, and the one object that owns each of them.

=====================  ================================  =========================================
place                  option (``TahConfig``)            what it replaces (module)
=====================  ================================  =========================================
``tp`` (TACO)          ``tah_tp_codec``: fp8             tensor-parallel collectives (``tensor_parallel``)
``dp`` (QuanGrad)      ``tah_dp_codec``: int8            gradient reduction (``data_parallel``)
``activation_memory``  ``tah_activation_memory``: laaq   tensors saved for backward (``activation_memory``)
=====================  ================================  =========================================

``install(config)`` -- called by ``megatron_tah.install`` after the pipeline transports -- first
checks that every rank was given the same settings for these places: when ``torch.distributed``
is initialised it all-gathers each rank's settings over the default group (every rank that
installs takes part, whatever its settings) and raises :class:`PlaceMismatchError` on every
rank if any differ, naming them, instead of letting one rank wait in a collective the others
never join. It then builds one :class:`Place` per place whose option is on and lets the place's
module install its patches into ``place.patches``. A place that is off installs nothing, so
megatron-core's own code runs unchanged. ``uninstall()`` restores every patch exactly.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import logging

import torch

from ..codecs import Codec
from ..config import TahConfig
from . import stats
from .collectives import Traffic
from .patching import Patches

logger = logging.getLogger(__name__)

# place -> (module under megatron_tah.megatron, TahConfig field that turns it on)
PLACES = {
    "tp": ("tensor_parallel", "tah_tp_codec"),
    "dp": ("data_parallel", "tah_dp_codec"),
    "activation_memory": ("activation_memory", "tah_activation_memory"),
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
    """What one place has installed: its configuration, codec, patches and message counters."""

    name: str
    config: TahConfig
    codec: Codec | None
    patches: Patches = dataclasses.field(default_factory=Patches)
    calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    state: dict = dataclasses.field(default_factory=dict)  # whatever the place's module keeps

    def measure(self, direction: str, x: torch.Tensor) -> float | None:
        """On every ``tah_error_sample_interval``-th collective of ``direction``: the codec's relative
        round-trip error on ``x`` (this rank's input, before the collective); otherwise None."""
        interval = self.config.tah_error_sample_interval
        if not interval or self.calls[direction] % interval:
            return None
        with torch.no_grad():
            x = x.detach().float()
            norm = x.norm()
            y = self.codec.decode(self.codec.encode(x), x.shape, x.dtype)
            return float((x - y).norm() / norm) if norm > 0 else 0.0

    def record(self, direction: str, traffic: Traffic, rel_error: float | None = None) -> None:
        """Count one collective of ``direction`` in the statistics (stream ``<place>_<direction>``)."""
        self.calls[direction] += 1
        stats.record_collective(self.name, direction, traffic.raw_nbytes, traffic.wire_nbytes, rel_error,
                                traffic.encode_seconds, traffic.decode_seconds)


_INSTALLED: dict[str, Place] = {}
_CONFIG: list = [None]  # the config the installed places came from


def settings(config: TahConfig) -> dict[str, str]:
    """Each place's settings as text ("none" when off): what ranks must agree on."""
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


def install(config: TahConfig) -> None:
    """Check that ranks agree, then install every place that ``config`` turns on (idempotent)."""
    if _CONFIG[0] is not None and _CONFIG[0] == config:
        return
    uninstall()
    check_ranks_agree(config)
    codecs = {"tp": config.tp_codec(), "dp": config.dp_codec(), "activation_memory": None}
    try:
        for name, (module_name, field) in PLACES.items():
            if getattr(config, field) == "none":
                continue
            place = Place(name, config, codecs[name])
            _INSTALLED[name] = place
            importlib.import_module(f"{__package__}.{module_name}").install(place)
            logger.info("megatron_tah: %s compressed (%s)", name, settings(config)[name])
    except Exception:
        uninstall()
        raise
    _CONFIG[0] = config


def uninstall() -> None:
    """Restore everything the places replaced (no-op when nothing is installed)."""
    for name in reversed(list(_INSTALLED)):
        place = _INSTALLED.pop(name)
        module_name = PLACES[name][0]
        finish = getattr(importlib.import_module(f"{__package__}.{module_name}"), "uninstall", None)
        if finish is not None:
            finish(place)
        place.patches.restore()
    _CONFIG[0] = None


def installed(name: str) -> Place | None:
    """The installed :class:`Place` called ``name`` (None when that place is off)."""
    return _INSTALLED.get(name)
