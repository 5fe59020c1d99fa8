"""int8 (QuanGrad) codec: wire size, the half-step error bound, exact zeros, bad input, wire checks."""

import math

import pytest
import torch

from megatron_tah.codecs import CodecError, WireFormatError, get_codec
from megatron_tah.codecs.int8 import BLOCK_SIZES
from tests.helpers.edge_cases import DTYPES, EDGE_CASES, edge_case_tensor

OUTPUT_ULP = {torch.float32: 2**-24, torch.bfloat16: 2**-8, torch.float16: 2**-11}


def blocks_of(x, block_size):
    """Blocks as the codec forms them: rows of the last dim, padded by repeating the last element."""
    rows = x.float().reshape(-1, x.shape[-1])
    pad = -x.shape[-1] % block_size
    if pad:
        rows = torch.cat([rows, rows[:, -1:].expand(-1, pad)], dim=1)
    return rows.reshape(-1, block_size)


@pytest.mark.parametrize("block_size", [32, 128, 1024])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (5000,), (7, 3, 100), (4, 2, 256), (3, 1025)])
def test_wire_size_and_half_step_bound(block_size, dtype, shape):
    codec = get_codec("int8", block_size=block_size)
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * 3).to(dtype)
    buf = codec.encode(x)
    blocks = math.prod(shape[:-1]) * -(-shape[-1] // block_size)
    assert buf.numel() == codec.wire_nbytes(shape, dtype) == 16 + 4 * blocks + blocks * block_size + (
        -(16 + 4 * blocks + blocks * block_size) % 8)
    y = codec.decode(buf, shape, dtype)
    assert y.shape == x.shape and y.dtype == dtype
    # Every element within half a step (max|block| / 254) plus the product's and the cast's rounding.
    step = blocks_of(x, block_size).abs().amax(-1) / 127
    err = (blocks_of(y, block_size) - blocks_of(x, block_size)).abs()
    bound = step[:, None] * (0.5 + 1e-6) + blocks_of(x, block_size).abs() * OUTPUT_ULP[dtype] * 1.01
    assert (err <= bound).all(), (err - bound).max()


def test_bits_per_element():
    codec = get_codec("int8", block_size=128)
    assert 8 * codec.wire_nbytes((1 << 20,), torch.float32) / (1 << 20) == pytest.approx(8.25, abs=1e-3)
    assert 8 * get_codec("int8", block_size=1024).wire_nbytes((1 << 20,), torch.float32) / (1 << 20) == \
        pytest.approx(8.03125, abs=1e-3)


def test_zeros_signs_and_block_maximum_are_exact():
    x = torch.randn(4, 256)
    x[:, 10:40] = 0.0  # sparse gradients stay exactly zero
    x[2] = 0.0  # an all-zero block: scale 0
    codec = get_codec("int8", block_size=64)
    y = codec.decode(codec.encode(x), x.shape, x.dtype)
    assert torch.equal(y[x == 0], x[x == 0])
    assert ((torch.sign(y) == torch.sign(x)) | (y == 0)).all()
    blocks_x, blocks_y = blocks_of(x, 64), blocks_of(y, 64)
    peak = blocks_x.abs().argmax(-1, keepdim=True)
    assert torch.allclose(blocks_y.gather(-1, peak), blocks_x.gather(-1, peak), rtol=1e-6, atol=0)


def test_identical_input_gives_identical_bytes():
    x = torch.randn(3, 500)
    assert torch.equal(get_codec("int8").encode(x), get_codec("int8").encode(x.clone()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", EDGE_CASES)
def test_edge_cases_round_trip(dtype, kind):
    codec = get_codec("int8", block_size=32)
    x = edge_case_tensor(kind, dtype=dtype)
    y = codec.decode(codec.encode(x), x.shape, dtype)
    assert torch.isfinite(y).all()
    if kind in ("zeros", "constant"):  # a constant block is its own maximum: exact
        assert torch.equal(y.float(), x.float())
    bx, by = blocks_of(x, 32), blocks_of(y, 32)
    bound = bx.abs().amax(-1, keepdim=True) / 254 * (1 + 1e-6) + bx.abs() * OUTPUT_ULP[dtype] * 1.01
    subnormal = 2**-25 if dtype == torch.float16 else 0.0  # half of fp16's smallest subnormal
    assert ((by - bx).abs() <= bound + subnormal).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 1e37])
def test_non_finite_values_poison_only_their_block(bad):
    codec = get_codec("int8", block_size=64)
    x = torch.randn(4, 2, 256)
    x[1, 0, 70] = bad
    y = codec.decode(codec.encode(x), x.shape, x.dtype)
    assert torch.isnan(y[1, 0, 64:128]).all()
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[1, 0, 64:128] = False
    clean = x.clone()
    clean[1, 0, 70] = 0
    assert torch.equal(y[mask], codec.decode(codec.encode(clean), x.shape, x.dtype)[mask])


def test_bad_configs_dtypes_and_buffers_raise():
    for block_size in (16, 100, 2048):
        with pytest.raises(CodecError, match="block_size"):
            get_codec("int8", block_size=block_size)
    assert BLOCK_SIZES == (32, 64, 128, 256, 512, 1024)
    with pytest.raises(CodecError, match="unsupported dtype"):
        get_codec("int8").encode(torch.zeros(8, dtype=torch.float64))
    codec = get_codec("int8", block_size=64)
    x = torch.randn(8, 128)
    buf = codec.encode(x)
    with pytest.raises(WireFormatError, match="bytes"):
        codec.decode(buf[:-8], x.shape, x.dtype)
    other = buf.clone()
    other[4] ^= 1  # the config digest of another int8 codec of the same size
    with pytest.raises(WireFormatError, match="another config"):
        codec.decode(other, x.shape, x.dtype)
    with pytest.raises(WireFormatError, match="another shape"):
        codec.decode(buf, (16, 64), x.dtype)
    fp8 = get_codec("fp8", group_size=64)
    foreign = fp8.encode(x)
    foreign[3] = codec.codec_id
    with pytest.raises(WireFormatError, match="'int8'"):  # the id is registered: errors name the sender
        fp8.decode(foreign, x.shape, x.dtype)
    with pytest.raises(CodecError, match="no Triton path"):
        get_codec("int8", backend="triton").encode(x)
