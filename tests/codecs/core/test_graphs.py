"""codecs/core/graphs.py on the CPU: what is captured (one graph per op, shape, dtype, device), the eager
fallbacks and their one log line, and that replays give eager's bytes and values. A fake graph
(``host_reads.FakeGraphs``) stands in for torch.cuda.CUDAGraph: its capture runs the call once (the
warm-up) and its replay re-runs the call under ``no_host_reads`` (what a real capture would reject).
The real capture runs in scripts/profile_codecs.py on a GPU; the places' use in tests/megatron/test_place_graphs.py."""

import logging

import pytest
import torch

from megatron_tah.codecs import CodecError, WireFormatError, get_codec
from megatron_tah.codecs.core.graphs import CudaGraphs, GraphedCodec, eager, place_codec
from megatron_tah.codecs.none import NoneCodec
from megatron_tah.codecs.core.samples import activation_like
from tests.helpers.codec_cases import cases
from tests.helpers.host_reads import FakeGraphs, HostRead, no_host_reads

SHAPE = (16, 2, 128)
OPTIONS = {"lowrank": {"rank": 4}}  # the codecs' options here (others: their defaults, rounding to nearest)


# tah's torch reference branches on the host (outliers; codes scattered by a boolean mask): a CUDA graph
# captures its Triton path (scripts/profile_codecs.py); on the CPU its replays are checked for values only.
TORCH_PATH_READS_HOST = {"tah"}


def graphed(name, graphs=None, checks="deferred", **options):
    codec = get_codec(name, backend="torch", **options).defer_checks(checks)
    return GraphedCodec(codec, graphs or FakeGraphs())


def messages(count=4, shape=SHAPE, dtype=torch.bfloat16):
    return [activation_like(shape, dtype=dtype, seed=seed) for seed in range(count)]


def why_eager(case) -> str | None:
    """Why a wrapper would not capture ``case``'s encode or decode on SHAPE (None: it captures both)."""
    wrapped, cpu = graphed(case.name, **case.options), torch.device("cpu")
    return wrapped.why_eager("encode", SHAPE, cpu) or wrapped.why_eager("decode", SHAPE, cpu)


CAPTURABLE = cases(OPTIONS, keep=lambda case: why_eager(case) is None)


@pytest.mark.parametrize("case", cases(OPTIONS, keep=lambda case: why_eager(case) is not None))
def test_a_codec_that_is_never_captured_says_why(case):
    """Only none (a copy each way) and a codec class declaring itself not capturable stay eager at rounding to
    nearest with deferred checks; every other codec is captured (the test below)."""
    reason, codec = why_eager(case), case.make()
    if isinstance(codec, NoneCodec):
        assert reason.startswith("one copy each way")
    else:
        assert not type(codec).graph_capturable and type(codec).graph_blocker in reason, reason


@pytest.mark.parametrize("case", CAPTURABLE)
def test_replayed_encode_and_decode_equal_eager_and_read_nothing_on_the_host(case):
    name, options = case.name, case.options
    eager = case.make().defer_checks()
    strict = name not in TORCH_PATH_READS_HOST
    wrapped = graphed(name, FakeGraphs(strict), **options)
    decoder = graphed(name, FakeGraphs(strict), **options)
    for x in messages():
        buf = wrapped.encode(x)
        assert torch.equal(buf, eager.encode(x))
        out = torch.empty_like(x)
        assert decoder.decode(buf, x.shape, x.dtype, out=out) is out
        want = eager.decode(buf, x.shape, x.dtype)
        assert torch.equal(out.nan_to_num(7.0), want.nan_to_num(7.0))
        assert torch.equal(decoder.decode(buf, x.shape, x.dtype).nan_to_num(7.0), want.nan_to_num(7.0))
    assert wrapped.captured == [("encode", SHAPE, torch.bfloat16, "cpu")]
    assert decoder.captured == [("decode", SHAPE, torch.bfloat16, "cpu")]
    assert (wrapped.graphs.captures, wrapped.graphs.replays, decoder.graphs.captures, decoder.graphs.replays) == (1, 3, 1, 7)
    assert wrapped.eager_reasons == decoder.eager_reasons == {}


