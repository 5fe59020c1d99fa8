"""hadint (torch reference; the kernels are compared with it in kernels/test_hadint.py): wire size, the error bound in both domains, unbiased stochastic rounding,
bad input, config mismatches, resume of the rounding noise, and its place in registry, flags and report."""

import argparse
import math

import pytest
import torch

from megatron_tah.codecs import CODECS, CodecError, get_codec
from megatron_tah.codecs.core import common
from benchmarks.codec_report import __main__ as report
from megatron_tah.numerics import MAX_ABS_VALUE
from megatron_tah.codecs.core.header import HEADER_NBYTES, align_up
from megatron_tah.config import TahConfig
from megatron_tah.megatron import arguments
from tests.helpers.edge_cases import (DTYPES, EDGE_CASES, assert_mismatched_receivers_refused, edge_case_tensor,
                                     rel_error, round_trip)

SHAPES = [(8, 2, 64), (7, 3, 100), (1, 1, 8), (33, 1, 130), (5, 17), (300,)]
OPTIONS = [{}, {"bits": 3}, {"bits": 5, "tile_size": 128}, {"bits": 8, "tile_size": 16}, {"hadamard": False},
           {"stochastic_rounding": True}]
OPTION_IDS = ["4b64", "3b64", "5b128", "8b16", "no-hadamard", "stochastic"]


def make(**options):
    return get_codec("hadint", backend="torch", **options)


def tiles_of(x, tile):
    """fp32 ``[T, tile]`` tiles of the last dim, zero padded (as the codec pads)."""
    rows = x.float().reshape(-1, x.shape[-1])
    return torch.nn.functional.pad(rows, (0, -x.shape[-1] % tile)).reshape(-1, tile)


# ----- wire size -------------------------------------------------------------------------------
@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_wire_size_is_wire_nbytes_and_the_bits_formula(options, dtype, shape):
    codec = make(**options)
    bits, tile = codec.bits, codec.tile_size
    x = torch.randn(shape).to(dtype)
    buf = codec.encode(x)
    tiles = math.prod(shape[:-1]) * -(-shape[-1] // tile)
    want = align_up(HEADER_NBYTES + 2 * tiles) + tiles * tile * bits // 8
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    assert buf.numel() == codec.wire_nbytes(shape, dtype) == want


@pytest.mark.parametrize("bits,tile,want", [(4, 64, 4.25), (4, 32, 4.5), (3, 64, 3.25), (5, 128, 5.125)])
def test_bits_per_element_on_a_large_tensor(bits, tile, want):
    shape = (1024, 4, 1024)
    assert make(bits=bits, tile_size=tile).wire_nbytes(shape, torch.bfloat16) * 8 / math.prod(shape) == \
        pytest.approx(want, abs=1e-4)


# ----- error bounds -------------------------------------------------------------------------------
@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("shape", [(8, 2, 64), (7, 3, 100), (5, 17)])
def test_error_within_the_bound_in_both_domains(options, shape):
    """Rotated domain: each value within s/2 of its input (s with stochastic rounding), s = max|y| / Q
    rounded up to bf16; original domain: the tile's L2 error is the same (orthonormal transform)."""
    codec = make(**options)
    q = 2 ** (codec.bits - 1) - 1
    x = torch.randn(shape) * torch.rand(shape[:-1] + (1,)) * 10
    y = round_trip(codec, x)
    tile = codec.tile_size
    rotated = common.signed_fwht(tiles_of(x, tile), codec.signs("cpu"))
    scale = rotated.abs().amax(dim=-1) / q
    step = scale * (1 + 2**-7)  # bf16 rounding up of the scale
    per_value = step * (1.0 if codec.stochastic_rounding else 0.5)
    if shape[-1] % tile == 0:  # (a ragged last tile's padding is dropped on decode: only the L2 bound below)
        err = (common.signed_fwht(tiles_of(y, tile), codec.signs("cpu")) - rotated).abs()
        assert (err <= per_value[:, None] * (1 + 1e-5) + 1e-6).all()
    l2 = (tiles_of(y, tile) - tiles_of(x, tile)).norm(dim=-1)
    assert (l2 <= per_value * math.sqrt(tile) * (1 + 1e-5) + 1e-5).all()


def test_more_bits_less_error_and_the_rotation_helps_an_outlier_channel():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 4, 256, generator=gen)
    errors = [rel_error(x, round_trip(make(bits=b), x)) for b in (3, 4, 5, 6, 8)]
    assert errors == sorted(errors, reverse=True) and errors[-1] < 0.01
    x[..., 5] *= 30
    assert rel_error(x, round_trip(make(), x)) < 0.5 * rel_error(x, round_trip(make(hadamard=False), x))


