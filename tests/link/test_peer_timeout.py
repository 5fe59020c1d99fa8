"""A silent or dead pipeline peer stops the run within ``--tah-peer-timeout-s``, naming the link and iteration.

``link/peer.py``'s ``PeerWatch`` with a fake clock and fake works (what ``Work.wait`` is given, what it raises);
then the real transport between two gloo processes: a peer that goes silent, a peer that dies, an outage
shorter than the bound; then the Megatron side (``megatron/peer_timeout.py``): the process groups' timeout
after the first step, lifted around checkpoint saves, and a collective's failure named.
"""

from __future__ import annotations

import contextlib
import datetime
import time

import pytest
import torch

from megatron_tah.config import TahConfig
from megatron_tah.link.peer import LinkError, PeerLostError, PeerTimeoutError, PeerWatch

GLOO_TIMEOUT = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting {ms}ms for recv operation to complete"
GLOO_CLOSED = "[../third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer [10.77.0.2]:43120"


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeWork:
    """A posted message that completes after ``completes_after`` s (None: never) or fails after ``fails_after``
    with ``error``; ``wait(timeout)`` advances the fake clock as long as a real wait would block."""

    def __init__(self, clock: FakeClock, completes_after: float | None = None, fails_after: float | None = None,
                 error: str = GLOO_CLOSED):
        self.clock, self.completes_after, self.fails_after, self.error = clock, completes_after, fails_after, error
        self.timeouts: list[datetime.timedelta | None] = []

    def wait(self, timeout: datetime.timedelta | None = None):
        self.timeouts.append(timeout)
        limit = None if timeout is None else timeout.total_seconds()
        if self.fails_after is not None and (limit is None or self.fails_after < limit):
            self.clock.now += self.fails_after
            raise RuntimeError(self.error)
        if self.completes_after is not None and (limit is None or self.completes_after < limit):
            self.clock.now += self.completes_after
            return True
        if limit is None:
            raise AssertionError("an unbounded wait on a message that never completes: a hang")
        self.clock.now += limit
        raise RuntimeError(GLOO_TIMEOUT.format(ms=int(limit * 1000)))


RECV = dict(peer=1, stages=(1, 0), ranks=(1, 0), receiving=True, what="activation gradients", iteration=17)


def _watch(timeout_s: float = 60.0) -> tuple[PeerWatch, FakeClock]:
    clock = FakeClock()
    return PeerWatch(timeout_s, clock=clock, wall=lambda: 1_700_000_000.0 + clock.now), clock


def test_a_silent_peer_stops_the_wait_at_the_bound_naming_link_iteration_and_last_data():
    watch, clock = _watch(60)
    watch.arrived(1)
    clock.now += 5.0  # this rank computed for 5 s since the peer's last message
    work = FakeWork(clock)  # never completes
    start = clock.now
    with pytest.raises(PeerTimeoutError) as caught:
        watch.wait(work, **RECV)
    err = caught.value
    assert clock.now - start == 60.0 and work.timeouts == [datetime.timedelta(seconds=60)]
    assert (err.link, err.ranks, err.iteration, err.waited_s, err.last_heard_s) == ((1, 0), (1, 0), 17, 60.0, 65.0)
    text = str(err)
    assert text.startswith("megatron_tah: link stage 1 -> stage 0, iteration 17 (world rank 1 -> 0): no activation "
                           "gradients arrived within --tah-peer-timeout-s 60 s; data from stage 1 last arrived ")
    assert "(65.0 s ago)" in text and "restarted from its last checkpoint" in text
    assert isinstance(err, LinkError) and "Timed out waiting 60000ms" in str(err.__cause__)


def test_an_outage_shorter_than_the_bound_is_ridden_out_and_costs_its_duration():
    watch, clock = _watch(60)
    watch.arrived(1)
    start = clock.now
    watch.wait(FakeWork(clock, completes_after=20.0), **RECV)  # no error
    assert clock.now - start == 20.0


def test_a_dead_peer_is_named_at_once_not_after_the_bound():
    watch, clock = _watch(60)
    watch.arrived(1)
    with pytest.raises(PeerLostError) as caught:
        watch.wait(FakeWork(clock, fails_after=0.5), **RECV)
    assert caught.value.waited_s == 0.5
    assert str(caught.value).startswith("megatron_tah: link stage 1 -> stage 0, iteration 17 (world rank 1 -> 0): the "
                                        "link failed after 0.5 s waiting for activation gradients (RuntimeError: ")
    assert "Connection closed by peer" in str(caught.value) and "died" in str(caught.value)


