"""The codecs' state in Megatron's checkpoints, so that a resumed run loses nothing.

Stateful codecs (AQ-SGD's per-sample buffers; the generators of stochastic rounding; ``auto``'s choice) live
in the installed pipeline transport (``pipeline_parallel.installed_transport()``), one per link end.
``install(patches)`` wraps ``megatron.training.training.save_checkpoint`` and ``load_checkpoint`` (looked up by
name by ``save_checkpoint_and_time`` and ``setup_model_and_optimizer``).

The codec state is part of the checkpoint's atomic unit:

* **save** -- *before* Megatron saves iteration ``N`` to ``--save`` (and so before its tracker
  ``latest_checkpointed_iteration.txt`` names ``N``: Megatron writes the tracker on rank 0 after a barrier of
  every rank, or in an async save's finalization), every rank whose codecs are stateful or hold state writes
  ``<save>/iter_<N:07d>/megatron_tah/rank_<world rank:05d>.pt`` = ``{"config": TahConfig as a dict, "codecs":
  {(direction, role, peer): codec.state_dict()}}``, to a temporary name first, flushed and renamed: a reader
  sees the whole file or none. A process killed at any point of a save leaves the tracker on the previous
  complete checkpoint.
* **load** -- after Megatron loaded iteration ``N`` from ``--load`` (not with ``--finetune``, which starts
  afresh, as it does for the optimizer), every rank reads its file back into the transport; codecs created
  later pick their state up on creation. A stateful run without the file raises ``CodecStateError`` naming
  the file, the rank and the iteration (no silent reset), so does a file that cannot be read; a file written
  under other codec settings raises an error naming both. Stateless codecs need no file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os

import torch

from .pipeline_parallel import installed_transport

STATE_DIR = "megatron_tah"
# Megatron's torch_dist writer warns when the iteration folder it writes into is not empty; the codec state
# written there first is expected, not an "old incomplete / corrupted checkpoint".
_DIST_LOGGER = "megatron.core.dist_checkpointing.serialization"
_OVERWRITING = "Overwriting old incomplete"


class CodecStateError(RuntimeError):
    """A checkpoint's codec state is missing or unreadable where this run's codecs need it."""


def state_file(root: str, iteration: int, rank: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}", STATE_DIR, f"rank_{rank:05d}.pt")


def _write_atomically(obj, path: str) -> None:
    """``torch.save(obj)`` to ``path`` through a temporary name in the same folder, flushed, then renamed."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.partial"
    with open(partial, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    with contextlib.suppress(OSError):  # the rename itself, durable (not every file system opens folders)
        folder = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


def save(root: str, iteration: int) -> str | None:
    """Write this rank's codec state for ``iteration`` under ``root`` (whole or absent); returns the file
    (None: the codecs are stateless and hold nothing)."""
    transport = installed_transport()
    if transport is None:
        return None
    states = transport.states.state_dict()
    if not states and not transport.states.stateful():
        return None
    path = state_file(root, iteration, torch.distributed.get_rank())
    _write_atomically({"config": dataclasses.asdict(transport.config), "codecs": states}, path)
    return path


def load(root: str, iteration: int) -> str | None:
    """Read this rank's codec state for ``iteration`` from ``root`` into the installed transport; returns the
    file (None: no file and stateless codecs). Raises ``CodecStateError`` when stateful codecs find no file or
    an unreadable one, ``RuntimeError`` when the transport is not installed."""
    transport = installed_transport()
    if transport is None:
        raise RuntimeError("megatron_tah: codec state is loaded into the installed pipeline transport; "
                           "call megatron_tah.install() first")
    rank = torch.distributed.get_rank()
    path = state_file(root, iteration, rank)
    if not os.path.isfile(path):
        if transport.states.stateful():
            raise CodecStateError(
                f"megatron_tah: rank {rank}: no codec state at iteration {iteration} ({path}) although this run's "
                "codecs keep state; the checkpoint was saved without megatron_tah or is incomplete. Resume from a "
                "checkpoint saved with these --tah-* flags, or use --finetune to start the codecs afresh")
        return None
    try:
        saved = torch.load(path, weights_only=False)
    except Exception as err:  # a damaged file: say which, not a pickle error
        raise CodecStateError(f"megatron_tah: rank {rank}: the codec state of iteration {iteration} cannot be "
                              f"read ({path}): {type(err).__name__}: {err}") from err
    transport.states.load_state_dict(saved["codecs"], saved_config=saved["config"])
    return path


class _ExpectedFolderFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_OVERWRITING)


@contextlib.contextmanager
def _quiet_overwriting(folder_was_empty: bool):
    """Drop the torch_dist writer's "overwriting" warning while it writes into a folder only the codec state
    was written to."""
    if not folder_was_empty:
        yield
        return
    logger, quiet = logging.getLogger(_DIST_LOGGER), _ExpectedFolderFilter()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _saving(original):
    def save_checkpoint(iteration, *args, **kwargs):
        from megatron.training.global_vars import get_args

        margs = get_args()
        if not (margs.save and installed_transport() is not None):
            return original(iteration, *args, **kwargs)
        folder = os.path.dirname(os.path.dirname(state_file(margs.save, int(iteration), 0)))
        was_empty = not os.path.isdir(folder) or not os.listdir(folder)
        save(margs.save, int(iteration))  # before Megatron's barrier and tracker (module docstring)
        with _quiet_overwriting(was_empty):
            return original(iteration, *args, **kwargs)

    return save_checkpoint


def _loading(original):
    def load_checkpoint(*args, **kwargs):
        result = original(*args, **kwargs)
        from megatron.training.global_vars import get_args

        margs = get_args()
        iteration = int(result[0]) if isinstance(result, tuple) and result else 0
        load_arg = kwargs.get("load_arg", "load")
        root = getattr(margs, load_arg, None)
        if iteration > 0 and root and not margs.finetune and load_arg == "load" and installed_transport() is not None:
            load(root, iteration)
        return result

    return load_checkpoint


def install(patches) -> None:
    patches.wrap("megatron.training.training", "save_checkpoint", _saving,
                 why="save the codecs' state with the checkpoint, before Megatron's tracker names it")
    patches.wrap("megatron.training.training", "load_checkpoint", _loading,
                 why="load the codecs' state with the checkpoint")
