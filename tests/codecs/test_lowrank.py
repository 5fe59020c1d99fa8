"""lowrank: wire size and its formula, the residual coded exactly as hadint codes it, the gain on a
low-rank input, bad input, config mismatches, and its place in registry, flags, preset and report.
The residual's Triton path is hadint's kernels (compared with the reference here and in kernels/test_hadint.py)."""

import argparse
import dataclasses
import math

import pytest
import torch

from megatron_tah.codecs import CODECS, CodecError, WireFormatError, get_codec
from benchmarks.codec_report import __main__ as report
from megatron_tah.numerics import MAX_ABS_VALUE
from megatron_tah.codecs.core.header import HEADER_NBYTES, align_up
from megatron_tah.codecs.lowrank import principal_directions
from megatron_tah.config import TahConfig, candidate_fields
from megatron_tah.kernels import common as kcommon
from megatron_tah.megatron import arguments
from tests.helpers.edge_cases import DTYPES, EDGE_CASES, edge_case_tensor, rel_error, round_trip

SHAPES = [(8, 2, 64), (7, 3, 100), (1, 1, 8), (33, 1, 130), (5, 17), (300,)]
OPTIONS = [{}, {"rank": 4, "coef_bits": 8}, {"bits": 4, "tile_size": 32, "rank": 1, "coef_bits": 3}]


def make(**options):
    return get_codec("lowrank", backend="torch", **options)


def low_rank_input(rows=256, h=128, rank=4, noise=0.01, seed=0):
    """Activations whose energy sits in ``rank`` directions not aligned with channels, plus white noise."""
    gen = torch.Generator().manual_seed(seed)
    directions = torch.linalg.qr(torch.randn(h, rank, generator=gen))[0].T
    weights = torch.randn(rows, rank, generator=gen) * torch.linspace(8, 2, rank)
    return weights @ directions + noise * torch.randn(rows, h, generator=gen)


