"""Compressing pipeline transports for megatron-core, and ``install`` / ``uninstall``.

``install(config)`` replaces ``megatron.core.pipeline_parallel.p2p_communication``'s
``_batched_p2p_ops`` and ``_p2p_ops`` (looked up at call time by
``P2PCommunicator._communicate``). The replacements keep Megatron's calling contract
and message pattern -- one message per direction per call, same peers, same process
groups, same posting order -- but each message is a codec's uint8 buffer:

* ``send_next`` / ``recv_prev`` carry activations through the *forward* codec,
  ``send_prev`` / ``recv_next`` activation gradients through the *backward* codec;
  codec objects are per link end (peer, role) and direction (AQ-SGD keeps state).
* Receives post ``codec.wire_nbytes(recv.shape, recv.dtype)`` bytes and decode into
  Megatron's own receive tensor under ``no_grad`` once complete. The batched path waits
  and decodes before returning ``[]``; the unbatched path returns handles whose
  ``.wait()`` waits, then decodes (send handles keep their buffer alive).
* Configuration check: the first transport call on a process group all-gathers every
  stage's codec configs over that group (each stage reaches its first p2p call without
  waiting on another stage, so this cannot deadlock) and raises
  ``CodecMismatchError`` on every stage whose neighbour uses other codecs -- on the
  receiver and on the sender, instead of a hang or a gloo size mismatch.
* AQ-SGD: sample ids travel in the codec's buffer. The first stage's forward step calls
  ``push_sample_ids(ids)`` per micro-batch; an activation send pops the oldest ids, an
  activation receive pushes the ids it decoded (unless this is the last stage).
* Statistics go to ``megatron_tah.megatron.stats``; ``tah_emulate_bandwidth`` delays
  message completion (``megatron_tah.megatron.emulate``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib
import json
import logging
import time

import torch

from ..codecs import get_codec, timing
from ..codecs.base import crc32_of
from ..config import TahConfig
from . import places, stats
from .emulate import LinkEmulator

logger = logging.getLogger(__name__)

P2P_MODULE = "megatron.core.pipeline_parallel.p2p_communication"
TRANSPORTS = ("_batched_p2p_ops", "_p2p_ops")
_MARKER = "_megatron_tah_patched"
_HANDSHAKE_NBYTES = 1024


class CodecMismatchError(RuntimeError):
    """Two neighbouring pipeline stages were configured with different codecs."""


@dataclasses.dataclass
class _State:
    config: TahConfig
    emulator: LinkEmulator | None
    shims_applied: bool
    codecs: dict = dataclasses.field(default_factory=dict)  # (direction, role, peer) -> Codec
    checked_groups: set = dataclasses.field(default_factory=set)
    sends: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    restored: dict = dataclasses.field(default_factory=dict)  # codec states loaded before the codec exists

    eval_uncompressed: bool = False  # inside ``evaluation(uncompressed=True)``

    def codec(self, direction: str, role: str, peer: int):
        if self.config.tah_warmup_iters and _training_iteration() < self.config.tah_warmup_iters:
            return _UNCOMPRESSED
        if self.eval_uncompressed:
            return _UNCOMPRESSED
        key = (direction, role, int(peer))
        if key not in self.codecs:
            cfg = self.config
            codec = cfg.forward_codec() if direction == "forward" else cfg.backward_codec()
            if key in self.restored:
                codec.load_state_dict(self.restored.pop(key))
            # Only used after _check_group compared the link's configs: headers are checked on the device.
            self.codecs[key] = codec.defer_checks()
        return self.codecs[key]


_STATE: _State | None = None
_UNCOMPRESSED = get_codec("none").defer_checks()  # --tah-warmup-iters, and uncompressed evaluations


def _training_iteration() -> int:
    """Megatron's ``args.curr_iteration`` (set by ``train`` before each step and kept during evaluation;
    0 before the loop starts); the same on every stage, so both ends of a link switch together."""
    from megatron.training.global_vars import get_args

    try:
        args = get_args()
    except AssertionError:
        raise RuntimeError("megatron_tah: --tah-warmup-iters counts Megatron's training iterations and needs "
                           "its training loop (megatron.training's global args are not set)") from None
    return int(getattr(args, "curr_iteration", 0) or 0)
_SAMPLE_IDS: collections.deque = collections.deque()


# ----- AQ-SGD sample ids -----------------------------------------------------------------
def push_sample_ids(ids: torch.Tensor) -> None:
    """Queue the sample ids of the next micro-batch this rank will send (first stage: per forward step)."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1:
        raise ValueError(f"sample ids must be a 1-D LongTensor [micro_batch], got {ids!r}")
    _SAMPLE_IDS.append(ids.detach().to(torch.long))


