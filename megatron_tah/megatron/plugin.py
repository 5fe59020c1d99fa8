"""One call that plugs megatron_tah into Megatron-LM's training loop (``megatron.training``).

``install_megatron_lm_plugin()`` -- called by ``python -m megatron_tah.pretrain_gpt``, by
``python -m megatron_tah.launch`` and by a ``pretrain_gpt.py`` patched with ``patches/`` -- does,
idempotently and before Megatron parses its arguments:

- ``--tah-*`` flags on Megatron's parser, validated with its arguments (``arguments.py``): a bad
  value ends the run with one ``error:`` line before anything is built;
- the statistics in the iteration log line, TensorBoard/wandb and ``--tah-log-json`` (``run_log.py``);
- wraps ``initialize_megatron`` (in ``megatron.training.training``, where ``pretrain()`` looks it up,
  and in ``megatron.training`` / ``megatron.training.initialize``, where scripts import it from) so
  that right after it returns -- arguments parsed, distributed and model-parallel state up, no model
  built -- ``megatron_tah.install(TahConfig.from_args(get_args()))`` replaces the pipeline
  transports and installs the tensor-parallel, data-parallel and activation-memory places that
  the flags turn on (``places.py``); without CUDA the wrapper passes Megatron's own ``allow_no_cuda=True``.
  Then it prints the places' start-up lines (``places.startup_lines``: each place's own, e.g. the
  pipeline's codecs or the tied embedding's uncompressed bytes, and which places are on).
  Opt-in: when every ``--tah-*`` flag is at its default nothing is installed, the log-line wrappers
  are taken off again, and one ``OFF_MESSAGE`` line says how to turn compression on;
- wraps Megatron's ``_initialize_distributed`` for several ranks per GPU (``share_gpus.py``): on with
  ``--tah-share-gpus`` or when two ranks' devices are one GPU (their UUIDs, exchanged through the
  rendezvous store), decided once the flags are parsed;
- runs Megatron's ``evaluate`` inside ``pipeline_parallel.evaluation()`` (run_log's wrapper of it), so
  ``--tah-eval-traffic`` can send the evaluations' traffic uncompressed (or both ways);
- saves and restores the codecs' state (AQ-SGD buffers, stochastic-rounding generators) with
  Megatron's checkpoints (``codec_state.py``);
- bounds Megatron's own waits on another stage by ``--tah-peer-timeout-s`` after the first training step, and
  names the stage and iteration of a collective that fails (``peer_timeout.py``; the transport's and the places'
  waits are bounded from the first: ``link/peer.py``, ``bounded.py``);
- the dataset helpers (``dataset_helpers.py``): skipped when compiled (megatron-core's wheel ships
  ``helpers_cpp`` without the Makefile Megatron runs ``make`` on), else a checkout's are compiled by
  this interpreter (its pybind11, its extension suffix), whatever ``python3`` is on ``PATH``;
- without CUDA, the CPU shims (``cpu_shims.hold_cpu_shims``).

What it replaced is recorded in ``registry.REGISTRY`` (``plugin``, ``arguments``, ``logging``).

``uninstall_megatron_lm_plugin()`` undoes all of it, including ``megatron_tah.install``.
"""

from __future__ import annotations

import torch

from . import codec_state, cpu_shims, peer_timeout, places, share_gpus
from .arguments import install_arguments, tah_config_from_args, uninstall_arguments
from .dataset_helpers import compiling_with_this_python
from .run_log import install_logging, uninstall_logging
from .registry import REGISTRY

INITIALIZE_MODULES = ("megatron.training.training", "megatron.training.initialize", "megatron.training")

OFF_MESSAGE = ("> megatron_tah: no --tah-* flag given, Megatron's own communication is unchanged; compress "
               "pipeline traffic with e.g. --tah-preset paper (or --tah-forward-codec / --tah-backward-codec, see --help)")


def _initializing_then_installing(original):
    def initialize_megatron(*args, **kwargs):
        if not torch.cuda.is_available():
            kwargs["allow_no_cuda"] = True  # Megatron's own switch for initialize.py:66's CUDA assert
        result = original(*args, **kwargs)
        from megatron.training.global_vars import get_args
        from megatron.training.utils import print_rank_0

        config = tah_config_from_args(get_args())
        if config.is_off():  # opt-in: without --tah-* flags Megatron runs exactly as upstream
            uninstall_logging()
            print_rank_0(OFF_MESSAGE)
            return result
        places.install(config)
        REGISTRY.plugin_installed_places = True
        for line in places.startup_lines(config, get_args()):
            print_rank_0(line)
        return result

    return initialize_megatron


def install_megatron_lm_plugin() -> None:
    """Install flags, logging, the post-initialization ``megatron_tah.install``, codec checkpoints, shims."""
    patches = REGISTRY.plugin
    if patches:
        return
    try:
        install_arguments()
        install_logging()
        for module in INITIALIZE_MODULES:
            patches.wrap(module, "initialize_megatron", _initializing_then_installing,
                         why="install the places the flags turn on, once Megatron is initialized")
        share_gpus.install(patches)
        codec_state.install(patches)
        peer_timeout.install(patches)
        patches.wrap("megatron.core.datasets.utils", "compile_helpers", compiling_with_this_python,
                     why="compile the dataset helpers with the running Python")
        cpu_shims.hold_cpu_shims("plugin")
    except Exception:
        uninstall_megatron_lm_plugin()
        raise


def uninstall_megatron_lm_plugin() -> None:
    """Undo ``install_megatron_lm_plugin`` and ``megatron_tah.install`` (no-op when not installed)."""
    if REGISTRY.plugin_installed_places:
        places.uninstall()
        REGISTRY.plugin_installed_places = False
    REGISTRY.plugin.restore()
    REGISTRY.bounded_groups = None
    uninstall_logging()
    uninstall_arguments()
    cpu_shims.release_cpu_shims("plugin")


def plugin_installed() -> bool:
    return bool(REGISTRY.plugin)
