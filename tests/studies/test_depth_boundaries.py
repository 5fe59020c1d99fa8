"""The depth study's emulated boundaries: a codec round trip after the chosen layers, both directions."""

import pytest
import torch

from benchmarks.depth.boundaries import Boundaries, _RoundTrip
from megatron_tah.config import TahConfig


def test_a_boundary_sends_activations_and_gradients_through_their_codecs(tmp_path):
    forward = {"tah_forward_codec": "fixedpoint", "tah_forward_bits": 4, "tah_tile_size": 64}
    backward = {"tah_backward_codec": "fixedpoint", "tah_backward_bits": 3, "tah_backward_tile_size": 32}
    boundaries = Boundaries([2], forward, backward, log=tmp_path / "log.jsonl", sample_every=1)
    x = torch.randn(16, 2, 128, requires_grad=True)
    y = _RoundTrip.apply(x, boundaries, 2)
    fwd = TahConfig(**forward).forward_codec()
    assert torch.equal(y, fwd.decode(fwd.encode(x.detach()), x.shape, x.dtype))  # what the next stage receives
    g = torch.randn_like(x)
    y.backward(g)
    bwd = TahConfig(**backward).backward_codec()
    assert torch.equal(x.grad, bwd.decode(bwd.encode(g), g.shape, g.dtype))  # what the previous stage receives
    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    assert len(lines) == 2 and '"direction": "forward"' in lines[0] and '"direction": "backward"' in lines[1]


def test_the_patch_wraps_only_the_chosen_layers_and_restores_exactly():
    from megatron.core.transformer.transformer_layer import TransformerLayer

    original = TransformerLayer.forward
    boundaries = Boundaries([1], {"tah_preset": "paper"}, {})
    boundaries.install()
    assert TransformerLayer.forward is not original
    boundaries.restore()
    assert TransformerLayer.forward is original


def test_the_page_shows_the_runs_there_are_and_names_the_studies_not_run(tmp_path):
    """``report.write_page``: gaps against the same seed's uncompressed run; a study without a complete run is
    listed as not run, and its numbers read "not run"."""
    import json

    from benchmarks.depth.__main__ import STUDIES
    from benchmarks.depth.report import write_page

    out = tmp_path / "runs"
    out.mkdir()
    for name, final in (("none", 5.40), ("paper_pp8", 5.65), ("paper_fwd_pp8", 5.70)):
        lines = [{"iteration": i, "lm_loss": 6.0} for i in (25, 50)] + \
                [{"iteration": 25, "valid_loss": 6.5}, {"iteration": 50, "valid_loss": final}]
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        (out / f"{name}.done").write_text("{}\n")
    page = tmp_path / "docs" / "DEPTH.md"
    write_page(STUDIES, out, page, {"cpu": "test cpu", "cores": 2})
    text = page.read_text()
    assert "+0.250 at PP 8" in text and "alone (gradients uncompressed): +0.300" in text
    assert "gradients alone cost" not in text  # paper_bwd_pp8 did not run here
    from benchmarks.depth.report import _share

    rows = {"paper_bwd_pp8": {"gap": 0.01}, "paper_fwd_pp8": {"gap": 0.25}}
    assert _share(rows, "paper_bwd_pp8", "paper_fwd_pp8") == ("The 6-bit gradients alone cost 4% of what the "
                                                              "activations' codec alone costs.")
    assert "not run at PP 2" in text
    assert "`paper_pp2`" in text.split("but not run for this page")[1]  # listed among the studies not run
    # the command that writes this page again: the studies it ran, in the study table's order
    assert "`python -m benchmarks.depth --only none,paper_pp8,paper_fwd_pp8 --write docs/DEPTH.md`" in text
    assert (tmp_path / "docs" / "data" / "depth_curves.png").stat().st_size > 1000
    assert not (tmp_path / "docs" / "data" / "depth_rms.png").exists()  # no forward-codec study ran