def clear_sample_ids() -> None:
    _SAMPLE_IDS.clear()


def pending_sample_ids() -> int:
    return len(_SAMPLE_IDS)


def _pop_sample_ids(required: bool) -> torch.Tensor | None:
    if not _SAMPLE_IDS and not required:
        return None
    if not _SAMPLE_IDS:
        raise RuntimeError(
            "aqsgd needs the sample ids of every micro-batch: call "
            "megatron_tah.megatron.patch.push_sample_ids(ids) in the first stage's forward step"
        )
    return _SAMPLE_IDS.popleft()


# ----- configuration check (the handshake) -------------------------------------------------
def _config_record(cfg: TahConfig) -> dict:
    fwd, bwd = cfg.forward_codec(), cfg.backward_codec()
    warmup, evals = cfg.tah_warmup_iters, cfg.tah_eval_traffic
    # The warm-up and the evaluations' traffic change what is sent: part of both directions' record.
    modes = "".join([f"/warmup={warmup}" if warmup else "", f"/eval={evals}" if evals != "codec" else ""])
    suffix = "".join([f", first {warmup} iterations uncompressed" if warmup else "",
                      {"codec": "", "uncompressed": ", evaluations uncompressed",
                       "both": ", evaluations through the codec and uncompressed"}[evals]])
    return {d: [crc32_of(f"{c.config_digest()}{modes}") if modes else c.config_digest(), c.describe() + suffix]
            for d, c in (("forward", fwd), ("backward", bwd))}


def _check_group(state: _State, group, device: torch.device) -> None:
    """All-gather every stage's codec configs once per group; raise on a neighbour that differs."""
    dist = torch.distributed
    key = id(group)
    if key in state.checked_groups:
        return
    mine = _config_record(state.config)
    raw = json.dumps(mine).encode()[:_HANDSHAKE_NBYTES]
    record = torch.zeros(_HANDSHAKE_NBYTES, dtype=torch.uint8)
    record[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    gathered = [torch.empty_like(record, device=device) for _ in range(group.size())]
    dist.all_gather(gathered, record.to(device), group=group)
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
                    f"megatron_tah: pipeline stage {me} (global rank {dist.get_rank()}) and its {where} stage "
                    f"{neighbour} (global rank {dist.get_global_rank(group, neighbour)}) use different "
                    f"{direction} codecs: this stage {mine[direction][1]}, stage {neighbour} {theirs[1]}. "
                    f"Pass the same --tah-* flags (TahConfig) to every pipeline stage."
                )
    state.checked_groups.add(key)


def _check_schedule(state: _State, group, send_next, recv_prev) -> None:
    if not state.config.forward_codec().needs_sample_ids:
        return
    from megatron.core import parallel_state

    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    wraps = (send_next is not None and group.rank() == group.size() - 1) or (
        recv_prev is not None and group.rank() == 0)
    if (vpp is not None and vpp > 1) or wraps:
        raise RuntimeError("megatron_tah: the aqsgd forward codec is not supported with the interleaved "
                           "(virtual pipeline) schedule; use tah, fixedpoint or fp8, or the 1F1B schedule")


