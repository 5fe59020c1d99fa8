"""scripts/profile_codecs.py on the CPU: its arguments, its table row, and its refusal without a GPU
(the measurement itself runs in scripts/gpu_check.sh's profile step)."""

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "scripts"))

import profile_codecs  # noqa: E402


def test_arguments_default_to_the_issue_shape_and_reject_unknown_codecs(capsys):
    args = profile_codecs.parse_args([])
    assert args.shape == (1024, 1, 1600) and "tah" in args.codecs and "aqsgd" not in args.codecs
    assert profile_codecs.parse_args(["--shape", "2048x8x8192", "--codecs", "tah", "fp8"]).codecs == ["tah", "fp8"]
    for bad in (["--codecs", "bogus"], ["--iters", "0"]):
        with pytest.raises(SystemExit):
            profile_codecs.parse_args(bad)
    assert "invalid choice: 'bogus'" in capsys.readouterr().err


def test_a_row_shows_both_paths_and_a_dash_where_the_graph_did_not_run():
    row = {"codec": "tah", "op": "encode", "eager_host_us": 650.25, "eager_device_us": 700.0, "gpu_us": 40.5,
           "launches": 31, "graph_host_us": 12.0, "graph_device_us": 45.0, "graph_pct_copy": 7.4}
    line = profile_codecs.format_row(row)
    assert line.split() == ["tah", "encode", "650.2", "700.0", "40.5", "31", "12.0", "45.0", "7%"]
    assert len(line) == len(profile_codecs.HEADER)
    eager_only = profile_codecs.format_row({**row, "graph_host_us": None, "graph_device_us": None,
                                            "graph_pct_copy": None})
    assert eager_only.split()[-3:] == ["-", "-", "-"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_it_refuses():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        profile_codecs.main(["--codecs", "tah"])
