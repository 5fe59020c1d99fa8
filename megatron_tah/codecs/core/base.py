"""The codec contract shared by every codec.

Every codec turns a tensor into one contiguous 1-D ``torch.uint8`` buffer whose
length depends only on the tensor's shape and dtype and on the codec's config
(``wire_nbytes``), so a pipeline receiver can post its receive before anything
arrives. Subclasses describe their buffer as a list of named sections, laid out
behind a 16-byte header (``header.py``: the wire format). Decoding checks the
length and every header field (``checks.py``: now or deferred to the device) and
raises :class:`WireFormatError` naming what differs, instead of returning garbage.

The checksum (``Codec(checksum=True)``, ``--tah-wire-checksum``) covers every byte after the
header. The sender computes it on the device after encoding; a decoder with the checksum on
recomputes it and raises :class:`PayloadChecksumError` when the two differ (bytes changed on
the way). Both ends must agree: a decoder with the checksum on rejects a buffer whose field is
0 (its sender had it off), one with it off rejects a buffer that carries a checksum.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from . import checksum as wire_checksum
from .checks import BufferChecks, DeferredErrors
from .checksum import ChecksumField
from .common import RoundingState
from .errors import CodecError, check_dtype, check_shape, dtype_name
from .header import WireHeader, WireLayout, crc32_of

CHECKSUM_DEFAULT = wire_checksum.ENABLED_BY_DEFAULT
BACKENDS = ("auto", "torch", "triton")
LAYOUT_CACHE_SIZE = 64  # layouts a codec object keeps (one per shape and dtype it has seen)


class Codec(WireHeader, ChecksumField, BufferChecks, RoundingState):
    """Base class: the contract, the layout cache and the backend choice.

    Subclasses set ``name`` and ``codec_id``, keep their options as plain
    attributes listed in ``config()``, and implement ``_sections`` (the wire
    layout), ``_encode_torch`` and ``_decode_torch`` (the pure-torch
    reference). A fused path implements ``_encode_triton`` / ``_decode_triton``
    with the same wire format; ``backend`` picks one (``"auto"``: Triton for
    CUDA tensors when it is available, torch otherwise). ``_decode_*`` take
    ``out``: a contiguous tensor of the message's shape and dtype to write the
    values into and return (no intermediate tensor of that size), or None for a
    new one. ``checksum`` puts a checksum of the payload in the header and
    checks it on decode (``checksum.py``).

    Its other methods come from the core modules they belong to: the header
    (``header.WireHeader``), the checksum field (``checksum.ChecksumField``),
    a decoder's checks (``checks.BufferChecks``: ``check_buffer``,
    ``defer_checks``, ``raise_deferred_errors``, ...) and the state kept
    between messages (``common.RoundingState``: ``state_dict``, ``salt_rounding``).

    A codec's config is fixed when it is made, so its layouts are cached per
    (shape, dtype): ``_sections`` runs once for each.
    """

    name: str = "?"
    codec_id: int = 255

    def __init__(self, backend: str = "auto", checksum: bool = CHECKSUM_DEFAULT):
        if backend not in BACKENDS:
            raise CodecError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if not isinstance(checksum, bool):
            raise CodecError(f"checksum must be True or False, got {checksum!r}")
        self.backend = backend
        self.checksum = checksum
        self.checks = "full"
        self._header_cache: dict[tuple, torch.Tensor] = {}
        self._layouts: dict[tuple, WireLayout] = {}
        self._deferred: dict[str, DeferredErrors] = {}
        self._deferred_checksum: dict[str, DeferredErrors] = {}
        self.payload_checksum = wire_checksum.PayloadChecksum()  # its constants, per device

    # ----- configuration -------------------------------------------------------------
    def config(self) -> dict:
        """Options that change the bytes on the wire (the backend does not)."""
        raise NotImplementedError

    def code_sections(self) -> dict[str, int]:
        """The buffer's sections of bit-packed codes (``common.pack_bits``): name -> bits per code. What a
        lossless coder after the codec reads as symbols (``entropy.py``); every other section is bytes."""
        return {}

    def config_digest(self) -> int:
        items = ",".join(f"{k}={self.config()[k]!r}" for k in sorted(self.config()))
        return crc32_of(f"{self.name}({items})")

    def describe(self) -> str:
        items = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{self.name}({items})"

    def __repr__(self) -> str:
        return f"<codec {self.describe()} backend={self.backend}>"

    # ----- what a codec can do -------------------------------------------------------
    graph_capturable: bool = True
    """Whether encode and decode (deferred checks, rounding to nearest) make no host sync and keep no per-call
    host state, so a CUDA graph can replay them (``graphs.GraphedCodec``); ``graph_blocker`` says why not."""
    graph_blocker: str = ""
    graph_no_gain: str = ""
    """Why a replay would not pay although the codec could be captured ("" when it would: ``none`` copies once)."""

    needs_sample_ids: bool = False
    """Whether ``encode`` takes the micro-batch's sample ids (a per-sample buffer, as in AQ-SGD)."""

    # ----- the public contract -------------------------------------------------------
    def wire_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """Exact length of ``encode(x)`` for any ``x`` of this shape and dtype."""
        return self.layout(shape, dtype).nbytes

    def layout(self, shape: Sequence[int], dtype: torch.dtype) -> WireLayout:
        """The wire layout for ``shape``/``dtype``, built once and then taken from the cache."""
        return self._cached_layout((tuple(shape), dtype), shape, dtype, self._sections)

    def _cached_layout(self, key: tuple, shape, dtype, sections) -> WireLayout:
        layout = self._layouts.get(key)
        if layout is None:
            shape = check_shape(shape)
            check_dtype(dtype)
            if len(self._layouts) >= LAYOUT_CACHE_SIZE:  # (shapes that keep changing: start over)
                self._layouts.clear()
            layout = self._layouts[key] = WireLayout.build(sections(shape, dtype))
        return layout

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Encode ``x`` into a new 1-D uint8 buffer of ``wire_nbytes(x.shape, x.dtype)`` bytes on x's device."""
        if not isinstance(x, torch.Tensor):
            raise CodecError(f"encode takes a torch.Tensor, got {type(x).__name__}")
        shape = check_shape(x.shape)
        check_dtype(x.dtype)
        layout = self.layout(shape, x.dtype)
        buf = torch.empty(layout.nbytes, dtype=torch.uint8, device=x.device)
        # The header, and zeros in the alignment padding so identical inputs give identical bytes: one write.
        index, values = self._fixed_bytes(shape, x.dtype, layout, x.device)
        buf.index_put_((index,), values)
        if self._use_triton(x.device):
            self._encode_triton(x.contiguous(), buf, layout)
        else:
            self._encode_torch(x.contiguous(), buf, layout)
        self.write_checksum(buf)
        return buf

    def decode(
        self,
        buf: torch.Tensor,
        shape: Sequence[int],
        dtype: torch.dtype,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode ``buf`` into a new tensor of ``shape``/``dtype`` on buf's device, or into ``out``.

        With ``out`` (a receiver's buffer) the values are written straight into it and ``out`` is
        returned; only a non-contiguous ``out`` is decoded into a new tensor first and copied.
        """
        layout = self.layout(shape, dtype)
        shape = tuple(int(d) for d in shape)
        self._check(buf, shape, dtype, layout)
        target = None
        if out is not None:
            if tuple(out.shape) != shape or out.dtype != dtype:
                raise CodecError(
                    f"out is {tuple(out.shape)} {dtype_name(out.dtype)}, expected {shape} {dtype_name(dtype)}"
                )
            if out.device != buf.device:
                raise CodecError(f"out is on {out.device}, the buffer on {buf.device}")
            if out.is_contiguous():
                target = out.detach()
        values = self._decode_values(buf, shape, dtype, layout, target)
        if out is None:
            return values
        if target is None:
            with torch.no_grad():
                out.copy_(values)
        return out

    def decode_on_device(self, buf: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                         out: torch.Tensor) -> torch.Tensor:
        """The device part of ``decode`` into a contiguous ``out`` (what ``graphs.GraphedCodec`` captures).

        The caller has made the host checks (``_check_length``, ``raise_deferred_errors``); with deferred
        checks the header comparison runs here, on the device. Checks ``"full"`` read the host: use ``decode``.
        """
        if self.checks == "full":
            raise CodecError("decode_on_device needs checks 'deferred' or 'off' (full checks read the host)")
        layout = self.layout(shape, dtype)
        if self.checks == "deferred":
            self._check_header_on_device(buf, shape, dtype)
        return self._decode_values(buf, shape, dtype, layout, out)

    def _decode_values(self, buf, shape, dtype, layout: WireLayout, out: torch.Tensor | None) -> torch.Tensor:
        decode = self._decode_triton if self._use_triton(buf.device) else self._decode_torch
        with torch.no_grad():
            return decode(buf, shape, dtype, layout, out=out)

    # ----- backends --------------------------------------------------------------------
    def _use_triton(self, device: torch.device) -> bool:
        if self.backend == "torch":
            return False
        if self.backend == "triton":
            if not self.has_triton_path():
                raise CodecError(f"codec {self.name!r} has no Triton path; use backend='torch'")
            return True
        if device.type != "cuda" or not self.has_triton_path():
            return False
        from ...kernels import HAVE_TRITON  # a CUDA machine without Triton uses the torch reference

        return HAVE_TRITON

    def has_triton_path(self) -> bool:
        return type(self)._encode_triton is not Codec._encode_triton

    def _sections(self, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple[str, int]]:
        raise NotImplementedError

    def _encode_torch(self, x: torch.Tensor, buf: torch.Tensor, layout: WireLayout) -> None:
        raise NotImplementedError

    def _decode_torch(self, buf, shape, dtype, layout: WireLayout, out: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def _encode_triton(self, x: torch.Tensor, buf: torch.Tensor, layout: WireLayout) -> None:
        raise NotImplementedError

    def _decode_triton(self, buf, shape, dtype, layout: WireLayout, out: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    # ----- helpers for subclasses ------------------------------------------------------
    @staticmethod
    def bits_per_element(nbytes: int, shape: Sequence[int]) -> float:
        return 8.0 * nbytes / math.prod(shape)