def test_one_capture_per_op_shape_and_dtype():
    wrapped = graphed("hadint")
    for shape, dtype in [(SHAPE, torch.bfloat16), (SHAPE, torch.float32), ((8, 1, 64), torch.bfloat16)] * 2:
        x = activation_like(shape, dtype=dtype, seed=1)
        wrapped.decode(wrapped.encode(x), shape, dtype)
    assert wrapped.graphs.captures == 6 and len(wrapped.captured) == 6


@pytest.mark.parametrize("name,options,checks,op,reason", [
    ("hadint", {"stochastic_rounding": True}, "deferred", "encode", "stochastic rounding"),
    ("hadint", {}, "full", "decode", "full checks read the header on the host"),
    ("aqsgd", {}, "deferred", "encode", "aqsgd is not capturable (per-sample buffers"),
    ("none", {}, "deferred", "encode", "one copy each way"),
    ("none", {}, "deferred", "decode", "one copy each way"),
])
def test_eager_fallbacks_say_why_in_one_log_line(name, options, checks, op, reason, caplog):
    wrapped = graphed(name, checks=checks, **options)
    eager = get_codec(name, backend="torch", **options).defer_checks(checks)
    caplog.set_level(logging.INFO, logger="megatron_tah.codecs.core.graphs")
    for x in messages(3, dtype=torch.float32):
        if op == "encode":
            if name == "aqsgd":
                ids = torch.arange(x.shape[1])
                assert torch.equal(wrapped.encode(x, sample_ids=ids), eager.encode(x, sample_ids=ids))
            else:
                assert torch.equal(wrapped.encode(x), eager.encode(x))
        else:
            buf = eager.encode(x)
            assert torch.equal(wrapped.decode(buf, x.shape, x.dtype), eager.decode(buf, x.shape, x.dtype))
    lines = [r.getMessage() for r in caplog.records if reason in r.getMessage()]
    assert len(lines) == 1 and f" {op} runs eagerly" in lines[0]
    assert (op, x.shape, x.dtype, "cpu") in wrapped.eager_reasons


def test_cpu_tensors_and_large_messages_stay_eager():
    assert "CUDA graphs need a CUDA device" in CudaGraphs.unavailable(torch.device("cpu"))
    wrapped = GraphedCodec(get_codec("hadint", backend="torch").defer_checks())  # real CudaGraphs
    x = activation_like(SHAPE, dtype=torch.float32, seed=0)
    assert torch.equal(wrapped.encode(x), wrapped.codec.encode(x)) and wrapped.captured == []
    small = GraphedCodec(get_codec("hadint", backend="torch").defer_checks(), FakeGraphs(), max_numel=1000)
    small.encode(x)
    assert "max_numel 1000" in small.eager_reasons[("encode", SHAPE, torch.float32, "cpu")]


def test_a_capture_that_fails_is_logged_and_its_warm_up_result_returned(caplog):
    class Refuses(FakeGraphs):
        def capture(self, fn, device):
            fn()
            raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    caplog.set_level(logging.INFO, logger="megatron_tah.codecs.core.graphs")
    wrapped, eager = graphed("lowrank", Refuses(), rank=4), get_codec("lowrank", backend="torch", rank=4)
    for x in messages(3):
        assert torch.equal(wrapped.encode(x), eager.encode(x))  # the warm-up advanced the state once, not twice
    lines = [r.getMessage() for r in caplog.records if "capture failed" in r.getMessage()]
    assert len(lines) == 1 and lines[0].endswith("RuntimeError: operation not permitted when stream is capturing")


def test_deferred_checks_still_count_bad_buffers_under_replay():
    wrapped = graphed("hadint")
    x = activation_like(SHAPE, dtype=torch.float32, seed=0)
    buf = wrapped.encode(x)
    wrapped.decode(buf, SHAPE, torch.float32)  # captured
    with pytest.raises(CodecError, match="out is"):
        wrapped.decode(buf, SHAPE, torch.float32, out=torch.empty(SHAPE, dtype=torch.bfloat16))
    bad = buf.clone()
    bad[4] ^= 1  # the config digest
    wrapped.decode(bad, SHAPE, torch.float32)  # replayed: counted on the device
    assert wrapped.graphs.replays == 1
    with pytest.raises(WireFormatError, match="1 check"):
        wrapped.decode(buf, SHAPE, torch.float32)
    with pytest.raises(WireFormatError, match="bytes"):
        wrapped.decode(buf[:-8], SHAPE, torch.float32)
    with pytest.raises(CodecError, match="wraps a Codec"):
        GraphedCodec(wrapped)


