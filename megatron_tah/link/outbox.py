"""The unbatched path's posted messages, held until each is finished: no posted ``Work`` is ever dropped.

gloo sends by rendezvous: until the receiver's ready-to-receive arrives, a send holds only a weak reference to
its buffer, and a send whose ``Work`` is destroyed before then is never sent (every later message on that
connection then stalls behind it); a gloo send reads as complete only once waited for. So every message the
unbatched transport posts (``message.Message``, with its ``Work`` and its buffers) stays in the
:class:`Outbox` until it is finished -- waited through the transport's bounded wait (``peer.PeerWatch``),
then ``finish``ed -- in one of three ways:

* by its handle (``message.Handle.wait``: Megatron waits for it);
* at the first call of a later training iteration (``reap``): a send of an earlier iteration whose handle was
  never waited for (the interleaved schedule leaves its last forward send's) is waited then. Its receiver
  posts that receive within that same iteration, needing nothing more from this rank, so the wait ends;
* at a later call, whatever the iteration (``reap``; also where it is unknown: a training loop of the user's own):
  a send never waited for once a later send on the same link has finished. A connection delivers in order, so
  the receiver has taken it already and its wait returns at once;
* at uninstall (``drain``): every send not yet finished, before the transport is dropped.

Finished messages leave at the next call, so the outbox holds at most about one iteration's messages, with or
without Megatron's iteration.
"""

from __future__ import annotations

from .message import Handle

__all__ = ["Outbox"]


class Outbox:
    """The handles (``message.Handle``) of the messages one transport posted on the unbatched path and has not
    yet seen finished."""

    def __init__(self):
        self.handles: list[Handle] = []

    def post(self, handle: Handle) -> None:
        self.handles.append(handle)

    def reap(self, iteration: int | None) -> None:
        """At the start of a transport call (training ``iteration``, None: unknown): stamp the complete messages'
        completion, finish the sends posted at an earlier iteration and those followed by a finished send on their
        link, and drop the finished and the failed."""
        for handle in self.handles:
            m = handle.message
            if not (m.done or m.failed):
                m.poll()
        overtaken = set()  # links with a later send finished (walked newest first)
        for handle in reversed(self.handles):
            m = handle.message
            if m.is_recv or m.failed:
                continue
            if not m.done:
                earlier = None not in (iteration, m.iteration) and m.iteration < iteration
                if earlier or id(m.link) in overtaken:
                    handle.wait()
            if m.done:
                overtaken.add(id(m.link))
        self.handles[:] = [h for h in self.handles if not (h.message.done or h.message.failed)]

    def drain(self) -> None:
        """Finish every send not yet finished (each wait bounded as the transport's are; the first that fails
        raises, and the rest are not waited for); then drop them all. Not a message whose wait already failed (its
        peer is gone), nor a receive never waited for (Megatron's schedules wait for every receive they post)."""
        try:
            for handle in self.handles:
                if not (handle.message.is_recv or handle.message.failed):
                    handle.wait()
        finally:
            self.handles.clear()

    def holdings(self) -> dict[str, int]:
        """What it holds now: messages (each with its ``Work``) and the bytes of their buffers."""
        held = [h.message for h in self.handles if not (h.message.done or h.message.failed)]
        return {"messages": len(held),
                "works": sum((m.work is not None) + (m.rest_work is not None) for m in held),
                "bytes": sum((0 if m.buf is None else m.buf.numel()) + (0 if m.rest is None else m.rest.numel())
                             for m in held)}
