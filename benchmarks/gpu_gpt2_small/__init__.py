"""A GPT-2-small-shaped run at PP 2 on one GPU (``python -m benchmarks.gpu_gpt2_small``)."""
