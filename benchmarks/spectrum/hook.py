"""A pipeline stage of ``python -m megatron_tah.pretrain_gpt`` that records its activation messages' spectrum.

Started by ``benchmarks.spectrum.run`` in place of ``megatron_tah.pretrain_gpt`` (same flags). Before
Megatron's loop starts it wraps the transport's per-message encode (``PipelineTransport.encode``
in ``megatron_tah.link.transport``, looked up at call time), so that the first forward message this stage sends in every N-th training
iteration (``args.curr_iteration``, N from ``$TAH_SPECTRUM_EVERY``; evaluations come after the
iteration's training messages, so they are never the first) adds one JSON line to
``$TAH_SPECTRUM_OUT/rank<r>.jsonl``: ``{"iteration", "rank", "shape", "share": {k: share}}``
(``benchmarks.common.energy.energy_share``). Training itself is unchanged.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..common.energy import energy_share

ENV_OUT = "TAH_SPECTRUM_OUT"
"""The folder the stage hook writes its records to (set by ``run``; read when the hook is installed)."""
ENV_EVERY = "TAH_SPECTRUM_EVERY"


def install() -> None:
    from megatron.training.global_vars import get_args

    from megatron_tah.link.transport import PipelineTransport

    folder, every = Path(os.environ[ENV_OUT]), int(os.environ[ENV_EVERY])
    rank = int(os.environ.get("RANK", "0"))
    original, seen = PipelineTransport.encode, set()

    def encode(transport, link, x, *args, **kwargs):
        if link.direction == "forward":
            iteration = int(getattr(get_args(), "curr_iteration", 0) or 0)
            if iteration % every == 0 and iteration not in seen:
                seen.add(iteration)
                record = {"iteration": iteration, "rank": rank, "shape": list(x.shape),
                          "share": energy_share(x.float())}
                with open(folder / f"rank{rank}.jsonl", "a") as f:
                    f.write(json.dumps(record) + "\n")
        return original(transport, link, x, *args, **kwargs)

    PipelineTransport.encode = encode


if __name__ == "__main__":
    install()
    from megatron_tah.pretrain_gpt import main

    main()
