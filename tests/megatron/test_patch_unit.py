"""Unit tests of the pipeline transport (``pipeline_parallel``): install/uninstall, version gate, link ends,
sample-id queue, link emulation."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import megatron_tah
from megatron_tah.link import handshake
from megatron_tah.megatron import pipeline_parallel, version
from megatron_tah.megatron.patching import MARKER
from megatron_tah.megatron.pipeline_parallel import installed_transport
from megatron_tah.megatron.registry import REGISTRY
from megatron_tah.link.emulate import LinkEmulator

p2p = pytest.importorskip("megatron.core.pipeline_parallel.p2p_communication")


@pytest.fixture(autouse=True)
def _clean():
    originals = {n: getattr(p2p, n) for n in version.TRANSPORTS}
    yield originals
    megatron_tah.uninstall()
    for n, fn in originals.items():
        setattr(p2p, n, fn)


def test_install_replaces_both_transports_and_keeps_originals(_clean):
    megatron_tah.install(tah_preset="paper")
    assert pipeline_parallel.is_installed()
    for name in version.TRANSPORTS:
        fn = getattr(p2p, name)
        assert fn is not _clean[name] and getattr(fn, MARKER)
        assert fn.__wrapped__ is _clean[name]
    cfg = REGISTRY.config
    assert (cfg.tah_forward_codec, cfg.tah_backward_codec, cfg.tah_backward_bits) == ("tah", "fixedpoint", 6)


def test_install_is_idempotent_and_reconfigures_without_rewrapping(_clean):
    megatron_tah.install(tah_forward_codec="none")
    first = {n: getattr(p2p, n) for n in version.TRANSPORTS}
    megatron_tah.install(tah_forward_codec="none")
    assert {n: getattr(p2p, n) for n in version.TRANSPORTS} == first
    megatron_tah.install(megatron_tah.TahConfig(tah_forward_codec="fixedpoint"))
    assert REGISTRY.config.tah_forward_codec == "fixedpoint"
    for name in version.TRANSPORTS:  # still one layer deep: the original, not a patched function
        assert getattr(p2p, name).__wrapped__ is _clean[name]


def test_uninstall_restores_the_exact_originals(_clean):
    megatron_tah.install()
    megatron_tah.uninstall()
    assert not pipeline_parallel.is_installed() and REGISTRY.config is None
    for name in version.TRANSPORTS:
        assert getattr(p2p, name) is _clean[name]
    megatron_tah.uninstall()  # a second uninstall is a no-op
    assert all(getattr(p2p, n) is _clean[n] for n in version.TRANSPORTS)


def test_install_rejects_unknown_options_and_bad_values(_clean):
    with pytest.raises(ValueError, match="tah_forward_codex"):
        megatron_tah.install(tah_forward_codex="tah")
    with pytest.raises(ValueError, match="tah_forward_codec"):
        megatron_tah.install(tah_forward_codec="zip")
    assert all(getattr(p2p, n) is _clean[n] for n in version.TRANSPORTS)


def test_missing_transport_symbol_is_named(monkeypatch, _clean):
    monkeypatch.delattr(p2p, "_p2p_ops")
    with pytest.raises(RuntimeError, match="_p2p_ops"):
        megatron_tah.install()
    assert p2p._batched_p2p_ops is _clean["_batched_p2p_ops"]


def test_importing_the_package_does_not_import_megatron_core():
    code = "import sys, megatron_tah; megatron_tah.TahConfig; print('megatron' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_replaced_transport_kept_after_uninstall_raises(_clean):
    megatron_tah.install(tah_forward_codec="none")
    kept = p2p._batched_p2p_ops
    megatron_tah.uninstall()
    with pytest.raises(RuntimeError, match="not installed"):
        kept(tensor_send_prev=None, tensor_recv_prev=None, tensor_send_next=None,
             tensor_recv_next=None, group=None, prev_pipeline_rank=0, next_pipeline_rank=0)


def test_calls_without_tensors_post_nothing(_clean):
    megatron_tah.install(tah_forward_codec="none")
    kwargs = dict(tensor_send_prev=None, tensor_recv_prev=None, tensor_send_next=None, tensor_recv_next=None,
                  group=None, prev_pipeline_rank=0, next_pipeline_rank=0)
    assert p2p._batched_p2p_ops(**kwargs) == []


def test_one_transport_per_install_registered_as_the_pp_place(_clean):
    megatron_tah.install(tah_forward_codec="none", tah_backward_codec="fixedpoint", tah_backend="torch")
    transport = installed_transport()
    assert REGISTRY.places["pp"].transport is transport and REGISTRY.places["pp"].stats is REGISTRY.stats
    assert transport.stats is REGISTRY.stats and REGISTRY.stats.buffer_source == transport.states.buffer_nbytes
    link = transport.link("forward", "send", 3)
    assert transport.link("forward", "send", 3) is link and link.key == ("forward", "send", 3)
    assert transport.link("backward", "send", 3).codec.name == "fixedpoint" and link.codec.name == "none"
    megatron_tah.install(tah_forward_codec="fixedpoint", tah_backend="torch")  # another config: a fresh transport
    assert installed_transport() is not transport and transport.closed and not installed_transport().links
    megatron_tah.uninstall()
    assert installed_transport() is None and REGISTRY.places == {} and REGISTRY.stats.buffer_source is None


def test_sample_id_queue_is_fifo_and_validated(_clean):
    with pytest.raises(RuntimeError, match="not installed"):
        pipeline_parallel.push_sample_ids(torch.tensor([1, 2]))
    megatron_tah.install(tah_forward_codec="none")
    transport = installed_transport()
    pipeline_parallel.push_sample_ids(torch.tensor([1, 2]))
    pipeline_parallel.push_sample_ids(torch.tensor([3, 4], dtype=torch.int32))
    assert len(transport.sample_ids) == 2
    assert transport.sample_ids.pop(required=True).tolist() == [1, 2]
    popped = transport.sample_ids.pop(required=False)
    assert popped.tolist() == [3, 4] and popped.dtype == torch.long
    assert transport.sample_ids.pop(required=False) is None
    with pytest.raises(RuntimeError, match="push_sample_ids"):
        transport.sample_ids.pop(required=True)
    with pytest.raises(ValueError, match="1-D"):
        pipeline_parallel.push_sample_ids(torch.zeros(2, 2, dtype=torch.long))


class _FakeGroup:
    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def test_aqsgd_with_the_interleaved_schedule_is_refused(monkeypatch):
    from megatron.core import parallel_state

    aqsgd = megatron_tah.TahConfig(tah_forward_codec="aqsgd")
    handshake.check_schedule(aqsgd, _FakeGroup(1, 4), torch.zeros(1), None)  # 1F1B middle stage: fine
    with pytest.raises(RuntimeError, match="interleaved"):  # last stage sending "next" wraps around
        handshake.check_schedule(aqsgd, _FakeGroup(3, 4), torch.zeros(1), None)
    with pytest.raises(RuntimeError, match="not supported with the interleaved"):
        handshake.check_schedule(aqsgd, _FakeGroup(1, 4), None, torch.zeros(1), virtual_stages=2)
    handshake.check_schedule(megatron_tah.TahConfig(tah_preset="paper"), _FakeGroup(1, 4), None, torch.zeros(1), 2)
    # The pipeline place hands the transport Megatron's virtual stages (the link reads nothing of Megatron).
    monkeypatch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size", lambda: 2)
    assert pipeline_parallel.virtual_stages() == 2


class _FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_link_emulator_serialises_messages_and_adds_latency():
    clock = _FakeClock()
    emu = LinkEmulator(1e6, latency_s=0.01, clock=clock, sleep=clock.sleep)
    assert emu.complete((0, 1), 125_000, completed_at=0.0) == pytest.approx(1.0)  # 1 Mbit at 1 Mbit/s
    # A second message posted at t=0 on the same link waits for the first: done at 2 s.
    assert emu.complete((0, 1), 125_000, completed_at=0.0) == pytest.approx(1.0)
    assert clock.now == pytest.approx(2.0)
    # The other direction is its own link; the receiver also waits for the latency.
    assert emu.complete((1, 0), 125_000, completed_at=2.0, receiver=True) == pytest.approx(1.01)
    # Compute that outlasted the transfer: nothing left to wait.
    clock.now = 10.0
    assert emu.complete((2, 3), 125_000, completed_at=8.0) == 0.0
    assert emu.total_delay_s == pytest.approx(3.01)


def test_link_emulator_validates():
    with pytest.raises(ValueError, match="bandwidth"):
        LinkEmulator(0)
    with pytest.raises(ValueError, match="latency"):
        LinkEmulator(1e6, latency_s=-1)


def test_install_builds_an_emulator_from_the_config(_clean):
    megatron_tah.install(tah_emulate_bandwidth="100mbit", tah_emulate_latency_ms=5)
    emu = installed_transport().emulation
    assert emu.bandwidth_bps == 1e8 and emu.latency_s == pytest.approx(0.005)
    megatron_tah.install(tah_emulate_bandwidth=None)
    assert installed_transport().emulation is None


def test_warmup_sends_uncompressed_until_megatrons_iteration_reaches_it(monkeypatch, _clean):
    """--tah-warmup-iters: every link end uses the `none` codec while Megatron's args.curr_iteration is
    below it, then the configured codecs (whose state the warm-up leaves untouched)."""
    import types

    from megatron.training import global_vars

    megatron_tah.install(tah_preset="paper", tah_warmup_iters=2, tah_backend="torch")
    transport = installed_transport()
    with pytest.raises(RuntimeError, match="needs its training loop"):
        transport.traffic.codec(transport.link("forward", "send", 1))
    args = types.SimpleNamespace()  # before Megatron's loop sets curr_iteration: iteration 0
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    for iteration, want in ((None, "none"), (0, "none"), (1, "none"), (2, "tah"), (7, "tah")):
        if iteration is not None:
            args.curr_iteration = iteration
        assert transport.traffic.codec(transport.link("forward", "send", 1)).name == want
        assert transport.traffic.codec(transport.link("backward", "recv", 1)).name == ("none" if want == "none" else "fixedpoint")
    # Stages configured with different warm-ups disagree in the handshake record, in both directions.
    plain, warm = handshake.config_record(megatron_tah.TahConfig(tah_preset="paper")), handshake.config_record(
        megatron_tah.TahConfig(tah_preset="paper", tah_warmup_iters=2))
    assert all(plain[d][0] != warm[d][0] and warm[d][1].endswith("first 2 iterations uncompressed")
               for d in ("forward", "backward"))
    with pytest.raises(ValueError, match="aqsgd"):
        megatron_tah.TahConfig(tah_forward_codec="aqsgd", tah_warmup_iters=1)
    with pytest.raises(ValueError, match=">= 0"):
        megatron_tah.TahConfig(tah_warmup_iters=-1)


def test_evaluation_sends_uncompressed_only_when_asked(_clean):
    """Inside ``pipeline_parallel.evaluation(uncompressed=True)`` every link end uses `none`; outside it, or with
    uncompressed=False, the codecs; a failing evaluation restores the previous setting."""
    with pipeline_parallel.evaluation(uncompressed=True):  # not installed: nothing to switch
        pass
    megatron_tah.install(tah_preset="paper", tah_backend="torch")
    transport = installed_transport()
    with pipeline_parallel.evaluation(uncompressed=False):
        assert transport.traffic.codec(transport.link("forward", "send", 1)).name == "tah"
    with pytest.raises(KeyError):
        with pipeline_parallel.evaluation(uncompressed=True):
            assert transport.traffic.codec(transport.link("forward", "recv", 1)).name == "none" == transport.traffic.codec(transport.link("backward", "send", 0)).name
            with pipeline_parallel.evaluation(uncompressed=False):
                assert transport.traffic.codec(transport.link("forward", "recv", 1)).name == "tah"
            assert transport.traffic.eval_uncompressed
            raise KeyError("an evaluation that fails")
    assert not transport.traffic.eval_uncompressed and transport.traffic.codec(transport.link("forward", "recv", 1)).name == "tah"
    records = {mode: handshake.config_record(megatron_tah.TahConfig(tah_eval_traffic=mode))
               for mode in ("codec", "uncompressed", "both")}
    assert len({r["forward"][0] for r in records.values()}) == 3  # stages set differently are refused
    assert records["codec"] == handshake.config_record(megatron_tah.TahConfig())
    assert records["uncompressed"]["backward"][1].endswith("evaluations uncompressed")
    for mode in ("uncompressed", "both"):
        with pytest.raises(ValueError, match="aqsgd"):
            megatron_tah.TahConfig(tah_forward_codec="aqsgd", tah_eval_traffic=mode)
    with pytest.raises(ValueError, match="choose one of codec, uncompressed, both"):
        megatron_tah.TahConfig(tah_eval_traffic="raw")


@pytest.mark.parametrize("traffic", ["codec", "uncompressed", "both"])
def test_logging_runs_megatrons_evaluate_per_eval_traffic(_clean, traffic):
    """The wrapper of Megatron's evaluate: which passes run, on which batches, with which traffic."""
    import types

    from megatron.training import global_vars, training

    from megatron_tah.megatron import run_log as tah_logging
    from megatron_tah.megatron import plugin

    original = training.evaluate
    passes = []

    def fake_evaluate(step, data_iterator, model, *rest, **kwargs):
        batches = [next(data_iterator) for _ in range(3)]
        global_vars.get_args().consumed_valid_samples += 3
        passes.append((installed_transport().traffic.eval_uncompressed, batches))
        return ({"lm loss": 1.0 + len(passes)}, None, False)

    try:
        training.evaluate = fake_evaluate
        plugin.install_megatron_lm_plugin()
        megatron_tah.install(tah_eval_traffic=traffic, tah_backend="torch")
        args = types.SimpleNamespace(consumed_valid_samples=0)
        old_args, global_vars._GLOBAL_ARGS = global_vars._GLOBAL_ARGS, args
        try:
            data = iter(range(100))
            result = training.evaluate(None, data, None)
        finally:
            global_vars._GLOBAL_ARGS = old_args
        assert result[0] == {"lm loss": 2.0} and args.consumed_valid_samples == 3 and next(data) == 3
        want = {"codec": [False], "uncompressed": [True], "both": [False, True]}[traffic]
        assert [raw for raw, _ in passes] == want and all(b == [0, 1, 2] for _, b in passes)
        recorded = REGISTRY.log.evaluations[-1]
        assert recorded == ({"lm loss": 2.0, "lm loss uncompressed": 3.0} if traffic == "both" else {"lm loss": 2.0})
        assert not installed_transport().traffic.eval_uncompressed
    finally:
        plugin.uninstall_megatron_lm_plugin()
        training.evaluate = original


def test_two_iterators_replay_what_megatron_hands_evaluate():
    """--tah-eval-traffic both: the second pass sees the first pass's batches, whatever the stage holds:
    no iterator (a middle stage), one with only ``__next__`` (Megatron's RerunDataIterator), a list of
    them (virtual pipeline stages)."""
    from megatron_tah.megatron.run_log import _two_iterators

    class NextOnly:
        def __init__(self, n):
            self.i, self.n = 0, n

        def __next__(self):
            if self.i == self.n:
                raise StopIteration
            self.i += 1
            return self.i

    assert _two_iterators(None) == (None, None)
    first, second = _two_iterators(NextOnly(3))
    assert [next(first), next(first)] == [1, 2] and list(second) == [1, 2, 3] and list(first) == [3]
    firsts, seconds = _two_iterators([NextOnly(2), None])
    assert seconds[1] is None and list(firsts[0]) == [1, 2] == list(seconds[0])
