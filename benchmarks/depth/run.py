"""One training run with emulated pipeline boundaries (``boundaries.py``), in this process.

    python -m benchmarks.depth.run --boundaries 1,2,3,4,5,6,7 --forward '{"tah_preset": "paper"}' \\
        --backward '{"tah_preset": "paper"}' --log errors.jsonl -- <megatron_tah.pretrain_gpt flags>

``--forward`` / ``--backward``: ``TahConfig`` fields as JSON (the forward codec of the first, the backward
codec of the second; ``{}``: none). The Megatron flags are ``megatron_tah.pretrain_gpt``'s, at pipeline
depth 1 (the default); the run is one process (``RANK=0``, ``WORLD_SIZE=1``, a free local port).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, megatron = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m benchmarks.depth.run", description=__doc__.split("\n")[0])
    parser.add_argument("--boundaries", default="", help="layer numbers (1-based) followed by a boundary, comma list")
    parser.add_argument("--forward", default="{}", help="TahConfig fields of the forward codec, JSON")
    parser.add_argument("--backward", default="{}", help="TahConfig fields of the backward codec, JSON")
    parser.add_argument("--log", help="JSON-lines file of sampled round-trip errors and message rms")
    parser.add_argument("--per-boundary", default="{}", help='forward codec at single boundaries, JSON {"7": {...}}')
    parser.add_argument("--warmup-iters", type=int, default=0, help="first N iterations uncompressed")
    parser.add_argument("--capture", help="folder: save the messages entering the codecs in --capture-at iterations")
    parser.add_argument("--capture-at", default="", help="training iterations to capture messages in, comma list")
    parser.add_argument("--capture-per", type=int, default=1, help="messages per boundary, direction and iteration")
    args = parser.parse_args(ours)
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    from .boundaries import Boundaries

    layers = [int(k) for k in args.boundaries.split(",") if k.strip()]
    boundaries = Boundaries(layers, json.loads(args.forward), json.loads(args.backward), log=args.log,
                            per_boundary=json.loads(args.per_boundary), warmup_iters=args.warmup_iters,
                            capture=args.capture, capture_at=[int(k) for k in args.capture_at.split(",") if k.strip()],
                            capture_per=args.capture_per)
    boundaries.install()
    from megatron_tah import pretrain_gpt

    sys.argv = ["megatron_tah.pretrain_gpt", *megatron]
    pretrain_gpt.main()


if __name__ == "__main__":
    main()
