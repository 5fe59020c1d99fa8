"""One call that plugs megatron_tah into an unchanged Megatron-LM training script.

``install_megatron_lm_plugin()`` (called by ``python -m megatron_tah.launch`` and by the patched
``pretrain_gpt.py``) does, idempotently:

- ``--tah-*`` flags on Megatron-LM's parser, validated with its arguments (``arguments.py``);
- the statistics in the iteration log line and TensorBoard/wandb (``logging.py``);
- wraps ``initialize_megatron`` (in ``megatron.training.training``, where ``pretrain()`` looks it up
  by name, and where scripts import it from: ``megatron.training`` and ``megatron.training.initialize``)
  so that right after it returns -- arguments parsed, distributed and model-parallel state up,
  no model built yet -- ``megatron_tah.install(TahConfig.from_args(get_args()))`` replaces the
  pipeline transports;
- without CUDA, megatron-core's CPU shims (``cpu_shims.apply_cpu_shims()``).

``uninstall_megatron_lm_plugin()`` undoes all of it, including ``megatron_tah.install``.
"""

from __future__ import annotations

import importlib

import torch

from .arguments import (
    install_arguments,
    tah_config_from_args,
    uninstall_arguments,
    unwrap_module_attribute,
    wrap_module_attribute,
)
from .logging import install_logging, uninstall_logging

# What this module itself turned on (so the inverse leaves others' installs alone).
_state = {"installed": False, "cpu_shims": False, "transports": False}


def _initializing_then_installing(original):
    def initialize_megatron(*args, **kwargs):
        result = original(*args, **kwargs)
        from megatron.training.global_vars import get_args
        from megatron.training.utils import print_rank_0

        import megatron_tah

        config = tah_config_from_args(get_args())
        megatron_tah.install(config)
        _state["transports"] = True
        print_rank_0(f"> megatron_tah: pipeline activations via {config.tah_forward_codec}, "
                     f"activation gradients via {config.tah_backward_codec}")
        return result

    return initialize_megatron


_INITIALIZE_MODULES = ("megatron.training.training", "megatron.training.initialize", "megatron.training")


def _initialize_modules():
    try:
        return [importlib.import_module(name) for name in _INITIALIZE_MODULES]
    except ImportError as err:
        raise RuntimeError(f"megatron_tah's plugin needs megatron.training (megatron-core >= 0.17): {err}") from err


def _cpu_shims():
    return importlib.import_module("megatron_tah.megatron.cpu_shims")


def install_megatron_lm_plugin() -> None:
    """Install flags, log wrapper, the post-initialization ``megatron_tah.install`` and (CPU only) shims."""
    install_arguments()
    install_logging()
    for module in _initialize_modules():
        wrap_module_attribute(module, "initialize_megatron", _initializing_then_installing)
    shims = _cpu_shims()
    if not torch.cuda.is_available() and not shims.cpu_shims_active():
        _state["cpu_shims"] = shims.apply_cpu_shims()
    _state["installed"] = True


def uninstall_megatron_lm_plugin() -> None:
    """Undo ``install_megatron_lm_plugin`` and ``megatron_tah.install`` (no-op when not installed)."""
    import megatron_tah

    if _state["transports"]:
        megatron_tah.uninstall()
        _state["transports"] = False
    for module in _initialize_modules():
        unwrap_module_attribute(module, "initialize_megatron")
    uninstall_logging()
    uninstall_arguments()
    if _state["cpu_shims"]:
        _cpu_shims().remove_cpu_shims()
        _state["cpu_shims"] = False
    _state["installed"] = False


def plugin_installed() -> bool:
    return _state["installed"]
