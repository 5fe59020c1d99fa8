"""Codec library: wire sizes, error bounds, rotation, determinism and bad input (torch references).

The generic tests take a ``case`` (``codec_cases``): every registered codec at its defaults, then a few
named variants; the focused ones name their codecs."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tah.codecs import CodecError, WireFormatError, get_codec
from megatron_tah.codecs.core import common
from megatron_tah.codecs.core.samples import activation_like
from tests.helpers.codec_cases import Case, cases, encode
from tests.helpers.edge_cases import DTYPES, EDGE_CASES, edge_case_tensor, rel_error

# Variants run by the generic tests after every registered codec; the focused tests below name their keys.
VARIANTS = {
    "fixedpoint3": Case("fixedpoint", {"bits": 3, "tile_size": 64}),
    "tah_tile": Case("tah", {"allocation": "tile", "tile_size": 32}),
    "tah_always": Case("tah", {"outlier_threshold": 0.0, "tile_size": 16}),
}
CASES = cases(variants=VARIANTS)
# Codecs that keep no state per sample: a receiver may decode the same buffer twice, and check it on the device.
STATELESS = cases(keep=lambda case: not case.declaration.needs_sample_ids)
BAD_VALUES = [float("nan"), float("inf"), -float("inf"), 1e37]


def make(key: str):
    """A codec of the focused tests: a registered codec at its defaults, or a variant."""
    return (VARIANTS[key] if key in VARIANTS else Case(key)).make()


def tile_error_norms(x, y, tile_size):
    """L2 norm of the error per tile over the real channels (padding counts as zero error)."""
    diff = (x.float() - y.float()).reshape(-1, x.shape[-1])
    diff = torch.nn.functional.pad(diff, (0, -x.shape[-1] % tile_size))
    return diff.reshape(-1, tile_size).norm(dim=-1)


# ----- wire size ---------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(8, 2, 64), (7, 3, 100), (1, 1, 8), (33, 1, 130), (16, 4, 256)])
def test_wire_size_matches_wire_nbytes(case, dtype, shape):
    sender, receiver = case.make(), case.make()  # (one object per link end: aqsgd keeps state on each)
    # a fixed input: the error bound is a typical one (tah at 8 values exceeds it for 1 draw in 100)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1234)).to(dtype)
    nbytes = sender.wire_nbytes(shape, dtype)
    buf = encode(sender, x)
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    assert buf.numel() == nbytes == receiver.wire_nbytes(shape, dtype)
    y = receiver.decode(buf, shape, dtype)
    assert y.shape == x.shape and y.dtype == dtype
    assert rel_error(x, y) < 0.35


def test_tah_bits_per_element_on_the_paper_shape():
    shape = (1024, 4, 4096)
    codec = get_codec("tah", tile_size=64, high_bits=4, low_bits=3, high_ratio=0.8, outlier_threshold=2.0)
    x = activation_like(shape, torch.bfloat16)
    buf = codec.encode(x)
    bits = 8 * buf.numel() / math.prod(shape)
    assert bits <= 4.45, bits
    # 80/20 mix of 4 and 3 bits is 3.8 bits of values; metadata adds at least 40 bits per tile of 64.
    assert bits > 3.8 + 40 / 64
    assert rel_error(x, codec.decode(buf, shape, torch.bfloat16)) < 0.2


def test_tah_low_bit_count_is_fixed_by_the_shape():
    codec = get_codec("tah", high_ratio=0.8)
    for s in (10, 11, 1, 5):
        assert codec.low_units_per_group((s, 2, 64)) == math.floor(s * 0.2 + 1e-9)
    x = torch.randn(10, 3, 128)
    layout = codec.layout(x.shape, x.dtype)
    flags = common.unpack_flags(layout.view(codec.encode(x), "flags"), 30).reshape(10, 3)
    assert flags.sum(dim=0).tolist() == [2, 2, 2]


def test_tah_token_allocation_gives_low_bits_to_low_entropy_tokens():
    x = torch.randn(10, 1, 64)
    peaked = [1, 7]  # one big channel each: low entropy
    x[peaked, 0, :] = 0.01 * x[peaked, 0, :]
    x[peaked, 0, 3] = 5.0
    codec = get_codec("tah", high_ratio=0.8, tile_size=64)
    buf = codec.encode(x)
    flags = common.unpack_flags(codec.layout(x.shape, x.dtype).view(buf, "flags"), 10)
    assert flags.nonzero().flatten().tolist() == peaked
    # The diagnostic inversion gives the low bits to the two highest-entropy tokens instead.
    inverted = get_codec("tah", high_ratio=0.8, tile_size=64, low_bits_for="high_entropy")
    assert inverted.config_digest() != codec.config_digest()  # a receiver configured otherwise is refused
    flags = common.unpack_flags(inverted.layout(x.shape, x.dtype).view(inverted.encode(x), "flags"), 10)
    p = x.abs() / x.abs().sum(dim=-1, keepdim=True)
    entropy = -(p * torch.log(p + 1e-8)).sum(dim=-1).flatten()
    assert flags.nonzero().flatten().tolist() == sorted(entropy.topk(2).indices.tolist())
    with pytest.raises(CodecError, match="low_bits_for"):
        get_codec("tah", low_bits_for="middle")


# ----- error bounds ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_none_is_bit_exact(dtype):
    x = activation_like((5, 3, 70), dtype)
    codec = get_codec("none")
    y = codec.decode(codec.encode(x), x.shape, dtype)
    assert torch.equal(y.view(torch.uint8) if dtype != torch.float32 else y, x.view(torch.uint8) if dtype != torch.float32 else x)


def _tile_steps(codec, buf, shape, dtype):
    layout = codec.layout(shape, dtype)
    return layout.view(buf, "scale", torch.bfloat16).float()


@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("tile_size", [16, 32, 64])
def test_fixedpoint_error_is_at_most_half_a_step(bits, tile_size):
    shape = (9, 2, 100)  # h not divisible by any tile size: exercises padding
    x = activation_like(shape, torch.float32, seed=bits)
    codec = get_codec("fixedpoint", bits=bits, tile_size=tile_size)
    buf = codec.encode(x)
    y = codec.decode(buf, shape, torch.float32)
    step = _tile_steps(codec, buf, shape, torch.float32)
    tiles_x, _ = common.to_tiles(x, tile_size)
    tiles_y, _ = common.to_tiles(y, tile_size)
    err = (tiles_x - tiles_y).abs().reshape(step.numel(), tile_size)
    bound = step[:, None] / 2 * (1 + 1e-5) + 1e-6
    assert (err <= bound).all()
    # The stored step is the ideal (max - min) / (2^b - 1) up to bf16 rounding.
    span = (tiles_x.amax(-1) - tiles_x.amin(-1)).reshape(-1) / (2**bits - 1)
    assert torch.allclose(step, span, rtol=2**-6)


def test_tah_error_bound_per_tile():
    shape = (16, 2, 128)
    x = activation_like(shape, torch.float32)
    codec = get_codec("tah", tile_size=32, outlier_threshold=2.0)
    buf = codec.encode(x)
    y = codec.decode(buf, shape, torch.float32)
    step = _tile_steps(codec, buf, shape, torch.float32)
    tile_err = tile_error_norms(x, y, 32)
    # Orthonormal rotation preserves the L2 error: sqrt(G) * step / 2 per tile at most.
    assert (tile_err <= math.sqrt(32) * step / 2 * (1 + 1e-4) + 1e-6).all()
    assert 0 < codec.last_rotated_fraction < 1


def test_hadamard_rotation_earns_its_place():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2, 256, generator=gen)
    x[..., ::64] = 20 * x.abs().max()  # one large outlier per 64-channel tile
    rotated = get_codec("tah", tile_size=64, outlier_threshold=2.0)
    plain = get_codec("tah", tile_size=64, outlier_threshold=float("inf"))
    err_rot = rel_error(x, rotated.decode(rotated.encode(x), x.shape, x.dtype))
    err_plain = rel_error(x, plain.decode(plain.encode(x), x.shape, x.dtype))
    assert rotated.last_rotated_fraction == 1.0 and plain.last_rotated_fraction == 0.0
    assert err_rot * 2 <= err_plain, (err_rot, err_plain)


def test_hadamard_rotation_does_not_hurt_gaussian_tiles():
    x = torch.randn(64, 2, 256, generator=torch.Generator().manual_seed(1))
    always = get_codec("tah", outlier_threshold=0.0)
    never = get_codec("tah", outlier_threshold=float("inf"))
    err_always = rel_error(x, always.decode(always.encode(x), x.shape, x.dtype))
    err_never = rel_error(x, never.decode(never.encode(x), x.shape, x.dtype))
    assert err_always <= err_never * 1.02, (err_always, err_never)


@pytest.mark.parametrize("tau", [0.0, 1.5, 2.0, float("inf")])
def test_outlier_test_matches_the_spec_definition(tau):
    """find_outliers == the SPEC's rule written with topk: |a1| / (|a2| + eps) > tau, pivot = first argmax."""
    gen = torch.Generator().manual_seed(7)
    tiles = torch.randn(40, 3, 16, generator=gen)
    tiles[::3, :, 5] *= 20  # outliers
    tiles[1, 0, 2] = tiles[1, 0, 9] = -50.0  # tied largest magnitudes: ratio 1, pivot 2
    tiles[2, 1] = 0.0  # all-zero tile
    tiles[4, 2, :] = 3.0  # constant tile
    rotate, pivot = get_codec("tah", tile_size=16, outlier_threshold=tau).find_outliers(tiles)
    top2 = tiles.abs().topk(2, dim=-1).values
    ratio = top2[..., 0] / (top2[..., 1] + 1e-8)
    expected = torch.ones_like(ratio, dtype=torch.bool) if tau == 0 else ratio > tau
    assert torch.equal(rotate, expected)
    assert torch.equal(pivot, torch.where(expected, tiles.abs().argmax(dim=-1), 0))
    assert (tau == 0) == bool(rotate[1, 0]) and pivot[1, 0] == (2 if tau == 0 else 0)
    assert 0 < int(rotate.sum()) < rotate.numel() or tau in (0.0, float("inf"))


