"""auto against the default codec over seeds on the demo's slow link (``python -m benchmarks.auto_seeds``)."""
