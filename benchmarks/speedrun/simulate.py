"""Seconds per step of Megatron's 1F1B pipeline behind slow links: a discrete-event model.

The schedule is megatron-core's ``forward_backward_pipelining_without_interleaving``: stage ``s``
of ``S`` runs ``W = min(S - s - 1, M)`` warm-up forwards, then one forward / one backward for the
remaining ``M - W`` micro-batches, then ``W`` cool-down backwards. Communication follows its p2p
calls with ``batch_p2p_comm`` and no ``overlap_p2p_comm``: ``recv_forward`` before a warm-up
forward, ``send_forward`` after it, then ``send_forward_recv_backward`` after every steady
forward, ``send_backward_recv_forward`` after every steady backward (``send_backward`` after the
last), and ``recv_backward`` / ``send_backward`` around each cool-down backward. Each call is one
batch of p2p ops.

Timing rules:

* compute: a forward of micro-batch ``m`` on stage ``s`` takes ``fwd_s[s]``, a backward ``bwd_s[s]``;
* a message is stamped with its sender's time when the compute that produced it ends (the batch
  that carries it is posted then);
* ``blocking=True`` (default; megatron-core waits for every p2p call's requests): a batch completes
  once both ends have posted every op in it, so a send also waits for its receiver to post the
  matching receive (NCCL's rendezvous). ``blocking=False``: sends never wait; a batch completes once
  the messages it receives were sent. The reference benchmark (``torch.distributed.pipelining``'s
  1F1B) sits between the two: its paired send/receive batches wait as Megatron's do (and a pair's
  send never waits longer than its receive: the neighbour posts both sides of the exchange
  together), but its lone warm-up and cool-down sends are asynchronous. Both modes give the same
  step on both records and whenever all stages and boundaries are alike; with unequal ones a
  blocking lone ``send_backward`` can hold a stage while its predecessor is still busy;
* then the receiver's inbound wire (``InboundWire``: one per stage, shared by activations from
  ``s - 1`` and gradients from ``s + 1``, metered in the order the stage consumes them) delays
  the stage until each received message has arrived. The real link is taken as infinitely fast.

``steps`` consecutive steps run back to back (the wires keep their state; stages start the next
step as soon as they finish their part of the previous one, as the reference's timing windows
do); the result is the makespan divided by ``steps``.
"""

from __future__ import annotations

import dataclasses

from megatron_tah.link.emulate import InboundWire

BANDWIDTH_BPS = 200e6  # the reference's link: 200 Mb/s ...
LATENCY_S = 0.05  # ... and 50 ms at every stage boundary
FORWARD_SHARE = 1.0 / 3.0  # forward : backward = 1 : 2 per micro-batch


@dataclasses.dataclass(frozen=True)
class Record:
    """A published ProtocolNanoGPT record: its inputs and its measured seconds per step."""

    name: str
    stages: int
    micro_batches: int
    micro_batch: int
    seq: int
    bytes_per_token: float  # each way, at every stage boundary
    step_no_link_s: float  # steady seconds per step of its run without the slow link
    published_s_per_step: float
    steps_to_target: int

    @property
    def message_bytes(self) -> float:
        return self.bytes_per_token * self.micro_batch * self.seq

    @property
    def published_T(self) -> float:
        return self.steps_to_target * self.published_s_per_step


# Step times without the slow link: the dense record's 539 ms (its loss run's steady step_avg, 538-541 ms);
# ReparamSSN's own loss run (WAN_MODE=off) logs 654-658 ms per step, not the dense 539 ms: 655 ms.
RECORDS = (
    Record("dense bf16", 8, 64, 8, 1024, 2048, 0.539, 100.475, 2925),
    Record("ReparamSSN", 8, 32, 16, 1024, 322, 0.655, 19.889, 9125),
)


@dataclasses.dataclass
class Timeline:
    """What ``simulate`` computed: per op ``(stage, "F"|"B", step, micro-batch) -> (start, end)``."""

    ops: dict[tuple[int, str, int, int], tuple[float, float]]
    finish_s: list[float]  # when each stage finished its last op
    wires: list[InboundWire]
    steps: int

    @property
    def makespan(self) -> float:
        return max(self.finish_s)

    @property
    def step_s(self) -> float:
        return self.makespan / self.steps


