"""megatron_tah/kernels: the Triton kernels against the codecs' torch paths (Triton's interpreter on the CPU)."""
