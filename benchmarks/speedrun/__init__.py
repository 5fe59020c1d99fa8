"""Time to a target loss over a WAN: the ProtocolNanoGPT scoring applied to megatron_tah's codecs.

* ``simulate`` -- a discrete-event model of Megatron's 1F1B under the inbound-wire link model,
  calibrated on the two published ProtocolNanoGPT records, and the projection of each codec's
  seconds per step and time to target on that setup (``python -m benchmarks.speedrun.projection``).

Embeddings: the model carries the pipeline's messages and nothing else, i.e. untied embeddings (what the
pretraining scripts use when ``RATE`` is set). Tied, Megatron adds an all-reduce of the
``vocabulary x hidden`` gradient between the first and the last stage each step, which this model does
not carry; docs/WAN_BYTES.md measures it.
"""
