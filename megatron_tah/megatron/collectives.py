"""Compressed collectives: all-gather, reduce-scatter and all-reduce whose wire is codec buffers.

Every function takes a stateless codec (``codecs.core.base.Codec``, or the ``codecs.core.graphs.GraphedCodec`` the places
hand it: the same calls, replayed per chunk shape) and a process group of ``N`` ranks, and
moves only ``uint8`` buffers made by ``codec.encode``, through two collectives that gloo and NCCL
both provide and that ``torch.distributed._coalescing_manager`` does not defer:
``all_to_all_single`` and the list form of ``all_gather``. Sums are taken in fp32, in rank
order, after decoding, so there is no low-precision accumulation on the wire and every rank
computes the same result bit for bit.

``all_gather(codec, output, input_, group)``
    ``output`` (``[N * d0, ...]``) = every rank's ``input_`` (``[d0, ...]``), concatenated along
    dim 0, each as decoded from its buffer -- this rank's own slice too, so all ranks agree.
    Wire per rank: ``(N - 1) * wire_nbytes(input_)``.
``reduce_scatter(codec, output, input_, group, op)``
    ``input_`` (``[N * d0, ...]``) is cut into ``N`` chunks along dim 0; chunk ``r`` of every rank
    is encoded (as fp32) and sent to rank ``r`` (all-to-all); each rank decodes the ``N`` chunks
    it received, sums them in fp32 (``AVG``: then divides by ``N``) and writes ``output``
    (``[d0, ...]``, any dtype; it may alias this rank's chunk of ``input_``).
    Wire per rank: ``(N - 1) * wire_nbytes(chunk)``.
``all_reduce(codec, tensor, group, op)``
    A reduce-scatter of ``tensor`` cut into ``N`` chunks, then the fp32 sums are encoded again and
    all-gathered (AGoQ's QuanGrad; TACO's compressed reduce-scatter + all-gather); ``tensor`` is
    overwritten with the result. Chunks: a tensor of two or more dims is viewed as rows of its
    last dim (codec groups stay inside rows), rows zero-padded to a multiple of ``N``; a 1-D
    tensor is cut into ``N`` pieces of a multiple of ``CHUNK_ALIGN`` elements (zero-padded).
    Wire per rank: ``2 * (N - 1) * wire_nbytes(chunk)``.

Each takes ``wait`` (optional): ``wait(work, what)`` waits for each collective it posts (``async_op=True``), the
place's bounded wait (``bounded.collective_wait``); without it the collectives block as the process group does.
Each returns a :class:`Traffic`: bytes this rank sent to other ranks (``wire_nbytes``), what the
same exchange would carry in the tensor's own dtype (``raw_nbytes``), and the codec time.
``op`` is ``SUM`` or ``AVG``; the callers (``tensor_parallel``, ``data_parallel``) hand anything
else, and tensors a codec cannot take, to megatron-core's own collective (see ``compressible``).
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from ..codecs.core import timing
from ..codecs.core.base import Codec
from ..codecs.core.errors import SUPPORTED_DTYPES, CodecError

CHUNK_ALIGN = 1024  # a 1-D chunk's length is a multiple of this (whole codec groups of up to 1024)


@dataclasses.dataclass
class Traffic:
    raw_nbytes: int = 0
    wire_nbytes: int = 0
    encode_seconds: float = 0.0  # or a pending sum of CUDA-event intervals (codecs.core.timing)
    decode_seconds: float = 0.0


class Done:
    """The handle a compressed collective returns for ``async_op=True``: it has already completed."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def check_codec(codec: Codec) -> Codec:
    """A codec for collectives must be stateless: every rank decodes what it is sent, in any order."""
    if codec.needs_sample_ids or codec.stateful:
        raise CodecError(f"{codec.describe()} keeps state between messages; collectives need a stateless codec")
    return codec


def compressible(tensor: torch.Tensor, op=None) -> bool:
    """Whether the compressed path takes ``tensor`` (a codec dtype, not empty) and ``op`` (SUM/AVG/None)."""
    ops = (None, torch.distributed.ReduceOp.SUM, torch.distributed.ReduceOp.AVG)
    return tensor.dtype in SUPPORTED_DTYPES and tensor.numel() > 0 and any(op == o for o in ops)


def _group_size_rank(group) -> tuple[int, int]:
    dist = torch.distributed
    return dist.get_world_size(group), dist.get_rank(group)


def _encode(codec: Codec, x: torch.Tensor, traffic: Traffic) -> torch.Tensor:
    clock = timing.Stopwatch(x.device)
    buf = codec.encode(x)
    traffic.encode_seconds = timing.add(traffic.encode_seconds, clock.stop())
    return buf


def _decode(codec: Codec, buf: torch.Tensor, shape, dtype, traffic: Traffic, out=None) -> torch.Tensor:
    clock = timing.Stopwatch(buf.device)
    result = codec.decode(buf, shape, dtype, out=out)
    traffic.decode_seconds = timing.add(traffic.decode_seconds, clock.stop())
    return result


def _posted(post, wait, what: str) -> None:
    """``post(async_op)``, waited through ``wait`` when given (else blocking)."""
    if wait is None:
        post(False)
    else:
        wait(post(True), what)