def test_rotation_is_exactly_invertible():
    from megatron_tah.codecs.tah import rotate_tiles, unrotate_tiles

    tiles = torch.randn(10, 3, 16, dtype=torch.float64).float()
    rotate = torch.rand(10, 3) > 0.5
    pivot = torch.randint(0, 16, (10, 3)) * rotate
    back = unrotate_tiles(rotate_tiles(tiles, rotate, pivot), rotate, pivot)
    assert torch.allclose(back, tiles, atol=1e-5)


def test_stochastic_rounding_is_unbiased_and_seeded():
    x = torch.full((1, 1, 64), 0.3)
    x[..., 0] = 0.0
    x[..., 1] = 1.0
    codec = get_codec("fixedpoint", bits=2, tile_size=64, stochastic_rounding=True, seed=3)
    mean = torch.stack([codec.decode(codec.encode(x), x.shape, x.dtype) for _ in range(400)]).mean(0)
    assert abs(mean[0, 0, 5:].mean().item() - 0.3) < 0.01  # round-to-nearest would give 1/3
    again = get_codec("fixedpoint", bits=2, tile_size=64, stochastic_rounding=True, seed=3)
    first = get_codec("fixedpoint", bits=2, tile_size=64, stochastic_rounding=True, seed=3).encode(x)
    assert torch.equal(first, again.encode(x))


