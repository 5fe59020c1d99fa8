"""``--tah-eval-forward-bits``: evaluations (and serving) through the pipeline at other forward bits than training.

Its rules (a forward codec that takes bits, not auto nor AQ-SGD, evaluations that go through the codec, bits the
codec takes); a forward link end's evaluation codec, which both ends of a link use inside an evaluation through
the codecs (never outside one, in an uncompressed one or in the warm-up; gradients are unaffected); the
handshake's record; and the depth study's emulated boundaries, which follow the same rule.
"""

from __future__ import annotations

import pytest
import torch

from megatron_tah.config import TahConfig
from megatron_tah.link.handshake import config_record
from megatron_tah.link.transport import PipelineTransport
from megatron_tah.megatron.places import STREAMS
from megatron_tah.megatron.stats import Stats

SHAPE = (32, 2, 128)
TRAINING = {"tah_forward_codec": "fixedpoint", "tah_forward_bits": 3, "tah_tile_size": 64,
            "tah_backward_codec": "fixedpoint", "tah_backward_bits": 4, "tah_backward_tile_size": 32,
            "tah_backend": "torch"}


def _config(**fields) -> TahConfig:
    return TahConfig(**{**TRAINING, "tah_eval_forward_bits": 8, **fields})


# ----- the rules -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, message", [
    ({"tah_forward_codec": "tah"}, "tah_eval_forward_bits = 8 with tah_forward_codec = 'tah': it takes no bits"),
    ({"tah_forward_codec": "fp8"}, "tah_forward_codec = 'fp8': it takes no bits"),
    ({"tah_forward_codec": "none"}, "tah_forward_codec = 'none': it takes no bits"),
    ({"tah_forward_codec": "auto"}, "tah_eval_forward_bits = 8 with tah_forward_codec = 'auto'"),
    ({"tah_forward_codec": "aqsgd", "tah_backward_codec": "none"}, "tah_eval_forward_bits = 8 with "
                                                                   "tah_forward_codec = 'aqsgd': its per-sample"),
    ({"tah_eval_traffic": "uncompressed"}, "tah_eval_forward_bits = 8 with tah_eval_traffic = 'uncompressed'"),
    ({"tah_eval_forward_bits": 1}, r"tah_eval_forward_bits = 1: bits must be an integer in \[2, 8\]"),
    ({"tah_eval_forward_bits": 9}, r"tah_eval_forward_bits = 9: bits must be an integer in \[2, 8\]"),
])
def test_each_rule_names_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        _config(**fields)
    with pytest.raises(ValueError, match=r"tah_eval_forward_bits = 2: bits must be an integer in \[3, 8\]"):
        TahConfig(tah_preset="lowrank", tah_eval_forward_bits=2)  # lowrank's residual: its own range


def test_valid_settings_build_the_evaluation_codec():
    assert TahConfig(**TRAINING).eval_forward_codec() is None  # unset: evaluations at the training bits
    assert _config().eval_forward_codec().bits == 8 and _config().forward_codec().bits == 3
    assert _config(tah_eval_traffic="both").eval_forward_codec().bits == 8
    lowrank = TahConfig(tah_preset="lowrank", tah_eval_forward_bits=5)
    assert (lowrank.eval_forward_codec().name, lowrank.eval_forward_codec().bits) == ("lowrank", 5)
    # with per-boundary bits the evaluation bits replace every boundary's
    per_boundary = TahConfig(tah_forward_codec="channel", tah_boundary_bits="3,6", tah_eval_forward_bits=8)
    assert per_boundary.forward_codec(0, 2).bits == 3 and per_boundary.eval_forward_codec().bits == 8


def test_the_flag_parses():
    import argparse

    from megatron_tah.megatron.arguments import add_tah_arguments

    parser = add_tah_arguments(argparse.ArgumentParser())
    assert parser.parse_args([]).tah_eval_forward_bits is None
    args = parser.parse_args(["--tah-forward-codec", "channel", "--tah-eval-forward-bits", "6"])
    assert args.tah_eval_forward_bits == 6 and TahConfig.from_args(args).eval_forward_codec().bits == 6


# ----- the link: both ends, per message -----------------------------------------------------------------
def _pair(config: TahConfig, iteration=lambda: None):
    """A sending stage 0 and a receiving stage 1 of a two-stage pipeline, in one process."""
    return tuple(PipelineTransport(config, Stats(STREAMS), iteration=iteration, depth=lambda: 2, stage=lambda: s)
                 for s in (0, 1))


