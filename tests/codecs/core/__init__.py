"""megatron_tah/codecs/core: the payload checksum, the lossless coders, CUDA-graph replay."""