def _per_stage(value, n: int, name: str) -> list[float]:
    try:
        values = [float(value)] * n
    except TypeError:  # a sequence, one value per stage or boundary
        values = [float(v) for v in value]
    if len(values) != n:
        raise ValueError(f"{name} needs {n} values (or one scalar), got {len(values)}")
    if any(not v >= 0 for v in values):
        raise ValueError(f"{name} must be >= 0, got {values!r}")
    return values


def _program(stage: int, stages: int, micro_batches: int, step: int) -> list[tuple]:
    """One stage's ops for one step, in order: ``("C", "F"|"B", step, mb)`` (compute) or
    ``("X", [(role, "f"|"b", step, mb), ...])`` (one batched p2p call that the stage waits for)."""
    absent = set()  # the pipeline's ends receive no activations / send no activations
    if stage == 0:
        absent |= {("recv", "f"), ("send", "b")}
    if stage == stages - 1:
        absent |= {("send", "f"), ("recv", "b")}
    warmup = min(stages - stage - 1, micro_batches)
    steady = micro_batches - warmup
    prog: list[tuple] = []

    def comm(*ops):
        batch = [(role, kind, step, m) for role, kind, m in ops if (role, kind) not in absent]
        if batch:
            prog.append(("X", batch))

    def compute(kind, m):
        prog.append(("C", kind, step, m))

    for m in range(warmup):  # recv_forward, forward, send_forward
        comm(("recv", "f", m))
        compute("F", m)
        comm(("send", "f", m))
    if steady:
        comm(("recv", "f", warmup))
    for i in range(steady):
        compute("F", warmup + i)
        comm(("send", "f", warmup + i), ("recv", "b", i))  # send_forward_recv_backward
        compute("B", i)
        if i < steady - 1:
            comm(("send", "b", i), ("recv", "f", warmup + i + 1))  # send_backward_recv_forward
        else:
            comm(("send", "b", i))
    for m in range(steady, micro_batches):  # recv_backward, backward, send_backward
        comm(("recv", "b", m))
        compute("B", m)
        comm(("send", "b", m))
    return prog


def simulate(stages: int, micro_batches: int, fwd_s, bwd_s, fwd_bytes, bwd_bytes, rate_bps: float,
             latency_s: float, *, blocking: bool = True, steps: int = 1) -> Timeline:
    """Run the 1F1B model (module docstring); per-stage ``fwd_s``/``bwd_s`` and per-boundary bytes
    (``fwd_bytes[s]``: stage ``s`` to ``s + 1``; ``bwd_bytes[s]``: stage ``s + 1`` to ``s``), or scalars."""
    if stages < 1 or micro_batches < 1 or steps < 1:
        raise ValueError(f"stages, micro_batches and steps must be >= 1, got {stages}, {micro_batches}, {steps}")
    fwd_s, bwd_s = _per_stage(fwd_s, stages, "fwd_s"), _per_stage(bwd_s, stages, "bwd_s")
    fwd_b = _per_stage(fwd_bytes, stages - 1, "fwd_bytes")
    bwd_b = _per_stage(bwd_bytes, stages - 1, "bwd_bytes")
    wires = [InboundWire(rate_bps, latency_s) for _ in range(stages)]
    progs = [[op for k in range(steps) for op in _program(s, stages, micro_batches, k)] for s in range(stages)]
    pc, clock = [0] * stages, [0.0] * stages
    posted: dict[tuple, float] = {}  # (role, kind, step, mb, sender stage) -> post time
    ops: dict[tuple[int, str, int, int], tuple[float, float]] = {}

    def key(s, role, kind, step, m):  # a message is named by its sender
        sender = s if role == "send" else (s - 1 if kind == "f" else s + 1)
        return (kind, step, m, sender)

    progress = True
    while progress:
        progress = False
        for s in range(stages):
            while pc[s] < len(progs[s]):
                op = progs[s][pc[s]]
                if op[0] == "C":
                    _, kind, step, m = op
                    start = clock[s]
                    clock[s] += fwd_s[s] if kind == "F" else bwd_s[s]
                    ops[(s, kind, step, m)] = (start, clock[s])
                else:
                    batch = [(role, key(s, role, *rest)) for role, *rest in op[1]]
                    for role, k in batch:
                        posted.setdefault((role, *k), clock[s])
                    peers = [("recv" if role == "send" else "send", *k) for role, k in batch
                             if role == "recv" or blocking]
                    if any(p not in posted for p in peers):
                        break  # wait for a neighbour to post its side
                    done = max([clock[s]] + [posted[p] for p in peers])
                    for role, k in batch:
                        if role == "recv":
                            kind, _, _, sender = k
                            nbytes = (fwd_b if kind == "f" else bwd_b)[min(sender, s)]
                            done = max(done, wires[s].arrival(posted[("send", *k)], nbytes))
                    clock[s] = done
                pc[s] += 1
                progress = True
    if any(pc[s] < len(progs[s]) for s in range(stages)):
        raise RuntimeError(f"the schedule deadlocked at ops {pc}")  # a bug in _program, never the inputs
    return Timeline(ops, clock, wires, steps)


