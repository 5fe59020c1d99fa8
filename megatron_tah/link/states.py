"""The codec state of one transport's link ends (``CodecStates``): what a checkpoint saves and loads.

A link end's codec may keep state between messages (AQ-SGD's per-sample buffers, stochastic rounding's
generator; an auto link end: its choice and its candidates' states). ``state_dict()`` is ``{(direction, role,
peer): state}`` of the link ends that hold some; ``load_state_dict`` gives each named link end its state back,
opening the link ends it names, and refuses a state saved with other codecs. Where the state goes on disk is
Megatron's side (``megatron/codec_state.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..config import TahConfig
from .handshake import CodecMismatchError, config_record

__all__ = ["CodecStates"]


class CodecStates:
    """The states of ``links`` (the transport's ``{(direction, role, peer): link.Link}``, read when asked);
    ``open(direction, role, peer)``: the transport's link end, opened at its first use."""

    def __init__(self, config: TahConfig, links: dict, open: Callable):
        self.config, self.links, self.open = config, links, open

    def state_dict(self) -> dict:
        """``{(direction, role, peer): codec.state_dict()}`` of the link ends whose codecs hold state
        (an auto link end: ``AutoEnd.state_dict()``, its choice and its candidates' states)."""
        states = {key: link.auto.state_dict() if link.auto is not None else link.codec.state_dict()
                  for key, link in self.links.items()}
        return {key: state for key, state in states.items() if state}

    def load_state_dict(self, states: dict, saved_config: dict | None = None) -> None:
        """Give each link end's codec its saved state (opening the link ends it names); ``saved_config``: the
        configuration it was saved with (``dataclasses.asdict`` of a ``TahConfig``), checked against this one's."""
        if saved_config is not None:
            fields = {f.name for f in dataclasses.fields(TahConfig)}
            saved = TahConfig(**{k: v for k, v in saved_config.items() if k in fields})
            if config_record(saved) != config_record(self.config):
                raise CodecMismatchError(
                    f"megatron_tah: the checkpoint's codec state was saved with other codecs "
                    f"({config_record(saved)}) than this run's ({config_record(self.config)}); "
                    "load it with the same --tah-* flags, or use --finetune to start the codecs afresh")
        for (direction, role, peer), codec_state in states.items():
            link = self.open(direction, role, peer)
            (link.codec if link.auto is None else link.auto).load_state_dict(codec_state)

    def stateful(self) -> bool:
        """Whether the configured codecs keep state between messages (AQ-SGD, stochastic rounding, auto's choice)."""
        if self.config.is_auto("forward") or self.config.is_auto("backward"):
            return True
        return any(codec.stateful for codec in (self.config.forward_codec(), self.config.backward_codec()))

    def buffer_nbytes(self) -> int:
        """Bytes held in per-sample buffers (AQ-SGD) by this rank's codecs (the statistics' buffer source)."""
        return sum(link.codec.buffer_nbytes() for link in self.links.values() if hasattr(link.codec, "buffer_nbytes"))
