"""mxfp4 and nvfp4 (torch references): E2M1 rounding, wire size, error bounds, exact values, bad input,
config mismatches, the random-sign Hadamard, and their place in the registry, flags and report."""

import argparse
import math

import pytest
import torch

from megatron_tah.codecs import CODECS, CodecError, WireFormatError, get_codec
from megatron_tah.codecs.core import common
from benchmarks.codec_report import __main__ as report
from megatron_tah.numerics import MAX_ABS_VALUE
from megatron_tah.codecs.core.header import HEADER_NBYTES, align_up
from megatron_tah.config import TahConfig
from megatron_tah.megatron import arguments
from tests.helpers.edge_cases import DTYPES, EDGE_CASES, edge_case_tensor, rel_error, round_trip

BLOCK = {"mxfp4": 32, "nvfp4": 16}
SCALE_BITS = 8  # E8M0 (mxfp4) and E4M3 (nvfp4) scales are one byte each
KEYS = [(name, hadamard) for name in BLOCK for hadamard in (False, True)]
IDS = [f"{name}{'-hadamard' if hadamard else ''}" for name, hadamard in KEYS]
SHAPES = [(8, 2, 64), (7, 3, 100), (1, 1, 8), (33, 1, 130), (5, 17), (300,)]


def make(name, hadamard=False, **options):
    return get_codec(name, hadamard=hadamard, backend="torch", **options)


def blocks_of(x, block):
    """fp32 ``[T, block]`` blocks of the last dim, zero padded (as the codecs pad)."""
    rows = x.float().reshape(-1, x.shape[-1])
    return torch.nn.functional.pad(rows, (0, -x.shape[-1] % block)).reshape(-1, block)


def half_step_bound(y, scale):
    """Largest error of E2M1 round-to-nearest of ``y / scale`` (per element), times ``scale``:
    half the grid step around the value (0.25 up to 2, 0.5 up to 4, 1 up to 6), or the saturation."""
    v = y.abs() / scale
    half = torch.where(v <= 2, 0.25, torch.where(v <= 4, 0.5, 1.0))
    return torch.where(v <= 6, half, v - 6) * scale


def mx_scale(blocks):
    """The OCP MX scale ``2^(floor(log2 amax) - 2)`` per block, computed here with frexp (not the codec's bits)."""
    amax = blocks.abs().amax(dim=-1)
    _, exponent = torch.frexp(amax)  # amax = m * 2^exponent, m in [0.5, 1)
    exponent = torch.where(amax > 0, exponent - 1 - 2, torch.full_like(exponent, -127)).clamp(-127, 127)
    return torch.pow(2.0, exponent.double()).float()


def nv_scale(blocks):
    """The NVFP4 decode scale ``e4m3(amax_block / (6 g)) * g`` per block, ``g = amax / (6 * 448)``."""
    g = torch.tensor(blocks.abs().max().double().item() / (6 * 448)).float()
    ratio = (blocks.abs().amax(dim=-1).double() / (g * 6.0).double()).clamp(0, 448).float()
    return ratio.to(torch.float8_e4m3fn).float() * g


# ----- E2M1 ------------------------------------------------------------------------------------
def test_e2m1_rounds_to_nearest_even_and_saturates():
    x = torch.tensor([0.0, 0.2, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 6.0, 7.0, 1e30, -0.75, -5.0, -0.1])
    want = torch.tensor([0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, 6.0, -1.0, -4.0, 0.0])
    rounded = common.e2m1_round(x)
    assert torch.equal(rounded, want)
    assert not torch.signbit(rounded[-1])  # -0.1 rounds to +0: zeros have one code
    codes = common.e2m1_codes(rounded)
    assert torch.equal(common.e2m1_values(codes), want)
    grid = common.e2m1_grid("cpu")
    assert torch.equal(common.e2m1_codes(grid[:8]), torch.arange(8, dtype=torch.uint8))
    assert torch.equal(common.e2m1_codes(-grid[1:8]), torch.arange(9, 16, dtype=torch.uint8))


