"""The tied word-embedding gradient between the first and last pipeline stages through a codec:
``--tah-embedding-codec int8``.

With tied embeddings (Megatron's default) the first stage holds the word embedding and the last stage a
copy of it as its output layer; after every backward pass megatron-core all-reduces the two gradients
over the embedding group (``finalize_model_grads._allreduce_word_embedding_grads``) so that both copies
take the same step: ``vocabulary x hidden`` elements each way, uncompressed, every iteration.
``install(place)`` replaces that function (looked up by name inside ``finalize_model_grads``) with an
exchange of two different messages:

* **first stage -> last stage, exact**: the embedding's gradient is non-zero only in the rows of tokens
  present in the batch. It sends those rows -- every row with a non-zero bit, so ``-0.0`` and NaN rows
  go too -- and their indices (``encode_rows``): a 32-byte header (int64: ``ROWS_MAGIC``, rows sent ``k``,
  vocabulary, hidden), then one buffer of the indices (int32, padded to 8 bytes) and the rows in the
  gradient's own dtype. Nothing is rounded: ``decode_rows`` gives back those rows bit for bit, and every
  other row is zero.
* **last stage -> first stage, through the codec**: the output layer's gradient is dense (every
  vocabulary row gets the softmax's gradient); it goes as ``codec.encode`` of it in fp32 (``int8``:
  blockwise 8-bit with an fp32 scale per block, 8.25 bits per element at the default block, the
  data-parallel place's format; ``wire_nbytes`` known to both ends).

Both ends then compute the same sum from the same bytes: ``total = codec.decode(dense bytes)`` in fp32,
``total[rows] = total[rows] + first stage's rows`` (in fp32), cast to the gradient's dtype. The last stage
decodes its own bytes rather than using its exact gradient, and the first stage's rows are exact on both
ends, so the two copies of the gradient -- and with them the two copies of the weight, which take the same
optimizer step -- stay identical bit for bit. The lossy part is the output layer's contribution only
(``tah emb rel err`` in the log: its sampled round-trip error).

On a gloo group with CUDA tensors the buffers go through host memory (gloo sends host tensors). Every transfer
is waited through the pipeline's peer watch (``link/peer.py``): bounded by ``--tah-peer-timeout-s`` (plus
``--tah-peer-start-up-s`` until the other end has been heard from), and a silent or dead end raises
``PeerTimeoutError`` / ``PeerLostError`` naming
the link between the first and the last stage and the iteration.

Falls back to megatron-core's own all-reduce (one log line) when the embedding group does not hold
exactly the first and the last stage (multi-token prediction), with Megatron-FSDP, or for a sharded
(DTensor) gradient. With untied embeddings (``--untie-embeddings-and-output-weights``) or a single
pipeline stage there is no such all-reduce: ``check_embedding_codec`` (the place's ``check_args``) makes the
flag an error in Megatron's argument validation; installed outside it, the place has nothing to replace a
call of and sends nothing.

``tied_embedding_warning(config, args)``: the one start-up line of a run with a pipeline codec, tied
embeddings and no embedding codec (the place's ``startup``, printed by the plugin).

Statistics: stream ``embedding`` (``tah emb`` in the log: bytes this rank sent, against the all-reduce's
``vocabulary x hidden x element size``); the WAN ledger counts the bytes as the embedding group's codec bytes.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from ..codecs import Codec, CodecError
from ..codecs.core import timing
from ..codecs.core.errors import SUPPORTED_DTYPES
from ..config import TahConfig
from ..link.peer import PeerWatch, posted
from . import collectives
from .collectives import Traffic
from .patching import resolve
from .place_spec import PlaceSpec
from .stats import Stream

logger = logging.getLogger(__name__)

NAME = "embedding"
FINALIZE = "megatron.core.distributed.finalize_model_grads"
ROWS_MAGIC = 0x31574F52_48414D54  # b"TMAHROW1" read as a little-endian int64
HEADER_ELEMENTS = 4  # int64: magic, rows sent, vocabulary, hidden
INDEX_DTYPE = torch.int32


# ----- the first stage's rows (exact) ----------------------------------------------------------------
def nonzero_rows(grad: torch.Tensor) -> torch.Tensor:
    """Indices (int64, ascending) of the rows of a 2-D ``grad`` holding any non-zero bit."""
    if grad.dim() != 2:
        raise ValueError(f"nonzero_rows: a 2-D gradient, got shape {tuple(grad.shape)}")
    bits = grad.contiguous().view(torch.uint8).view(grad.shape[0], -1)
    return bits.ne(0).any(dim=1).nonzero().squeeze(1)


def _index_nbytes(k: int) -> int:
    return (k * INDEX_DTYPE.itemsize + 7) // 8 * 8


def rows_nbytes(k: int, hidden: int, dtype: torch.dtype) -> int:
    """Bytes of the rows buffer for ``k`` rows of ``hidden`` elements of ``dtype`` (the header aside)."""
    return _index_nbytes(k) + k * hidden * dtype.itemsize


def encode_rows(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(header int64[4], rows buffer uint8) of the non-zero rows of a 2-D ``grad`` (module docstring)."""
    if grad.dim() != 2:
        raise ValueError(f"encode_rows: a 2-D gradient, got shape {tuple(grad.shape)}")
    index = nonzero_rows(grad)
    k, (vocab, hidden) = index.numel(), grad.shape
    header = torch.tensor([ROWS_MAGIC, k, vocab, hidden], dtype=torch.int64, device=grad.device)
    buf = torch.zeros(rows_nbytes(k, hidden, grad.dtype), dtype=torch.uint8, device=grad.device)
    buf[: k * INDEX_DTYPE.itemsize].copy_(index.to(INDEX_DTYPE).view(torch.uint8))
    buf[_index_nbytes(k):].copy_(grad.index_select(0, index).contiguous().view(torch.uint8).view(-1))
    return header, buf