def _through(sender, receiver, x, direction="forward"):
    """One message from ``sender`` to ``receiver`` (forward: stage 0 to 1; backward: 1 to 0), as the transport
    encodes and decodes it: (its codec buffer's bytes, what the receiver decoded, the codec each end chose)."""
    if direction == "backward":
        sender, receiver = receiver, sender
    send = sender.link(direction, "send", 1 if direction == "forward" else 0)
    recv = receiver.link(direction, "recv", 0 if direction == "forward" else 1)
    buf, rest = sender.encode(send, x)
    assert rest is None
    target = torch.empty_like(x)
    message = receiver.receive(recv, target, None, {"extra_nbytes": 0})
    assert message.buf.numel() == buf.numel()  # the receiver posts the bytes the sender's codec made
    message.buf.copy_(buf)
    receiver._decode(message)
    return buf.numel(), target, (sender.traffic.codec(send), receiver.traffic.codec(recv))


def _error(x, y):
    return float((y - x).norm() / x.norm())


def test_an_evaluation_through_the_codecs_sends_activations_at_the_evaluation_bits():
    config = _config()
    sender, receiver = _pair(config)
    x = torch.randn(SHAPE)
    training, evaluation = config.forward_codec(), config.eval_forward_codec()
    assert training.wire_nbytes(SHAPE, x.dtype) < evaluation.wire_nbytes(SHAPE, x.dtype)
    nbytes, trained, codecs = _through(sender, receiver, x)
    assert nbytes == training.wire_nbytes(SHAPE, x.dtype) and {c.bits for c in codecs} == {3}
    s, r = sender, receiver
    with s.traffic.evaluation(uncompressed=False), r.traffic.evaluation(uncompressed=False):
        nbytes, evaluated, codecs = _through(s, r, x)
        assert nbytes == evaluation.wire_nbytes(SHAPE, x.dtype) and {c.bits for c in codecs} == {8}
        assert _error(x, evaluated) < _error(x, trained) / 4  # 8 bits: a much smaller round-trip error
        assert torch.equal(evaluated, evaluation.decode(evaluation.encode(x), SHAPE, x.dtype))
        # gradients are never evaluated: the training codec still
        nbytes, _, codecs = _through(s, r, x, "backward")
        assert nbytes == config.backward_codec().wire_nbytes(SHAPE, x.dtype) and {c.bits for c in codecs} == {4}
        with s.traffic.evaluation(uncompressed=True), r.traffic.evaluation(uncompressed=True):
            nbytes, raw, codecs = _through(s, r, x)
            assert {c.name for c in codecs} == {"none"} and torch.equal(raw, x)
        assert _through(s, r, x)[0] == evaluation.wire_nbytes(SHAPE, x.dtype)  # back to the evaluation's
    nbytes, after, _ = _through(sender, receiver, x)  # after it: the training codec again
    assert nbytes == training.wire_nbytes(SHAPE, x.dtype) and torch.equal(after, trained)


def test_without_the_flag_evaluations_go_through_the_training_codec():
    sender, receiver = _pair(TahConfig(**TRAINING))
    x = torch.randn(SHAPE)
    assert sender.link("forward", "send", 1).eval_codec is None
    with sender.traffic.evaluation(uncompressed=False), receiver.traffic.evaluation(uncompressed=False):
        nbytes, _, codecs = _through(sender, receiver, x)
    assert nbytes == TahConfig(**TRAINING).forward_codec().wire_nbytes(SHAPE, x.dtype)
    assert {c.bits for c in codecs} == {3}


def test_the_warm_up_still_sends_uncompressed_in_an_evaluation():
    iteration = [0]
    sender, receiver = _pair(_config(tah_warmup_iters=2), iteration=lambda: iteration[0])
    x = torch.randn(SHAPE)
    with sender.traffic.evaluation(uncompressed=False), receiver.traffic.evaluation(uncompressed=False):
        nbytes, y, codecs = _through(sender, receiver, x)
        assert {c.name for c in codecs} == {"none"} and torch.equal(y, x)
        iteration[0] = 2
        assert {c.bits for c in _through(sender, receiver, x)[2]} == {8}


def test_neighbours_with_other_evaluation_bits_are_refused():
    """The handshake's record (what neighbouring stages compare: a difference is a CodecMismatchError) differs
    when only the evaluation bits differ."""
    plain, six, eight = config_record(TahConfig(**TRAINING)), config_record(_config(tah_eval_forward_bits=6)), \
        config_record(_config())
    assert len({r["forward"][0] for r in (plain, six, eight)}) == 3
    assert "evaluations at 8 bits forward" in eight["forward"][1]
    assert config_record(_config()) == eight


