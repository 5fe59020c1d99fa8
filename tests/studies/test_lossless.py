"""``benchmarks.lossless``: the order-0 entropy of a codec buffer, section by section."""

from __future__ import annotations

import pytest
import torch

from benchmarks.lossless import buffer_entropy_bits, entropy_bits
from megatron_tah.codecs.core.samples import activation_like
from megatron_tah.config import TahConfig
from megatron_tah.config.presets import PRESETS


def test_order0_entropy_of_known_distributions():
    assert entropy_bits(torch.zeros(1000, dtype=torch.uint8)) == pytest.approx(0.0, abs=1e-9)
    assert entropy_bits(torch.arange(16, dtype=torch.uint8).repeat(64)) == pytest.approx(4 * 1024)
    assert entropy_bits(torch.tensor([0, 0, 0, 1] * 250, dtype=torch.uint8)) == pytest.approx(
        1000 * (-(0.75 * torch.log2(torch.tensor(0.75)) + 0.25 * torch.log2(torch.tensor(0.25)))).item())


@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "none"])
def test_every_preset_codecs_packed_sections_are_named_and_their_entropy_is_at_most_the_wire(preset):
    config = TahConfig(tah_preset=preset, tah_backend="torch")
    x = activation_like((64, 1, 128), seed=3)
    for codec in (config.forward_codec(), config.backward_codec()):
        layout = codec.layout(tuple(x.shape), x.dtype)
        assert codec.code_sections() and set(codec.code_sections()) <= set(layout.offsets), (codec.name, layout.offsets)
        buf = codec.encode(x)
        bits = buffer_entropy_bits(codec, buf, tuple(x.shape), x.dtype)
        # a packed section's codes are at most its bits each, a byte section at most 8 bits a byte
        assert 0 < bits <= 8 * buf.numel()
        codes = sum(layout.offsets[name][1] for name in codec.code_sections())
        assert bits < 8 * buf.numel() - 0.01 * 8 * codes  # activations' codes are not uniform: something saved


def test_a_uniform_code_section_costs_its_bits():
    """Codes drawn uniformly: the packed section's entropy is its bits per code (up to sampling)."""
    config = TahConfig(tah_forward_codec="channel", tah_forward_bits=4, tah_backend="torch")
    codec = config.forward_codec()
    x = torch.rand(4096, 1, 8) * torch.arange(1, 9)  # uniform per channel: uniform codes
    buf = codec.encode(x)
    start, size = codec.layout(tuple(x.shape), x.dtype).offsets["codes"]
    from megatron_tah.codecs.core.common import unpack_bits

    codes = unpack_bits(buf[start:start + size], 4, size * 2)
    assert entropy_bits(codes) == pytest.approx(4 * codes.numel(), rel=0.01)


def test_the_projection_with_the_coder_bills_the_measured_share_at_the_same_steps(tmp_path):
    import json

    from benchmarks.lossless import projected

    speedrun = tmp_path / "speedrun.json"
    speedrun.write_text(json.dumps({"table": [{"codec": "lowrank", "multiplier": 1.1}, {"codec": "paper"}]}))
    result = {"rows": [{"preset": "lowrank", "direction": "forward", "bits": 4.0, "coded": 3.0},
                       {"preset": "lowrank", "direction": "backward", "bits": 4.0, "coded": 2.0},
                       {"preset": "paper", "direction": "forward", "bits": 4.0, "coded": 3.0},
                       {"preset": "paper", "direction": "backward", "bits": 4.0, "coded": 3.0}]}
    rows = projected(result, speedrun)
    assert [r["preset"] for r in rows] == ["lowrank"]  # paper: no measured multiplier
    row = rows[0]
    assert row["multiplier"] == 1.1 and row["T_coded"] < row["T"] and row["s_per_step_coded"] < row["s_per_step"]
    assert row["T"] / row["s_per_step"] == pytest.approx(row["T_coded"] / row["s_per_step_coded"])  # same steps
    assert row["bits_coded"] < row["bits"]
    from benchmarks.speedrun import projection

    from megatron_tah.link import frames

    margin = 1 + frames.MARGIN  # the frames hold the coded bytes and a margin
    split = projection.project({"lowrank": 1.1}, {"lowrank": projection.CODECS["lowrank"]}, byte_scale={
        "lowrank": (0.75 * margin, 0.5 * margin)}, micro_batches=row["split"])[0]
    assert row["split"] == 32 and row["T_coded_split"] == pytest.approx(split["T"])
    assert row["T_coded_split"] < row["T_coded"]  # fewer, larger messages: latency held the wire less often


def test_the_host_coder_is_billed_its_time_and_credited_its_link_saving():
    import torch

    from benchmarks.lossless import host_zlib, host_zlib_text
    from benchmarks.speedrun import projection
    from megatron_tah.codecs.core.samples import activation_like
    from megatron_tah.config import TahConfig

    x = activation_like((64, 1, 256)).to(torch.bfloat16)
    h = host_zlib({3: (x, (x * 1e-3).to(torch.bfloat16))}, "lowrank", repeats=1)
    config = TahConfig(tah_preset="lowrank")
    for direction, codec in (("forward", config.forward_codec()), ("backward", config.backward_codec())):
        row = h[direction]
        assert row["message_bytes"] == codec.wire_nbytes(projection.SHAPE, torch.bfloat16)
        assert 0 < row["saved"] < 1 and row["compress_mb_s"] > 0 and row["decompress_mb_s"] > 0
        assert row["link_saved_ms"] == pytest.approx(1e3 * 8 * row["message_bytes"] * row["saved"] / 200e6)
        assert row["coder_ms"] == pytest.approx(row["message_bytes"] / 1e3 * (1 / row["compress_mb_s"]
                                                                              + 1 / row["decompress_mb_s"]))
    text = host_zlib_text(h, "test cpu")
    assert "on one core of test cpu, per `lowrank` message" in text and f"saves {h['forward']['saved']:.0%}" in text
    assert "does not pay" in text if h["forward"]["coder_ms"] > h["forward"]["link_saved_ms"] else "pays" in text
    fast = {**h, **{d: {**h[d], "coder_ms": 0.0} for d in ("forward", "backward")}}
    assert "A coder on the host pays." in host_zlib_text(fast, "test cpu")


def test_the_built_coder_sends_close_to_the_order0_estimate_and_is_billed_its_time():
    from benchmarks.lossless import host_entropy, host_entropy_text, measure

    x = activation_like((256, 1, 128), seed=4).to(torch.bfloat16)
    config = TahConfig(tah_preset="lowrank", tah_backend="torch")
    for codec in (config.forward_codec(), config.backward_codec()):
        m = measure(codec, x)
        # ANS sends the entropy; its tables cost a little more (code pairs can only take a little off)
        assert m["coded"] < m["bits"] and m["order0"] - 0.05 < m["coded"] < m["order0"] + 0.35
    h = host_entropy({3: (x, (x * 1e-3).to(torch.bfloat16))}, "lowrank", repeats=1)
    for direction in ("forward", "backward"):
        row = h[direction]
        assert 0 < row["saved"] < 1 and row["compress_mb_s"] > 0 and row["decompress_mb_s"] > 0
        assert row["coder_ms"] == pytest.approx(row["message_bytes"] / 1e3 * (1 / row["compress_mb_s"]
                                                                              + 1 / row["decompress_mb_s"]))
    text = host_entropy_text(h, "test cpu")
    assert f"ans coder on test cpu ({h['threads']} thread" in text and f"it saves {h['forward']['saved']:.0%}" in text