def rows_expected(header: torch.Tensor, shape: tuple[int, int]) -> int:
    """The rows ``k`` a received header announces; ``CodecError`` naming what differs from ``shape``."""
    values = header.tolist()
    if len(values) != HEADER_ELEMENTS or values[0] != ROWS_MAGIC:
        raise CodecError(f"embedding rows: not a rows header ({values}); both stages must run "
                         "--tah-embedding-codec with the same megatron_tah")
    k, vocab, hidden = values[1:]
    if (vocab, hidden) != tuple(shape) or not 0 <= k <= vocab:
        raise CodecError(f"embedding rows: the first stage sent {k} rows of a {vocab} x {hidden} gradient, "
                         f"this stage's is {shape[0]} x {shape[1]}")
    return k


def decode_rows(buf: torch.Tensor, k: int, hidden: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices int64, rows ``[k, hidden]`` of ``dtype``) of a rows buffer, bit for bit what was encoded."""
    if buf.numel() != rows_nbytes(k, hidden, dtype):
        raise CodecError(f"embedding rows: {buf.numel()} bytes for {k} rows of {hidden} x {dtype}, "
                         f"expected {rows_nbytes(k, hidden, dtype)}")
    index = buf[: k * INDEX_DTYPE.itemsize].view(INDEX_DTYPE).to(torch.int64)
    rows = buf[_index_nbytes(k):].view(dtype).view(k, hidden)
    return index, rows


def combine(dense: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``dense`` (fp32, the decoded dense gradient) plus the exact ``rows`` at ``index``, in fp32, in place."""
    dense[index] = dense[index] + rows.float()
    return dense


# ----- the exchange --------------------------------------------------------------------------------
def _wire_device(group, device: torch.device) -> torch.device:
    """Where buffers travel: host memory on gloo (it sends host tensors), else the gradient's device."""
    return torch.device("cpu") if torch.distributed.get_backend(group) == "gloo" else device


def exchange(codec, grad: torch.Tensor, group, peer: int, first: bool,
             wait: Callable[[object, bool, str], None]) -> tuple[torch.Tensor, Traffic]:
    """The sum of the first stage's exact rows and the last stage's gradient through ``codec``, in fp32,
    the same bits on both ends; ``first``: this rank is the first stage (``peer``: the other end's global
    rank); ``wait(work, receiving, what)``: a bounded wait of one transfer. Returns the sum and this rank's
    ``Traffic``."""
    dist = torch.distributed
    shape, device = tuple(grad.shape), grad.device
    wire = _wire_device(group, device)
    traffic = Traffic(raw_nbytes=grad.numel() * grad.element_size())
    dense_nbytes = codec.wire_nbytes(shape, torch.float32)
    clock = timing.Stopwatch(device)
    if first:
        header, rows_buf = encode_rows(grad)
        traffic.encode_seconds = clock.stop()
        dense = torch.empty(dense_nbytes, dtype=torch.uint8, device=wire)
        works = [posted(lambda: dist.isend(header.to(wire), peer, group=group)),
                 posted(lambda: dist.isend(rows_buf.to(wire), peer, group=group)),
                 posted(lambda: dist.irecv(dense, peer, group=group))]
        for work, receiving, what in zip(works, (False, False, True), ("rows", "rows", "dense gradient")):
            wait(work, receiving, f"embedding gradient {what}")
        traffic.wire_nbytes = header.numel() * header.element_size() + rows_buf.numel()
        k = int(header[1])
        index, rows = decode_rows(rows_buf, k, shape[1], grad.dtype)
        dense = dense.to(device)
    else:
        dense = codec.encode(grad.detach().float().contiguous())
        traffic.encode_seconds = clock.stop()
        work = posted(lambda: dist.isend(dense.to(wire), peer, group=group))
        header = torch.empty(HEADER_ELEMENTS, dtype=torch.int64, device=wire)
        wait(posted(lambda: dist.irecv(header, peer, group=group)), True, "embedding gradient rows")
        k = rows_expected(header, shape)
        rows_buf = torch.empty(rows_nbytes(k, shape[1], grad.dtype), dtype=torch.uint8, device=wire)
        wait(posted(lambda: dist.irecv(rows_buf, peer, group=group)), True, "embedding gradient rows")
        wait(work, False, "embedding gradient dense gradient")
        traffic.wire_nbytes = dense.numel()
        index, rows = decode_rows(rows_buf.to(device), k, shape[1], grad.dtype)
    clock = timing.Stopwatch(device)
    total = combine(codec.decode(dense, shape, torch.float32), index, rows)
    traffic.decode_seconds = clock.stop()
    return total, traffic


