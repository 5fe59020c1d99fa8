"""Fused Triton kernels behind the codecs' ``backend="triton"`` path.

One module per codec (``fixedpoint``, ``hadint``, ``tah`` with its bit allocation in ``tah_alloc``, ``fp8``),
each exposing ``triton_<codec>_encode`` / ``triton_<codec>_decode`` launchers that fill or read
the same wire sections, byte for byte, as the codec's torch reference (``codecs/``); ``laaq`` packs
tensors saved for backward (memory, no wire header) with the ``fixedpoint`` kernels. Shared
``@triton.jit`` helpers (the tile blocks, butterfly Hadamard, tree sums, directed rounding, the
quantizer, bit packing) and the launch/recording machinery live in ``common``.

Dependencies point one way, codecs -> kernels -> geometry: the launchers take plain ints and
tensors (the wire sections as uint8 views, by the names the codec's layout gives them), never codec
objects, and import nothing from ``codecs/`` (``tests/project/test_layering.py`` checks). A codec with a
kernel keeps its wire layout here, in its kernel module (``fixedpoint_sections`` ...), and imports it
from there: one stem per codec across the layers.

Every module imports without Triton; its launchers then raise
``RuntimeError("... needs triton")``. Kernels run on CUDA tensors, or on CPU
tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton
is imported).
"""

from .common import HAVE_TRITON, require_triton

__all__ = ["HAVE_TRITON", "require_triton"]
