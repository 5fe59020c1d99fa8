"""The error a failed run stopped on (``megatron/failures.py``): each rank records the error that ended its training
loop, and the first one is chosen by time, a neighbour's lost connection never winning over the error that caused it.
"""

from __future__ import annotations

import json

import pytest

from megatron_tah.codecs.core.errors import PayloadChecksumError
from megatron_tah.link.peer import PeerLostError
from megatron_tah.megatron import failures
from megatron_tah.megatron.failures import RankError, first_error

LOST = dict(message="megatron_tah: link stage 0 -> stage 1, iteration 6: the link failed", secondary=True)


def _checksum_error() -> PayloadChecksumError:
    return PayloadChecksumError("tah: 1 buffer(s) failed the payload checksum", codec="tah").at(0, 1, 6)


def _lost_error() -> PeerLostError:
    return PeerLostError("megatron_tah: link stage 0 -> stage 1, iteration 6 (world rank 0 -> 1): the link\n failed",
                         link=(0, 1), ranks=(0, 1), iteration=6, waited_s=0.1, last_heard_s=0.2)


def test_a_rank_records_its_error_with_the_link_iteration_and_kind(tmp_path):
    path = failures.record(_checksum_error(), 1, secondary=False, folder=tmp_path)
    assert path == tmp_path / "rank1.json"
    failures.record(_lost_error(), 0, secondary=True, folder=tmp_path)
    checksum, lost = sorted(failures.read(tmp_path), key=lambda r: -r.rank)
    assert (checksum.rank, checksum.error, checksum.link, checksum.iteration, checksum.secondary) == \
        (1, "PayloadChecksumError", (0, 1), 6, False)
    assert checksum.message == "link stage 0 -> stage 1, iteration 6: tah: 1 buffer(s) failed the payload checksum"
    assert lost.message.endswith("the link failed") and "\n" not in lost.message and lost.secondary
    assert checksum.text() == f"PayloadChecksumError on rank 1: {checksum.message}"
    assert lost.text().startswith("PeerLostError on rank 0 (a neighbour's process ended without recording an error")
    assert lost.at <= checksum.at + 1.0  # recorded now, by the wall clock


def test_a_ranks_first_record_stays_and_nothing_is_recorded_without_a_folder(tmp_path, monkeypatch):
    failures.record(_checksum_error(), 1, secondary=False, folder=tmp_path)
    assert failures.record(_lost_error(), 1, secondary=True, folder=tmp_path) is None
    assert [r.error for r in failures.read(tmp_path)] == ["PayloadChecksumError"]
    monkeypatch.delenv(failures.ENV, raising=False)
    assert failures.record(_checksum_error(), 2, secondary=False) is None
    monkeypatch.setenv(failures.ENV, str(tmp_path))
    assert failures.record(ValueError("bad value"), 2, secondary=False) == tmp_path / "rank2.json"
    record = json.loads((tmp_path / "rank2.json").read_text())
    assert record["error"] == "ValueError" and record["link"] is None and record["iteration"] is None
    # a folder that cannot be written: the rank's own error goes on, unrecorded
    assert failures.record(_checksum_error(), 3, secondary=False, folder=tmp_path / "missing") is None
    (tmp_path / "rank4.json").write_text("{not json")
    assert sorted(r.rank for r in failures.read(tmp_path)) == [1, 2]


def _at(rank: int, at: float, error: str = "PeerLostError", **fields) -> RankError:
    return RankError(**{"rank": rank, "at": at, "error": error, **LOST, **fields})


@pytest.mark.parametrize("records, chosen", [
    # the neighbour's lost connection was recorded first (the checksum's rank was slow to unwind): the cause wins
    ([_at(0, 10.0), _at(1, 10.4, "PayloadChecksumError", secondary=False)], 1),
    # two causes: the earlier
    ([_at(2, 20.0, "PeerTimeoutError", secondary=False), _at(1, 19.0, "PayloadChecksumError", secondary=False),
      _at(0, 18.0)], 1),
    # only lost connections (the dead rank recorded nothing): the earliest of them
    ([_at(3, 5.0), _at(0, 4.5)], 0),
    # a tie: the lower rank
    ([_at(3, 7.0, "PeerTimeoutError", secondary=False), _at(2, 7.0, "PeerTimeoutError", secondary=False)], 2),
])
def test_the_first_error_is_the_earliest_that_is_not_a_lost_neighbour(records, chosen):
    assert first_error(records).rank == chosen
    assert first_error(list(reversed(records))).rank == chosen  # whatever order the files are read in


def test_no_record_no_first_error(tmp_path):
    assert first_error([]) is None and first_error(failures.read(tmp_path)) is None