# ----- the place -------------------------------------------------------------------------------------
def _fall_back(place, reason: str) -> None:
    if reason not in place.state.setdefault("fallbacks", set()):
        place.state["fallbacks"].add(reason)
        logger.warning("megatron_tah: --tah-embedding-codec: %s; megatron-core's own all-reduce carries the "
                       "tied embedding's gradient, uncompressed", reason)


def _watched(place, group, pp_group, peer: int, first: bool):
    """``exchange``'s wait: through the pipeline transport's peer watch (a watch of the place's own without one),
    naming the link between the first and the last stage and Megatron's iteration."""
    from megatron.core import parallel_state

    from .pipeline_parallel import installed_transport, megatron_iteration

    dist = torch.distributed
    transport = installed_transport()
    watch = transport.peers if transport is not None else place.state.setdefault(
        "watch", PeerWatch(place.config.tah_peer_timeout_s, start_up_s=place.config.tah_peer_start_up_s))
    stages = (dist.get_world_size(pp_group) if pp_group is not None
              else parallel_state.get_pipeline_model_parallel_world_size())
    mine, theirs = (0, stages - 1) if first else (stages - 1, 0)
    me, bounded = dist.get_rank(), dist.get_backend(group) == "gloo"  # (NCCL: the group's timeout, link/peer.py)

    def wait(work, receiving: bool, what: str) -> None:
        link, ranks = ((theirs, mine), (peer, me)) if receiving else ((mine, theirs), (me, peer))
        watch.wait(work, peer=peer, stages=link, ranks=ranks, receiving=receiving, what=what,
                   iteration=megatron_iteration(), bounded=bounded)

    return wait


def _tied_gradient(place, model, config, embd_group, pp_group):
    """(weight, grad attribute, first stage?, peer) of the tied embedding this rank reduces; None: nothing to
    reduce here; "fallback": megatron-core's own all-reduce must do it."""
    dist = torch.distributed
    finalize = resolve(FINALIZE)
    if finalize.get_pg_size(embd_group) <= 1 or dist.get_rank() not in dist.get_process_group_ranks(embd_group):
        return None
    ranks = dist.get_process_group_ranks(embd_group)
    if len(ranks) != 2:
        _fall_back(place, f"the embedding group holds {len(ranks)} ranks, not the first and last stage")
        return "fallback"
    if finalize.is_pp_first_stage(pp_group):
        first, module = True, model[0]
    elif finalize.is_pp_last_stage(pp_group):
        first, module = False, model[-1]
    else:
        _fall_back(place, "a stage between the first and the last holds the embedding (multi-token prediction)")
        return "fallback"
    if module.ddp_config.use_megatron_fsdp:
        _fall_back(place, "Megatron-FSDP shards the gradient")
        return "fallback"
    module = finalize.get_attr_wrapped_model(module, "pre_process", return_model_obj=True)
    weight = finalize._get_shared_word_embedding_weight(module, config)
    if weight is None:
        return None
    attribute = finalize._get_main_grad_attr(weight)
    grad = getattr(weight, attribute)
    if grad is None:
        return None
    if type(grad) is not torch.Tensor or grad.dim() != 2 or grad.dtype not in SUPPORTED_DTYPES:
        _fall_back(place, f"a {type(grad).__name__} gradient of shape {tuple(grad.shape)}, {grad.dtype}")
        return "fallback"
    peer = ranks[1] if ranks[0] == dist.get_rank() else ranks[0]
    return weight, attribute, first, peer


