"""``--tah-entropy-coding`` in megatron-core's own pipeline schedules (PP 2, CPU, gloo): the same losses and
gradients bit for bit as the codec alone, fewer bytes on the wire, on every schedule -- 1F1B batched and
unbatched, interleaved with overlapped transfers --, each message one transfer of its own length (gloo); the
framed protocol (NCCL's) forced on gloo, its overflows carried by a second batch; and no message lost when a
receiver posts late and its sender uninstalls (and is collected) right after its last send."""

from __future__ import annotations

import gc
import math
import time

import pytest
import torch

from tests.helpers.dist_utils import run_distributed
from tests.megatron.test_patch_pipeline import ENV, SCHEDULES, _build, _train, _WireSpy

pytestmark = pytest.mark.distributed

CODECS = dict(tah_forward_codec="hadint", tah_forward_bits=4, tah_backward_codec="hadint", tah_backward_bits=4,
              tah_backend="torch")
ITERATIONS = 3
BATCHED = [s for s in SCHEDULES if s[2]]  # the framed protocol's overflows go on batched calls only


class _Sends(_WireSpy):
    """``_WireSpy`` that also counts the sends (transfers) handed to gloo."""

    def __enter__(self):
        super().__enter__()
        counted, self.sends = torch.distributed.ProcessGroup.send, 0

        def send(pg, tensors, dst, tag=0):
            self.sends += 1
            return counted(pg, tensors, dst, tag)

        torch.distributed.ProcessGroup.send = send
        return self


class _LateReceiver:
    """Every receive this rank posts (``irecv``, batched or not) is posted ``delay_s`` late: the window between a
    message's completion and the next receive's post, in which a sender may finish and uninstall. (Replaced in
    ``distributed_c10d`` too, which ``P2POp`` checks an op against.)"""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s
        self.modules = (torch.distributed, torch.distributed.distributed_c10d)
        self.original = torch.distributed.irecv

    def __enter__(self):
        original, delay_s = self.original, self.delay_s

        def irecv(*args, **kwargs):
            time.sleep(delay_s)
            return original(*args, **kwargs)

        if delay_s:
            for module in self.modules:
                module.irecv = irecv
        return self

    def __exit__(self, *exc):
        for module in self.modules:
            module.irecv = self.original


def _run(build, framed: bool = False, late_s: float = 0.0, iterations: int = ITERATIONS, **options):
    """Train ``ITERATIONS`` steps with the codecs (and ``options``; ``framed``: the framed protocol forced on
    gloo; ``late_s``: every receive of this rank posted that late), then uninstall at once and collect garbage:
    losses, gradients, bytes and sends this rank handed to gloo, the transport's recorded wire bytes and
    messages, the inbound wire's billed bytes if emulated, and what the transport held before uninstalling."""
    import megatron_tah
    from megatron_tah.megatron.pipeline_parallel import installed_transport
    from megatron_tah.megatron.registry import REGISTRY

    megatron_tah.install(**CODECS, **options)
    if framed:
        installed_transport().exact_backends = ()
    REGISTRY.stats.collect(reset=True)
    try:
        with _Sends() as spy, _LateReceiver(late_s):
            losses, grads = _train(build(), iterations, lr=3e-3)
            inbound = installed_transport().emulation
            billed = inbound.billed_bytes if inbound is not None else None
            held = installed_transport().outbox.holdings()
            megatron_tah.uninstall()  # right after the last send: its sends are drained, not dropped
            gc.collect()
    finally:
        megatron_tah.uninstall()
    stats = REGISTRY.stats.collect(reset=True)
    return {"losses": losses, "grads": grads, "spied": sum(spy.bytes_to.values()), "sends": spy.sends,
            "recorded": stats["forward"]["wire_bytes"] + stats["backward"]["wire_bytes"],
            "messages": stats["forward"]["messages"] + stats["backward"]["messages"], "billed": billed, "held": held}


