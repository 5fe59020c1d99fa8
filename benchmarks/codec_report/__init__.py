"""Every codec's bits, error and time on one tensor (``python -m benchmarks.codec_report``), or on real models'
hidden states (``--real``: ``real``)."""
