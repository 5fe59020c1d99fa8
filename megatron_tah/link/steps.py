"""The steps a link end's messages go through between the codec and the wire.

A message feature that changes the bytes on the wire is a :class:`Step`: ``frames.FramingStep``
(``--tah-entropy-coding``: the codec buffer entropy-coded into a frame of an agreed size, an overflow as a
second message), ``wire.TrailerStep`` (the trailer after every message: auto's announcement and
transit reports, the send stamp the inbound wire's emulation reads) and ``emulate.EmulationStep`` (the emulated
slow link, ``--tah-emulate-bandwidth``). ``link.open_link`` builds a link end's steps once, from the
configuration, in send order; the transport calls them in turn:

* a send: ``on_send`` in order, from the codec's buffer to the message posted;
* a receive being posted: ``post_nbytes`` in order, from the codec's buffer size to the bytes posted (with
  ``exact``, the most the message can be: the backend delivers a shorter message into it);
* a complete receive: ``received_nbytes`` in order (how much of the receive the message filled), then
  ``follow_nbytes`` (the bytes of a second message behind it, received next);
* a complete message, either way: ``on_complete`` in order (when it was complete: the emulated link's time);
* then a receive: ``on_arrival`` in reverse order; then ``on_receive`` in reverse order, from the message (less
  its trailer) back to the codec's buffer, which the codec decodes.

The transport itself only posts, waits and completes messages: what a step adds or reads is the step's.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["Outgoing", "Step"]


@dataclasses.dataclass
class Outgoing:
    """A message being assembled on a send end: ``buf``, the codec's buffer as the steps so far made it;
    ``rest``, bytes that follow as a second message (None: none); what it was encoded from (``codec``, the
    tensor's ``shape`` and ``dtype``), the encode's time (``encode_seconds``: seconds or a pending
    ``codecs.core.timing`` interval) and whether it goes exact (``exact``: the receiver posts the most it can be, so it
    is sent at its own length, ``frames.py``)."""

    codec: object
    shape: torch.Size
    dtype: torch.dtype
    buf: torch.Tensor
    encode_seconds: object = 0.0
    rest: torch.Tensor | None = None
    exact: bool = False


class Step:
    """One step of a link end's messages; every hook does nothing unless a step overrides it. ``m`` is a
    ``message.Message`` of the step's link end."""

    def on_send(self, out: Outgoing) -> None:
        """A message on its way out: replace ``out.buf`` and/or set ``out.rest``."""

    def post_nbytes(self, codec, shape, dtype, nbytes: int, exact: bool = False) -> int:
        """The bytes to post for a receive decoded by ``codec`` into ``shape``/``dtype``, given ``nbytes``
        from the steps before (the first step gets the codec buffer's size); the trailer's bytes apart. With
        ``exact``, the most a message can be (a shorter one fills its start)."""
        return nbytes

    def received_nbytes(self, m, nbytes: int) -> int:
        """A complete receive whose message is at most ``nbytes`` (from the steps before; the trailer's bytes
        apart): how many it is."""
        return nbytes

    def follow_nbytes(self, m) -> int:
        """A complete receive: the bytes that follow it as a second message (0: none)."""
        return 0

    def check_unbatched(self, received_from: list[int], exact: bool) -> None:
        """Before an unbatched call posts: raise if this step's messages cannot go that way (``received_from``:
        the ranks the call receives from; ``exact``: whether its messages go exact, ``Outgoing``)."""

    def on_complete(self, m, done_at: float | None) -> float | None:
        """A complete message, send or receive (a receive's length read, its second message too): returns when
        it was complete, wall time, given ``done_at`` from the steps before (None: unknown)."""
        return done_at

    def on_arrival(self, m, done_at: float | None, emulated: bool) -> None:
        """A complete receive, at wall time ``done_at`` (the emulated link's, when ``emulated``)."""

    def on_receive(self, m, buf: torch.Tensor) -> torch.Tensor:
        """A complete receive's buffer on the device, as the steps after this one left it: the buffer the
        steps before it made (the first step returns the codec's buffer)."""
        return buf
