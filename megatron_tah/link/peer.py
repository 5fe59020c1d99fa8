"""A pipeline rank's neighbours: when data last arrived from each, and waits bounded by ``--tah-peer-timeout-s``.

``PeerWatch.wait(work, ...)`` is how the transport waits for one posted message (``message.Message``).

* **Bounded** (``bounded=True``: gloo, whose waits block the host anyway): every wait passes ``timeout`` to
  ``Work.wait`` (gloo raises after that long, point-to-point and collective alike; checked on torch 2.14), and
  the wait raises :class:`PeerTimeoutError`. The timeout is ``--tah-peer-timeout-s``; until data has arrived
  from the peer once (the handshake, auto's latency probes, the first message: a peer may still be building
  its model, loading data or compiling kernels) it is ``--tah-peer-timeout-s + --tah-peer-start-up-s``.
* **Unbounded** (``bounded=False``: NCCL, where ``Work.wait()`` only makes the current stream wait and a
  timeout would turn it into a host-blocking wait): the process group's timeout bounds the operation
  instead (NCCL's watchdog; the Megatron plugin sets it to the same bound after the first iteration).
* A wait that fails for another reason -- the peer's process died and its connections closed (gloo:
  ``Connection closed by peer``) -- raises :class:`PeerLostError`. So does a transfer the backend refused to
  post for that reason (``posted``: the refusal is kept as a ``FailedPost`` whose wait raises it).

Both name the link (``link stage 1 -> stage 0``, the stages of ``codecs.core.errors.link_text``), the world ranks,
the iteration and when data from the peer last arrived, and are raised from the backend's error. The
clocks are injectable (``clock``: seconds for durations, ``wall``: the time of day shown), for tests.
"""

from __future__ import annotations

import datetime
import time
from typing import Callable

from ..codecs.core.errors import link_text

TIMEOUT_MARKERS = ("timed out", "timeout")  # what gloo's and NCCL's timeout messages say (lower case)


class LinkError(RuntimeError):
    """A pipeline link failed while this rank waited on another stage. ``link`` (sender stage, receiver stage)
    and ``ranks`` (sender, receiver world ranks): None when the wait was a collective, not a pipeline message
    (``megatron/peer_timeout.py``); ``iteration`` (None outside the training loop); ``waited_s`` (how long the
    wait lasted, None: unknown); ``last_heard_s`` (seconds since data last arrived from the peer; None: never)."""

    def __init__(self, message: str, *, link: tuple[int, int] | None, ranks: tuple[int, int] | None,
                 iteration: int | None, waited_s: float | None, last_heard_s: float | None):
        super().__init__(message)
        self.link, self.ranks, self.iteration = link, ranks, iteration
        self.waited_s, self.last_heard_s = waited_s, last_heard_s


class PeerTimeoutError(LinkError):
    """No message arrived on a link within the bound: the peer is frozen, cut off or far behind."""


class PeerLostError(LinkError):
    """A link's connection failed (its peer's process died, or the backend gave up on it)."""


class FailedPost:
    """A transfer the backend refused to post (e.g. the peer's connection had closed): never complete; its
    ``wait()`` raises the refusal, so the peer watch's wait names the link like any failed wait."""

    def __init__(self, error: Exception):
        self.error = error

    def wait(self, timeout=None):
        raise self.error

    def is_completed(self) -> bool:
        return False


def posted(post: Callable[[], object], count: int | None = None):
    """``post()`` (a ``dist.isend``/``irecv``, or with ``count`` a ``batch_isend_irecv`` of that many ops); when the
    backend raises, its error as one ``FailedPost`` (or ``count`` of them) to wait on instead."""
    try:
        return post()
    except RuntimeError as err:
        failed = FailedPost(err)
        return failed if count is None else [failed] * count


def posted_batch(ops: list) -> list:
    """``dist.batch_isend_irecv(ops)``: one work per op (a backend may return one work for the whole batch), or
    when the backend raises, a ``FailedPost`` per op."""
    import torch.distributed as dist

    works = posted(lambda: dist.batch_isend_irecv(ops), len(ops))
    return works if len(works) == len(ops) else [works[-1] if works else None] * len(ops)