def test_the_page_tabulates_each_boundary_and_quotes_the_speedruns_remedies(tmp_path):
    """Per boundary: the sampled forward error (last quarter of the run), the rms sent and their product; the
    remedies' steps to target come from the speedrun's committed JSON, interval and seeds included."""
    import json

    from benchmarks.depth.__main__ import STUDIES
    from benchmarks.depth.report import boundary_table, build, remedies

    out = tmp_path / "runs"
    out.mkdir()
    lines = [{"iteration": 50, "lm_loss": 6.0}, {"iteration": 50, "valid_loss": 5.6}]
    (out / "paper_pp8.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (out / "paper_pp8.done").write_text("{}\n")
    samples = [{"call": c, "direction": "forward", "boundary": b, "rel_error": e, "rms": rms}
               for c, b, e, rms in ((0, 1, 0.9, 9.0), (8, 1, 0.1, 2.0), (10, 1, 0.1, 2.0), (10, 7, 0.08, 12.0))]
    samples.append({"call": 10, "direction": "backward", "boundary": 7, "rel_error": 0.02, "rms": 1e-6})
    (out / "paper_pp8.errors.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    table = boundary_table(build(STUDIES, out, {"cpu": "test", "cores": 2}))
    # call 0 is before the last quarter (calls >= 7.5): left out
    assert "| 1 | 0.100 | 2.00 | 0.200 | – |" in table and "| 7 | 0.080 | 12.00 | 0.960 | 0.020 |" in table
    assert boundary_table({"rows": {}}) == "(`paper_pp8` not run)"
    speedrun = tmp_path / "speedrun.json"
    assert "has not been written" in remedies(speedrun)
    speedrun.write_text(json.dumps({"table": [
        {"codec": "channel9", "seeds": [1, 2, 3], "multiplier": 1.08, "multiplier_low": 1.01, "multiplier_high": 1.14},
        {"codec": "channel_f5", "seeds": [1], "multiplier": 1.22},
        {"codec": "channel", "seeds": [1, 2], "multiplier": None, "missed_within": {"1": 500, "2": 740}}]}))
    text = remedies(speedrun)
    assert "missed within 500/740 steps; 1.22x (one seed); 1.08x [1.01, 1.14] (3 seeds) bf16's steps" in text
    assert "`lowrank` (the message's 16 principal directions apart, the residual at 3 bits): not run" in text
    assert "(`channel3_h4`, `channel4_h4`, `channel5_h4`, `channel_h4`): not run; not run; not run; not run;" in text


def test_the_one_boundary_runs_are_read_against_all_seven():
    from benchmarks.depth.report import position_reading

    def rows(b1, b4, b7, all7):
        return {n: {"gap": g} for n, g in (("paper_fwd_b1", b1), ("paper_fwd_b4", b4), ("paper_fwd_b7", b7),
                                           ("paper_fwd_pp8", all7))}

    text = position_reading(rows(0.01, 0.02, 0.03, 0.30))  # 7 x 0.02 = 0.14 added, 0.30 together
    assert "Seven times the mean one-boundary gap is +0.140, against +0.300" in text and "(2.1x)" in text
    assert "they compound" in text and "after layer 7" in text
    assert "about what their costs added" in position_reading(rows(0.02, 0.02, 0.02, 0.15))
    assert "less together" in position_reading(rows(0.04, 0.05, 0.03, 0.10))
    assert "costs nothing measurable" in position_reading(rows(-0.01, 0.0, 0.005, 0.2))
    assert position_reading({}) == "The one-boundary runs have not run for this page."


def test_a_wider_run_is_measured_against_the_uncompressed_run_of_its_width(tmp_path):
    import json

    from benchmarks.depth.__main__ import STUDIES, command
    from benchmarks.depth.report import build, width_reading

    by_name = {s.name: s for s in STUDIES}
    flags = command(by_name["paper_pp8_h512"], tmp_path, [])
    assert flags[flags.index("--hidden-size") + 1] == "512" and flags[flags.index("--num-attention-heads") + 1] == "4"
    out = tmp_path / "runs"
    out.mkdir()
    for name, final in (("none", 5.40), ("paper_pp8", 5.65), ("none_h256", 5.20), ("paper_pp8_h256", 5.30)):
        lines = [{"iteration": 50, "lm_loss": 6.0}, {"iteration": 25, "valid_loss": 6.5},
                 {"iteration": 50, "valid_loss": final}]
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        (out / f"{name}.done").write_text("{}\n")
    rows = build(STUDIES, out, {"cpu": "test", "cores": 2})["rows"]
    assert rows["paper_pp8"]["gap"] == pytest.approx(0.25) and rows["paper_pp8_h256"]["gap"] == pytest.approx(0.10)
    assert width_reading(rows) == "At PP 8 the gap shrinks with every doubling of the width (one seed each)."
    assert width_reading({}) == "The wider runs have not run for this page."


def test_a_gap_that_holds_across_widths_is_read_as_such():
    from benchmarks.depth.report import width_reading

    rows = {n: {"gap": g} for n, g in (("paper_pp8", 0.22), ("paper_pp8_h256", 0.19), ("paper_pp8_h512", 0.22))}
    assert "stays about the same at every width (+0.190 to +0.220)" in width_reading(rows)
    rows["paper_pp8_h512"]["gap"] = 0.30
    assert "does not move one way with the width" in width_reading(rows)
