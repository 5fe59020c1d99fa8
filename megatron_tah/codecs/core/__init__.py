"""The wire core every codec is built on: the contract (``base``), its header, checks, checksum and errors,
the pure-torch building blocks (``common``: packing, quantization, rounding noise), the lossless coders after
a codec (``entropy`` with ``zstd``, ``ans`` and ``huffman``), CUDA-graph replay (``graphs``), device timing
(``timing``), what a codec declares (``options``) and activation-like test data (``samples``)."""
