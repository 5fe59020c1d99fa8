"""The megatron-core patch layer: compressing p2p transports, the tensor-parallel, data-parallel and
activation-memory places (``places.py``), CPU shims, statistics, link emulation.

Submodules import megatron-core lazily (only when a function that needs it runs).
"""

from __future__ import annotations


def install(config=None, **overrides) -> None:
    from .patch import install as _install

    _install(config, **overrides)


def uninstall() -> None:
    from .patch import uninstall as _uninstall

    _uninstall()


__all__ = ["install", "uninstall"]
