"""``link/message.py``: its host staging (wire buffers through pinned host memory, on CPU tensors through the same
code) and a staged message posted through the transport."""

import pytest
import torch

from megatron_tah.codecs import get_codec
from megatron_tah.link.message import HostStaging
from tests.helpers.dist_utils import run_distributed
from tests.helpers.p2p import p2p_call, transport_call


def _through(staging: HostStaging, wire: torch.Tensor) -> torch.Tensor:
    """send-stage -> (the link: a copy) -> recv-stage; the device wire buffer the codec would decode."""
    sent = staging.stage_send(wire)
    received = staging.stage_recv(wire.numel())
    received.host.copy_(sent.host())
    sent.release()
    out = received.to_device().clone()
    received.release()
    return out


@pytest.mark.parametrize("nbytes", [0, 1, 7, 4096, 1 << 20])
def test_round_trip_is_byte_exact(nbytes):
    gen = torch.Generator().manual_seed(nbytes)
    wire = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    out = _through(HostStaging("cpu"), wire)
    torch.testing.assert_close(out, wire, rtol=0, atol=0)


def test_second_message_of_a_size_allocates_nothing():
    staging = HostStaging("cpu")
    first = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    _through(staging, first)
    made = staging.allocations
    assert made == 3  # send host, recv host, recv device
    second = torch.flip(first, [0]).contiguous()
    assert torch.equal(_through(staging, second), second)
    assert staging.allocations == made
    _through(staging, torch.zeros(10, dtype=torch.uint8))  # a new size: new buffers
    assert staging.allocations == made + 3


def test_buffers_held_at_once_are_distinct():
    # Two sends of one size in flight (not yet released) must not share a host buffer.
    staging = HostStaging("cpu")
    a, b = torch.full((64,), 1, dtype=torch.uint8), torch.full((64,), 2, dtype=torch.uint8)
    sa, sb = staging.stage_send(a), staging.stage_send(b)
    assert sa.host().data_ptr() != sb.host().data_ptr()
    assert torch.equal(sa.host(), a) and torch.equal(sb.host(), b)
    sa.release()
    sb.release()
    with pytest.raises(RuntimeError, match="after release"):
        sa.host()


@pytest.mark.parametrize("bad", [torch.zeros(4, dtype=torch.float32), torch.zeros(2, 2, dtype=torch.uint8)])
def test_rejects_what_is_not_a_wire_buffer(bad):
    with pytest.raises(ValueError, match="1-D uint8"):
        HostStaging("cpu").stage_send(bad)


def test_cuda_staging_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        HostStaging("cuda")


def _staged_pipeline(rank, world_size):
    """Stage 0: a linear layer's bf16 activations through the `none` codec, sent plain and staged;
    stage 1: decodes both, and returns the two losses and whether the staged bytes matched."""
    torch.manual_seed(0)
    codec = get_codec("none")
    shape, dtype = (16, 2, 32), torch.bfloat16
    staging = HostStaging("cpu")
    results = []
    for step in range(3):  # several messages: the pooled buffers are reused
        if rank == 0:
            x = torch.randn(shape) @ torch.randn(32, 32)
            wire = codec.encode(x.to(dtype))
            torch.distributed.send(wire, 1)  # the plain path
            staged = staging.stage_send(wire)
            torch.distributed.isend(staged.host(), 1).wait()
            staged.release()
        else:
            nbytes = codec.wire_nbytes(shape, dtype)
            plain = torch.empty(nbytes, dtype=torch.uint8)
            torch.distributed.recv(plain, 0)
            staged = staging.stage_recv(nbytes)
            torch.distributed.irecv(staged.host, 0).wait()
            outs = []
            for wire in (plain, staged.to_device()):
                out = torch.empty(shape, dtype=dtype)
                codec.decode(wire, shape, dtype, out=out)
                outs.append(out)
            staged.release()
            losses = [float((o.float() ** 2).mean()) for o in outs]
            results.append((losses, torch.equal(outs[0], outs[1])))
    return results, staging.allocations


