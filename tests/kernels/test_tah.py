"""Fused TAH-Quant kernels vs the torch reference: identical bytes (atol=0) and identical decodes.

The reference computes the entropy partials, the butterfly Hadamard and every division in the
kernels' order (``codecs/core/common.py``), so flags, metadata and packed codes match byte for byte,
stochastic rounding included. Runs on CPU tensors under TRITON_INTERPRET=1, or compiled on CUDA
(``scripts/gpu_check.sh``).
"""

import pytest
import torch

from megatron_tah.codecs import CodecError, WireFormatError, get_codec
from megatron_tah.codecs.core.samples import activation_like
from megatron_tah.kernels import common as kcommon
from tests.helpers.edge_cases import DTYPES, EDGE_CASES, edge_case_tensor, assert_same_values

DEVICE = kcommon.kernel_device()
pytestmark = [pytest.mark.triton, pytest.mark.skipif(DEVICE is None, reason=kcommon.why_no_kernels())]

# (shape, dtype, config): every tile size, both allocations, h a multiple of the tile and not,
# always / sometimes / never rotate, 2..8 bits, stochastic rounding.
CASES = [
    ((32, 2, 256), torch.bfloat16, {}),
    ((16, 3, 200), torch.float32, {"allocation": "tile", "tile_size": 32}),
    ((8, 2, 64), torch.float16, {"outlier_threshold": 0.0, "tile_size": 16}),
    ((10, 1, 40), torch.float32, {"tile_size": 8, "high_bits": 5, "low_bits": 2}),
    ((16, 2, 384), torch.bfloat16, {"tile_size": 128, "outlier_threshold": float("inf")}),
    ((16, 2, 320), torch.bfloat16, {"tile_size": 128}),
    ((12, 2, 160), torch.float16, {"allocation": "tile", "high_bits": 8, "low_bits": 6, "high_ratio": 0.5}),
    ((4, 2, 96), torch.float32, {"tile_size": 32, "high_ratio": 1.0}),
    ((16, 2, 128), torch.float32, {"low_bits_for": "high_entropy"}),
    ((6, 2, 128), torch.bfloat16, {"allocation": "tile", "tile_size": 16, "low_bits_for": "high_entropy"}),
    ((16, 2, 128), torch.float32, {"stochastic_rounding": True, "seed": 4}),
]


def codecs(**config):
    return get_codec("tah", backend="torch", **config), get_codec("tah", backend="triton", **config)


def check_against_reference(ref, fused, x):
    shape, dtype = tuple(x.shape), x.dtype
    want = ref.encode(x)
    got = fused.encode(x)
    assert got.numel() == want.numel() == fused.wire_nbytes(shape, dtype)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert fused.last_rotated_fraction == ref.last_rotated_fraction
    assert_same_values(fused.decode(want, shape, dtype), ref.decode(want, shape, dtype))
    return got


@pytest.mark.parametrize("shape,dtype,config", CASES)
def test_kernel_matches_reference(shape, dtype, config):
    ref, fused = codecs(**config)
    x = activation_like(shape, dtype=dtype, seed=len(config), device=DEVICE)
    x.view(-1)[7] = float("nan")  # one bad tile
    got = check_against_reference(ref, fused, x)
    y = fused.decode(got, shape, dtype)
    assert y.reshape(-1)[: fused.tile_size].isnan().all()
    assert not y.reshape(-1)[fused.tile_size:].isnan().any()
    if fused.outlier_threshold != float("inf"):
        assert 0 < fused.last_rotated_fraction


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", EDGE_CASES)
def test_edge_cases(kind, dtype):
    ref, fused = codecs(tile_size=32)
    check_against_reference(ref, fused, edge_case_tensor(kind, dtype=dtype).to(DEVICE))


@pytest.mark.parametrize("allocation", ["token", "tile"])
@pytest.mark.parametrize("per_lane,tiles", [(32, 8), (8, 4), (None, 2)])
def test_many_programs_and_lanes_per_tile(allocation, per_lane, tiles):
    # Many programs with a ragged last one (the codec tests run one under the interpreter), a ragged last
    # tile per token, and tiles spread over 1 to 8 lanes (reductions and butterflies across lanes).
    from megatron_tah.kernels.tah import triton_tah_allocate, triton_tah_decode, triton_tah_encode, triton_tah_tables

    ref, fused = codecs(allocation=allocation, tile_size=64)
    x = activation_like((3, 2, 1100), dtype=torch.float32, seed=5, device=DEVICE)  # 18 tiles per token
    shape = tuple(x.shape)
    want = ref.encode(x)
    layout = ref.layout(shape, x.dtype)
    got = want.clone()
    got[16:] = 0
    config = dict(tile_size=64, allocation=allocation)
    low_per_group = ref.low_units_per_group(shape)
    sections = fused._kernel_sections(got, layout)
    high_units, low_units = triton_tah_allocate(x, sections["flags"], low_per_group=low_per_group, invert=False,
                                                **config)
    # The device tables are the reference's (TahCodec.unit_tables) for the reference's flags.
    low = ref._read_flags(want, shape, layout)
    for table, expected in zip((high_units, low_units), ref.unit_tables(low, shape)):
        torch.testing.assert_close(table, expected, rtol=0, atol=0)
    widths = dict(high_bits=4, low_bits=3, **config)
    rotated = triton_tah_encode(x, sections, high_units, low_units, outlier_threshold=2.0, per_lane=per_lane,
                                tiles_per_prog=tiles, **widths)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert int(rotated.sum()) == round(ref.last_rotated_fraction * layout.view(want, "meta").numel())
    error = torch.zeros((), dtype=torch.int32, device=DEVICE)
    sections = fused._kernel_sections(want, layout)
    tables = triton_tah_tables(sections["flags"], shape, error, low_per_group=low_per_group, **config)
    for table, expected in zip(tables, (high_units, low_units)):
        torch.testing.assert_close(table, expected, rtol=0, atol=0)
    y = triton_tah_decode(sections, shape, x.dtype, *tables, error, rotates=True, per_lane=per_lane,
                          tiles_per_prog=tiles, **widths)
    assert_same_values(y, ref.decode(want, shape, x.dtype))
    assert int(error) == 0