# ----- messages ----------------------------------------------------------------------------
def _encode(state: _State, direction: str, x: torch.Tensor, peer: int) -> torch.Tensor:
    """Encode one outgoing tensor and record its statistics."""
    codec = state.codec(direction, "send", peer)
    with torch.no_grad():
        x = x.detach()
        with_ids = codec.needs_sample_ids
        # An activation send consumes the oldest queued ids (other codecs ignore them), so the
        # queue stays bounded whatever codec runs; aqsgd needs them.
        ids = _pop_sample_ids(required=with_ids) if direction == "forward" else None
        clock = timing.Stopwatch(x.device)
        buf = codec.encode(x, sample_ids=ids) if with_ids else codec.encode(x)
        stats.record_codec_time(direction, encode_seconds=clock.stop())
        rel_error = None
        interval = state.config.tah_error_sample_interval
        if interval and not with_ids and codec is not _UNCOMPRESSED and state.sends[direction] % interval == 0:
            rel_error = timing.relative_error(x, codec.decode(buf, x.shape, x.dtype))
    state.sends[direction] += 1
    stats.record_send(direction, x.numel() * x.element_size(), buf.numel(), peer,
                      rel_error=rel_error, rotated_fraction=getattr(codec, "last_rotated", None))
    return buf


class _Message:
    """One posted send or receive; ``finish`` applies the emulated link and decodes a receive."""

    def __init__(self, state, direction, peer, send_tensor=None, recv_tensor=None, last_stage=False):
        self.state, self.direction, self.peer = state, direction, int(peer)
        self.target, self.last_stage = recv_tensor, last_stage
        if send_tensor is not None:
            self.buf = _encode(state, direction, send_tensor, peer)
        else:
            self.codec = state.codec(direction, "recv", peer)
            nbytes = self.codec.wire_nbytes(recv_tensor.shape, recv_tensor.dtype)
            self.buf = torch.empty(nbytes, dtype=torch.uint8, device=recv_tensor.device)
        self.work = None
        self.done = False
        self.completed_at = None

    @property
    def is_recv(self) -> bool:
        return self.target is not None

    def poll(self) -> None:
        if self.completed_at is None and self.work is not None and self.work.is_completed():
            self.completed_at = time.monotonic()

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        emulator = self.state.emulator
        if emulator is not None:
            me = torch.distributed.get_rank()
            link = (self.peer, me) if self.is_recv else (me, self.peer)
            emulator.complete(link, self.buf.numel(), self.completed_at, receiver=self.is_recv)
        if self.is_recv:
            clock = timing.Stopwatch(self.buf.device)
            with torch.no_grad():
                self.codec.decode(self.buf, self.target.shape, self.target.dtype, out=self.target)
            stats.record_codec_time(self.direction, decode_seconds=clock.stop())
            if self.codec.needs_sample_ids and self.direction == "forward" and not self.last_stage:
                push_sample_ids(self.codec.last_sample_ids)
        self.buf = None  # the transfer is complete: drop the wire buffer


class _Handle:
    """What the unbatched transport returns in place of a ``Work``: ``wait()`` waits, then decodes."""

    def __init__(self, message: _Message):
        self.message = message

    def wait(self, timeout=None):
        msg = self.message
        if not msg.done:
            msg.poll()
            msg.work.wait()
            if msg.completed_at is None:
                msg.completed_at = time.monotonic()
            msg.finish()
        return True

    def is_completed(self) -> bool:
        return self.message.done or self.message.work.is_completed()


_OUTSTANDING: list[_Message] = []  # unbatched messages not yet finished (for completion stamps)


def _poll_outstanding() -> None:
    _OUTSTANDING[:] = [m for m in _OUTSTANDING if not m.done]
    for m in _OUTSTANDING:
        m.poll()


def _messages(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next,
              group, prev_pipeline_rank, next_pipeline_rank) -> dict[str, _Message]:
    """Start of every transport call: finish earlier handles whose transfer is done, check configs,
    encode the sends and allocate the receive buffers (Megatron's op order)."""
    state = _state()
    _poll_outstanding()
    tensors = [t for t in (tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next) if t is not None]
    if not tensors:
        return {}
    _check_group(state, group, tensors[0].device)
    _check_schedule(state, group, tensor_send_next, tensor_recv_prev)
    last = group.rank() == group.size() - 1
    plan = (("send_prev", "backward", prev_pipeline_rank, tensor_send_prev, None),
            ("recv_prev", "forward", prev_pipeline_rank, None, tensor_recv_prev),
            ("send_next", "forward", next_pipeline_rank, tensor_send_next, None),
            ("recv_next", "backward", next_pipeline_rank, None, tensor_recv_next))
    return {name: _Message(state, direction, peer, send, recv, last_stage=last)
            for name, direction, peer, send, recv in plan if send is not None or recv is not None}


