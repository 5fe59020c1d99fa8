"""The fault harness: what a WAN's faults do to a real pipeline run (``python -m benchmarks.faults``)."""
