"""``aqsgd``: AQ-SGD, quantized activation *changes* against a per-sample buffer (SPEC section 3).

Stateful: make one object per link end (sender and receiver each keep a copy of the
same state, and stay bit-identical because both update it from the bytes on the wire).

State:
    ``buffer``: ``dict[sample_id -> tensor [s, h]]`` in ``buffer_dtype``, on the tensors' device;
    ``samples_seen``: samples that passed through this link end (``b`` per message).

Phase of a message, decided before it is sent and known to both ends:
    **warm-up** while ``samples_seen < warmup_samples`` (the trainer sets ``warmup_samples``
    to the training-set size: the first epoch). The payload is the raw input (its own dtype,
    a ``none`` buffer); both ends set ``m[id] = a`` (non-finite elements stored as 0) and the
    receiver returns ``a`` exactly.
    **delta** afterwards (from the start when ``warmup_samples = 0``). The payload is a
    ``fixedpoint(bits, tile_size)`` buffer of ``a - m[id]`` (fp32; an id not in the buffer has
    ``m = 0`` on both ends); both ends decode that payload with the same fixedpoint codec
    to ``d`` and set ``m[id] = m[id] + d`` (saturated to ``buffer_dtype``'s range); the
    receiver returns the new ``m[id]`` in the message dtype. A tile whose delta is bad (NaN,
    +-Inf, beyond ``MAX_ABS_VALUE``) decodes to NaN and leaves its part of ``m`` unchanged.
Both ends count the same messages, so the phase switches at the same message on both.
If one message lists an id twice, every column is coded against the old ``m`` and decodes
to its own ``m + d``; the last column's is stored (on both ends).

``wire_nbytes(shape, dtype)`` depends on the phase the *next* message will have (shape must
be ``[s, b, h]``): the receiver knows it before the message arrives.

Wire: header | ``state``: int64[2] = (phase: 0 warm-up / 1 delta, ``samples_seen`` before
this message) | ``ids``: int64[b] | ``payload``: the inner codec's whole buffer (its own
16-byte header included, its checksum field 0: the outer checksum covers it): ``none`` of
``[s, b, h]`` in the message dtype (warm-up), or ``fixedpoint(bits, tile_size)`` of ``[s, b, h]``
fp32 (delta). Decoding checks the phase and
the counter and raises ``WireFormatError`` when the two ends are out of step.
"""

from __future__ import annotations

import math

import torch

from .core.base import CHECKSUM_DEFAULT, Codec
from .core.errors import CodecError, WireFormatError, check_dtype, check_shape, dtype_name
from .core.header import HEADER_NBYTES, WireLayout, register_codec_id
from .fixedpoint import FixedPointCodec
from .none import NoneCodec
from .core.options import CodecDeclaration, Option

DECLARATION = CodecDeclaration(
    takes=("bits", "tile_size"),
    forward_only=True,  # deltas against the activations a sample sent last time; gradients have no such buffer
    needs_sample_ids=True,
    kernel=True,  # its deltas go through fixedpoint's kernel
    options=(Option("tah_aqsgd_warmup_samples", "warmup_samples", int, 0, "AQ-SGD: samples sent uncompressed on "
                    "each link before deltas start (one epoch of the training set).", bounds=(0, math.inf)),),
)