def test_the_host_read_checker_can_fail():
    with no_host_reads(), pytest.raises(HostRead):
        bool(torch.ones(1))
    with no_host_reads(), pytest.raises(HostRead, match="built on the host"):
        torch.tensor(3, dtype=torch.int16)
    assert torch.tensor(3).item() == 3  # restored


def test_bf16_metadata_bits_build_nothing_on_the_host():
    """The NaN bits of bad tiles' metadata come from a fill, not a host-built tensor: lowrank's residual
    (through hadint) reaches this in every encode, and a pageable copy there cannot be captured."""
    from megatron_tah import numerics
    from megatron_tah.codecs.core.common import bf16_bits

    values = torch.tensor([1.0, -2.5, 0.0, 3.0])
    nan = torch.tensor([False, True, False, True])
    with no_host_reads():
        bits = bf16_bits(values, nan)
    assert bits.dtype == torch.int16
    assert bits.tolist() == [0x3F80, numerics.BF16_NAN_BITS, 0, numerics.BF16_NAN_BITS]


def test_the_wrapper_stands_where_its_codec_stood():
    """What the places read from a codec comes from the wrapped one; ``defer_checks`` drops what was captured."""
    wrapped = graphed("lowrank", rank=4)
    codec = wrapped.codec
    x = activation_like(SHAPE, dtype=torch.float32, seed=0)
    buf = wrapped.encode(x)
    assert wrapped.wire_nbytes(SHAPE, torch.float32) == codec.wire_nbytes(SHAPE, torch.float32) == buf.numel()
    assert (wrapped.name, wrapped.codec_id, wrapped.config_digest(), wrapped.describe()) == (
        codec.name, codec.codec_id, codec.config_digest(), codec.describe())
    assert (wrapped.checksum, wrapped.needs_sample_ids, wrapped.stateful, wrapped.checks) == (False, False, True, "deferred")
    state = wrapped.state_dict()
    assert state and all(torch.equal(a, b) for a, b in zip(state["subspaces"].values(),
                                                           codec.state_dict()["subspaces"].values()))
    with pytest.raises(AttributeError, match="no_such"):
        wrapped.no_such_attribute
    assert wrapped.captured and wrapped.defer_checks("off") is wrapped
    assert codec.checks == "off" and wrapped.captured == [] and wrapped.eager_reasons == {}


def test_place_codec_defers_checks_and_wraps_unless_eager():
    made = place_codec(get_codec("fp8", backend="torch"), graphs=FakeGraphs())
    assert isinstance(made, GraphedCodec) and made.checks == "deferred" and eager(made) is made.codec
    plain = place_codec(get_codec("fp8", backend="torch"), eager=True)
    assert not isinstance(plain, GraphedCodec) and plain.checks == "deferred" and eager(plain) is plain


def test_wrappers_sharing_a_log_say_each_reason_once(caplog):
    caplog.set_level(logging.INFO, logger="megatron_tah.codecs.core.graphs")
    logged = set()
    ends = [GraphedCodec(get_codec(name, backend="torch").defer_checks(), logged=logged)  # real CudaGraphs: CPU
            for name in ("hadint", "hadint", "fixedpoint")]
    x = activation_like(SHAPE, dtype=torch.float32, seed=0)
    for end in ends:
        end.decode(end.encode(x), SHAPE, torch.float32)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "tensors on CPU: CUDA graphs need a CUDA device" in lines[0], lines
    assert all(len(end.eager_reasons) == 2 for end in ends)


def test_tah_keeps_its_rotated_fraction_in_place_so_replays_refresh_it():
    wrapped = graphed("tah", FakeGraphs(strict=False))
    eager_tah = get_codec("tah", backend="torch")
    kept = None
    for seed in range(3):
        x = activation_like(SHAPE, dtype=torch.float32, seed=seed) * (1 + 3 * seed)
        x[..., :: 7 + seed] *= 20  # outliers in some tiles: the fraction differs per message
        wrapped.encode(x)
        eager_tah.encode(x)
        assert torch.equal(wrapped.last_rotated, eager_tah.last_rotated)
        kept = wrapped.codec._rotated if kept is None else kept
        assert wrapped.codec._rotated is kept  # one buffer, written in place (what a graph replays into)
    assert wrapped.graphs.replays == 2


