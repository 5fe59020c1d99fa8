"""The error a failed run stopped on, whichever of its processes exited first.

When a link fails, the rank that detects it raises the error naming the link, the iteration and the kind
(``PayloadChecksumError``, ``PeerTimeoutError``); its neighbours then lose their connections to it
(``PeerLostError``) or are stopped by the launcher. Which process exits first, and whose traceback the
output shows first, depends on the machine's load. So each rank records the error that ended its training
loop (``record``, called by ``peer_timeout.py``'s ``train`` wrapper) as one JSON file in the folder named by
``TAH_ERROR_DIR`` (nothing without it), and the restart loop (``megatron_tah.restart``), which gives each
attempt its own folder, names ``first_error`` of the records:

* the earliest record (wall clock) that is not secondary;
* a ``PeerLostError`` is secondary: its neighbour's process died, and that neighbour's own error, when it
  recorded one, is the cause (a peer lost after a checksum stop elsewhere, not the other way round);
* only secondary records: the earliest of them (the neighbour died without one: killed, out of memory);
* no record: the exit status is all there is.

One host's folder holds its own ranks' records (a restart loop per node).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

ENV = "TAH_ERROR_DIR"  # the folder a rank records its error in (set by the restart loop per attempt)


@dataclasses.dataclass(frozen=True)
class RankError:
    """One rank's error: ``at`` (wall-clock seconds when recorded), ``error`` (its class name), ``message`` (on
    one line), ``link`` (sender and receiver stage) and ``iteration`` when it names them, ``secondary``: it
    says that a neighbour died."""

    rank: int
    at: float
    error: str
    message: str
    link: tuple[int, int] | None = None
    iteration: int | None = None
    secondary: bool = False

    def text(self) -> str:
        """``"PayloadChecksumError on rank 1: link stage 0 -> stage 1, iteration 6: ..."``."""
        why = " (a neighbour's process ended without recording an error: killed, or out of memory)"
        return f"{self.error} on rank {self.rank}{why if self.secondary else ''}: {self.message}"


def record(err: BaseException, rank: int, *, secondary: bool, folder: str | os.PathLike | None = None) -> Path | None:
    """Record ``err`` as ``rank``'s error in ``folder`` (default: ``$TAH_ERROR_DIR``; neither: nothing); a rank's
    first record stays. Returns the file written, None when nothing was (no folder, a record already there,
    or the folder cannot be written: the error itself goes on either way)."""
    folder = os.environ.get(ENV) if folder is None else folder
    if not folder:
        return None
    link, iteration = getattr(err, "link", None), getattr(err, "iteration", None)
    entry = RankError(int(rank), time.time(), type(err).__name__, " ".join(str(err).split()),
                      None if link is None else tuple(int(s) for s in link),
                      None if iteration is None else int(iteration), bool(secondary))
    path = Path(folder) / f"rank{int(rank)}.json"
    try:
        if path.exists():
            return None
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(dataclasses.asdict(entry)))
        partial.replace(path)  # whole or absent for a reader
    except OSError:
        return None
    return path


def read(folder: str | os.PathLike) -> list[RankError]:
    """The records in ``folder`` (files that cannot be read or parsed are left out)."""
    found = []
    for path in sorted(Path(folder).glob("rank*.json")):
        try:
            entry = json.loads(path.read_text())
            link = entry.get("link")
            found.append(RankError(**{**entry, "link": None if link is None else tuple(link)}))
        except (OSError, ValueError, TypeError):
            continue
    return found


def first_error(records: list[RankError]) -> RankError | None:
    """The error the run stopped on (module docstring): the earliest record that is not secondary, else the
    earliest; None without records. Ties go to the lower rank."""
    primary = [r for r in records if not r.secondary]
    return min(primary or records, key=lambda r: (r.at, r.rank), default=None)