def _scenarios(rank, world_size):
    from megatron_tah.link import frames
    from megatron_tah.megatron.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    out = {}
    for name, vpp, batch_p2p, overlap in SCHEDULES:
        build = lambda: _build(world_size, vpp, batch_p2p, overlap, 4 * (vpp or 1))  # noqa: E731
        out[name] = {"plain": _run(build), "coded": _run(build, tah_entropy_coding=True),
                     "staged": _run(build, tah_entropy_coding=True, tah_share_gpus=True)}  # host buffers, as on GPUs
        if batch_p2p:
            margin = frames.MARGIN
            frames.MARGIN = -0.5  # every framed message after a link's first half the size its codes need: each overflows
            try:
                out[name]["framed"] = _run(build, framed=True, tah_entropy_coding=True)
            finally:
                frames.MARGIN = margin
    build = lambda: _build(world_size, None, True, False, 4)  # noqa: E731
    out["inbound"] = _run(build, tah_entropy_coding=True, tah_emulate_bandwidth="1gbit",
                          tah_emulate_wire="inbound")
    return out


def _same(a, b) -> bool:
    return a["losses"] == b["losses"] and a["grads"].keys() == b["grads"].keys() and all(
        torch.equal(a["grads"][k], b["grads"][k]) for k in a["grads"])


@pytest.mark.smoke
def test_entropy_coding_changes_bytes_not_values_on_every_schedule():
    results = run_distributed(_scenarios, 2, env=ENV, timeout=900)
    for name, vpp, batch_p2p, overlap in SCHEDULES:
        for rank in range(2):
            r = results[rank][name]
            plain, coded, staged = r["plain"], r["coded"], r["staged"]
            assert _same(plain, coded) and _same(plain, staged), (name, rank, plain["losses"], coded["losses"])
            # what the transport counts is what crossed gloo: each message once, at its coded length
            for run in r.values():
                assert run["spied"] == run["recorded"] > 0, (name, rank, run["spied"], run["recorded"])
            assert staged["spied"] == coded["spied"] and coded["sends"] == plain["sends"] == coded["messages"]  # one each
            assert coded["spied"] < 0.97 * plain["spied"], (name, rank, coded["spied"], plain["spied"])
            if batch_p2p:  # framed, every frame too small: each message after a link's first is two transfers
                framed = r["framed"]
                assert _same(plain, framed), (name, rank)
                assert framed["sends"] > coded["sends"] and framed["spied"] >= coded["spied"], (name, rank)
                assert framed["spied"] < plain["spied"], (name, rank)
    for rank in range(2):
        r = results[rank]["inbound"]
        # both ranks' wires billed every message's coded bytes, nothing else: what the other rank sent
        assert r["billed"] == results[1 - rank]["inbound"]["recorded"] > 0


LATE_S = 0.3  # how late every receive is posted: a sender ends its step long before
LATE_ITERATIONS = 2


def _late_receivers(rank, world_size):
    """Per schedule: the plain run, then with entropy coding and every receive of this rank posted late, twice in
    a row (a message lost in the first run would stall the second behind it), staged, and framed (NCCL's
    protocol, forced on gloo) on the batched schedule; frames too small (overflows) wherever the protocol has
    them; each run uninstalls and collects garbage right after its last send. Returns the losses, the sends and
    the seconds each run took."""
    from megatron_tah.link import frames
    from megatron_tah.megatron.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    out = {}
    for name, vpp, batch_p2p, overlap in SCHEDULES:
        build = lambda: _build(world_size, vpp, batch_p2p, overlap, 4 * (vpp or 1))  # noqa: E731
        runs = {"plain": dict(), "late": dict(tah_entropy_coding=True, late_s=LATE_S),
                "late again": dict(tah_entropy_coding=True, late_s=LATE_S),
                "late staged": dict(tah_entropy_coding=True, tah_share_gpus=True, late_s=LATE_S)}
        if batch_p2p:
            runs["late framed"] = dict(tah_entropy_coding=True, framed=True, late_s=LATE_S)
        for options in runs.values():
            options["iterations"] = LATE_ITERATIONS
        out[name] = {}
        for run, options in runs.items():
            margin = frames.MARGIN
            frames.MARGIN = -0.5 if options.get("late_s") else margin  # framed: every frame too small, overflows
            start = time.monotonic()
            try:
                result = _run(build, **options)
            finally:
                frames.MARGIN = margin
            out[name][run] = {"losses": result["losses"], "grads": result["grads"], "sends": result["sends"],
                              "messages": result["messages"], "seconds": time.monotonic() - start}
    return out


