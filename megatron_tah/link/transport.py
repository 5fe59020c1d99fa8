"""The pipeline transport: one process's pipeline messages moved as codec buffers (``PipelineTransport``).

``batched_p2p_ops`` and ``p2p_ops`` take megatron-core's transport arguments (``_batched_p2p_ops`` /
``_p2p_ops``: the tensors to send and receive, the process group, the peers' ranks; the pipeline place
``megatron/pipeline_parallel.py`` puts them in megatron-core's place) and keep its calling contract and
message pattern -- one message per direction per call, same peers, same process groups, same posting
order -- but each message is a codec's uint8 buffer (``wire.py``). The transport reads nothing of
Megatron: what it needs from the training loop is given at construction (``iteration``: the current
training iteration, the same on every stage; ``virtual_stages``: the interleaved schedule's size; ``depth``
and ``stage``: the pipeline's stages and this rank's).

* ``send_next`` / ``recv_prev`` carry activations through the *forward* codec, ``send_prev`` / ``recv_next``
  activation gradients through the *backward* codec, each on its link end (``link.Link``: its codec, its
  counters and the steps its messages go through between the codec and the wire, ``steps.py``). A send
  encodes, hands the buffer to the steps and posts what they made; a receive posts the bytes the codec and
  the steps say and, once complete, hands it back through the steps and decodes into Megatron's receive
  tensor under ``no_grad``. The batched path waits and decodes before returning ``[]``; the unbatched path
  returns handles whose ``.wait()`` waits, then decodes (every posted message is held, its ``Work`` and
  buffers with it, until finished: ``message.Outbox``).
* The first call on a process group all-gathers every stage's codec configs over it (each stage reaches its
  first p2p call without waiting on another, so this cannot deadlock) and raises ``CodecMismatchError`` on both
  ends of a link whose stages use other codecs (``handshake.py``); with the trailer on, it also measures each
  neighbour's latency.
* Host staging (``message.HostStaging``, per link end): on a gloo group with CUDA tensors or
  ``--tah-share-gpus``, wire buffers cross through pinned host memory; the bytes on the wire are the same.
* Message lengths (``--tah-entropy-coding``): on ``exact_backends`` a receive posts the most a message can be;
  elsewhere a frame, and what does not fit follows as a second message (``frames.py``, ``message.post_rests``).
* A corrupted message (``--tah-wire-checksum``) raises ``PayloadChecksumError`` naming the link's stages and
  the training iteration; every wait goes through ``peer.PeerWatch``, which bounds it (``peer.py``).
* Statistics go to the sink it is given (``record_send``, ``record_codec_time``, ``record_auto``:
  ``megatron/stats.py``'s ``Stats``), counting the bytes that cross the network.

Elsewhere: a link end's boundary, codec (CUDA graphs: ``codecs.core.graphs.place_codec``) and steps, and what the
link ends share -- which codec a message goes through (the warm-up, uncompressed evaluations, auto's choice per
iteration), AQ-SGD's sample ids, the codecs' state for checkpoints: ``link.py``; a message's life (its buffers,
the outbox, its length, second messages): ``message.py``; the trailer and its step: ``wire.py``; the emulated
slow link, a link end's last step: ``emulate.py``.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from ..codecs import PayloadChecksumError
from ..codecs.core import timing
from ..codecs.core.graphs import CudaGraphs, eager
from ..config import TahConfig
from .emulate import InboundWire, emulation
from .handshake import CodecMismatchError, check_group, check_schedule, link_latency
from .link import CodecStates, Link, SampleIds, Traffic, open_link
from .message import Handle, Message, Outbox, post_rests
from .peer import PeerWatch, posted, posted_batch
from .steps import Outgoing
from .wire import message_extra_nbytes, time_works, wall_seconds

logger = logging.getLogger(__name__)

__all__ = ["CodecMismatchError", "PipelineTransport"]


def _unknown() -> None:
    return None


class PipelineTransport:
    """This process's pipeline transport: the configuration, the link ends and what they share (the traffic
    switch, the sample-id queue, the emulated link, their codec state), the unbatched messages not yet
    finished and the statistics sink.

    ``iteration()``: the current training iteration, the same on every stage (None: unknown, e.g.
    outside a training loop; the warm-up and auto need it). ``virtual_stages()``: the interleaved
    schedule's virtual stages (None: not interleaved). ``depth()``: the pipeline's stages (auto's steps
    multipliers; None: 1). ``stage()``: this rank's pipeline stage (``--tah-boundary-bits``: a forward link's
    boundary)."""

    def __init__(self, config: TahConfig, stats, iteration: Callable[[], int | None] = _unknown,
                 virtual_stages: Callable[[], int | None] = _unknown, depth: Callable[[], int | None] = _unknown,
                 stage: Callable[[], int | None] = _unknown):
        self.config = config
        self.stats = stats
        self.iteration, self.virtual_stages, self.depth, self.stage = iteration, virtual_stages, depth, stage
        self.emulation = emulation(config)  # the emulated link, crossed through the link ends' steps (emulate.py)
        self.links: dict[tuple[str, str, int], Link] = {}
        self.states = CodecStates(config, self.links, self.link)  # the link ends' codec state (link.py)
        self.exact_backends = ("gloo",)  # whose receives take a shorter message (frames.py; tests empty it)
        auto = config.is_auto("forward") or config.is_auto("backward")
        # the trailer after every message (wire.py): auto's, or the inbound wire's send stamp
        self.trailer_nbytes = message_extra_nbytes(auto or isinstance(self.emulation, InboundWire))
        self.billed_trailer_nbytes = self.trailer_nbytes if auto else 0  # the inbound wire bills real traffic only
        self.latency: dict[int, float] = {}  # auto: one-way latency to each neighbour (world rank), seconds
        self.traffic = Traffic(config, iteration)  # the warm-up / evaluation switch (link.py)
        self.needs_sample_ids = config.forward_codec().needs_sample_ids  # aqsgd: the schedule is checked
        self.sample_ids = SampleIds()  # AQ-SGD's (link.py)
        self.outbox = Outbox()  # unbatched messages not yet finished (message.py)
        # when each neighbour was last heard from; bounded waits
        self.peers = PeerWatch(config.tah_peer_timeout_s, start_up_s=config.tah_peer_start_up_s)
        self.checked_groups: set[int] = set()
        self.closed = False  # uninstalled: a kept reference to a replaced function must not run
        self.graphs = CudaGraphs  # how the link ends' GraphedCodecs capture (tests give a fake)
        self.graph_log: set[str] = set()  # the eager fallbacks' reasons logged, shared by the link ends
        if not config.tah_eager_codecs and auto:
            logger.info("megatron_tah: auto links call their codecs eagerly, no CUDA graphs: the choice compares "
                        "eager costs")

    # ----- link ends and their codecs ----------------------------------------------------
    def link(self, direction: str, role: str, peer: int) -> Link:
        """This rank's link end (``link.open_link`` makes it at its first use)."""
        key = (direction, role, int(peer))
        if key not in self.links:
            other = "backward" if direction == "forward" else "forward"
            self.links[key] = open_link(self.config, direction, role, int(peer), depth=self.depth, graphs=self.graphs,
                                        graph_log=self.graph_log, trailer=self.trailer_nbytes > 0,
                                        reply=lambda: self.link(other, "send", peer), latency=self.latency,
                                        stage=self.stage, emulation=self.emulation)
        return self.links[key]

    def staged(self, group, device: torch.device) -> bool:
        """Whether messages on ``group`` go through host staging: on gloo groups, with CUDA tensors or
        --tah-share-gpus (other backends read device memory themselves)."""
        if torch.distributed.get_backend(group) != "gloo":
            return False
        return self.config.tah_share_gpus or device.type == "cuda"

    # ----- messages ------------------------------------------------------------------------
    def _messages(self, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next,
                  group, prev_pipeline_rank, next_pipeline_rank) -> dict[str, Message]:
        """Start of every transport call: finish earlier handles whose transfer is done, check configs,
        encode the sends and allocate the receive buffers (Megatron's op order)."""
        if self.closed:
            raise RuntimeError("megatron_tah transport called while not installed; call megatron_tah.install()")
        self.outbox.reap(self.iteration())
        tensors = [t for t in (tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next) if t is not None]
        if not tensors:
            return {}
        if id(group) not in self.checked_groups:
            check_group(self.config, group, tensors[0].device, self.handshake_wait(group))
            if self.trailer_nbytes:
                self.latency.update(link_latency(group, tensors[0].device, self.handshake_wait(group)))
            self.checked_groups.add(id(group))
        if self.needs_sample_ids:
            check_schedule(self.config, group, tensor_send_next, tensor_recv_prev, self.virtual_stages())
        stage, stages = group.rank(), group.size()
        prev_stage, next_stage = (stage - 1) % stages, (stage + 1) % stages
        staged = self.staged(group, tensors[0].device)
        call = {"extra_nbytes": self.trailer_nbytes, "last_stage": stage == stages - 1,
                "exact": torch.distributed.get_backend(group) in self.exact_backends, "iteration": self.iteration()}
        prev, after = prev_pipeline_rank, next_pipeline_rank
        messages = {}  # Megatron's op order
        self._message(messages, "send_prev", tensor_send_prev, "backward", prev, staged, call, stage, prev_stage)
        self._message(messages, "recv_prev", tensor_recv_prev, "forward", prev, staged, call, prev_stage, stage)
        self._message(messages, "send_next", tensor_send_next, "forward", after, staged, call, stage, next_stage)
        self._message(messages, "recv_next", tensor_recv_next, "backward", after, staged, call, next_stage, stage)
        return messages

    def _message(self, messages: dict, name: str, tensor: torch.Tensor | None, direction: str, peer: int,
                 staged: bool, call: dict, *stages: int) -> None:
        """``messages[name]``, a send of ``tensor`` or a receive into it (None: none) on this rank's ``direction``
        link end to ``peer``; ``stages``: (sender, receiver); ``call``: the ``Message``'s other arguments."""
        if tensor is None:
            return
        role = "send" if name.startswith("send") else "recv"
        link, known = self.link(direction, role, peer), dict(call, stages=stages)
        if role == "send":
            messages[name] = self.send(link, tensor, staged, known)
        else:
            messages[name] = self.receive(link, tensor, staged, known)

    def send(self, link: Link, x: torch.Tensor, staged: bool, known: dict) -> Message:
        """A send of ``x`` on ``link`` (``encode``), posted from a pinned host copy when ``staged`` (its second
        message, if any, copied to the host too); ``known``: the ``Message``'s other arguments."""
        host = link.host_staging(x.device) if staged else None
        buf, rest = self.encode(link, x, known["exact"])
        if rest is not None and staged:
            rest = rest.cpu()  # (gloo reads host memory)
        return Message.send(link, buf, host, rest=rest, **known)

    def encode(self, link: Link, x: torch.Tensor, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Encode one outgoing tensor on ``link`` through the codec of its next message (``Traffic.codec``; what
        else the encode takes: ``SampleIds.encode_inputs``) and pass it through the link end's steps: the whole
        message (trailer included) and the bytes that follow it as a second message (None: none); records its
        statistics (``record_send``)."""
        if link.auto is not None:
            link.auto.prepare(x)
        codec = self.traffic.codec(link)
        with torch.no_grad():
            x = x.detach()
            clock = timing.Stopwatch(x.device)
            buf = codec.encode(x, **self.sample_ids.encode_inputs(link.direction, codec))
            out = Outgoing(codec, x.shape, x.dtype, buf, clock.stop(), exact=exact)
            rel_error = self.sample_error(link, x, out)
            for step in link.steps:
                step.on_send(out)
        link.messages += 1
        self.record_send(link, x, out, rel_error)
        return out.buf, out.rest

    def receive(self, link: Link, target: torch.Tensor, staged: bool, known: dict) -> Message:
        """A receive on ``link`` into ``target`` (into a pinned host buffer when ``staged``): the bytes its codec and
        its steps say (with entropy coding the most a message can be, or framed the size both ends agree on), plus
        the trailer (``known["extra_nbytes"]``); ``known``: the ``Message``'s other arguments."""
        host = link.host_staging(target.device) if staged else None
        codec = self.traffic.codec(link)
        nbytes = codec.wire_nbytes(target.shape, target.dtype)
        for step in link.steps:
            nbytes = step.post_nbytes(codec, target.shape, target.dtype, nbytes, exact=known.get("exact", False))
        return Message.receive(link, target, codec, nbytes, host=host, **known)

    def finish(self, m: Message) -> None:
        """A message whose transfer is complete: a receive's length, the emulated link's delay, the steps'
        reading of a receive and its decode into Megatron's tensor; then its buffers go."""
        if m.done:
            return
        m.done = True
        link = m.link
        if m.is_recv:
            m.read()  # its length and its trailer (on a GPU the read waits for the data: its completion time)
        done_at = None if m.completed_at is None else wall_seconds(m.completed_at)
        for step in link.steps:
            done_at = step.on_complete(m, done_at)
        if m.is_recv:
            for step in reversed(link.steps):
                step.on_arrival(m, done_at, self.emulation is not None)
            self.peers.arrived(link.peer)
            self._decode(m)
        m.release()

    def wait(self, m: Message, work=None) -> None:
        """Wait for ``m``'s transfer (``work``, None: ``m.work``), bounded as ``peer.PeerWatch.wait`` says; a
        timeout or a lost peer raises a ``peer.LinkError`` naming the link and the iteration."""
        me = torch.distributed.get_rank()
        ranks = (m.link.peer, me) if m.is_recv else (me, m.link.peer)
        what = "activations" if m.link.direction == "forward" else "activation gradients"
        self.peers.wait(m.work if work is None else work, peer=m.link.peer, stages=m.stages, ranks=ranks,
                        receiving=m.is_recv, what=what, iteration=self.iteration(), bounded=m.bounded)

    def handshake_wait(self, group):
        """The handshake's bounded wait on ``group`` (``handshake.Wait``), through the peer watch."""
        dist = torch.distributed

        def wait(work, peer: int, receiving: bool, what: str) -> None:
            me, stage, peer_stage = dist.get_rank(), group.rank(), dist.get_group_rank(group, peer)
            stages, ranks = ((peer_stage, stage), (peer, me)) if receiving else ((stage, peer_stage), (me, peer))
            self.peers.wait(work, peer=peer, stages=stages, ranks=ranks, receiving=receiving, what=what,
                            iteration=self.iteration(), bounded=dist.get_backend(group) == "gloo", start_up=True)

        return wait

    def _decode(self, m: Message) -> None:
        """Decode a received message into Megatron's receive tensor; a checksum failure names the link and
        iteration; an activation's sample ids (aqsgd) go on to the next stage's queue."""
        codec, link, wire = m.codec, m.link, m.codec_buffer()
        clock = timing.Stopwatch(wire.device)
        with torch.no_grad():
            for step in reversed(link.steps):
                wire = step.on_receive(m, wire)
            try:
                codec.decode(wire, m.target.shape, m.target.dtype, out=m.target)
                if codec.checksum:  # this message's count (CPU), or what has reached the host (CUDA: no sync)
                    codec.raise_deferred_errors(wire.device)
            except PayloadChecksumError as err:
                raise err.at(*m.stages, self.iteration()) from err
        self.stats.record_codec_time(link.direction, decode_seconds=clock.stop())
        link.messages += 1
        self.sample_ids.received(m)

    # ----- statistics ----------------------------------------------------------------------
    def sample_error(self, link: Link, x: torch.Tensor, out: Outgoing) -> torch.Tensor | None:
        """The statistics' sample of the codec's relative error on ``x``, from a trial decode of ``out.buf`` (the
        codec's buffer, before the steps) on the sender: every ``--tah-error-sample-interval``-th message of
        ``link``. None otherwise, and for the uncompressed codec and a codec fed sample ids (a decode would move
        its per-sample buffers)."""
        interval, codec = self.config.tah_error_sample_interval, out.codec
        if not interval or codec.needs_sample_ids or codec is self.traffic.uncompressed or link.messages % interval:
            return None
        return timing.relative_error(x, eager(codec).decode(out.buf, x.shape, x.dtype))

    def record_send(self, link: Link, x: torch.Tensor, out: Outgoing, rel_error) -> None:
        """A sent message's statistics: its encode time, auto's choice and measured rate, the bytes that cross the
        network (the inbound wire's send stamp is not traffic) and ``rel_error`` (``sample_error``)."""
        self.stats.record_codec_time(link.direction, encode_seconds=out.encode_seconds)
        if link.auto is not None:
            rate = link.auto.rate
            self.stats.record_auto(link.peer, link.auto.current,
                                   rate.rate_bps if rate else None, rate.spread_bps if rate else None)
        wire_nbytes = out.buf.numel() - self.trailer_nbytes + self.billed_trailer_nbytes
        wire_nbytes += 0 if out.rest is None else out.rest.numel()
        self.stats.record_send(link.direction, x.numel() * x.element_size(), wire_nbytes, link.peer,
                               rel_error=rel_error, rotated_fraction=getattr(out.codec, "last_rotated", None))

    # ----- the transport calls ---------------------------------------------------------------
    def batched_p2p_ops(self, *, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next,
                        group, prev_pipeline_rank, next_pipeline_rank):
        """Compressing ``_batched_p2p_ops``: one batch of uint8 messages, waited and decoded; returns ``[]``."""
        dist = torch.distributed
        messages = self._messages(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next,
                                  group, prev_pipeline_rank, next_pipeline_rank)
        if not messages:
            return []
        timed = time_works(group)
        for m in messages.values():
            m.stamp()
            m.group = group
        ops = [dist.P2POp(dist.irecv if m.is_recv else dist.isend, m.buf, m.link.peer, group)
               for m in messages.values()]
        bounded = dist.get_backend(group) == "gloo"  # (NCCL: the process group's timeout, peer.py)
        for m, work in zip(messages.values(), posted_batch(ops)):
            m.work, m.bounded, m.timed = work, bounded, timed
            self.wait(m)
            m.completed_at = time.monotonic()  # each stamped when it is done (auto's rate meter)
        for m in post_rests(messages.values()):  # both ends post theirs, then wait
            self.wait(m, m.rest_work)
        for m in messages.values():
            self.finish(m)
        return []

    def p2p_ops(self, *, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next,
                group, prev_pipeline_rank, next_pipeline_rank):
        """Compressing ``_p2p_ops``: Megatron's op order and group choice; returns ``{name: handle}``."""
        dist = torch.distributed
        messages = self._messages(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next,
                                  group, prev_pipeline_rank, next_pipeline_rank)
        # Megatron alternates process groups by rank parity so that the two directions can overlap
        # (the WORLD group stands in for a second group when the pipeline group has two ranks).
        other = dist.group.WORLD if group.size() == 2 and dist.get_backend(group) != "ucc" else group
        even = group.rank() % 2 == 0
        send_group, recv_group = (group, other) if even else (other, group)
        order = (("send_next", "recv_prev", "send_prev", "recv_next") if even
                 else ("recv_prev", "send_next", "recv_next", "send_prev"))
        bounded = dist.get_backend(group) == "gloo"  # (NCCL: the process group's timeout, peer.py)
        received_from = [m.link.peer for m in messages.values() if m.is_recv]
        for m in messages.values():
            for step in m.link.steps:
                step.check_unbatched(received_from, exact=m.exact)
        handles = {}
        for name in order:
            if name not in messages:
                continue
            m = messages[name]
            post, post_group = (dist.irecv, recv_group) if m.is_recv else (dist.isend, send_group)
            m.stamp()
            m.timed = time_works(post_group)
            m.work = posted(lambda: post(m.buf, m.link.peer, group=post_group))
            m.bounded, m.group = bounded, post_group
            handles[name] = Handle(m, self.finish, self.wait)
            self.outbox.post(handles[name])
        return handles

    def drain(self) -> None:
        """Uninstall: finish every send still posted (bounded waits, ``message.Outbox``); then no call is taken."""
        try:
            self.outbox.drain()
        finally:
            self.closed = True
