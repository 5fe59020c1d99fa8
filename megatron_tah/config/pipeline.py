"""What the pipeline's fields must satisfy: its two codecs and its link's options.

The pipeline's codecs (``tah_forward_codec``, ``tah_backward_codec`` and their direction parameters) must be able
to do what they are asked (carry gradients, round stochastically, run on Triton) and must build. Its link's options
-- bits per boundary (``tah_boundary_bits``), the warm-up (``tah_warmup_iters``), evaluation traffic
(``tah_eval_traffic``) and bits (``tah_eval_forward_bits``), entropy coding, the emulated link (``tah_emulate_*``),
the peer timeout -- follow rules between themselves and with those codecs. The link (``megatron_tah/link/``)
reads a ``TahConfig`` as it is, with or without Megatron and the places (the tests and benchmarks build
transports directly), so these rules sit here, below it: ``TahConfig`` runs ``check`` when it is made, and the pipeline place names it as its ``check`` hook
(``megatron/pipeline_parallel.py``), beside its checks of Megatron's arguments. Each rule raises ``ValueError``
naming the field and the value.
"""

from __future__ import annotations

from typing import Any

from ..codecs import CODECS, CodecError, codec_declaration
from .auto import AUTO
from .fields import backward_codecs, forward_codecs, rounding_codecs

DIRECTIONS = ("tah_forward_codec", "tah_backward_codec")


def check(config: Any) -> None:
    """The pipeline's rules (``config``: a ``TahConfig`` whose fields each hold a valid value): its codecs', then
    its link options'."""
    check_codecs(config)
    check_link_options(config)


def check_backward_codec(config: Any) -> None:
    """A codec that carries activations only is no gradient codec (checked before the field's choices, which lack
    it, for this message)."""
    if config.tah_backward_codec in CODECS and codec_declaration(config.tah_backward_codec).forward_only:
        raise ValueError(f"tah_backward_codec = {config.tah_backward_codec!r}: it compresses activations only; "
                         f"choose one of {', '.join(backward_codecs())} for gradients")


def check_codecs(config: Any) -> None:
    """Each direction's codec can do what it is asked, and builds (the codecs' own messages)."""
    check_backward_codec(config)
    _check_rounding(config)
    if config.tah_backend == "triton":
        for field in DIRECTIONS:
            name = getattr(config, field)
            if name != AUTO and not codec_declaration(name).kernel:  # (auto's candidates: when built)
                raise ValueError(f"tah_backend = 'triton' with {field} = {name!r}: it has no Triton kernel; "
                                 "use auto or torch")
    for role, build in (("forward", config.forward_codec), ("backward", config.backward_codec)):
        try:
            build()
        except CodecError as err:
            raise ValueError(f"tah_{role}_codec = {getattr(config, f'tah_{role}_codec')!r}: {err}") from None


def _check_rounding(config: Any) -> None:
    """Stochastic rounding is asked of a codec that rounds stochastically (``none`` aside), never ignored."""
    asked = {"tah_forward_codec": config.tah_stochastic_rounding,  # (the keys are DIRECTIONS)
             "tah_backward_codec": config.tah_stochastic_rounding or config.tah_backward_stochastic_rounding}
    rounding = rounding_codecs()
    if config.tah_backward_stochastic_rounding and config.tah_backward_codec not in rounding:
        raise ValueError(f"tah_backward_stochastic_rounding needs a tah_backward_codec that rounds stochastically "
                         f"({', '.join(rounding)}), got {config.tah_backward_codec!r}")
    for field, wanted in asked.items():
        name = getattr(config, field)
        if wanted and name != "none" and name not in rounding:
            raise ValueError(f"tah_stochastic_rounding with {field} = {name!r}: it rounds to nearest; "
                             f"stochastic rounding is for {', '.join(rounding)}")
    if config.tah_stochastic_rounding and not any(getattr(config, field) in rounding for field in asked):
        raise ValueError(f"tah_stochastic_rounding with neither direction's codec among {', '.join(rounding)}")


