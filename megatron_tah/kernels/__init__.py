"""Fused Triton kernels behind the codecs' ``backend="triton"`` path.

One module per codec (``fixedpoint``, ``tah``, ``fp8``), each exposing
``triton_<codec>_encode`` / ``triton_<codec>_decode`` launchers that fill or
read the same wire sections as the codec's torch reference (``codecs/``).
Shared ``@triton.jit`` helpers (bf16 directed rounding, round half to even,
the asymmetric tile quantizer, bit packing) live in ``common``.

Every module imports without Triton; its launchers then raise
``RuntimeError("... needs triton")``. Kernels run on CUDA tensors, or on CPU
tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton
is imported).
"""

from .common import HAVE_TRITON, require_triton

__all__ = ["HAVE_TRITON", "require_triton"]