def test_a_late_receiver_gets_every_message_of_a_sender_that_uninstalled_at_once():
    """The window of the hang this protocol closes: a receive posted after its sender finished its step and
    dropped its transport. Every run ends, with the plain run's losses and gradients, well within the bound."""
    results = run_distributed(_late_receivers, 2, env=ENV, timeout=900)
    for name, *_ in SCHEDULES:
        for rank in range(2):
            runs = results[rank][name]
            plain = runs.pop("plain")
            for run, r in runs.items():
                assert _same(plain, r), (name, run, rank, plain["losses"], r["losses"])
                assert r["seconds"] < 300, (name, run, rank, r["seconds"])  # (no wait reached a timeout)
            if "late framed" in runs:
                assert runs["late framed"]["sends"] > runs["late"]["sends"], (name, rank)  # overflows were sent


def test_a_framed_receive_posted_before_the_links_previous_one_was_read_is_refused_an_exact_one_is_not():
    """Framed (NCCL), sizes follow the coded sizes of a link's messages in turn: a schedule posting receives ahead
    gets an error, not a frame sized from stale history (which the sender would size differently). Exact (gloo),
    every receive posts the coder's most, whatever was posted before."""
    from megatron_tah.codecs.core import entropy
    from megatron_tah.config import TahConfig
    from megatron_tah.link.transport import PipelineTransport
    from megatron_tah.megatron.places import STREAMS
    from megatron_tah.megatron.stats import Stats

    transport = PipelineTransport(TahConfig(**CODECS, tah_entropy_coding=True), Stats(STREAMS))
    link = transport.link("forward", "recv", 0)
    target = torch.empty(64, 2, 128)
    capacity = entropy.capacity_nbytes(transport.traffic.codec(link), target.shape, target.dtype) + 4
    exact = [transport.receive(link, target, None, {"stages": (0, 1), "extra_nbytes": 0, "exact": True})
             for _ in range(3)]
    assert [m.buf.numel() for m in exact] == [capacity] * 3 and all(m.exact for m in exact)
    first = transport.receive(link, target, None, {"stages": (0, 1), "extra_nbytes": 0})
    assert first.buf.numel() == capacity and not first.exact  # framed, no history yet: the coder's most
    with pytest.raises(RuntimeError, match="posted before the previous one had been read"):
        transport.receive(link, target, None, {"stages": (0, 1), "extra_nbytes": 0})