WARMUP, DELTA = 0, 1
PHASE_NAMES = {WARMUP: "warm-up", DELTA: "delta"}
BUFFER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class AqSgdCodec(Codec):
    name = "aqsgd"
    codec_id = 4

    def __init__(self, bits: int = 4, tile_size: int = 64, warmup_samples: int = 0,
                 buffer_dtype: torch.dtype = torch.float32, backend: str = "auto",
                 checksum: bool = CHECKSUM_DEFAULT):
        super().__init__(backend, checksum)
        # The inner buffers travel inside this one, whose checksum covers them.
        self._delta_codec = FixedPointCodec(bits=bits, tile_size=tile_size, backend=backend, checksum=False)
        self._raw_codec = NoneCodec(backend="torch", checksum=False)  # a copy: no kernel needed
        self.bits = self._delta_codec.bits
        self.tile_size = self._delta_codec.tile_size
        if isinstance(warmup_samples, bool) or not isinstance(warmup_samples, int) or warmup_samples < 0:
            raise CodecError(f"warmup_samples must be an integer >= 0, got {warmup_samples!r}")
        self.warmup_samples = warmup_samples
        if buffer_dtype not in BUFFER_DTYPES:
            raise CodecError(f"buffer_dtype must be one of {[dtype_name(d) for d in BUFFER_DTYPES]}, "
                             f"got {buffer_dtype!r}")
        self.buffer_dtype = buffer_dtype
        self.buffer: dict[int, torch.Tensor] = {}
        self.samples_seen = 0
        self.last_sample_ids: torch.Tensor | None = None

    def config(self) -> dict:
        return {"bits": self.bits, "tile_size": self.tile_size, "warmup_samples": self.warmup_samples,
                "buffer_dtype": dtype_name(self.buffer_dtype)}

    # ----- state ---------------------------------------------------------------------------
    @property
    def phase(self) -> int:
        """Phase of the next message: ``WARMUP`` (0) or ``DELTA`` (1)."""
        return WARMUP if self.samples_seen < self.warmup_samples else DELTA

    def buffer_nbytes(self) -> int:
        """Bytes held in the per-sample buffer (``samples * s * h * buffer_dtype.itemsize``)."""
        return sum(t.numel() * t.element_size() for t in self.buffer.values())

    needs_sample_ids = True
    graph_capturable = False
    graph_blocker = "per-sample buffers indexed by the micro-batch's sample ids, read on the host"

    @property
    def stateful(self) -> bool:
        return True

    def state_dict(self) -> dict:
        """The per-sample buffer and the sample count (the warm-up phase depends on it)."""
        return {"buffer": dict(self.buffer), "samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict) -> None:
        self.buffer = dict(state["buffer"])
        self.samples_seen = int(state["samples_seen"])

    def reset(self) -> None:
        """Forget every sample and restart the count (both ends must do it together)."""
        self.buffer.clear()
        self.samples_seen = 0
        self.last_sample_ids = None

    # ----- layout --------------------------------------------------------------------------
    def _payload_codec(self, phase: int) -> Codec:
        return self._raw_codec if phase == WARMUP else self._delta_codec

    def _payload_dtype(self, phase: int, dtype: torch.dtype) -> torch.dtype:
        return dtype if phase == WARMUP else torch.float32

    def _sections_for(self, shape, dtype, phase):
        if len(shape) != 3:
            raise CodecError(f"aqsgd takes [s, b, h] tensors, got shape {tuple(shape)}")
        payload = self._payload_codec(phase).wire_nbytes(shape, self._payload_dtype(phase, dtype))
        return [("state", 16), ("ids", 8 * shape[1]), ("payload", payload)]

    def _sections(self, shape, dtype):
        return self._sections_for(shape, dtype, self.phase)

    def _check_buffer_phase(self, buf: torch.Tensor, shape, dtype, layout) -> None:
        """Name a phase or counter mismatch (the ends are out of step) before the generic checks."""
        phase = self.phase
        other = 1 - phase
        if isinstance(buf, torch.Tensor) and buf.dtype == torch.uint8 and buf.dim() == 1:
            other_nbytes = self.layout_for_phase(shape, dtype, other).nbytes
            if buf.numel() != layout.nbytes and buf.numel() == other_nbytes:
                raise WireFormatError(
                    f"aqsgd: buffer is a {PHASE_NAMES[other]} message ({buf.numel()} bytes) but this end is in "
                    f"the {PHASE_NAMES[phase]} phase (samples_seen={self.samples_seen}, "
                    f"warmup_samples={self.warmup_samples}); both ends must count the same messages")
        self.check_buffer(buf, shape, dtype, layout)
        got_phase, got_seen = layout.view(buf, "state", torch.int64).tolist()
        if got_phase != phase:
            raise WireFormatError(f"aqsgd: buffer is marked phase {got_phase}, this end expects "
                                  f"{phase} ({PHASE_NAMES[phase]})")
        if got_seen != self.samples_seen:
            raise WireFormatError(f"aqsgd: sender had seen {got_seen} samples, this end {self.samples_seen}: "
                                  "the two ends are out of step (a message was lost or sent twice)")

    def layout(self, shape, dtype) -> WireLayout:
        return self.layout_for_phase(shape, dtype, self.phase)

    def layout_for_phase(self, shape, dtype, phase: int) -> WireLayout:
        """The layout of a ``phase`` message (cached per shape, dtype and phase)."""
        return self._cached_layout((tuple(shape), dtype, phase), shape, dtype,
                                   lambda shape, dtype: self._sections_for(shape, dtype, phase))

    # ----- the contract --------------------------------------------------------------------
    def encode(self, x: torch.Tensor, sample_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Encode ``x`` ``[s, b, h]`` for samples ``sample_ids`` (int64[b]) and update this end's buffer."""
        if sample_ids is None:
            raise CodecError("aqsgd.encode needs sample_ids (one stable id per sample of the micro-batch)")
        if not isinstance(x, torch.Tensor):
            raise CodecError(f"encode takes a torch.Tensor, got {type(x).__name__}")
        layout = self.layout(x.shape, x.dtype)
        ids = self._check_ids(sample_ids, x.shape[1])
        buf = torch.empty(layout.nbytes, dtype=torch.uint8, device=x.device)
        buf[:HEADER_NBYTES].copy_(self._header(tuple(x.shape), x.dtype, x.device))
        self._zero_padding(buf, layout)
        phase = self.phase
        layout.view(buf, "state", torch.int64).copy_(torch.tensor([phase, self.samples_seen]))
        layout.view(buf, "ids", torch.int64).copy_(torch.tensor(ids))
        x = x.detach()
        if phase == WARMUP:
            payload = self._raw_codec.encode(x)
        else:
            payload = self._delta_codec.encode(x.float() - self._gather(ids, x.shape, x.device))
        layout.view(buf, "payload").copy_(payload)
        self.write_checksum(buf)
        # The sender updates its state from the bytes it sends, exactly as the receiver will.
        self._apply(layout.view(buf, "payload"), phase, ids, tuple(x.shape), x.dtype)
        return buf

    def decode(self, buf, shape, dtype, out=None) -> torch.Tensor:
        """Decode a message, update this end's buffer, set ``last_sample_ids``; returns the new ``m[ids]``
        (written into ``out`` when given)."""
        layout = self.layout(shape, dtype)
        shape = check_shape(shape)
        self._check_buffer_phase(buf, shape, dtype, layout)
        if out is not None and (tuple(out.shape) != shape or out.dtype != dtype or out.device != buf.device):
            raise CodecError(f"out is {tuple(out.shape)} {dtype_name(out.dtype)} on {out.device}, expected "
                             f"{shape} {dtype_name(dtype)} on {buf.device}")
        ids_tensor = layout.view(buf, "ids", torch.int64).clone()
        with torch.no_grad():
            values = self._apply(layout.view(buf, "payload"), self.phase, ids_tensor.tolist(), shape, dtype, out)
        self.last_sample_ids = ids_tensor
        return values

    # ----- internals -----------------------------------------------------------------------
    @staticmethod
    def _check_ids(sample_ids, b: int) -> list[int]:
        ids = torch.as_tensor(sample_ids)
        if ids.dim() != 1 or ids.numel() != b:
            raise CodecError(f"sample_ids must be a 1-D tensor of b={b} ids, got shape {tuple(ids.shape)}")
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise CodecError(f"sample_ids must be integers, got {ids.dtype}")
        return [int(i) for i in ids.tolist()]

    def _gather(self, ids: list[int], shape, device) -> torch.Tensor:
        """fp32 ``[s, b, h]`` of the stored ``m[id]`` (zeros for ids not yet stored)."""
        s, _, h = shape
        columns = []
        for sample_id in ids:
            stored = self.buffer.get(sample_id)
            if stored is None:
                columns.append(torch.zeros((s, h), device=device))
            elif tuple(stored.shape) != (s, h):
                raise CodecError(f"aqsgd: sample {sample_id} is stored as [s, h] = {list(stored.shape)}, "
                                 f"this message has [{s}, {h}]; sequence length and hidden size must stay fixed")
            else:
                columns.append(stored.to(device=device, dtype=torch.float32))
        return torch.stack(columns, dim=1)

    def _round_to_buffer(self, values: torch.Tensor) -> torch.Tensor:
        """fp32 ``values`` as ``buffer_dtype`` stores them (saturated to its finite range), in fp32."""
        if self.buffer_dtype == torch.float32:
            return values
        limit = torch.finfo(self.buffer_dtype).max
        return values.clamp(-limit, limit).to(self.buffer_dtype).float()

    def _store(self, ids: list[int], values: torch.Tensor) -> None:
        """``m[id] = values[:, i, :]`` in ``buffer_dtype`` (values already rounded to it); last column wins."""
        for i, sample_id in enumerate(ids):
            column = torch.empty(values.shape[0], values.shape[2], dtype=self.buffer_dtype, device=values.device)
            self.buffer[sample_id] = column.copy_(values[:, i, :])

    def _apply(self, payload: torch.Tensor, phase: int, ids: list[int], shape, dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode ``payload``, update the buffer (identically on both ends), return the message's values
        (in ``out`` when given)."""
        if phase == WARMUP:
            values = self._raw_codec.decode(payload, shape, dtype, out=out)
            finite = values.float()
            finite = torch.where(torch.isfinite(finite), finite, torch.zeros_like(finite))
            self._store(ids, self._round_to_buffer(finite))
        else:
            delta = self._delta_codec.decode(payload, shape, torch.float32)
            old = self._gather(ids, shape, payload.device)
            bad = torch.isnan(delta)
            new = self._round_to_buffer(torch.where(bad, old, old + delta))
            self._store(ids, new)
            direct = out if out is not None and dtype == torch.float32 else None
            values = torch.where(bad, delta, new, out=direct)
            if dtype == torch.float16:
                limit = torch.finfo(torch.float16).max
                values = values.clamp_(-limit, limit)
            if out is None:
                values = values.to(dtype)
            elif values is not out:
                values = out.copy_(values)
        self.samples_seen += shape[1]
        return values


register_codec_id(AqSgdCodec.codec_id, AqSgdCodec.name)
