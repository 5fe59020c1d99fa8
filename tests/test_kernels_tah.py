"""Fused TAH-Quant kernels vs the torch reference.

Quantization and packing are the reference's exact operations; the entropy and the
Hadamard sum in another order, so the criterion (issue 6) is: same wire size, same
flags and rotation metadata, decoded values within one quantization step of the
reference on >= 99.9% of elements, and cross-decoding both ways. Where nothing is
rotated the bytes must be identical. Runs on CPU tensors under TRITON_INTERPRET=1.
"""

import pytest
import torch

from edge_cases import DTYPES, EDGE_CASES, edge_case_tensor
from megatron_tah.codecs import CodecError, get_codec
from megatron_tah.codecs.samples import activation_like
from megatron_tah.kernels import common as kcommon

DEVICE = kcommon.kernel_device()
pytestmark = [pytest.mark.triton, pytest.mark.skipif(DEVICE is None, reason=kcommon.why_no_kernels())]

# (shape, dtype, config): every tile size, both allocations, h a multiple of the tile and not,
# always / sometimes / never rotate, 2..8 bits.
CASES = [
    ((32, 2, 256), torch.bfloat16, {}),
    ((16, 3, 200), torch.float32, {"allocation": "tile", "tile_size": 32}),
    ((8, 2, 64), torch.float16, {"outlier_threshold": 0.0, "tile_size": 16}),
    ((10, 1, 40), torch.float32, {"tile_size": 8, "high_bits": 5, "low_bits": 2}),
    ((16, 2, 384), torch.bfloat16, {"tile_size": 128, "outlier_threshold": float("inf")}),
    ((12, 2, 160), torch.float16, {"allocation": "tile", "high_bits": 8, "low_bits": 6, "high_ratio": 0.5}),
    ((4, 2, 96), torch.float32, {"tile_size": 32, "high_ratio": 1.0}),
    ((16, 2, 128), torch.float32, {"low_bits_for": "high_entropy"}),
    ((6, 2, 128), torch.bfloat16, {"allocation": "tile", "tile_size": 16, "low_bits_for": "high_entropy"}),
]


def codecs(**config):
    return get_codec("tah", backend="torch", **config), get_codec("tah", backend="triton", **config)


def element_steps(codec, buf, shape):
    """Each element's quantization step (its tile's bf16 scale), shape ``shape``."""
    s, b, h = shape
    scale = codec.layout(shape, torch.float32).view(buf, "scale", torch.bfloat16).float()
    return scale.reshape(s * b, -1).repeat_interleave(codec.tile_size, dim=1)[:, :h].reshape(shape)


def assert_within_one_step(got, want, steps, min_fraction=0.999):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got.isnan(), want.isnan())
    diff = (got.float() - want.float()).nan_to_num(0.0).abs()
    # One step, plus the output dtype's rounding of values that moved by an ulp.
    bound = steps * 1.001 + want.float().abs().nan_to_num(0.0) * torch.finfo(want.dtype).eps
    assert (diff <= bound).float().mean().item() >= min_fraction


def check_against_reference(ref, fused, x):
    shape, dtype = tuple(x.shape), x.dtype
    want = ref.encode(x)
    got = fused.encode(x)
    assert got.numel() == want.numel() == fused.wire_nbytes(shape, dtype)
    layout = ref.layout(shape, dtype)
    for section in ("flags", "meta"):
        torch.testing.assert_close(layout.view(got, section), layout.view(want, section), rtol=0, atol=0)
    assert fused.last_rotated_fraction == pytest.approx(ref.last_rotated_fraction, abs=0)
    steps = element_steps(ref, want, shape)
    reference = ref.decode(want, shape, dtype)
    # Kernel decoder on reference bytes, reference decoder on kernel bytes, kernel on kernel.
    assert_within_one_step(fused.decode(want, shape, dtype), reference, steps)
    assert_within_one_step(ref.decode(got, shape, dtype), reference, steps)
    assert_within_one_step(fused.decode(got, shape, dtype), reference, steps)
    if fused.outlier_threshold == float("inf"):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    return got, want


