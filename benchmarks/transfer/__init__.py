"""A codec's error on the toy against a real model's (``python -m benchmarks.transfer``)."""