def check_link_options(config: Any) -> None:
    """The link options' rules between themselves and with the pipeline's codecs."""
    # auto chooses among none, fp8 and the presets' codecs, none of which keeps per-sample state
    forward = codec_declaration("none" if config.is_auto("forward") else config.tah_forward_codec)
    if config.tah_warmup_iters < 0:
        raise ValueError(f"tah_warmup_iters = {config.tah_warmup_iters}: must be >= 0")
    if config.tah_warmup_iters and forward.needs_sample_ids:
        raise ValueError(f"tah_warmup_iters with tah_forward_codec = {config.tah_forward_codec!r}: a codec keeping "
                         "state per sample warms up per sample (its own option)")
    if config.tah_eval_traffic != "codec" and forward.needs_sample_ids:
        raise ValueError(f"tah_eval_traffic = {config.tah_eval_traffic!r} with tah_forward_codec = "
                         f"{config.tah_forward_codec!r}: its per-sample state follows every message of a sample; "
                         "evaluate through the codec")
    if config.tah_entropy_when != "always" and not config.tah_entropy_coding:
        raise ValueError(f"tah_entropy_when = {config.tah_entropy_when!r} chooses when the entropy coder runs: it "
                         "needs tah_entropy_coding")
    if config.tah_entropy_when == "auto" and config.link_rate_bps is None and not (
            config.is_auto("forward") and config.is_auto("backward")):
        raise ValueError("tah_entropy_when = 'auto' judges the coder by the link's rate: give tah_link_rate (or "
                         "tah_emulate_bandwidth), or let auto measure it (tah_forward_codec and tah_backward_codec "
                         "auto)")
    if config.tah_emulate_wire != "link" and config.tah_emulate_bandwidth is None:
        raise ValueError(f"tah_emulate_wire = {config.tah_emulate_wire!r} meters the emulated link: it needs "
                         "tah_emulate_bandwidth")
    if not config.tah_peer_timeout_s >= 0:
        raise ValueError(f"tah_peer_timeout_s = {config.tah_peer_timeout_s!r}: must be >= 0 seconds (0: no bound "
                         "of its own, Megatron's timeouts)")
    if not config.tah_peer_start_up_s >= 0:
        raise ValueError(f"tah_peer_start_up_s = {config.tah_peer_start_up_s!r}: must be >= 0 seconds")
    if config.tah_emulate_latency_ms < 0:
        raise ValueError(f"tah_emulate_latency_ms = {config.tah_emulate_latency_ms}: must be >= 0")
    _check_boundary_bits(config)
    _check_eval_forward_bits(config)


def _bits_codecs() -> list[str]:
    """The forward codecs that take bits (``--tah-forward-bits``)."""
    return [n for n in forward_codecs() if "bits" in codec_declaration(n).takes]


def _check_eval_forward_bits(config: Any) -> None:
    """Evaluation bits need a forward codec that takes bits, keeps no per-sample state and is not auto, evaluations
    that go through it (not ``tah_eval_traffic = 'uncompressed'``), and must build it."""
    bits = config.tah_eval_forward_bits
    if bits is None:
        return
    name = config.tah_forward_codec
    if config.is_auto("forward"):
        raise ValueError(f"tah_eval_forward_bits = {bits} with tah_forward_codec = 'auto': auto chooses each link's "
                         "codec and bits; give the forward direction a codec that takes bits or a preset")
    if name not in _bits_codecs():
        takers = [n for n in _bits_codecs() if not codec_declaration(n).needs_sample_ids]
        raise ValueError(f"tah_eval_forward_bits = {bits} with tah_forward_codec = {name!r}: it takes no bits; "
                         f"evaluation bits need a forward codec that takes bits ({', '.join(takers)})")
    if codec_declaration(name).needs_sample_ids:
        raise ValueError(f"tah_eval_forward_bits = {bits} with tah_forward_codec = {name!r}: its per-sample state "
                         "follows every message of a sample; evaluate through the training codec")
    if config.tah_eval_traffic == "uncompressed":
        raise ValueError(f"tah_eval_forward_bits = {bits} with tah_eval_traffic = 'uncompressed': evaluations "
                         "never go through the codec; use codec or both, or drop tah_eval_forward_bits")
    try:
        config.build_codec(name, bits, config.tah_tile_size)
    except CodecError as err:
        raise ValueError(f"tah_eval_forward_bits = {bits}: {err}") from None


def _check_boundary_bits(config: Any) -> None:
    """Per-boundary bits need a forward codec that takes bits, and each entry must build it."""
    entries = config.boundary_bits()
    if not entries:
        return
    name = config.tah_forward_codec
    bits_codecs = _bits_codecs()
    if config.is_auto("forward") or name not in bits_codecs:
        raise ValueError(f"tah_boundary_bits with tah_forward_codec = {name!r}: per-boundary bits need a forward "
                         f"codec that takes bits ({', '.join(bits_codecs)})")
    for b in sorted(set(entries)):
        try:
            config.build_codec(name, b, config.tah_tile_size)
        except CodecError as err:
            raise ValueError(f"tah_boundary_bits = {config.tah_boundary_bits!r}: entry {b}: {err}") from None
