"""The fault harness's in-process faults (``benchmarks/faults``), loaded by Python at start-up from
``PYTHONPATH`` in every process of a harness run; inert unless ``TAH_FAULT`` is set in a training rank.

``TAH_FAULT=KIND:RANK:ITERATION[:SECONDS]`` acts on world rank RANK's first forward message (activations)
at Megatron's training iteration ITERATION, once per job (``TAH_FAULT_DONE`` names a file made when it
has acted, so a restarted attempt runs clean):

* ``outage``: the message leaves SECONDS late -- to the next stage its link is silent that long, what a
  link that is down looks like from the receiving end (no ``tc`` here; the sender waits with it);
* ``corrupt``: one byte of the message's payload is flipped after encoding, as a faulty path would.

``TAH_FAULT=ratedrop:*:FIRST:LAST:FACTOR`` divides the emulated link's rate (``--tah-emulate-bandwidth``) by
FACTOR for the messages of iterations FIRST to LAST, in every rank (both ends of a link apply the model), then
gives it back: a rate that drops and recovers.
"""

import os

_SPEC = os.environ.get("TAH_FAULT")
if _SPEC and os.environ.get("RANK") is not None:
    import time
    from pathlib import Path

    from megatron_tah.link import transport as _transport

    _kind, _rank, _iteration, *_rest = _SPEC.split(":")
    _seconds = float(_rest[0]) if _rest else 0.0
    _done = Path(os.environ.get("TAH_FAULT_DONE", os.devnull + ".absent"))
    _encode = _transport.PipelineTransport.encode

    def _faulty_encode(self, link, x, *args, **kwargs):
        buf, rest = _encode(self, link, x, *args, **kwargs)  # the message, and an entropy-coded frame's overflow (None: none)
        if (int(os.environ["RANK"]) == int(_rank) and link.direction == "forward" and not _done.exists()
                and self.iteration() == int(_iteration)):
            _done.write_text(f"{_kind} at iteration {_iteration}, {time.time():.3f}\n")
            if _kind == "outage":
                time.sleep(_seconds)
            elif _kind == "corrupt":
                buf[buf.numel() // 2] ^= 0x10
        return buf, rest

    if _kind == "ratedrop":
        _last, _factor = int(_rest[0]), float(_rest[1])
        _finish = _transport.PipelineTransport.finish

        def _rate_dropping_finish(self, m):
            meter = self.emulation
            if meter is not None:
                if not hasattr(meter, "base_bps"):
                    meter.base_bps = meter.bandwidth_bps
                iteration = self.iteration()
                dropped = iteration is not None and int(_iteration) <= iteration <= _last
                meter.bandwidth_bps = meter.base_bps / _factor if dropped else meter.base_bps
            return _finish(self, m)

        _transport.PipelineTransport.finish = _rate_dropping_finish
    else:
        _transport.PipelineTransport.encode = _faulty_encode
