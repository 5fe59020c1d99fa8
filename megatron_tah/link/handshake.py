"""The pipeline's configuration check: neighbouring stages must use the same codecs.

``check_group(config, group, device)`` all-gathers every stage's ``config_record`` over the
pipeline ``group`` -- a JSON text of at most ``HANDSHAKE_NBYTES`` bytes, zero-padded, per rank:
``{"forward": [config digest, description], "backward": [...]}`` -- and raises
:class:`CodecMismatchError` on every stage whose previous or next stage's digest differs in either
direction, naming both stages and both configurations. The digest covers the codec's settings and
what changes the traffic of a whole run (``--tah-warmup-iters``, ``--tah-eval-traffic``,
``--tah-eval-forward-bits``, ``--tah-wire-checksum``, ``--tah-entropy-coding`` with its coder and the coder's library
version; forward, ``--tah-boundary-bits``); a direction set to ``auto`` is recorded as its
candidates' names and digests (both ends must hold the same decoders and carry the announcement trailer,
``wire.py``).
``check_schedule`` refuses AQ-SGD under the interleaved (virtual pipeline) schedule (the caller says how
many virtual stages there are: the link reads nothing of Megatron).
``link_latency`` (auto only) times a few 8-byte round trips with each neighbouring stage.

Both wait through ``wait(work, peer, receiving, what)`` (``Wait``: the transport's peer watch, ``peer.py``), so a
neighbour that never reaches its first call, or dies in the handshake, ends in a ``LinkError`` naming the link.
"""

from __future__ import annotations

import json
import time
from typing import Callable

import torch

from ..codecs.core import entropy
from ..codecs.core.header import crc32_of
from ..config import TahConfig
from .peer import posted
from .wire import wait_completed

HANDSHAKE_NBYTES = 1024
# (work, the peer's world rank, whether this rank receives from it, what it carries): a bounded wait
Wait = Callable[[object, int, bool, str], None]


class CodecMismatchError(RuntimeError):
    """Two neighbouring pipeline stages were configured with different codecs."""


def config_record(cfg: TahConfig) -> dict:
    """``{direction: [digest, description]}``: what neighbouring stages must agree on."""
    warmup, evals, checksum = cfg.tah_warmup_iters, cfg.tah_eval_traffic, cfg.tah_wire_checksum
    coded, eval_bits = cfg.tah_entropy_coding, cfg.tah_eval_forward_bits
    coder = entropy.coder_identity(cfg.tah_entropy_coder) if coded else ""
    # The warm-up, the evaluations' traffic and bits, the payload checksum and the entropy coding change what is
    # sent (the codec's config digest leaves them out): part of both directions' record.
    modes = "".join([f"/warmup={warmup}" if warmup else "", f"/eval={evals}" if evals != "codec" else "",
                     f"/eval_bits={eval_bits}" if eval_bits is not None else "",
                     "/checksum" if checksum else "", f"/entropy={coder}" if coded else ""])
    suffix = "".join([f", first {warmup} iterations uncompressed" if warmup else "",
                      {"codec": "", "uncompressed": ", evaluations uncompressed",
                       "both": ", evaluations through the codec and uncompressed"}[evals],
                      f", evaluations at {eval_bits} bits forward" if eval_bits is not None else "",
                      ", payload checksum" if checksum else "", f", entropy-coded by {coder}" if coded else ""])
    per_boundary = cfg.boundary_bits()
    record = {}
    for direction in ("forward", "backward"):
        if cfg.is_auto(direction):
            names = cfg.auto_settings().candidates
            identity = ",".join(f"{n}={cfg.auto_candidate_codec(n, direction).config_digest()}" for n in names)
            digest, text = crc32_of(f"auto:{identity}"), f"auto({', '.join(names)})"
        else:
            codec = cfg.forward_codec() if direction == "forward" else cfg.backward_codec()
            digest, text = codec.config_digest(), codec.describe()
            if direction == "forward" and per_boundary:  # each link's bits follow from the list: both ends hold it
                digest = crc32_of(f"{digest}/boundary_bits={','.join(map(str, per_boundary))}")
                text += f", bits per boundary {','.join(map(str, per_boundary))}"
        record[direction] = [crc32_of(f"{digest}{modes}") if modes else digest, text + suffix]
    return record


