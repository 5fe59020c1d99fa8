"""Fused channel kernels vs the torch reference: identical bytes (scale, zero, codes), identical decodes, both ways.

Runs the Triton path on CPU tensors under TRITON_INTERPRET=1 (``make test``), or on CUDA
(``scripts/gpu_check.sh``), where the same assertions hold for the compiled kernels.
"""

import pytest
import torch

from megatron_tah.codecs import get_codec
from megatron_tah.codecs.core.samples import activation_like
from megatron_tah.kernels import common as kcommon
from tests.helpers.edge_cases import DTYPES, EDGE_CASES, assert_same_values, edge_case_tensor, with_bad_values

DEVICE = kcommon.kernel_device()
pytestmark = [pytest.mark.triton, pytest.mark.skipif(DEVICE is None, reason=kcommon.why_no_kernels())]

# (shape, bits): one row and many, h a multiple of 8 (the row-block path) and not (the row-major path),
# h odd and not a power of two, a channel block wider than h.
CASES = [((64, 1, 128), 4), ((64, 4, 128), 3), ((7, 3, 96), 6), ((1, 1, 130), 2), ((256, 2, 1024), 8),
         ((5, 17), 5)]


def codecs(**config):
    return get_codec("channel", backend="torch", **config), get_codec("channel", backend="triton", **config)


def assert_bit_exact(x, ref, tri):
    """Same bytes section by section (atol = 0), and each decoder reads the other's bytes as its own."""
    shape, dtype = x.shape, x.dtype
    want = ref.encode(x.cpu())
    got = tri.encode(x.to(DEVICE)).cpu()
    layout = ref.layout(shape, dtype)
    for name in ("scale", "zero", "codes"):
        torch.testing.assert_close(layout.view(got, name), layout.view(want, name), rtol=0, atol=0, msg=name)
    assert torch.equal(got, want)  # the header and the padding too
    assert_same_values(tri.decode(want.to(DEVICE), shape, dtype).cpu(), ref.decode(want, shape, dtype))
    out = torch.empty(shape, dtype=dtype, device=DEVICE)
    assert tri.decode(got.to(DEVICE), shape, dtype, out=out) is out
    assert_same_values(out.cpu(), ref.decode(got, shape, dtype))
    return out.cpu()


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,bits", CASES, ids=[f"{'x'.join(map(str, s))}-{b}b" for s, b in CASES])
def test_kernel_bytes_and_decodes_equal_the_reference(shape, bits, dtype, stochastic):
    x = with_bad_values(activation_like(shape, dtype=dtype, seed=bits))  # NaN, +Inf, -Inf: three bad channels
    ref, tri = codecs(bits=bits, stochastic_rounding=stochastic, seed=bits)
    for _ in range(2):  # stochastic rounding: the second call draws new noise, on both paths alike
        y = assert_bit_exact(x, ref, tri)
    h = shape[-1]
    for index in (1, x.numel() // 2, x.numel() - 1):  # the bad values' channels: NaN in every row
        assert y.reshape(-1, h)[:, index % h].isnan().all()


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("bits", range(2, 9))
def test_every_bit_width(bits, stochastic):
    x = activation_like((9, 2, 40), dtype=torch.bfloat16, seed=bits)
    assert_bit_exact(x, *codecs(bits=bits, stochastic_rounding=stochastic))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", EDGE_CASES)
def test_edge_cases(kind, dtype):
    x = edge_case_tensor(kind, shape=(6, 2, 96), dtype=dtype)
    y = assert_bit_exact(x, *codecs(bits=4))
    assert torch.isfinite(y).all()
    if kind in ("zeros", "constant"):
        assert torch.equal(y, x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e37])
def test_a_bad_value_poisons_its_channel_on_both_paths(bad):
    x = torch.randn(4, 2, 100)
    x[1, 0, 70] = bad
    y = assert_bit_exact(x, *codecs())
    assert y[..., 70].isnan().all() and torch.isfinite(y[..., torch.arange(100) != 70]).all()