@contextlib.contextmanager
def evaluation(uncompressed: bool):
    """An evaluation (forward only) runs inside this, entered on every stage together (by logging's
    wrapper of Megatron's ``evaluate``, per ``--tah-eval-traffic``; a loop of one's own enters it around
    its evaluation): with ``uncompressed`` every link sends raw. A no-op when not installed."""
    state = _STATE
    if state is None:
        yield
        return
    before, state.eval_uncompressed = state.eval_uncompressed, bool(uncompressed)
    try:
        yield
    finally:
        state.eval_uncompressed = before


def _state() -> _State:
    if _STATE is None:
        raise RuntimeError("megatron_tah transport called while not installed; call megatron_tah.install()")
    return _STATE


def batched_p2p_ops(*, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next,
                    group, prev_pipeline_rank, next_pipeline_rank):
    """Compressing ``_batched_p2p_ops``: one batch of uint8 messages, waited and decoded; returns ``[]``."""
    dist = torch.distributed
    messages = _messages(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next,
                         group, prev_pipeline_rank, next_pipeline_rank)
    if not messages:
        return []
    ops = [dist.P2POp(dist.irecv if m.is_recv else dist.isend, m.buf, m.peer, group) for m in messages.values()]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    now = time.monotonic()
    for m in messages.values():
        m.completed_at = now
        m.finish()
    return []


def p2p_ops(*, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next,
            group, prev_pipeline_rank, next_pipeline_rank):
    """Compressing ``_p2p_ops``: Megatron's op order and group choice; returns ``{name: handle}``."""
    dist = torch.distributed
    messages = _messages(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next,
                         group, prev_pipeline_rank, next_pipeline_rank)
    # Megatron alternates process groups by rank parity so that the two directions can overlap
    # (the WORLD group stands in for a second group when the pipeline group has two ranks).
    other = dist.group.WORLD if group.size() == 2 and dist.get_backend(group) != "ucc" else group
    even = group.rank() % 2 == 0
    send_group, recv_group = (group, other) if even else (other, group)
    order = (("send_next", "recv_prev", "send_prev", "recv_next") if even
             else ("recv_prev", "send_next", "recv_next", "send_prev"))
    handles = {}
    for name in order:
        if name not in messages:
            continue
        m = messages[name]
        post = dist.irecv if m.is_recv else dist.isend
        m.work = post(m.buf, m.peer, group=recv_group if m.is_recv else send_group)
        _OUTSTANDING.append(m)
        handles[name] = _Handle(m)
    return handles


# ----- install / uninstall -----------------------------------------------------------------
def _p2p_module():
    try:
        module = importlib.import_module(P2P_MODULE)
    except ImportError as err:
        raise RuntimeError(f"megatron_tah.install needs {P2P_MODULE} (megatron-core): {err}") from err
    for name in TRANSPORTS:
        if not hasattr(module, name):
            raise RuntimeError(f"megatron_tah.install: {P2P_MODULE}.{name} not found; "
                               "this megatron-core does not have the transport functions the patch replaces")
    return module


def _replacement(name: str, original):
    impl = batched_p2p_ops if name == "_batched_p2p_ops" else p2p_ops

    def transport(**kwargs):
        return impl(**kwargs)

    transport.__name__ = transport.__qualname__ = name
    transport.__doc__ = impl.__doc__
    transport.__wrapped__ = original
    setattr(transport, _MARKER, True)
    return transport


def is_installed() -> bool:
    module = importlib.import_module(P2P_MODULE) if _STATE is not None else None
    return module is not None and all(getattr(getattr(module, n), _MARKER, False) for n in TRANSPORTS)


def current_config() -> TahConfig | None:
    return None if _STATE is None else _STATE.config


