"""Per-stage checkpoints of the compact trainer, laid out as Megatron-LM lays them out.

::

    DIR/latest_checkpointed_iteration.txt            the newest complete iteration (written last)
    DIR/iter_0000100/mp_rank_00_001/model_optim_rng.pt   stage 1 of iteration 100

Each ``model_optim_rng.pt`` holds ``{"iteration", "consumed_samples", "model",
"optimizer", "rng", "args"}`` for one pipeline stage (torch.save). The
directory names follow Megatron's; the file content is this trainer's own
(not loadable by Megatron-LM's ``load_checkpoint``).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch



class RunError(RuntimeError):
    """A checkpoint or dataset is missing or does not fit the run; the trainer prints it as one line."""


TRACKER = "latest_checkpointed_iteration.txt"
# Architecture flags that must match between a checkpoint and the run loading it.
ARCH_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "padded_vocab_size",
             "max_position_embeddings", "pipeline_model_parallel_size")


def stage_file(root: str | Path, iteration: int, stage: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}" / f"mp_rank_00_{stage:03d}" / "model_optim_rng.pt"


def rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def save(root: str, stage: int, iteration: int, consumed_samples: int, model, optimizer, args, barrier) -> Path:
    """Write this stage's file; after ``barrier()`` stage 0 updates the tracker file."""
    path = stage_file(root, iteration, stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": rng_state(),
        "args": {k: getattr(args, k) for k in ARCH_KEYS},
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)
    barrier()
    if stage == 0:
        (Path(root) / TRACKER).write_text(f"{iteration}\n")
    barrier()
    return path


def latest_iteration(root: str) -> int:
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        raise RunError(f"--load {root}: no {TRACKER} (not a checkpoint directory of this trainer)")
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise RunError(f"{tracker}: expected an iteration number, found {text!r}")
    return int(text)


def load(root: str, stage: int, model, optimizer, args) -> tuple[int, int]:
    """Load this stage's state; returns (iteration, consumed samples) to resume from.

    With ``args.finetune`` only the weights are loaded and (0, 0) is returned.
    Raises RunError when the checkpoint's architecture differs from ``args``.
    """
    iteration = latest_iteration(root)
    path = stage_file(root, iteration, stage)
    if not path.is_file():
        raise RunError(f"checkpoint {path} not found (saved with another pipeline size?)")
    state = torch.load(path, map_location="cpu", weights_only=False)
    mismatched = [f"{k}: checkpoint {state['args'][k]}, run {getattr(args, k)}"
                  for k in ARCH_KEYS if state["args"].get(k) != getattr(args, k)]
    if mismatched:
        raise RunError(f"checkpoint {root} does not match this model ({'; '.join(mismatched)})")
    model.load_state_dict(state["model"])
    if args.finetune:
        return 0, 0
    if not args.no_load_optim:
        optimizer.load_state_dict(state["optimizer"])
    if not args.no_load_rng:
        set_rng_state(state["rng"])
    return state["iteration"], state["consumed_samples"]
