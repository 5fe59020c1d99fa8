"""One end of one pipeline link (``Link``), and how the transport opens one (``open_link``): its boundary and codec.

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
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ..codecs import Codec
from ..codecs.core.graphs import GraphedCodec, place_codec
from ..config import TahConfig
from .auto import AutoEnd, link_salt
from .emulate import EmulationStep
from .frames import FramingStep
from .staging import HostStaging
from .steps import Step
from .trailer import TrailerStep

__all__ = ["Link", "link_boundary", "open_link"]


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
    # forward, with --tah-eval-forward-bits: the codec of evaluations through the codecs (traffic.py)
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


def open_link(config: TahConfig, direction: str, role: str, peer: int, *, depth: Callable[[], int | None],
              stage: Callable[[], int | None], graphs, graph_log: set[str], trailer: bool,
              reply: Callable[[], Link], latency: dict[int, float], emulation=None) -> Link:
    """A new link end: its codec (an auto direction: its ``AutoEnd``, at the pipeline's ``depth()``, None: 1;
    otherwise the configured codec -- a forward link's at its boundary (``link_boundary``, from this rank's
    ``stage()``) with ``--tah-boundary-bits`` -- salted for its own rounding noise and placed in CUDA graphs as
    ``codecs.core.graphs.place_codec`` says; a forward link's evaluation codec with ``--tah-eval-forward-bits``, alike) and its steps: entropy framing with ``--tah-entropy-coding``, then the
    trailer when it is on (``trailer``; ``reply`` and ``latency``: ``trailer.TrailerStep``'s), then the emulated
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
    if config.tah_entropy_coding:
        link.steps.append(FramingStep(direction, peer, config.tah_entropy_coder, config.link_rate_bps,
                                      auto=config.tah_entropy_when == "auto"))
    measure = config.is_auto("forward") or config.is_auto("backward")
    if trailer:
        link.steps.append(TrailerStep(link, measure=measure, reply=reply, latency=latency))
    if emulation is not None:
        link.steps.append(EmulationStep(emulation, bill_trailer=measure))
    return link