class PeerWatch:
    """Per peer (world rank): the time data last arrived from it; waits bounded by ``timeout_s`` (0: unbounded),
    the first ones on a peer by ``timeout_s + start_up_s``."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, start_up_s: float = 0.0):
        if not timeout_s >= 0:
            raise ValueError(f"timeout_s = {timeout_s!r}: must be >= 0 (0: no bound of its own)")
        if not start_up_s >= 0:
            raise ValueError(f"start_up_s = {start_up_s!r}: must be >= 0")
        self.timeout_s, self.start_up_s = float(timeout_s), float(start_up_s)
        self.clock, self.wall = clock, wall
        self.heard: dict[int, tuple[float, float]] = {}  # peer -> (clock, wall) of the last message from it

    def arrived(self, peer: int) -> None:
        """A message from ``peer`` has completed."""
        self.heard[int(peer)] = (self.clock(), self.wall())

    def last_heard(self, peer: int) -> str:
        """``"16:42:03 (61.2 s ago)"``, or ``"never"``."""
        if peer not in self.heard:
            return "never"
        at, wall = self.heard[peer]
        return f"{time.strftime('%H:%M:%S', time.localtime(wall))} ({self.clock() - at:.1f} s ago)"

    def wait(self, work, *, peer: int, stages: tuple[int, int], ranks: tuple[int, int], receiving: bool,
             what: str, iteration: int | None, bounded: bool = True, start_up: bool = False) -> None:
        """Wait for ``work`` (a posted message to or from ``peer``); raise a :class:`LinkError` naming the link
        (``stages``, ``ranks``: sender and receiver) when it times out or fails. ``what``: the message's
        content for the error ("activations", "activation gradients"). ``start_up``: a start-up exchange (the
        handshake), waited alike but not counted as data from the peer (its first message may follow a long
        first encode)."""
        limit = None
        if bounded and self.timeout_s > 0:
            limit = self.timeout_s + (0.0 if peer in self.heard else self.start_up_s)
        failed = _wait_within(work, limit, self.clock)
        if failed is not None:
            err, waited, timed_out = failed
            raise self._error(err, timed_out, peer, stages, ranks, receiving, what, iteration, waited,
                              limit) from err
        if receiving and not start_up:
            self.arrived(peer)

    def _error(self, err, timed_out: bool, peer, stages, ranks, receiving: bool, what: str, iteration,
               waited: float, limit: float | None) -> LinkError:
        where = f"{link_text(*stages, iteration)} (world rank {ranks[0]} -> {ranks[1]})"
        heard = f"data from stage {stages[0] if receiving else stages[1]} last arrived {self.last_heard(peer)}"
        verb = "no" if receiving else "could not send the"
        if timed_out:
            bound = ("within the process group's timeout (Megatron's --distributed-timeout-minutes; "
                     "--tah-peer-timeout-s is 0 or the backend is NCCL)" if limit is None else
                     f"within --tah-peer-timeout-s {limit:g} s" if peer in self.heard else
                     f"within {limit:g} s (--tah-peer-timeout-s {self.timeout_s:g} + --tah-peer-start-up-s "
                     f"{self.start_up_s:g}: no data had arrived from this peer yet)")
            text = (f"megatron_tah: {where}: {verb} {what} {'arrived ' if receiving else ''}{bound}; {heard}. "
                    "The peer stage is frozen, cut off or far behind; this rank stops so that the job can be "
                    "restarted from its last checkpoint")
            cls = PeerTimeoutError
        else:
            text = (f"megatron_tah: {where}: the link failed after {waited:.1f} s waiting for {what} "
                    f"({type(err).__name__}: {str(err).strip()}); {heard}. The peer stage's process has likely "
                    "died; this rank stops so that the job can be restarted from its last checkpoint")
            cls = PeerLostError
        last = None if peer not in self.heard else self.clock() - self.heard[peer][0]
        return cls(text, link=tuple(stages), ranks=tuple(ranks), iteration=iteration, waited_s=waited,
                   last_heard_s=last)


def _wait_within(work, limit: float | None, clock: Callable[[], float]):
    """``work.wait()`` within ``limit`` seconds (None: the process group's own timeout). None when it completed;
    else the backend's error, the seconds waited and whether it was a timeout (the limit reached, or the backend
    says so). A :class:`LinkError` raised inside passes through."""
    start = clock()
    try:
        if limit is None:
            work.wait()
        else:
            work.wait(datetime.timedelta(seconds=limit))
    except LinkError:
        raise
    except Exception as err:  # noqa: BLE001 (the backend's error, named and chained by the caller)
        waited = clock() - start
        timed_out = (limit is not None and waited >= 0.99 * limit) or any(
            marker in str(err).lower() for marker in TIMEOUT_MARKERS)
        return err, waited, timed_out
    return None


def wait_collective(work, *, timeout_s: float, what: str, ranks: list[int], me: int, iteration: int | None,
                    start_up_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
    """Wait for a collective's ``work`` (``what``: e.g. "data-parallel int8 all-reduce") over the group of world
    ``ranks`` within ``timeout_s + start_up_s`` (``timeout_s`` 0: ``work.wait()``, the process group's own
    timeout); raise :class:`PeerTimeoutError` / :class:`PeerLostError` naming the group, the ranks that may not
    have answered (the others of the group), this rank and the iteration."""
    limit = timeout_s + start_up_s if timeout_s > 0 else None
    failed = _wait_within(work, limit, clock)
    if failed is None:
        return
    err, waited, timed_out = failed
    others = [r for r in ranks if r != me]
    where = (f"world rank {me}, {what} over world ranks {list(ranks)}"
             + ("" if iteration is None else f", iteration {iteration}"))
    if timed_out:
        bound = ("within the process group's timeout" if limit is None else
                 f"within --tah-peer-timeout-s {timeout_s:g} s" if not start_up_s else
                 f"within {limit:g} s (--tah-peer-timeout-s {timeout_s:g} + --tah-peer-start-up-s {start_up_s:g}:"
                 " the group's first collective)")
        text = (f"megatron_tah: {where}: world rank(s) {others} did not answer {bound}. A rank is frozen, cut "
                "off or far behind; this rank stops so that the job can be restarted from its last checkpoint")
        cls = PeerTimeoutError
    else:
        text = (f"megatron_tah: {where}: failed after {waited:.1f} s ({type(err).__name__}: {str(err).strip()}); "
                f"world rank(s) {others} likely died; this rank stops so that the job can be restarted from its "
                "last checkpoint")
        cls = PeerLostError
    raise cls(text, link=None, ranks=None, iteration=iteration, waited_s=waited, last_heard_s=None) from err
