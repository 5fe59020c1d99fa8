"""Saved-tensor quantizer (LAAQ): one launch packs a tensor into one uint8 buffer, one launch unpacks it.

This is memory, not a wire: no header, no checksum, no layout object. A tensor of ``n`` elements,
read flat in memory order, is cut into ``B = ceil(n / block)`` blocks of ``block`` consecutive
elements (the last one padded by repeating the last element), each quantized asymmetrically at
``bits`` bits with a bf16 scale and zero -- the ``fixedpoint`` quantizer's math and bytes
(``codecs/core/common.quantize_tiles``, the torch reference), run by its fused kernel on the tensor
viewed as a single row of ``n`` channels. The buffer holds, back to back::

    scale: bf16[B] | zero: bf16[B] | codes: B * block codes of ``bits`` bits (8 codes in ``bits`` bytes)

``nbytes(n, bits, block)`` is its size: ``(bits + 32 / block) / 8`` bytes per element. Every
element decodes within half a step (``scale / 2``) of its input; a constant block decodes to its
value rounded down to bf16 (exactly when it is bf16-representable, zeros included); a block
holding NaN, +-Inf or a magnitude above ``numerics.MAX_ABS_VALUE`` decodes to NaN throughout.

The launchers take plain tensors and ints; ``sections`` gives the named views of a buffer.
"""

from __future__ import annotations

import functools

import torch

from .fixedpoint import fixedpoint_sections, triton_fixedpoint_decode, triton_fixedpoint_encode

SECTIONS = ("scale", "zero", "codes")


@functools.lru_cache(maxsize=1024)
def _offsets(numel: int, bits: int, block: int) -> tuple[tuple[str, int, int], ...]:
    """(name, start, end) of each section (a saved tensor's shapes repeat every micro-batch: cached)."""
    out, start = [], 0
    for name, size in fixedpoint_sections((numel,), bits, block):
        out.append((name, start, start + size))
        start += size
    return tuple(out)


def nbytes(numel: int, bits: int, block: int) -> int:
    """Bytes of the buffer that holds ``numel`` elements at ``bits`` bits, one scale/zero per ``block``."""
    return _offsets(numel, bits, block)[-1][2]


def sections(buf: torch.Tensor, numel: int, bits: int, block: int) -> dict[str, torch.Tensor]:
    """``{"scale", "zero", "codes"}``: uint8 views of ``buf`` (1-D uint8 of ``nbytes(...)`` bytes)."""
    offsets = _offsets(numel, bits, block)
    if buf.numel() != offsets[-1][2] or buf.dtype != torch.uint8:
        raise ValueError(f"laaq buffer: expected {offsets[-1][2]} uint8 bytes for {numel} elements at {bits} bits, "
                         f"block {block}; got {buf.numel()} {buf.dtype}")
    return {name: buf[start:end] for name, start, end in offsets}


def triton_laaq_pack(x: torch.Tensor, bits: int, block: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack contiguous fp32/fp16/bf16 ``x`` into ``out`` (or a new buffer of ``nbytes`` bytes): one launch."""
    if not x.is_contiguous():
        raise ValueError("triton_laaq_pack needs a contiguous tensor")
    numel = x.numel()
    if out is None:
        out = torch.empty(nbytes(numel, bits, block), dtype=torch.uint8, device=x.device)
    triton_fixedpoint_encode(x.view(numel), sections(out, numel, bits, block), bits, block)
    return out


def triton_laaq_unpack(buf: torch.Tensor, shape, dtype: torch.dtype, bits: int, block: int,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """Unpack ``buf`` into ``out`` (contiguous, ``shape``/``dtype``) or a new tensor: one launch."""
    numel = 1
    for d in shape:
        numel *= int(d)
    if out is None:
        out = torch.empty(tuple(shape), dtype=dtype, device=buf.device)
    triton_fixedpoint_decode(sections(buf, numel, bits, block), (numel,), dtype, bits, block, out=out.view(numel))
    return out