def check_group(config: TahConfig, group, device: torch.device, wait: Wait) -> None:
    """All-gather every stage's codec configs over ``group``; raise on a neighbour that differs.
    A collective: every rank of ``group`` calls it (each on its first transport call on the group); waited as a
    receive from the previous stage."""
    dist = torch.distributed
    mine = config_record(config)
    raw = json.dumps(mine).encode()[:HANDSHAKE_NBYTES]
    record = torch.zeros(HANDSHAKE_NBYTES, dtype=torch.uint8)
    record[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    gathered = [torch.empty_like(record, device=device) for _ in range(group.size())]
    work = posted(lambda: dist.all_gather(gathered, record.to(device), group=group, async_op=True))
    wait(work, dist.get_global_rank(group, (group.rank() - 1) % group.size()), True, "codec configurations")
    records = []
    for buf in gathered:
        text = bytes(buf.cpu().tolist()).rstrip(b"\0").decode(errors="replace")
        try:
            records.append(json.loads(text))
        except json.JSONDecodeError:
            records.append({"forward": [None, text], "backward": [None, text]})
    me, size = group.rank(), group.size()
    for neighbour, where in (((me - 1) % size, "previous"), ((me + 1) % size, "next")):
        for direction in ("forward", "backward"):
            theirs = records[neighbour][direction]
            if theirs[0] != mine[direction][0]:
                raise CodecMismatchError(
                    f"megatron_tah: pipeline stage {me} (world rank {dist.get_rank()}) and its {where} stage "
                    f"{neighbour} (world rank {dist.get_global_rank(group, neighbour)}) use different "
                    f"{direction} codecs: this stage {mine[direction][1]}, stage {neighbour} {theirs[1]}. "
                    f"Pass the same --tah-* flags (TahConfig) to every pipeline stage."
                )


def check_schedule(config: TahConfig, group, send_next, recv_prev, virtual_stages: int | None = None) -> None:
    """Raise when the forward codec needs sample ids (aqsgd) and the schedule is interleaved
    (``virtual_stages`` > 1 virtual pipeline stages, or a message that wraps from the last stage to the first)."""
    if not config.forward_codec().needs_sample_ids:
        return
    vpp = virtual_stages
    wraps = (send_next is not None and group.rank() == group.size() - 1) or (
        recv_prev is not None and group.rank() == 0)
    if (vpp is not None and vpp > 1) or wraps:
        raise RuntimeError("megatron_tah: the aqsgd forward codec is not supported with the interleaved "
                           "(virtual pipeline) schedule; use tah, fixedpoint or fp8, or the 1F1B schedule")


def link_latency(group, device: torch.device, wait: Wait, rounds: int = 5) -> dict[int, float]:
    """One-way latency to each neighbouring stage, ``{world rank: seconds}``: half the fastest of
    ``rounds`` round trips of an 8-byte message (what a message costs whatever its size: propagation and
    the backend's own overhead; ``auto`` subtracts it from transits to get the rate). A collective over
    ``group``: the pairs (i, i + 1 mod size) go in order of i, each timed by its lower stage and told to
    the other, so no rank waits on one that waits on it. A round trip ends when the reply's receive is
    complete (``wire.wait_completed``: on NCCL a ``wait()`` returns once the transfer is queued)."""
    what = "latency probes"
    dist = torch.distributed
    me, size = group.rank(), group.size()
    if size < 2:
        return {}
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    elif device.type == "cuda":
        device = torch.device("cpu")  # gloo sends host tensors
    ping = torch.zeros(1, dtype=torch.float64, device=device)
    latency = {}
    for i in range(size if size > 2 else 1):
        first, second = i, (i + 1) % size
        if me not in (first, second):
            continue
        peer = dist.get_global_rank(group, second if me == first else first)
        if me == first:
            best, pong = float("inf"), torch.zeros_like(ping)
            for _ in range(rounds):
                start = time.perf_counter()
                sent = posted(lambda: dist.isend(ping, peer, group=group))
                reply = posted(lambda: dist.irecv(pong, peer, group=group))
                # the reply is here: the round trip is over (not merely queued, on NCCL)
                wait_completed(reply, lambda work: wait(work, peer, True, what))
                best = min(best, time.perf_counter() - start)
                wait(sent, peer, False, what)
            ping.fill_(best / 2)
            wait(posted(lambda: dist.isend(ping, peer, group=group)), peer, False, what)
        else:
            for _ in range(rounds):
                wait(posted(lambda: dist.irecv(ping, peer, group=group)), peer, True, what)
                wait(posted(lambda: dist.isend(ping, peer, group=group)), peer, False, what)
            wait(posted(lambda: dist.irecv(ping, peer, group=group)), peer, True, what)
        latency[peer] = float(ping.item())
    return latency