@pytest.mark.parametrize("name", ["tah", "fixedpoint"])
def test_stochastic_rounding_state_resumes_the_same_noise(name):
    x = activation_like((8, 2, 128), seed=3)
    running = get_codec(name, stochastic_rounding=True, seed=11)
    running.encode(x), running.encode(x)
    state = running.state_dict()
    resumed = get_codec(name, stochastic_rounding=True, seed=11)
    assert not torch.equal(resumed.encode(x), running.encode(x))  # a fresh codec starts the sequence over...
    resumed = get_codec(name, stochastic_rounding=True, seed=11)
    resumed.load_state_dict(state)
    running = get_codec(name, stochastic_rounding=True, seed=11)
    for _ in range(2):
        running.encode(x)
    assert torch.equal(resumed.encode(x), running.encode(x))  # ...a restored one continues it
    with pytest.raises(ValueError, match="seed"):
        get_codec(name, stochastic_rounding=True, seed=12).load_state_dict(state)
    assert get_codec(name).state_dict() == {}  # round to nearest: nothing to save


# ----- determinism -------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
def test_identical_input_gives_identical_bytes(case):
    x = activation_like((12, 2, 192), torch.bfloat16, seed=5)
    assert torch.equal(encode(case.make(), x), encode(case.make(), x.clone()))


