"""benchmarks/ and the study scripts: speedrun, depth, real models, reproduce, faults, the reports."""
