"""Experiments on megatron_tah, kept out of the installed package (the wheel ships ``megatron_tah*`` only).

Run from the repository root; each imports the product as any user would:

* ``python -m benchmarks.reproduce PART`` -- the small-scale reproduction of the TAH-Quant and AQ-SGD
  papers and the convergence parity study; writes ``docs/RESULTS.md`` and ``docs/PARITY.md``
  (``scripts/reproduce.sh`` runs its parts).
* ``python -m benchmarks.codec_report`` -- every codec's bits, error and time on one activation-like tensor.
"""