# ----- bad input -----------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", EDGE_CASES)
def test_edge_cases_round_trip_without_nan(case, dtype, kind):
    sender, receiver = case.make(), case.make()
    x = edge_case_tensor(kind, dtype=dtype)
    y = receiver.decode(encode(sender, x), x.shape, dtype)
    assert torch.isfinite(y).all()
    if kind == "zeros":
        assert torch.equal(y.float(), x.float())
    else:
        assert rel_error(x, y) < 0.35


@pytest.mark.parametrize("key", ["fixedpoint", "fixedpoint3", "tah", "tah_tile"])  # no forced rotation
@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_tiles_decode_exactly(key, dtype):
    codec = make(key)
    x = edge_case_tensor("constant", dtype=dtype)
    assert torch.equal(codec.decode(codec.encode(x), x.shape, dtype).float(), x.float())  # 3.25 is exact in bf16


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("bad", BAD_VALUES)
def test_a_bad_value_decodes_to_nan_where_it_was_and_the_rest_stays_finite(case, bad):
    """The codecs' common rule: a bad value (NaN, +-Inf, beyond MAX_ABS_VALUE) decodes to NaN in its place, never
    to a finite number, and poisons only its own neighbourhood (its tile, block or channel); a lossless codec
    (its round trip exact) gives it back as it was."""
    x = torch.randn(4, 2, 256, generator=torch.Generator().manual_seed(0))
    sender, receiver = case.make(), case.make()
    lossless = torch.equal(receiver.decode(encode(sender, x), x.shape, x.dtype), x)
    x[1, 0, 70] = bad
    sender, receiver = case.make(), case.make()
    y = receiver.decode(encode(sender, x), x.shape, x.dtype)
    if lossless:
        assert torch.equal(y.nan_to_num(7.0), x.nan_to_num(7.0))
        return
    assert torch.isnan(y[1, 0, 70])
    assert torch.isfinite(y).float().mean() >= 0.9


@pytest.mark.parametrize("case", CASES)
def test_unsupported_dtypes_and_empty_shapes_raise(case):
    for bad in (torch.float64, torch.int32, torch.uint8):
        with pytest.raises(CodecError, match="unsupported dtype"):
            encode(case.make(), torch.zeros(2, 2, 8, dtype=bad))
        with pytest.raises(CodecError, match="unsupported dtype"):
            case.make().wire_nbytes((2, 2, 8), bad)
    with pytest.raises(CodecError, match="empty"):
        case.make().wire_nbytes((0, 2, 8), torch.float32)


