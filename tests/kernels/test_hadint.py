"""Fused hadint kernels vs the torch reference: identical bytes, identical decodes, both ways.

Runs the Triton path on CPU tensors under TRITON_INTERPRET=1 (``make test``), or on CUDA
(``scripts/gpu_check.sh``), where the same assertions hold for the compiled kernels.
"""

import pytest
import torch

from megatron_tah.codecs import get_codec
from megatron_tah.codecs.core.samples import activation_like
from megatron_tah.kernels import common as kcommon
from tests.helpers.edge_cases import DTYPES, EDGE_CASES, edge_case_tensor, assert_same_values

DEVICE = kcommon.kernel_device()
pytestmark = [pytest.mark.triton, pytest.mark.skipif(DEVICE is None, reason=kcommon.why_no_kernels())]

# (shape, options): h a multiple of the tile and not, tile sizes 8..128, 3..8 bits, with and without
# the transform, stochastic rounding.
CASES = [
    ((16, 2, 256), {}),
    ((8, 3, 200), {"bits": 4, "tile_size": 64}),
    ((5, 70), {"bits": 8, "tile_size": 32}),
    ((4, 1, 3, 96), {"bits": 3, "tile_size": 8}),
    ((6, 2, 384), {"bits": 5, "tile_size": 128}),
    ((7, 1, 48), {"bits": 6, "tile_size": 16, "hadamard": False}),
    ((3, 2, 136), {"bits": 4, "tile_size": 64, "stochastic_rounding": True, "seed": 3}),
    ((9, 130), {"bits": 7, "tile_size": 32, "stochastic_rounding": True, "hadamard_seed": 5}),
]


def codecs(**config):
    return get_codec("hadint", backend="torch", **config), get_codec("hadint", backend="triton", **config)


def assert_bit_exact(x, ref, tri):
    buf_ref = ref.encode(x.cpu())
    buf_tri = tri.encode(x.to(DEVICE))
    assert torch.equal(buf_tri.cpu(), buf_ref)  # same bytes (atol = 0)
    shape, dtype = x.shape, x.dtype
    assert_same_values(tri.decode(buf_ref.to(DEVICE), shape, dtype).cpu(), ref.decode(buf_ref, shape, dtype))
    out = torch.empty(shape, dtype=dtype, device=DEVICE)
    assert tri.decode(buf_tri, shape, dtype, out=out) is out
    assert_same_values(out.cpu(), ref.decode(buf_ref, shape, dtype))


@pytest.mark.parametrize("shape,options", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_bytes_and_decodes_equal_the_reference(shape, options, dtype):
    gen = torch.Generator().manual_seed(len(shape) * 7 + shape[-1])
    x = (torch.randn(shape, generator=gen) * torch.rand(shape[:-1] + (1,), generator=gen) * 4).to(dtype)
    ref, tri = codecs(**options)
    for _ in range(2):  # stochastic rounding: the second call draws new noise, on both paths alike
        assert_bit_exact(x, ref, tri)


@pytest.mark.parametrize("kind", EDGE_CASES)
def test_edge_cases(kind):
    x = edge_case_tensor(kind, shape=(6, 2, 96), dtype=torch.bfloat16)
    assert_bit_exact(x, *codecs(tile_size=32))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e37])
def test_bad_values_poison_their_tile_on_both_paths(bad):
    x = torch.randn(4, 2, 100)
    x[1, 0, 70] = bad
    assert_bit_exact(x, *codecs())


def test_activation_like_data_with_the_default_options():
    assert_bit_exact(activation_like((32, 2, 512), torch.bfloat16, seed=1), *codecs())
