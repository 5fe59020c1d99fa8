"""The megatron-core versions this patch layer was checked against, and the check.

The p2p transports' keyword signature (``_batched_p2p_ops`` / ``_p2p_ops``) and the
``P2PCommunicator`` that calls them were read in 0.17-0.19; outside that range the
patch refuses to install instead of guessing.
"""

from __future__ import annotations

import re

MIN_VERSION = (0, 17)
MAX_VERSION_EXCLUSIVE = (0, 20)
SUPPORTED_RANGE = "megatron-core >= 0.17, < 0.20"


def parse_version(text: str) -> tuple[int, ...]:
    """Leading numeric components of a version string: ``"0.19.2rc0+abc"`` -> ``(0, 19, 2)``."""
    match = re.match(r"\s*(\d+(?:\.\d+)*)", str(text))
    if not match:
        raise ValueError(f"cannot read a version number from {text!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def is_supported(version: str) -> bool:
    parsed = parse_version(version)
    return MIN_VERSION <= parsed[:2] < MAX_VERSION_EXCLUSIVE


def installed_version() -> str:
    """megatron-core's version string; RuntimeError when it is not installed."""
    try:
        from megatron.core import package_info
    except ImportError as err:
        raise RuntimeError(f"megatron_tah needs {SUPPORTED_RANGE}, and megatron-core is not installed: {err}") from err
    return str(package_info.__version__)


def check_version(version: str | None = None) -> str:
    """Return the version when supported; RuntimeError naming it and the supported range otherwise."""
    version = installed_version() if version is None else version
    if not is_supported(version):
        raise RuntimeError(
            f"megatron-core {version} is not supported by megatron_tah: it needs {SUPPORTED_RANGE} "
            f"(install e.g. megatron-core==0.19.2)"
        )
    return version