@pytest.mark.distributed
def test_two_gloo_processes_staged_equals_plain():
    (_, sender_allocs), (results, receiver_allocs) = run_distributed(_staged_pipeline, 2, timeout=120)
    for (plain_loss, staged_loss), same in results:
        assert same and plain_loss == staged_loss
    assert len({losses[0] for losses, _ in results}) == 3  # three different messages
    assert sender_allocs == 1 and receiver_allocs == 2


# ----- the transport's staged path (PipelineTransport, both megatron-core transports) -----------------
SHAPE = (16, 2, 32)


def _exchange(rank: int, batched: bool, activation: torch.Tensor, gradient: torch.Tensor):
    """One transport call per rank of a 2-stage pipeline: stage 0 sends ``activation`` and receives a
    gradient, stage 1 receives the activation and sends ``gradient``; returns what this rank received."""
    received = torch.empty_like(activation)
    p2p_call(rank, batched, activation if rank == 0 else gradient, received)
    return received


def _transport_staged_and_plain(rank, world_size):
    """Per codec pair, dtype and transport: what every message delivered, plain and with --tah-share-gpus
    (host staging on CPU), the wire bytes counted, and the staging buffers the link ends made."""
    import megatron_tah
    from megatron_tah.megatron.pipeline_parallel import installed_transport
    from megatron_tah.megatron.registry import REGISTRY

    out = {}
    for forward, backward, dtype in (("none", "none", torch.bfloat16), ("tah", "fixedpoint", torch.float32)):
        for batched in (True, False):
            runs = {}
            for staged in (False, True):
                megatron_tah.install(tah_forward_codec=forward, tah_backward_codec=backward, tah_backend="torch",
                                     tah_share_gpus=staged)
                gen = torch.Generator().manual_seed(5)
                received = []
                for _ in range(3):  # several messages: the staging buffers are reused
                    activation = torch.randn(SHAPE, generator=gen).to(dtype)
                    gradient = torch.randn(SHAPE, generator=gen).to(dtype)
                    received.append(_exchange(rank, batched, activation, gradient))
                stats = REGISTRY.stats.collect(reset=True)
                allocations = {key: None if link.staging is None else link.staging.allocations
                               for key, link in installed_transport().links.items()}
                megatron_tah.uninstall()
                runs[staged] = (received, stats["forward"]["wire_bytes"], stats["backward"]["wire_bytes"], allocations)
            plain, staged = runs[False], runs[True]
            out[(forward, dtype, batched)] = {
                "identical": all(torch.equal(a, b) for a, b in zip(plain[0], staged[0])),
                "changed": not torch.equal(staged[0][0], staged[0][1]),
                "wire_bytes": (plain[1:3], staged[1:3]),
                "plain_allocations": plain[3], "staged_allocations": staged[3]}
    return out


@pytest.mark.distributed
def test_the_transport_stages_every_message_and_delivers_the_plain_paths_bytes():
    """--tah-share-gpus on CPU: both transports, `none` (bf16) and compressed codecs, both directions; the
    received tensors are bit-identical to the plain path's, the bytes on the wire the same, and each link end
    made its host buffers once (send: one host buffer; receive: a host and a device buffer)."""
    results = run_distributed(_transport_staged_and_plain, 2, env={"TRITON_INTERPRET": "1"}, timeout=300)
    for rank, per_case in enumerate(results):
        for case, r in per_case.items():
            assert r["identical"] and r["changed"], (rank, case)
            plain_bytes, staged_bytes = r["wire_bytes"]
            assert plain_bytes == staged_bytes and plain_bytes[rank] > 0, (rank, case)  # (sends are counted)
            assert set(r["plain_allocations"].values()) == {None}
            assert {key[1]: n for key, n in r["staged_allocations"].items()} == {"send": 1, "recv": 2}, (rank, case)


# ----- when a staged send waits for its host copy ------------------------------------------------------
class _RecordingStaging:
    """A link end's staging that records when a copy is queued and when its host buffer is awaited."""

    device = torch.device("cpu")

    def __init__(self, events: list, name: str):
        self.events, self.name, self.hosts = events, name, []

    def stage_send(self, wire):
        self.events.append(("copy", self.name))
        events, name, host = self.events, self.name, wire.clone()
        self.hosts.append(host)

        class _Staged:
            def host(self):
                events.append(("host", name))
                return host

            def release(self):
                pass

        return _Staged()


class _Group:
    def rank(self) -> int:
        return 1

    def size(self) -> int:
        return 3


