"""The fault harness: what a WAN's faults do to a real pipeline run (``python -m benchmarks.faults``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(__file__).resolve().parent / "site"
_HARNESS_VARIABLES = ("TAH_FAULT", "TAH_FAULT_DONE", "CHECKSUM")  # set by a scenario, never inherited


def script_env(out: Path, data_prefix: str, port: int, rate: str, iters: int, **variables: str) -> dict:
    """The environment of one harness run of ``scripts/pretrain_gpt.sh`` on the CPU behind the emulated ``rate``,
    writing to ``out``, with ``site/`` (the in-process faults) on ``PYTHONPATH``; ``variables`` on top."""
    env = {k: v for k, v in os.environ.items() if k not in _HARNESS_VARIABLES}
    env.update(PYTHON=sys.executable, DEVICE="cpu", OUT=str(out), DATA_PREFIX=data_prefix, TRAIN_ITERS=str(iters),
               MASTER_PORT=str(port), RATE=rate, LINK="emulate", LR="2e-3",
               PYTHONPATH=os.pathsep.join([str(SITE), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.update(variables)
    return env
