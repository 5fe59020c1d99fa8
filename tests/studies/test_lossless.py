"""``benchmarks.lossless``: the order-0 entropy of a codec buffer, section by section."""

from __future__ import annotations

import pytest
import torch

from benchmarks.lossless.measure import buffer_entropy_bits, entropy_bits
from megatron_tah.codecs.core import entropy
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


def test_the_projection_with_the_coder_bills_the_measured_share_and_the_coders_time_at_the_same_steps(tmp_path):
    import json

    from benchmarks.lossless.measure import projected
    from megatron_tah.config.auto import STEPS_MULTIPLIER

    speedrun = tmp_path / "speedrun.json"
    speedrun.write_text(json.dumps({"table": [{"codec": "lowrank", "multiplier": 1.1}, {"codec": "paper"}]}))
    rows_ = [{"preset": p, "direction": d, "bits": 4.0, "coded": c}
             for p, shares in (("lowrank", (3.0, 2.0)), ("paper", (3.0, 3.0)), ("lowrank_h3_rn", (3.0, 3.0)))
             for d, c in zip(("forward", "backward"), shares)]
    host = {"coder": "zstd", "forward": {"compress_mb_s": 100.0, "decompress_mb_s": 200.0},
            "backward": {"compress_mb_s": 100.0, "decompress_mb_s": 200.0}}
    rows = {r["preset"]: r for r in projected({"rows": rows_, "host_entropy": host}, speedrun)}
    assert sorted(rows) == ["lowrank", "lowrank_h3_rn"]  # paper: no measured multiplier
    row = rows["lowrank"]
    assert row["multiplier"] == 1.1 and row["multiplier_from"] == "the toy speedrun"
    assert rows["lowrank_h3_rn"]["multiplier"] == STEPS_MULTIPLIER[8]["lowrank_h3_rn"]  # the real-model study's
    assert rows["lowrank_h3_rn"]["multiplier_from"] == "the real-model study at depth 8"
    assert row["T_coded"] < row["T"] and row["s_per_step_coded"] < row["s_per_step"]
    assert row["T"] / row["s_per_step"] == pytest.approx(row["T_coded"] / row["s_per_step_coded"])  # same steps
    assert row["bits_coded"] < row["bits"] and row["T_coder_time"] > row["T_coded"]  # the coder's time is billed
    from benchmarks.speedrun import projection

    from megatron_tah.link import frames

    margin = 1 + frames.MARGIN  # the frames hold the coded bytes and a margin
    per_byte = projection.CodecTime(1e-8, 5e-9, "test")  # 100 MB/s encode, 200 MB/s decode
    scale = {"lowrank": (0.75 * margin, 0.5 * margin)}
    timed = projection.project({"lowrank": 1.1}, {"lowrank": projection.CODECS["lowrank"]}, byte_scale=scale,
                               coder_seconds_per_byte={"lowrank": (per_byte, per_byte)})[0]
    assert row["T_coder_time"] == pytest.approx(timed["T"])
    assert timed["forward_codec_s"] == pytest.approx(
        projection.codec_time(projection.TahConfig(**projection.CODECS["lowrank"]).forward_codec()).encode_s
        + projection.codec_time(projection.TahConfig(**projection.CODECS["lowrank"]).forward_codec()).decode_s
        + 1.5e-8 * projection.TahConfig(**projection.CODECS["lowrank"]).forward_codec().wire_nbytes(
            projection.SHAPE, torch.bfloat16))  # the codec buffer's bytes at the coder's rates, both ends
    split = projection.project({"lowrank": 1.1}, {"lowrank": projection.CODECS["lowrank"]}, byte_scale=scale,
                               micro_batches=row["split"], coder_seconds_per_byte={"lowrank": (per_byte, per_byte)})[0]
    assert row["split"] == 32 and row["T_coded_split"] == pytest.approx(split["T"])


def test_the_host_coder_is_billed_its_time_and_credited_its_link_saving():
    import torch

    from benchmarks.lossless.measure import host_zlib, host_zlib_text
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
    assert "zlib on the whole buffer pays." in host_zlib_text(fast, "test cpu")


def test_the_built_coder_sends_close_to_the_order0_estimate_and_is_billed_its_time():
    from benchmarks.lossless.measure import host_entropy, host_entropy_text, measure

    x = activation_like((256, 1, 128), seed=4).to(torch.bfloat16)
    config = TahConfig(tah_preset="lowrank", tah_backend="torch")
    for codec in (config.forward_codec(), config.backward_codec()):
        m = measure(codec, x)
        # the default coder sends about the entropy; its tables cost a little more (pairs can take a little off)
        assert m["coded"] < m["bits"] and m["order0"] - 0.05 < m["coded"] < m["order0"] + 0.35
    h = host_entropy({3: (x, (x * 1e-3).to(torch.bfloat16))}, "lowrank", repeats=1)
    for direction in ("forward", "backward"):
        row = h[direction]
        assert 0 < row["saved"] < 1 and row["compress_mb_s"] > 0 and row["decompress_mb_s"] > 0
        assert row["coder_ms"] == pytest.approx(row["message_bytes"] / 1e3 * (1 / row["compress_mb_s"]
                                                                              + 1 / row["decompress_mb_s"]))
    text = host_entropy_text(h, "test cpu")
    assert f"{entropy.DEFAULT_CODER} coder on test cpu ({h['threads']} thread" in text and f"it saves {h['forward']['saved']:.0%}" in text


def test_the_coders_summary_gives_each_coders_span_per_shape_from_the_rows():
    from benchmarks.lossless import coders

    def row(shape, order0, coded, mb_s, bps):
        return {"preset": "p", "direction": "forward", "shape": shape, "raw": 2 * order0, "order0": order0,
                "coders": {"zstd": {"coded": coded, "encode_ms": 1.0, "decode_ms": 1.0, "mb_s": mb_s,
                                    "break_even_bps": bps}}}

    rows = [row([1024, 1, 576], 1000, 990, 100.0, 5e7), row([128, 1, 576], 100, 101, 50.0, 2e8),
            row([128, 1, 576], 200, 203, 80.0, 3e8)]
    text = coders.summary(rows)
    assert "`zstd`: `[1024, 1, 576]` 0.9900; `[128, 1, 576]` 1.0100-1.0150 of the order-0 bound" in text
    assert "50.0-100.0 MB/s; pays below 50.0 Mbit/s to 300.0 Mbit/s" in text
    assert text in coders.table(rows, "host", "cmd")
