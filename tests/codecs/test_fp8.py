"""fp8 (TACO E4M3) codec: wire size, per-group error bound, pre-scale, range, bad input, wire checks."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tah.codecs import CodecError, WireFormatError, get_codec
from megatron_tah.codecs.core import common
from megatron_tah.codecs.fp8 import FP8_MAX, prescale_reference
from megatron_tah.codecs.core.samples import activation_like
from tests.helpers.edge_cases import DTYPES

# E4M3 rounds within 2^-4 relative (normals) or 2^-10 absolute in units of the post-scale
# (subnormals); the orthonormal Hadamard carries that to x (see the module docstring).
# The cast to the output dtype adds half an ulp: relative for normals, absolute for fp16 subnormals.
OUTPUT_ULP = {torch.float32: 2**-24, torch.bfloat16: 2**-8, torch.float16: 2**-11}
SUBNORMAL_ULP = {torch.float32: 0.0, torch.bfloat16: 0.0, torch.float16: 2**-25}


def zero_padded_groups(x, group_size):
    pad = -x.shape[-1] % group_size
    return torch.nn.functional.pad(x.float(), (0, pad)).reshape(-1, x.shape[-1] + pad).reshape(-1, group_size)


def group_bound_ok(x, y, group_size, dtype):
    """Per group: ||x - y|| <= (2^-4 + 2^-10 sqrt(G) / 448 + output rounding) * ||x|| (+ fp16 subnormals)."""
    gx, gy = zero_padded_groups(x, group_size), zero_padded_groups(y, group_size)
    err = (gx - gy).double().norm(dim=-1)
    ref = gx.double().norm(dim=-1)
    factor = 2**-4 + 2**-10 * math.sqrt(group_size) / FP8_MAX + OUTPUT_ULP[dtype] * 1.07 + 1e-5
    bound = factor * ref + math.sqrt(group_size) * SUBNORMAL_ULP[dtype]
    return bool((err <= bound).all()), (err / ref.clamp_min(1e-300)).max().item()


@pytest.mark.parametrize("group_size", [8, 32, 128])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 3, 100), (33, 1, 130), (4, 2, 256), (5, 2, 129)])
def test_wire_size_and_error_bound(group_size, dtype, shape):
    codec = get_codec("fp8", group_size=group_size)
    x = activation_like(shape, dtype, seed=sum(shape))
    buf = codec.encode(x)
    groups = math.prod(shape[:-1]) * -(-shape[-1] // group_size)
    assert buf.numel() == codec.wire_nbytes(shape, dtype)
    assert buf.numel() >= 16 + groups * (group_size + 8)
    y = codec.decode(buf, shape, dtype)
    assert y.shape == x.shape and y.dtype == dtype
    ok, worst = group_bound_ok(x.float(), y.float(), group_size, dtype)
    assert ok, worst


def test_bits_per_element_on_the_paper_shape():
    shape, codec = (1024, 4, 4096), get_codec("fp8", group_size=128)
    bits = 8 * codec.wire_nbytes(shape, torch.bfloat16) / math.prod(shape)
    assert 8.5 <= bits <= 8.6, bits
    # The same size comes out of an encode (a slice of the shape keeps the run fast).
    small = (64, 4, 4096)
    x = activation_like(small, torch.bfloat16)
    assert 8 * codec.encode(x).numel() / math.prod(small) == pytest.approx(8.5, abs=1e-3)


def test_activation_like_error_is_small():
    x = activation_like((64, 2, 1024), torch.bfloat16)
    codec = get_codec("fp8")
    y = codec.decode(codec.encode(x), x.shape, x.dtype)
    rel = ((y.float() - x.float()).norm() / x.float().norm()).item()
    assert rel < 0.04, rel  # E4M3 after a Hadamard: ~2-3 %, well under the 6.25 % worst case


def test_prescale_matches_the_spec_formula():
    gen = torch.Generator().manual_seed(0)
    groups = torch.randn(200, 128, generator=gen) * torch.logspace(-4, 4, 200)[:, None]
    direct = (FP8_MAX / torch.sqrt(groups.square().mean(-1) + 1e-6)).clamp(1e-3, 1e3)
    assert torch.allclose(prescale_reference(groups), direct, rtol=1e-5)
    # Where squaring overflows (or underflows) fp32 the safe form still gives the clamped value.
    extreme = torch.tensor([[1e30] * 8, [1e-30] * 8, [0.0] * 8])
    assert prescale_reference(extreme).tolist() == pytest.approx([1e-3, 1e3, 1e3])


def test_stored_scales_follow_the_recipe():
    x = torch.randn(3, 2, 128, generator=torch.Generator().manual_seed(1)) * 7
    codec = get_codec("fp8")
    buf = codec.encode(x)
    layout = codec.layout(x.shape, x.dtype)
    alpha = layout.view(buf, "prescale", torch.float32)
    post = layout.view(buf, "postscale", torch.float32)
    groups = x.reshape(-1, 128)
    rotated = (groups * alpha[:, None]) @ common.hadamard_matrix(128)
    assert torch.allclose(post, rotated.abs().amax(-1) / FP8_MAX, rtol=1e-6)
    codes = layout.view(buf, "codes").view(torch.float8_e4m3fn).float().reshape(-1, 128)
    assert torch.equal(codes.abs().amax(-1), torch.full((6,), FP8_MAX))  # the peak maps to 448 exactly


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("magnitude", [1e6, 1e20, 1e35])
def test_large_magnitudes_do_not_overflow(dtype, magnitude):
    x = (torch.randn(4, 2, 192, generator=torch.Generator().manual_seed(2)) * magnitude).to(dtype)
    codec = get_codec("fp8")
    y = codec.decode(codec.encode(x), x.shape, dtype)
    assert torch.isfinite(y).all()
    assert group_bound_ok(x.float(), y.float(), 128, dtype)[0]


def test_fp16_at_its_limit_and_tiny_values():
    codec = get_codec("fp8", group_size=32)
    x = torch.full((2, 1, 64), 65504.0, dtype=torch.float16)
    x[..., 1::3] = -65504.0
    y = codec.decode(codec.encode(x), x.shape, x.dtype)
    assert torch.isfinite(y).all()
    tiny = torch.randn(3, 2, 64) * 1e-30
    y = codec.decode(codec.encode(tiny), tiny.shape, tiny.dtype)
    # Norms of 1e-30 values underflow in fp32: compare in fp64.
    err = (y.double() - tiny.double()).norm() / tiny.double().norm()
    assert err < 0.07, err.item()


def test_zero_and_constant_groups():
    codec = get_codec("fp8", group_size=64)
    x = torch.zeros(2, 2, 128)
    x[1, :, :64] = 3.25  # a constant group: all energy in the first Hadamard output
    x[1, :, 64:] = -1e-3
    y = codec.decode(codec.encode(x), x.shape, x.dtype)
    assert torch.equal(y[0], x[0])  # zero groups decode to exact zeros, no NaN
    assert torch.allclose(y[1], x[1], rtol=1e-5, atol=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 1e37])
def test_bad_group_decodes_to_nan_and_leaves_others_bit_identical(bad):
    codec = get_codec("fp8", group_size=32)
    x = torch.randn(3, 2, 100, generator=torch.Generator().manual_seed(3))
    clean = x.clone()
    x[2, 1, 40] = bad
    clean[2, 1, 40] = 0.0
    y = codec.decode(codec.encode(x), x.shape, x.dtype)
    y_clean = codec.decode(codec.encode(clean), x.shape, x.dtype)
    group = slice(32, 64)
    assert torch.isnan(y[2, 1, group]).all()
    keep = torch.ones_like(x, dtype=torch.bool)
    keep[2, 1, group] = False
    assert torch.equal(y[keep], y_clean[keep])  # groups are independent: nothing else moved


def test_determinism_and_decode_into_out():
    x = activation_like((9, 3, 200), torch.bfloat16, seed=4)
    first = get_codec("fp8").encode(x)
    assert torch.equal(first, get_codec("fp8").encode(x.clone()))
    codec = get_codec("fp8")
    out = torch.empty(9, 3, 200, dtype=torch.bfloat16, requires_grad=True)
    assert codec.decode(first, x.shape, x.dtype, out=out) is out
    assert torch.equal(out.detach(), codec.decode(first, x.shape, x.dtype))


def test_invalid_configs_dtypes_and_buffers_raise():
    with pytest.raises(CodecError, match="tile_size"):
        get_codec("fp8", group_size=96)
    with pytest.raises(CodecError, match="unsupported dtype"):
        get_codec("fp8").encode(torch.zeros(2, 1, 128, dtype=torch.float64))
    x = torch.randn(4, 2, 128)
    codec = get_codec("fp8")
    buf = codec.encode(x)
    with pytest.raises(WireFormatError, match="bytes"):
        codec.decode(buf[:-8], x.shape, x.dtype)
    with pytest.raises(WireFormatError, match="another shape"):
        codec.decode(buf, (2, 4, 128), x.dtype)
    # A header written by an fp8 codec with another group size, on a buffer of the right length.
    forged = buf.clone()
    forged[:16] = get_codec("fp8", group_size=64).encode(x)[:16]
    with pytest.raises(WireFormatError, match="another config"):
        codec.decode(forged, x.shape, x.dtype)
    with pytest.raises(WireFormatError, match="'fixedpoint'"):
        codec.decode(torch.cat([get_codec("fixedpoint").encode(x)[:16], buf[16:]]), x.shape, x.dtype)


@settings(max_examples=40, deadline=None)
@given(
    s=st.integers(1, 9), b=st.integers(1, 3), h=st.integers(1, 300),
    group_size=st.sampled_from([16, 64, 128]), dtype=st.sampled_from(DTYPES),
    log_scale=st.floats(-6, 4), seed=st.integers(0, 2**16),
)
def test_round_trip_property(s, b, h, group_size, dtype, log_scale, seed):
    x = (torch.randn(s, b, h, generator=torch.Generator().manual_seed(seed)) * 10**log_scale).to(dtype)
    codec = get_codec("fp8", group_size=group_size)
    buf = codec.encode(x)
    assert buf.numel() == codec.wire_nbytes(x.shape, dtype)
    y = codec.decode(buf, x.shape, dtype)
    assert torch.isfinite(y).all()
    ok, worst = group_bound_ok(x.float(), y.float(), group_size, dtype)
    assert ok, worst
