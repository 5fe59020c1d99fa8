"""Run an unchanged Megatron-LM training script with megatron_tah plugged in.

    python -m megatron_tah.launch <Megatron-LM>/pretrain_gpt.py <megatron args> <--tah-* args>
    torchrun --nproc-per-node 8 -m megatron_tah.launch <Megatron-LM>/pretrain_gpt.py ...

Installs the plugin (``megatron_tah.megatron.plugin.install_megatron_lm_plugin``: ``--tah-*``
flags, statistics in the log line, compressed pipeline transports once arguments are parsed),
then runs SCRIPT as ``__main__`` with ``sys.argv = [SCRIPT, *ARGS]``. SCRIPT's directory goes first
on ``sys.path`` before anything imports ``megatron`` (as ``python SCRIPT`` would): a Megatron-LM
checkout's own ``megatron`` package is the one that runs, and pretrain_gpt.py finds its siblings.
Exit status: the script's; 2 with a one-line message when SCRIPT is missing.
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: python -m megatron_tah.launch SCRIPT [SCRIPT ARGS...]  (e.g. <Megatron-LM>/pretrain_gpt.py --num-layers 24 ... --tah-forward-codec tah)"


RENDEZVOUS_DEFAULTS = (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"))


def default_rendezvous(environ=os.environ) -> None:
    """Fill in the ``env://`` variables a process started without torchrun lacks (set ones are kept): rank 0 of
    ``WORLD_SIZE`` (1) on 127.0.0.1. ``MASTER_PORT``: 0 for one process, so that its store binds a port of its own
    (a port found free and closed again can be taken by another process before the store binds it); for several
    processes a port free now (give ``MASTER_PORT`` where they must meet)."""
    for key, value in RENDEZVOUS_DEFAULTS:
        environ.setdefault(key, value)
    if "MASTER_PORT" not in environ:
        if environ["WORLD_SIZE"] == "1":
            environ["MASTER_PORT"] = "0"
        else:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                environ["MASTER_PORT"] = str(s.getsockname()[1])


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        raise SystemExit(2 if not argv else 0)
    script, script_args = argv[0], argv[1:]
    if not os.path.isfile(script):
        print(f"megatron_tah.launch: error: script {script!r} not found (expected e.g. <Megatron-LM checkout>/pretrain_gpt.py)",
              file=sys.stderr)
        raise SystemExit(2)

    script = os.path.abspath(script)
    # The checkout first, before anything imports ``megatron``: its own package is the one that runs
    # (the installed megatron-core would otherwise win, and the checkout's sibling modules be missing).
    sys.path.insert(0, os.path.dirname(script))
    from .megatron.plugin import install_megatron_lm_plugin

    install_megatron_lm_plugin()
    sys.argv = [script, *script_args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
