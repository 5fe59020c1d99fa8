"""The megatron-core patch layer: the places megatron_tah compresses (``places.py``: the pipeline's
p2p transports ``pipeline_parallel.py``, which puts the link's transport in megatron-core's place,
tensor- and data-parallel collectives, activation memory), the Megatron-LM plugin (flags, training
log, codec checkpoints, CPU shims, several ranks per GPU); what is installed is in ``registry.REGISTRY``.

Submodules import megatron-core lazily (only when a function that needs it runs).
"""

from __future__ import annotations


def install(config=None, **overrides) -> None:
    from .places import install as _install

    _install(config, **overrides)


def uninstall() -> None:
    from .places import uninstall as _uninstall

    _uninstall()


__all__ = ["install", "uninstall"]