def test_stochastic_rounding_is_unbiased_and_resumes_exactly():
    x = torch.randn(4, 2, 64)
    codec = make(stochastic_rounding=True, seed=7)
    mean = torch.stack([round_trip(codec, x) for _ in range(400)]).mean(0)
    nearest = round_trip(make(), x)
    assert (mean - x).abs().mean() < 0.25 * (nearest - x).abs().mean()
    assert codec.stateful and codec.state_dict() == {"rounding_noise": {"seed": 7, "calls": 400}}
    resumed = make(stochastic_rounding=True, seed=7)
    resumed.load_state_dict(codec.state_dict())
    assert torch.equal(resumed.encode(x), codec.encode(x))
    assert not torch.equal(make(stochastic_rounding=True, seed=7).encode(x), make(stochastic_rounding=True,
                                                                                seed=7).encode(x * 1.5))
    assert not make().stateful and make().state_dict() == {}


@pytest.mark.parametrize("dtype", DTYPES)
def test_zeros_decode_to_zero_and_tiny_tiles_to_zero_or_close(dtype):
    x = torch.zeros(3, 2, 64, dtype=dtype)
    y = round_trip(make(), x)
    assert torch.equal(y, x) and not torch.signbit(y).any()
    tiny = torch.full((2, 64), 1e-39)  # a scale below the smallest normal fp32: zero codes
    assert torch.equal(round_trip(make(), tiny), torch.zeros_like(tiny))


@pytest.mark.parametrize("options", [{}, {"hadamard": False}], ids=["hadamard", "plain"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", EDGE_CASES)
def test_edge_cases_round_trip_without_nan(options, dtype, kind):
    x = edge_case_tensor(kind, dtype=dtype)
    y = round_trip(make(**options), x)
    assert torch.isfinite(y).all()
    if kind == "zeros":
        assert torch.equal(y, x)
    else:
        assert rel_error(x, y) < 0.2


def test_huge_magnitudes_up_to_max_abs_value():
    x = torch.randn(4, 128)
    x = x / x.abs().max() * MAX_ABS_VALUE
    y = round_trip(make(), x)
    assert torch.isfinite(y).all() and rel_error(x, y) < 0.15
    x16 = torch.full((2, 64), 65504.0, dtype=torch.float16)
    x16[:, ::2] = -65504.0
    assert torch.isfinite(round_trip(make(), x16)).all()  # decoded values clamped to fp16's range


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 1e37])
def test_non_finite_values_poison_only_their_tile(bad):
    codec = make()
    x = torch.randn(4, 2, 100)
    x[1, 0, 70] = bad
    y = round_trip(codec, x)
    tile = slice(64, 100)
    assert torch.isnan(y[1, 0, tile]).all()
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[1, 0, tile] = False
    clean = x.clone()
    clean[1, 0, 70] = 0
    assert torch.isfinite(y[mask]).all() and torch.equal(y[mask], round_trip(codec, clean)[mask])


# ----- configuration and the wire header ----------------------------------------------------------
def test_differently_configured_receiver_raises():
    assert_mismatched_receivers_refused(make(), [make(hadamard=False), make(hadamard_seed=1),
                                                 make(stochastic_rounding=True)], make(bits=5))


def test_bad_options_and_backends_raise():
    for options, match in (({"bits": 2}, "bits"), ({"bits": 9}, "bits"), ({"tile_size": 48}, "tile_size"),
                           ({"hadamard": 1}, "hadamard must be"), ({"stochastic_rounding": "no"}, "stochastic"),
                           ({"block_size": 64}, "unexpected keyword")):
        with pytest.raises(CodecError, match=match):
            get_codec("hadint", **options)
    x = torch.randn(3, 40)
    assert get_codec("hadint").has_triton_path()  # (kernels: tests/kernels/test_hadint.py)
    assert torch.equal(get_codec("hadint").encode(x), make().encode(x))  # auto on CPU tensors: the reference


# ----- registry, flags, report ------------------------------------------------------------------------
def test_registered_in_codecs_flags_config_and_report():
    assert "hadint" in CODECS
    parser = arguments.add_tah_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--tah-forward-codec", "hadint", "--tah-backward-codec", "hadint",
                              "--tah-backward-bits", "4", "--tah-backward-tile-size", "64",
                              "--tah-backward-stochastic-rounding"])
    config = arguments.tah_config_from_args(args)
    assert config.forward_codec().describe() == \
        "hadint(hadamard=True, hadamard_seed=0, bits=4, tile_size=64, stochastic_rounding=False)"
    assert config.backward_codec().describe() == \
        "hadint(hadamard=True, hadamard_seed=0, bits=4, tile_size=64, stochastic_rounding=True)"
    rounded = TahConfig(tah_forward_codec="fixedpoint", tah_backward_codec="fixedpoint",
                        tah_backward_stochastic_rounding=True)
    assert rounded.backward_codec().stochastic_rounding and not rounded.forward_codec().rounding_noise.enabled
    with pytest.raises(ValueError, match="tah_backward_stochastic_rounding needs"):
        TahConfig(tah_backward_codec="fp8", tah_backward_stochastic_rounding=True)
    with pytest.raises(ValueError, match="tah_forward_codec = 'hadint'.*bits"):
        TahConfig(tah_forward_codec="hadint", tah_forward_bits=2)
    assert [name for _, name, _ in report.STATELESS_ROWS].count("hadint") == 2
