"""The places megatron_tah compresses, and the one installer of all of them (``megatron_tah.install``).

=====================  ================================  ===============================================
place                  option (``TahConfig``)            what it replaces (module)
=====================  ================================  ===============================================
``pp`` (TAH-Quant)     always; codecs ``tah_forward_*``  pipeline p2p transports (``pipeline_parallel``)
                       and ``tah_backward_*``
``tp`` (TACO)          ``tah_tp_codec``: fp8             tensor-parallel collectives (``tensor_parallel``)
``dp`` (QuanGrad)      ``tah_dp_codec``: int8            gradient reduction (``data_parallel``)
``embedding``          ``tah_embedding_codec``: int8     tied word-embedding gradient all-reduce (``embedding``)
``activation_memory``  ``tah_activation_memory``: laaq   tensors saved for backward (``activation_memory``)
``wan`` (ledger)       always                            counts bytes that cross a stage (``ledger``)
=====================  ================================  ===============================================

Each place declares itself at the end of its module (``PLACE``, a ``place_spec.PlaceSpec``: its option,
codec, statistics, settings text, install and uninstall, and its hooks); ``PLACES`` is the table of those
declarations, in install order, and ``streams()`` their statistics streams (``STREAMS``: the table's at
import, for a sink built outside ``install``). The ledger comes last: the
other places patch megatron-core's functions as they found them (``Patches.wrap`` leaves a function that
is already ours alone, so a counting function in front would keep a place out), and what they send goes
through ``torch.distributed``, looked up at call time, where the ledger counts it.

The places' hooks run here, for every place in ``PLACES``, on or off: ``check(config)`` (each place's
``validate``: its codec, then its own ``check``; the flags' validation runs it through
``arguments.tah_config_from_args``, and ``install`` before anything is installed), ``check_args(config,
args)`` (Megatron's parsed arguments, from the flags' validation hook) and ``startup_lines(config, args)``
(printed once by the plugin after Megatron's initialization). An installed place's ``statistics`` hook is
the statistics sink's source under its name (``Stats.sources``).

``install(config, **overrides)`` applies the CPU shims when CUDA is absent (``cpu_shims``), runs
``check(config)``, then checks that every rank was given the same settings for the collective places: when
``torch.distributed`` is initialised it all-gathers each rank's ``settings`` over the default group
(every rank that installs takes part, whatever its settings) and raises :class:`PlaceMismatchError`
on every rank if any differ, naming them, instead of letting one rank wait in a collective the
others never join (the pipeline checks its neighbours itself, per group: ``link/handshake.py``). It
then builds one :class:`place_spec.Place` per place that is on and lets the place install its patches
into ``place.patches``. A place that is off installs nothing, so megatron-core's own code runs
unchanged. Everything installed is recorded in ``registry.REGISTRY`` (``config``, ``places``);
``uninstall()`` restores every patch exactly, newest first. Installing the same configuration
again is a no-op; another configuration replaces every place (fresh codecs, counters, queues).

How to add a place:

1. a module here with ``install(place)`` that replaces megatron-core functions only through
   ``place.patches`` and counts traffic with ``place.record`` (optionally ``uninstall(place)``), its codec
   builder, checks and start-up lines, ending with its ``PLACE = PlaceSpec(...)``; tests in
   ``tests/megatron/test_<module>.py``;
2. its ``PLACE`` in ``PLACES`` below;
3. with an option: its ``TahConfig`` field (``"none"``: off; its choices in the field's metadata), from
   which the ``--tah-*`` flag follows.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import torch

from ..config import TahConfig
from . import activation_memory, cpu_shims, data_parallel, embedding, ledger, pipeline_parallel, tensor_parallel
from .place_spec import Place, PlaceSpec
from .registry import REGISTRY
from .stats import Stream

logger = logging.getLogger(__name__)

PLACES: dict[str, PlaceSpec] = {spec.name: spec for spec in (
    pipeline_parallel.PLACE, tensor_parallel.PLACE, data_parallel.PLACE, embedding.PLACE, activation_memory.PLACE,
    ledger.PLACE)}


def streams() -> tuple[Stream, ...]:
    """Every place's statistics streams, in ``PLACES`` order (what ``REGISTRY.stats`` counts)."""
    return tuple(stream for spec in PLACES.values() for stream in spec.streams)


STREAMS = streams()
"""The streams of the places in ``PLACES`` at import (``streams()`` reads the table as it is now)."""

__all__ = ["PLACES", "STREAMS", "Place", "PlaceMismatchError", "check", "check_args", "check_ranks_agree", "install",
           "installed", "settings", "startup_lines", "streams", "uninstall"]


class PlaceMismatchError(RuntimeError):
    """Ranks were given different settings for a place whose traffic they share."""


def settings(config: TahConfig) -> dict[str, str]:
    """Each collective place's settings as text ("none" when off): what ranks must agree on."""
    return {name: spec.settings(config) if spec.is_on(config) else "none"
            for name, spec in PLACES.items() if spec.settings is not None}


