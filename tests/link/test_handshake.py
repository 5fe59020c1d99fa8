"""``link/handshake.py``'s ``link_latency`` against a NCCL-like backend: works that are queued at once and
complete later (a fake ``torch.distributed`` and a fake clock); and on gloo, with 3 real processes."""

from __future__ import annotations

import pytest
import torch

from megatron_tah.link import handshake
from tests.helpers.dist_utils import run_distributed

ROUND_TRIP = 0.004  # seconds: the fake link's
TICK = ROUND_TRIP / 200  # the fake clock's advance per completion poll


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Work:
    """Queued at once (``wait()`` returns, as NCCL's does); complete once the clock reaches ``done_at``."""

    def __init__(self, clock: _Clock, done_at: float):
        self.clock, self.done_at = clock, done_at

    def is_completed(self) -> bool:
        self.clock.now += TICK  # time passes while the host polls
        return self.clock.now >= self.done_at

    def wait(self, timeout=None) -> bool:
        return True


class _Group:
    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 2


def _nccl_like(monkeypatch, clock: _Clock) -> None:
    """``torch.distributed`` as rank 0 of a 2-rank NCCL group sees it over a link of ``ROUND_TRIP``: blocking
    calls return once queued; a receive's work completes a round trip after it is posted."""
    dist = torch.distributed
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")  # (host tensors: no CUDA here)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    monkeypatch.setattr(dist, "isend", lambda tensor, dst, group=None: _Work(clock, clock.now))
    monkeypatch.setattr(dist, "irecv", lambda tensor, src, group=None: _Work(clock, clock.now + ROUND_TRIP))
    monkeypatch.setattr(handshake.time, "perf_counter", clock)


def test_the_latency_is_half_the_completed_round_trip_not_the_time_to_queue_it(monkeypatch):
    """On NCCL ``send``/``recv`` return once queued: timing them reads ~0 whatever the link. The round trip
    is timed to the reply's completion, so the latency read is half the link's round trip."""
    clock = _Clock()
    _nccl_like(monkeypatch, clock)
    latency = handshake.link_latency(_Group(), torch.device("cpu"), _wait, rounds=3)
    assert list(latency) == [1]
    assert latency[1] == pytest.approx(ROUND_TRIP / 2, abs=TICK)


def _wait(work, peer, receiving, what):
    work.wait()


def _gloo_latency(rank, world_size):
    return handshake.link_latency(torch.distributed.group.WORLD, torch.device("cpu"), _wait)


@pytest.mark.distributed
def test_gloo_ranks_each_read_their_neighbours_latency():
    """Three gloo processes (a ring of 3 pairs): each rank learns both neighbours' latency, the same number
    at both ends of a pair, positive and well under a second on one machine (a gloo receive reads as complete
    only once waited for: a poll alone would never end)."""
    latency = run_distributed(_gloo_latency, 3, timeout=120)
    for rank, measured in enumerate(latency):
        assert set(measured) == {(rank - 1) % 3, (rank + 1) % 3}
        assert all(0 < s < 1.0 for s in measured.values()), measured
    for a in range(3):
        b = (a + 1) % 3
        assert latency[a][b] == latency[b][a]
