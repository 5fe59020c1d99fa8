"""``--tah-forward-codec auto`` / ``--tah-backward-codec auto`` on the pipeline's links.

The decisions are ``auto_codec``'s; this module carries them. Every link end of an auto direction
(``pipeline_parallel.Link``) owns an :class:`AutoEnd` holding a codec per candidate
(``--tah-auto-candidates``; a receiver decodes whichever the sender announced). Protocol, per link
and direction, with ``k`` Megatron's ``args.curr_iteration`` (the same on both ends):

* **Wire format.** Every message of the direction (warm-up and evaluations included) is the codec
  buffer followed by ``ANNOUNCEMENT_NBYTES`` (8) bytes: ``auto_codec.encode_announcement`` of the
  codec the *next* iteration uses (magic, codec id, config digest, ``k + 1`` mod 2**16). The
  receiver posts ``codec.wire_nbytes(shape, dtype) + 8`` bytes for the codec of iteration ``k``.
  The trailer is appended with one ``torch.cat`` (a copy of the compressed bytes).
* **Lockstep.** Both ends start with ``TahConfig.auto_start()`` (paper, else the first candidate).
  At its first message of a new iteration each end switches to the codec announced during the
  previous one: the sender to what it announced, the receiver to what it read. The receiver keeps
  the trailers of an iteration on the device and reads them at that boundary (one host read per
  link end and iteration, not per message); trailers that disagree, name another iteration or a
  codec it does not hold raise ``WireFormatError``. The codec's own header is still checked on
  every decode, so a buffer of another codec is an error, never a misread. The warm-up and
  uncompressed evaluations send through ``none`` but carry the trailer all the same.
* **Deciding (sender).** At its first send the sender measures every candidate on that message
  (``CodecCostTable``: one untimed call, then the fastest of 3; the pipeline runs meanwhile, and
  contention only adds time, so the minimum is the cost). ``LinkRateMeter`` is fed with the bytes
  and the post-to-completion seconds (emulated delay included, codec time excluded) of this end's
  sends and of the receives of the other direction from the same peer (a link carries both). At the
  first boundary where the meter has enough transfers (normally after the first iteration) and then
  every ``--tah-auto-interval`` iterations, the sender measures the rate (the *fastest* transfer of
  the window: on the 1F1B schedule nearly every transfer includes waiting for the peer's compute --
  the upper quartile read 8.4 Mbit/s on a gloo loopback that carries Gbit/s, test_auto_pipeline.py --
  and waiting only ever adds time, so the fastest transfer is the closest to the link's rate), folds the mean encode time
  of the current codec since the last measurement into the table (``CodecCostTable.observe``) and
  ``Chooser.update``s (hysteresis: a switch needs a 5% predicted gain on 2 measurements in a row);
  the choice is announced from then on and takes effect at the next boundary. The receiver's
  decode time is the sender's measurement of it. A candidate that fails to build or to run during
  the measurement is dropped with one warning.
* **Checkpoints.** ``state_dict()`` holds the current and announced codecs, the chooser's
  hysteresis state, the meter's window and the candidates' own states (stochastic rounding), so a
  resumed run starts with the codec the interrupted one had announced.
"""

from __future__ import annotations

import torch

from ..codecs import Codec, WireFormatError, timing
from ..config import TahConfig
from .auto_codec import (ANNOUNCEMENT_NBYTES, AutoDecision, Chooser, CodecCostTable, LinkRate, LinkRateMeter,
                         decode_announcement, encode_announcement)

__all__ = ["ANNOUNCEMENT_NBYTES", "AutoEnd"]


