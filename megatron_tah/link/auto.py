"""``--tah-forward-codec auto`` / ``--tah-backward-codec auto`` on the pipeline's links.

The decisions are ``choice.py``'s, the measurements ``measure.py``'s, the bytes ``wire.py``'s; this
module carries them. Every link end of an auto direction (``link.Link``) owns an :class:`AutoEnd`
holding a codec per candidate (``--tah-auto-candidates``; a receiver decodes whichever the sender
announced). Protocol, per link and direction, with ``k`` the training iteration the transport is given
(Megatron's ``args.curr_iteration``, the same on both ends):

* **Wire.** When either direction is auto, every message of the pipeline (both directions, warm-up
  and evaluations included) carries the 24-byte trailer after the codec buffer (``wire.py``): the
  announcement of the codec iteration ``k + 1`` uses, the sender's ``sent at`` stamp and a report of
  the other direction's fastest transit. The receiver posts ``codec.wire_nbytes(shape, dtype) + 24``
  bytes for the codec of iteration ``k`` and reads the trailer on the host as soon as the message is
  complete (on a GPU that read waits for the receive, which Megatron's ``batch_p2p_sync`` does anyway;
  it also makes the completion time real, since a NCCL ``wait()`` returns before the data is there).
* **Measuring a direction.** A message's *transit* is its receiver's completion time minus the
  ``sent at`` stamp: the time the link took, without the time the receiver spent waiting for its
  sender to compute the tensor (which the post-to-completion time includes, and which on a fast
  link is most of it). It includes the receiver's own lateness in posting, so it bounds the link
  time from above. On NCCL the host read that completes the receive also waits for the receiver's
  compute queued before it, so the receive's works time themselves on the device
  (``wire.time_works``) and the transit is the smaller of that duration and the stamps' difference
  (both bound the link's time from above). The receiver keeps, per peer, the fastest transit (bytes / seconds) since its
  last report and reports it in the trailer of its next message *to that peer* (the other
  direction); the sender feeds the reports to its ``LinkRateMeter``. So each direction is measured
  on its own (asymmetric links), by the traffic the pipeline carries anyway, with no probe. The
  two ends' wall clocks are assumed synchronised (on one machine they are the same clock; across
  sites NTP keeps them within about a millisecond, which biases a transit by as much).
* **Lockstep.** Both ends start with ``AutoSettings.start()`` (none, else paper, else the first
  candidate: the largest messages, see there).
  At its first message of a new iteration each end switches to the codec announced during the
  previous one: the sender to what it announced, the receiver to what it read. Announcements of one
  iteration that disagree, name another iteration or a codec the receiver does not hold raise
  ``WireFormatError`` at that boundary. The codec's own header is still checked on
  every decode, so a buffer of another codec is an error, never a misread. The warm-up and
  uncompressed evaluations send through ``none`` but carry the trailer all the same.
* **Deciding (sender).** At its first send the sender measures every candidate on that message
  (``CodecCostTable``: one untimed call, then the median of 5, while the pipeline runs: contention
  from stages sharing the cores is part of the cost). Its ``LinkRateMeter`` is fed with the
  reports of its receiver (above). At the first boundary where the meter has enough transfers
  (normally after the first iteration) and then every ``--tah-auto-interval`` iterations, the sender
  measures the rate (the *fastest* reported transfer of the window: a transit only ever includes
  extra time, never less, so the fastest one is the closest to the link's rate; the first transfers,
  connection set-up included, are not skipped: the slowest never counts), folds the mean
  encode time of the current codec since the last measurement into the table
  (``CodecCostTable.observe``) and ``Chooser.update``s (hysteresis: a switch needs a 5% predicted gain on 2
  measurements in a row, or 2x on one);
  the choice is announced from then on and takes effect at the next boundary. At every boundary in
  between, a collapse (the latest transfers all under half the rate last measured, its slower quartile,
  at their size) measures at once from those transfers, and a predicted gain of 5% then switches without
  waiting for ``patience``; so does a fall: the latest whole iterations' fastest transfer at a size under half
  the last measurement's there (``LinkRateMeter.fell``: a drop inside the window, which the window's fastest
  transfer hides, and a drop that a late-posting receiver hid from the collapse check), measured from those
  iterations' transfers alone. A switch is on probation (``choice.Probation``, ``--tah-auto-probation`` iterations): if the new codec's
  iterations were not faster than the previous codec's, the sender announces the previous one again
  (logged) and leaves the new one out for 4 measurements. The receiver's
  decode time is the sender's measurement of it. A candidate that fails to build or to run during
  the measurement is dropped with one warning.
* **Checkpoints.** ``state_dict()`` holds the current and announced codecs, the chooser's
  hysteresis state, the meter's window and its last measurement, the probation's iteration times and trial, and the candidates'
  own states (stochastic rounding), so a
  resumed run starts with the codec the interrupted one had announced.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings

import torch

from ..codecs import Codec, WireFormatError
from ..codecs.core import timing
from ..config import TahConfig
from .choice import Chooser, Probation
from .measure import CodecCostTable, LinkRate, LinkRateMeter
from .wire import AutoDecision, decode_announcement, encode_announcement

logger = logging.getLogger(__name__)


def link_salt(direction: str, role: str, peer: int | None) -> str:
    """The name of a link end (direction, sender -> receiver ranks) that salts its codecs' stochastic rounding
    (``Codec.salt_rounding``): every sender draws its own noise."""
    dist = torch.distributed
    me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    sender, receiver = (me, peer) if role == "send" else (peer, me)
    return f"{direction}:{sender}->{receiver}"


class AutoEnd:
    """The auto codec of one link end: ``direction`` and ``role`` ("send" decides, "recv" follows); ``peer``: the
    other end's rank, for the log; ``boundary`` (boundary, boundaries): where a candidate with per-boundary bits
    takes its bits (None: its ``tah_forward_bits``)."""

    def __init__(self, config: TahConfig, direction: str, role: str, peer: int | None = None, depth: int = 1,
                 boundary: tuple[int, int] | None = None):
        self.config, self.direction, self.role, self.peer, self.depth = config, direction, role, peer, depth
        self.settings = config.auto_settings()
        self.codecs: dict[str, Codec] = {}
        for name in self.settings.candidates:
            try:
                self.codecs[name] = config.auto_candidate_codec(name, direction, boundary).defer_checks().salt_rounding(
                    link_salt(direction, role, peer))
            except Exception as err:  # noqa: BLE001 (the candidate is left out, with its reason)
                warnings.warn(f"auto codec: candidate {name!r} dropped ({type(err).__name__}: {err})",
                              RuntimeWarning, stacklevel=2)
        start = config.auto_settings().start()
        if start not in self.codecs:
            raise RuntimeError(f"auto codec: the start candidate {start!r} could not be built")
        self.current = self.next = start  # this iteration's codec, the next one's (announced / read)
        self.iteration: int | None = None  # the iteration ``current`` belongs to
        self.meter = LinkRateMeter(self.settings.interval, skip_first=0, quantile=1.0)  # (a slow first: not fastest)
        self.table: CodecCostTable | None = None  # sender: built at its first send
        self.chooser: Chooser | None = None
        self.rate: LinkRate | None = None  # the last measurement
        self._chooser_state: dict | None = None  # from a checkpoint, for the chooser built later
        self._encode_seconds, self._encodes = 0.0, 0  # the current codec's since the last measurement
        self._announcement: bytes | None = None  # sender: this iteration's announcement
        probation = self.settings.probation if role == "send" else 0
        self.probation = Probation(probation) if probation else None  # sender: did a switch pay off?
        self._received: list[bytes] = []  # receiver: this iteration's announcements

    @property
    def codec(self) -> Codec:
        return self.codecs[self.current]

    # ----- the iteration boundary ------------------------------------------------------------
    def begin(self, iteration: int) -> Codec:
        """The codec of this end's messages in ``iteration``; the first call of a new iteration switches
        to the announced codec (receiver: reads the trailers first; sender: may decide anew)."""
        if iteration != self.iteration:
            if self.role == "recv":
                self._read_announcements()
            elif self.probation is not None:
                self.probation.begin(iteration, self.current, time.monotonic())
            self.current = self.next
            self.iteration = iteration
            self._announcement = None  # the announcement names the iteration
            if self.role == "send":
                self.meter.iteration_done()
                self._decide(iteration)
        return self.codecs[self.current]

    def _decide(self, iteration: int) -> None:
        if self.chooser is None:
            return
        if self.probation is not None and self._probation_failed():
            return
        # far slower since the last measurement: measure now, from the transfers that show it
        collapse = self.rate is not None and self.meter.collapsed(self.rate)
        fell = 0 if self.rate is None or collapse else self.meter.fell(self.rate)
        if not (self.chooser.current is None or self.meter.due(iteration) or collapse or fell):
            return
        rate = self.meter.measure(recent=self.meter.min_transfers if collapse else fell or None)
        if rate is None:
            return
        if self._encodes and self.current in self.table.costs:
            self.table.observe(self.current, encode_s=timing.to_float(self._encode_seconds) / self._encodes)
        self._encode_seconds, self._encodes = 0.0, 0
        self.rate = rate
        self.next = self.chooser.update(rate, collapse=collapse or bool(fell))
        if self.probation is not None and self.next != self.current:
            self.probation.switched(self.current, self.next, iteration + 1)

    def _probation_failed(self) -> bool:
        """A trial that just ended with the new codec no faster: back to the previous one (announced now)."""
        trial = self.probation.trial
        verdict = self.probation.verdict()
        if verdict is None or trial[1] != self.current or verdict == self.current:
            return False
        previous, before, new, after = self.probation.compared
        self.chooser.reject(new, verdict)
        self.next = verdict
        to = "" if self.peer is None else f" to rank {self.peer}"
        logger.info(f"megatron_tah: auto {self.direction}{to}: {new}'s fastest iteration took {1e3 * after:.0f} ms, "
                    f"{previous}'s {1e3 * before:.0f} ms: back to {previous}; {new} is left out for "
                    f"{self.settings.memory} measurements")
        return True

    def _read_announcements(self) -> None:
        if not self._received:
            return
        received, self._received = self._received, []
        if any(raw != received[0] for raw in received):
            raise WireFormatError(f"auto codec: the {self.direction} announcements of iteration {self.iteration} "
                                  f"disagree ({[raw.hex() for raw in received]})")
        self.next = decode_announcement(received[0], self.codecs, self.iteration + 1).name

    # ----- messages -------------------------------------------------------------------------
    def prepare(self, x: torch.Tensor) -> None:
        """Sender, before each send (and before ``begin``): the first call measures the candidates on ``x``."""
        if self.table is None:
            self._build_table(x)

    def sent(self, encode_seconds) -> bytes:
        """Sender, per message encoded with this iteration's codec: its announcement (the next iteration's codec)."""
        if self.table is not None and self.current in self.table.costs:
            self._encode_seconds = timing.add(self._encode_seconds, encode_seconds)
            self._encodes += 1
        if self._announcement is None:
            codec = self.codecs[self.next]
            self._announcement = encode_announcement(AutoDecision(self.next, codec.codec_id, codec.config_digest(),
                                                                  self.iteration + 1))
        return self._announcement

    def received(self, announcement: bytes | None) -> None:
        """Receiver, per message: keep its announcement (read at the next boundary)."""
        if announcement is None:
            raise WireFormatError(f"auto codec: a {self.direction} message without an announcement (is the sender "
                                  "running auto on this direction?)")
        self._received.append(bytes(announcement))

    def _build_table(self, x: torch.Tensor) -> None:
        makers = {name: (lambda name=name: self.config.auto_candidate_codec(name, self.direction))
                  for name in self.codecs}
        with torch.no_grad():
            self.table = CodecCostTable(makers, x.shape, x.dtype, x.device, sample=x.detach())
        self.chooser = Chooser(self.table, self.settings, depth=self.depth, direction=self.direction)
        self._log_floor()
        if self._chooser_state is not None:
            self.chooser.load_state_dict(self._chooser_state)
            self._chooser_state = None

    def _log_floor(self) -> None:
        """Say which candidates the accuracy floor leaves out of this link's choice, and which pass it by their
        measured steps (``Chooser.within_floor``)."""
        floor, costs = self.chooser.floor(), self.table.costs
        out = [f"{name} {cost.error:.3g}" for name, cost in costs.items()
               if not self.chooser.within_floor(name, cost, floor)]
        waived = [f"{name} {cost.error:.3g}" for name, cost in costs.items()
                  if cost.error > floor and self.chooser.within_floor(name, cost, floor)]
        to = "" if self.peer is None else f" to rank {self.peer}"
        logger.info(f"megatron_tah: auto {self.direction}{to}: accuracy floor {floor:.3g} (relative round-trip "
                    f"error); left out: {', '.join(out) or 'nothing'}"
                    + (f"; above it but judged by their steps measured at depth {self.depth}: {', '.join(waived)}"
                       if waived else ""))

    # ----- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        self._read_announcements()  # a receiver's pending trailers: read now (``next`` is what they say)
        chooser = self.chooser.state_dict() if self.chooser is not None else self._chooser_state
        return {"current": self.current, "next": self.next, "iteration": self.iteration,
                "chooser": chooser, "meter": self.meter.state_dict(),
                "rate": dataclasses.asdict(self.rate) if self.rate is not None else None,  # (a collapse is against it)
                "probation": self.probation.state_dict() if self.probation is not None else None,
                "codecs": {name: codec.state_dict() for name, codec in self.codecs.items() if codec.state_dict()}}

    def load_state_dict(self, state: dict) -> None:
        for key in ("current", "next"):
            if state[key] not in self.codecs:
                raise ValueError(f"auto codec: the checkpoint's {key} codec {state[key]!r} is not a candidate "
                                 f"here ({', '.join(self.codecs)})")
        self.current, self.next, self.iteration = state["current"], state["next"], state["iteration"]
        self.meter.load_state_dict(state["meter"])
        rate = state.get("rate")  # (absent from checkpoints written before collapses were checked)
        self.rate = None if rate is None else LinkRate(rate["rate_bps"], rate["spread_bps"], rate["transfers"],
                                                       tuple(tuple(item) for item in rate["by_size"]))
        if self.probation is not None and state.get("probation") is not None:
            self.probation.load_state_dict(state["probation"])
        if self.chooser is not None and state["chooser"] is not None:
            self.chooser.load_state_dict(state["chooser"])
        else:
            self._chooser_state = state["chooser"]
        for name, codec_state in state["codecs"].items():
            self.codecs[name].load_state_dict(codec_state)
        self._announcement, self._received = None, []
