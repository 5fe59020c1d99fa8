"""The saved-tensor quantizer (``kernels/laaq.py``): Triton kernel vs torch reference, byte for byte.

Both paths sit behind ``activation_memory.pack`` / ``unpack`` (``backend`` torch or triton). The
Triton path runs on CPU tensors under TRITON_INTERPRET=1, or compiled on CUDA (``scripts/gpu_check.sh``).
"""

import pytest
import torch

from megatron_tah.codecs.core.samples import activation_like
from megatron_tah.kernels import common as kcommon
from megatron_tah.kernels import laaq as kernels
from megatron_tah.megatron.activation_memory import pack, unpack
from tests.helpers.edge_cases import DTYPES, EDGE_CASES, edge_case_tensor, assert_same_values, with_bad_values

DEVICE = kcommon.kernel_device()
needs_kernels = pytest.mark.skipif(DEVICE is None, reason=kcommon.why_no_kernels())

# (shape, bits, block): what the hooks see -- [s, b, h] activations, [b * heads, s, d] views, an odd
# number of elements (not a multiple of the block), every block size, 2..8 bits.
CASES = [
    ((32, 2, 128), 4, 128),
    ((8, 3, 200), 5, 128),
    ((4099,), 6, 64),
    ((3, 7, 29), 8, 32),
    ((2, 4, 16, 16), 2, 16),
    ((5, 70), 3, 8),
    ((1, 1, 1000), 7, 128),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,bits,block", CASES)
@pytest.mark.parametrize("bad", [False, True], ids=["finite", "nan_inf"])
@needs_kernels
@pytest.mark.triton
def test_kernel_matches_reference(shape, bits, block, dtype, bad):
    x = activation_like(shape, dtype=dtype, seed=bits, device=DEVICE)
    if bad:
        x = with_bad_values(x)
    want = pack(x, bits, block, "torch")
    got = pack(x, bits, block, "triton")
    assert got.dtype == torch.uint8 and got.numel() == kernels.nbytes(x.numel(), bits, block) == want.numel()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # Each decoder reads the other's bytes exactly as its own.
    assert_same_values(unpack(want, shape, dtype, bits, block, "triton"), unpack(want, shape, dtype, bits, block, "torch"))


@pytest.mark.parametrize("kind", EDGE_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@needs_kernels
@pytest.mark.triton
def test_edge_cases_match_reference_and_round_trip(kind, dtype):
    x = edge_case_tensor(kind, (6, 2, 96), dtype).to(DEVICE)
    want = pack(x, 4, 128, "torch")
    torch.testing.assert_close(pack(x, 4, 128, "triton"), want, rtol=0, atol=0)
    y = unpack(want, x.shape, dtype, 4, 128, "triton")
    if kind in ("zeros", "constant"):  # constant blocks of a bf16-representable value decode exactly
        torch.testing.assert_close(y, x, rtol=0, atol=0)
    assert_within_half_a_step(x, y, 4, 128)


def assert_within_half_a_step(x, y, bits, block):
    """Every element within scale / 2 of its input (scale = (max - min) / levels of its block, rounded up to bf16),
    up to the final cast to x's dtype (half an ulp) and the reciprocal's rounding."""
    n = x.numel()
    padded = torch.cat([x.reshape(-1).float(), x.reshape(-1)[-1:].float().expand(-(-n // block) * block - n)])
    blocks = padded.view(-1, block)
    span = (blocks.amax(1) - blocks.amin(1)).double()
    step = span / (2**bits - 1) * (1 + 2**-7) + blocks.abs().amax(1).double() * 2**-7  # bf16 rounding of zero, scale
    err = (y.reshape(-1).double() - x.reshape(-1).double()).abs()
    bound = (step / 2).repeat_interleave(block)[:n] * (1 + 1e-5)
    ulp = x.reshape(-1).double().abs() * (2**-8 if x.dtype == torch.bfloat16 else 2**-11 if x.dtype == torch.float16 else 0)
    assert bool((err <= bound + ulp).all()), float((err - bound - ulp).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
def test_torch_round_trip_error_and_bytes(dtype, bits):
    x = activation_like((64, 2, 128), dtype=dtype, seed=3)
    buf = pack(x, bits, 128, "torch")
    assert buf.numel() == x.numel() * (bits + 32 / 128) / 8  # no header: (bits + 32 / block) / 8 bytes per element
    y = unpack(buf, x.shape, dtype, bits, 128, "torch")
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
    assert_within_half_a_step(x, y, bits, 128)


def test_probabilities_at_8_bits_within_a_510th_of_the_block_max():
    """Softmax rows lie in [0, 1]: zero rounds down to 0 when the block's minimum is below 2^-133, so the
    step is (max / 255) rounded up to bf16: at 8 bits every probability is within max / 510 (1 + 2^-7)."""
    probs = torch.randn(2, 4, 64, 64, generator=torch.Generator().manual_seed(0)).mul(4).softmax(-1)
    y = unpack(pack(probs, 8, 128, "torch"), probs.shape, probs.dtype, 8, 128, "torch")
    block_max = probs.reshape(-1, 128).amax(1, keepdim=True)
    err = (y - probs).abs().reshape(-1, 128)
    assert bool((err <= block_max / 510 * (1 + 2**-7) + 2**-24).all())
    assert bool((y >= -2**-24).all())


def test_non_contiguous_input_packs_like_its_contiguous_copy():
    x = activation_like((16, 4, 64), dtype=torch.bfloat16, seed=1).transpose(0, 1)
    assert not x.is_contiguous()
    torch.testing.assert_close(pack(x, 4, 64, "torch"), pack(x.contiguous(), 4, 64, "torch"), rtol=0, atol=0)
    assert torch.equal(unpack(pack(x, 4, 64, "torch"), x.shape, x.dtype, 4, 64, "torch"),
                       unpack(pack(x.contiguous(), 4, 64, "torch"), x.shape, x.dtype, 4, 64, "torch"))


def test_nan_and_inf_decode_their_block_to_nan_and_leave_others_alone():
    x = torch.linspace(-1, 1, 512).reshape(4, 128)
    x[1, 5], x[2, 7] = float("nan"), float("inf")
    y = unpack(pack(x, 4, 128, "torch"), x.shape, x.dtype, 4, 128, "torch")
    assert bool(y[1].isnan().all() and y[2].isnan().all())
    assert not bool(y[[0, 3]].isnan().any())
    assert_within_half_a_step(x[[0, 3]], y[[0, 3]], 4, 128)


def test_wrong_buffer_size_is_an_error():
    buf = pack(torch.randn(1000), 4, 128, "torch")
    with pytest.raises(ValueError, match="laaq buffer"):
        unpack(buf[:-1], (1000,), torch.float32, 4, 128, "torch")
    with pytest.raises(ValueError, match="laaq buffer"):
        unpack(buf, (1000,), torch.float32, 5, 128, "torch")


@needs_kernels
@pytest.mark.triton
def test_one_launch_each_way():
    x = torch.randn(3, 4099)
    with kcommon.recording() as launches:
        kernels.triton_laaq_pack(x, 4, 128)
    assert [launch.label for launch in launches] == ["fixedpoint_encode G128 b4"]
    buf = torch.empty(kernels.nbytes(x.numel(), 4, 128), dtype=torch.uint8)
    with kcommon.recording() as launches:
        kernels.triton_laaq_unpack(buf, x.shape, torch.bfloat16, 4, 128)
    assert [launch.label for launch in launches] == ["fixedpoint_decode G128 b4 ->bfloat16"]