def simulate_step(stages: int, micro_batches: int, fwd_s, bwd_s, fwd_bytes, bwd_bytes, rate_bps: float,
                  latency_s: float, *, blocking: bool = True, steps: int = 1) -> float:
    """Seconds per step of Megatron's 1F1B at ``stages`` x ``micro_batches`` under the inbound-wire link.

    ``fwd_s`` / ``bwd_s``: seconds of one micro-batch's forward / backward on each stage (list of
    ``stages``, or a scalar for all); ``fwd_bytes`` / ``bwd_bytes``: billed bytes of one activation /
    gradient message at each boundary (list of ``stages - 1``, or a scalar); ``rate_bps`` bits/s
    (``math.inf`` for no slow link) and ``latency_s`` per message; ``blocking``: sends wait for the
    receiver (module docstring); ``steps``: run this many steps back to back and average.
    """
    return simulate(stages, micro_batches, fwd_s, bwd_s, fwd_bytes, bwd_bytes, rate_bps, latency_s,
                    blocking=blocking, steps=steps).step_s


def compute_per_micro_batch(step_no_link_s: float, stages: int, micro_batches: int,
                            forward_share: float = FORWARD_SHARE) -> tuple[float, float]:
    """``(fwd_s, bwd_s)`` per micro-batch and stage from a step time measured without the slow link.

    With equal stages and a free link, 1F1B takes ``(M + S - 1) (f + b)`` (``M`` slots of work on
    the busiest stage plus the ``S - 1`` slot bubble), so ``f + b = step / (M + S - 1)``, split
    ``forward_share : 1 - forward_share``. Per-step work outside the schedule (the optimizer) is
    thereby spread over the slots.
    """
    slot = step_no_link_s / (micro_batches + stages - 1)
    return slot * forward_share, slot * (1.0 - forward_share)


def simulate_record(record: Record, *, blocking: bool = True, steps: int = 1) -> float:
    """The model's seconds per step for a published record, from its published inputs only."""
    f, b = compute_per_micro_batch(record.step_no_link_s, record.stages, record.micro_batches)
    return simulate_step(record.stages, record.micro_batches, f, b, record.message_bytes, record.message_bytes,
                         BANDWIDTH_BPS, LATENCY_S, blocking=blocking, steps=steps)


def calibration_rows(*, steps: int = 1) -> list[dict]:
    """Simulated against published seconds per step for each record, blocking and non-blocking sends."""
    rows = []
    for rec in RECORDS:
        sim = simulate_record(rec, steps=steps)
        eager = simulate_record(rec, blocking=False, steps=steps)
        rows.append(dict(record=rec.name, published_s=rec.published_s_per_step, simulated_s=sim,
                         error=sim / rec.published_s_per_step - 1.0, simulated_nonblocking_s=eager,
                         error_nonblocking=eager / rec.published_s_per_step - 1.0))
    return rows
