"""Fused fp8 kernels vs the torch reference: identical bytes and identical decodes, both ways.

The E4M3 cast is exact (checked against torch's own float8_e4m3fn on every code and on
ties); the pre-scale's tree sum, the butterfly Hadamard and every division are the
reference's operations in its order, so scales and codes are byte-identical (atol=0).
Runs on CPU tensors under TRITON_INTERPRET=1, or compiled on CUDA (``scripts/gpu_check.sh``).
"""

import pytest
import torch

from megatron_tah.codecs import get_codec
from megatron_tah.codecs.core.samples import activation_like
from megatron_tah.kernels import common as kcommon
from tests.helpers.edge_cases import DTYPES, EDGE_CASES, edge_case_tensor, assert_same_values

DEVICE = kcommon.kernel_device()
pytestmark = [pytest.mark.triton, pytest.mark.skipif(DEVICE is None, reason=kcommon.why_no_kernels())]

if DEVICE is not None:
    import triton
    import triton.language as tl

    from megatron_tah.kernels.fp8 import e4m3_bits_kernel, e4m3_value_kernel

    @triton.jit
    def e4m3_probe_kernel(x_ptr, code_ptr, value_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        mask = i < n
        code = e4m3_bits_kernel(tl.load(x_ptr + i, mask=mask, other=0.0))
        tl.store(code_ptr + i, code, mask=mask)
        tl.store(value_ptr + i, e4m3_value_kernel(code), mask=mask)

CASES = [
    ((16, 2, 256), torch.bfloat16, 128),
    ((8, 3, 200), torch.float32, 64),
    ((5, 70), torch.float16, 8),
    ((6, 2, 96), torch.float32, 32),
    ((4, 1, 48), torch.bfloat16, 16),
]


def codecs(group_size):
    return (get_codec("fp8", group_size=group_size, backend="torch"),
            get_codec("fp8", group_size=group_size, backend="triton"))


def test_e4m3_cast_matches_torch():
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes.view(torch.float8_e4m3fn).float()
    finite = finite[torch.isfinite(finite)]
    # Every representable value, the midpoints between neighbours (ties to even), and points just off them.
    grid = finite.unique()
    mid = (grid[1:] + grid[:-1]) / 2
    probes = torch.cat([grid, mid, mid.nextafter(torch.tensor(1e9)), mid.nextafter(torch.tensor(-1e9)),
                        torch.tensor([-0.0, 1e-30, -3e-4, 447.99])])
    probes = probes.clamp(-448, 448).contiguous().to(DEVICE)
    n = probes.numel()
    code = torch.empty(n, dtype=torch.int32, device=DEVICE)
    value = torch.empty(n, dtype=torch.float32, device=DEVICE)
    e4m3_probe_kernel[(1,)](probes, code, value, n, BLOCK=triton.next_power_of_2(n))
    want = probes.to(torch.float8_e4m3fn)
    torch.testing.assert_close(code.to(torch.uint8), want.view(torch.uint8), rtol=0, atol=0)
    torch.testing.assert_close(value, want.float(), rtol=0, atol=0)


def check_against_reference(ref, fused, x):
    shape, dtype = tuple(x.shape), x.dtype
    want = ref.encode(x)
    got = fused.encode(x)
    assert got.numel() == want.numel() == fused.wire_nbytes(shape, dtype)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    reference = ref.decode(want, shape, dtype)
    assert_same_values(fused.decode(want, shape, dtype), reference)
    return got


@pytest.mark.parametrize("shape,dtype,group_size", CASES)
def test_kernel_matches_reference(shape, dtype, group_size):
    ref, fused = codecs(group_size)
    x = activation_like(shape, dtype=dtype, seed=group_size, device=DEVICE)
    x.view(-1)[3] = float("nan")  # one bad group
    got = check_against_reference(ref, fused, x)
    y = fused.decode(got, shape, dtype)
    assert y.reshape(-1)[:group_size].isnan().all() and not y.reshape(-1)[group_size:].isnan().any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", EDGE_CASES)
def test_edge_cases(kind, dtype):
    ref, fused = codecs(32)
    check_against_reference(ref, fused, edge_case_tensor(kind, dtype=dtype).to(DEVICE))


@pytest.mark.parametrize("per_lane,groups", [(16, 8), (32, 4), (8, 2)])
def test_many_programs_and_lanes_per_group(per_lane, groups):
    # Many programs with a ragged last one (the codec tests run one under the interpreter), and groups
    # spread over 2 to 8 lanes (tree sums and butterflies across lanes).
    from megatron_tah.kernels.fp8 import triton_fp8_decode, triton_fp8_encode

    ref, _ = codecs(64)
    x = activation_like((5, 3, 200), dtype=torch.float16, seed=1, device=DEVICE)  # 60 groups
    want = ref.encode(x)
    layout = ref.layout(x.shape, x.dtype)
    got = want.clone()
    got[16:] = 0
    triton_fp8_encode(x, layout.sections(got), 64, per_lane=per_lane, groups_per_prog=groups)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    y = triton_fp8_decode(layout.sections(want), x.shape, x.dtype, 64, per_lane=per_lane, groups_per_prog=groups)
    assert_same_values(y, ref.decode(want, x.shape, x.dtype))


def test_decode_into_out():
    ref, fused = codecs(64)
    x = activation_like((4, 2, 128), dtype=torch.bfloat16, device=DEVICE)
    buf = ref.encode(x)
    out = torch.empty_like(x)
    assert fused.decode(buf, x.shape, x.dtype, out=out) is out
    torch.testing.assert_close(out, ref.decode(buf, x.shape, x.dtype), rtol=0, atol=0)


def test_auto_backend_keeps_cpu_tensors_on_torch():
    codec = get_codec("fp8")
    assert codec.has_triton_path() and not codec._use_triton(torch.device("cpu"))