class _Done:
    def is_completed(self) -> bool:
        return True

    def wait(self, timeout=None) -> bool:
        return True


@pytest.mark.parametrize("batched", [False, True], ids=["p2p_ops", "batched"])
def test_a_staged_send_awaits_its_host_copy_when_posted_so_the_next_encode_overlaps_it(monkeypatch, batched):
    """A middle stage sending both ways in one call (the interleaved schedule's exchange): the second
    message's encode is queued before the first message's device-to-host copy is awaited (each is awaited
    only when its message is posted), and the bytes posted are the encodes' own."""
    from megatron_tah.config import TahConfig
    from megatron_tah.link.transport import PipelineTransport
    from megatron_tah.megatron.places import STREAMS
    from megatron_tah.megatron.stats import Stats

    dist = torch.distributed
    transport = PipelineTransport(TahConfig(tah_forward_codec="fixedpoint", tah_backward_codec="fixedpoint",
                                            tah_backend="torch"), Stats(STREAMS))
    group, events, encoded, sent = _Group(), [], {}, {}
    transport.checked_groups.add(id(group))
    monkeypatch.setattr(transport, "staged", lambda group, device: True)
    staging = {0: _RecordingStaging(events, "send_prev"), 2: _RecordingStaging(events, "send_next")}
    transport.link("backward", "send", 0).staging, transport.link("forward", "send", 2).staging = staging.values()
    encode = transport.encode

    def recording_encode(link, x, *args):
        buf, rest = encode(link, x, *args)
        events.append(("encode", link.direction))
        encoded[link.peer] = buf.clone()
        return buf, rest

    def isend(buf, dst, group=None):
        events.append(("isend", dst))
        sent[dst] = buf
        return _Done()

    monkeypatch.setattr(transport, "encode", recording_encode)
    monkeypatch.setattr(dist, "get_backend", lambda g=None: "gloo")
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)  # (the peer watch names the sending rank)
    monkeypatch.setattr(dist, "isend", isend)
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group=None: (op, tensor, peer, group))
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [op(t, p, group=g) for op, t, p, g in ops])
    gen = torch.Generator().manual_seed(3)
    call = dict(tensor_send_prev=torch.randn(SHAPE, generator=gen), tensor_recv_prev=None,
                tensor_send_next=torch.randn(SHAPE, generator=gen), tensor_recv_next=None,
                group=group, prev_pipeline_rank=0, next_pipeline_rank=2)
    transport_call(transport, batched, **call)
    assert events.index(("encode", "forward")) < events.index(("host", "send_prev")), events
    last_encode = max(i for i, (what, _) in enumerate(events) if what == "encode")
    assert all(i > last_encode for i, (what, _) in enumerate(events) if what == "host"), events
    for name, peer in (("send_prev", 0), ("send_next", 2)):
        assert events.index(("host", name)) < events.index(("isend", peer)), events
    assert sent.keys() == encoded.keys() == {0, 2}
    assert all(sent[peer] is staging[peer].hosts[0] for peer in sent)  # the host copy is what is posted
    assert all(torch.equal(sent[peer], encoded[peer]) for peer in sent)


def test_messages_of_varying_lengths_share_a_few_pooled_buffers():
    """Entropy-coded messages go at their own lengths: each comes from its size class's buffer (at most 1/16
    larger), so a link end's pool stays a few buffers whatever the lengths."""
    from megatron_tah.link.message import size_class

    assert [size_class(n) for n in (0, 1, 64, 65, 1000, 1024, 1025, 23720)] == [0, 64, 64, 128, 1024, 1024, 1088,
                                                                                 24576]
    assert all(n <= size_class(n) <= n * 17 / 16 for n in range(1024, 100_000, 997))  # (steps of 64 below)
    staging = HostStaging("cpu")
    gen = torch.Generator().manual_seed(0)
    for n in torch.randint(21_000, 24_000, (200,), generator=gen).tolist():
        sent = staging.stage_send(torch.full((n,), 7, dtype=torch.uint8))
        host = sent.host()
        assert host.numel() == n and bool((host == 7).all())
        sent.release()
    assert staging.allocations <= 4  # the classes 21504 .. 24576 (1024 apart)
