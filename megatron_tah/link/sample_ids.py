"""AQ-SGD's sample-id queue of one process (``SampleIds``).

AQ-SGD keeps a buffer per training sample, so an activation's sample ids travel in the codec's buffer. The
first stage's forward step pushes each micro-batch's ids (``push``); every activation send takes the oldest
(``sending``: whatever the codec, so the queue stays bounded; an error when the codec needs them and none are
queued); an activation receive whose codec decoded ids queues them for this stage's own send (``received``),
unless this is the last stage. Gradients carry none.
"""

from __future__ import annotations

import collections

import torch

__all__ = ["SampleIds"]


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

    def sending(self, direction: str, codec) -> torch.Tensor | None:
        """The ids a send on a ``direction`` link carries through ``codec``: an activation send consumes the
        oldest (other codecs ignore them); None for gradients."""
        return self.pop(required=codec.needs_sample_ids) if direction == "forward" else None

    def received(self, m) -> None:
        """A decoded receive (a ``message.Message``): an activation's ids go on to this stage's queue."""
        if m.codec.needs_sample_ids and m.link.direction == "forward" and not m.last_stage:
            self.push(m.codec.last_sample_ids)