def _gather_buffers(buf: torch.Tensor, size: int, group, wait=None) -> list[torch.Tensor]:
    gathered = torch.empty(size * buf.numel(), dtype=torch.uint8, device=buf.device)
    parts = list(gathered.chunk(size))
    _posted(lambda a: torch.distributed.all_gather(parts, buf, group=group, async_op=a), wait, "all-gather")
    return parts


def all_gather(codec: Codec, output: torch.Tensor, input_: torch.Tensor, group=None, wait=None) -> Traffic:
    """``output = cat([decode(encode(input_ of rank r)) for r in ranks], dim=0)`` (see the module docstring)."""
    size, _ = _group_size_rank(group)
    if output.shape[0] != size * input_.shape[0] or output.shape[1:] != input_.shape[1:]:
        raise ValueError(f"all_gather: output {tuple(output.shape)} is not {size} x input {tuple(input_.shape)}")
    traffic = Traffic()
    with torch.no_grad():
        buf = _encode(codec, input_.detach().contiguous(), traffic)
        parts = _gather_buffers(buf, size, group, wait)
        for r, (part, out) in enumerate(zip(parts, output.chunk(size))):
            if out.is_contiguous():
                _decode(codec, part, input_.shape, input_.dtype, traffic, out=out)
            else:
                out.copy_(_decode(codec, part, input_.shape, input_.dtype, traffic))
    traffic.wire_nbytes = (size - 1) * buf.numel()
    traffic.raw_nbytes = (size - 1) * input_.numel() * input_.element_size()
    return traffic


def _sum_of_chunks(codec: Codec, chunks: list[torch.Tensor], group, op, traffic: Traffic, wait=None) -> torch.Tensor:
    """All-to-all of ``chunks`` (one per rank, equal shapes) as fp32 codec buffers; the fp32 sum of what arrives."""
    size = len(chunks)
    shape = tuple(chunks[0].shape)
    send = torch.cat([_encode(codec, c.detach().float().contiguous(), traffic) for c in chunks])
    recv = torch.empty_like(send)
    _posted(lambda a: torch.distributed.all_to_all_single(recv, send, group=group, async_op=a), wait, "all-to-all")
    total = None
    for part in recv.chunk(size):  # rank order: the same additions on every rank
        value = _decode(codec, part, shape, torch.float32, traffic)
        total = value if total is None else total.add_(value)
    if op == torch.distributed.ReduceOp.AVG:
        total.div_(size)
    traffic.wire_nbytes += (size - 1) * (send.numel() // size)
    return total


def reduce_scatter(codec: Codec, output: torch.Tensor, input_: torch.Tensor, group=None,
                   op=torch.distributed.ReduceOp.SUM, wait=None) -> Traffic:
    """``output`` = the fp32 sum over ranks of their chunk ``rank`` of ``input_`` (see the module docstring)."""
    size, rank = _group_size_rank(group)
    if input_.shape[0] != size * output.shape[0] or input_.shape[1:] != output.shape[1:]:
        raise ValueError(f"reduce_scatter: input {tuple(input_.shape)} is not {size} x output {tuple(output.shape)}")
    traffic = Traffic()
    with torch.no_grad():
        total = _sum_of_chunks(codec, list(input_.chunk(size)), group, op, traffic, wait)
        output.copy_(total.view(output.shape))
    traffic.raw_nbytes = (size - 1) * output.numel() * input_.element_size()
    return traffic


def _chunked(tensor: torch.Tensor, size: int) -> torch.Tensor:
    """``tensor`` as ``[size, ...]`` chunks (rows of the last dim, or 1-D pieces), zero-padded."""
    if tensor.dim() >= 2:
        rows = tensor.reshape(-1, tensor.shape[-1])
        per_rank = math.ceil(rows.shape[0] / size)
        padded = rows.new_zeros(size * per_rank, rows.shape[-1])
        padded[: rows.shape[0]] = rows
        return padded.view(size, per_rank, rows.shape[-1])
    per_rank = math.ceil(tensor.numel() / (size * CHUNK_ALIGN)) * CHUNK_ALIGN
    padded = tensor.new_zeros(size * per_rank)
    padded[: tensor.numel()] = tensor
    return padded.view(size, per_rank)


def all_reduce(codec: Codec, tensor: torch.Tensor, group=None, op=torch.distributed.ReduceOp.SUM,
               wait=None) -> Traffic:
    """Reduce ``tensor`` in place over ``group``: compressed reduce-scatter, then compressed all-gather."""
    size, _ = _group_size_rank(group)
    traffic = Traffic()
    with torch.no_grad():
        chunks = _chunked(tensor.detach(), size)
        mine = _sum_of_chunks(codec, list(chunks.unbind(0)), group, op, traffic, wait)
        buf = _encode(codec, mine, traffic)
        parts = _gather_buffers(buf, size, group, wait)
        for part, out in zip(parts, chunks.unbind(0)):
            out.copy_(_decode(codec, part, mine.shape, torch.float32, traffic))
        tensor.copy_(chunks.reshape(-1)[: tensor.numel()].view(tensor.shape))
    traffic.wire_nbytes += (size - 1) * buf.numel()
    traffic.raw_nbytes = 2 * (size - 1) * chunks[0].numel() * tensor.element_size()
    return traffic