def test_stochastic_rounding_is_the_references_and_seeded():
    shape = (16, 2, 128)
    config = {"stochastic_rounding": True, "seed": 4}
    ref, fused = codecs(**config)
    x = activation_like(shape, dtype=torch.float32, seed=2, device=DEVICE)
    buf = fused.encode(x)
    torch.testing.assert_close(buf, ref.encode(x), rtol=0, atol=0)
    assert torch.equal(buf, get_codec("tah", backend="triton", **config).encode(x))  # seeded
    near = get_codec("tah", backend="triton").encode(x)
    layout = ref.layout(shape, x.dtype)
    torch.testing.assert_close(layout.view(buf, "flags"), layout.view(near, "flags"), rtol=0, atol=0)
    assert not torch.equal(layout.view(buf, "high"), layout.view(near, "high"))
    # Error bounded per tile by sqrt(G) * step in L2 (rotated tiles) and by a step per element.
    y = ref.decode(buf, shape, x.dtype)
    steps = layout.view(buf, "scale", torch.bfloat16).float()
    err = (y - x).reshape(-1, ref.tile_size)
    assert (err.norm(dim=1) <= steps * ref.tile_size**0.5 * 1.001).all()


def test_corrupt_buffers_are_rejected_now_or_counted_on_the_device():
    ref, fused = codecs()
    x = activation_like((10, 1, 64), dtype=torch.float32, device=DEVICE)
    buf = fused.encode(x)
    layout = ref.layout(x.shape, x.dtype)
    flags = buf.clone()
    layout.view(flags, "flags")[0] ^= 0xFF
    pivots = buf.clone()
    layout.view(pivots, "meta")[3] = 0x80 | 0x7F  # rotated, pivot 127 in a tile of 64
    for codec in (ref, fused):
        with pytest.raises(CodecError, match="low-bit tiles"):
            codec.decode(flags, x.shape, x.dtype)
        with pytest.raises(CodecError, match="pivot"):
            codec.decode(pivots, x.shape, x.dtype)
    for corrupt in (flags, pivots):
        deferred = get_codec("tah", backend="triton").defer_checks()
        deferred.decode(buf, x.shape, x.dtype)
        deferred.raise_deferred_errors(wait=True)  # a good buffer: nothing counted
        y = deferred.decode(corrupt, x.shape, x.dtype)  # no sync, no error yet: values are garbage...
        assert y.shape == x.shape
        with pytest.raises(WireFormatError, match="check"):  # ...and the count says so
            deferred.raise_deferred_errors(wait=True)
        with pytest.raises(WireFormatError, match="check"):  # as does every later decode
            deferred.decode(buf, x.shape, x.dtype)


def test_decode_writes_into_out():
    ref, fused = codecs(tile_size=32)
    x = activation_like((6, 2, 96), dtype=torch.bfloat16, device=DEVICE)
    buf = fused.encode(x)
    out = torch.full_like(x, 7.0).requires_grad_()
    pointer = out.data_ptr()
    assert fused.decode(buf, x.shape, x.dtype, out=out) is out
    assert out.data_ptr() == pointer
    assert_same_values(out.detach(), ref.decode(buf, x.shape, x.dtype))


@pytest.mark.parametrize("name,config", [("tah", {}), ("tah", {"allocation": "tile"}), ("fixedpoint", {}),
                                         ("fp8", {})])
def test_hot_path_never_waits_for_the_device(name, config):
    # Meta tensors hold no data: any .item(), .tolist() or host copy on the encode or decode path raises.
    codec = get_codec(name, backend="triton", **config).defer_checks()
    shape = (64, 4, 512)
    x = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    out = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    with kcommon.recording() as launches:
        buf = codec.encode(x)
        assert codec.decode(buf, shape, x.dtype, out=out) is out
    assert buf.numel() == codec.wire_nbytes(shape, x.dtype) and launches


@pytest.mark.parametrize("name,config", [("tah", {"tile_size": 32}), ("tah", {"tile_size": 128}),
                                         ("fixedpoint", {"tile_size": 128}), ("fp8", {})])
def test_both_block_arrangements(monkeypatch, name, config):
    # Triton up to 3.6 gets its blocks' pointers in the other arrangement (kernels.common.block_flip):
    # the same bytes either way.
    from megatron_tah.kernels import fixedpoint, fp8, tah

    x = activation_like((8, 2, 320), dtype=torch.bfloat16, seed=3, device=DEVICE)
    ref = get_codec(name, backend="torch", **config)
    want = ref.encode(x)
    for module in (fixedpoint, fp8, tah):
        monkeypatch.setattr(module, "block_flip", lambda: not kcommon.block_flip())
    fused = get_codec(name, backend="triton", **config)
    torch.testing.assert_close(fused.encode(x), want, rtol=0, atol=0)
    assert_same_values(fused.decode(want, x.shape, x.dtype), ref.decode(want, x.shape, x.dtype))


def test_auto_backend_keeps_cpu_tensors_on_torch():
    codec = get_codec("tah")
    assert codec.has_triton_path() and not codec._use_triton(torch.device("cpu"))
