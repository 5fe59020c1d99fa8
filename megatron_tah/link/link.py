"""One end of one pipeline link (``Link``), how the transport opens one (``open_link``), and what the link ends
of one transport share: the switch of the codec each message goes through (``Traffic``), AQ-SGD's sample-id
queue (``SampleIds``) and the link ends' codec state (``CodecStates``).

A link end is (direction, role, peer): "forward" carries activations, "backward" their gradients; "send" or
"recv"; the world rank at the other end. It owns its codec (AQ-SGD and stochastic rounding keep state), or on
an auto direction its ``auto.AutoEnd``, which picks the codec per iteration; its counters; its host staging
buffers; the report it owes its peer (auto); and the steps its messages go through (``steps.py``), built once
from the configuration.

CUDA graphs: a link end's codec is a ``codecs.core.graphs.GraphedCodec`` (``place_codec``; not with
``--tah-eager-codecs``): its encode and its decode are captured once per (shape, dtype, device) and replayed. A
replayed decode writes the graph's static output and copies it into Megatron's receive tensor (one device copy):
Megatron allocates a new receive tensor per message, so a capture per receive pointer would never be replayed.
Eager where a graph cannot replay the call (CPU tensors, ``none``, AQ-SGD, stochastic rounding, ...), with one
log line per reason for all link ends together. Auto links stay eager: their cost table times each candidate's
eager call and the sender folds its measured encode time into that table (``auto.py``); a replayed current codec
would skew the choice.

``Traffic``: a message goes through its link end's codec (an auto link end's choice for the iteration,
``auto.AutoEnd.begin``) except during the warm-up (``--tah-warmup-iters``: Megatron's first training iterations)
and inside ``evaluation(uncompressed=True)``, when it goes through ``none``; inside
``evaluation(uncompressed=False)`` a link end with an evaluation codec (forward, ``--tah-eval-forward-bits``:
``Link.eval_codec``) sends and receives through that one. Both ends of a link switch together: they read the
same training iteration and enter evaluations together.

``SampleIds``: AQ-SGD keeps a buffer per training sample, so an activation's sample ids travel in the codec's
buffer. The first stage's forward step pushes each micro-batch's ids (``push``); every activation send takes the
oldest (``encode_inputs``: whatever the codec, so the queue stays bounded; an error when the codec needs them and none
are queued) for the codec's encode; an activation receive whose codec
decoded ids queues them for this stage's own send (``received``), unless this is the last stage. Gradients
carry none.

``CodecStates``: a link end's codec may keep state between messages (AQ-SGD's per-sample buffers, stochastic
rounding's generator; an auto link end: its choice and its candidates' states): what a checkpoint saves and
loads. ``state_dict()`` is ``{(direction, role, peer): state}`` of the link ends that hold some;
``load_state_dict`` gives each named link end its state back, opening the link ends it names, and refuses a
state saved with other codecs. Where the state goes on disk is Megatron's side (``megatron/codec_state.py``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
from typing import Callable

import torch

from ..codecs import Codec, get_codec
from ..codecs.core.graphs import GraphedCodec, place_codec
from ..config import TahConfig
from .auto import AutoEnd, link_salt
from .emulate import EmulationStep
from .frames import FramingStep
from .handshake import CodecMismatchError, config_record
from .message import HostStaging
from .steps import Step
from .wire import TrailerStep

__all__ = ["CodecStates", "Link", "SampleIds", "Traffic", "link_boundary", "open_link"]


@dataclasses.dataclass
class Link:
    """One end of one pipeline link: ``direction`` ("forward": activations, "backward": their
    gradients), ``role`` ("send", "recv") and ``peer`` (the world rank at the other end).
    Owns the codec of that end and what was counted on it; what is known per link end (a measured
    rate, staging buffers, captured graphs per message shape) belongs here too."""

    direction: str
    role: str
    peer: int
    codec: Codec | GraphedCodec  # auto: the codec of the current iteration
    messages: int = 0  # messages through this end so far
    auto: AutoEnd | None = None  # the direction is auto: picks ``codec`` per iteration (auto.py)
    staging: HostStaging | None = dataclasses.field(default=None, repr=False)  # its host buffers, once staged
    report: tuple[int, float] | None = None  # send end: fastest (bytes, s) of the peer's messages to us, unreported
    steps: list[Step] = dataclasses.field(default_factory=list, repr=False)  # its messages' steps, in send order
    # forward, with --tah-eval-forward-bits: the codec of evaluations through the codecs (``Traffic``)
    eval_codec: Codec | GraphedCodec | None = None

    def host_staging(self, device: torch.device) -> HostStaging:
        """This end's staging buffers for wire buffers on ``device`` (made on first use)."""
        if self.staging is None or self.staging.device != device:
            self.staging = HostStaging(device)
        return self.staging

    def step(self, kind: type) -> Step | None:
        """This end's step of type ``kind``, if it has one."""
        return next((step for step in self.steps if isinstance(step, kind)), None)

    @property
    def key(self) -> tuple[str, str, int]:
        return self.direction, self.role, self.peer


