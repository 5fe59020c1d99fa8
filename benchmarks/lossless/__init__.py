"""What a lossless coder after each preset saves (``python -m benchmarks.lossless``): ``measure`` (the study),
``coders`` (each coder's cost and savings), ``coder_libraries`` (the host coder's library, chosen by measurement)."""
