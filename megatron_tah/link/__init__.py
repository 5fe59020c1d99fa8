"""The pipeline link: pipeline-parallel messages through codecs, apart from Megatron.

``transport.PipelineTransport`` takes megatron-core's p2p transport arguments (the tensors, the process
group, the peers) and sends each message as a codec buffer (``wire.py``: the codec buffer and, with
``auto``, a 24-byte trailer), decoding into the receiver's tensor. Around it: ``link.py`` (a link end: its
codec and its steps), ``steps.py`` (what a message goes through between the codec and the wire: entropy
framing, ``frames.py``; the trailer, ``trailer.py``), ``message.py`` (one posted message), ``handshake.py``
(neighbouring stages agree on their codecs), ``staging.py`` (gloo through pinned host memory), ``emulate.py``
(a slow link in process), and ``auto``: ``measure.py`` (link rate, codec costs), ``choice.py`` (the choice,
its probation) and ``auto.py`` (the lockstep protocol per link end).

Imports the config and the codecs, never Megatron: the pipeline place (``megatron/pipeline_parallel.py``)
puts the transport in megatron-core's place and hands it the training iteration.
"""