# ----- CudaGraphs.capture against a fake CUDA runtime (tests/helpers/fake_cuda.py): streams, syncs, pools --------
CUDA0 = torch.device("cuda", 0)


def _capture_calls(results):
    """A call for ``CudaGraphs.capture``: returns (or raises) the next of ``results`` each time."""
    calls = iter(results)

    def fn():
        result = next(calls)
        if isinstance(result, BaseException):
            raise result
        return result

    return fn


def test_a_capture_does_not_wait_for_the_device_and_captures_on_the_warm_up_stream(monkeypatch):
    """torch.cuda.graph synchronises the device and empties the caches on entry: mid-schedule, with NCCL
    kernels posted on other streams, a stall or a hang. The capture here makes the device wait, not the host."""
    from tests.helpers.fake_cuda import FakeCuda

    cuda = FakeCuda(monkeypatch)
    replay = CudaGraphs.capture(_capture_calls([torch.ones(2), torch.ones(2)]), CUDA0)
    (graph,) = cuda.graphs
    assert (cuda.syncs, cuda.empties) == (0, 0)
    assert cuda.on_default_streams() and not cuda.capturing and not cuda.routing
    assert graph.mode == "thread_local" and graph.captured and replay == graph.replay
    default = cuda.current[0]
    assert graph.stream.waited == [default] and default.waited == [graph.stream]  # ordered on the device


@pytest.mark.parametrize("where", ["capture_end", "the captured call"])
def test_a_failed_capture_restores_the_stream_ends_the_capture_and_frees_its_pool(monkeypatch, where):
    """torch.cuda.graph's exit skips restoring the stream when capture_end raises: every later kernel of the
    thread would run on its side stream. And torch leaves the pool's allocation routing on (capture_end
    raises before endAllocateToPool): the allocator would stop recycling blocks used across streams."""
    from tests.helpers.fake_cuda import FakeCuda

    cuda = FakeCuda(monkeypatch)
    cuda.fail_capture_end = "CUDA error: operation failed due to a previous error during capture"
    broken = "operation not permitted when stream is capturing"
    if where == "capture_end":
        fn, match = _capture_calls([torch.ones(2), torch.ones(2)]), "previous error during capture"
    else:  # the call raises; capture_end then raises too (the capture is invalidated): fn's error is reported
        fn, match = _capture_calls([torch.ones(2), RuntimeError(broken)]), broken
    with pytest.raises(RuntimeError, match=match):
        CudaGraphs.capture(fn, CUDA0)
    (graph,) = cuda.graphs
    assert cuda.on_default_streams(), cuda.current
    assert not cuda.capturing and not cuda.routing and cuda.released == [graph.pool]
    assert (cuda.syncs, cuda.empties) == (0, 0)


def test_a_captured_call_that_raises_before_the_device_leaves_the_pool_to_its_graph(monkeypatch):
    from tests.helpers.fake_cuda import FakeCuda

    cuda = FakeCuda(monkeypatch)
    with pytest.raises(CodecError, match="bad input"):
        CudaGraphs.capture(_capture_calls([torch.ones(2), CodecError("bad input")]), CUDA0)
    (graph,) = cuda.graphs
    assert cuda.on_default_streams() and not cuda.capturing and not cuda.routing
    assert graph.captured and cuda.released == []  # the graph owns its pool (released when it is dropped)


def test_a_failed_capture_turns_the_op_eager_for_every_shape_and_keeps_the_other_op(caplog):
    class FailsEncode(FakeGraphs):
        attempts = 0

        def capture(self, fn, device):
            if self.current == "encode":
                fn()
                self.attempts += 1
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
            return super().capture(fn, device)

    caplog.set_level(logging.INFO, logger="megatron_tah.codecs.core.graphs")
    graphs = FailsEncode()
    wrapped = graphed("hadint", graphs)
    eager_codec = get_codec("hadint", backend="torch").defer_checks()
    for shape in (SHAPE, (8, 1, 64), (4, 2, 32)):
        x = activation_like(shape, dtype=torch.float32, seed=0)
        graphs.current = "encode"
        buf = wrapped.encode(x)
        assert torch.equal(buf, eager_codec.encode(x))
        graphs.current = "decode"
        wrapped.decode(buf, shape, torch.float32)
    assert graphs.attempts == 1
    assert [key[0] for key in wrapped.eager_reasons] == ["encode"] * 3
    assert [key[0] for key in wrapped.captured] == ["decode"] * 3
    lines = [r.getMessage() for r in caplog.records if "capture failed" in r.getMessage()]
    assert len(lines) == 1 and " encode runs eagerly" in lines[0]
    wrapped.defer_checks()  # a new check mode may capture: try again
    graphs.current = "encode"
    wrapped.encode(activation_like(SHAPE, dtype=torch.float32, seed=0))
    assert graphs.attempts == 2


