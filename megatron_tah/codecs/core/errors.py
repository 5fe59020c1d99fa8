"""What a codec raises, and the checks of its inputs (shape and dtype) that raise it."""

from __future__ import annotations

from typing import Sequence

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
