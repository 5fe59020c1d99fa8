"""Small-scale reproduction of the TAH-Quant and AQ-SGD papers' claims (``scripts/reproduce.sh``).

Parts (``python -m benchmarks.reproduce PART``):

* ``throughput`` -- tokens/s per codec and link rate over real rate-limited links
  (:mod:`.throughput`), next to the bound ``(c + t_raw) / (c + t_wire)``.
* ``convergence`` -- pretraining (Shakespeare) and fine-tuning (State of the Union)
  per codec, validation loss curves (:mod:`.convergence`).
* ``ablations`` -- the paper's tau / bit-mix / tile-size / allocation ablations.
* ``memory`` -- AQ-SGD's per-sample buffer bytes vs TAH-Quant's (none).
* ``report`` -- regenerate ``docs/RESULTS.md`` and its PNG plots from the collected
  logs (:mod:`.report`); every number in it comes from a log file under ``runs/reproduce``.

Each run (``python -m megatron_tah.pretrain_gpt``, Megatron-LM's loop) writes ``NAME.jsonl`` (the plugin's per-iteration records) and
``NAME.meta.json`` (command, status, wall time, load average, peak RSS) under
``runs/reproduce/PART/``; :mod:`benchmarks.common.runner` skips runs that already completed.
"""
