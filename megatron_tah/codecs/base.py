"""The codec contract shared by every codec, and the wire header.

Every codec turns a tensor into one contiguous 1-D ``torch.uint8`` buffer whose
length depends only on the tensor's shape and dtype and on the codec's config
(``wire_nbytes``), so a pipeline receiver can post its receive before anything
arrives. Subclasses describe their buffer as a list of named sections; this
module lays the sections out behind a 16-byte header:

====== ===== ==========================================================
offset bytes  field
====== ===== ==========================================================
0      2      magic ``b"MT"``
2      1      wire format version (``WIRE_VERSION``)
3      1      codec id (``Codec.codec_id``)
4      4      CRC-32 of the codec's config (little endian)
8      4      CRC-32 of the shape and dtype (little endian)
12     4      payload checksum (little endian; ``checksum.py``), 0: none
====== ===== ==========================================================

Sections follow in the order the codec lists them, each starting on an
8-byte boundary (so bf16/fp32 sections can be viewed in place). Decoding
checks the length and every header field and raises :class:`WireFormatError`
naming what differs, instead of returning garbage.

The checksum (``Codec(checksum=True)``, ``--tah-wire-checksum``) covers every byte after the
header. The sender computes it on the device after encoding; a decoder with the checksum on
recomputes it and raises :class:`PayloadChecksumError` when the two differ (bytes changed on
the way). Both ends must agree: a decoder with the checksum on rejects a buffer whose field is
0 (its sender had it off), one with it off rejects a buffer that carries a checksum.

Checks, per codec object (``Codec.checks``): ``"full"`` (the default) reads the header
on the host and raises at once; on a GPU that is one device-to-host copy, a sync, per
decode. ``"deferred"`` (``Codec.defer_checks()``, for a link whose configurations a
handshake has already compared) compares the header with the expected bytes on the
device and counts mismatches and corrupt payloads there; a later ``decode`` (or
``raise_deferred_errors()``) raises once the count has reached the host, without ever
waiting for it (checksum failures are counted apart and raise :class:`PayloadChecksumError`).
``"off"`` checks only the buffer's length (and no checksum).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Sequence

import torch

from . import checksum as wire_checksum
from ..numerics import MAX_ABS_VALUE  # noqa: F401  (re-exported: finite inputs up to it round-trip)

MAGIC = b"MT"
WIRE_VERSION = 2  # 2: bytes 12-15 hold the payload checksum (1: reserved, zero)
HEADER_NBYTES = 16
CHECKSUM_OFFSET = 12  # the header's last 4 bytes
CHECKSUM_DEFAULT = wire_checksum.ENABLED_BY_DEFAULT
SECTION_ALIGN = 8

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = ("auto", "torch", "triton")
CHECKS = ("full", "deferred", "off")
LAYOUT_CACHE_SIZE = 64  # layouts a codec object keeps (one per shape and dtype it has seen)


class CodecError(ValueError):
    """A codec was configured or called with something it cannot handle."""


class WireFormatError(CodecError):
    """A buffer does not match what this decoder expects (length, header, config, shape)."""


def link_text(sender_stage: int, receiver_stage: int, iteration: int | None) -> str:
    """Where a message went wrong, as errors name it: ``"link stage 0 -> stage 1, iteration 12"``
    (without the iteration when it is None: outside Megatron's training loop)."""
    where = f"link stage {sender_stage} -> stage {receiver_stage}"
    return where if iteration is None else f"{where}, iteration {iteration}"


class PayloadChecksumError(WireFormatError):
    """A buffer's payload does not match the checksum in its header: bytes changed on the way.

    Attributes: ``codec`` (the decoder's description), ``found`` and ``computed`` (the header's value
    and the payload's; None when the failure was counted on the device), ``count`` (buffers that
    failed), and ``link`` / ``iteration`` (None until the transport names them with ``at``).
    """

    def __init__(self, message: str, *, codec: str, found: int | None = None, computed: int | None = None,
                 count: int = 1, link: tuple[int, int] | None = None, iteration: int | None = None):
        super().__init__(message)
        self.message = message
        self.codec, self.found, self.computed, self.count = codec, found, computed, count
        self.link, self.iteration = link, iteration

    def at(self, sender_stage: int, receiver_stage: int, iteration: int | None) -> "PayloadChecksumError":
        """This error on a given link and iteration, its message starting with ``link_text``; raise it from this one."""
        return PayloadChecksumError(
            f"{link_text(sender_stage, receiver_stage, iteration)}: {self.message}", codec=self.codec,
            found=self.found, computed=self.computed, count=self.count,
            link=(sender_stage, receiver_stage), iteration=iteration)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_dtype(dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise CodecError(
            f"unsupported dtype {dtype_name(dtype)}: codecs take "
            f"{', '.join(dtype_name(d) for d in SUPPORTED_DTYPES)}"
        )


def check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(int(d) for d in shape)
    if len(shape) == 0 or any(d <= 0 for d in shape):
        raise CodecError(f"shape {shape} must have at least one dimension and no empty dimensions")
    return shape


def align_up(n: int, alignment: int = SECTION_ALIGN) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclasses.dataclass(frozen=True)
class WireLayout:
    """Byte offsets of a codec's sections inside one buffer (header first)."""

    offsets: dict[str, tuple[int, int]]  # name -> (start, nbytes)
    nbytes: int

    @classmethod
    def build(cls, sections: Sequence[tuple[str, int]]) -> "WireLayout":
        offsets = {}
        cursor = HEADER_NBYTES
        for name, size in sections:
            cursor = align_up(cursor)
            offsets[name] = (cursor, int(size))
            cursor += int(size)
        return cls(offsets=offsets, nbytes=align_up(cursor))

    def view(self, buf: torch.Tensor, name: str, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """The section ``name`` of ``buf`` as a 1-D tensor of ``dtype`` (no copy)."""
        start, size = self.offsets[name]
        return buf[start : start + size].view(dtype)

    def sections(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every section of ``buf`` as a 1-D uint8 view, by name: what the kernels' launchers take."""
        return {name: buf[start : start + size] for name, (start, size) in self.offsets.items()}


def crc32_of(text: str) -> int:
    return zlib.crc32(text.encode()) & 0xFFFFFFFF


class DeferredErrors:
    """A count of wire-format errors kept on the device, read back without ever waiting for it.

    ``add(bad)`` adds a 0-d count (a device tensor) without a sync. ``seen()`` returns the count as
    of the last copy that has reached the host: on CUDA it starts an asynchronous copy into pinned
    memory and returns the value of the previous completed one (so an error surfaces one or two
    decodes later); on the CPU the count is read directly.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.count = torch.zeros((), dtype=torch.int32, device=device)
        self._cuda = device.type == "cuda"
        self._host = torch.zeros((), dtype=torch.int32, pin_memory=self._cuda)
        self._event = None
        self._host_value = 0

    def add(self, bad: torch.Tensor) -> None:
        self.count.add_(bad.to(torch.int32))

    def seen(self, wait: bool = False) -> int:
        """The count as far as the host knows it; ``wait=True`` reads it now (a sync: tests, or at log time)."""
        if self.device.type == "meta":  # shapes only (scripts/kernel_report.py): nothing to read
            return 0
        if not self._cuda or wait:
            self._host_value = int(self.count)
            return self._host_value
        if self._event is None or self._event.query():
            if self._event is not None:  # the count only grows: an older copy never lowers it
                self._host_value = max(self._host_value, int(self._host))
            self._host.copy_(self.count, non_blocking=True)  # queued on the count's device's current stream
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(self.device))  # that stream, not the current device's
        return self._host_value


class Codec:
    """Base class: header, layout, validation and backend choice.

    Subclasses set ``name`` and ``codec_id``, keep their options as plain
    attributes listed in ``config()``, and implement ``_sections`` (the wire
    layout), ``_encode_torch`` and ``_decode_torch`` (the pure-torch
    reference). A fused path implements ``_encode_triton`` / ``_decode_triton``
    with the same wire format; ``backend`` picks one (``"auto"``: Triton for
    CUDA tensors when it is available, torch otherwise). ``_decode_*`` take
    ``out``: a contiguous tensor of the message's shape and dtype to write the
    values into and return (no intermediate tensor of that size), or None for a
    new one. ``checksum`` puts a checksum of the payload in the header and
    checks it on decode (see the module docstring).

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

    # ----- state kept between messages (saved with checkpoints) -------------------------
    graph_capturable: bool = True
    """Whether encode and decode (deferred checks, rounding to nearest) make no host sync and keep no per-call
    host state, so a CUDA graph can replay them (``graphs.GraphedCodec``); ``graph_blocker`` says why not."""
    graph_blocker: str = ""

    needs_sample_ids: bool = False
    """Whether ``encode`` takes the micro-batch's sample ids (a per-sample buffer, as in AQ-SGD)."""

    @property
    def stateful(self) -> bool:
        """Whether messages depend on earlier ones (AQ-SGD buffers, stochastic-rounding generators)."""
        noise = getattr(self, "rounding_noise", None)
        return bool(noise is not None and noise.enabled)

    def salt_rounding(self, salt: str) -> "Codec":
        """Give this codec's stochastic rounding its own noise stream, named by ``salt`` (the link end: direction,
        this rank, the peer); rounding to nearest is unaffected. Returns the codec."""
        noise = getattr(self, "rounding_noise", None)
        if noise is not None and noise.enabled:
            self.rounding_noise = noise.salted(salt)
        return self

    def state_dict(self) -> dict:
        """What a resumed run needs to continue this codec's message sequence exactly ({} when stateless)."""
        noise = getattr(self, "rounding_noise", None)
        return {"rounding_noise": noise.state_dict()} if self.stateful else {}

    def load_state_dict(self, state: dict) -> None:
        if "rounding_noise" in state:
            self.rounding_noise.load_state_dict(state["rounding_noise"])

    def defer_checks(self, mode: str = "deferred") -> "Codec":
        """Choose how ``decode`` checks buffers (see the module docstring); returns the codec.

        Call it once the link's configurations were compared (the pipeline handshake does):
        ``"deferred"`` then checks on the device with no host sync per message.
        """
        if mode not in CHECKS:
            raise CodecError(f"checks must be one of {CHECKS}, got {mode!r}")
        self.checks = mode
        return self

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

    # ----- checks ----------------------------------------------------------------------
    def _check_length(self, buf, shape, dtype, layout: WireLayout) -> None:
        if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1:
            raise WireFormatError("a wire buffer is a 1-D torch.uint8 tensor")
        if buf.numel() != layout.nbytes:
            raise WireFormatError(
                f"{self.name}: buffer has {buf.numel()} bytes, {layout.nbytes} expected for "
                f"{shape} {dtype_name(dtype)} with {self.describe()}"
            )

    def _check(self, buf, shape, dtype, layout: WireLayout) -> None:
        if self.checks == "full":
            self.check_buffer(buf, shape, dtype, layout)  # (the length first)
            return
        self._check_length(buf, shape, dtype, layout)
        if self.checks == "deferred":
            self.raise_deferred_errors(buf.device)
            self._check_header_on_device(buf, shape, dtype)

    def _check_header_on_device(self, buf, shape, dtype) -> None:
        """Count a header that differs from the expected one in ``deferred_errors`` (device ops, no sync)."""
        expected = self._header(shape, dtype, buf.device)
        errors = self.deferred_errors(buf.device)
        if self.checksum:  # the fixed fields here, the checksum (0 from a sender without one) apart
            errors.add((buf[:CHECKSUM_OFFSET] != expected[:CHECKSUM_OFFSET]).any())
            self.deferred_checksum_errors(buf.device).add(self.checksum_mismatch(buf))
        elif self._use_triton(buf.device):
            from ..kernels.common import check_header  # one launch instead of three

            check_header(buf, expected, errors.count)
        else:
            errors.add((buf[:HEADER_NBYTES] != expected).any())

    def deferred_errors(self, device: torch.device) -> DeferredErrors:
        """The device count of header mismatches and corrupt payloads found by deferred checks."""
        return self._count_on(self._deferred, device)

    def deferred_checksum_errors(self, device: torch.device) -> DeferredErrors:
        """The device count of buffers whose payload failed the checksum in deferred checks."""
        return self._count_on(self._deferred_checksum, device)

    @staticmethod
    def _count_on(counts: dict, device: torch.device) -> DeferredErrors:
        key = str(device)
        if key not in counts:
            counts[key] = DeferredErrors(device)
        return counts[key]

    @staticmethod
    def _first_seen(counts: dict, device: torch.device | None, wait: bool) -> tuple[str, int] | None:
        """(device, count) of the first of ``counts`` (on ``device``, or any) that has seen errors."""
        for key, errors in counts.items():
            if device is None or key == str(device):
                count = errors.seen(wait)
                if count:
                    return key, count
        return None

    def device_check(self, bad: torch.Tensor) -> bool:
        """Record a 0-d device count of corrupt items found by a decode; False when checks are ``"full"``
        (then the caller raises itself, on the host)."""
        if self.checks == "deferred":
            self.deferred_errors(bad.device).add(bad)
        return self.checks != "full"

    def raise_deferred_errors(self, device: torch.device | None = None, wait: bool = False) -> None:
        """Raise ``WireFormatError`` when an earlier deferred check found a bad buffer.

        Without ``wait`` there is no sync, so on a GPU the latest decodes may not be counted yet (see
        ``DeferredErrors``); ``wait=True`` reads the device's count now (for the log line, or a test).
        Checksum failures come first, as :class:`PayloadChecksumError`.
        """
        if found := self._first_seen(self._deferred_checksum, device, wait):
            key, count = found
            raise PayloadChecksumError(
                f"{self.name}: {count} buffer(s) decoded earlier on {key} failed the payload checksum (bytes "
                f"changed on the way, or a sender with the checksum off); the values decoded from them are "
                f"garbage", codec=self.describe(), count=count)
        if found := self._first_seen(self._deferred, device, wait):
            key, count = found
            raise WireFormatError(
                f"{self.name}: {count} check(s) failed on buffers decoded earlier on {key} (a header that does "
                f"not match {self.describe()}, or a corrupt payload); the values decoded from them are garbage"
            )

    # ----- header ----------------------------------------------------------------------
    def _header_bytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> bytes:
        shape_digest = crc32_of(f"{shape}/{dtype_name(dtype)}")
        return (
            MAGIC
            + bytes([WIRE_VERSION, self.codec_id])
            + self.config_digest().to_bytes(4, "little")
            + shape_digest.to_bytes(4, "little")
            + bytes(4)
        )

    def _fixed_bytes(self, shape, dtype, layout: WireLayout, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, values) of the bytes fixed by shape and config: the header and the alignment padding."""
        key = ("fixed", shape, dtype, str(device), layout.nbytes)
        if key not in self._header_cache:
            positions = list(range(HEADER_NBYTES))
            cursor = HEADER_NBYTES
            for start, size in sorted(layout.offsets.values()):
                positions += range(cursor, start)
                cursor = start + size
            positions += range(cursor, layout.nbytes)
            values = bytearray(self._header_bytes(shape, dtype)) + bytearray(len(positions) - HEADER_NBYTES)
            self._header_cache[key] = (torch.tensor(positions, dtype=torch.int64).to(device),
                                       torch.frombuffer(values, dtype=torch.uint8).to(device))
        return self._header_cache[key]

    def _header(self, shape, dtype, device) -> torch.Tensor:
        key = (shape, dtype, str(device))
        if key not in self._header_cache:
            raw = torch.frombuffer(bytearray(self._header_bytes(shape, dtype)), dtype=torch.uint8)
            self._header_cache[key] = raw.to(device)
        return self._header_cache[key]

    def check_buffer(self, buf, shape, dtype, layout: WireLayout | None = None) -> None:
        """Raise WireFormatError unless ``buf`` was made by a codec configured like this one for shape/dtype
        (PayloadChecksumError when only its payload differs from its checksum). One host read."""
        layout = layout or self.layout(shape, dtype)
        self._check_length(buf, shape, dtype, layout)
        head = buf[:HEADER_NBYTES]
        if self.checksum:  # read the header and the payload's checksum together
            checksum = self.payload_checksum
            head = torch.cat((head, checksum.field(checksum.value(buf[HEADER_NBYTES:]))))
        got = bytes(head.cpu().tolist())
        want = self._header_bytes(shape, dtype)
        if got[:2] != MAGIC:
            raise WireFormatError(f"not a megatron_tah buffer (magic {got[:2]!r})")
        if got[2] != WIRE_VERSION:
            raise WireFormatError(f"wire format version {got[2]}, this build reads version {WIRE_VERSION}")
        if got[3] != self.codec_id:
            sender = codec_name_for_id(got[3])
            raise WireFormatError(f"buffer was encoded by codec {sender!r}, this decoder is {self.describe()}")
        if got[4:8] != want[4:8]:
            raise WireFormatError(
                f"buffer was encoded by a {self.name} codec with another config "
                f"(digest {int.from_bytes(got[4:8], 'little'):08x}); this decoder is {self.describe()} "
                f"(digest {self.config_digest():08x})"
            )
        if got[8:12] != want[8:12]:
            raise WireFormatError(f"buffer was encoded for another shape or dtype than {shape} {dtype_name(dtype)}")
        self._check_checksum(int.from_bytes(got[12:16], "little"),
                             int.from_bytes(got[16:20], "little") if self.checksum else None)

    def _check_checksum(self, found: int, computed: int | None) -> None:
        """Compare the header's checksum field with the payload's (None: this decoder has the checksum off)."""
        if computed is None:
            if found:
                raise WireFormatError(f"buffer carries a payload checksum ({found:08x}) but this decoder "
                                      f"({self.describe()}) has the checksum off; turn it on or off at both ends "
                                      "(--tah-wire-checksum)")
            return
        if not found:
            raise WireFormatError(f"buffer carries no payload checksum (its sender has the checksum off) but this "
                                  f"decoder ({self.describe()}) checks one; turn it on or off at both ends "
                                  "(--tah-wire-checksum)")
        if found != computed:
            raise PayloadChecksumError(
                f"{self.name}: corrupt payload: the header's checksum is {found:08x}, the payload's {computed:08x} "
                "(bytes changed on the way); refusing to decode it", codec=self.describe(), found=found,
                computed=computed)

    def write_checksum(self, buf: torch.Tensor) -> None:
        """Put the payload's checksum in ``buf``'s header (on the device, no sync); the field stays 0 when off."""
        if self.checksum:
            checksum = self.payload_checksum
            buf[CHECKSUM_OFFSET:HEADER_NBYTES].copy_(checksum.field(checksum.value(buf[HEADER_NBYTES:])))

    def checksum_mismatch(self, buf: torch.Tensor) -> torch.Tensor:
        """0-d bool on ``buf``'s device: its header's checksum field is not its payload's checksum (no sync)."""
        checksum = self.payload_checksum
        computed = checksum.field(checksum.value(buf[HEADER_NBYTES:]))
        return (buf[CHECKSUM_OFFSET:HEADER_NBYTES] != computed).any()

    @staticmethod
    def _zero_padding(buf: torch.Tensor, layout: WireLayout) -> None:
        cursor = HEADER_NBYTES
        for start, size in sorted(layout.offsets.values()):
            if start > cursor:
                buf[cursor:start].zero_()
            cursor = start + size
        if layout.nbytes > cursor:
            buf[cursor:].zero_()

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
        from ..kernels import HAVE_TRITON  # a CUDA machine without Triton uses the torch reference

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


_CODEC_NAMES_BY_ID: dict[int, str] = {}


def register_codec_id(codec_id: int, name: str) -> None:
    """Record that ``codec_id`` (the header's byte 3) is codec ``name``'s, run when the codec's module is
    imported; an id outside one byte or already another codec's raises ``ValueError`` naming both."""
    if isinstance(codec_id, bool) or not isinstance(codec_id, int) or not 0 <= codec_id < 255:
        raise ValueError(f"codec_id = {codec_id!r} of codec {name!r}: must be an integer in [0, 254] "
                         "(255 is the base class's)")
    other = _CODEC_NAMES_BY_ID.setdefault(codec_id, name)
    if other != name:
        raise ValueError(f"codec_id = {codec_id} of codec {name!r} is already codec {other!r}'s: "
                         "give the new codec an unused id")


def codec_name_for_id(codec_id: int) -> str:
    return _CODEC_NAMES_BY_ID.get(codec_id, f"unknown id {codec_id}")