@pytest.mark.parametrize("key", ["fixedpoint", "fixedpoint3", "tah", "tah_tile", "tah_always", "fp8"])
@pytest.mark.parametrize("bad", BAD_VALUES)
def test_non_finite_values_poison_only_their_tile(key, bad):
    codec = make(key)
    x = torch.randn(4, 2, 256)
    x[1, 0, 70] = bad
    y = codec.decode(codec.encode(x), x.shape, x.dtype)
    g = getattr(codec, "tile_size", None) or getattr(codec, "group_size")
    tile = slice(70 // g * g, 70 // g * g + g)
    assert torch.isnan(y[1, 0, tile]).all()
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[1, 0, tile] = False
    assert torch.isfinite(y[mask]).all()
    clean = x.clone()
    clean[1, 0, 70] = 0
    y_clean = codec.decode(codec.encode(clean), x.shape, x.dtype)
    # Tiles elsewhere decode the same as without the bad value, except where a per-token choice moved.
    assert (y[mask] == y_clean[mask]).float().mean() > 0.95


def test_fp16_near_its_limit_does_not_overflow():
    x = torch.full((2, 1, 64), 65504.0, dtype=torch.float16)
    x[..., ::2] = -65504.0
    for key in ("fixedpoint3", "tah", "fp8"):
        codec = make(key)
        y = codec.decode(codec.encode(x), x.shape, x.dtype)
        assert torch.isfinite(y).all(), key


def test_unsupported_dtype_and_shapes_raise():
    for bad in (torch.float64, torch.int32, torch.uint8):
        with pytest.raises(CodecError, match="unsupported dtype"):
            get_codec("fixedpoint").encode(torch.zeros(2, 2, 8, dtype=bad))
    with pytest.raises(CodecError, match=r"\[s, b, h\]"):
        get_codec("tah").encode(torch.zeros(4, 64))
    with pytest.raises(CodecError, match="empty"):
        get_codec("fixedpoint").wire_nbytes((0, 2, 8), torch.float32)


def test_bad_configs_raise():
    with pytest.raises(CodecError, match="tile_size"):
        get_codec("tah", tile_size=48)
    with pytest.raises(CodecError, match="low_bits"):
        get_codec("tah", high_bits=3, low_bits=4)
    with pytest.raises(CodecError, match="bits"):
        get_codec("fixedpoint", bits=9)
    with pytest.raises(CodecError, match="high_ratio"):
        get_codec("tah", high_ratio=1.5)
    with pytest.raises(CodecError, match="outlier_threshold"):
        get_codec("tah", outlier_threshold=float("nan"))
    with pytest.raises(CodecError, match="unknown codec"):
        get_codec("int4")
    with pytest.raises(CodecError, match="unexpected keyword"):
        get_codec("fixedpoint", tile=32)


def test_wrong_buffers_raise_clear_errors():
    x = torch.randn(8, 2, 64)
    tah = get_codec("tah")
    buf = tah.encode(x)
    with pytest.raises(WireFormatError, match="bytes"):
        tah.decode(buf[:-8], x.shape, x.dtype)
    with pytest.raises(WireFormatError, match="552 expected"):
        get_codec("tah", high_ratio=0.5).decode(buf, x.shape, x.dtype)
    other = get_codec("tah", outlier_threshold=4.0)  # same size, different config
    assert other.wire_nbytes(x.shape, x.dtype) == buf.numel()
    with pytest.raises(WireFormatError, match="another config"):
        other.decode(buf, x.shape, x.dtype)
    fixed = get_codec("fixedpoint", bits=4, tile_size=64)
    fbuf = fixed.encode(x)
    with pytest.raises(WireFormatError, match="another shape"):
        fixed.decode(fbuf, (16, 1, 64), x.dtype)  # same size, other shape
    with pytest.raises(WireFormatError):
        tah.decode(fbuf, x.shape, x.dtype)
    garbage = buf.clone()
    garbage[:2] = 0
    with pytest.raises(WireFormatError, match="magic"):
        tah.decode(garbage, x.shape, x.dtype)
    with pytest.raises(WireFormatError, match="uint8"):
        tah.decode(buf.float(), x.shape, x.dtype)


def test_codec_id_mismatch_names_the_sender():
    x = torch.randn(4, 1, 64)
    sender = get_codec("fixedpoint", bits=8, tile_size=64)
    receiver = get_codec("fixedpoint", bits=8, tile_size=64)
    buf = sender.encode(x)
    buf[3] = 2  # pretend the sender was tah
    get_codec("tah")  # (its module registers its id)
    with pytest.raises(WireFormatError, match="'tah'"):
        receiver.decode(buf, x.shape, x.dtype)


# The ids of the codecs that shipped (byte 3 of the header): wire constants, so they are written out here; a codec
# added since has its own in its test file.
CODEC_IDS = {"none": 0, "fixedpoint": 1, "tah": 2, "fp8": 3, "aqsgd": 4, "int8": 5, "mxfp4": 6, "nvfp4": 7,
             "hadint": 8, "lowrank": 9, "channel": 10}


@pytest.mark.parametrize("case", cases())
def test_a_codec_is_registered_under_its_name_with_an_id_of_its_own(case):
    from megatron_tah.codecs import CODECS, codec_class, load_all_codecs
    from megatron_tah.codecs.core.header import codec_name_for_id

    load_all_codecs()
    cls = codec_class(case.name)
    assert cls.name == case.name and codec_name_for_id(cls.codec_id) == case.name
    assert [name for name in CODECS if codec_class(name).codec_id == cls.codec_id] == [case.name]
    assert CODEC_IDS.get(case.name, cls.codec_id) == cls.codec_id


def test_every_codec_has_its_own_id_and_a_duplicate_is_an_error_at_import():
    from megatron_tah.codecs import CODECS, codec_class, load_all_codecs
    from megatron_tah.codecs.core.header import codec_name_for_id, register_codec_id

    load_all_codecs()
    assert set(CODEC_IDS) <= set(CODECS)
    assert all(codec_class(name).codec_id == i and codec_name_for_id(i) == name for name, i in CODEC_IDS.items())
    register_codec_id(2, "tah")  # the same codec again (a module imported twice): nothing to do
    with pytest.raises(ValueError, match="codec_id = 2 of codec 'newcodec' is already codec 'tah'"):
        register_codec_id(2, "newcodec")
    with pytest.raises(ValueError, match="codec_id = 300"):
        register_codec_id(300, "newcodec")
    assert codec_name_for_id(2) == "tah"


def test_decode_into_out_tensor():
    x = torch.randn(6, 2, 64, dtype=torch.bfloat16)
    codec = get_codec("tah")
    out = torch.empty(6, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    result = codec.decode(codec.encode(x), x.shape, x.dtype, out=out)
    assert result is out
    assert torch.equal(out.detach(), codec.decode(codec.encode(x), x.shape, x.dtype))
    with pytest.raises(CodecError, match="out is"):
        codec.decode(codec.encode(x), x.shape, x.dtype, out=torch.empty(6, 2, 64))


# ----- building blocks -------------------------------------------------------------------------
@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_unpack_round_trip(bits):
    codes = torch.randint(0, 2**bits, (8 * 37,), dtype=torch.uint8)
    packed = common.pack_bits(codes, bits)
    assert packed.numel() == 37 * bits
    assert torch.equal(common.unpack_bits(packed, bits, codes.numel()), codes)


def test_round_bf16_is_directed():
    x = torch.randn(10000) * torch.logspace(-30, 30, 10000)
    down, up = common.round_bf16(x, -1), common.round_bf16(x, +1)
    assert (down <= x).all() and (up >= x).all()
    assert torch.equal(down.to(torch.bfloat16).float(), down) and torch.equal(up.to(torch.bfloat16).float(), up)
    assert ((up - down) <= x.abs() * 2**-7).all()


@pytest.mark.parametrize("size", [8, 16, 32, 64, 128])
def test_hadamard_is_orthonormal_with_constant_first_row(size):
    h = common.hadamard_matrix(size)
    assert torch.allclose(h @ h, torch.eye(size), atol=1e-6)
    assert torch.allclose(h[0], torch.full((size,), size**-0.5))


# ----- property-based ------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    s=st.integers(1, 12), b=st.integers(1, 3), h=st.integers(1, 200),
    tile_size=st.sampled_from([16, 32, 64]), scale=st.floats(1e-3, 1e4),
    high_ratio=st.sampled_from([0.0, 0.5, 0.8, 1.0]), seed=st.integers(0, 2**16),
)
def test_tah_round_trip_property(s, b, h, tile_size, scale, high_ratio, seed):
    x = torch.randn(s, b, h, generator=torch.Generator().manual_seed(seed)) * scale
    codec = get_codec("tah", tile_size=tile_size, high_ratio=high_ratio)
    buf = codec.encode(x)
    assert buf.numel() == codec.wire_nbytes(x.shape, x.dtype)
    y = codec.decode(buf, x.shape, x.dtype)
    step = _tile_steps(codec, buf, x.shape, x.dtype)
    tile_err = tile_error_norms(x, y, tile_size)
    assert (tile_err <= math.sqrt(tile_size) * step / 2 * (1 + 1e-4) + 1e-6 * scale).all()


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple).filter(lambda t: t[-1] > 0),
    bits=st.integers(2, 8), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16),
)
def test_fixedpoint_round_trip_property(shape, bits, dtype, seed):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    codec = get_codec("fixedpoint", bits=bits, tile_size=8)
    buf = codec.encode(x)
    y = codec.decode(buf, shape, dtype)
    step = _tile_steps(codec, buf, shape, dtype)
    err = (common.to_tiles(x, 8)[0] - common.to_tiles(y.float(), 8)[0]).abs().reshape(-1, 8)
    # The output dtype's own rounding adds at most half an ulp of the value.
    ulp = common.to_tiles(x, 8)[0].abs().reshape(-1, 8) * (2**-8 if dtype == torch.bfloat16 else 2**-11)
    assert (err <= step[:, None] / 2 * (1 + 1e-5) + ulp + 1e-6).all()


