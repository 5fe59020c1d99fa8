"""The pipeline link's options besides its codecs, and the rules they follow.

Bits per boundary (``tah_boundary_bits``), the warm-up (``tah_warmup_iters``), evaluation traffic
(``tah_eval_traffic``), entropy coding, the emulated link (``tah_emulate_*``) and the peer timeout are read by the
link (``megatron_tah/link/``), which takes a ``TahConfig`` as it is, with or without Megatron and the places (the
tests and benchmarks build transports directly). So their rules sit here, below the link: ``TahConfig`` runs
``check`` when it is made, and the pipeline place names it as its ``check`` hook (``megatron/pipeline_parallel.py``),
beside its checks of Megatron's arguments. Each rule raises ``ValueError`` naming the field and the value.
"""

from __future__ import annotations

from typing import Any

from ..codecs import CodecError, codec_declaration
from .fields import forward_codecs


def check(config: Any) -> None:
    """The link options' rules between themselves and with the pipeline's codecs (``config``: a ``TahConfig``)."""
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
    if config.tah_entropy_coding and (config.is_auto("forward") or config.is_auto("backward")):
        raise ValueError("tah_entropy_coding with an auto direction: auto chooses by the codecs' fixed message "
                         "sizes; give both directions a codec or a preset")
    if config.tah_emulate_wire != "link" and config.tah_emulate_bandwidth is None:
        raise ValueError(f"tah_emulate_wire = {config.tah_emulate_wire!r} meters the emulated link: it needs "
                         "tah_emulate_bandwidth")
    if not config.tah_peer_timeout_s >= 0:
        raise ValueError(f"tah_peer_timeout_s = {config.tah_peer_timeout_s!r}: must be >= 0 seconds (0: no bound "
                         "of its own, Megatron's timeouts)")
    if config.tah_emulate_latency_ms < 0:
        raise ValueError(f"tah_emulate_latency_ms = {config.tah_emulate_latency_ms}: must be >= 0")
    _check_boundary_bits(config)


def _check_boundary_bits(config: Any) -> None:
    """Per-boundary bits need a forward codec that takes bits, and each entry must build it."""
    entries = config.boundary_bits()
    if not entries:
        return
    name = config.tah_forward_codec
    bits_codecs = [n for n in forward_codecs() if "bits" in codec_declaration(n).takes]
    if config.is_auto("forward") or name not in bits_codecs:
        raise ValueError(f"tah_boundary_bits with tah_forward_codec = {name!r}: per-boundary bits need a forward "
                         f"codec that takes bits ({', '.join(bits_codecs)})")
    for b in sorted(set(entries)):
        try:
            config.build_codec(name, b, config.tah_tile_size)
        except CodecError as err:
            raise ValueError(f"tah_boundary_bits = {config.tah_boundary_bits!r}: entry {b}: {err}") from None
