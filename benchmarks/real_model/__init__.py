"""A real pretrained model trained through the codecs (``python -m benchmarks.real_model``; docs/REAL_MODEL.md)."""
