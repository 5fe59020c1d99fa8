"""megatron_tah: TAH-Quant compressed pipeline-parallel communication for Megatron-LM.

>>> import megatron_tah
>>> megatron_tah.install(tah_forward_codec="tah")   # before the first pipeline schedule runs
>>> megatron_tah.uninstall()                         # megatron-core's original transports again

``import megatron_tah`` stays light: megatron-core is imported by ``install``, and
``TahConfig`` / ``get_codec`` are loaded on first access.
"""

from __future__ import annotations

__version__ = "0.1.0"


def install(config=None, **overrides) -> None:
    """Compress megatron-core's pipeline p2p traffic, and the tensor-parallel, data-parallel and
    activation-memory places the config turns on (see ``megatron_tah.megatron.places.install``)."""
    from .megatron.places import install as _install

    _install(config, **overrides)


def uninstall() -> None:
    """Restore everything ``install`` replaced (see ``megatron_tah.megatron.places.uninstall``)."""
    from .megatron.places import uninstall as _uninstall

    _uninstall()


def __getattr__(name):
    if name == "TahConfig":
        from .config import TahConfig

        return TahConfig
    if name == "get_codec":
        from .codecs import get_codec

        return get_codec
    raise AttributeError(f"module 'megatron_tah' has no attribute {name!r}")


__all__ = ["TahConfig", "get_codec", "install", "uninstall"]
