"""InboundWire: one rank's inbound wire shared by both neighbours, metered by the receiver (fake clock)."""

import pytest

from megatron_tah.link.emulate import InboundWire


class _FakeClock:
    def __init__(self):
        self.now = 0.0
        self.slept = []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


MB = 1_000_000  # 1 MB at 8 Mbit/s holds the wire for 1 s


def test_a_scripted_sequence_from_both_neighbours_arrives_when_hand_computed():
    clock = _FakeClock()
    wire = InboundWire(8e6, latency_s=0.5, clock=clock, sleep=clock.sleep)
    # activation from the previous stage, sent at 0: wire 0 -> 1 + 0.5 latency = 1.5
    assert wire.receive(sent_at=0.0, nbytes=MB) == pytest.approx(1.5)
    assert clock.now == pytest.approx(1.5)
    # gradient from the next stage sent at 0.2, back to back: it waits for the wire (free at 1.5), 1.5 + 2 + 0.5
    assert wire.receive(sent_at=0.2, nbytes=2 * MB) == pytest.approx(2.5)
    assert clock.now == pytest.approx(4.0)
    # an idle gap: the receiver computes until 12; an activation sent at 10 started at 10 and arrived at 11
    clock.now = 12.0
    assert wire.receive(sent_at=10.0, nbytes=MB // 2) == 0.0
    assert wire.free_at == pytest.approx(11.0)
    # an empty gradient sent at 10.5 still holds the wire for the latency: 11 -> 11.5 (already past)
    assert wire.receive(sent_at=10.5, nbytes=0) == 0.0
    assert wire.free_at == pytest.approx(11.5)
    # an activation sent at 11.2 queues behind it: 11.5 + 1 + 0.5 = 13, one second after now
    assert wire.receive(sent_at=11.2, nbytes=MB) == pytest.approx(1.0)
    assert clock.now == pytest.approx(13.0)
    assert clock.slept == pytest.approx([1.5, 2.5, 1.0])
    assert wire.total_delay_s == pytest.approx(5.0)
    assert wire.billed_bytes == 4.5 * MB


def test_arrival_is_pure_and_latency_occupies_the_wire():
    wire = InboundWire(8e6, latency_s=0.25, clock=lambda: pytest.fail("arrival must not read the clock"),
                       sleep=lambda s: pytest.fail("arrival must not sleep"))
    # three messages sent together: each holds the wire for 1 s + 0.25 s, latency included
    ends = [wire.arrival(0.0, MB) for _ in range(3)]
    assert ends == pytest.approx([1.25, 2.5, 3.75])
    assert wire.occupancy_seconds(MB) == pytest.approx(1.25)
    # a message sent after the wire went idle starts when it is sent
    assert wire.arrival(10.0, 2 * MB) == pytest.approx(12.25)


def test_only_the_bytes_passed_are_billed_and_bad_inputs_are_refused():
    wire = InboundWire(8e6)
    wire.arrival(0.0, 1234)
    wire.arrival(0.0, 0)
    assert wire.billed_bytes == 1234
    with pytest.raises(ValueError, match="nbytes"):
        wire.arrival(0.0, -1)
    with pytest.raises(ValueError, match="bandwidth"):
        InboundWire(0)
    with pytest.raises(ValueError, match="latency"):
        InboundWire(1e6, latency_s=-0.1)


def test_the_transport_meters_each_receive_on_the_inbound_wire_from_the_senders_stamp():
    """``--tah-emulate-wire inbound``: a receive waits until its message has crossed this rank's one inbound
    wire, from the send time its trailer carries; only the codec's bytes are billed (the stamp's trailer is
    not traffic), activations and gradients queue on the same wire, and the decode is unchanged."""
    import torch

    from megatron_tah.config import TahConfig
    from megatron_tah.link.message import Message
    from megatron_tah.link.transport import PipelineTransport
    from megatron_tah.link.wire import TRAILER_NBYTES, Trailer, append_trailer
    from megatron_tah.megatron.places import STREAMS
    from megatron_tah.megatron.stats import Stats

    config = TahConfig(tah_forward_codec="fixedpoint", tah_forward_bits=8, tah_emulate_bandwidth="8mbit",
                       tah_emulate_latency_ms=500, tah_emulate_wire="inbound")
    transport = PipelineTransport(config, Stats(STREAMS))
    assert isinstance(transport.emulation, InboundWire) and transport.trailer_nbytes == TRAILER_NBYTES
    clock = _FakeClock()
    clock.now = 100.0
    transport.emulation = InboundWire(8e6, 0.5, clock=clock, sleep=clock.sleep)

    def receive(direction, sent_at, x):
        link = transport.link(direction, "recv", 0)
        codec = transport.traffic.codec(link)
        message = append_trailer(codec.encode(x), Trailer(None, sent_at, None))
        target = torch.empty_like(x)
        m = Message(link, message, target=target, codec=codec, extra_nbytes=TRAILER_NBYTES, stages=(0, 1))
        m.completed_at = 0.0
        transport.finish(m)
        return codec.wire_nbytes(x.shape, x.dtype), target

    x = torch.randn(64, 2, 128)
    nbytes, decoded = receive("forward", 99.9, x)  # sent 0.1 s ago, the wire idle: arrives at 99.9 + bytes/rate + 0.5
    first = 99.9 + nbytes * 8 / 8e6 + 0.5
    assert clock.now == pytest.approx(first)
    assert torch.allclose(decoded, x, atol=0.05 * x.abs().max().item())
    g = 1e-5 * torch.randn(64, 2, 128)
    grad_nbytes, _ = receive("backward", 100.0, g)  # sent before the wire was free: it queues behind the activation
    assert clock.now == pytest.approx(first + grad_nbytes * 8 / 8e6 + 0.5)
    assert transport.emulation.billed_bytes == nbytes + grad_nbytes
