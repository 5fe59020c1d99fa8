"""Fused fixedpoint kernels vs the torch reference: identical bytes, identical decodes, both ways.

Runs the Triton path on CPU tensors under TRITON_INTERPRET=1 (``make test``), or on CUDA
(``scripts/gpu_check.sh``), where the same assertions hold for the compiled kernels.
"""

import pytest
import torch

from megatron_tah.codecs import get_codec
from megatron_tah.codecs.core.samples import activation_like
from megatron_tah.kernels import common as kcommon
from tests.helpers.edge_cases import DTYPES, EDGE_CASES, edge_case_tensor, assert_same_values, with_bad_values

DEVICE = kcommon.kernel_device()
pytestmark = [pytest.mark.triton, pytest.mark.skipif(DEVICE is None, reason=kcommon.why_no_kernels())]

# (shape, bits, tile_size): h a multiple of the tile and not, every tile size, 2..8 bits.
CASES = [
    ((16, 2, 256), 6, 32),
    ((8, 3, 200), 4, 64),
    ((5, 70), 8, 64),
    ((4, 1, 3, 96), 3, 8),
    ((6, 2, 384), 2, 128),
    ((7, 1, 48), 5, 16),
    ((3, 2, 136), 7, 32),
]


def codecs(**config):
    return (get_codec("fixedpoint", backend="torch", **config), get_codec("fixedpoint", backend="triton", **config))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,bits,tile_size", CASES)
def test_kernel_matches_reference(shape, bits, tile_size, dtype):
    ref, fused = codecs(bits=bits, tile_size=tile_size)
    x = with_bad_values(activation_like(shape, dtype=dtype, seed=bits, device=DEVICE))
    want = ref.encode(x)
    got = fused.encode(x)
    assert got.numel() == fused.wire_nbytes(shape, dtype) == want.numel()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # The kernel decoder reads reference bytes exactly as the reference decoder does, and vice versa.
    decoded = fused.decode(want, shape, dtype)
    assert_same_values(decoded, ref.decode(want, shape, dtype))
    assert_same_values(ref.decode(got, shape, dtype), decoded)
    assert decoded[..., :1].reshape(-1)[0].isnan()  # the tile holding the NaN decodes to NaN


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", EDGE_CASES)
def test_edge_cases_identical(kind, dtype):
    ref, fused = codecs(bits=4, tile_size=32)
    x = edge_case_tensor(kind, dtype=dtype).to(DEVICE)
    got = fused.encode(x)
    torch.testing.assert_close(got, ref.encode(x), rtol=0, atol=0)
    out = torch.empty_like(x)
    assert fused.decode(got, x.shape, dtype, out=out) is out
    assert_same_values(out, ref.decode(got, x.shape, dtype))


@pytest.mark.parametrize("per_lane,tiles", [(16, 4), (8, 8), (64, 2)])
def test_many_programs_and_lanes_per_tile(per_lane, tiles):
    # The codec tests run one program under the interpreter; here the grid has many, with a ragged last one,
    # and a tile spread over 4 or 8 lanes (butterflies and reductions across lanes) or held by one.
    from megatron_tah.kernels.fixedpoint import triton_fixedpoint_decode, triton_fixedpoint_encode

    ref = get_codec("fixedpoint", bits=5, tile_size=64, backend="torch")
    x = with_bad_values(activation_like((5, 3, 200), dtype=torch.bfloat16, seed=9, device=DEVICE))  # 60 tiles
    want = ref.encode(x)
    layout = ref.layout(x.shape, x.dtype)
    got = want.clone()
    got[16:] = 0
    triton_fixedpoint_encode(x, layout.sections(got), 5, 64, per_lane=per_lane, tiles_per_prog=tiles)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    y = triton_fixedpoint_decode(layout.sections(want), x.shape, x.dtype, 5, 64, per_lane=per_lane,
                                 tiles_per_prog=tiles)
    assert_same_values(y, ref.decode(want, x.shape, x.dtype))


def test_fp16_decode_clamps_to_range():
    # Rounding to the nearest level may step past 65504; both paths clamp instead of returning inf.
    ref, fused = codecs(bits=2, tile_size=8)
    x = torch.tensor([-65504.0, -65504.0, -65504.0, 0.0, 1.0, 2.0, 65504.0, 65500.0], dtype=torch.float16,
                     device=DEVICE).reshape(1, 8)
    buf = fused.encode(x)
    y = fused.decode(buf, x.shape, x.dtype)
    assert torch.isfinite(y).all()
    assert_same_values(y, ref.decode(buf, x.shape, x.dtype))


def test_stochastic_rounding_is_the_references_and_unbiased():
    shape = (64, 1, 128)
    x = activation_like(shape, dtype=torch.float32, seed=3, device=DEVICE)
    options = dict(bits=3, tile_size=32, stochastic_rounding=True, seed=5)
    first, again = (get_codec("fixedpoint", backend="triton", **options) for _ in range(2))
    ref = get_codec("fixedpoint", backend="torch", **options)
    buf = first.encode(x)
    torch.testing.assert_close(buf, ref.encode(x), rtol=0, atol=0)  # the same counter-based noise
    assert torch.equal(buf, again.encode(x))  # same seed, same bytes
    second = first.encode(x)
    assert not torch.equal(buf, second)  # the stream moves on
    torch.testing.assert_close(second, ref.encode(x), rtol=0, atol=0)
    y = ref.decode(buf, shape, x.dtype)
    scale = ref.layout(shape, x.dtype).view(buf, "scale", torch.bfloat16).float().repeat_interleave(32)
    err = (y - x).reshape(-1)
    assert (err.abs() <= scale * (1 + 1e-6)).all()
    nearest = get_codec("fixedpoint", bits=3, tile_size=32, backend="triton")
    near_err = (nearest.decode(nearest.encode(x), shape, x.dtype) - x).reshape(-1)
    assert err.abs().mean() > near_err.abs().mean()  # really stochastic, not round-to-nearest
    assert abs(err.mean().item()) < 0.02 * scale.mean().item()


def test_auto_backend_keeps_cpu_tensors_on_torch():
    codec = get_codec("fixedpoint")
    assert codec.has_triton_path()
    assert not codec._use_triton(torch.device("cpu"))
    assert get_codec("fixedpoint", backend="triton")._use_triton(torch.device("cpu"))


def test_launcher_without_triton_says_so(monkeypatch):
    from megatron_tah.kernels import fixedpoint as kfixed

    monkeypatch.setattr(kcommon, "HAVE_TRITON", False)
    codec = get_codec("fixedpoint", backend="triton")
    x = torch.ones(2, 32, device=DEVICE)
    layout = codec.layout(x.shape, x.dtype)
    with pytest.raises(RuntimeError, match="needs triton"):
        kfixed.triton_fixedpoint_encode(x, layout.sections(torch.empty(layout.nbytes, dtype=torch.uint8)), 6, 32)
