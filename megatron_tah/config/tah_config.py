"""megatron_tah's options: ``TahConfig``, the schema of the ``--tah-*`` flags, its presets' expansion and the
pipeline's codec factory.

Every option is a field written out here, with its docstring under it (the flag's help), as megatron-core writes
its configs; what makes a value valid is declared on the field (``fields.py``: its ``choices``, a codec option's
declared range, a ``parse`` of its text). A codec's own options (``tah_high_bits``, ...) are fields made by
``codec_option(name)`` from the ``DECLARATION`` at the top of the codec's file; ``auto``'s take their defaults from
``auto.AutoSettings``, which checks them.

``__post_init__`` expands ``tah_preset``, checks every field's value against its declaration and the pipeline's
codecs (their capabilities, their bits and tiles, by building them once) and runs the link options' rules
(``link_options.py``: the link reads a ``TahConfig`` without the places), raising ``ValueError`` naming the field
and value. What a place makes of its option -- its codec, its rules with other fields and with Megatron's
arguments -- is the place's, in its module (``megatron/place.py``), checked by ``megatron_tah.install`` and
the flags' validation. ``megatron/arguments.py`` turns every field into a flag (``tah_tile_size`` ->
``--tah-tile-size``) and the flag table.

Everything is off by default (``none`` both ways): a run without ``--tah-*`` flags is Megatron's own.
"""

# No ``from __future__ import annotations``: megatron's ArgumentGroupFactory reads the annotations as types.
import dataclasses
from typing import Any

from ..codecs import CODECS, Codec, CodecError, codec_declaration, get_codec
from ..codecs.base import BACKENDS
from ..codecs.checksum import ENABLED_BY_DEFAULT as WIRE_CHECKSUM_DEFAULT
from ..geometry import TILE_SIZES
from ..units import parse_bandwidth
from . import link_options
from .auto import AUTO, DEFAULTS as AUTO_DEFAULTS, DIRECTIONS, AutoSettings, candidate_fields, check_candidate
from .fields import (CODEC_OPTIONS, CodecChoices, IntList, backward_codecs, check_field, codec_option, field_docs,
                     forward_codecs, rounding_codecs)
from .presets import PRESETS