# ----- wire size -------------------------------------------------------------------------------
@pytest.mark.parametrize("options", OPTIONS, ids=["default", "r4c8", "4b32r1c3"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_wire_size_is_wire_nbytes_and_the_layout_formula(options, dtype, shape):
    codec = make(**options)
    x = torch.randn(shape).to(dtype)
    buf = codec.encode(x)
    h, rows = shape[-1], math.prod(shape[:-1])
    k, tile = min(codec.rank, h), codec.tile_size
    tiles = rows * -(-h // tile)
    sizes = [2 * k, k * h, 2 * rows, -(-rows * k // 8) * codec.coef_bits, 2 * tiles, tiles * tile * codec.bits // 8]
    end = HEADER_NBYTES
    for size in sizes:
        end = align_up(end) + size
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    assert buf.numel() == codec.wire_nbytes(shape, dtype) == align_up(end)
    y = codec.decode(buf, shape, dtype)
    assert y.shape == x.shape and y.dtype == dtype


def test_bits_per_element_of_the_preset_at_the_study_shape_and_at_scale():
    codec = get_codec("lowrank", bits=3, rank=16, coef_bits=6)
    assert codec.wire_nbytes((128, 4, 128), torch.float32) * 8 / (128 * 4 * 128) == pytest.approx(4.38, abs=0.005)
    # bits + 16/64 + (16k + 8kh)/(rows h) + (16 + 6k)/h at GPT-2 XL's width, 4096 tokens
    big = (1024, 4, 1600)
    want = 3 + 16 / 64 + (16 * 16 + 8 * 16 * 1600) / (4096 * 1600) + (16 + 6 * 16) / 1600
    assert codec.wire_nbytes(big, torch.bfloat16) * 8 / math.prod(big) == pytest.approx(want, abs=1e-3)


# ----- what is sent ------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(16, 4, 128), (7, 3, 100), (300,)])
def test_residual_sections_are_hadint_of_x_minus_the_decoded_low_rank_part(shape):
    codec = make()
    x = torch.randn(shape) + 3 * torch.randn(shape[-1])  # a common direction on top of noise
    buf = codec.encode(x)
    layout = codec.layout(x.shape, x.dtype)
    h = shape[-1]
    low = codec._read_low_rank(buf, layout, x.numel() // h, h).reshape(shape)
    hadint = get_codec("hadint", bits=codec.bits, tile_size=codec.tile_size, backend="torch")
    ref = hadint.encode(x.float() - low)
    ref_layout = hadint.layout(x.shape, torch.float32)
    for name in ("scale", "codes"):
        assert torch.equal(layout.view(buf, name), ref_layout.view(ref, name))
    decoded = codec.decode(buf, x.shape, torch.float32)
    assert torch.equal(decoded, low + hadint.decode(ref, x.shape, torch.float32))


def test_principal_directions_are_orthonormal_and_find_a_planted_subspace():
    x = low_rank_input(rank=4, noise=0.0)
    basis = principal_directions(x, 6)
    assert basis.shape == (6, 128)
    assert torch.allclose(basis @ basis.T, torch.eye(6), atol=1e-5)
    assert rel_error(x, (x @ basis[:4].T) @ basis[:4]) < 1e-5  # the top 4 span the planted directions
    zeros = principal_directions(torch.zeros(5, 32), 3)  # any orthonormal basis
    assert torch.allclose(zeros @ zeros.T, torch.eye(3), atol=1e-6)


def test_a_low_rank_message_costs_far_less_error_than_hadint_at_more_bits():
    x = low_rank_input(rank=4, noise=0.01)
    lowrank = make(rank=8)
    hadint4 = get_codec("hadint", bits=4, backend="torch")
    assert lowrank.wire_nbytes(x.shape, x.dtype) < hadint4.wire_nbytes(x.shape, x.dtype) * 1.1
    err_lowrank, err_hadint = rel_error(x, round_trip(lowrank, x)), rel_error(x, round_trip(hadint4, x))
    assert err_hadint > 0.08 and err_lowrank < err_hadint / 5
    # An isotropic message gains nothing, and loses nothing beyond hadint's error at the residual's bits.
    iso = torch.randn(256, 128)
    hadint3 = get_codec("hadint", bits=3, backend="torch")
    assert rel_error(iso, round_trip(lowrank, iso)) < 1.05 * rel_error(iso, round_trip(hadint3, iso)) < 0.3


def test_more_residual_bits_or_rank_less_error():
    x = low_rank_input(rank=12, noise=0.05)
    errors = [rel_error(x, round_trip(make(**o), x)) for o in ({"rank": 4}, {"rank": 16}, {"rank": 16, "bits": 5})]
    assert errors[0] > errors[1] > errors[2]


# ----- stochastic rounding of the residual (gradients: the speedrun's lowrank2) --------------------
def sections(codec, buf, x):
    return codec.layout(x.shape, x.dtype).sections(buf)


def test_stochastic_rounding_changes_only_the_residuals_codes_and_is_unbiased():
    x = low_rank_input(rank=12, noise=0.3)  # the residual holds a fair share of the energy
    nearest, stochastic = make(), make(stochastic_rounding=True, seed=5)
    n, single, mean = 200, [], torch.zeros_like(x)
    for _ in range(n):
        a, b = nearest.encode(x), stochastic.encode(x)
        parts_a, parts_b = sections(nearest, a, x), sections(stochastic, b, x)
        for name in ("basis_scale", "basis", "coef_scale", "coef"):  # the same tracked basis and coefficients
            assert torch.equal(parts_a[name], parts_b[name]), name
        y = stochastic.decode(b, x.shape, x.dtype)
        single.append(rel_error(x, y))
        mean += y / n
    biased = rel_error(x, round_trip(nearest, x))
    typical = sum(single) / n
    # Unbiased: the mean of n independent round trips is within about typical / sqrt(n) of x (3 sigma here),
    # while rounding to nearest repeats its error; one stochastic round trip costs up to twice nearest's.
    assert rel_error(x, mean) < 3 * typical / n ** 0.5 < 0.5 * biased
    assert biased < typical < 2 * biased


def test_stochastic_rounding_draws_per_link_noise_and_resumes_it(tmp_path):
    messages = drifting_messages(count=4)
    a, b = make(stochastic_rounding=True, seed=5), make(stochastic_rounding=True, seed=5)
    assert a.salt_rounding("backward:1") is a and a.rounding_noise is a.residual.rounding_noise
    b.salt_rounding("backward:2")
    assert not torch.equal(a.encode(messages[0]), b.encode(messages[0]))  # two links: two noise streams
    whole = make(stochastic_rounding=True, seed=5).salt_rounding("backward:1")
    expected = [whole.encode(x) for x in messages]
    first = make(stochastic_rounding=True, seed=5).salt_rounding("backward:1")
    for x in messages[:2]:
        first.encode(x)
    torch.save(first.state_dict(), tmp_path / "codec.pt")
    assert first.state_dict()["rounding_noise"]["calls"] == 2
    resumed = make(stochastic_rounding=True, seed=5).salt_rounding("backward:1")
    resumed.load_state_dict(torch.load(tmp_path / "codec.pt"))
    assert all(torch.equal(resumed.encode(x), want) for x, want in zip(messages[2:], expected[2:]))
    with pytest.raises(ValueError, match="seed"):  # another link's (or seed's) noise never resumes silently
        make(stochastic_rounding=True, seed=5).salt_rounding("backward:2").load_state_dict(first.state_dict())


def test_a_receiver_that_rounds_otherwise_is_refused():
    x = torch.randn(16, 2, 128)
    with pytest.raises(WireFormatError, match="another config"):
        make().decode(make(stochastic_rounding=True).encode(x), x.shape, x.dtype)


# ----- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", EDGE_CASES)
def test_edge_cases_round_trip_without_nan(dtype, kind, stochastic):
    x = edge_case_tensor(kind, dtype=dtype)
    y = round_trip(make(stochastic_rounding=stochastic), x)
    assert torch.isfinite(y).all()
    if kind == "zeros":
        assert torch.equal(y, x) and not torch.signbit(y).any()
    else:
        assert rel_error(x, y) < (0.3 if stochastic else 0.2)


def test_huge_magnitudes_up_to_max_abs_value_and_fp16_limits():
    hadint3 = get_codec("hadint", bits=3, backend="torch")
    x = torch.randn(64, 128)
    x = x / x.abs().max() * MAX_ABS_VALUE  # every row above the bound: sent as hadint alone, exactly
    y = round_trip(make(), x)
    assert torch.isfinite(y).all() and torch.equal(y, round_trip(hadint3, x))
    # A basis along (e_0 + ones / sqrt(h)) and a row of ones at 1e36: projecting that row would leave a
    # residual of -5.7e36 in channel 0 (a NaN tile); rows that large are sent by the residual alone.
    u = torch.full((128,), 1 / math.sqrt(256))
    u[0] += 1 / math.sqrt(2)
    x = torch.stack([u / u.abs().max() * MAX_ABS_VALUE] * 400 + [torch.full((128,), MAX_ABS_VALUE)])
    y = round_trip(make(rank=1), x)
    assert torch.isfinite(y).all() and torch.equal(y, round_trip(hadint3, x))
    x = low_rank_input() * 1e32  # below the bound (1e36 / (2 (1 + sqrt 128)) = 4.1e34): the low-rank path
    assert x.abs().max() < 4e34 and rel_error(x, round_trip(make(), x)) < rel_error(x, round_trip(hadint3, x)) / 5
    x16 = torch.full((4, 64), 65504.0, dtype=torch.float16)
    x16[:, ::2] = -65504.0
    assert torch.isfinite(round_trip(make(), x16)).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 1e37])
def test_a_bad_value_poisons_only_its_tile_and_its_row_keeps_hadints_accuracy(bad):
    codec = make()
    x = low_rank_input(rows=64, h=256, rank=4, noise=0.05).reshape(8, 8, 256)
    x[1, 0, 70] = bad
    y = round_trip(codec, x)
    assert torch.isnan(y[1, 0, 64:128]).all()
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[1, 0, 64:128] = False
    assert torch.isfinite(y[mask]).all()
    others = torch.ones(8, 8, dtype=torch.bool)
    others[1, 0] = False
    assert rel_error(x[others], y[others]) < 0.05  # the basis comes from the good rows
    row = mask[1, 0]
    hadint3 = get_codec("hadint", bits=3, backend="torch")
    clean_row = x[1, 0].clone()
    clean_row[64:128] = 0
    assert rel_error(clean_row[row], y[1, 0][row]) <= 1.5 * rel_error(
        clean_row[row], round_trip(hadint3, clean_row)[row])


def test_identical_input_gives_identical_bytes():
    x = low_rank_input().to(torch.bfloat16)
    assert torch.equal(make().encode(x), make().encode(x.clone()))


# ----- configuration and the wire header ----------------------------------------------------------
def test_differently_configured_receiver_raises():
    x = torch.randn(16, 2, 128)
    sender = make()
    for other in (make(hadamard_seed=1),):
        assert other.wire_nbytes(x.shape, x.dtype) == sender.wire_nbytes(x.shape, x.dtype)
        with pytest.raises(WireFormatError, match="another config"):
            other.decode(sender.encode(x), x.shape, x.dtype)
    for other in (make(rank=8), make(coef_bits=5), make(bits=4)):
        with pytest.raises(WireFormatError, match="bytes"):
            other.decode(sender.encode(x), x.shape, x.dtype)
    buf = sender.encode(x)
    buf[3] = get_codec("hadint").codec_id
    with pytest.raises(WireFormatError, match="'hadint'"):
        sender.decode(buf, x.shape, x.dtype)


def test_bad_options_raise():
    for options, match in (({"rank": 0}, "rank"), ({"rank": 257}, "rank"), ({"rank": "4"}, "rank"),
                           ({"rank": True}, "rank"), ({"coef_bits": 2}, "coef_bits"), ({"coef_bits": 9}, "coef_bits"),
                           ({"bits": 2}, "bits"), ({"tile_size": 48}, "tile_size"),
                           ({"stochastic_rounding": 1}, "stochastic_rounding")):
        with pytest.raises(CodecError, match=match):
            get_codec("lowrank", **options)
    with pytest.raises(CodecError, match="unsupported dtype"):
        make().encode(torch.zeros(4, 64, dtype=torch.float64))


# ----- the residual's Triton path -----------------------------------------------------------------
@pytest.mark.triton
@pytest.mark.skipif(kcommon.kernel_device() is None, reason=kcommon.why_no_kernels())
@pytest.mark.parametrize("shape,options", [((16, 2, 128), {}), ((5, 3, 100), {"bits": 4, "tile_size": 32, "rank": 3}),
                                           ((16, 2, 128), {"stochastic_rounding": True, "seed": 5})])
def test_triton_path_writes_the_reference_bytes_on_the_same_device(shape, options):
    device = kcommon.kernel_device()
    x = low_rank_input(rows=math.prod(shape[:-1]), h=shape[-1], rank=4, noise=0.05).reshape(shape).to(device)
    x[0, 0, 5] = float("nan")
    ref = get_codec("lowrank", backend="torch", **options)
    tri = get_codec("lowrank", backend="triton", **options)
    assert tri.has_triton_path()
    buf = tri.encode(x)
    assert torch.equal(buf, ref.encode(x))  # atol = 0 (the low-rank part is the same torch code on the device)
    a, b = tri.decode(buf, shape, x.dtype), ref.decode(buf, shape, x.dtype)
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


# ----- registry, flags, preset, report ------------------------------------------------------------
def test_registered_in_codecs_flags_preset_and_report():
    assert "lowrank" in CODECS
    parser = arguments.add_tah_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--tah-forward-codec", "lowrank", "--tah-forward-bits", "3",
                              "--tah-lowrank-rank", "8", "--tah-lowrank-coef-bits", "5"])
    assert arguments.tah_config_from_args(args).forward_codec().describe() == \
        "lowrank(bits=3, tile_size=64, rank=8, coef_bits=5, hadamard_seed=0, stochastic_rounding=False)"
    preset = TahConfig(tah_preset="lowrank")
    assert preset.forward_codec().describe() == \
        "lowrank(bits=3, tile_size=64, rank=16, coef_bits=6, hadamard_seed=0, stochastic_rounding=False)"
    assert preset.backward_codec().describe() == \
        "hadint(hadamard=True, hadamard_seed=0, bits=4, tile_size=64, stochastic_rounding=True)"
    # auto's candidate lowrank8 is the same with rank 8 (the parity runs of rank 8 were made with these flags spelled
    # out).
    spelled = parser.parse_args(["--tah-forward-codec", "lowrank", "--tah-forward-bits", "3", "--tah-lowrank-rank", "8",
                                 "--tah-backward-codec", "hadint", "--tah-backward-bits", "4",
                                 "--tah-backward-tile-size", "64", "--tah-backward-stochastic-rounding"])
    assert dataclasses.replace(TahConfig(**candidate_fields("lowrank8")), tah_preset="none") == \
        arguments.tah_config_from_args(spelled)
    with pytest.raises(ValueError, match="tah_lowrank_rank = 8 conflicts with tah_preset = 'lowrank'"):
        TahConfig(tah_preset="lowrank", tah_lowrank_rank=8)
    # lowrank on gradients, its residual rounded stochastically (the speedrun's lowrank2)
    both = parser.parse_args(["--tah-backward-codec", "lowrank", "--tah-backward-bits", "3",
                              "--tah-backward-tile-size", "64", "--tah-backward-stochastic-rounding"])
    assert arguments.tah_config_from_args(both).backward_codec().describe() == \
        "lowrank(bits=3, tile_size=64, rank=16, coef_bits=6, hadamard_seed=0, stochastic_rounding=True)"
    with pytest.raises(ValueError, match=r"tah_lowrank_rank = 0: must lie in \[1, 256\]"):
        TahConfig(tah_forward_codec="lowrank", tah_lowrank_rank=0)
    assert [name for _, name, _ in report.STATELESS_ROWS].count("lowrank") == 1


# ----- the tracked subspace: quality, determinism, resume, no host sync ---------------------------
def eigh_basis(x, k, iterations=3, oversampling=8):
    """What lowrank sent before its tracked basis, for comparison: 3 power steps from the seeded start, then a
    Rayleigh-Ritz step by ``eigh`` (a host sync on CUDA) keeping the top k."""
    from megatron_tah.codecs.lowrank import _start

    q = _start(x.shape[1], min(k + oversampling, x.shape[1]), "cpu")
    x = x / x.abs().amax()
    for _ in range(iterations):
        q = torch.linalg.qr(x.T @ (x @ q))[0]
    projected = x @ q
    vectors = torch.linalg.eigh(projected.T @ projected)[1]
    return (q @ vectors[:, -k:].flip(-1)).T


def drifting_messages(count=6, rows=256, h=128, rank=12, noise=0.05):
    """Messages of one link: the same planted directions, new weights each time (activations of a training run)."""
    gen = torch.Generator().manual_seed(3)
    directions = torch.linalg.qr(torch.randn(h, rank, generator=gen))[0].T
    spread = torch.logspace(1, -0.5, rank)
    return [(torch.randn(rows, rank, generator=gen) * spread) @ directions + noise * torch.randn(rows, h, generator=gen)
            for _ in range(count)]


@pytest.mark.parametrize("rank,planted", [(4, 12), (16, 12), (8, 4)])
def test_the_tracked_basis_is_no_worse_than_the_eigh_basis_after_a_few_messages(rank, planted, monkeypatch):
    tracked, by_eigh = make(rank=rank), make(rank=rank)
    monkeypatch.setattr(by_eigh, "_basis", lambda x, k: eigh_basis(x, k))
    ratios = [rel_error(x, round_trip(tracked, x)) / rel_error(x, round_trip(by_eigh, x))
              for x in drifting_messages(rank=planted)]
    # Quantization noise moves a message's ratio by about 2% either way (measured: 0.987 .. 1.022).
    assert max(ratios[1:]) < 1.03 and sum(ratios[2:]) / len(ratios[2:]) < 1.01


def test_tracking_is_deterministic_and_a_zero_message_keeps_the_subspace():
    messages = drifting_messages(count=4)
    a, b = make(rank=4), make(rank=4)
    assert all(torch.equal(a.encode(x), b.encode(x)) for x in messages)
    held = a.state_dict()["subspaces"][128]
    a.encode(torch.zeros(256, 128))
    assert torch.equal(a.state_dict()["subspaces"][128], held)
    q = held
    assert torch.allclose(q.T @ q, torch.eye(q.shape[1]), atol=1e-5)


def test_state_dict_resume_writes_the_same_bytes(tmp_path):
    messages = drifting_messages(count=5)
    whole = make(rank=4)
    expected = [whole.encode(x) for x in messages]
    first = make(rank=4)
    for x in messages[:2]:
        first.encode(x)
    torch.save(first.state_dict(), tmp_path / "codec.pt")
    resumed = make(rank=4)
    assert resumed.stateful and resumed.state_dict() == {"subspaces": {}}
    resumed.load_state_dict(torch.load(tmp_path / "codec.pt"))
    assert all(torch.equal(resumed.encode(x), want) for x, want in zip(messages[2:], expected[2:]))
    # A held subspace is overwritten in place (a captured graph keeps reading the same tensor).
    held = resumed._subspaces[128]
    resumed.load_state_dict(first.state_dict())
    assert resumed._subspaces[128] is held and torch.equal(held, first.state_dict()["subspaces"][128])
    with pytest.raises(CodecError, match="rank 8"):
        make(rank=8).load_state_dict(first.state_dict())


def test_encode_reads_nothing_back_on_the_host():
    from tests.helpers.host_reads import HostRead, no_host_reads

    # The basis, coefficients and residual; the residual's coding is hadint's (its Triton kernels on CUDA,
    # tested for syncs below; the torch reference branches on the host).
    codec = make(rank=4)
    messages = drifting_messages(count=3)
    layout = codec.layout(messages[0].shape, messages[0].dtype)
    buf = codec.encode(messages[0])
    with no_host_reads():
        for x in messages[1:]:
            codec._residual(x, buf, layout)
        with pytest.raises(HostRead):  # the checker can fail: eigh's Rayleigh-Ritz step read the host
            torch.zeros(2).item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda.set_sync_debug_mode needs a CUDA GPU")
def test_encode_makes_no_host_sync_on_cuda():
    codec = get_codec("lowrank", rank=16)
    messages = [x.cuda() for x in drifting_messages(count=3, h=256)]
    codec.encode(messages[0])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x in messages[1:]:
            codec.encode(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