def test_a_send_that_cannot_be_delivered_names_the_link_it_goes_on():
    watch, clock = _watch(30)
    watch.arrived(1)
    with pytest.raises(PeerTimeoutError, match=r"^megatron_tah: link stage 0 -> stage 1, iteration 3 \(world rank "
                                               r"0 -> 1\): could not send the activations within --tah-peer-timeout-s 30 s; "
                                               r"data from stage 1 last arrived"):
        watch.wait(FakeWork(clock), peer=1, stages=(0, 1), ranks=(0, 1), receiving=False, what="activations",
                   iteration=3)


def test_a_transfer_the_backend_refuses_to_post_is_named_when_waited_for():
    """gloo raises at ``isend`` when the peer's connection has already closed: the refusal is kept and raised by the
    wait, as a lost peer naming the link -- never complete, so no wait skips it."""
    from megatron_tah.link.peer import FailedPost, posted

    def refuse():
        raise RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer [127.0.0.1]:1234")

    failed = posted(refuse)
    assert isinstance(failed, FailedPost) and not failed.is_completed()
    batch = posted(refuse, 3)  # a batch_isend_irecv of 3 ops
    assert len(batch) == 3 and all(isinstance(w, FailedPost) for w in batch)
    assert posted(lambda: "work") == "work"
    watch, _ = _watch(30)
    watch.arrived(1)
    with pytest.raises(PeerLostError, match=r"^megatron_tah: link stage 0 -> stage 1, iteration 3 \(world rank 0 -> "
                                            r"1\): the link failed after 0.0 s waiting for activations \(RuntimeError: "
                                            r".*Connection closed by peer"):
        watch.wait(failed, peer=1, stages=(0, 1), ranks=(0, 1), receiving=False, what="activations", iteration=3)


def test_before_the_first_message_from_a_peer_the_bound_has_the_start_up_allowance():
    """Start-up (building the model, compiling kernels, auto's cost table) may keep a peer silent longer than the
    bound: until data has arrived from it, a wait is bounded by --tah-peer-timeout-s + --tah-peer-start-up-s, and
    its error says so; then by the bound alone."""
    clock = FakeClock()
    watch = PeerWatch(60, clock=clock, wall=lambda: 1_700_000_000.0 + clock.now, start_up_s=240)
    work = FakeWork(clock, completes_after=250.0)
    watch.wait(work, **RECV)
    assert work.timeouts == [datetime.timedelta(seconds=300)]
    start = clock.now
    with pytest.raises(PeerTimeoutError, match=r"within 300 s \(--tah-peer-timeout-s 60 \+ --tah-peer-start-up-s "
                                               r"240: no data had arrived from this peer yet\).*last arrived never"):
        watch.wait(FakeWork(clock), **{**RECV, "peer": 2})
    assert clock.now - start == 300.0
    work = FakeWork(clock, completes_after=1.0)
    watch.wait(work, **RECV)  # peer 1 has been heard from
    assert work.timeouts == [datetime.timedelta(seconds=60)]


@pytest.mark.parametrize("timeout_s, bounded", [(0.0, True), (60.0, False)])
def test_no_bound_of_its_own_when_off_or_on_nccl(timeout_s, bounded):
    """0 leaves Megatron's timeouts; on NCCL a timeout would turn the stream wait into a host-blocking one, so the
    process group's timeout (its watchdog) bounds the operation instead."""
    watch, clock = _watch(timeout_s)
    watch.arrived(1)
    work = FakeWork(clock, completes_after=1.0)
    watch.wait(work, **RECV, bounded=bounded)
    assert work.timeouts == [None]


def test_the_bound_is_a_validated_option():
    assert TahConfig().tah_peer_timeout_s == 120.0 and TahConfig().is_off()
    with pytest.raises(ValueError, match="tah_peer_timeout_s = -1"):
        TahConfig(tah_peer_timeout_s=-1)
    with pytest.raises(ValueError, match="timeout_s"):
        PeerWatch(float("nan"))
    assert TahConfig().tah_peer_start_up_s == 60.0
    with pytest.raises(ValueError, match="tah_peer_start_up_s = -1"):
        TahConfig(tah_peer_start_up_s=-1)


# ----- the real transport, two gloo processes ------------------------------------------------------------
class _Died(Exception):
    """Stage 1's end in the "dead" scenario."""


@contextlib.contextmanager
def _megatron_iteration(iteration):
    """Megatron's global args with ``curr_iteration`` (what the link reads) for the body; the project uninstalled
    and the args cleared after it."""
    import types

    import megatron_tah
    from megatron.training import global_vars

    args = types.SimpleNamespace(curr_iteration=iteration)
    global_vars._GLOBAL_ARGS = args
    try:
        yield args
    finally:
        megatron_tah.uninstall()
        global_vars._GLOBAL_ARGS = None


