"""How a decoder checks the buffers it is given, per codec object (``Codec.checks``).

``"full"`` (the default) reads the header on the host and raises at once; on a GPU that is one
device-to-host copy, a sync, per decode. ``"deferred"`` (``Codec.defer_checks()``, for a link whose
configurations a handshake has already compared) compares the header with the expected bytes on the
device and counts mismatches and corrupt payloads there; a later ``decode`` (or
``raise_deferred_errors()``) raises once the count has reached the host, without ever waiting for it
(checksum failures are counted apart and raise :class:`PayloadChecksumError`). ``"off"`` checks only
the buffer's length (and no checksum).
"""

from __future__ import annotations

import torch

from .errors import CodecError, PayloadChecksumError, WireFormatError, dtype_name
from .header import CHECKSUM_OFFSET, HEADER_NBYTES, MAGIC, WIRE_VERSION, WireLayout, codec_name_for_id

CHECKS = ("full", "deferred", "off")


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


class BufferChecks:
    """A decoder's checks of a buffer: its length, its header, its payload checksum, now or deferred.

    Part of ``Codec``: reads its ``checks``, ``checksum``, ``name``, ``codec_id``, ``describe()``, ``layout()``,
    the header (``header.WireHeader``) and checksum (``checksum.ChecksumField``) methods, and keeps the
    device counts ``_deferred`` and ``_deferred_checksum``.
    """

    def defer_checks(self, mode: str = "deferred"):
        """Choose how ``decode`` checks buffers (see the module docstring); returns the codec.

        Call it once the link's configurations were compared (the pipeline handshake does):
        ``"deferred"`` then checks on the device with no host sync per message.
        """
        if mode not in CHECKS:
            raise CodecError(f"checks must be one of {CHECKS}, got {mode!r}")
        self.checks = mode
        return self

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

    def _check_header_on_device(self, buf, shape, dtype) -> None:
        """Count a header that differs from the expected one in ``deferred_errors`` (device ops, no sync)."""
        expected = self._header(shape, dtype, buf.device)
        errors = self.deferred_errors(buf.device)
        if self.checksum:  # the fixed fields here, the checksum (0 from a sender without one) apart
            errors.add((buf[:CHECKSUM_OFFSET] != expected[:CHECKSUM_OFFSET]).any())
            self.deferred_checksum_errors(buf.device).add(self.checksum_mismatch(buf))
        elif self._use_triton(buf.device):
            from ...kernels.common import check_header  # one launch instead of three

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
