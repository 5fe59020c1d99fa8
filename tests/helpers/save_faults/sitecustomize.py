"""A rank killed during a phase of a checkpoint save (``tests/megatron/test_codec_state.py``), loaded by Python
at start-up from ``PYTHONPATH``; inert unless ``TAH_SAVE_FAULT`` is set in a training rank.

``TAH_SAVE_FAULT=PHASE:RANK:SAVE`` SIGKILLs world rank RANK during its SAVE-th checkpoint save (1-based), once
per job (``TAH_FAULT_DONE`` names a file made just before, so a restarted attempt runs clean). PHASE:

* ``model``: as Megatron's sharded writer starts (``dist_checkpointing.save``: state dict built, nothing of
  the model written);
* ``optimizer``: as the sharded writer returns (model and optimizer shards written, before Megatron's barrier
  and tracker);
* ``codec``: halfway through writing the codec-state file (its first half flushed to disk);
* ``tracker``: as rank 0 is about to write Megatron's tracker (everything else of the save written).
"""

import os

_SPEC = os.environ.get("TAH_SAVE_FAULT")
if _SPEC and os.environ.get("RANK") is not None and int(os.environ["RANK"]) == int(_SPEC.split(":")[1]):
    import io
    import signal
    from pathlib import Path

    import torch

    _phase, _rank, _save = _SPEC.split(":")
    _done = Path(os.environ["TAH_FAULT_DONE"])
    _saves = [0]

    def _die(where: str) -> None:
        _done.write_text(f"{_phase} killed at {where}\n")
        os.kill(os.getpid(), signal.SIGKILL)

    def _armed() -> bool:
        return _saves[0] == int(_save) and not _done.exists()

    import megatron.core.dist_checkpointing as _dist
    import megatron.training.checkpointing as _ckpt

    _dist_save, _tracker_name = _dist.save, _ckpt.get_checkpoint_tracker_filename

    def _counting_dist_save(*args, **kwargs):
        _saves[0] += _phase != "codec"
        if _phase == "model" and _armed():
            _die("the sharded writer's start")
        result = _dist_save(*args, **kwargs)
        if _phase == "optimizer" and _armed():
            _die("the sharded writer's return")
        return result

    def _tracker_filename(*args, **kwargs):
        if _phase == "tracker" and _armed():
            _die("the tracker")
        return _tracker_name(*args, **kwargs)

    _dist.save = _counting_dist_save
    _ckpt.get_checkpoint_tracker_filename = _tracker_filename

    if _phase == "codec":
        _torch_save = torch.save

        def _half_written_save(obj, f, *args, **kwargs):
            name = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", "")
            if "megatron_tah/rank_" not in str(name):
                return _torch_save(obj, f, *args, **kwargs)
            _saves[0] += 1  # the codec state is written once per save, before or after Megatron's writer
            if not _armed():
                return _torch_save(obj, f, *args, **kwargs)
            whole = io.BytesIO()
            _torch_save(obj, whole, *args, **kwargs)
            data = whole.getvalue()
            with open(name, "wb") as out:
                out.write(data[: len(data) // 2])
                out.flush()
                os.fsync(out.fileno())
            _die("half the codec state")

        torch.save = _half_written_save