def link_boundary(config: TahConfig, direction: str, role: str, stage: Callable[[], int | None],
                  depth: Callable[[], int | None]) -> tuple[int, int] | None:
    """(boundary, boundaries) of this rank's ``direction`` link end as ``role`` where the forward codec's bits
    may be per boundary (``--tah-boundary-bits``; an auto direction, whose candidates may have them): a forward
    send leaves boundary ``stage()``, a receive comes through ``stage() - 1`` of the pipeline's ``depth()``
    stages; None otherwise. With the flag, an unknown stage or a link around the pipeline's end (the interleaved
    schedule) is a ``ValueError``; auto's candidates take their own bits there."""
    explicit = bool(config.boundary_bits())
    if direction != "forward" or not (explicit or config.is_auto("forward")):
        return None
    stage, depth = stage(), depth()
    boundary = None if stage is None else (stage if role == "send" else stage - 1)
    if boundary is not None and depth is not None and 0 <= boundary < depth - 1:
        return boundary, depth - 1
    if not explicit:
        return None
    if boundary is None or depth is None:
        raise ValueError("megatron_tah: --tah-boundary-bits needs the pipeline's stage and depth (Megatron's "
                         "parallel state is not initialised)")
    raise ValueError(f"megatron_tah: --tah-boundary-bits: stage {stage} of {depth} {role}s activations around the "
                     "pipeline's end (the interleaved schedule); per-boundary bits need 1F1B")


def measured_rate(auto: AutoEnd) -> float | None:
    """An ``auto`` link end's last measured rate (bit/s), None before its first measurement."""
    return None if auto.rate is None else auto.rate.rate_bps


