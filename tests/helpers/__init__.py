"""What several tests share: the codec cases, edge-case inputs, multi-process runs, the tiny GPT, CUDA fakes."""
