"""The codec comparison table (``python -m benchmarks.codec_report``) on a small shape."""

import math

import pytest
import torch

from benchmarks.codec_report import __main__ as report
from megatron_tah.codecs import get_codec
from megatron_tah.codecs.core.samples import activation_like
from tests.helpers.codec_cases import cases
from tests.helpers.edge_cases import rel_error

SHAPE = (32, 2, 256)


@pytest.fixture(scope="module")
def measured():
    return report.measure(SHAPE, torch.bfloat16, seed=1, repeats=1)


def test_rows_cover_every_codec_with_consistent_numbers(measured):
    rows, buffer_nbytes = measured
    by_label = {r.label: r for r in rows}
    assert list(by_label) == [label for label, _, _ in report.stateless_rows()] + [
        "aqsgd 4b/64 first visit", "aqsgd 4b/64 revisit"]
    x = activation_like(SHAPE, torch.bfloat16, seed=1)
    for label, name, options in report.stateless_rows():
        row = by_label[label]
        nbytes = get_codec(name, **options).wire_nbytes(SHAPE, torch.bfloat16)
        assert row.nbytes == nbytes
        assert row.bits_per_element == pytest.approx(8 * nbytes / math.prod(SHAPE))
        assert row.ratio_bf16 * row.bits_per_element == pytest.approx(16)
        assert row.encode_ms > 0 and row.decode_ms > 0
    assert by_label["none"].rel_error == 0.0
    fixed = get_codec("fixedpoint", bits=4, tile_size=64)
    direct = report.relative_error(x, fixed.decode(fixed.encode(x), SHAPE, torch.bfloat16))
    assert by_label["fixedpoint 4b/64"].rel_error == pytest.approx(direct)
    # More bits, less error; rotation helps on outlier channels; a revisit beats the first visit.
    assert by_label["fixedpoint 6b/32"].rel_error < by_label["fixedpoint 4b/64"].rel_error \
        < by_label["fixedpoint 3b/64"].rel_error
    assert by_label["tah (default)"].rel_error < by_label["tah tau=inf (no rotation)"].rel_error
    assert by_label["aqsgd 4b/64 revisit"].rel_error < 0.2 * by_label["aqsgd 4b/64 first visit"].rel_error
    assert by_label["aqsgd 4b/64 first visit"].rel_error == pytest.approx(direct, rel=1e-3)
    assert by_label["fp8 G=128"].bits_per_element < 8.6
    assert buffer_nbytes == SHAPE[1] * SHAPE[0] * SHAPE[2] * 4


# A codec keeping state per sample is measured apart (aqsgd: its first-visit and revisit rows).
@pytest.mark.parametrize("case", cases(keep=lambda case: not case.declaration.needs_sample_ids))
def test_every_registered_codec_has_a_row_of_its_own_numbers(case):
    rows = [(label, options) for label, name, options in report.stateless_rows() if name == case.name]
    assert rows, case.name
    x = activation_like((16, 2, 128), torch.bfloat16, seed=1)
    for label, options in rows:
        row = report.measure_stateless(label, case.name, options, x, repeats=1, backend="torch")
        codec = case.make(**options)
        buf = codec.encode(x)
        assert row.label == label and row.nbytes == buf.numel() == codec.wire_nbytes(x.shape, x.dtype)
        assert row.bits_per_element == pytest.approx(8 * buf.numel() / x.numel())
        assert row.rel_error == pytest.approx(rel_error(x, codec.decode(buf, x.shape, x.dtype)), rel=1e-6, abs=1e-12)
        assert row.encode_ms > 0 and row.decode_ms > 0
        assert row.label in report.format_table([row])


def test_main_prints_the_table(capsys):
    assert report.main(["--shape", "16", "1", "128", "--dtype", "fp32", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "shape [16, 1, 128] fp32" in out
    for label in ("none", "fixedpoint 6b/32", "tah (default)", "fp8 G=128", "int8 B=128", "aqsgd 4b/64 revisit"):
        assert label in out
    header = next(line for line in out.splitlines() if line.startswith("codec"))
    assert header.split() == ["codec", "bits/elem", "vs", "bf16", "vs", "fp32", "rel.", "error", "encode", "ms",
                              "decode", "ms"]


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="three sizes"):
        report.measure((4, 64), torch.float32)
    with pytest.raises(SystemExit):
        report.main(["--dtype", "int8"])
