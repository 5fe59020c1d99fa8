"""The pipeline link: pipeline-parallel messages through codecs, apart from Megatron.

``transport.PipelineTransport`` takes megatron-core's p2p transport arguments (the tensors, the process
group, the peers) and sends each message as a codec buffer, decoding into the receiver's tensor. Its parts:
``link.py`` (a link end -- boundary, codec, steps -- and what the link ends share: the traffic switch, AQ-SGD's
sample-id queue, the codec state), ``message.py`` (a message's life: its buffers and host staging, the outbox,
its length, second messages), ``wire.py`` (the bytes on the wire: the codec buffer, the 24-byte trailer and its
step, completion timing), ``steps.py`` (what a message goes through between the codec and the wire), with the
steps ``frames.py`` (entropy framing) and ``emulate.py`` (the emulated slow link); ``handshake.py`` (neighbouring
stages agree on their codecs), ``peer.py`` (bounded waits); and ``auto``: ``measure.py`` (link rate, codec
costs), ``choice.py`` (the choice, its probation), ``auto.py`` (the lockstep protocol per link end).

The send path (``batched_p2p_ops`` / ``p2p_ops`` -> ``send``)::

    transport.send      the link end (link.open_link), its host staging (message.HostStaging)
    transport.encode    the codec of the message (link.Traffic), its encode (+ link.SampleIds.encode_inputs)
    steps.on_send       frames.FramingStep (coded, framed) -> wire.TrailerStep (trailer appended)
    transport.record_send   statistics, an error sample (transport.sample_error)
    message.Message.send    its host copy started (message.HostStaging.stage_send)
    batched_p2p_ops / p2p_ops   message.Message.stamp (wire.stamp_sent_at), posted (peer.posted_batch, posted)

The receive path (``transport.receive`` posts; ``transport.finish`` once complete, send or receive)::

    transport.receive   bytes to post: the codec's, then steps.post_nbytes; message.Message.receive
    message.Message.read      its length (steps' received/follow_nbytes), its trailer (wire.read_trailer)
    steps.on_complete   emulate.EmulationStep: the emulated link's delay
    steps.on_arrival    wire.TrailerStep: announcement, transit report, rate meter (auto)
    transport._decode   message.Message.codec_buffer (staged back to the device), steps.on_receive
                        (frames: decoded back to the codec's buffer), codec.decode, link.SampleIds.received

The message protocol -- no part of a message is lost, no wait is unbounded:

* One pipeline message is one transfer (one send, one receive of the same link, Megatron's order and groups),
  except a framed entropy-coded message that overflows its frame (below). A receive posts the most its message
  can be: the codec's ``wire_nbytes`` (fixed by shape and dtype), or with ``--tah-entropy-coding`` on gloo the
  coder's most plus a 4-byte length; the sender sends exactly what it made (``frames.py``: gloo writes a shorter
  message into the start of a larger receive, and the length says where it ends), then the trailer when on.
* Where a receive must be the send's size (NCCL), an entropy-coded message goes in a frame of a size both ends
  agree on, and what does not fit follows as a second message in one more batch of the same batched call,
  posted by both ends in one order once the frames are complete, each ``Work`` its message's; unbatched
  transfers with entropy coding are refused there (``message.post_rests``, ``frames.FramingStep.check_unbatched``).
* Every posted ``Work`` belongs to its message until it is finished: the batched path waits for its messages
  and their second messages before returning; the unbatched path hands Megatron a handle per message and
  holds the message (``message.Outbox``) until the handle is waited, until the first call of a later iteration
  (a send Megatron never waited for), or until uninstall, which waits for every send still posted. No send's
  ``Work`` is dropped before its receiver took it (gloo would then never send it).
* Every wait -- a message, a second message, a drained send, the handshake's -- goes through the peer watch
  (``peer.PeerWatch``): bounded by ``--tah-peer-timeout-s`` once the peer has been heard from (before that,
  start-up, by the process group's timeout), and a silent or dead peer raises ``PeerTimeoutError`` /
  ``PeerLostError`` naming the link and the iteration.

Imports the config and the codecs, never Megatron: the pipeline place (``megatron/pipeline_parallel.py``)
puts the transport in megatron-core's place and hands it the training iteration.
"""