# ----- checks once per link, and statistics without host syncs -----------------------------------
@pytest.mark.parametrize("case", STATELESS)
def test_deferred_checks_count_foreign_headers_and_raise_later(case):
    x = torch.randn(8, 2, 128)
    codec = case.make()
    buf = codec.encode(x)
    other = get_codec("fixedpoint", bits=8, tile_size=64).encode(x)[:16]  # someone else's header
    forged = torch.cat([other, buf[16:]])
    deferred = case.make().defer_checks()
    assert deferred.checks == "deferred"
    deferred.decode(buf, x.shape, x.dtype)
    deferred.decode(forged, x.shape, x.dtype)  # no error yet: a mismatch is only counted
    with pytest.raises(WireFormatError, match="1 check"):
        deferred.raise_deferred_errors(wait=True)
    with pytest.raises(WireFormatError, match="check"):
        deferred.decode(buf, x.shape, x.dtype)
    unchecked = case.make().defer_checks("off")
    unchecked.decode(forged, x.shape, x.dtype)
    unchecked.raise_deferred_errors(wait=True)  # "off" counts nothing
    with pytest.raises(WireFormatError, match="bytes"):  # the length is always checked
        unchecked.decode(buf[:-8], x.shape, x.dtype)
    with pytest.raises(CodecError, match="checks"):
        case.make().defer_checks("sometimes")