def check(config: TahConfig) -> None:
    """Every place's ``validate(config)``: ``ValueError`` naming the field and value of what cannot run."""
    for spec in PLACES.values():
        spec.validate(config)


def check_args(config: TahConfig, args: Any) -> None:
    """Every place's ``check_args`` against Megatron's parsed ``args``: ``ValueError`` naming the flags."""
    for spec in PLACES.values():
        if spec.check_args is not None:
            spec.check_args(config, args)


def startup_lines(config: TahConfig, args: Any) -> list[str]:
    """The start-up lines of a run with ``config`` and Megatron's ``args``: the always-on places' own lines, one
    line naming the places the flags turned on (``settings``), then the other places' own lines."""
    def own(always: bool) -> list[str]:
        return [line for spec in PLACES.values() if spec.startup is not None and (spec.option is None) == always
                for line in spec.startup(config, args)]

    on = {place: value for place, value in settings(config).items() if value != "none"}
    summary = ["> megatron_tah: " + ", ".join(f"{place} via {value}" for place, value in on.items())] if on else []
    return own(True) + summary + own(False)


def check_ranks_agree(config: TahConfig, group=None) -> None:
    """Raise PlaceMismatchError on every rank of ``group`` (default: all) unless all have the same settings.

    The settings travel as JSON bytes in two all-gathers (lengths, then the padded bytes), each waited within
    ``--tah-peer-timeout-s`` plus ``--tah-peer-start-up-s`` (the run's first collective: a peer may still be
    importing; ``bounded.collective_wait``), so a rank that never arrives ends the others' wait with
    ``PeerTimeoutError`` naming it."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return
    mine = settings(config)
    everyone = _gather_json(config, mine, group)
    differing = sorted({place for record in everyone for place in mine if record[place] != mine[place]})
    if not differing and all(record == everyone[0] for record in everyone):
        return
    places = differing or sorted(mine)
    lines = "; ".join(f"rank {r}: " + ", ".join(f"{p}={record[p]}" for p in places) for r, record in enumerate(everyone))
    raise PlaceMismatchError(
        f"megatron_tah: ranks were given different settings for {', '.join(places)} ({lines}). "
        "Every rank must run with the same --tah-* flags (TahConfig).")


def _gather_json(config: TahConfig, record: dict, group) -> list[dict]:
    """Every rank's ``record`` (JSON-serializable) in group order, through bounded all-gathers."""
    import json

    from .bounded import collective_wait

    dist = torch.distributed
    device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
              else torch.device("cpu"))
    wait = collective_wait(config, group, prefix="settings check ")
    data = json.dumps(record, sort_keys=True).encode()
    world = dist.get_world_size(group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    wait(dist.all_gather(lengths, length, group=group, async_op=True), "lengths all-gather")
    sizes = [int(n) for n in lengths]
    buf = torch.zeros(max(sizes), dtype=torch.uint8)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.empty(max(sizes), dtype=torch.uint8, device=device) for _ in range(world)]
    wait(dist.all_gather(bufs, buf.to(device), group=group, async_op=True), "all-gather")
    return [json.loads(bytes(b[:n].cpu().tolist())) for b, n in zip(bufs, sizes)]


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
    REGISTRY.stats.declare(streams())
    try:
        check(config)
        check_ranks_agree(config)
        for name, spec in PLACES.items():
            if not spec.is_on(config):
                continue
            place = Place(name, config, spec.codec(config) if spec.codec else None, stats=REGISTRY.stats)
            REGISTRY.places[name] = place
            spec.install(place)
            if spec.statistics is not None:
                REGISTRY.stats.sources[name] = functools.partial(spec.statistics, place)
            if spec.settings is not None:
                logger.info("megatron_tah: %s compressed (%s)", name, spec.settings(config))
    except Exception:
        uninstall()
        raise
    REGISTRY.config = config


def _remove_places() -> None:
    """Every place removed and its patches restored, even when a place's ``uninstall`` raises (the pipeline's,
    whose last sends cannot be delivered: a peer gone); the first such error is raised once all are removed."""
    error = None
    for name in reversed(list(REGISTRY.places)):
        place = REGISTRY.places.pop(name)
        REGISTRY.stats.sources.pop(name, None)
        try:
            if PLACES[name].uninstall is not None:
                PLACES[name].uninstall(place)
        except Exception as err:  # noqa: BLE001 (raised below, once every place is removed)
            error = error or err
        finally:
            place.patches.restore()
    REGISTRY.config = None
    if error is not None:
        raise error


def uninstall() -> None:
    """Restore everything ``install`` replaced, CPU shims included (no-op when nothing is installed)."""
    _remove_places()
    cpu_shims.release_cpu_shims("install")


def installed(name: str) -> Place | None:
    """The installed :class:`place_spec.Place` called ``name`` (None when that place is off)."""
    return REGISTRY.places.get(name)