def _what_it_raised(call, start):
    """("no error", seconds) after ``call()``, or the LinkError's (class, text, link, iteration, seconds since
    ``start``, a ``time.monotonic()`` reading, or the call's start when None)."""
    start = time.monotonic() if start is None else start
    try:
        call()
        return ("no error", time.monotonic() - start)
    except LinkError as err:
        return (type(err).__name__, str(err), err.link, err.iteration, time.monotonic() - start)


def _silent_or_dead_peer(rank, world_size, fate, bound):
    """Two exchanges; then stage 1 goes silent (sleeps), dies (its process exits) or goes quiet for less than the bound, while
    stage 0 posts its third exchange at iteration 7. Returns (what stage 0 raised, seconds its wait took)."""
    import megatron_tah
    from tests.link.test_message import SHAPE, _exchange

    x = torch.randn(SHAPE)
    with _megatron_iteration(0) as args:
        megatron_tah.install(tah_preset="paper", tah_backend="torch", tah_peer_timeout_s=bound)
        for args.curr_iteration in (5, 6):
            _exchange(rank, True, x, x)
        args.curr_iteration = 7
        if rank == 1:
            if fate == "dead":  # its process ends at once (the harness's os._exit after an error, no orderly
                raise _Died()  # shutdown of the process group): the kernel closes its connections, as when killed
            time.sleep({"silent": bound + 8.0, "outage": bound / 3}[fate])
            if fate == "silent":
                return "slept"
        return _what_it_raised(lambda: _exchange(rank, True, x, x), None)


@pytest.mark.distributed
@pytest.mark.parametrize("fate", ["silent", "dead", "outage"])
def test_a_silent_or_dead_peer_stops_the_transport_within_the_bound(fate):
    from tests.helpers.dist_utils import RankFailure, run_distributed

    bound = 6.0
    results = run_distributed(_silent_or_dead_peer, 2, fate, bound, timeout=240, grace=30, return_exceptions=True)
    stage0 = results[0]
    assert not isinstance(stage0, RankFailure), stage0
    if fate == "dead":
        assert isinstance(results[1], RankFailure) and results[1].type_name == "_Died", results[1]
    if fate == "outage":  # stage 1 was quiet for bound / 3: ridden out
        assert stage0[0] == "no error" and bound / 3 - 0.5 <= stage0[1] < bound, stage0
        return
    name, text, link, iteration, seconds = stage0
    # Stage 0 waits for its send first (gloo completes a send once the receiver has taken it), then its receive.
    assert link in ((0, 1), (1, 0)) and iteration == 7, stage0
    sender, receiver = link
    assert text.startswith(f"megatron_tah: link stage {sender} -> stage {receiver}, iteration 7 (world rank {sender} "
                           f"-> {receiver}): "), text
    assert "data from stage 1 last arrived" in text, text
    if fate == "silent":
        assert name == "PeerTimeoutError" and bound - 0.5 <= seconds <= bound + 3.0, stage0
        assert "within --tah-peer-timeout-s 6 s" in text and "s ago)" in text
    else:
        assert name == "PeerLostError" and seconds < bound, stage0
        assert "Connection closed by peer" in text or "Connection reset" in text, text


# ----- the Megatron side: the process groups' timeout, saves, a collective's failure named -----------------
class _Registry:
    """A stand-in for ``registry.REGISTRY`` (the wrappers read ``config`` and ``bounded_groups``)."""

    def __init__(self, config):
        self.config, self.bounded_groups = config, None


def _patched(monkeypatch, config, args):
    from megatron_tah.megatron import peer_timeout

    calls = []
    registry = _Registry(config)
    monkeypatch.setattr(peer_timeout, "REGISTRY", registry)
    monkeypatch.setattr(peer_timeout, "_megatron_args", lambda: args)
    monkeypatch.setattr(peer_timeout, "set_group_timeouts", lambda timeout: calls.append(timeout) or 3)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    return peer_timeout, registry, calls


