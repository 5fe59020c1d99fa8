"""The pipeline link: pipeline-parallel messages through codecs, apart from Megatron.

``transport.PipelineTransport`` takes megatron-core's p2p transport arguments (the tensors, the process
group, the peers) and sends each message as a codec buffer (``wire.py``: the codec buffer and, with
``auto``, a 24-byte trailer), decoding into the receiver's tensor. Around it: ``link.py`` (a link end: its
boundary, codec and steps), ``steps.py`` (what a message goes through between the codec and the wire: entropy
framing, ``frames.py``; the trailer, ``trailer.py``; the emulated slow link, ``emulate.py``), ``traffic.py``
(the codec of the next message: the warm-up and evaluation switch), ``sample_ids.py`` (AQ-SGD's sample-id
queue), ``states.py`` (the link ends' codec state, for checkpoints), ``message.py`` (one posted message),
``outbox.py`` (the posted messages held until finished), ``overflow.py`` (a receive's length, a batched call's
second messages), ``handshake.py`` (neighbouring stages agree on their codecs), ``peer.py`` (bounded waits),
``staging.py`` (gloo through pinned host memory), and ``auto``: ``measure.py`` (link rate, codec costs),
``choice.py`` (the choice, its probation) and ``auto.py`` (the lockstep protocol per link end).

The message protocol -- no part of a message is lost, no wait is unbounded:

* One pipeline message is one transfer (one send, one receive of the same link, Megatron's order and groups),
  except a framed entropy-coded message that overflows its frame (below). A receive posts the most its message
  can be: the codec's ``wire_nbytes`` (fixed by shape and dtype), or with ``--tah-entropy-coding`` on gloo the
  coder's most plus a 4-byte length; the sender sends exactly what it made (``frames.py``: gloo writes a shorter
  message into the start of a larger receive, and the length says where it ends), then the trailer when on.
* Where a receive must be the send's size (NCCL), an entropy-coded message goes in a frame of a size both ends
  agree on, and what does not fit follows as a second message in one more batch of the same batched call,
  posted by both ends in one order once the frames are complete, each ``Work`` its message's; unbatched
  transfers with entropy coding are refused there (``overflow.py``).
* Every posted ``Work`` belongs to its message until it is finished: the batched path waits for its messages
  and their second messages before returning; the unbatched path hands Megatron a handle per message and
  holds the message (``outbox.py``) until the handle is waited, until the first call of a later iteration
  (a send Megatron never waited for), or until uninstall, which waits for every send still posted. No send's
  ``Work`` is dropped before its receiver took it (gloo would then never send it).
* Every wait -- a message, a second message, a drained send, the handshake's -- goes through the peer watch
  (``peer.PeerWatch``): bounded by ``--tah-peer-timeout-s`` once the peer has been heard from (before that,
  start-up, by the process group's timeout), and a silent or dead peer raises ``PeerTimeoutError`` /
  ``PeerLostError`` naming the link and the iteration.

Imports the config and the codecs, never Megatron: the pipeline place (``megatron/pipeline_parallel.py``)
puts the transport in megatron-core's place and hands it the training iteration.
"""
