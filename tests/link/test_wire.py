"""``link/wire.py``: completion timing and the receive transit ``auto`` measures on a NCCL-like backend: works that
time themselves (``_get_duration()``, milliseconds) and a host read of the trailer that comes late (the
receiver's queued compute). Fakes of ``torch.distributed`` and the process group; no process is started."""

from __future__ import annotations

import pytest
import torch

from megatron_tah.config import TahConfig
from megatron_tah.link import wire
from megatron_tah.link.transport import PipelineTransport
from megatron_tah.link.wire import Trailer, append_trailer, wall_seconds
from megatron_tah.megatron.places import STREAMS
from megatron_tah.megatron.stats import Stats
from tests.helpers.p2p import transport_call

SHAPE = (16, 2, 32)
DEVICE_MS = 30.0  # the receive's own time on the device, as the backend reports it
LATE = 2.0  # seconds from the send's stamp to the receiver's host read of the trailer


class _Work:
    def __init__(self, polls_left: int = 0, duration_ms: float | None = DEVICE_MS):
        self.polls_left, self.duration_ms, self.waited = polls_left, duration_ms, False

    def is_completed(self) -> bool:
        self.polls_left -= 1
        return self.polls_left < 0

    def wait(self, timeout=None) -> bool:
        self.waited = True
        return True

    def _get_duration(self) -> float:
        if self.duration_ms is None:
            raise RuntimeError("getDuration only works if timing was enabled")
        return self.duration_ms


class _Group:
    """Stage 1 of a 3-stage pipeline group; records when its works' timing is turned on."""

    def __init__(self):
        self.timing = False

    def rank(self) -> int:
        return 1

    def size(self) -> int:
        return 3

    def _enable_collectives_timing(self) -> None:
        self.timing = True


class _GlooRecv(_Work):
    """A gloo receive: complete only once ``wait()`` has been called (which returns when the data is there)."""

    def is_completed(self) -> bool:
        return self.waited


def test_wait_completed_waits_then_polls_until_the_transfer_is_done():
    work = _Work(polls_left=3)  # NCCL-like: wait() returns at once, the kernel completes three polls later
    wire.wait_completed(work, lambda w: w.wait())
    assert work.polls_left == -1 and work.waited
    gloo = _GlooRecv()
    wire.wait_completed(gloo, lambda w: w.wait())  # (a poll before the wait would never end)
    assert gloo.waited


def test_only_nccl_groups_time_their_works_and_an_untimed_work_has_no_duration(monkeypatch):
    for backend, timed in (("nccl", True), ("gloo", False)):
        group = _Group()
        monkeypatch.setattr(torch.distributed, "get_backend", lambda g=None, b=backend: b)
        assert wire.time_works(group) is timed and group.timing is timed
    assert wire.work_seconds(_Work()) == pytest.approx(DEVICE_MS / 1e3)
    assert wire.work_seconds(_Work(duration_ms=None)) is None
    assert wire.work_seconds(object()) is None


def _fake_dist(monkeypatch, backend: str, group: _Group, config: TahConfig, posted: list) -> None:
    """``torch.distributed`` of ``backend``: a receive's work completes at once and times itself (only a
    NCCL group's timing was turned on before it was posted); the message it delivers was stamped ``LATE``
    seconds before now, when the host reads it."""
    dist = torch.distributed
    codec = config.forward_codec()

    def irecv(buf, src, group=None):
        x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
        buf.copy_(append_trailer(codec.encode(x), Trailer(None, wall_seconds() - LATE, None)))
        posted.append(buf.numel())
        return _Work(duration_ms=DEVICE_MS if group is not None and group.timing else None)

    monkeypatch.setattr(dist, "get_backend", lambda g=None: backend)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)  # (the peer watch names the receiving rank)
    monkeypatch.setattr(dist, "irecv", irecv)
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group=None: (op, tensor, peer, group))
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [op(t, p, group=g) for op, t, p, g in ops])


@pytest.mark.parametrize("batched", [False, True], ids=["p2p_ops", "batched"])
@pytest.mark.parametrize("backend, transit", [("nccl", DEVICE_MS / 1e3), ("gloo", LATE)])
def test_a_timed_receive_reports_its_device_time_not_the_wait_for_a_late_host_read(monkeypatch, batched,
                                                                                   backend, transit):
    """On NCCL a receive's ``wait()`` returns at once and the trailer's host read waits for the receiver's
    queued compute: timed from the send's stamp to that read, a transit includes the compute. The work's own
    duration on the device is the transit reported to the sender. On gloo the host's timing stands."""
    config = TahConfig(tah_forward_codec="fixedpoint", tah_backward_codec="auto", tah_backend="torch",
                       tah_auto_candidates="none,fp8,paper")
    transport = PipelineTransport(config, Stats(STREAMS), iteration=lambda: 0)
    group, posted = _Group(), []
    transport.checked_groups.add(id(group))  # (the configuration check and the ping: not this test's)
    _fake_dist(monkeypatch, backend, group, config, posted)
    received = torch.empty(SHAPE)
    call = dict(tensor_send_prev=None, tensor_recv_prev=received, tensor_send_next=None, tensor_recv_next=None,
                group=group, prev_pipeline_rank=0, next_pipeline_rank=2)
    transport_call(transport, batched, **call)
    report = transport.link("backward", "send", 0).report  # what stage 1 tells stage 0 of its forward direction
    assert report is not None and report[0] == posted[0]
    assert report[1] == pytest.approx(transit, rel=0.05)
    assert received.abs().sum() > 0  # (decoded as before)