def test_split_ranges_many_programs_and_lanes():
    # The codec tests run one range program per channel block under the interpreter; here the rows are split
    # three ways (partials, then the merge), channel blocks are ragged, the loop's last block is partial, and
    # the code pass runs many programs of 8 channels per lane; then the row-major path with many programs.
    from megatron_tah.kernels.channel import triton_channel_decode, triton_channel_encode, triton_channel_range

    for shape in ((50, 2, 100), (25, 2, 99)):
        ref = get_codec("channel", bits=5, backend="torch")
        x = with_bad_values(activation_like(shape, dtype=torch.bfloat16, seed=9, device=DEVICE))
        want = ref.encode(x)
        layout = ref.layout(x.shape, x.dtype)
        got = want.clone()
        got[16:] = 0
        triton_channel_range(x, layout.sections(got), 5, rows_per_iteration=8, channels=32, splits=3)
        torch.testing.assert_close(got[:layout.offsets["codes"][0]], want[:layout.offsets["codes"][0]], rtol=0,
                                   atol=0)
        triton_channel_encode(x, layout.sections(got), 5, per_lane=16 if shape[-1] % 8 else 8, rows_per_prog=4)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        y = triton_channel_decode(layout.sections(want), x.shape, x.dtype, 5, per_lane=8, rows_per_prog=2)
        assert_same_values(y, ref.decode(want, x.shape, x.dtype))


def test_fp16_decode_clamps_to_range():
    # Rounding to the nearest level may step past 65504; both paths clamp instead of returning inf.
    x = torch.full((2, 8), 65504.0, dtype=torch.float16)
    x[0] = -65504.0
    y = assert_bit_exact(x, *codecs(bits=2))
    assert torch.isfinite(y).all()


def test_stochastic_rounding_is_the_references_and_moves_on():
    x = activation_like((64, 1, 128), dtype=torch.float32, seed=3, device=DEVICE)
    options = dict(bits=3, stochastic_rounding=True, seed=5)
    first, again = (get_codec("channel", backend="triton", **options) for _ in range(2))
    ref = get_codec("channel", backend="torch", **options)
    buf = first.encode(x)
    torch.testing.assert_close(buf, ref.encode(x), rtol=0, atol=0)  # the same counter-based noise
    assert torch.equal(buf, again.encode(x))  # same seed, same bytes
    second = first.encode(x)
    assert not torch.equal(buf, second)  # the stream moves on
    torch.testing.assert_close(second, ref.encode(x), rtol=0, atol=0)
    assert first.state_dict() == {"rounding_noise": {"seed": 5, "calls": 2}}


def test_auto_backend_keeps_cpu_tensors_on_torch():
    codec = get_codec("channel")
    assert codec.has_triton_path()
    assert not codec._use_triton(torch.device("cpu"))
    assert get_codec("channel", backend="triton")._use_triton(torch.device("cpu"))


def test_launchers_without_triton_say_so(monkeypatch):
    from megatron_tah.kernels import channel as kchannel

    monkeypatch.setattr(kcommon, "HAVE_TRITON", False)
    codec = get_codec("channel", backend="triton")
    x = torch.ones(2, 32, device=DEVICE)
    layout = codec.layout(x.shape, x.dtype)
    sections = layout.sections(torch.empty(layout.nbytes, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="needs triton"):
        kchannel.triton_channel_encode(x, sections, 4)
    with pytest.raises(RuntimeError, match="needs triton"):
        kchannel.triton_channel_decode(sections, x.shape, x.dtype, 4)


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,outliers", [((64, 2, 128), 1), ((7, 3, 96), 2), ((4, 1, 40), 5)])  # 5: capped at 3 rows
def test_outlier_tokens_are_the_references_bytes(shape, outliers, dtype, stochastic):
    x = activation_like(shape, dtype=dtype, seed=outliers)
    x.view(-1, shape[-1])[3] *= 40  # a sink row
    x.view(-1, shape[-1])[-1, 5] = float("nan")  # a bad value: its row goes first
    ref, tri = codecs(bits=3, stochastic_rounding=stochastic, outlier_tokens=outliers, seed=1)
    for name in ("outlier_index", "outlier_rows"):
        assert name in ref.layout(shape, dtype).offsets
    for _ in range(2):
        y = assert_bit_exact(x, ref, tri)
    assert y.view(-1, shape[-1])[-1, 5].isnan() and y.isnan().sum() == 1