def open_link(config: TahConfig, direction: str, role: str, peer: int, *, depth: Callable[[], int | None],
              stage: Callable[[], int | None], graphs, graph_log: set[str], trailer: bool,
              reply: Callable[[], Link], latency: dict[int, float], emulation=None) -> Link:
    """A new link end: its codec (an auto direction: its ``AutoEnd``, at the pipeline's ``depth()``, None: 1;
    otherwise the configured codec -- a forward link's at its boundary (``link_boundary``, from this rank's
    ``stage()``) with ``--tah-boundary-bits`` -- salted for its own rounding noise and placed in CUDA graphs as
    ``codecs.core.graphs.place_codec`` says; a forward link's evaluation codec with ``--tah-eval-forward-bits``, alike) and its steps: entropy framing with ``--tah-entropy-coding``, then the
    trailer when it is on (``trailer``; ``reply`` and ``latency``: ``wire.TrailerStep``'s), then the emulated
    link (``emulation``: the process's ``emulate.LinkEmulator`` or ``InboundWire``, None: none)."""
    boundary = link_boundary(config, direction, role, stage, depth)
    if config.is_auto(direction):
        auto = AutoEnd(config, direction, role, peer, depth=depth() or 1, boundary=boundary)
        link = Link(direction, role, peer, auto.codec, auto=auto)
    else:
        codec = config.forward_codec(*(boundary or ())) if direction == "forward" else config.backward_codec()
        codec.salt_rounding(link_salt(direction, role, peer))  # each sender its own rounding noise
        # Only used after check_group compared the link's configs: headers are checked on the device.
        link = Link(direction, role, peer, place_codec(codec, config.tah_eager_codecs, graphs, graph_log))
        evaluating = config.eval_forward_codec() if direction == "forward" else None
        if evaluating is not None:  # both ends of the link build it alike: the receiver decodes what it encodes
            evaluating.salt_rounding(link_salt(direction, role, peer) + ":eval")
            link.eval_codec = place_codec(evaluating, config.tah_eager_codecs, graphs, graph_log)
    if config.tah_entropy_coding:  # judged at the given rate, else at an auto link end's measured one
        rate = config.link_rate_bps
        if rate is None and link.auto is not None:
            rate = functools.partial(measured_rate, link.auto)
        link.steps.append(FramingStep(direction, peer, config.tah_entropy_coder, rate,
                                      auto=config.tah_entropy_when == "auto"))
    measure = config.is_auto("forward") or config.is_auto("backward")
    if trailer:
        link.steps.append(TrailerStep(link, measure=measure, reply=reply, latency=latency))
    if emulation is not None:
        link.steps.append(EmulationStep(emulation, bill_trailer=measure))
    return link


# ----- the traffic switch ----------------------------------------------------------------------------------
class Traffic:
    """The switch of one transport: ``iteration()``, the current training iteration (None: unknown, outside a
    training loop); ``uncompressed``, the ``none`` codec it switches to; ``evaluating``, inside an
    ``evaluation``; ``eval_uncompressed``, inside ``evaluation(uncompressed=True)``."""

    def __init__(self, config: TahConfig, iteration: Callable[[], int | None]):
        self.config, self.iteration = config, iteration
        self.uncompressed = get_codec("none").defer_checks()  # warm-up and uncompressed evaluations
        self.evaluating = self.eval_uncompressed = False

    def training_iteration(self) -> int:
        """``iteration()``, which the warm-up and auto need: both ends of a link switch together."""
        iteration = self.iteration()
        if iteration is None:
            raise RuntimeError("megatron_tah: --tah-warmup-iters counts Megatron's training iterations and needs "
                               "its training loop (megatron.training's args are not set)")
        return iteration

    def codec(self, link) -> Codec:
        """The codec of ``link``'s next message (a ``link.Link``): ``none`` during the warm-up and uncompressed
        evaluations, its evaluation codec (if it has one) in the other evaluations."""
        if link.auto is not None:
            link.codec = link.auto.begin(self.training_iteration())
        if self.config.tah_warmup_iters and self.training_iteration() < self.config.tah_warmup_iters:
            return self.uncompressed
        if self.evaluating:
            if self.eval_uncompressed:
                return self.uncompressed
            if link.eval_codec is not None:
                return link.eval_codec
        return link.codec

    @contextlib.contextmanager
    def evaluation(self, uncompressed: bool):
        """An evaluation, every message through ``none`` with ``uncompressed``, else through the link ends'
        evaluation codecs where they have one; the previous setting after it."""
        before = self.evaluating, self.eval_uncompressed
        self.evaluating, self.eval_uncompressed = True, bool(uncompressed)
        try:
            yield
        finally:
            self.evaluating, self.eval_uncompressed = before