def install(config: TahConfig | None = None, **overrides) -> None:
    """Route megatron-core's pipeline p2p traffic through the configured codecs (idempotent).

    ``overrides`` are TahConfig fields applied on top of ``config`` (default ``TahConfig()``).
    Installing again with another config replaces the config (and resets per-link codec state).
    """
    from .cpu_shims import apply_cpu_shims, cpu_shims_active
    from .version import check_installed

    global _STATE
    check_installed()
    cfg = config if config is not None else TahConfig()
    if overrides:
        known = {f.name for f in dataclasses.fields(TahConfig)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"megatron_tah.install: unknown option(s) {unknown}; options are TahConfig fields "
                             f"such as tah_forward_codec, tah_backward_codec")
        cfg = dataclasses.replace(cfg, **overrides)
    module = _p2p_module()
    if _STATE is not None and _STATE.config == cfg and is_installed():
        return
    if _STATE is not None:
        shims = _STATE.shims_applied
    else:  # remember whether install (and not the caller) applied them, for uninstall
        shims = not cpu_shims_active() and apply_cpu_shims()
    bandwidth = cfg.emulated_bandwidth_bps
    emulator = None if bandwidth is None else LinkEmulator(bandwidth, cfg.tah_emulate_latency_ms / 1e3)
    _STATE = _State(config=cfg, emulator=emulator, shims_applied=shims)
    stats.set_buffer_source(buffer_nbytes)
    for name in TRANSPORTS:
        current = getattr(module, name)
        if not getattr(current, _MARKER, False):
            setattr(module, name, _replacement(name, current))
    logger.info("megatron_tah: pipeline p2p compressed (forward %s, backward %s)",
                cfg.forward_codec().describe(), cfg.backward_codec().describe())
    places.install(cfg)  # tensor-parallel, data-parallel, activation memory (each only when turned on)


def codec_states() -> dict:
    """``{(direction, role, peer): codec.state_dict()}`` of this rank's codecs that hold state."""
    if _STATE is None:
        return {}
    states = {key: codec.state_dict() for key, codec in _STATE.codecs.items()}
    states.update(_STATE.restored)  # loaded for link ends that have not sent or received since
    return {key: state for key, state in states.items() if state}


def stateful() -> bool:
    """Whether the installed codecs keep state between messages (AQ-SGD, stochastic rounding)."""
    if _STATE is None:
        return False
    return any(codec.stateful for codec in (_STATE.config.forward_codec(), _STATE.config.backward_codec()))


def load_codec_states(states: dict, saved_config: dict | None = None) -> None:
    """Give each link end's codec its saved state (now, or when the codec is created)."""
    state = _state()
    if saved_config is not None:
        saved = TahConfig(**{k: v for k, v in saved_config.items() if k in {f.name for f in dataclasses.fields(TahConfig)}})
        if _config_record(saved) != _config_record(state.config):
            raise CodecMismatchError(
                f"megatron_tah: the checkpoint's codec state was saved with other codecs "
                f"({_config_record(saved)}) than this run's ({_config_record(state.config)}); "
                "load it with the same --tah-* flags, or use --finetune to start the codecs afresh")
    for key, codec_state in states.items():
        key = (key[0], key[1], int(key[2]))
        if key in state.codecs:
            state.codecs[key].load_state_dict(codec_state)
        else:
            state.restored[key] = codec_state


def buffer_nbytes() -> int:
    """Bytes held in per-sample buffers (AQ-SGD) by this rank's codecs; 0 when not installed."""
    if _STATE is None:
        return 0
    return sum(c.buffer_nbytes() for c in _STATE.codecs.values() if hasattr(c, "buffer_nbytes"))


def uninstall() -> None:
    """Restore megatron-core's original transports (and remove CPU shims that install applied)."""
    global _STATE
    places.uninstall()
    module = importlib.import_module(P2P_MODULE) if _STATE is not None else None
    if module is not None:
        for name in TRANSPORTS:
            current = getattr(module, name)
            if getattr(current, _MARKER, False):
                setattr(module, name, current.__wrapped__)
        if _STATE.shims_applied:
            from .cpu_shims import remove_cpu_shims

            remove_cpu_shims()
    _STATE = None
    stats.set_buffer_source(None)
    _OUTSTANDING.clear()
    clear_sample_ids()
