"""megatron_tah's options: ``TahConfig``, the schema of the ``--tah-*`` flags, its presets' expansion and the
pipeline's codec factory. Every option is a field with its help under it, as megatron-core writes its configs; what
makes a value valid is declared on the field (``fields.py``), a codec's own options come from its ``DECLARATION``.
``__post_init__`` expands ``tah_preset``, checks each field and the pipeline's rules (``pipeline.py``), raising
``ValueError`` naming the field and value; another place's option is its ``PlaceSpec``'s (``megatron/place_spec.py``),
checked by ``megatron_tah.install``. Without ``--tah-*`` flags a run is Megatron's own.
"""

# No ``from __future__ import annotations``: megatron's ArgumentGroupFactory reads the annotations as types.
import dataclasses
from typing import Any

from ..codecs import Codec, codec_declaration, get_codec
from ..codecs.core.base import BACKENDS
from ..codecs.core.checksum import ENABLED_BY_DEFAULT as WIRE_CHECKSUM_DEFAULT
from ..codecs.core.entropy import CODERS, DEFAULT_CODER
from ..geometry import TILE_SIZES
from ..units import parse_bandwidth
from . import pipeline
from .auto import AUTO, CANDIDATES, DEFAULTS as AUTO_DEFAULTS, DIRECTIONS, AutoSettings, candidate_fields
from .fields import (CODEC_OPTIONS, CodecChoices, IntList, backward_codecs, check_field, codec_option, field_docs,
                     first_sentence, forward_codecs, parsed, takers)
from .presets import PRESETS