def test_an_exact_message_is_its_length_and_coded_bytes_read_back_from_a_larger_receive():
    """What gloo does with a message shorter than its receive (the start filled, the rest untouched), by hand:
    the receiver reads the length, takes the message's bytes (the trailer its last 24) and decodes the values."""
    from megatron_tah.config import TahConfig
    from megatron_tah.link import frames
    from megatron_tah.link.transport import PipelineTransport
    from megatron_tah.megatron.places import STREAMS
    from megatron_tah.megatron.stats import Stats

    config = TahConfig(**CODECS, tah_entropy_coding=True, tah_emulate_bandwidth="1gbit", tah_emulate_wire="inbound")
    sender, receiver = (PipelineTransport(config, Stats(STREAMS)) for _ in range(2))
    x = torch.randn(64, 2, 128, generator=torch.Generator().manual_seed(1))  # codes enough to pay for their tables
    message, rest = sender.encode(sender.link("forward", "send", 1), x, exact=True)
    assert rest is None and message.numel() == frames.coded_length(message, 10**9) + 4 + 24  # length, bytes, trailer
    link = receiver.link("forward", "recv", 0)
    m = receiver.receive(link, torch.empty_like(x), None, {"stages": (0, 1), "extra_nbytes": 24, "exact": True})
    assert m.buf.numel() > message.numel() + 64
    m.buf.fill_(0xEE)
    m.buf[: message.numel()] = message
    assert m.read_length() == 0 and m.buf.numel() == message.numel()  # nothing follows; the message's own length
    m.read()
    assert m.trailer == bytes(message[-24:].tolist())
    receiver._decode(m)
    codec = sender.link("forward", "send", 1).codec
    assert torch.equal(m.target, codec.decode(codec.encode(x), x.shape, x.dtype))  # the codec's values exactly
    with pytest.raises(RuntimeError, match="needs a backend that takes a message shorter than its receive"):
        link.steps[0].check_unbatched([0], exact=False)  # framed messages go on batched calls only
    link.steps[0].check_unbatched([0, 0], exact=True)


def test_both_stages_must_agree_and_auto_codes_judged_at_its_measured_rate():
    from megatron_tah.config import TahConfig
    from megatron_tah.link.handshake import config_record

    from megatron_tah.codecs.core import entropy

    coded, plain = config_record(TahConfig(**CODECS, tah_entropy_coding=True)), config_record(TahConfig(**CODECS))
    other = config_record(TahConfig(**CODECS, tah_entropy_coding=True, tah_entropy_coder="huffman"))
    by_ans = config_record(TahConfig(**CODECS, tah_entropy_coding=True, tah_entropy_coder="ans"))
    for direction in ("forward", "backward"):
        assert coded[direction][0] != plain[direction][0]  # a neighbour without it is a CodecMismatchError
        assert coded[direction][0] != other[direction][0]  # ... and one with another coder
        assert coded[direction][1] == plain[direction][1] + \
            f", entropy-coded by {entropy.coder_identity(entropy.DEFAULT_CODER)}"
        assert "zstd (frame format" in coded[direction][1] and other[direction][1].endswith("by huffman (torch)")
        assert "constriction " in by_ans[direction][1] and by_ans[direction][0] != coded[direction][0]
    both_auto = TahConfig(tah_forward_codec="auto", tah_backward_codec="auto", tah_entropy_coding=True,
                          tah_entropy_when="auto")  # the rate auto measures judges the coder
    assert both_auto.link_rate_bps is None and config_record(both_auto)["forward"][1].endswith(
        f", entropy-coded by {entropy.coder_identity(entropy.DEFAULT_CODER)}")
    with pytest.raises(ValueError, match="or let auto measure it"):  # a fixed direction has no rate to judge by
        TahConfig(tah_forward_codec="auto", tah_entropy_coding=True, tah_entropy_when="auto")


def test_frame_sizes_follow_the_links_recent_coded_sizes_within_the_capacity():
    from megatron_tah.link import frames

    sizes = frames.FrameSizes()
    key = ("hadint", 1, (64, 2, 128), torch.bfloat16)
    assert sizes.size(key, 5000) == 5000  # no history: the coder's most
    for used in (1000, 1100, 900):
        sizes.record(key, used)
    assert sizes.size(key, 5000) == math.ceil(1100 * (1 + frames.MARGIN) / frames.ROUND) * frames.ROUND == 1152
    assert sizes.size(key, 1000) == 1000  # never above the capacity
    assert sizes.size(("none",) + key[1:], 7000) == 7000  # another codec: its own history
    for _ in range(frames.WINDOW):
        sizes.record(key, 500)  # the 1100 has left the window
    assert sizes.size(key, 5000) == 512