class AutoEnd:
    """The auto codec of one link end: ``direction`` and ``role`` ("send" decides, "recv" follows)."""

    def __init__(self, config: TahConfig, direction: str, role: str):
        self.config, self.direction, self.role = config, direction, role
        self.settings = config.auto_settings()
        self.codecs: dict[str, Codec] = {}
        for name in self.settings.candidates:
            try:
                self.codecs[name] = config.auto_candidate_codec(name, direction).defer_checks()
            except Exception as err:  # noqa: BLE001 (the candidate is left out, with its reason)
                import warnings

                warnings.warn(f"auto codec: candidate {name!r} dropped ({type(err).__name__}: {err})",
                              RuntimeWarning, stacklevel=2)
        start = config.auto_start()
        if start not in self.codecs:
            raise RuntimeError(f"auto codec: the start candidate {start!r} could not be built")
        self.current = self.next = start  # this iteration's codec, the next one's (announced / read)
        self.iteration: int | None = None  # the iteration ``current`` belongs to
        self.meter = LinkRateMeter(self.settings.interval, quantile=1.0)
        self.table: CodecCostTable | None = None  # sender: built at its first send
        self.chooser: Chooser | None = None
        self.rate: LinkRate | None = None  # the last measurement
        self._chooser_state: dict | None = None  # from a checkpoint, for the chooser built later
        self._encode_seconds, self._encodes = 0.0, 0  # the current codec's since the last measurement
        self._trailer: torch.Tensor | None = None  # sender: the announcement bytes on the device
        self._received: list[torch.Tensor] = []  # receiver: this iteration's trailers, on the device

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
            self.current = self.next
            self.iteration = iteration
            self._trailer = None  # the announcement names the iteration
            if self.role == "send":
                self._decide(iteration)
        return self.codecs[self.current]

    def _decide(self, iteration: int) -> None:
        if self.chooser is None or not (self.chooser.current is None or self.meter.due(iteration)):
            return
        rate = self.meter.measure()
        if rate is None:
            return
        if self._encodes and self.current in self.table.costs:
            self.table.observe(self.current, encode_s=timing.to_float(self._encode_seconds) / self._encodes)
        self._encode_seconds, self._encodes = 0.0, 0
        self.rate = rate
        self.next = self.chooser.update(rate)

    def _read_announcements(self) -> None:
        if not self._received:
            return
        raw = torch.stack(self._received).cpu()
        self._received = []
        if not bool((raw == raw[0]).all()):
            raise WireFormatError(f"auto codec: the {self.direction} announcements of iteration {self.iteration} "
                                  f"disagree ({raw.tolist()})")
        self.next = decode_announcement(bytes(raw[0].tolist()), self.codecs, self.iteration + 1).name

    # ----- messages -------------------------------------------------------------------------
    def prepare(self, x: torch.Tensor) -> None:
        """Sender, before each send (and before ``begin``): the first call measures the candidates on ``x``."""
        if self.table is None:
            self._build_table(x)

    def sent(self, buf: torch.Tensor, encode_seconds) -> torch.Tensor:
        """The message for ``buf`` (encoded with this iteration's codec): ``buf`` || announcement."""
        if self.current in self.table.costs:
            self._encode_seconds = timing.add(self._encode_seconds, encode_seconds)
            self._encodes += 1
        if self._trailer is None or self._trailer.device != buf.device:
            digest = self.codecs[self.next].config_digest()
            raw = encode_announcement(AutoDecision(self.next, self.codecs[self.next].codec_id, digest,
                                                   self.iteration + 1))
            self._trailer = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(buf.device)
        return torch.cat([buf, self._trailer])

    def received(self, trailer: torch.Tensor) -> None:
        """Keep a received message's trailer (read at the next boundary)."""
        if trailer.numel() != ANNOUNCEMENT_NBYTES:
            raise WireFormatError(f"auto codec: a trailer of {trailer.numel()} bytes, expected {ANNOUNCEMENT_NBYTES}")
        self._received.append(trailer.clone())

    def _build_table(self, x: torch.Tensor) -> None:
        makers = {name: (lambda name=name: self.config.auto_candidate_codec(name, self.direction))
                  for name in self.codecs}
        with torch.no_grad():
            self.table = CodecCostTable(makers, x.shape, x.dtype, x.device, sample=x.detach())
        self.chooser = Chooser(self.table, self.settings)
        if self._chooser_state is not None:
            self.chooser.load_state_dict(self._chooser_state)
            self._chooser_state = None

    # ----- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        self._read_announcements()  # a receiver's pending trailers: read now (``next`` is what they say)
        chooser = self.chooser.state_dict() if self.chooser is not None else self._chooser_state
        return {"current": self.current, "next": self.next, "iteration": self.iteration,
                "chooser": chooser, "meter": self.meter.state_dict(),
                "codecs": {name: codec.state_dict() for name, codec in self.codecs.items() if codec.state_dict()}}

    def load_state_dict(self, state: dict) -> None:
        for key in ("current", "next"):
            if state[key] not in self.codecs:
                raise ValueError(f"auto codec: the checkpoint's {key} codec {state[key]!r} is not a candidate "
                                 f"here ({', '.join(self.codecs)})")
        self.current, self.next, self.iteration = state["current"], state["next"], state["iteration"]
        self.meter.load_state_dict(state["meter"])
        if self.chooser is not None and state["chooser"] is not None:
            self.chooser.load_state_dict(state["chooser"])
        else:
            self._chooser_state = state["chooser"]
        for name, codec_state in state["codecs"].items():
            self.codecs[name].load_state_dict(codec_state)
        self._trailer, self._received = None, []