# ----- AQ-SGD's sample ids ---------------------------------------------------------------------------------
class SampleIds:
    """The queue: 1-D LongTensors, oldest first."""

    def __init__(self):
        self.queue: collections.deque[torch.Tensor] = collections.deque()

    def __len__(self) -> int:
        return len(self.queue)

    def push(self, ids: torch.Tensor) -> None:
        """Queue the ids of the next micro-batch this rank sends."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1:
            raise ValueError(f"sample ids must be a 1-D LongTensor [micro_batch], got {ids!r}")
        self.queue.append(ids.detach().to(torch.long))

    def pop(self, required: bool) -> torch.Tensor | None:
        """The oldest queued ids (None: none queued, an error when ``required``)."""
        if self.queue:
            return self.queue.popleft()
        if required:
            raise RuntimeError("aqsgd needs the sample ids of every micro-batch: call megatron_tah.megatron."
                               "pipeline_parallel.push_sample_ids(ids) in the first stage's forward step")
        return None

    def encode_inputs(self, direction: str, codec) -> dict:
        """What a send on a ``direction`` link gives ``codec.encode`` besides the tensor: ``{"sample_ids": ids}``
        where the codec needs them (an activation send's: the oldest queued; an error when none is), else nothing.
        Every activation send takes the oldest ids, whatever its codec, so that the queue stays bounded; gradients
        carry none."""
        ids = self.pop(required=codec.needs_sample_ids) if direction == "forward" else None
        return {"sample_ids": ids} if codec.needs_sample_ids else {}

    def received(self, m) -> None:
        """A decoded receive (a ``message.Message``): an activation's ids go on to this stage's queue."""
        if m.codec.needs_sample_ids and m.link.direction == "forward" and not m.last_stage:
            self.push(m.codec.last_sample_ids)


# ----- the codec state -------------------------------------------------------------------------------------
class CodecStates:
    """The states of ``links`` (the transport's ``{(direction, role, peer): link.Link}``, read when asked);
    ``open(direction, role, peer)``: the transport's link end, opened at its first use."""

    def __init__(self, config: TahConfig, links: dict, open: Callable):
        self.config, self.links, self.open = config, links, open

    def state_dict(self) -> dict:
        """``{(direction, role, peer): codec.state_dict()}`` of the link ends whose codecs hold state
        (an auto link end: ``AutoEnd.state_dict()``, its choice and its candidates' states)."""
        states = {key: link.auto.state_dict() if link.auto is not None else link.codec.state_dict()
                  for key, link in self.links.items()}
        return {key: state for key, state in states.items() if state}

    def load_state_dict(self, states: dict, saved_config: dict | None = None) -> None:
        """Give each link end's codec its saved state (opening the link ends it names); ``saved_config``: the
        configuration it was saved with (``dataclasses.asdict`` of a ``TahConfig``), checked against this one's."""
        if saved_config is not None:
            fields = {f.name for f in dataclasses.fields(TahConfig)}
            saved = TahConfig(**{k: v for k, v in saved_config.items() if k in fields})
            if config_record(saved) != config_record(self.config):
                raise CodecMismatchError(
                    f"megatron_tah: the checkpoint's codec state was saved with other codecs "
                    f"({config_record(saved)}) than this run's ({config_record(self.config)}); "
                    "load it with the same --tah-* flags, or use --finetune to start the codecs afresh")
        for (direction, role, peer), codec_state in states.items():
            link = self.open(direction, role, peer)
            (link.codec if link.auto is None else link.auto).load_state_dict(codec_state)

    def stateful(self) -> bool:
        """Whether the configured codecs keep state between messages (AQ-SGD, stochastic rounding, auto's choice)."""
        if self.config.is_auto("forward") or self.config.is_auto("backward"):
            return True
        return any(codec.stateful for codec in (self.config.forward_codec(), self.config.backward_codec()))

    def buffer_nbytes(self) -> int:
        """Bytes held in per-sample buffers (AQ-SGD) by this rank's codecs (the statistics' buffer source)."""
        return sum(link.codec.buffer_nbytes() for link in self.links.values() if hasattr(link.codec, "buffer_nbytes"))
