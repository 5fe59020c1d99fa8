"""megatron_tah's options: one dataclass, the source of the ``--tah-*`` flags.

Each field's docstring is its flag's help text; ``add_tah_arguments`` turns
``tah_forward_codec`` into ``--tah-forward-codec`` (see ``megatron/arguments.py``),
so a flag and its field never drift apart. A field whose valid values are a fixed list declares
them once, as ``metadata={"choices": ...}``: the flag's argparse choices and the check in
``__post_init__`` both come from there. ``__post_init__`` validates and raises ``ValueError``
naming the offending value.
"""

from __future__ import annotations

import ast
import dataclasses
from typing import Any

from .codecs import CODECS, Codec, CodecError, get_codec
from .codecs.checksum import ENABLED_BY_DEFAULT as WIRE_CHECKSUM_DEFAULT
from .codecs.tah import ALLOCATIONS, LOW_BITS_FOR
from .units import parse_bandwidth

TP_CODECS = ("none", "fp8")
DP_CODECS = ("none", "int8")
ACTIVATION_MEMORY = ("none", "laaq")
EVAL_TRAFFIC = ("codec", "uncompressed", "both")

# --tah-preset name -> the fields it sets (issue 12; measured gaps and bits: docs/PARITY.md, RESULTS.md section 4b).
PRESETS = {
    "none": {},
    # TAH-Quant exactly as SPEC.md specifies it, with the 6-bit tile-32 backward codec: the flags' defaults.
    "paper": {"tah_forward_codec": "tah", "tah_backward_codec": "fixedpoint", "tah_tile_size": 64,
              "tah_high_bits": 4, "tah_low_bits": 3, "tah_high_ratio": 0.8, "tah_outlier_threshold": 2.0,
              "tah_allocation": "token", "tah_backward_bits": 6, "tah_backward_tile_size": 32},
    # Random-sign Hadamard INT4 both ways, one bf16 scale per 64 values (4.25 bits each way), gradients
    # rounded stochastically: the parity study's candidate (Triton kernels: kernels/hadint.py).
    "hadint4": {"tah_forward_codec": "hadint", "tah_forward_bits": 4, "tah_tile_size": 64,
                "tah_backward_codec": "hadint", "tah_backward_bits": 4, "tah_backward_tile_size": 64,
                "tah_backward_stochastic_rounding": True},
    # The message's 16 principal directions apart (8-bit basis, 6-bit coefficients) and the residual as
    # Hadamard INT3 (4.38 bits at hidden 128, 512 rows; fewer at larger sizes), gradients as in hadint4.
    "lowrank": {"tah_forward_codec": "lowrank", "tah_forward_bits": 3, "tah_tile_size": 64,
                "tah_lowrank_rank": 16, "tah_lowrank_coef_bits": 6,
                "tah_backward_codec": "hadint", "tah_backward_bits": 4, "tah_backward_tile_size": 64,
                "tah_backward_stochastic_rounding": True},
    # The same with 8 directions: fewer bits (3.88 at hidden 128, 3.63 at 256), a larger measured gap.
    "lowrank8": {"tah_forward_codec": "lowrank", "tah_forward_bits": 3, "tah_tile_size": 64,
                 "tah_lowrank_rank": 8, "tah_lowrank_coef_bits": 6,
                 "tah_backward_codec": "hadint", "tah_backward_bits": 4, "tah_backward_tile_size": 64,
                 "tah_backward_stochastic_rounding": True},
}

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
    tah_preset: str = dataclasses.field(default="none", metadata={"choices": tuple(PRESETS)})
    """A named set of pipeline-codec options: none (the flags below as given), paper (TAH-Quant as specified, the defaults), hadint4 (Hadamard INT4 both ways, 4.25 bits each, stochastic rounding of gradients: 1.35x fewer bytes than paper), lowrank (activations: 16 principal directions apart and the residual as Hadamard INT3, 4.38 bits at hidden 128; gradients as hadint4) or lowrank8 (the same with 8 directions, 3.88 bits). A flag set to neither its default nor the preset's value is an error."""

    tah_forward_codec: str = "tah"
    """Codec for activations sent to the next stage: none, fixedpoint, tah, fp8, aqsgd, int8, mxfp4, nvfp4, hadint or lowrank."""

    tah_backward_codec: str = "fixedpoint"
    """Codec for activation gradients sent to the previous stage: none, fixedpoint, tah, fp8, int8, mxfp4, nvfp4, hadint or lowrank."""

    tah_tile_size: int = 64
    """Channels per tile for the forward codec (tah, fixedpoint, aqsgd, hadint, lowrank's residual): 16, 32, 64 or 128."""

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
    """Round stochastically (unbiased) instead of to nearest in the quantizing codecs (both directions)."""

    tah_backward_stochastic_rounding: bool = False
    """Round stochastically in the backward codec only (fixedpoint or hadint): unbiased activation gradients."""

    tah_forward_bits: int = 4
    """Bits of the forward codec when it is fixedpoint, aqsgd or hadint (lowrank: of its residual)."""

    tah_backward_bits: int = 6
    """Bits of the backward codec when it is fixedpoint or hadint (lowrank: of its residual)."""

    tah_lowrank_rank: int = 16
    """lowrank codec: principal directions of each message sent apart from the residual (at most the hidden size)."""

    tah_lowrank_coef_bits: int = 6
    """lowrank codec: bits of the per-token coefficients of those directions (3 to 8)."""

    tah_backward_tile_size: int = 32
    """Channels per tile of the backward codec."""

    tah_fp8_group_size: int = 128
    """Group size of the fp8 codec (pipeline or tensor-parallel)."""

    tah_int8_block_size: int = 128
    """Elements per fp32 scale of the int8 codec (data-parallel gradients, or a pipeline direction): 32 to 1024."""

    tah_fp4_hadamard: bool = False
    """mxfp4 / nvfp4: rotate every block (32 / 16 values) by a random-sign Walsh-Hadamard transform before quantizing (reference-only codecs, no Triton kernel)."""

    tah_tp_codec: str = dataclasses.field(default="none", metadata={"choices": TP_CODECS})
    """Tensor-parallel collectives (TACO): none (megatron-core's own, nothing replaced) or fp8 (all-gather, reduce-scatter and all-reduce of FP8 shards with fp32 sums)."""

    tah_dp_codec: str = dataclasses.field(default="none", metadata={"choices": DP_CODECS})
    """Data-parallel gradient reduction (AGoQ QuanGrad): none (megatron-core's own) or int8 (all-to-all of 8-bit shards, fp32 sums, all-gather of 8-bit sums)."""

    tah_activation_memory: str = dataclasses.field(default="none", metadata={"choices": ACTIVATION_MEMORY})
    """Tensors transformer layers save for backward (AGoQ LAAQ): none (kept as they are) or laaq (blockwise low-bit, attention inputs kept)."""

    tah_laaq_bits: str = "4,5,6,8"
    """LAAQ bits per pipeline stage, first to last: stage i of p uses entry floor(i * n / p) of these n (each 2..8)."""

    tah_laaq_block_size: int = 128
    """LAAQ elements per scale/zero pair: 8, 16, 32, 64 or 128."""

    tah_warmup_iters: int = 0
    """Send the first N training iterations uncompressed in both directions (the official TAH-Quant code's warm-up; the bytes count in the statistics). Needs Megatron's training loop; not with aqsgd (see --tah-aqsgd-warmup-samples)."""

    tah_eval_traffic: str = dataclasses.field(default="codec", metadata={"choices": EVAL_TRAFFIC})
    """Pipeline traffic of Megatron's evaluations (forward only): codec (through the codecs, like training), uncompressed (the loss is the trained model's own, not the model's through the codec), or both (through the codecs, then the same batches again uncompressed: Megatron's log shows the first, --tah-log-json records both as valid_loss and valid_loss_uncompressed). Training is unchanged. Entered by Megatron's evaluate() (a loop of one's own uses megatron_tah.megatron.pipeline_parallel.evaluation()); codec only with aqsgd."""

    tah_aqsgd_warmup_samples: int = 0
    """AQ-SGD: samples sent uncompressed on each link before deltas start (one epoch of the training set)."""

    tah_backend: str = "auto"
    """Codec implementation: auto (Triton on CUDA tensors, torch on CPU), torch or triton."""

    tah_wire_checksum: bool = WIRE_CHECKSUM_DEFAULT
    """Put a checksum of each pipeline message's payload in its header (computed on the device) and check it on receipt: a corrupted message raises PayloadChecksumError instead of reaching the model silently. Both stages must agree. Off by default (on needs a cost under 2% of the codec's time): on CPU it costs 0.9-3.3% of tah's encode + decode time and 4.9-9.9% of the 6-bit fixedpoint backward codec's, at the demo's shape and at [1024, 1, 1600] bf16 (scripts/bench_codecs.py --checksum); the GPU's cost is not measured."""

    tah_error_sample_interval: int = 16
    """Measure the relative round-trip error on one message in this many (0: never)."""

    tah_emulate_bandwidth: str | None = None
    """Delay every pipeline message as if the link ran at this rate (e.g. 100mbit, 1gbit); off by default."""

    tah_emulate_latency_ms: float = 0.0
    """Extra one-way latency per message in milliseconds, with --tah-emulate-bandwidth."""

    tah_log_json: str | None = None
    """Append one JSON record per iteration and per evaluation (loss, time, bytes on the wire, codec time) to this file."""

    tah_share_gpus: bool = False
    """Run several pipeline ranks per GPU (device = local rank mod the GPU count; on automatically when a node's local ranks outnumber its GPUs): the process groups use gloo (NCCL refuses two ranks on one GPU) and every pipeline message goes through pinned host memory after encoding (megatron/share_gpus.py, megatron/staging.py). Without a CUDA device the ranks run on the CPU and the messages are staged all the same."""

    def __post_init__(self):
        self._apply_preset()
        for field in dataclasses.fields(self):
            choices = field.metadata.get("choices")
            if choices and getattr(self, field.name) not in choices:
                raise ValueError(f"{field.name} = {getattr(self, field.name)!r}: choose one of {', '.join(choices)}")
        for field in ("tah_forward_codec", "tah_backward_codec"):
            if getattr(self, field) not in CODECS:
                raise ValueError(f"{field} = {getattr(self, field)!r}: choose one of {', '.join(CODECS)}")
        if self.tah_backward_codec == "aqsgd":
            raise ValueError("tah_backward_codec = 'aqsgd': AQ-SGD compresses activations only; "
                             "use fixedpoint, tah, fp8 or none for gradients")
        if self.tah_backward_stochastic_rounding and self.tah_backward_codec not in ("fixedpoint", "hadint"):
            raise ValueError(f"tah_backward_stochastic_rounding needs tah_backward_codec fixedpoint or hadint, "
                             f"got {self.tah_backward_codec!r}")
        if self.tah_low_bits_for not in LOW_BITS_FOR:
            raise ValueError(f"tah_low_bits_for = {self.tah_low_bits_for!r}: choose {' or '.join(LOW_BITS_FOR)}")
        if self.tah_allocation not in ALLOCATIONS:
            raise ValueError(f"tah_allocation = {self.tah_allocation!r}: choose {' or '.join(ALLOCATIONS)}")
        if not 0.0 <= self.tah_high_ratio <= 1.0:
            raise ValueError(f"tah_high_ratio = {self.tah_high_ratio}: must lie in [0, 1]")
        if self.tah_outlier_threshold < 0:
            raise ValueError(f"tah_outlier_threshold = {self.tah_outlier_threshold}: must be >= 0 (or inf)")
        if self.tah_warmup_iters < 0:
            raise ValueError(f"tah_warmup_iters = {self.tah_warmup_iters}: must be >= 0")
        if self.tah_warmup_iters and self.tah_forward_codec == "aqsgd":
            raise ValueError("tah_warmup_iters with tah_forward_codec = 'aqsgd': AQ-SGD warms up per sample "
                             "(tah_aqsgd_warmup_samples)")
        if self.tah_eval_traffic != "codec" and self.tah_forward_codec == "aqsgd":
            raise ValueError(f"tah_eval_traffic = {self.tah_eval_traffic!r} with tah_forward_codec = 'aqsgd': "
                             "AQ-SGD's per-sample buffers follow every message of a sample; evaluate through the codec")
        if self.tah_emulate_bandwidth is not None:
            parse_bandwidth(self.tah_emulate_bandwidth)
        if self.tah_emulate_latency_ms < 0:
            raise ValueError(f"tah_emulate_latency_ms = {self.tah_emulate_latency_ms}: must be >= 0")
        # Building the codecs validates bit widths and tile sizes with the codecs' own messages.
        for role, build in (("forward", self.forward_codec), ("backward", self.backward_codec),
                            ("tp", self.tp_codec), ("dp", self.dp_codec)):
            try:
                build()
            except CodecError as err:
                name = getattr(self, f"tah_{role}_codec")
                raise ValueError(f"tah_{role}_codec = {name!r}: {err}") from None
        if any(not 2 <= b <= 8 for b in self.laaq_bits()):
            raise ValueError(f"tah_laaq_bits = {self.tah_laaq_bits!r}: every entry must lie in [2, 8]")
        try:
            self.laaq_codec(0, 1)
        except CodecError as err:
            raise ValueError(f"tah_laaq_block_size = {self.tah_laaq_block_size}: {err}") from None

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
        return _field_docs(cls)

    @property
    def emulated_bandwidth_bps(self) -> float | None:
        return None if self.tah_emulate_bandwidth is None else parse_bandwidth(self.tah_emulate_bandwidth)

    def _codec(self, name: str, bits: int, tile_size: int, stochastic_rounding: bool = False,
               checksum: bool = False) -> Codec:
        backend = {"backend": self.tah_backend, "checksum": checksum}
        stochastic_rounding = stochastic_rounding or self.tah_stochastic_rounding
        if name == "none":
            return get_codec("none", **backend)
        if name == "fixedpoint":
            return get_codec("fixedpoint", bits=bits, tile_size=tile_size,
                             stochastic_rounding=stochastic_rounding, **backend)
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
        if name == "int8":
            return get_codec("int8", block_size=self.tah_int8_block_size, **backend)
        if name == "hadint":
            return get_codec("hadint", bits=bits, tile_size=tile_size, stochastic_rounding=stochastic_rounding,
                             **backend)
        if name == "lowrank":
            if stochastic_rounding:
                raise CodecError("lowrank rounds to nearest; stochastic rounding is for fixedpoint and hadint")
            return get_codec("lowrank", bits=bits, tile_size=tile_size, rank=self.tah_lowrank_rank,
                             coef_bits=self.tah_lowrank_coef_bits, **backend)
        if name in ("mxfp4", "nvfp4"):
            return get_codec(name, hadamard=self.tah_fp4_hadamard, **backend)
        raise ValueError(f"unknown codec {name!r}")

    def forward_codec(self) -> Codec:
        """A new codec object for activations (one per link end: aqsgd keeps state)."""
        return self._codec(self.tah_forward_codec, self.tah_forward_bits, self.tah_tile_size,
                           checksum=self.tah_wire_checksum)

    def backward_codec(self) -> Codec:
        """A new codec object for activation gradients."""
        return self._codec(self.tah_backward_codec, self.tah_backward_bits, self.tah_backward_tile_size,
                           stochastic_rounding=self.tah_backward_stochastic_rounding,
                           checksum=self.tah_wire_checksum)

    def tp_codec(self) -> Codec | None:
        """The tensor-parallel collectives' codec (None: megatron-core's collectives are left alone)."""
        return None if self.tah_tp_codec == "none" else self._codec(self.tah_tp_codec, 8, self.tah_fp8_group_size)

    def dp_codec(self) -> Codec | None:
        """The data-parallel gradient codec (None: megatron-core's reduction is left alone)."""
        return None if self.tah_dp_codec == "none" else self._codec(self.tah_dp_codec, 8, self.tah_int8_block_size)

    def laaq_bits(self) -> tuple[int, ...]:
        """``tah_laaq_bits`` as integers (ValueError naming the flag when it does not parse)."""
        try:
            bits = tuple(int(part) for part in self.tah_laaq_bits.split(","))
        except ValueError:
            bits = ()
        if not bits:
            raise ValueError(f"tah_laaq_bits = {self.tah_laaq_bits!r}: give comma-separated integers, e.g. 4,5,6,8")
        return bits

    def laaq_stage_bits(self, stage: int, stages: int) -> int:
        """Bits of stored activations on pipeline stage ``stage`` of ``stages`` (entry floor(stage * n / stages))."""
        bits = self.laaq_bits()
        return bits[stage * len(bits) // stages]

    def laaq_codec(self, stage: int, stages: int) -> Codec:
        """A new codec for the tensors saved on pipeline stage ``stage`` of ``stages`` (fixedpoint, one block per tile)."""
        return get_codec("fixedpoint", bits=self.laaq_stage_bits(stage, stages), tile_size=self.tah_laaq_block_size,
                         backend=self.tah_backend, checksum=False)