# ----- the depth study's emulated boundaries -------------------------------------------------------------
def test_the_emulated_boundaries_evaluate_through_the_evaluation_codec(monkeypatch):
    import contextlib

    from benchmarks.depth import boundaries as module

    fields = {**TRAINING, "tah_eval_forward_bits": 8}
    emulated = module.Boundaries([2], fields, fields)
    captured = {}
    monkeypatch.setattr(module.Patches, "wrap", lambda self, where, name, make: captured.setdefault(name, make))
    emulated.install()
    evaluation = captured["evaluation"](lambda uncompressed: contextlib.nullcontext())  # pipeline_parallel's, wrapped
    x = torch.randn(SHAPE)
    training, at_eight = TahConfig(**TRAINING).forward_codec(), _config().eval_forward_codec()

    def forward():
        return emulated.round_trip(2, "forward", x)

    assert torch.equal(forward(), training.decode(training.encode(x), SHAPE, x.dtype))
    with evaluation(False):
        assert torch.equal(forward(), at_eight.decode(at_eight.encode(x), SHAPE, x.dtype))
        backward = TahConfig(**TRAINING).backward_codec()
        assert torch.equal(emulated.round_trip(2, "backward", x), backward.decode(backward.encode(x), SHAPE, x.dtype))
        with evaluation(True):
            assert torch.equal(forward(), x)
        assert emulated.evaluating and not emulated.uncompressed
    assert not emulated.evaluating
    assert torch.equal(forward(), training.decode(training.encode(x), SHAPE, x.dtype))
    unset = module.Boundaries([2], TRAINING, TRAINING)
    unset.evaluating = True
    assert torch.equal(unset.round_trip(2, "forward", x), training.decode(training.encode(x), SHAPE, x.dtype))


# ----- a 2-stage gloo pipeline ------------------------------------------------------------------------
def _pipeline(rank, world_size):
    """Every rank: one step (lr 0) trained, one inside an evaluation through the codecs, one inside an
    uncompressed one (bytes sent to each rank and the last stage's losses of each), then a start with the last
    stage given other evaluation bits (each rank's mismatch message)."""
    import megatron_tah
    from megatron_tah.link.handshake import CodecMismatchError
    from megatron_tah.megatron import pipeline_parallel
    from megatron_tah.megatron.cpu_shims import apply_cpu_shims
    from tests.megatron.test_patch_pipeline import _build, _train, _WireSpy

    apply_cpu_shims()
    fields = {"tah_forward_codec": "channel", "tah_forward_bits": 4, "tah_backend": "torch"}
    megatron_tah.install(**fields, tah_eval_forward_bits=8)
    chunks = _build(world_size, None, True, False, world_size)
    result = {}
    for name, evaluation in (("trained", None), ("evaluated", False), ("uncompressed", True)):
        with _WireSpy() as spy:
            if evaluation is None:
                losses, _ = _train(chunks, 1)
            else:
                with pipeline_parallel.evaluation(uncompressed=evaluation):
                    losses, _ = _train(chunks, 1)
        result[name] = {"sent": spy.bytes_to, "losses": losses[0]}
    megatron_tah.uninstall()
    megatron_tah.install(**fields, tah_eval_forward_bits=8 if rank == 0 else 6)
    try:
        _train(_build(world_size, None, True, False, world_size), 1)
        result["mismatch"] = "no error"
    except CodecMismatchError as err:
        result["mismatch"] = str(err)
    finally:
        megatron_tah.uninstall()
    return result


@pytest.mark.distributed
def test_a_two_stage_pipeline_evaluates_at_the_evaluation_bits():
    from tests.helpers.dist_utils import run_distributed
    from megatron_tah.codecs import get_codec
    from tests.megatron.test_patch_pipeline import ENV, HIDDEN, MICRO_BATCH, MICRO_BATCHES, SEQ

    results = run_distributed(_pipeline, 2, env=ENV, timeout=600)
    shape = (SEQ, MICRO_BATCH, HIDDEN)
    raw = MICRO_BATCHES * get_codec("none").wire_nbytes(shape, torch.float32)
    for name, bits in (("trained", 4), ("evaluated", 8)):
        assert results[0][name]["sent"][1] == MICRO_BATCHES * get_codec("channel", bits=bits).wire_nbytes(
            shape, torch.float32), name
        assert results[1][name]["sent"][0] == raw, name  # gradients: uncompressed, as configured
    assert results[0]["uncompressed"]["sent"][1] == raw
    losses = {name: torch.tensor(results[1][name]["losses"]) for name in ("trained", "evaluated", "uncompressed")}
    gap = {name: float((losses[name] - losses["uncompressed"]).abs().sum()) for name in ("trained", "evaluated")}
    assert gap["evaluated"] < gap["trained"], gap  # the same weights: 8 bits come closer to the raw activations'
    for rank in range(2):
        message = results[rank]["mismatch"]
        assert "forward codecs" in message and "evaluations at" in message, (rank, message)
