"""megatron_tah's options: one dataclass, the source of the ``--tah-*`` flags.

Each field's docstring is its flag's help text; ``add_tah_arguments`` turns
``tah_forward_codec`` into ``--tah-forward-codec`` (see ``megatron/arguments.py``),
so a flag and its field never drift apart. ``__post_init__`` validates and
raises ``ValueError`` naming the offending value.
"""

from __future__ import annotations

import ast
import dataclasses
from typing import Any

from .codecs import CODECS, Codec, CodecError, get_codec
from .codecs.tah import ALLOCATIONS, LOW_BITS_FOR
from .units import parse_bandwidth

def _field_docs(cls) -> dict[str, str]:
    """Docstrings written under dataclass fields (as megatron-core does), read from the source."""
    import inspect

    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


@dataclasses.dataclass
class TahConfig:
    tah_forward_codec: str = "tah"
    """Codec for activations sent to the next stage: none, fixedpoint, tah, fp8 or aqsgd."""

    tah_backward_codec: str = "fixedpoint"
    """Codec for activation gradients sent to the previous stage: none, fixedpoint, tah or fp8."""

    tah_tile_size: int = 64
    """Channels per tile for the forward codec (tah, fixedpoint, aqsgd): 16, 32, 64 or 128."""

    tah_high_bits: int = 4
    """TAH-Quant: bits for the high-entropy share of tokens (or tiles)."""

    tah_low_bits: int = 3
    """TAH-Quant: bits for the lowest-entropy share of tokens (or tiles)."""

    tah_high_ratio: float = 0.8
    """TAH-Quant: fraction of tokens per sample (or tiles per token) quantized with the high bit width."""

    tah_outlier_threshold: float = 2.0
    """TAH-Quant: rotate a tile when |largest| / |second largest| exceeds this; 0 always rotates, inf never."""

    tah_allocation: str = "token"
    """TAH-Quant bit allocation unit: token (paper v1) or tile (paper v2)."""

    tah_low_bits_for: str = "low_entropy"
    """TAH-Quant: which tokens (or tiles) get the low bit width: low_entropy (the paper) or high_entropy (diagnostic)."""

    tah_stochastic_rounding: bool = False
    """Round stochastically (unbiased) instead of to nearest in the quantizing codecs."""

    tah_forward_bits: int = 4
    """Bits of the forward codec when it is fixedpoint or aqsgd."""

    tah_backward_bits: int = 6
    """Bits of the backward fixedpoint codec."""

    tah_backward_tile_size: int = 32
    """Channels per tile of the backward codec."""

    tah_fp8_group_size: int = 128
    """Group size of the fp8 codec (either direction)."""

    tah_aqsgd_warmup_samples: int = 0
    """AQ-SGD: samples sent uncompressed on each link before deltas start (one epoch of the training set)."""

    tah_backend: str = "auto"
    """Codec implementation: auto (Triton on CUDA tensors, torch on CPU), torch or triton."""

    tah_error_sample_interval: int = 16
    """Measure the relative round-trip error on one message in this many (0: never)."""

    tah_emulate_bandwidth: str | None = None
    """Delay every pipeline message as if the link ran at this rate (e.g. 100mbit, 1gbit); off by default."""

    tah_emulate_latency_ms: float = 0.0
    """Extra one-way latency per message in milliseconds, with --tah-emulate-bandwidth."""

    tah_log_json: str | None = None
    """Append one JSON record per iteration and per evaluation (loss, time, bytes on the wire, codec time) to this file."""

    def __post_init__(self):
        for field in ("tah_forward_codec", "tah_backward_codec"):
            if getattr(self, field) not in CODECS:
                raise ValueError(f"{field} = {getattr(self, field)!r}: choose one of {', '.join(CODECS)}")
        if self.tah_backward_codec == "aqsgd":
            raise ValueError("tah_backward_codec = 'aqsgd': AQ-SGD compresses activations only; "
                             "use fixedpoint, tah, fp8 or none for gradients")
        if self.tah_low_bits_for not in LOW_BITS_FOR:
            raise ValueError(f"tah_low_bits_for = {self.tah_low_bits_for!r}: choose {' or '.join(LOW_BITS_FOR)}")
        if self.tah_allocation not in ALLOCATIONS:
            raise ValueError(f"tah_allocation = {self.tah_allocation!r}: choose {' or '.join(ALLOCATIONS)}")
        if not 0.0 <= self.tah_high_ratio <= 1.0:
            raise ValueError(f"tah_high_ratio = {self.tah_high_ratio}: must lie in [0, 1]")
        if self.tah_outlier_threshold < 0:
            raise ValueError(f"tah_outlier_threshold = {self.tah_outlier_threshold}: must be >= 0 (or inf)")
        if self.tah_emulate_bandwidth is not None:
            parse_bandwidth(self.tah_emulate_bandwidth)
        if self.tah_emulate_latency_ms < 0:
            raise ValueError(f"tah_emulate_latency_ms = {self.tah_emulate_latency_ms}: must be >= 0")
        # Building the codecs validates bit widths and tile sizes with the codecs' own messages.
        for role, build in (("forward", self.forward_codec), ("backward", self.backward_codec)):
            try:
                build()
            except CodecError as err:
                name = getattr(self, f"tah_{role}_codec")
                raise ValueError(f"tah_{role}_codec = {name!r}: {err}") from None

    @classmethod
    def from_args(cls, args: Any) -> "TahConfig":
        """Pick the ``tah_*`` attributes of an argparse namespace (missing ones keep their defaults)."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        return cls(**values)

    @classmethod
    def field_docs(cls) -> dict[str, str]:
        return _field_docs(cls)

    @property
    def emulated_bandwidth_bps(self) -> float | None:
        return None if self.tah_emulate_bandwidth is None else parse_bandwidth(self.tah_emulate_bandwidth)

    def _codec(self, name: str, bits: int, tile_size: int) -> Codec:
        backend = {"backend": self.tah_backend}
        if name == "none":
            return get_codec("none", **backend)
        if name == "fixedpoint":
            return get_codec("fixedpoint", bits=bits, tile_size=tile_size,
                             stochastic_rounding=self.tah_stochastic_rounding, **backend)
        if name == "tah":
            return get_codec("tah", tile_size=self.tah_tile_size, high_bits=self.tah_high_bits,
                             low_bits=self.tah_low_bits, high_ratio=self.tah_high_ratio,
                             outlier_threshold=self.tah_outlier_threshold, allocation=self.tah_allocation,
                             low_bits_for=self.tah_low_bits_for,
                             stochastic_rounding=self.tah_stochastic_rounding, **backend)
        if name == "fp8":
            return get_codec("fp8", group_size=self.tah_fp8_group_size, **backend)
        if name == "aqsgd":
            return get_codec("aqsgd", bits=bits, tile_size=tile_size,
                             warmup_samples=self.tah_aqsgd_warmup_samples, **backend)
        raise ValueError(f"unknown codec {name!r}")

    def forward_codec(self) -> Codec:
        """A new codec object for activations (one per link end: aqsgd keeps state)."""
        return self._codec(self.tah_forward_codec, self.tah_forward_bits, self.tah_tile_size)

    def backward_codec(self) -> Codec:
        """A new codec object for activation gradients."""
        return self._codec(self.tah_backward_codec, self.tah_backward_bits, self.tah_backward_tile_size)