@dataclasses.dataclass
class TahConfig:
    """Compressed communication for training over slow links (fields: the pipeline-wide options, then each
    codec's declared options). Every option is off by default: without a --tah-* flag the run is Megatron's own;
    --tah-preset paper turns on TAH-Quant for activations and 6-bit fixed point for their gradients."""

    tah_preset: str = dataclasses.field(default="none", metadata={"choices": tuple(PRESETS)})
    """A named set of pipeline-codec options: none (the flags below as given), paper (TAH-Quant as specified, with the 6-bit backward codec), hadint4 (Hadamard INT4 both ways, 4.25 bits each, stochastic rounding of gradients: 1.35x fewer bytes than paper), lowrank (activations: 16 principal directions apart and the residual as Hadamard INT3, 4.38 bits at hidden 128; gradients as hadint4) lowrank8 (the same with 8 directions, 3.88 bits), channel (for deep pipelines: per-channel 4-bit activations, per-channel 3-bit stochastically rounded gradients, 7.01 bits both ways at large messages), channel6 (the same with 2-bit gradients, 6.01 bits) channel9 (channel with 6-bit activations, 9.01 bits) channel_h4 (per-channel 6-bit activations with each sequence's largest token sent apart in bf16, gradients as hadint4: 10.27 bits both ways at large messages) or channel_b_h4 (channel_h4 with bits per boundary, 6,5,5,5,5,6,5: 9.56 bits both ways at depth 8 on average). Each preset's steps to a loss at pipeline depth 8: docs/REAL_MODEL.md (a real model) and docs/SPEEDRUN.md (the toy). A flag set to neither its default nor the preset's value is an error."""

    tah_forward_codec: str = dataclasses.field(default="none", metadata={"choices": CodecChoices(forward_codecs, AUTO)})
    """Codec for activations sent to the next stage (none: Megatron's own transport, uncompressed; auto: chosen per link among --tah-auto-candidates from the measured link rate and codec costs)."""

    tah_backward_codec: str = dataclasses.field(default="none",
                                                metadata={"choices": CodecChoices(backward_codecs, AUTO)})
    """Codec for activation gradients sent to the previous stage (none: uncompressed; auto: as for the forward codec)."""

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
    """Round stochastically in the backward codec only (lowrank: its residual): unbiased activation gradients."""

    tah_boundary_bits: str | None = dataclasses.field(
        default=None, metadata={"parse": IntList("6,5,5,5,5,6,5", what="one per pipeline boundary")})
    """Bits of the forward codec per pipeline boundary, first to last (comma list, e.g. 6,5,5,5,5,6,5), in place of --tah-forward-bits: boundary i of the p - 1 between p stages (stage i sends to stage i + 1) uses entry floor(i * n / (p - 1)) of these n. Spends bits where a model needs them (a real model's per-boundary costs: python -m benchmarks.real_model.sensitivity, docs/REAL_MODEL.md). Needs a forward codec that takes bits (not auto) and the 1F1B schedule (not interleaved). Both stages of a link must agree."""

    tah_tp_codec: str = dataclasses.field(default="none", metadata={"choices": ("none", "fp8")})
    """Tensor-parallel collectives (TACO): none (megatron-core's own, nothing replaced) or fp8 (all-gather, reduce-scatter and all-reduce of FP8 shards with fp32 sums)."""

    tah_dp_codec: str = dataclasses.field(default="none", metadata={"choices": ("none", "int8")})
    """Data-parallel gradient reduction (AGoQ QuanGrad): none (megatron-core's own) or int8 (all-to-all of 8-bit shards, fp32 sums, all-gather of 8-bit sums)."""

    tah_embedding_codec: str = dataclasses.field(default="none", metadata={"choices": ("none", "int8")})
    """Tied word-embedding gradient between the first and the last pipeline stage (megatron-core all-reduces vocabulary x hidden elements each way every iteration): none (megatron-core's own all-reduce) or int8 (the first stage sends the rows of tokens in the batch exactly, with their indices; the last stage its dense output-layer gradient as blockwise int8; both add them in fp32 in the same order, so both copies of the weight stay identical). Needs tied embeddings and two or more stages (an error otherwise); scripts/pretrain_gpt.sh unties instead when RATE is set."""

    tah_activation_memory: str = dataclasses.field(default="none", metadata={"choices": ("none", "laaq")})
    """Tensors transformer layers save for backward (AGoQ LAAQ): none (kept as they are) or laaq (blockwise low-bit, attention inputs kept)."""

    tah_laaq_bits: str = dataclasses.field(default="4,5,6,8", metadata={"parse": IntList("4,5,6,8", bounds=(2, 8))})
    """LAAQ bits per pipeline stage, first to last: stage i of p uses entry floor(i * n / p) of these n (each 2..8)."""

    tah_laaq_block_size: int = 128
    """LAAQ elements per scale/zero pair: 8, 16, 32, 64 or 128."""

    tah_warmup_iters: int = 0
    """Send the first N training iterations uncompressed in both directions (the official TAH-Quant code's warm-up; the bytes count in the statistics). Needs Megatron's training loop; not with a codec that warms up per sample (aqsgd: --tah-aqsgd-warmup-samples)."""

    tah_eval_traffic: str = dataclasses.field(default="codec", metadata={"choices": ("codec", "uncompressed", "both")})
    """Pipeline traffic of Megatron's evaluations (forward only): codec (through the codecs, like training), uncompressed (the loss is the trained model's own, not the model's through the codec), or both (through the codecs, then the same batches again uncompressed: Megatron's log shows the first, --tah-log-json records both as valid_loss and valid_loss_uncompressed). Training is unchanged. Entered by Megatron's evaluate() (a loop of one's own uses megatron_tah.megatron.pipeline_parallel.evaluation()); codec only with aqsgd."""


    tah_backend: str = dataclasses.field(default="auto", metadata={"choices": BACKENDS})
    """Codec implementation: auto (Triton on CUDA tensors where the codec has a kernel, torch otherwise), torch or triton."""

    tah_wire_checksum: bool = WIRE_CHECKSUM_DEFAULT
    """Put a checksum of each pipeline message's payload in its header (computed on the device) and check it on receipt: a corrupted message raises PayloadChecksumError naming the link and iteration instead of reaching the model silently. Both stages must agree. Off by default here; on in scripts/pretrain_gpt.sh and the demo whenever they run behind a slow link (RATE, --rate). Its measured cost behind a slow link and on a fast one: docs/RELIABILITY.md."""

    tah_entropy_coding: bool = False
    """Code each pipeline message losslessly after its codec (a canonical Huffman code per section of its buffer, codecs/entropy.py): fewer bytes, the same decoded values, so the steps to a loss do not change. torch.distributed's sends have sizes fixed in advance, so both stages size each message from the coded sizes of the last 8 on its link plus 2% (link/frames.py); what does not fit follows as a second message. Costs the coder's time on both ends (torch operations, no fused kernel; not timed on a GPU: python -m benchmarks.lossless times it on the CPU, where it does not pay). Megatron's schedules read each link's receives in turn, as the sizing needs (a schedule posting them ahead gets an error). Needs a fixed codec (not auto). Both stages must agree."""

    tah_peer_timeout_s: float = 120.0
    """Stop the run when a neighbouring pipeline stage stays silent this long (seconds; 0: Megatron's own timeouts only). A wait for a pipeline message longer than this raises PeerTimeoutError naming the link (stage i -> j), the iteration and when data from that stage last arrived; a dead peer raises PeerLostError at once; an outage shorter than this is ridden out. The same bound applies to every other collective after the first iteration (it sets Megatron's --distributed-timeout-seconds-after-init unless that is given; checkpoint saves keep --distributed-timeout-minutes), and the first iteration after a start waits up to --distributed-timeout-minutes (kernel compilation, auto's cost table). The default, 120 s, exceeds a whole step of the slowest WAN record (docs/RELIABILITY.md; a wait lasts part of one) and is 5x shorter than Megatron's 10-minute default. gloo waits are bounded by the transport itself; NCCL's by the process group's timeout (its watchdog)."""

    tah_eager_codecs: bool = False
    """Call the codecs eagerly on GPUs. By default the pipeline's link ends and the TP/DP collectives capture each codec call once per message shape as a CUDA graph and replay it (fewer launches; one log line per reason a call stays eager: CPU tensors, the none codec, AQ-SGD, stochastic rounding, a failed capture); this turns that off, to compare or to rule it out."""

    tah_error_sample_interval: int = 16
    """Measure the relative round-trip error on one message in this many (0: never)."""

    tah_emulate_bandwidth: str | None = dataclasses.field(default=None, metadata={"parse": parse_bandwidth})
    """Delay every pipeline message as if the link ran at this rate (e.g. 100mbit, 1gbit); off by default."""

    tah_emulate_latency_ms: float = 0.0
    """Extra one-way latency per message in milliseconds, with --tah-emulate-bandwidth."""

    tah_emulate_wire: str = dataclasses.field(default="link", metadata={"choices": ("link", "inbound")})
    """How --tah-emulate-bandwidth meters messages: link (each directed link between two stages is its own pipe; the latency delays a message without holding the pipe) or inbound (each rank has one inbound wire shared by the activations from the previous stage and the gradients from the next; a message holds it from max(wire free, its sender's send time, carried in a 24-byte trailer that is not billed) for its bytes / rate plus the latency, then the receiver may use it: the WAN speedrun's meter)."""

    tah_log_json: str | None = None
    """Append one JSON record per iteration and per evaluation (loss, time, bytes on the wire, codec time) to this file."""

    tah_auto_candidates: str = ",".join(AUTO_DEFAULTS.candidates)
    """Codecs a direction set to auto chooses among (comma list): none, fp8, fixedpoint4 (direct 4-bit activations, the paper's 6-bit gradients) or a preset's codec for the direction (paper, hadint4, lowrank, lowrank8, channel, channel6, channel9, channel_h4). Links start with none (else paper, else the first) until the link is measured."""

    tah_auto_max_error: float | None = AUTO_DEFAULTS.max_error
    """auto: largest relative round-trip error a candidate may have (default: the paper codec's error on the link's first message, waived for a candidate whose steps to a loss were measured at the pipeline's depth, not as a lower bound: it is judged by those; given, it binds every candidate)."""

    tah_auto_interval: int = AUTO_DEFAULTS.interval
    """auto: measure each link's rate and reconsider its codec every this many iterations (and once as soon as the first iteration's transfers are measured); a rate that falls under half is measured at the first iteration boundary after whole iterations holding 3 transfers at the new rate, whatever the interval."""

    tah_auto_probation: int = AUTO_DEFAULTS.probation
    """auto: after a switch the new codec keeps the link only if its first this-many iterations ran faster than the ones before the switch; else the link goes back and the codec waits 4 measurements before it is tried again (0: no probation)."""

    tah_share_gpus: bool = False
    """Run several pipeline ranks per GPU (device = local rank mod the GPU count; on automatically when two ranks' devices are one GPU (device UUIDs exchanged at the rendezvous)): the process groups use gloo (NCCL refuses two ranks on one GPU) and every pipeline message goes through pinned host memory after encoding (megatron/share_gpus.py, link/staging.py). Without a CUDA device the ranks run on the CPU and the messages are staged all the same."""

    # ----- the codecs' own options: default, help and range from each codec's DECLARATION --------------------
    tah_high_bits: int = codec_option("tah_high_bits")
    tah_low_bits: int = codec_option("tah_low_bits")
    tah_high_ratio: float = codec_option("tah_high_ratio")
    tah_outlier_threshold: float = codec_option("tah_outlier_threshold")
    tah_allocation: str = codec_option("tah_allocation")
    tah_low_bits_for: str = codec_option("tah_low_bits_for")
    tah_fp8_group_size: int = codec_option("tah_fp8_group_size")
    tah_aqsgd_warmup_samples: int = codec_option("tah_aqsgd_warmup_samples")
    tah_int8_block_size: int = codec_option("tah_int8_block_size")
    tah_fp4_hadamard: bool = codec_option("tah_fp4_hadamard")
    tah_lowrank_rank: int = codec_option("tah_lowrank_rank")
    tah_lowrank_coef_bits: int = codec_option("tah_lowrank_coef_bits")
    tah_channel_outlier_tokens: int = codec_option("tah_channel_outlier_tokens")

    _DIRECTIONS = ("tah_forward_codec", "tah_backward_codec")
    # The direction parameters' fields (codecs/options.py): their help names the registered codecs that take them.
    _DIRECTION_PARAMETERS = {"tah_tile_size": "tile_size", "tah_backward_tile_size": "tile_size",
                             "tah_forward_bits": "bits", "tah_backward_bits": "bits",
                             "tah_stochastic_rounding": "stochastic_rounding",
                             "tah_backward_stochastic_rounding": "stochastic_rounding"}

    def __post_init__(self):
        self._apply_preset()
        if self.tah_backward_codec in CODECS and codec_declaration(self.tah_backward_codec).forward_only:
            raise ValueError(f"tah_backward_codec = {self.tah_backward_codec!r}: it compresses activations only; "
                             f"choose one of {', '.join(backward_codecs())} for gradients")
        for field in dataclasses.fields(self):
            check_field(field, getattr(self, field.name))
        self.auto_settings()  # checks the tah_auto_* fields
        self._check_rounding()
        if self.tah_backend == "triton":
            for field in self._DIRECTIONS:
                name = getattr(self, field)
                if name != AUTO and not codec_declaration(name).kernel:  # (auto's candidates: when built)
                    raise ValueError(f"tah_backend = 'triton' with {field} = {name!r}: it has no Triton kernel; "
                                     "use auto or torch")
        # Building the codecs validates bit widths and tile sizes with the codecs' own messages.
        for role, build in (("forward", self.forward_codec), ("backward", self.backward_codec)):
            try:
                build()
            except CodecError as err:
                name = getattr(self, f"tah_{role}_codec")
                raise ValueError(f"tah_{role}_codec = {name!r}: {err}") from None
        link_options.check(self)

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
        """Every field's help: the docstrings under the fields (a direction parameter's followed by the registered
        codecs that take it), and each codec option's declared help."""
        docs = field_docs(cls)
        for field, parameter in cls._DIRECTION_PARAMETERS.items():
            takers = backward_codecs() if "backward" in field else forward_codecs()
            takers = [name for name in takers if parameter in codec_declaration(name).takes]
            docs[field] = f"{docs[field]} Codecs that take it: {', '.join(takers)}."
        return {**docs, **{name: option.help for name, option in CODEC_OPTIONS.items()}}

    def parsed(self, name: str) -> Any:
        """Field ``name`` as its readers use it: what its declared ``parse`` makes of its text (None stays None)."""
        value = getattr(self, name)
        parse = next(f for f in dataclasses.fields(self) if f.name == name).metadata.get("parse")
        return value if parse is None or value is None else parse(value)

    @property
    def emulated_bandwidth_bps(self) -> float | None:
        return self.parsed("tah_emulate_bandwidth")

    def boundary_bits(self) -> tuple[int, ...]:
        """``tah_boundary_bits`` as integers (() when not set)."""
        return self.parsed("tah_boundary_bits") or ()

    def _check_rounding(self) -> None:
        """Stochastic rounding is asked of a codec that rounds stochastically (``none`` aside), never ignored."""
        asked = {"tah_forward_codec": self.tah_stochastic_rounding,  # (the keys are _DIRECTIONS)
                 "tah_backward_codec": self.tah_stochastic_rounding or self.tah_backward_stochastic_rounding}
        rounding = rounding_codecs()
        if self.tah_backward_stochastic_rounding and self.tah_backward_codec not in rounding:
            raise ValueError(f"tah_backward_stochastic_rounding needs a tah_backward_codec that rounds stochastically "
                             f"({', '.join(rounding)}), got {self.tah_backward_codec!r}")
        for field, wanted in asked.items():
            name = getattr(self, field)
            if wanted and name != "none" and name not in rounding:
                raise ValueError(f"tah_stochastic_rounding with {field} = {name!r}: it rounds to nearest; "
                                 f"stochastic rounding is for {', '.join(rounding)}")
        if self.tah_stochastic_rounding and not any(getattr(self, field) in rounding for field in asked):
            raise ValueError(f"tah_stochastic_rounding with neither direction's codec among {', '.join(rounding)}")

    def is_off(self) -> bool:
        """Every option at its default: nothing is compressed, emulated or logged (Megatron runs as without us)."""
        return self == type(self)()

    # ----- the codec factory ---------------------------------------------------------------------------------
    def build_codec(self, name: str, bits: int, tile_size: int, stochastic_rounding: bool = False,
                    checksum: bool = False) -> Codec:
        """A new codec ``name`` with a direction's parameters, this config's backend and the codec's own options
        (its declaration); ``checksum``: the payload checksum in the header (the pipeline's codecs:
        ``tah_wire_checksum``). The places build theirs with it."""
        direction = {"bits": bits, "tile_size": tile_size,
                     "stochastic_rounding": stochastic_rounding or self.tah_stochastic_rounding}
        return get_codec(name, backend=self.tah_backend, checksum=checksum,
                         **codec_declaration(name).build_kwargs(self, direction))

    def auto_settings(self) -> AutoSettings:
        """The ``AutoSettings`` of the auto directions (the same for both); a bad ``tah_auto_*`` value raises
        ``ValueError`` naming its field (``AutoSettings`` names the setting first: the field is ``tah_auto_<it>``)."""
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

    def auto_start(self) -> str:
        """The candidate auto links start with, before their first measurement (``AutoSettings.start``)."""
        return self.auto_settings().start()

    def forward_codec(self, boundary: int | None = None, boundaries: int | None = None) -> Codec:
        """A new codec object for activations (one per link end: aqsgd keeps state); auto: the codec
        its links start with (``auto_start``). ``boundary`` of ``boundaries`` (0-based; the link from stage
        ``boundary`` to the next of a pipeline with ``boundaries + 1`` stages): its bits (``forward_bits``)."""
        if self.is_auto("forward"):
            return self.auto_candidate_codec(self.auto_start(), "forward")
        return self.build_codec(self.tah_forward_codec, self.forward_bits(boundary, boundaries), self.tah_tile_size,
                                checksum=self.tah_wire_checksum)

    def forward_bits(self, boundary: int | None = None, boundaries: int | None = None) -> int:
        """The forward codec's bits at ``boundary`` of ``boundaries``: entry ``floor(boundary * n / boundaries)``
        of ``tah_boundary_bits`` when set (``boundary`` None: ``tah_forward_bits``, what a message outside a
        pipeline's links would use), else ``tah_forward_bits``."""
        entries = self.boundary_bits()
        if not entries or boundary is None:
            return self.tah_forward_bits
        if boundaries is None or not 0 <= boundary < boundaries:
            raise ValueError(f"tah_boundary_bits: boundary {boundary} of {boundaries}: a link between neighbouring "
                             "stages of a pipeline that does not wrap (the 1F1B schedule, not interleaved)")
        return entries[boundary * len(entries) // boundaries]

    def backward_codec(self) -> Codec:
        """A new codec object for activation gradients (auto: as ``forward_codec``)."""
        if self.is_auto("backward"):
            return self.auto_candidate_codec(self.auto_start(), "backward")
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
    check_candidate(name)
    config = TahConfig(**candidate_fields(name), tah_backend=backend, tah_wire_checksum=checksum)
    return config.forward_codec(*(boundary or ())) if direction == "forward" else config.backward_codec()