@dataclasses.dataclass
class TahConfig:
    """Compressed communication for training over slow links (fields: the pipeline-wide options, then each
    codec's declared options). Every option is off by default: without a --tah-* flag the run is Megatron's own."""

    # ----- the pipeline's codecs ----------------------------------------------------------------------------
    tah_preset: str = dataclasses.field(default="none", metadata={"choices": tuple(PRESETS)})
    """A named set of pipeline-codec options (docs/FLAGS.md lists each). Measured: docs/REAL_MODEL.md; a flag set to
    neither its default nor the preset's value is an error."""
    tah_forward_codec: str = dataclasses.field(default="none", metadata={"choices": CodecChoices(forward_codecs, AUTO)})
    """Codec of activations sent to the next stage (none: uncompressed; auto: chosen per link, --tah-auto-*)."""
    tah_backward_codec: str = dataclasses.field(default="none",
                                                metadata={"choices": CodecChoices(backward_codecs, AUTO)})
    """Codec for activation gradients sent to the previous stage (none: uncompressed; auto: as forward)."""
    tah_tile_size: int = dataclasses.field(default=64, metadata={"choices": TILE_SIZES})
    """Channels per tile of the forward codec (lowrank: of its residual)."""
    tah_backward_tile_size: int = dataclasses.field(default=32, metadata={"choices": TILE_SIZES})
    """Channels per tile of the backward codec."""
    tah_forward_bits: int = 4
    """Bits of the forward codec (lowrank: of its residual)."""
    tah_backward_bits: int = 6
    """Bits of the backward codec (lowrank: of its residual)."""
    tah_stochastic_rounding: bool = False
    """Round stochastically (unbiased) instead of to nearest in both directions' codecs (lowrank: its residual)."""
    tah_backward_stochastic_rounding: bool = False
    """Round stochastically in the backward codec only: unbiased activation gradients. With lowrank: its residual."""
    tah_boundary_bits: str | None = dataclasses.field(
        default=None, metadata={"parse": IntList("6,5,5,5,5,6,5", what="one per pipeline boundary")})
    """Bits of the forward codec per pipeline boundary, first to last, e.g. 6,5,5,5,5,6,5. In place of
    --tah-forward-bits; not with auto or interleaving (docs/USAGE.md)."""
    # ----- the other places (their modules in megatron/: what each makes of its option) ----------------------
    tah_tp_codec: str = dataclasses.field(default="none", metadata={"choices": ("none", "fp8")})
    """Tensor-parallel collectives (TACO): none (megatron-core's own) or fp8 (FP8 shards, fp32 sums)."""
    tah_dp_codec: str = dataclasses.field(default="none", metadata={"choices": ("none", "int8")})
    """Data-parallel gradient reduction (AGoQ QuanGrad): none (megatron-core's own) or int8 (8-bit shards)."""
    tah_embedding_codec: str = dataclasses.field(default="none", metadata={"choices": ("none", "int8")})
    """Tied word-embedding gradient between the first and the last stage: none or int8 (docs/USAGE.md). With
    none, megatron-core's all-reduce; with int8, exact rows one way, blockwise int8 back."""
    tah_activation_memory: str = dataclasses.field(default="none", metadata={"choices": ("none", "laaq")})
    """Tensors layers save for backward (AGoQ LAAQ): none (kept as they are) or laaq (blockwise low-bit)."""
    tah_laaq_bits: str = dataclasses.field(default="4,5,6,8", metadata={"parse": IntList("4,5,6,8", bounds=(2, 8))})
    """LAAQ bits per pipeline stage, first to last. Stage i of p uses entry floor(i * n / p) of these n."""
    tah_laaq_block_size: int = 128
    """LAAQ elements per scale/zero pair: 8, 16, 32, 64 or 128."""
    # ----- the pipeline's link -------------------------------------------------------------------------------
    tah_warmup_iters: int = 0
    """Send the first N training iterations uncompressed both ways. TAH-Quant's warm-up; aqsgd warms up per sample."""
    tah_eval_traffic: str = dataclasses.field(default="codec", metadata={"choices": ("codec", "uncompressed", "both")})
    """Evaluations' pipeline traffic: codec (as training), uncompressed, or both. Both logs valid_loss_uncompressed."""
    tah_eval_forward_bits: int | None = None
    """Forward codec bits of evaluations through the codecs: serving at other bits than training. Default: the
    training bits; in place of every boundary's bits (docs/USAGE.md)."""
    tah_backend: str = dataclasses.field(default="auto", metadata={"choices": BACKENDS})
    """Codec implementation: auto (Triton for CUDA tensors where the codec has a kernel), torch or triton."""
    tah_wire_checksum: bool = WIRE_CHECKSUM_DEFAULT
    """Checksum each pipeline message's payload, checked on receipt. Both stages agree; cost: docs/RELIABILITY.md."""
    tah_entropy_coding: bool = False
    """Code each pipeline message losslessly after its codec: fewer bytes, the same values. On gloo each message
    goes at its own length, on NCCL in agreed frames. With auto codecs, auto still chooses by a codec's uncoded
    bytes. Both stages agree (docs/CODECS.md)."""
    tah_entropy_coder: str = dataclasses.field(default=DEFAULT_CODER, metadata={"choices": tuple(CODERS)})
    """The lossless coder of --tah-entropy-coding: zstd or ans on the host, huffman on the message's device. The
    zstd coder (PyPI zstandard) is the fastest here, ans is constriction's, huffman torch's (slower on a CPU). Both
    stages agree (docs/CODECS.md)."""
    tah_entropy_when: str = dataclasses.field(default="always", metadata={"choices": ("always", "auto")})
    """With --tah-entropy-coding: always code, or auto: only where the wire time saved exceeds the coder's time.
    With auto a link's messages are coded while the wire time coding saves at the link's rate (--tah-link-rate, or
    the rate auto measured on an auto link) exceeds the coder's encode + decode time, timed on the link's
    messages (docs/CODECS.md)."""
    tah_link_rate: str | None = dataclasses.field(default=None, metadata={"parse": parse_bandwidth})
    """The pipeline links' rate where known (e.g. 100mbit): what the entropy coder is judged by. Default:
    --tah-emulate-bandwidth's; coding that does not pay at it is a warning with the numbers."""
    tah_peer_timeout_s: float = 120.0
    """Stop the run when a neighbouring stage stays silent this many seconds, naming the link. With 0, Megatron's
    timeouts only; it bounds the other collectives too (docs/RELIABILITY.md)."""
    tah_peer_start_up_s: float = 60.0
    """Seconds added to --tah-peer-timeout-s for the first wait on each neighbour or group. That wait covers the
    handshake, the first message and a place's first collective: a peer still building its model or compiling."""
    tah_eager_codecs: bool = False
    """Call the codecs eagerly on GPUs, not replayed as CUDA graphs per message shape (to compare, or rule out)."""
    tah_error_sample_interval: int = 16
    """Measure the relative round-trip error on one message in this many (0: never)."""
    tah_emulate_bandwidth: str | None = dataclasses.field(default=None, metadata={"parse": parse_bandwidth})
    """Delay every pipeline message as if the link ran at this rate (e.g. 100mbit, 1gbit); off by default."""
    tah_emulate_latency_ms: float = 0.0
    """Extra one-way latency per message in milliseconds, with --tah-emulate-bandwidth."""
    tah_emulate_wire: str = dataclasses.field(default="link", metadata={"choices": ("link", "inbound")})
    """How --tah-emulate-bandwidth meters: link (a pipe per directed link) or inbound (a wire per rank)."""
    tah_log_json: str | None = None
    """Append one JSON record per iteration and evaluation (loss, time, bytes on the wire) to this file."""
    # ----- auto: a direction's codec chosen per link -----------------------------------------------------------
    tah_auto_candidates: str = ",".join(AUTO_DEFAULTS.candidates)
    """Codecs auto may choose, a comma list."""
    tah_auto_max_error: float | None = AUTO_DEFAULTS.max_error
    """auto: largest relative round-trip error a candidate may have (default: paper's; docs/DESIGN.md)."""
    tah_auto_interval: int = AUTO_DEFAULTS.interval
    """auto: measure each link and reconsider its codec every this many iterations (docs/DESIGN.md)."""
    tah_auto_probation: int = AUTO_DEFAULTS.probation
    """auto: iterations a new codec runs before its times are compared. Not faster, it goes back (0: none)."""
    # ----- several ranks per GPU -------------------------------------------------------------------------------
    tah_share_gpus: bool = False
    """Run several pipeline ranks per GPU (on by itself when two share one): gloo, messages staged (docs/USAGE.md)."""
    # ----- the codecs' own options: default, help and range from each codec's DECLARATION --------------------
    # (a line under one is its flag's help where the declared help is longer: ``field_help``)
    tah_high_bits: int = codec_option("tah_high_bits")
    tah_low_bits: int = codec_option("tah_low_bits")
    tah_high_ratio: float = codec_option("tah_high_ratio")
    """TAH-Quant: fraction of tokens per sample quantized with the high bit width."""
    tah_outlier_threshold: float = codec_option("tah_outlier_threshold")
    """TAH-Quant: rotate a tile when |largest| / |second largest| exceeds this."""
    tah_allocation: str = codec_option("tah_allocation")
    tah_low_bits_for: str = codec_option("tah_low_bits_for")
    """TAH-Quant: which tokens get the low bit width: low_entropy (the paper) or high_entropy."""
    tah_fp8_group_size: int = codec_option("tah_fp8_group_size")
    tah_aqsgd_warmup_samples: int = codec_option("tah_aqsgd_warmup_samples")
    """AQ-SGD: samples sent uncompressed on each link before deltas start."""
    tah_int8_block_size: int = codec_option("tah_int8_block_size")
    tah_fp4_hadamard: bool = codec_option("tah_fp4_hadamard")
    """mxfp4 / nvfp4: rotate every block by a random-sign Walsh-Hadamard transform."""
    tah_lowrank_rank: int = codec_option("tah_lowrank_rank")
    """lowrank: principal directions of each message sent apart from the residual."""
    tah_lowrank_coef_bits: int = codec_option("tah_lowrank_coef_bits")
    tah_channel_outlier_tokens: int = codec_option("tah_channel_outlier_tokens")
    """channel: tokens per sequence (the largest) sent apart in bf16; 0: none."""

    # The direction parameters' fields (codecs/core/options.py): their help names the registered codecs that take them.
    _DIRECTION_PARAMETERS = {"tah_tile_size": "tile_size", "tah_backward_tile_size": "tile_size", "tah_forward_bits":
                             "bits", "tah_backward_bits": "bits", "tah_stochastic_rounding": "stochastic_rounding",
                             "tah_backward_stochastic_rounding": "stochastic_rounding"}

    def __post_init__(self):
        self._apply_preset()
        pipeline.check_backward_codec(self)
        for field in dataclasses.fields(self):
            check_field(field, getattr(self, field.name))
        self.auto_settings()  # checks the tah_auto_* fields
        pipeline.check(self)

    def _apply_preset(self) -> None:
        """Set the preset's fields; a field already set to something else than its default and the preset's
        value is a conflict (``ValueError`` naming both)."""
        preset = PRESETS.get(self.tah_preset)
        if preset is None:
            return  # (reported with the other choices below)
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, value in preset.items():
            current = getattr(self, name)
            if current != defaults[name] and current != value:
                raise ValueError(f"{name} = {current!r} conflicts with tah_preset = {self.tah_preset!r}, "
                                 f"which sets {value!r}; drop one of them")
            setattr(self, name, value)

    @classmethod
    def from_args(cls, args: Any) -> "TahConfig":
        """Pick the ``tah_*`` attributes of an argparse namespace (missing ones keep their defaults)."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        return cls(**values)

    @classmethod
    def field_docs(cls) -> dict[str, str]:
        """Every field's help: the docstrings under the fields (auto's candidates followed by their list, a direction
        parameter's by the registered codecs that take it), and each codec option's declared help."""
        docs = field_docs(cls)
        docs["tah_auto_candidates"] += f" Candidates: {', '.join(CANDIDATES)}."
        for field, parameter in cls._DIRECTION_PARAMETERS.items():
            docs[field] += f" Codecs that take it: {', '.join(takers(parameter, backward='backward' in field))}."
        return {**docs, **{name: option.help for name, option in CODEC_OPTIONS.items()}}

    @classmethod
    def field_help(cls) -> dict[str, str]:
        """Every field's help as its flag prints it: the first sentence of its docs (``field_docs``; the whole is
        docs/FLAGS.md's); a codec option's is the line under its field here, else its declared help's first."""
        written = field_docs(cls)
        return {name: written[name] if name in CODEC_OPTIONS and name in written else first_sentence(text)
                for name, text in cls.field_docs().items()}

    @property
    def emulated_bandwidth_bps(self) -> float | None:
        return parsed(self, "tah_emulate_bandwidth")

    @property
    def link_rate_bps(self) -> float | None:
        """The links' rate the entropy coder is judged by: ``tah_link_rate``, else the emulated one (None: unknown)."""
        rate = parsed(self, "tah_link_rate")
        return rate if rate is not None else self.emulated_bandwidth_bps

    def boundary_bits(self) -> tuple[int, ...]:
        """``tah_boundary_bits`` as integers (() when not set)."""
        return parsed(self, "tah_boundary_bits") or ()

    def is_off(self) -> bool:
        """Every option at its default: nothing is compressed, emulated or logged (Megatron runs as without us)."""
        return self == type(self)()
    # ----- the codec factory ---------------------------------------------------------------------------------
    def build_codec(self, name: str, bits: int, tile_size: int, stochastic_rounding: bool = False,
                    checksum: bool = False) -> Codec:
        """A new codec ``name`` with a direction's parameters, this config's backend and the codec's own options;
        ``checksum``: the payload checksum in its header (the pipeline's: ``tah_wire_checksum``). Places use it too."""
        direction = {"bits": bits, "tile_size": tile_size,
                     "stochastic_rounding": stochastic_rounding or self.tah_stochastic_rounding}
        return get_codec(name, backend=self.tah_backend, checksum=checksum,
                         **codec_declaration(name).build_kwargs(self, direction))

    def auto_settings(self) -> AutoSettings:
        """The ``AutoSettings`` of the auto directions (both alike); ``ValueError`` names a bad ``tah_auto_*``."""
        try:
            return AutoSettings(candidates=self.tah_auto_candidates, max_error=self.tah_auto_max_error,
                                interval=self.tah_auto_interval, probation=self.tah_auto_probation)
        except ValueError as err:
            raise ValueError(f"tah_auto_{err}") from None

    def is_auto(self, direction: str) -> bool:
        """Whether ``direction`` ("forward", "backward") chooses its codec per link (``auto``)."""
        return getattr(self, f"tah_{direction}_codec") == AUTO

    def auto_candidate_codec(self, name: str, direction: str, boundary: tuple[int, int] | None = None) -> Codec:
        """A new codec object of auto candidate ``name`` on ``direction`` (this config's backend and checksum; at
        ``boundary`` (boundary, boundaries) for a preset with per-boundary bits)."""
        return candidate_codec(name, direction, self.tah_backend, checksum=self.tah_wire_checksum, boundary=boundary)

    def forward_codec(self, boundary: int | None = None, boundaries: int | None = None) -> Codec:
        """A new codec object for activations (one per link end: aqsgd keeps state; auto: the one its links start
        with), at ``boundary`` of ``boundaries`` (from stage ``boundary`` to the next) with its ``forward_bits``."""
        if self.is_auto("forward"):
            return self.auto_candidate_codec(self.auto_settings().start(), "forward")
        return self.build_codec(self.tah_forward_codec, self.forward_bits(boundary, boundaries), self.tah_tile_size,
                                checksum=self.tah_wire_checksum)

    def forward_bits(self, boundary: int | None = None, boundaries: int | None = None) -> int:
        """The forward codec's bits at ``boundary`` of ``boundaries``: entry ``floor(boundary * n / boundaries)`` of
        ``tah_boundary_bits`` when set and ``boundary`` given, else ``tah_forward_bits``."""
        entries = self.boundary_bits()
        if not entries or boundary is None:
            return self.tah_forward_bits
        if boundaries is None or not 0 <= boundary < boundaries:
            raise ValueError(f"tah_boundary_bits: boundary {boundary} of {boundaries}: a link between neighbouring "
                             "stages of a pipeline that does not wrap (the 1F1B schedule, not interleaved)")
        return entries[boundary * len(entries) // boundaries]

    def eval_forward_codec(self) -> Codec | None:
        """A new forward codec at ``tah_eval_forward_bits`` (every boundary's), for evaluations through the codecs;
        None when unset (they go through the training codec)."""
        return None if self.tah_eval_forward_bits is None else self.build_codec(
            self.tah_forward_codec, self.tah_eval_forward_bits, self.tah_tile_size, checksum=self.tah_wire_checksum)

    def backward_codec(self) -> Codec:
        """A new codec object for activation gradients (auto: as ``forward_codec``)."""
        if self.is_auto("backward"):
            return self.auto_candidate_codec(self.auto_settings().start(), "backward")
        return self.build_codec(self.tah_backward_codec, self.tah_backward_bits, self.tah_backward_tile_size,
                                stochastic_rounding=self.tah_backward_stochastic_rounding,
                                checksum=self.tah_wire_checksum)


def candidate_codec(name: str, direction: str, backend: str = "auto", checksum: bool = False,
                    boundary: tuple[int, int] | None = None) -> Codec:
    """A new codec object for auto candidate ``name`` on ``direction`` (forward: activations, backward: gradients),
    a forward one at ``boundary`` (boundary, boundaries: ``TahConfig.forward_codec``'s) when given: the codec of a
    ``TahConfig`` with the candidate's fields (``auto.candidate_fields``)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction = {direction!r}: choose forward or backward")
    config = TahConfig(**candidate_fields(name), tah_backend=backend, tah_wire_checksum=checksum)
    return config.forward_codec(*(boundary or ())) if direction == "forward" else config.backward_codec()