def test_the_process_groups_get_the_bound_after_the_first_step_and_the_start_up_timeout_during_saves(monkeypatch):
    import types

    args = types.SimpleNamespace(distributed_timeout_minutes=10, distributed_timeout_seconds_after_init=None,
                                 curr_iteration=4)
    peer_timeout, registry, calls = _patched(monkeypatch, TahConfig(tah_preset="paper", tah_peer_timeout_s=45), args)
    step = peer_timeout._bounding_after_the_first_step(lambda *a, **k: "stepped")
    save = peer_timeout._saving_with_the_start_up_timeout(lambda *a, **k: calls.append("saved"))
    save()  # before the first step: Megatron's own timeouts, nothing to lift
    assert calls == ["saved"] and registry.bounded_groups is None
    assert step() == "stepped" and step() == "stepped"
    assert calls == ["saved", datetime.timedelta(seconds=45)] and registry.bounded_groups == 45.0  # once
    save()
    assert calls[2:] == [datetime.timedelta(minutes=10), "saved", datetime.timedelta(seconds=45)]


@pytest.mark.parametrize("config, after_init", [(TahConfig(tah_preset="paper", tah_peer_timeout_s=0), None),
                                                (TahConfig(tah_preset="paper"), 300), (None, None)])
def test_the_groups_keep_megatrons_timeouts_when_off_or_megatrons_own_option_is_given(monkeypatch, config, after_init):
    import types

    args = types.SimpleNamespace(distributed_timeout_minutes=10, distributed_timeout_seconds_after_init=after_init)
    peer_timeout, registry, calls = _patched(monkeypatch, config, args)
    peer_timeout._bounding_after_the_first_step(lambda: None)()
    assert calls == [] and registry.bounded_groups is None


def test_a_collectives_failure_names_the_stage_iteration_and_when_each_neighbour_was_last_heard(monkeypatch):
    import types

    args = types.SimpleNamespace(distributed_timeout_minutes=10, curr_iteration=23)
    peer_timeout, registry, _ = _patched(monkeypatch, TahConfig(tah_preset="paper"), args)
    registry.bounded_groups = 120.0
    watch, clock = _watch(120)
    watch.arrived(0)
    clock.now += 121.0
    monkeypatch.setattr(peer_timeout, "installed_transport", lambda: types.SimpleNamespace(peers=watch))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)

    def train():
        raise RuntimeError(GLOO_TIMEOUT.format(ms=120000))

    with pytest.raises(PeerTimeoutError) as caught:
        peer_timeout._naming_failures(train)()
    text = str(caught.value)
    assert text.startswith("megatron_tah: world rank 1, iteration 23: a collective between stages timed out "
                           "(process groups' timeout: 120 s, --tah-peer-timeout-s)"), text
    assert "from world rank 0: " in text and "(121.0 s ago)" in text
    for unrelated in (ValueError("bad value"), RuntimeError("CUDA out of memory")):
        def failing(err=unrelated):
            raise err
        with pytest.raises(type(unrelated)) as other:
            peer_timeout._naming_failures(failing)()
        assert other.value is unrelated  # not a backend failure: unchanged


def test_the_error_that_ends_the_training_loop_is_recorded_for_the_restart_loop(monkeypatch, tmp_path):
    """A collective's lost connection is recorded as secondary (a neighbour died), the transport's checksum error
    as the cause, and any other error too; each rank in its own file (``megatron/failures.py``)."""
    import types

    from megatron_tah.codecs.core.errors import PayloadChecksumError
    from megatron_tah.megatron import failures

    args = types.SimpleNamespace(distributed_timeout_minutes=10, curr_iteration=6)
    peer_timeout, _, _ = _patched(monkeypatch, TahConfig(tah_preset="paper"), args)
    monkeypatch.setattr(peer_timeout, "installed_transport", lambda: None)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setenv(failures.ENV, str(tmp_path))
    checksum = PayloadChecksumError("tah: 1 buffer(s) failed the payload checksum", codec="tah").at(0, 1, 6)
    for rank, err, expected in ((0, RuntimeError(GLOO_CLOSED), PeerLostError), (1, checksum, PayloadChecksumError),
                                (2, KeyError("tokens"), KeyError)):
        monkeypatch.setattr(torch.distributed, "get_rank", lambda rank=rank: rank)

        def failing(err=err):
            raise err

        with pytest.raises(expected):
            peer_timeout._naming_failures(failing)()
    lost, cause, other = failures.read(tmp_path)
    assert (lost.rank, lost.error, lost.secondary, lost.iteration) == (0, "PeerLostError", True, 6)
    assert lost.message.startswith("megatron_tah: world rank 0, iteration 6: a collective between stages failed")
    assert (cause.rank, cause.error, cause.secondary, cause.link, cause.iteration) == \
        (1, "PayloadChecksumError", False, (0, 1), 6)
    assert (other.rank, other.error, other.secondary) == (2, "KeyError", False)
    assert failures.first_error([lost, cause, other]) == cause


