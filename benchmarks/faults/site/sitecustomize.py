"""The fault harness's in-process faults (``benchmarks/faults``), loaded by Python at start-up from
``PYTHONPATH`` in every process of a harness run; inert unless ``TAH_FAULT`` is set in a training rank.

``TAH_FAULT=KIND:RANK:ITERATION[:SECONDS]`` acts on world rank RANK's first forward message (activations)
at Megatron's training iteration ITERATION, once per job (``TAH_FAULT_DONE`` names a file made when it
has acted, so a restarted attempt runs clean):

* ``outage``: the message leaves SECONDS late -- to the next stage its link is silent that long, what a
  link that is down looks like from the receiving end (no ``tc`` here; the sender waits with it);
* ``corrupt``: one byte of the message's payload is flipped after encoding, as a faulty path would.
"""

import os

_SPEC = os.environ.get("TAH_FAULT")
if _SPEC and os.environ.get("RANK") is not None:
    import time
    from pathlib import Path

    from megatron_tah.link import transport as _transport

    _kind, _rank, _iteration, *_rest = _SPEC.split(":")
    _seconds = float(_rest[0]) if _rest else 0.0
    _done = Path(os.environ["TAH_FAULT_DONE"])
    _encode = _transport.PipelineTransport.encode

    def _faulty_encode(self, link, x):
        buf = _encode(self, link, x)
        if (int(os.environ["RANK"]) == int(_rank) and link.direction == "forward" and not _done.exists()
                and self.iteration() == int(_iteration)):
            _done.write_text(f"{_kind} at iteration {_iteration}, {time.time():.3f}\n")
            if _kind == "outage":
                time.sleep(_seconds)
            elif _kind == "corrupt":
                buf[buf.numel() // 2] ^= 0x10
        return buf

    _transport.PipelineTransport.encode = _faulty_encode
