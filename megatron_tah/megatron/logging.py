"""megatron_tah's statistics in Megatron-LM's training log, TensorBoard and wandb.

``install_logging()`` replaces ``megatron.training.training.training_log`` (``train()`` looks it up
by name at call time) with a wrapper taking ``*args, **kwargs``. On iterations where Megatron
prints its log line (``iteration % args.log_interval == 0`` or the first iteration) the wrapper,
on every rank (the reduction is collective over the pipeline group):

1. takes this rank's counters since the last log line: ``stats.collect(reset=True)``;
2. reduces them to the last rank: ``stats.reduce_to_last_rank(...)``;
3. appends ``stats.format_for_log(...)`` to the iteration line Megatron prints (or prints it on
   its own line if that line could not be found);
4. writes the numbers as scalars ``tah/<direction>_<key>`` (e.g. ``tah/forward_ratio``) to the
   TensorBoard and wandb writers, which Megatron creates only on the last rank.

Other iterations call the original unchanged. ``uninstall_logging()`` restores it exactly.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from typing import Any, Callable

from .arguments import unwrap_module_attribute, wrap_module_attribute

DIRECTIONS = ("forward", "backward")
SCALAR_KEYS = ("messages", "raw_bytes", "wire_bytes", "ratio", "rel_error", "rotated_fraction")
# training_log(loss_dict, total_loss_dict, learning_rate, iteration, ..., is_first_iteration=...)
_ITERATION_POSITION = 3
_FIRST_ITERATION_POSITION = 12


def _training_module():
    try:
        return importlib.import_module("megatron.training.training")
    except ImportError as err:
        raise RuntimeError(
            f"megatron_tah's log wrapper needs megatron.training.training (megatron-core >= 0.17): {err}"
        ) from err


def _stats():
    return importlib.import_module("megatron_tah.megatron.stats")


def _argument(args: tuple, kwargs: dict, position: int, name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else default


def scalars(stats: dict) -> dict[str, float]:
    """Flatten reduced statistics into ``{"tah/forward_ratio": 3.6, ...}``, skipping missing/NaN values."""
    out = {}
    for direction in DIRECTIONS:
        for key in SCALAR_KEYS:
            value = stats.get(direction, {}).get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                out[f"tah/{direction}_{key}"] = float(value)
    return out


def write_scalars(stats: dict, iteration: int, writer=None, wandb_writer=None) -> dict[str, float]:
    """Write the statistics to a TensorBoard ``SummaryWriter`` and/or a wandb run (either may be None)."""
    values = scalars(stats)
    if writer is not None:
        for name, value in values.items():
            writer.add_scalar(name, value, iteration)
    if wandb_writer is not None and values:
        wandb_writer.log(values, iteration)
    return values


def _is_iteration_line(message: Any) -> bool:
    return isinstance(message, str) and " iteration " in message and "consumed samples" in message


@contextlib.contextmanager
def _appending_to_iteration_line(module, fragment: str):
    """Within the block, ``module.print_rank_last`` adds ``fragment`` to the first iteration line it prints.

    Yields a one-element list that says whether the fragment was appended.
    """
    original: Callable | None = getattr(module, "print_rank_last", None)
    appended = [False]
    if original is None:
        yield appended
        return

    def print_rank_last(message, *args, **kwargs):
        if not appended[0] and _is_iteration_line(message):
            appended[0] = True
            message = message + fragment
        return original(message, *args, **kwargs)

    module.print_rank_last = print_rank_last
    try:
        yield appended
    finally:
        module.print_rank_last = original


def _logging_training_log(original):
    def training_log(*args, **kwargs):
        from megatron.training.global_vars import get_args, get_tensorboard_writer, get_wandb_writer

        margs = get_args()
        iteration = _argument(args, kwargs, _ITERATION_POSITION, "iteration")
        first = bool(_argument(args, kwargs, _FIRST_ITERATION_POSITION, "is_first_iteration", False))
        if iteration is None or not (iteration % margs.log_interval == 0 or first):
            return original(*args, **kwargs)

        stats = _stats()
        reduced = stats.reduce_to_last_rank(stats.collect(reset=True))
        fragment = stats.format_for_log(reduced)
        write_scalars(reduced, iteration, get_tensorboard_writer(), get_wandb_writer())
        module = _training_module()
        with _appending_to_iteration_line(module, fragment) as appended:
            result = original(*args, **kwargs)
        if not appended[0] and fragment:
            module.print_rank_last(f" iteration {iteration:8d} |{fragment}")
        return result

    return training_log


def install_logging() -> None:
    """Wrap ``megatron.training.training.training_log`` (idempotent)."""
    wrap_module_attribute(_training_module(), "training_log", _logging_training_log)


def uninstall_logging() -> None:
    """Restore the original ``training_log`` (no-op when not installed)."""
    unwrap_module_attribute(_training_module(), "training_log")