def _compressing(place):
    def make(original):
        def _allreduce_word_embedding_grads(model, config, embd_group=None, pp_group=None):
            from megatron.core import parallel_state

            group, pipeline = embd_group, pp_group
            if group is None:
                group = parallel_state.get_embedding_group(check_initialized=False)
                if pipeline is None:
                    pipeline = parallel_state.get_pipeline_model_parallel_group()
            if group is None:
                return original(model, config, embd_group, pp_group)
            found = _tied_gradient(place, model, config, group, pipeline)
            if found == "fallback":
                return original(model, config, embd_group, pp_group)
            if found is None:
                return None
            weight, attribute, first, peer = found
            grad = getattr(weight, attribute)
            rel_error = None if first else place.measure("backward", grad)
            wait = _watched(place, group, pipeline, peer, first)
            with place.stats.codec_traffic():
                total, traffic = exchange(place.codec, grad, group, peer, first, wait)
            with torch.no_grad():
                grad.copy_(total)
            place.record("backward", traffic, rel_error)
            return None

        return _allreduce_word_embedding_grads

    return make


def install(place) -> None:
    """Send the tied word-embedding gradient as the first stage's exact rows and the last stage's ``place.codec``."""
    collectives.check_codec(place.codec)
    place.patches.wrap(FINALIZE, "_allreduce_word_embedding_grads", _compressing(place),
                       why="the tied embedding gradient as exact rows and int8 instead of a dense all-reduce")


# ----- its codec, checks and start-up line --------------------------------------------------------
def codec(config: TahConfig) -> Codec | None:
    """The codec of the last stage's output-layer gradient, 8-bit in blocks of ``tah_int8_block_size`` (None:
    megatron-core's all-reduce is left alone)."""
    if config.tah_embedding_codec == "none":
        return None
    return config.build_codec(config.tah_embedding_codec, 8, config.tah_int8_block_size)


def check_embedding_codec(config: TahConfig, args) -> None:
    """``ValueError`` when ``--tah-embedding-codec`` is on but Megatron's arguments leave nothing to compress."""
    if config.tah_embedding_codec == "none":
        return
    given = f"--tah-embedding-codec {config.tah_embedding_codec}"
    if getattr(args, "pipeline_model_parallel_size", 1) < 2:
        raise ValueError(f"megatron_tah: {given} compresses the tied word-embedding gradient between the first "
                         "and the last pipeline stage; with one stage nothing crosses (drop the flag)")
    if getattr(args, "untie_embeddings_and_output_weights", False):
        raise ValueError(f"megatron_tah: {given} with --untie-embeddings-and-output-weights: untied embeddings "
                         "have no gradient all-reduce between the stages (drop one of the two flags)")


def _gradient_element_size(args) -> int:
    """Bytes per element of Megatron's main gradients (fp32 unless bf16/fp16 parameters reduce in their dtype)."""
    low = getattr(args, "bf16", False) or getattr(args, "fp16", False)
    return 2 if low and not getattr(args, "accumulate_allreduce_grads_in_fp32", False) else 4


def tied_embedding_warning(config: TahConfig, args) -> str | None:
    """The start-up line of a run with a pipeline codec, tied embeddings and no embedding codec: the bytes the
    embedding all-reduce sends uncompressed per iteration, and the two remedies. None otherwise."""
    if (getattr(args, "pipeline_model_parallel_size", 1) < 2 or getattr(args, "untie_embeddings_and_output_weights", False)
            or config.tah_embedding_codec != "none"
            or (config.tah_forward_codec == "none" and config.tah_backward_codec == "none")):
        return None
    remedy = ("compress it with --tah-embedding-codec int8 or untie with --untie-embeddings-and-output-weights")
    vocab = getattr(args, "padded_vocab_size", None) or getattr(args, "vocab_size", None)
    if vocab is None:  # (the tokenizer sets it later: the size is not known yet)
        return ("> megatron_tah: warning: tied embeddings: every iteration all-reduces the word-embedding gradient "
                f"between the first and the last stage uncompressed, beside the compressed pipeline; {remedy}")
    each = vocab * args.hidden_size * _gradient_element_size(args)
    return (f"> megatron_tah: warning: tied embeddings: every iteration all-reduces the {vocab} x {args.hidden_size} "
            f"word-embedding gradient between the first and the last stage uncompressed, {2 * each / 1e6:.1f} MB "
            f"per iteration ({each / 1e6:.1f} MB each way) beside the compressed pipeline; {remedy}")


def startup(config: TahConfig, args) -> list[str]:
    """The start-up lines: ``tied_embedding_warning``'s, if any."""
    warning = tied_embedding_warning(config, args)
    return [warning] if warning else []


PLACE = PlaceSpec(
    name=NAME, option="tah_embedding_codec", install=install, codec=codec,
    streams=(Stream("embedding", NAME, "backward", "emb"),),
    settings=lambda config: codec(config).describe(),
    check_args=check_embedding_codec, startup=startup,
)
