"""channel (torch reference; the kernels are compared with it in kernels/test_channel.py): wire size, the error
bound per element, one grid per channel shared by every token, unbiased stochastic rounding, bad input poisoning
its channel only, config mismatches, resume of the rounding noise, and its place in registry, flags and report."""

import argparse
import math

import pytest
import torch

from benchmarks.codec_report import __main__ as report
from megatron_tah.codecs import CODECS, CodecError, WireFormatError, get_codec
from megatron_tah.codecs.core import common
from megatron_tah.numerics import MAX_ABS_VALUE
from megatron_tah.codecs.core.header import HEADER_NBYTES, align_up
from megatron_tah.config import TahConfig
from megatron_tah.megatron import arguments
from tests.helpers.edge_cases import (DTYPES, EDGE_CASES, assert_mismatched_receivers_refused, edge_case_tensor,
                                     rel_error, round_trip)

SHAPES = [(8, 2, 64), (7, 3, 100), (1, 1, 8), (33, 1, 130), (5, 17), (300,), (1, 1, 130)]
OPTIONS = [{}, {"bits": 2}, {"bits": 3}, {"bits": 6}, {"bits": 8}, {"stochastic_rounding": True}]
OPTION_IDS = ["4b", "2b", "3b", "6b", "8b", "stochastic"]


def make(**options):
    return get_codec("channel", backend="torch", **options)


def metadata(codec, buf, shape, dtype):
    """fp32 scale and zero ``[h]`` of a buffer."""
    layout = codec.layout(shape, dtype)
    return layout.view(buf, "scale", torch.bfloat16).float(), layout.view(buf, "zero", torch.bfloat16).float()


