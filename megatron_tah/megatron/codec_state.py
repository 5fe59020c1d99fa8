"""The codecs' state in Megatron's checkpoints, so that a resumed run loses nothing.

Stateful codecs (AQ-SGD's per-sample buffers; the generators of stochastic rounding) live in
the installed pipeline transport (``pipeline_parallel.installed_transport()``), one per link end. ``install(patches)`` wraps
``megatron.training.training.save_checkpoint`` and ``load_checkpoint`` (looked up by name by
``save_checkpoint_and_time`` and ``setup_model_and_optimizer``):

* after Megatron saved iteration ``N`` to ``--save``, every rank whose codecs hold state writes
  ``<save>/iter_<N:07d>/megatron_tah/rank_<world rank:05d>.pt`` = ``{"config": TahConfig as a
  dict, "codecs": {(direction, role, peer): codec.state_dict()}}`` (torch.save);
* after Megatron loaded iteration ``N`` from ``--load`` (not with ``--finetune``, which starts
  afresh, as it does for the optimizer), every rank reads its file back into the transport;
  codecs created later pick their state up on creation. A checkpoint without the file (saved
  without megatron_tah, or with stateless codecs) leaves the codecs fresh and says so when the
  run's codecs are stateful; a file written under other codec settings raises an error naming
  both.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from .pipeline_parallel import installed_transport

STATE_DIR = "megatron_tah"


def state_file(root: str, iteration: int, rank: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}", STATE_DIR, f"rank_{rank:05d}.pt")


def save(root: str, iteration: int) -> str | None:
    """Write this rank's codec state for ``iteration`` under ``root``; returns the file (None: no state)."""
    transport = installed_transport()
    states = transport.states.state_dict() if transport is not None else {}
    if not states:
        return None
    path = state_file(root, iteration, torch.distributed.get_rank())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"config": dataclasses.asdict(transport.config), "codecs": states}, path)
    return path


def load(root: str, iteration: int) -> str | None:
    """Read this rank's codec state for ``iteration`` from ``root`` into the installed transport
    (None: no file; an error when the transport is not installed)."""
    transport = installed_transport()
    if transport is None:
        raise RuntimeError("megatron_tah: codec state is loaded into the installed pipeline transport; "
                           "call megatron_tah.install() first")
    path = state_file(root, iteration, torch.distributed.get_rank())
    if not os.path.isfile(path):
        return None
    saved = torch.load(path, weights_only=False)
    transport.states.load_state_dict(saved["codecs"], saved_config=saved["config"])
    return path


def _saving(original):
    def save_checkpoint(iteration, *args, **kwargs):
        result = original(iteration, *args, **kwargs)
        from megatron.training.global_vars import get_args

        margs = get_args()
        if margs.save and installed_transport() is not None:
            save(margs.save, int(iteration))
        return result

    return save_checkpoint


def _loading(original):
    def load_checkpoint(*args, **kwargs):
        result = original(*args, **kwargs)
        from megatron.training.global_vars import get_args
        from megatron.training.utils import print_rank_0

        margs = get_args()
        iteration = int(result[0]) if isinstance(result, tuple) and result else 0
        load_arg = kwargs.get("load_arg", "load")
        root = getattr(margs, load_arg, None)
        transport = installed_transport()
        if iteration > 0 and root and not margs.finetune and load_arg == "load" and transport is not None:
            if load(root, iteration) is None and transport.states.stateful():
                print_rank_0(f"> megatron_tah: no codec state in {root} at iteration {iteration}; "
                             "stateful codecs start fresh")
        return result

    return load_checkpoint


def install(patches) -> None:
    patches.wrap("megatron.training.training", "save_checkpoint", _saving,
                 why="save the codecs' state with the checkpoint")
    patches.wrap("megatron.training.training", "load_checkpoint", _loading,
                 why="load the codecs' state with the checkpoint")