@pytest.mark.parametrize("shape,dtype,config", CASES)
def test_kernel_matches_reference(shape, dtype, config):
    ref, fused = codecs(**config)
    x = activation_like(shape, dtype=dtype, seed=len(config), device=DEVICE)
    x.view(-1)[7] = float("nan")  # one bad tile
    got, _ = check_against_reference(ref, fused, x)
    assert fused.decode(got, shape, dtype).reshape(-1)[: fused.tile_size].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", EDGE_CASES)
def test_edge_cases(kind, dtype):
    ref, fused = codecs(tile_size=32)
    check_against_reference(ref, fused, edge_case_tensor(kind, dtype=dtype).to(DEVICE))


@pytest.mark.parametrize("allocation", ["token", "tile"])
def test_many_programs(allocation):
    # Many programs with a ragged last one (the codec tests run one under the interpreter), and
    # tokens longer than one entropy chunk (1024 channels).
    from megatron_tah.kernels.tah import triton_tah_decode, triton_tah_encode

    ref, fused = codecs(allocation=allocation, tile_size=32)
    x = activation_like((3, 2, 1100), dtype=torch.float32, seed=5, device=DEVICE)  # 210 tiles
    want = ref.encode(x)
    layout = ref.layout(x.shape, x.dtype)
    got = want.clone()
    got[16:] = 0
    triton_tah_encode(fused, x, got, layout, tiles_per_prog=16, rows_per_prog=2)
    for section in ("flags", "meta"):
        torch.testing.assert_close(layout.view(got, section), layout.view(want, section), rtol=0, atol=0)
    steps = element_steps(ref, want, x.shape)
    reference = ref.decode(want, x.shape, x.dtype)
    assert_within_one_step(triton_tah_decode(fused, want, x.shape, x.dtype, layout, tiles_per_prog=16), reference,
                           steps)
    assert_within_one_step(ref.decode(got, x.shape, x.dtype), reference, steps)


def test_unrotated_tiles_are_bit_exact():
    # Quantization and packing of tiles the Hadamard does not touch are the reference's exact ops.
    ref, fused = codecs(outlier_threshold=float("inf"), allocation="tile", tile_size=16)
    x = activation_like((6, 2, 100), dtype=torch.bfloat16, seed=1, device=DEVICE)
    got, want = check_against_reference(ref, fused, x)
    assert fused.last_rotated_fraction == 0.0
    out = torch.empty_like(x)
    fused.decode(got, x.shape, x.dtype, out=out)
    torch.testing.assert_close(out, ref.decode(want, x.shape, x.dtype), rtol=0, atol=0)


def test_stochastic_rounding_within_one_step():
    shape = (16, 2, 128)
    config = {"stochastic_rounding": True, "seed": 4}
    ref, fused = codecs(**config)
    x = activation_like(shape, dtype=torch.float32, seed=2, device=DEVICE)
    buf = fused.encode(x)
    assert torch.equal(buf, get_codec("tah", backend="triton", **config).encode(x))  # seeded
    near = get_codec("tah", backend="torch").encode(x)
    layout = ref.layout(shape, x.dtype)
    torch.testing.assert_close(layout.view(buf, "flags"), layout.view(near, "flags"), rtol=0, atol=0)
    # Rotated tiles: error bounded per tile by sqrt(G) * step in L2; check the decode against nearest's.
    y = ref.decode(buf, shape, x.dtype)
    steps = element_steps(ref, buf, shape)
    err = (y - x).reshape(-1, ref.tile_size)
    assert (err.norm(dim=1) <= steps.reshape(-1, ref.tile_size)[:, 0] * ref.tile_size**0.5 * 1.001).all()
    assert not torch.equal(layout.view(buf, "high"), layout.view(near, "high"))


def test_corrupt_flags_rejected_by_both_paths():
    ref, fused = codecs()
    x = activation_like((10, 1, 64), dtype=torch.float32, device=DEVICE)
    buf = fused.encode(x)
    flags = ref.layout(x.shape, x.dtype).view(buf, "flags")
    flags[0] ^= 0xFF
    for codec in (ref, fused):
        with pytest.raises(CodecError, match="low-bit tiles"):
            codec.decode(buf, x.shape, x.dtype)


def test_auto_backend_keeps_cpu_tensors_on_torch():
    codec = get_codec("tah")
    assert codec.has_triton_path() and not codec._use_triton(torch.device("cpu"))