# ----- wire size -------------------------------------------------------------------------------
@pytest.mark.parametrize("name,hadamard", KEYS, ids=IDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_wire_size_is_wire_nbytes_and_the_bits_formula(name, hadamard, dtype, shape):
    codec = make(name, hadamard)
    x = torch.randn(shape).to(dtype)
    buf = codec.encode(x)
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    assert buf.numel() == codec.wire_nbytes(shape, dtype)
    blocks = math.prod(shape[:-1]) * -(-shape[-1] // BLOCK[name])
    codes_nbytes = blocks * BLOCK[name] * 4 // 8
    scales_nbytes = blocks * SCALE_BITS // 8
    global_nbytes = 0 if name == "mxfp4" else align_up(4)  # nvfp4's fp32 per-tensor scale
    assert buf.numel() == HEADER_NBYTES + global_nbytes + align_up(scales_nbytes) + align_up(codes_nbytes)
    y = codec.decode(buf, shape, dtype)
    assert y.shape == x.shape and y.dtype == dtype and torch.isfinite(y).all()


@pytest.mark.parametrize("name,bits", [("mxfp4", 4.25), ("nvfp4", 4.5)])
def test_bits_per_element_on_a_large_tensor(name, bits):
    shape = (1024, 4, 4096)
    codec = make(name)
    nbytes = codec.wire_nbytes(shape, torch.bfloat16)
    n = math.prod(shape)
    overhead = HEADER_NBYTES + (8 if name == "nvfp4" else 0)
    assert nbytes == overhead + n * bits / 8
    assert codec.bits_per_element(nbytes, shape) == pytest.approx(bits, abs=1e-4)


# ----- error bounds and exact values -------------------------------------------------------------
@pytest.mark.parametrize("name", BLOCK)
@pytest.mark.parametrize("shape", [(16, 2, 128), (9, 70)])
def test_every_element_within_half_a_grid_step_times_its_block_scale(name, shape):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=gen) * torch.exp(2 * torch.randn(shape[-1], generator=gen))  # scales vary
    y = round_trip(make(name), x)
    blocks, decoded = blocks_of(x, BLOCK[name]), blocks_of(y, BLOCK[name])
    scale = mx_scale(blocks) if name == "mxfp4" else nv_scale(blocks)
    bound = half_step_bound(blocks, scale[:, None])
    err = (decoded - blocks).abs()
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    assert (err <= bound + 1e-6 * amax).all()  # (slack: fp32 rounding of the saturated bound v - 6)
    # Relative to the block: never more than a quarter of its largest magnitude (plus nvfp4's scale rounding).
    assert (err <= amax * (0.25 if name == "mxfp4" else 0.25 * 17 / 16) * (1 + 1e-6)).all()


@pytest.mark.parametrize("name", BLOCK)
def test_hadamard_error_bound_holds_in_the_rotated_domain(name):
    codec = make(name, hadamard=True)
    x = torch.randn(6, 4, 96)
    y = round_trip(codec, x)
    signs = codec.signs(x.device)
    rotated = common.signed_fwht(blocks_of(x, BLOCK[name]), signs)
    decoded = common.signed_fwht(blocks_of(y, BLOCK[name]), signs)  # the rotation is orthonormal
    scale = mx_scale(rotated) if name == "mxfp4" else nv_scale(rotated)
    slack = 1e-5 * rotated.abs().amax(dim=-1, keepdim=True)  # fp32 rounding of the two transforms
    assert ((decoded - rotated).abs() <= half_step_bound(rotated, scale[:, None]) * (1 + 1e-6) + slack).all()


def representable(name, dtype, rows=12, seed=7):
    """Blocks of E2M1 values times ``2^k`` (k in [-6, 6)) holding a +-6 or +-4, so that no scale rounds:
    mxfp4's is ``2^k``; for nvfp4 every block holds a 6 and the first one ``6 * 448 / 4``, so the
    per-tensor scale is ``1/4`` and every block scale ``2^(k+2)`` is an E4M3 value."""
    gen = torch.Generator().manual_seed(seed)
    block = BLOCK[name]
    grid = common.e2m1_grid("cpu")
    values = grid[torch.randint(0, 16, (rows, 2, block), generator=gen)]
    values[:, 0, 0] = 6.0
    values[:, 1, 3] = -6.0 if name == "nvfp4" else -4.0
    k = torch.randint(-6, 6, (rows, 2, 1), generator=gen).float()
    x = values * torch.pow(2.0, k)
    if name == "nvfp4":
        x[0, 0] = values[0, 0] * 112.0  # 6 * 112 = 6 * 448 * (1/4): the tensor's largest magnitude
    return x.reshape(rows, 2 * block).to(dtype)


@pytest.mark.parametrize("name", BLOCK)
@pytest.mark.parametrize("dtype", DTYPES)
def test_representable_values_decode_exactly(name, dtype):
    x = representable(name, dtype)
    y = round_trip(make(name), x)
    assert torch.equal(y, x)


@pytest.mark.parametrize("name,hadamard", KEYS, ids=IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_zeros_decode_to_zero(name, hadamard, dtype):
    x = torch.zeros(3, 2, 70, dtype=dtype)
    y = round_trip(make(name, hadamard), x)
    assert torch.equal(y, x) and not torch.signbit(y).any()


@pytest.mark.parametrize("name", BLOCK)
def test_constant_blocks(name):
    x = torch.full((4, 64), 4.0)  # on the grid with scale 1 (mxfp4) / 2/3 -> 6 * (e4m3(2/3) g) (nvfp4)
    y = round_trip(make(name), x)
    if name == "mxfp4":
        assert torch.equal(y, x)
    assert (y - x).abs().max() <= 4.0 / 16
    x = torch.full((4, 64), 3.25)
    y = round_trip(make(name), x)
    assert torch.allclose(y, x, rtol=0.1) and (y == y[0, 0]).all()


@pytest.mark.parametrize("name,hadamard", KEYS, ids=IDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", EDGE_CASES)
def test_edge_cases_round_trip_without_nan(name, hadamard, dtype, kind):
    x = edge_case_tensor(kind, dtype=dtype)
    y = round_trip(make(name, hadamard), x)
    assert torch.isfinite(y).all()
    if kind == "zeros":
        assert torch.equal(y, x)
    else:
        assert rel_error(x, y) < 0.35


@pytest.mark.parametrize("name,hadamard", KEYS, ids=IDS)
def test_huge_magnitudes_up_to_max_abs_value(name, hadamard):
    x = torch.randn(4, 128)
    x = x / x.abs().max() * MAX_ABS_VALUE
    y = round_trip(make(name, hadamard), x)
    assert torch.isfinite(y).all()
    assert rel_error(x, y) < 0.2
    x16 = torch.full((2, 64), 65504.0, dtype=torch.float16)
    x16[:, ::2] = -65504.0
    assert torch.isfinite(round_trip(make(name, hadamard), x16)).all()


@pytest.mark.parametrize("name,hadamard", KEYS, ids=IDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 1e37])
def test_non_finite_values_poison_only_their_block(name, hadamard, bad):
    """The codecs' common rule for bad input (docs/CODECS.md, "Bad input, by design"): no host sync, the block
    decodes to all-NaN so Megatron's NaN check fires; every other block decodes as without it."""
    codec = make(name, hadamard)
    x = torch.randn(4, 2, 100)
    x[1, 0, 70] = bad
    y = round_trip(codec, x)
    g = BLOCK[name]
    block = slice(70 // g * g, min(70 // g * g + g, 100))
    assert torch.isnan(y[1, 0, block]).all()
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[1, 0, block] = False
    assert torch.isfinite(y[mask]).all()
    clean = x.clone()
    clean[1, 0, 70] = 0
    y_clean = round_trip(codec, clean)
    assert torch.equal(y[mask], y_clean[mask])  # nvfp4's per-tensor scale ignores bad values too


# ----- configuration and the wire header ----------------------------------------------------------
@pytest.mark.parametrize("name", BLOCK)
def test_differently_configured_receiver_raises(name):
    x = torch.randn(4, 2, 64)
    plain, rotated = make(name), make(name, hadamard=True)
    assert plain.wire_nbytes(x.shape, x.dtype) == rotated.wire_nbytes(x.shape, x.dtype)
    assert plain.config_digest() != rotated.config_digest()
    with pytest.raises(WireFormatError, match="another config"):
        rotated.decode(plain.encode(x), x.shape, x.dtype)
    with pytest.raises(WireFormatError, match="another config"):
        plain.decode(rotated.encode(x), x.shape, x.dtype)
    with pytest.raises(WireFormatError, match="another config"):
        make(name, hadamard=True, hadamard_seed=1).decode(rotated.encode(x), x.shape, x.dtype)
    # Without the transform the seed is not part of the config: nothing to disagree about.
    assert make(name, hadamard_seed=5).config() == plain.config() == {"hadamard": False}
    with pytest.raises(WireFormatError, match="another shape"):
        plain.decode(plain.encode(x), (8, 1, 64), x.dtype)


def test_mxfp4_and_nvfp4_buffers_are_not_interchangeable():
    x = torch.randn(4, 96)  # mxfp4: 16 + 16 + 192 = 224 bytes; nvfp4: 16 + 8 + 24 + 192 = 240
    with pytest.raises(WireFormatError, match="bytes"):
        make("nvfp4").decode(make("mxfp4").encode(x), x.shape, x.dtype)
    buf = make("mxfp4").encode(x)
    buf[3] = make("nvfp4").codec_id
    with pytest.raises(WireFormatError, match="'nvfp4'"):
        make("mxfp4").decode(buf, x.shape, x.dtype)


@pytest.mark.parametrize("name", BLOCK)
def test_bad_options_and_backends_raise(name):
    with pytest.raises(CodecError, match="hadamard must be"):
        get_codec(name, hadamard="yes")
    with pytest.raises(CodecError, match="hadamard_seed"):
        get_codec(name, hadamard=True, hadamard_seed=-1)
    with pytest.raises(CodecError, match="unexpected keyword"):
        get_codec(name, block_size=64)
    with pytest.raises(CodecError, match="no Triton path"):
        get_codec(name, backend="triton").encode(torch.randn(2, 32))
    x = torch.randn(3, 40)
    auto = get_codec(name)  # auto: the torch reference (no kernel)
    assert not auto.has_triton_path()
    assert torch.equal(auto.encode(x), make(name).encode(x))


@pytest.mark.parametrize("name,hadamard", KEYS, ids=IDS)
def test_identical_input_gives_identical_bytes(name, hadamard):
    x = torch.randn(12, 2, 192, dtype=torch.bfloat16)
    assert torch.equal(make(name, hadamard).encode(x), make(name, hadamard).encode(x.clone()))


def test_hadamard_signs_come_from_the_seed_and_invert():
    a, b = make("mxfp4", True).signs("cpu"), make("mxfp4", True, hadamard_seed=1).signs("cpu")
    assert torch.equal(a, make("mxfp4", True).signs("cpu"))
    assert set(a.tolist()) == {-1.0, 1.0} and not torch.equal(a, b)
    assert make("mxfp4").signs("cpu") is None and make("nvfp4", True).signs("cpu").numel() == 16
    x = torch.randn(10, 32)
    back = common.signed_fwht_inverse(common.signed_fwht(x, a), a)
    assert torch.allclose(back, x, atol=1e-6)


# ----- what the Hadamard does on an outlier channel (measured) -------------------------------------
@pytest.mark.parametrize("outlier", [10.0, 30.0, 100.0])
def test_hadamard_on_an_outlier_channel(outlier):
    """Measured, not assumed. mxfp4: the rotation lowers the error (a spike's power-of-two block scale
    leaves it in E2M1's coarsest binade or saturates it at 6X, up to a quarter of the spike; spread over
    the block that error shrinks). nvfp4: it raises it (the E4M3 block scale already puts a spike exactly
    on 6S and only its own 16-value block loses its small values; rotated, the block is flat at about
    |spike| / 4 and every value lands in the 4..6 binade, where the grid step is a third of the value)."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(64, 4, 256, generator=gen)
    x[..., 5] *= outlier
    errors = {(name, hadamard): rel_error(x, round_trip(make(name, hadamard), x)) for name, hadamard in KEYS}
    print(f"outlier x{outlier:g}: " + ", ".join(f"{n}{' +H' if h else ''} {e:.4f}" for (n, h), e in errors.items()))
    assert errors["mxfp4", True] < 0.85 * errors["mxfp4", False]
    assert errors["nvfp4", True] > errors["nvfp4", False]


def test_hadamard_on_activation_like_data():
    """The report's data (outlier channels, heavy tails): the same directions as above."""
    from megatron_tah.codecs.core.samples import activation_like

    x = activation_like((64, 2, 512), torch.bfloat16, seed=0)
    errors = {(name, hadamard): rel_error(x, round_trip(make(name, hadamard), x)) for name, hadamard in KEYS}
    assert errors["mxfp4", True] < 0.85 * errors["mxfp4", False]
    assert errors["nvfp4", True] > errors["nvfp4", False]
    assert errors["nvfp4", False] < errors["mxfp4", False]  # finer scales (16 values, 4-bit mantissa)


# ----- registry, flags, report ------------------------------------------------------------------------
def test_registered_in_codecs_flags_config_and_report():
    assert {"mxfp4", "nvfp4"} <= set(CODECS)
    parser = arguments.add_tah_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--tah-forward-codec", "mxfp4", "--tah-backward-codec", "nvfp4", "--tah-fp4-hadamard"])
    config = arguments.tah_config_from_args(args)
    assert config.forward_codec().describe() == "mxfp4(hadamard=True, hadamard_seed=0)"
    assert config.backward_codec().describe() == "nvfp4(hadamard=True, hadamard_seed=0)"
    assert TahConfig(tah_forward_codec="nvfp4").forward_codec().describe() == "nvfp4(hadamard=False)"
    labels = [name for _, name, _ in report.STATELESS_ROWS]
    assert labels.count("mxfp4") == 2 and labels.count("nvfp4") == 2