# ----- from the first byte: the handshake, the first message and a place's collective, measured -------------
START_BOUND, START_UP = 3.0, 2.0  # --tah-peer-timeout-s and --tah-peer-start-up-s of these runs
LATE_S = 5.0  # how late past the bound an error may surface on a loaded machine (far from the group's 10 minutes)


def _silent_from_the_start(rank, world_size, where):
    """Stage 1 stays silent (sleeps) at ``where``: before the settings check of ``install``, before the
    handshake, after it before its first message, before a data-parallel int8 all-reduce, or before the first
    tied-embedding exchange; stage 0 goes on. Returns stage 0's (error class, text, link, iteration, seconds its
    wait took)."""
    import types

    import megatron_tah
    from megatron_tah.link.handshake import check_group
    from megatron_tah.megatron import collectives, embedding
    from megatron_tah.megatron.bounded import collective_wait
    from megatron_tah.megatron.pipeline_parallel import installed_transport
    from tests.link.test_message import SHAPE, _exchange

    config = TahConfig(tah_preset="paper", tah_backend="torch", tah_peer_timeout_s=START_BOUND,
                       tah_peer_start_up_s=START_UP)
    world, x = torch.distributed.group.WORLD, torch.randn(SHAPE)
    silent_for = START_BOUND + START_UP + 8.0

    def first_wait():
        if where == "dp collective":
            codec = config.build_codec("int8", 8, config.tah_int8_block_size)
            collectives.all_reduce(codec, torch.randn(4096), world,
                                   wait=collective_wait(config, world, prefix="data-parallel int8 "))
        elif where == "embedding exchange":
            place = types.SimpleNamespace(config=config, state={})
            codec = config.build_codec("int8", 8, config.tah_int8_block_size)
            embedding.exchange(codec, torch.randn(64, 16), world, 1, first=True,
                               wait=embedding._watched(place, world, world, 1, first=True))
        else:
            _exchange(rank, True, x, x)

    # both ranks past their imports before either installs: under load one rank's imports may trail the other's by
    # more than the bounds here (5 s), and the first rank's own settings check would then end the run instead
    torch.distributed.barrier()
    with _megatron_iteration(1):
        if rank == 1:
            if where != "settings check":
                megatron_tah.install(config)
            if where == "first message":
                transport = installed_transport()
                check_group(config, world, x.device, transport.handshake_wait(world))
            time.sleep(silent_for)
            return "slept"
        if where == "settings check":  # the wait is install's own check of the group's settings
            return _what_it_raised(lambda: megatron_tah.install(config), None)
        megatron_tah.install(config)
        return _what_it_raised(first_wait, None)


@pytest.mark.distributed
@pytest.mark.parametrize("where", ["settings check", "handshake", "first message", "dp collective",
                                   "embedding exchange"])
def test_a_peer_silent_from_the_start_stops_the_run_within_the_bound_and_the_start_up_allowance(where):
    """No wait is left to the process group's timeout (here Megatron's default, 10 minutes): the first wait on a
    peer ends at --tah-peer-timeout-s + --tah-peer-start-up-s, naming the link or group, the ranks and the
    iteration."""
    from tests.helpers.dist_utils import RankFailure, run_distributed

    results = run_distributed(_silent_from_the_start, 2, where, timeout=120, grace=20, return_exceptions=True)
    stage0 = results[0]
    assert not isinstance(stage0, RankFailure) and stage0[0] == "PeerTimeoutError", stage0
    _, text, link, iteration, seconds = stage0
    print(f"{where}: PeerTimeoutError after {seconds:.2f} s (bound {START_BOUND:g} + allowance {START_UP:g} s)")
    limit = START_BOUND + START_UP  # + the scheduling of a loaded machine: 2.34 s more at a load average near 50
    assert limit - 0.5 <= seconds <= limit + LATE_S and iteration == 1, stage0
    if where in ("dp collective", "settings check"):
        what = "data-parallel int8 all-to-all" if where == "dp collective" else "settings check lengths all-gather"
        assert link is None and text.startswith(f"megatron_tah: world rank 0, {what} over world ranks [0, 1], "
                                                "iteration 1: world rank(s) [1] did not answer within 5 s "
                                                "(--tah-peer-timeout-s 3 + --tah-peer-start-up-s 2"), text
    else:
        sender, receiver = link
        assert text.startswith(f"megatron_tah: link stage {sender} -> stage {receiver}, iteration 1 (world rank "
                               f"{sender} -> {receiver}): "), text
        assert "within 5 s (--tah-peer-timeout-s 3 + --tah-peer-start-up-s 2: no data had arrived" in text, text
        assert ("codec configurations" in text) == (where == "handshake"), text
