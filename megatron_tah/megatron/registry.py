"""What megatron_tah has installed in this process: ``REGISTRY``, the one mutable object of
``megatron_tah.megatron``.

Every installer records here what it replaced (each in its own ``Patches``), and every reader --
statistics, the training log, the codec checkpoints -- finds the installed state here; no other
module of this package keeps state. ``places.install`` / ``places.uninstall`` fill and empty
``config`` and ``places``; the plugin, the flags, the log and the CPU shims own the other fields.
It knows no particular place (the pipeline's transport: ``pipeline_parallel.installed_transport()``).
This module imports nothing of megatron-core and nothing above it in the package
(``patching``, ``place_spec`` and ``stats`` only), so any module may import it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from .patching import Patches
from .stats import Stats

if TYPE_CHECKING:
    from ..config import TahConfig
    from .place_spec import Place


@dataclasses.dataclass
class Registry:
    config: TahConfig | None = None
    """The configuration ``megatron_tah.install`` was given (None: not installed)."""
    places: dict[str, Place] = dataclasses.field(default_factory=dict)
    """Installed places by name, in install order; each owns its patches."""
    stats: Stats = dataclasses.field(default_factory=Stats)
    """The statistics sink every place records into; the training log collects it (its streams are
    declared by ``places.install`` and the log's install: ``places.streams()``)."""
    cpu_shims: Patches = dataclasses.field(default_factory=Patches)
    """The CPU shims' replacements (``cpu_shims.py``), whoever applied them."""
    cpu_shim_holders: set[str] = dataclasses.field(default_factory=set)
    """Who holds the shims (``"install"``, ``"plugin"``); they go when the last one releases them.
    Empty while shims are active: applied by a caller of ``cpu_shims.apply_cpu_shims``, theirs."""
    arguments: Patches = dataclasses.field(default_factory=Patches)
    """The ``--tah-*`` flags on Megatron's parser and validation (``arguments.py``)."""
    logging: Patches = dataclasses.field(default_factory=Patches)
    """The statistics in Megatron's training log (``run_log.py``)."""
    log: Any = None
    """The training log's pending counters and evaluations (``logging.LogState``) while installed."""
    plugin: Patches = dataclasses.field(default_factory=Patches)
    """The plugin's other hooks: initialization, codec checkpoints, dataset helpers (``plugin.py``)."""
    plugin_installed_places: bool = False
    """Whether the plugin's initialization hook ran ``megatron_tah.install`` (its uninstall undoes it)."""
    bounded_groups: float | None = None
    """The timeout (seconds) ``peer_timeout.py`` gave the process groups after the first training step (None:
    Megatron's own timeouts)."""


REGISTRY = Registry()