@pytest.mark.parametrize("case", STATELESS)
def test_decode_writes_into_a_contiguous_out(case):
    x = torch.randn(6, 2, 96)
    codec = case.make()
    buf = codec.encode(x)
    out = torch.full_like(x, 7.0)
    pointer = out.data_ptr()
    assert codec.decode(buf, x.shape, x.dtype, out=out) is out and out.data_ptr() == pointer
    assert torch.equal(out, codec.decode(buf, x.shape, x.dtype))
    strided = torch.empty(6, 2, 192)[..., ::2]  # not contiguous: decoded, then copied in
    assert codec.decode(buf, x.shape, x.dtype, out=strided) is strided
    assert torch.equal(strided, out)


def test_timing_helpers_keep_values_pending():
    from megatron_tah.codecs.core import timing

    assert timing.add(1.0, 2.0) == 3.0 and timing.add(1.0, None) == 1.0
    pending = timing.add(timing.add(0.5, torch.tensor(0.25)), torch.tensor(1.0))
    assert isinstance(pending, timing.Pending) and timing.to_float(pending) == 1.75
    watch = timing.Stopwatch("cpu")
    assert 0 <= watch.stop() < 5
    x = torch.tensor([3.0, 4.0])
    assert timing.relative_error(x, torch.zeros(2)).item() == 1.0
    assert timing.relative_error(torch.zeros(2), x).item() == 0.0
    assert timing.relative_error(x, x * 1.1).item() == pytest.approx(0.1)


def test_events_are_recorded_on_the_stream_of_the_tensors_device(monkeypatch):
    """The work of a tensor on cuda:1 runs on cuda:1's current stream whichever device is current (cuda:0
    here): an event recorded on the current device's stream would time, or wait for, other work."""
    from tests.helpers.fake_cuda import FakeCuda

    from megatron_tah.codecs.core import timing
    from megatron_tah.codecs.core.checks import DeferredErrors

    cuda = FakeCuda(monkeypatch, devices=2)
    on_1 = cuda.Stream(1)
    with cuda.stream(on_1):  # cuda:1's current stream is a side stream; the current device stays 0
        watch = timing.Stopwatch("cuda:1")
        interval = watch.stop()
        errors = DeferredErrors(torch.device("cpu"))  # (no CUDA here: made on the CPU, then pointed at cuda:1)
        errors.device, errors._cuda = torch.device("cuda", 1), True
        errors.seen()
    assert [stream for _, stream in cuda.events] == [on_1, on_1, on_1]
    assert isinstance(interval, timing.Interval)


def test_rotated_fraction_stays_a_tensor_until_read():
    codec = get_codec("tah", outlier_threshold=0.0, tile_size=32)
    assert codec.last_rotated is None and codec.last_rotated_fraction is None
    codec.encode(torch.randn(4, 2, 64))
    assert isinstance(codec.last_rotated, torch.Tensor) and codec.last_rotated.dim() == 0
    assert codec.last_rotated_fraction == 1.0