def test_a_frame_carries_its_length_and_an_overflow_the_rest():
    from megatron_tah.codecs import WireFormatError
    from megatron_tah.link import frames

    coded = torch.arange(100, dtype=torch.uint8)
    fitting, rest = frames.frame(coded, 128)
    assert rest is None and fitting.numel() == 128 and not fitting[104:].any()
    assert frames.coded_length(fitting, 200) == 100
    assert torch.equal(frames.unframe(fitting, 100, None), coded)
    short, rest = frames.frame(coded, 64)
    assert short.numel() == 64 and rest.numel() == 100 + 4 - 64
    assert frames.coded_length(short, 200) == 100
    assert torch.equal(frames.unframe(short, 100, rest), coded)
    with pytest.raises(WireFormatError, match="more than the coder's most"):
        frames.coded_length(fitting, 64)
    with pytest.raises(WireFormatError, match="announced 100"):
        frames.unframe(short, 100, rest[:-1])
    with pytest.raises(WireFormatError, match="nothing follows"):
        frames.unframe(short, 100, None)


def test_the_docs_and_the_flag_state_the_frames_sizing_rule():
    """DESIGN.md, CODECS.md and the flag's help describe the sizing ``frames.py`` does."""
    import pathlib

    from megatron_tah.link import frames

    docs = pathlib.Path(__file__).resolve().parents[2] / "docs"
    design = " ".join((docs / "DESIGN.md").read_text().split())
    assert (f"the largest coded size of the link's last {frames.WINDOW} messages of that codec and shape, plus "
            f"{frames.MARGIN:.0%}, rounded up to {frames.ROUND} bytes") in design
    codecs = " ".join((docs / "CODECS.md").read_text().split())
    assert f"the coded sizes of the link's last {frames.WINDOW} messages plus {frames.MARGIN:.0%}" in codecs
    flags = " ".join((docs / "FLAGS.md").read_text().split())  # the flag's help (scripts/write_flags.py --check)
    assert "On gloo each message goes at its own length, on NCCL in agreed frames" in flags  # the rule: CODECS.md


def _send_and_read_back(config, x):
    """One forward message through a sender's steps, read back by a receiver: (its coded bytes, the values)."""
    from megatron_tah.link import frames
    from megatron_tah.link.transport import PipelineTransport
    from megatron_tah.megatron.places import STREAMS
    from megatron_tah.megatron.stats import Stats

    sender, receiver = (PipelineTransport(config, Stats(STREAMS)) for _ in range(2))
    message, _ = sender.encode(sender.link("forward", "send", 1), x, exact=True)
    m = receiver.receive(receiver.link("forward", "recv", 0), torch.empty_like(x), None,
                         {"stages": (0, 1), "extra_nbytes": 0, "exact": True})
    m.buf[: message.numel()] = message
    m.read()
    receiver._decode(m)
    return frames.coded_length(message, 10**9), m.target, sender.link("forward", "send", 1)


@pytest.mark.parametrize("rate, pays", [("100kbit", True), ("100gbit", False)])
def test_auto_codes_a_links_messages_only_where_the_saved_wire_time_exceeds_the_coders(rate, pays):
    from megatron_tah.codecs.core import entropy
    from megatron_tah.config import TahConfig

    config = TahConfig(**CODECS, tah_entropy_coding=True, tah_entropy_when="auto", tah_link_rate=rate)
    x = torch.randn(256, 1, 576, generator=torch.Generator().manual_seed(2)) * torch.linspace(0.1, 3, 576)
    coded_nbytes, values, link = _send_and_read_back(config, x)
    codec = link.codec
    uncoded = entropy.capacity_nbytes(codec, tuple(x.shape), torch.float32)
    numbers = link.steps[0].rule.last
    assert numbers["pays"] is pays and numbers["rate_bps"] == {"100kbit": 1e5, "100gbit": 1e11}[rate]
    assert (numbers["saved_s"] > numbers["encode_s"] + numbers["decode_s"]) is pays
    assert numbers["coded"] < numbers["raw"] == uncoded  # coding saves bytes either way; time decides
    assert (coded_nbytes < uncoded) if pays else (coded_nbytes == uncoded)  # sent coded, or every section raw
    assert torch.equal(values, codec.decode(codec.encode(x), x.shape, x.dtype))  # the receiver reads both


