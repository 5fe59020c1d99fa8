"""``--tah-*-codec auto`` on the pipeline's links (``megatron/auto_link.py``): the lockstep protocol
between a sender's and a receiver's ``AutoEnd`` in one process with fake link rates and codec costs,
the flags, the handshake record and the log line; the real transport at PP=2 is in
``test_auto_pipeline.py``."""

from __future__ import annotations

import pytest
import torch

from megatron_tah.codecs import WireFormatError
from megatron_tah.config import TahConfig
from megatron_tah.megatron.auto_codec import CandidateCost, Chooser, CodecCostTable, LinkRate
from megatron_tah.megatron.auto_link import ANNOUNCEMENT_NBYTES, AutoEnd
from megatron_tah.megatron.handshake import config_record
from megatron_tah.megatron.stats import Stats, format_for_log

SHAPE = (32, 2, 64)
CANDIDATES = "none,fp8,paper"


def _config(**kw) -> TahConfig:
    return TahConfig(**{"tah_forward_codec": "auto", "tah_backend": "torch", "tah_auto_candidates": CANDIDATES,
                        "tah_auto_interval": 1, **kw})


def _fake(end: AutoEnd, rates: list[float]) -> None:
    """Give a sender fixed costs (none: free, 4 MB on the wire; fp8: 2 MB, 1 ms; paper: 1 MB, 2 ms) and
    scripted link rates, one per measurement."""
    costs = {"none": (0.0, 4_000_000), "fp8": (1e-3, 2_000_000), "paper": (2e-3, 1_000_000)}
    table = CodecCostTable.from_costs([
        CandidateCost(name, end.codecs[name].codec_id, end.codecs[name].config_digest(), seconds / 2, seconds / 2,
                      nbytes, {"none": 0.0, "fp8": 0.01, "paper": 0.1}[name])
        for name, (seconds, nbytes) in costs.items()])
    end.table, end.chooser = table, Chooser(table, end.settings)
    script = iter(rates)
    end.meter.measure = lambda: LinkRate(next(script), 0.0, 10)


def _exchange(sender: AutoEnd, receiver: AutoEnd, iteration: int, x: torch.Tensor, messages: int = 2):
    """``messages`` messages of ``iteration`` from sender to receiver; returns (sender's codec, receiver's
    codec, the decoded tensors)."""
    decoded = []
    for _ in range(messages):
        sender.prepare(x)
        codec = sender.begin(iteration)
        message = sender.sent(codec.encode(x), 0.0)
        theirs = receiver.begin(iteration)
        assert message.numel() == theirs.wire_nbytes(x.shape, x.dtype) + ANNOUNCEMENT_NBYTES
        decoded.append(theirs.decode(message[:-ANNOUNCEMENT_NBYTES], x.shape, x.dtype))
        receiver.received(message[-ANNOUNCEMENT_NBYTES:])
    return sender.current, receiver.current, decoded


def test_the_receiver_switches_with_the_sender_one_iteration_after_the_announcement():
    cfg = _config()
    sender, receiver = AutoEnd(cfg, "forward", "send"), AutoEnd(cfg, "forward", "recv")
    x = torch.randn(SHAPE)
    sender.prepare(x)  # measures the real candidates once; then fake costs and rates decide
    # 1 Mbit/s: paper (fewest bytes) wins; 100 Gbit/s: none (no codec time) once two measurements agree.
    _fake(sender, [1e6, 1e6, 1e11, 1e11] + [1e11] * 6)
    seen = [_exchange(sender, receiver, k, x)[:2] for k in range(7)]
    # The first measurement (iteration 0's boundary: the fake meter always has one) chooses freely:
    # paper; 1e11 at iterations 2 and 3 switches at the second, effective from iteration 4.
    assert [s for s, _ in seen] == ["paper"] * 4 + ["none"] * 3
    assert [r for _, r in seen] == [s for s, _ in seen]  # lockstep
    _, _, decoded = _exchange(sender, receiver, 7, x, 1)
    assert torch.equal(decoded[0], x.to(decoded[0].dtype))  # none: the bits as sent


def test_a_buffer_of_another_codec_than_the_announced_one_is_an_error():
    cfg = _config()
    sender, receiver = AutoEnd(cfg, "forward", "send"), AutoEnd(cfg, "forward", "recv")
    for codec in receiver.codecs.values():
        codec.defer_checks("full")
    x = torch.randn(SHAPE)
    _exchange(sender, receiver, 0, x, 1)
    fp8 = sender.codecs["fp8"].encode(x)
    with pytest.raises(WireFormatError):
        receiver.codec.decode(torch.cat([fp8, fp8])[: receiver.codec.wire_nbytes(SHAPE, x.dtype)], SHAPE, x.dtype)