# ----- wire size -------------------------------------------------------------------------------
@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_wire_size_is_wire_nbytes_and_the_bits_formula(options, dtype, shape):
    codec = make(**options)
    x = torch.randn(shape).to(dtype)
    buf = codec.encode(x)
    h, n = shape[-1], math.prod(shape)
    want = align_up(align_up(HEADER_NBYTES + 2 * h) + 2 * h) + -(-n // 8) * codec.bits
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    assert buf.numel() == codec.wire_nbytes(shape, dtype) == align_up(want)


@pytest.mark.parametrize("shape,bits,want", [((64, 1, 128), 4, 4.515625), ((64, 4, 128), 4, 4.12890625),
                                             ((1024, 8, 1024), 4, 4.0039215), ((1024, 8, 1024), 3, 3.0039215)])
def test_bits_per_element_is_bits_plus_32_per_row_and_the_header(shape, bits, want):
    nbytes = make(bits=bits).wire_nbytes(shape, torch.bfloat16)
    assert 8 * nbytes / math.prod(shape) == pytest.approx(want, abs=1e-6)
    assert 8 * nbytes == 8 * HEADER_NBYTES + math.prod(shape) * bits + 32 * shape[-1]


# ----- error bounds -------------------------------------------------------------------------------
@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("shape", [(8, 2, 64), (7, 3, 100), (5, 17), (1, 1, 130)])
def test_error_within_half_a_step_or_a_step_and_the_grid_covers_the_range(options, shape):
    codec = make(**options)
    gen = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(shape, generator=gen) * torch.rand(shape[-1], generator=gen) * 10 + torch.randn(shape[-1], generator=gen)
    buf = codec.encode(x)
    y = codec.decode(buf, shape, x.dtype)
    scale, zero = metadata(codec, buf, shape, x.dtype)
    rows = x.reshape(-1, shape[-1])
    lo, hi = rows.amin(0), rows.amax(0)
    levels = 2**codec.bits - 1
    assert (zero <= lo).all() and (zero > lo - lo.abs() * 2**-7 - 1e-30).all()  # min rounded down to bf16
    assert (zero + levels * scale >= hi).all()  # the grid covers [lo, hi]
    assert (scale <= (hi - zero) / levels * (1 + 2**-7) + 1e-30).all()  # the range / levels, rounded up
    # (up to the reciprocal's rounding, levels * 2^-23 of a step, and the decode's own rounding to fp32)
    per_value = scale * (1.0 if codec.stochastic_rounding else 0.5) * (1 + levels * 2**-22)
    assert ((y - x).abs() <= per_value + x.abs() * 2**-23).all()


def test_relative_error_on_gaussian_data_at_3_and_4_bits():
    x = torch.randn(64, 4, 1024, generator=torch.Generator().manual_seed(0))
    errors = {b: rel_error(x, round_trip(make(bits=b), x)) for b in (2, 3, 4, 6, 8)}
    assert list(errors.values()) == sorted(errors.values(), reverse=True) and errors[8] < 0.01
    assert 0.18 < errors[3] < 0.3 and 0.08 < errors[4] < 0.14  # (the range over 256 gaussian tokens: about 6 sigma)


def test_one_grid_per_channel_for_every_token():
    """Equal values of a channel decode to the same value in every row; a channel's grid is its own: an outlier
    channel leaves the other channels' decodes as they were (a tile codec would coarsen its neighbours' grid)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 2, 64, generator=gen)
    x[::3, :, 7] = 0.123
    codec = make(bits=3)
    y = round_trip(codec, x)
    assert torch.unique(y[::3, :, 7]).numel() == 1
    loud = x.clone()
    loud[..., 5] *= 1000
    y_loud = round_trip(codec, loud)
    others = torch.arange(64) != 5
    assert torch.equal(y_loud[..., others], y[..., others])
    fixed = get_codec("fixedpoint", bits=3, tile_size=64, backend="torch")
    assert rel_error(x[..., others], round_trip(fixed, loud)[..., others]) > 10 * rel_error(x[..., others],
                                                                                           y[..., others])


def test_stochastic_rounding_is_unbiased_and_resumes_exactly():
    x = torch.randn(8, 2, 64, generator=torch.Generator().manual_seed(2))
    codec = make(bits=3, stochastic_rounding=True, seed=7)
    mean = torch.stack([round_trip(codec, x) for _ in range(400)]).mean(0)
    nearest = round_trip(make(bits=3), x)
    assert (mean - x).abs().mean() < 0.25 * (nearest - x).abs().mean()
    # Per element, the mean of 400 draws is within 6 standard deviations (at most scale / 40) of the input.
    scale, _ = metadata(make(bits=3), make(bits=3).encode(x), x.shape, x.dtype)  # (the same grid as nearest's)
    assert ((mean - x).abs() <= 0.15 * scale).all()
    assert codec.stateful and codec.state_dict() == {"rounding_noise": {"seed": 7, "calls": 400}}
    resumed = make(bits=3, stochastic_rounding=True, seed=7)
    resumed.load_state_dict(codec.state_dict())
    assert torch.equal(resumed.encode(x), codec.encode(x))
    first = make(stochastic_rounding=True, seed=7)
    assert not torch.equal(first.encode(x), first.encode(x))  # the stream moves on per call
    assert not make().stateful and make().state_dict() == {}


def test_stochastic_noise_is_hash_uniform_of_the_row_major_index():
    x = torch.randn(6, 40)
    seed = common.RoundingNoise(True, 3).next_seed()
    buf = make(bits=4, stochastic_rounding=True, seed=3).encode(x)
    scale, zero = metadata(make(), buf, x.shape, x.dtype)
    noise = common.hash_uniform(seed, x.numel(), "cpu").reshape(x.shape)
    want = ((x - zero) * common.div_rn(1.0, scale) + noise).floor().clamp(0, 15)
    codes = common.unpack_bits(make().layout(x.shape, x.dtype).view(buf, "codes"), 4, x.numel()).reshape(x.shape)
    assert torch.equal(codes.float(), want)


# ----- edge cases and bad input ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", EDGE_CASES)
def test_edge_cases_round_trip_without_nan(kind, dtype):
    x = edge_case_tensor(kind, dtype=dtype)
    y = round_trip(make(), x)
    assert torch.isfinite(y).all()
    if kind in ("zeros", "constant"):  # 3.25 is a bf16 value: scale 0, the zero is the constant
        assert torch.equal(y, x) and not torch.signbit(y).any()
    else:
        assert rel_error(x, y) < 0.2
    if kind == "one_outlier" and dtype == torch.bfloat16:  # the outlier channel is constant over the tokens
        assert torch.equal(y[..., 5], x[..., 5])


@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_and_zero_channels_decode_exactly_and_one_row_works(dtype):
    x = torch.randn(5, 3, 24).to(dtype)
    x[..., 4] = -1.5
    x[..., 9] = 0.0
    y = round_trip(make(bits=2), x)
    assert torch.equal(y[..., 4], x[..., 4]) and torch.equal(y[..., 9], x[..., 9])
    one = torch.randn(1, 1, 131).to(dtype)  # one row: every channel is constant
    assert rel_error(one, round_trip(make(bits=2), one)) < 1e-3


def test_huge_magnitudes_up_to_max_abs_value():
    x = torch.randn(4, 128)
    x = x / x.abs().max() * MAX_ABS_VALUE
    y = round_trip(make(), x)
    assert torch.isfinite(y).all() and rel_error(x, y) < 0.15
    x16 = torch.full((2, 64), 65504.0, dtype=torch.float16)
    x16[0] = -65504.0
    assert torch.isfinite(round_trip(make(bits=2), x16)).all()  # decoded values clamped to fp16's range


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 1e37])
def test_bad_values_poison_their_channel_in_every_row_and_nothing_else(bad):
    codec = make()
    x = torch.randn(4, 2, 100)
    x[1, 0, 70] = bad
    buf = codec.encode(x)
    y = codec.decode(buf, x.shape, x.dtype)
    assert torch.isnan(y[..., 70]).all()
    clean = x.clone()
    clean[1, 0, 70] = 0
    others = torch.arange(100) != 70
    assert torch.isfinite(y[..., others]).all()
    assert torch.equal(y[..., others], round_trip(codec, clean)[..., others])
    layout = codec.layout(x.shape, x.dtype)  # the pattern quantize_tiles writes for a bad tile
    assert layout.view(buf, "scale", torch.int16)[70] == 0
    assert layout.view(buf, "zero", torch.int16)[70] == common.numerics.BF16_NAN_BITS
    codes = common.unpack_bits(layout.view(buf, "codes"), 4, x.numel()).reshape(-1, 100)
    assert (codes[:, 70] == 0).all()


# ----- configuration and the wire header ----------------------------------------------------------
def test_differently_configured_receiver_raises():
    assert_mismatched_receivers_refused(make(), [make(stochastic_rounding=True)], make(bits=5))


def test_bad_options_shapes_and_dtypes_raise():
    for options, match in (({"bits": 1}, "bits"), ({"bits": 9}, "bits"), ({"stochastic_rounding": "no"}, "stochastic"),
                           ({"tile_size": 64}, "unexpected keyword")):
        with pytest.raises(CodecError, match=match):
            get_codec("channel", **options)
    with pytest.raises(CodecError, match="empty"):
        make().wire_nbytes((0, 2, 8), torch.float32)
    with pytest.raises(CodecError, match="empty"):
        make().encode(torch.zeros(4, 0))
    with pytest.raises(CodecError, match="unsupported dtype"):
        make().encode(torch.zeros(2, 8, dtype=torch.float64))
    x = torch.randn(3, 40)
    assert get_codec("channel").has_triton_path()  # (kernels: tests/kernels/test_channel.py)
    assert torch.equal(get_codec("channel").encode(x), make().encode(x))  # auto on CPU tensors: the reference


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_writes_into_out(dtype):
    x = torch.randn(6, 2, 48).to(dtype)
    codec = make()
    buf = codec.encode(x)
    out = torch.empty_like(x)
    assert codec.decode(buf, x.shape, dtype, out=out) is out
    assert torch.equal(out, codec.decode(buf, x.shape, dtype))


# ----- registry, flags, report ------------------------------------------------------------------------
def test_registered_in_codecs_flags_config_and_report():
    assert "channel" in CODECS and get_codec("channel").codec_id == 10
    parser = arguments.add_tah_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--tah-forward-codec", "channel", "--tah-backward-codec", "channel",
                              "--tah-backward-bits", "6", "--tah-backward-stochastic-rounding"])
    config = arguments.tah_config_from_args(args)
    assert config.forward_codec().describe() == "channel(bits=4, stochastic_rounding=False)"
    assert config.backward_codec().describe() == "channel(bits=6, stochastic_rounding=True)"
    with pytest.raises(ValueError, match="tah_forward_codec = 'channel'.*bits"):
        TahConfig(tah_forward_codec="channel", tah_forward_bits=9)
    assert [name for _, name, _ in report.STATELESS_ROWS].count("channel") == 2


@pytest.mark.parametrize("candidate, forward_bits, backward_bits", [("channel", 4, 3), ("channel6", 4, 2),
                                                                     ("channel9", 6, 3)])
def test_the_channel_candidates_bits_both_ways(candidate, forward_bits, backward_bits):
    """Per-channel activations, per-channel stochastically rounded gradients: bits + 32 / rows per value
    (a bf16 scale and zero per channel) plus the 16-byte header, exactly."""
    from megatron_tah.config import TahConfig, candidate_fields

    config = TahConfig(**candidate_fields(candidate))
    fwd, bwd = config.forward_codec(), config.backward_codec()
    assert (fwd.name, bwd.name) == ("channel", "channel")
    for shape in ((1024, 8, 1024), (64, 1, 128)):
        rows, hidden = shape[0] * shape[1], shape[2]
        values = rows * hidden
        for codec, bits in ((fwd, forward_bits), (bwd, backward_bits)):
            nbytes = codec.wire_nbytes(shape, torch.bfloat16)
            assert nbytes == 16 + 4 * hidden + values * bits // 8
    big = 8 * sum(c.wire_nbytes((1024, 8, 1024), torch.bfloat16) for c in (fwd, bwd)) / (1024 * 8 * 1024)
    assert big == pytest.approx(forward_bits + backward_bits, abs=0.01)
    assert bwd.stochastic_rounding and not fwd.stochastic_rounding


# ----- outlier tokens -------------------------------------------------------------------------------
def sink_message(shape=(64, 2, 128), sinks=(0, 1), factor=60.0, seed=0):
    """Gaussian rows with a few rows (attention sinks; rows 0 and 1: the first token of both sequences)
    ``factor`` times larger."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    rows = x.view(-1, shape[-1])
    rows[list(sinks)] *= factor
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("shape,tokens,rows", [((64, 2, 128), 1, 2), ((64, 2, 128), 3, 6), ((3, 1, 8), 5, 2),
                                              ((1, 1, 8), 3, 0), ((6, 40), 2, 2), ((4, 3, 2, 8), 1, 6)])
def test_outlier_tokens_per_sequence_and_the_wire_size(shape, tokens, rows):
    codec = make(bits=4, outlier_tokens=tokens)
    layout = codec.layout(shape, torch.bfloat16)
    h, n = shape[-1], math.prod(shape)
    grids = align_up(align_up(align_up(HEADER_NBYTES + 2 * h) + 2 * h) + -(-n // 8) * 4)
    extra = align_up(align_up(grids + 4 * rows) + 2 * rows * h) - grids if rows else 0
    assert codec.wire_nbytes(shape, torch.bfloat16) == grids + extra
    assert layout.offsets.get("outlier_rows", (0, 0))[1] == 2 * rows * h
    assert codec.encode(torch.randn(shape).bfloat16()).numel() == grids + extra


def test_outlier_tokens_leave_the_grids_to_the_other_rows():
    """The sinks decode to their bf16 values; every other row is coded on the grids of the other rows alone:
    the same scale, zero and codes as a message whose sink rows hold a copy of an ordinary row."""
    x = sink_message()
    codec = make(bits=6, outlier_tokens=1)
    buf = codec.encode(x)
    y = codec.decode(buf, x.shape, x.dtype)
    rows, got = x.view(-1, 128), y.view(-1, 128)
    assert torch.equal(got[[0, 1]], rows[[0, 1]])
    layout = codec.layout(x.shape, x.dtype)
    assert sorted(layout.view(buf, "outlier_index", torch.int32).tolist()) == [0, 1]
    plain = rows.clone()
    size = rows.float().abs().amax(1)
    size[[0, 1]] = -1
    plain[[0, 1]] = rows[int(torch.argmax(size))]  # the next row in size order
    reference = make(bits=6)
    want = reference.encode(plain.view(x.shape))
    for name in ("scale", "zero", "codes"):
        assert torch.equal(layout.view(buf, name), reference.layout(x.shape, x.dtype).view(want, name)), name
    others = list(range(2, 128))
    assert rel_error(rows[others], got[others]) < 0.04  # 6 bits on Gaussian rows: about 5.4 sigma / 63 / sqrt(12)
    without = reference.decode(reference.encode(x), x.shape, x.dtype).view(-1, 128)
    assert rel_error(rows[others], without[others]) > 0.3  # the sinks' range


def test_outlier_tokens_take_bad_rows_first_and_keep_them_in_their_row():
    x = sink_message(shape=(128, 1, 128), sinks=(0,))
    x.view(-1, 128)[9, 3] = float("nan")
    x.view(-1, 128)[20, 7] = float("inf")
    y = round_trip(make(bits=4, outlier_tokens=3), x)
    assert y.view(-1, 128)[9, 3].isnan() and y.view(-1, 128)[20, 7] == float("inf")
    assert y.isnan().sum() == 1 and y.isinf().sum() == 1  # the channels 3 and 7 stay on their grids
    # one outlier token: the NaN row and the Inf row rank first (tie: the earlier row), the other poisons its channel
    rows = round_trip(make(bits=4, outlier_tokens=1), x).view(-1, 128)
    assert rows[9, 3].isnan() and not rows[9, 7].isnan()  # the outlier row, as sent
    assert rows[[r for r in range(128) if r != 9], 7].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_outlier_tokens_decode_into_out_and_fp16_clamps(dtype):
    x = sink_message(shape=(8, 1, 16), sinks=(2,), factor=1.0)
    x.view(-1, 16)[2, 0] = 1e6
    codec = make(bits=4, outlier_tokens=1)
    buf = codec.encode(x.to(dtype))
    out = torch.empty(x.shape, dtype=dtype)
    assert codec.decode(buf, x.shape, dtype, out=out) is out
    big = out.view(-1, 16)[2, 0].item()
    assert big == (torch.finfo(torch.float16).max if dtype == torch.float16 else x.view(-1, 16)[2, 0].float().item())


def test_outlier_tokens_config_flags_and_mismatch():
    x = sink_message(shape=(8, 1, 16), sinks=(2,))
    assert make().config() == {"bits": 4, "stochastic_rounding": False}  # the wire of before, by default
    with pytest.raises(WireFormatError):
        make(outlier_tokens=1).decode(make(outlier_tokens=2).encode(x), x.shape, x.dtype)
    for bad in (-1, 1.5, True):
        with pytest.raises(CodecError, match="outlier_tokens"):
            make(outlier_tokens=bad)
    with pytest.raises(ValueError, match="tah_channel_outlier_tokens"):
        TahConfig(tah_forward_codec="channel", tah_channel_outlier_tokens=-2)
    parser = arguments.add_tah_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--tah-forward-codec", "channel", "--tah-forward-bits", "6",
                              "--tah-channel-outlier-tokens", "1"])
    codec = arguments.tah_config_from_args(args).forward_codec()
    assert codec.describe() == "channel(bits=6, stochastic_rounding=False, outlier_tokens=1)"