def test_an_auto_link_end_judges_the_coder_at_the_rate_auto_measured_and_a_given_rate_wins():
    import types

    from megatron_tah.config import TahConfig
    from megatron_tah.link.transport import PipelineTransport
    from megatron_tah.megatron.places import STREAMS
    from megatron_tah.megatron.stats import Stats

    config = TahConfig(tah_forward_codec="auto", tah_backward_codec="auto", tah_backend="torch",
                       tah_entropy_coding=True, tah_entropy_when="auto")
    link = PipelineTransport(config, Stats(STREAMS)).link("forward", "send", 1)
    rule = link.steps[0].rule
    assert link.auto is not None and link.auto.rate is None and rule.rate_bps is None  # not measured: coded
    link.auto.rate = types.SimpleNamespace(rate_bps=2.5e6)
    assert rule.rate_bps == 2.5e6 and rule.judge(1000, 500, 0.0, 0.0)["rate_bps"] == 2.5e6
    given = TahConfig(**{**{f: getattr(config, f) for f in ("tah_forward_codec", "tah_backward_codec", "tah_backend",
                                                             "tah_entropy_coding", "tah_entropy_when")},
                         "tah_link_rate": "100mbit"})
    assert PipelineTransport(given, Stats(STREAMS)).link("forward", "send", 1).steps[0].rule.rate_bps == 1e8


def test_coding_left_on_where_it_does_not_pay_warns_with_the_numbers():
    from megatron_tah.codecs.core import entropy
    from megatron_tah.config import TahConfig

    config = TahConfig(**CODECS, tah_entropy_coding=True, tah_link_rate="100gbit")
    x = torch.randn(256, 1, 576, generator=torch.Generator().manual_seed(3))
    with pytest.warns(UserWarning, match=r"--tah-entropy-coding on the forward link with rank 1 does not pay: it saves "
                      r"[\d,]+ of [\d,]+ bytes per message, [\d.]+ ms at 1e\+05 Mbit/s, and costs [\d.]+ ms"):
        coded_nbytes, values, link = _send_and_read_back(config, x)
    assert coded_nbytes < entropy.capacity_nbytes(link.codec, tuple(x.shape), torch.float32)  # coded all the same


def test_auto_needs_the_coding_and_a_link_rate():
    from megatron_tah.config import TahConfig

    with pytest.raises(ValueError, match="needs tah_entropy_coding"):
        TahConfig(**CODECS, tah_entropy_when="auto", tah_link_rate="1gbit")
    with pytest.raises(ValueError, match="give tah_link_rate"):
        TahConfig(**CODECS, tah_entropy_coding=True, tah_entropy_when="auto")
    assert TahConfig(**CODECS, tah_entropy_coding=True, tah_entropy_when="auto",
                     tah_emulate_bandwidth="10mbit").link_rate_bps == 1e7


def _handshake_with_coder(rank, world_size):
    """Each rank's start-up check with its own coder (rank 0 ans, rank 1 huffman): the message it raises."""
    from megatron_tah.config import TahConfig
    from megatron_tah.link.handshake import CodecMismatchError, check_group

    config = TahConfig(**CODECS, tah_entropy_coding=True, tah_entropy_coder=("ans", "huffman")[rank])
    try:
        check_group(config, torch.distributed.group.WORLD, torch.device("cpu"), lambda work, *_: work.wait())
    except CodecMismatchError as err:
        return str(err)
    return None


def test_stages_with_different_coders_stop_at_start_up_naming_both():
    from megatron_tah.codecs.core import entropy

    messages = run_distributed(_handshake_with_coder, 2, timeout=120)
    for rank, message in enumerate(messages):
        assert message is not None and "use different forward codecs" in message
        assert f"entropy-coded by {entropy.coder_identity('ans')}" in message and "by huffman (torch)" in message