def test_announcements_that_disagree_or_name_another_iteration_are_errors():
    cfg = _config()
    x = torch.randn(SHAPE)
    sender, receiver = AutoEnd(cfg, "forward", "send"), AutoEnd(cfg, "forward", "recv")
    _exchange(sender, receiver, 0, x, 1)
    sender.next, sender._trailer = "fp8", None  # a sender changing its mind within an iteration
    _exchange(sender, receiver, 0, x, 1)
    with pytest.raises(WireFormatError, match="disagree"):
        receiver.begin(1)
    sender, receiver = AutoEnd(cfg, "forward", "send"), AutoEnd(cfg, "forward", "recv")
    _exchange(sender, receiver, 5, x, 1)
    receiver.iteration = 6  # out of step: the trailer names iteration 6, the receiver expects 7
    with pytest.raises(WireFormatError, match="out of step"):
        receiver.begin(7)
    receiver = AutoEnd(cfg, "forward", "recv")
    receiver.begin(0)
    receiver.received(torch.zeros(ANNOUNCEMENT_NBYTES, dtype=torch.uint8))
    with pytest.raises(WireFormatError, match="not an auto-codec announcement"):
        receiver.begin(1)


def test_resume_from_state_dicts_equals_an_uninterrupted_run():
    cfg = _config(tah_auto_candidates="none,fp8,paper,hadint4", tah_backward_codec="auto",
                  tah_auto_max_error=0.2)
    rates = [1e6, 1e11, 1e11, 1e6, 1e11, 1e11, 1e11, 1e11]  # one per iteration (interval 1)
    x = torch.randn(SHAPE)

    def ends(script):
        sender, receiver = AutoEnd(cfg, "backward", "send"), AutoEnd(cfg, "backward", "recv")
        sender.prepare(x)
        _fake(sender, script)
        return sender, receiver

    def run(sender, receiver, iterations, start=0):
        out = [_exchange(sender, receiver, k, x) for k in range(start, start + iterations)]
        return [(s, r, [d.tolist() for d in decoded]) for s, r, decoded in out]

    full = run(*ends(rates), 8)
    sender, receiver = ends(rates[:4])
    first = run(sender, receiver, 4)
    saved = {"send": sender.state_dict(), "recv": receiver.state_dict()}
    sender, receiver = ends(rates[4:])  # a new process: fresh ends, then the checkpoint
    sender.load_state_dict(saved["send"])
    receiver.load_state_dict(saved["recv"])
    second = run(sender, receiver, 4, start=4)
    assert first + second == full  # codecs and decoded bits (hadint4's stochastic rounding continues)
    assert [s for s, _, _ in full] == ["paper", "paper", "paper", "none", "none", "none", "none", "none"]


def test_flags_validate_and_the_handshake_record_covers_the_candidates():
    assert TahConfig().tah_auto_candidates == "none,fp8,paper,hadint4,lowrank"
    for bad in ({"tah_auto_interval": 0}, {"tah_auto_max_error": -1.0}, {"tah_auto_candidates": "none,int4"},
                {"tah_auto_candidates": "none,fp8"}):  # no paper and no max_error: no floor
        with pytest.raises(ValueError, match="tah_auto"):
            TahConfig(tah_forward_codec="auto", **bad)
    assert TahConfig(tah_forward_codec="auto", tah_auto_candidates="none,fp8", tah_auto_max_error=0.05)
    a, b = _config(), _config(tah_auto_candidates="none,paper")
    assert config_record(a)["forward"] != config_record(b)["forward"]
    assert config_record(a)["backward"] == config_record(b)["backward"]
    assert config_record(a)["forward"][1] == "auto(none, fp8, paper)"
    assert a.forward_codec().name == "tah" and _config(tah_auto_candidates="fp8,none",
                                                        tah_auto_max_error=0.1).forward_codec().name == "fp8"


def test_the_log_line_names_each_links_codec_and_rate():
    stats = Stats()
    stats.record_auto(1, "paper", 1.02e6, 3e4)
    collected = stats.collect()
    assert collected["auto"] == {(0, 1): {"codec": "paper", "rate_bps": 1.02e6, "spread_bps": 3e4}}
    for d in ("forward", "backward"):
        collected[d]["messages"] = 0
    assert "tah auto 0->1: paper at 1.02 Mbit/s" in format_for_log(collected)
    stats.record_auto(1, "none", None, None)
    assert "tah auto 0->1: none at rate not measured yet" in format_for_log(stats.collect())


def test_only_receives_feed_a_senders_rate_meter(monkeypatch):
    """A send completes once the socket buffers hold it: its time is not the link's. A receive on the link
    from peer p feeds the meter of this rank's auto sender to p (the reverse direction's)."""
    import megatron_tah
    from megatron_tah.megatron.registry import REGISTRY

    megatron_tah.install(tah_forward_codec="auto", tah_backward_codec="auto", tah_backend="torch")
    try:
        transport = REGISTRY.pipeline
        send_fwd = transport.link("forward", "send", 1)
        recv_bwd = transport.link("backward", "recv", 1)
        seen = send_fwd.auto.meter.seen
        transport.record_transfer(send_fwd, 1 << 20, 1e-6)  # a buffered send: ignored
        assert send_fwd.auto.meter.seen == seen
        transport.record_transfer(recv_bwd, 1 << 20, 0.5)  # the gradients from peer 1: the link's rate
        assert send_fwd.auto.meter.seen == seen + 1
    finally:
        megatron_tah.uninstall()