def test_a_capture_keeps_only_its_static_buffers_not_the_warm_up_result():
    """The warm-up's result is the first call's result: the caller owns it, the capture must not hold it."""
    import gc
    import weakref

    class TwoCalls(FakeGraphs):  # as torch's: the warm-up call, then the captured one
        def capture(self, fn, device):
            fn()
            return super().capture(fn, device)

    wrapped = graphed("fixedpoint", TwoCalls())
    x = activation_like(SHAPE, dtype=torch.float32, seed=0)
    first = wrapped.encode(x)
    gone = weakref.ref(first)
    assert wrapped.captured == [("encode", SHAPE, torch.float32, "cpu")]
    del first
    gc.collect()
    assert gone() is None
    assert torch.equal(wrapped.encode(x), wrapped.codec.encode(x))  # the replay's static output is still there


@pytest.fixture(autouse=True)
def _stream_state_after_each_test():
    """On a GPU: after each test the thread is back on the default stream and nothing is capturing."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index in range(torch.cuda.device_count()):
            stream = torch.cuda.current_stream(index)
            assert stream == torch.cuda.default_stream(index), f"left on {stream} of cuda:{index}"
        assert not torch.cuda.is_current_stream_capturing()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh tests)")
def test_real_capture_that_syncs_fails_cleanly_on_a_gpu():
    """A call that reads the device on the host fails to capture: the thread is back on its stream, the
    allocator recycles memory again, no device sync, and the eager result stands."""
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(1024, device=device)

    def syncs():
        y = x * 2
        if float(y.sum()) > 1e30:  # a host read: refused while capturing
            y += 1
        return y

    with pytest.raises(Exception):
        CudaGraphs.capture(syncs, device)
    assert torch.cuda.current_stream(device) == torch.cuda.default_stream(device)
    assert not torch.cuda.is_current_stream_capturing()
    z = torch.empty(1 << 20, device=device)  # allocations work and come from the ordinary pool
    z.fill_(1.0)
    assert float(z.sum()) == float(1 << 20)
    wrapped = GraphedCodec(get_codec("hadint").defer_checks())
    v = activation_like(SHAPE, dtype=torch.bfloat16, seed=0).to(device)
    assert torch.equal(wrapped.encode(v), get_codec("hadint").defer_checks().encode(v))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh tests)")
@pytest.mark.parametrize("case", CAPTURABLE)
def test_real_graphs_on_a_gpu_replay_the_eager_bytes(case):
    """torch.cuda.CUDAGraph, as the places build it: the codecs with a Triton path are captured and their
    replays give eager's bytes, values and statistics (tah's rotated fraction from the first call on); the
    others either are captured or say why not (their torch path may sync)."""
    name, options = case.name, case.options
    reference = get_codec(name, **options).defer_checks()
    wrapped, decoder = place_codec(get_codec(name, **options)), place_codec(get_codec(name, **options))
    for x in messages():
        x = x.cuda()
        buf = wrapped.encode(x)
        assert torch.equal(buf, reference.encode(x))
        if name == "tah":
            assert torch.equal(wrapped.last_rotated, reference.last_rotated)
        out = torch.empty_like(x)
        assert decoder.decode(buf, x.shape, x.dtype, out=out) is out
        assert torch.equal(out.nan_to_num(7.0), reference.decode(buf, x.shape, x.dtype).nan_to_num(7.0))
    decoder.raise_deferred_errors(wait=True)
    key = (SHAPE, torch.bfloat16, str(x.device))
    if reference.has_triton_path():
        assert (wrapped.captured, decoder.captured) == ([("encode", *key)], [("decode", *key)])
    else:
        for graphed_codec, op in ((wrapped, "encode"), (decoder, "decode")):
            assert graphed_codec.captured == [(op, *key)] or "capture failed" in graphed_codec.eager_reasons[(op, *key)]
