"""auto at pipeline depth: a codec's measured steps penalty counts against its byte savings."""

import json
import math
from pathlib import Path

import pytest

from megatron_tah.config import AutoSettings
from megatron_tah.config import auto as auto_config
from megatron_tah.link.choice import Chooser
from megatron_tah.link.measure import CandidateCost, CodecCostTable

ROOT = Path(__file__).resolve().parents[2]


def _costs():
    # wire bytes of a [64, 1, 128] message: none (bf16), paper's forward (4.4 bits), fixed point 4-bit (4.5)
    return [CandidateCost("none", 0, 0, 0.0, 0.0, 16400, 0.0), CandidateCost("paper", 1, 1, 0.0, 0.0, 4550, 0.05),
            CandidateCost("fixedpoint4", 2, 2, 0.0, 0.0, 4620, 0.04)]


def test_steps_multiplier_rows_by_depth(monkeypatch):
    monkeypatch.setattr(auto_config, "STEPS_MULTIPLIER", {8: {"paper": 2.6, "fixedpoint4": 1.05}})
    m = auto_config.steps_multiplier
    assert m("paper", 8) == 2.6 and m("paper", 16) == 2.6  # deeper: the deepest measured row below
    assert m("paper", 4) == 1.0 and m("none", 8) == 1.0 and m("paper", 8, "backward") == 1.0
    assert m("hadint4", 8) == 2.6  # unmeasured at a measured depth: the row's largest, not free


def test_a_measured_direction_share_splits_the_multiplier_between_the_directions(monkeypatch):
    monkeypatch.setattr(auto_config, "STEPS_MULTIPLIER", {4: {"paper": 1.5}, 8: {"paper": 2.0, "lowrank": 1.2}})
    monkeypatch.setattr(auto_config, "DIRECTION_SHARES", {8: {"paper": 0.75}})
    m = auto_config.steps_multiplier
    assert m("paper", 8) == pytest.approx(2.0 ** 0.75) and m("paper", 8, "backward") == pytest.approx(2.0 ** 0.25)
    assert m("paper", 8) * m("paper", 8, "backward") == pytest.approx(2.0)  # the two charges make the whole
    assert m("lowrank", 8) == 1.2 and m("lowrank", 8, "backward") == 1.0  # no share measured: forward carries it
    assert m("paper", 4) == 1.5 and m("paper", 4, "backward") == 1.0  # shares measured deeper only: not applied
    assert m("paper", 16) == pytest.approx(2.0 ** 0.75)  # deeper: the deepest measured share below
    settings = AutoSettings(candidates=("none", "paper", "fixedpoint4"), max_error=1.0, patience=1)
    backward = Chooser(CodecCostTable.from_costs(_costs()), settings, current="none", depth=8, direction="backward")
    # paper's gradients now carry their share (2 ** 0.25 x 4550 bytes), more than fixedpoint4's 4620 with no share
    assert backward.update(1e6) == "fixedpoint4"
    assert backward.predicted["paper"] / backward.predicted["fixedpoint4"] == pytest.approx(2.0 ** 0.25 * 4550 / 4620,
                                                                                          rel=0.01)


@pytest.mark.parametrize("depth, expected", [(2, "paper"), (8, "fixedpoint4")])
def test_auto_leaves_a_codec_whose_steps_penalty_makes_it_slower_to_target(monkeypatch, depth, expected):
    # paper sends the fewest bytes, so at a depth with no penalty it wins; at depth 8 its 2.6x steps make
    # 2.6 x 4550 bytes' time worse than fixedpoint4's 1.05 x 4620 (and than none's 16400 x 1.0)
    monkeypatch.setattr(auto_config, "STEPS_MULTIPLIER", {8: {"paper": 2.6, "fixedpoint4": 1.05}})
    settings = AutoSettings(candidates=("none", "paper", "fixedpoint4"), max_error=1.0, patience=1)
    chooser = Chooser(CodecCostTable.from_costs(_costs()), settings, current="none", depth=depth)
    assert chooser.update(1e6) == expected
    backward = Chooser(CodecCostTable.from_costs(_costs()), settings, current="none", depth=depth,
                       direction="backward")
    assert backward.update(1e6) == "paper"  # gradients: no steps penalty charged


def test_a_candidate_measured_at_the_depth_is_judged_by_its_steps_not_the_default_error_floor(monkeypatch):
    # lowrank's round-trip error is above paper's (the default floor) but its steps at depth 8 were measured
    # (1.09x) and beat fixedpoint4's (2.0x at fewer bytes): it passes the floor there, and wins
    monkeypatch.setattr(auto_config, "STEPS_MULTIPLIER", {8: {"paper": 2.6, "fixedpoint4": 2.0, "lowrank": 1.09}})
    costs = _costs() + [CandidateCost("lowrank", 3, 3, 0.0, 0.0, 6400, 0.08), CandidateCost("hadint4", 4, 4, 0.0, 0.0,
                                                                                           4400, 0.07)]
    settings = AutoSettings(candidates=("none", "paper", "fixedpoint4", "lowrank", "hadint4"), patience=1)
    deep = Chooser(CodecCostTable.from_costs(costs), settings, current="none", depth=8)
    assert deep.update(1e6) == "lowrank" and "hadint4" not in deep.predicted  # hadint4: not measured, over the floor
    assert auto_config.steps_measured("lowrank", 8) and auto_config.steps_measured("lowrank", 16)
    assert not auto_config.steps_measured("lowrank", 4) and not auto_config.steps_measured("hadint4", 8)
    # at depth 2 nothing is measured: the floor holds, and the fewest bytes within it win
    shallow = Chooser(CodecCostTable.from_costs(costs), settings, current="none", depth=2)
    assert shallow.update(1e6) == "paper" and set(shallow.predicted) == {"none", "paper", "fixedpoint4"}
    # gradients at depth 8: no penalty charged, the measured candidates pass the floor, the fewest bytes win
    backward = Chooser(CodecCostTable.from_costs(costs), settings, current="none", depth=8, direction="backward")
    assert backward.update(1e6) == "paper"
    # an explicit floor binds every candidate, measured or not
    strict = Chooser(CodecCostTable.from_costs(costs), AutoSettings(candidates=settings.candidates, max_error=0.05,
                                                                   patience=1), current="none", depth=8)
    assert strict.update(1e6) == "fixedpoint4" and "lowrank" not in strict.predicted


def test_a_lower_bound_waives_nothing_but_a_measured_alias_does(monkeypatch):
    """Gradients at depth 8: ``channel6``'s 2-bit gradients (a codec that missed the target: its multiplier is a
    lower bound) are held to the floor, so they are not sent for free; ``hadint4``'s 4-bit gradients, a lower bound
    under their own name, are ``lowrank``'s too (left out as the same codec), whose steps were measured."""
    monkeypatch.setattr(auto_config, "STEPS_MULTIPLIER", {8: {"paper": 2.5, "channel6": 1.79, "hadint4": 2.27,
                                                              "lowrank": 1.09}})
    monkeypatch.setattr(auto_config, "STEPS_AT_LEAST", {8: frozenset({"paper", "channel6", "hadint4"})})
    assert auto_config.steps_measured("lowrank", 8) and not auto_config.steps_measured("channel6", 8)
    costs = _costs() + [CandidateCost("hadint4", 4, 4, 0.0, 0.0, 4400, 0.07),
                        CandidateCost("channel6", 5, 5, 0.0, 0.0, 2200, 0.30)]
    settings = AutoSettings(candidates=("none", "paper", "fixedpoint4", "hadint4", "lowrank", "channel6"), patience=1)

    def backward(aliases):
        table = CodecCostTable.from_costs(costs)
        table.aliases = aliases
        chooser = Chooser(table, settings, current="none", depth=8, direction="backward")
        return chooser.update(1e6), set(chooser.predicted)

    chosen, allowed = backward({"lowrank": "hadint4"})
    assert chosen == "hadint4" and "channel6" not in allowed  # fewest bytes among those allowed
    chosen, allowed = backward({})  # without lowrank's measurement behind it, hadint4 is over the floor too
    assert chosen == "paper" and allowed == {"none", "paper", "fixedpoint4"}


def _real_model() -> dict:
    return json.loads((ROOT / "docs" / "data" / "real_model.json").read_text())


def _tables(result: dict) -> dict[int, list[dict]]:
    return {int(d): rows for d, rows in {str(result["depth"]): result["table"], **result["depths"]}.items()}


def test_the_lower_bounds_are_the_committed_misses():
    """``STEPS_AT_LEAST`` at each depth names exactly the real model's candidates that missed the target there
    (evaluated uncompressed)."""
    for depth, rows in _tables(_real_model()).items():
        missed = {r["codec"] for r in rows if r["uncompressed"]["multiplier"] is None}
        assert auto_config.STEPS_AT_LEAST[depth] == missed & set(auto_config.STEPS_MULTIPLIER[depth]), depth


def test_the_transports_auto_links_know_the_pipelines_depth():
    from megatron_tah.config import TahConfig
    from megatron_tah.link.transport import PipelineTransport
    from megatron_tah.megatron.places import STREAMS
    from megatron_tah.megatron.stats import Stats

    config = TahConfig(tah_forward_codec="auto", tah_backward_codec="auto")
    transport = PipelineTransport(config, Stats(STREAMS), depth=lambda: 8)
    assert transport.link("forward", "send", 1).auto.depth == 8
    assert PipelineTransport(config, Stats(STREAMS)).link("backward", "send", 1).auto.depth == 1


def test_the_table_is_the_measured_multipliers():
    """Each entry is a committed measurement of the real-model study (docs/data/real_model.json) at its depth: the
    steps multiplier of the model evaluated uncompressed, or for a codec that missed the target its run's steps over
    bf16's steps to target on the same seed, the smallest over the seeds that missed."""
    for depth, rows in _tables(_real_model()).items():
        by_codec = {r["codec"]: r for r in rows}
        base = by_codec["bf16"]["uncompressed"]["steps_by_seed"]
        for candidate, multiplier in auto_config.STEPS_MULTIPLIER[depth].items():
            m = by_codec[candidate]["uncompressed"]
            expected = m["multiplier"] or min(m["missed_within"] / base[s] for s, v in m["steps_by_seed"].items()
                                              if v is None)
            assert expected == pytest.approx(multiplier, abs=0.005), (depth, candidate)


def test_the_shipped_measurements_are_the_pages_and_say_where_they_come_from():
    """The package data auto reads is what ``benchmarks/real_model/measured.py`` derives from the committed real-model page's
    JSON, with its date and host: a row per depth the study ran, each with every auto candidate it ran there."""
    from megatron_tah.config import CANDIDATES

    from benchmarks.real_model import measured

    shipped = json.loads((ROOT / measured.MEASURED).read_text())["steps_multiplier"]
    result = _real_model()
    expected = measured.real_model_rows(result)
    assert sorted(map(int, shipped)) == sorted(expected) == sorted(_tables(result))
    for depth, row in expected.items():
        got = shipped[str(depth)]
        assert {k: got[k] for k in ("multipliers", "at_least", "page", "date", "host")} == \
            {k: row[k] for k in ("multipliers", "at_least", "page", "date", "host")}, depth
        assert got["command"].startswith("python -m benchmarks.real_model")
        ran = {r["codec"] for r in _tables(result)[depth]}
        assert set(got["multipliers"]) == ran & set(CANDIDATES) and got["date"] == result["date"]
    assert auto_config.MEASURED["steps_multiplier"] == shipped  # what the product reads (the installed package's)


def test_a_study_writes_its_row_beside_its_page_and_keeps_the_others(tmp_path):
    """The real-model study's ``--write`` puts its rows into the checkout's measured file (rows of depths it did not
    run kept), and leaves the file alone for a page outside a checkout's docs/ (a trial run's)."""
    from benchmarks.real_model import measured

    checkout = tmp_path / "checkout"
    (checkout / measured.MEASURED).parent.mkdir(parents=True)
    before = {"16": {"multipliers": {"paper": 9.0}, "at_least": [], "page": "x", "command": "y", "date": "z",
                     "host": {}}}
    (checkout / measured.MEASURED).write_text(json.dumps({"steps_multiplier": before}))
    result = _real_model()
    result["table"] = [{**r, "uncompressed": {**r["uncompressed"], "multiplier": 1.5}} if r["codec"] == "paper" else r
                       for r in result["table"]]
    rows = measured.real_model_rows(result, "python -m benchmarks.real_model --codecs bf16,paper --write x")
    assert measured.write_beside(tmp_path / "trial" / "REAL_MODEL.md", rows) is None
    written = measured.write_beside(checkout / "docs" / "REAL_MODEL.md", rows)
    after = json.loads(written.read_text())["steps_multiplier"]
    assert after[str(result["depth"])]["multipliers"]["paper"] == 1.5
    assert after[str(result["depth"])]["command"] == "python -m benchmarks.real_model --codecs bf16,paper --write x"
    assert after["16"] == before["16"] and list(after) == sorted(after, key=int)


def test_the_whole_runs_one_direction_runs_give_each_direction_its_share_and_the_file_keeps_the_rest(tmp_path):
    from benchmarks.real_model import measured

    def row(codec, end):
        return {"codec": codec, "uncompressed": {"points": {"50": {"ratio": 1.5}, "200": {"ratio": end}}}}

    result = {"date": "2026-12-07", "tables": {"8": [row("bf16", 1.0), row("lowrank_h3_rn", 1.3),
                                                     row("lowrank_h3_rn_fwd", 1.2), row("lowrank_h3_rn_bwd", 1.1),
                                                     row("paper_fwd", 1.2)],  # paper's other direction did not run
                                               "4": [row("lowrank_h3_rn_fwd", 0.98), row("lowrank_h3_rn_bwd", 0.99)]}}
    shares = measured.direction_shares(result)
    assert list(shares) == [8]  # at depth 4 neither direction cost steps: nothing to split
    expected = math.log(1.2) / (math.log(1.2) + math.log(1.1))  # the end of the run, not step 50
    assert shares[8]["shares"] == {"lowrank_h3_rn": round(expected, 3)} and shares[8]["ratios"] == {
        "lowrank_h3_rn": [1.2, 1.1]}
    path = tmp_path / "measured.json"
    path.write_text(json.dumps({"steps_multiplier": {"8": {"multipliers": {"paper": 1.1}}}}))
    measured.write_shares(path, shares)
    data = json.loads(path.read_text())
    assert data["steps_multiplier"] == {"8": {"multipliers": {"paper": 1.1}}}  # the rest kept
    assert data["direction_shares"]["8"]["shares"] == {"lowrank_h3_rn": round(expected, 3)}
    measured.write_row(8, {"multipliers": {"paper": 1.2}}, path)  # the real-model study's rows keep the shares
    assert json.loads(path.read_text())["direction_shares"] == data["direction_shares"]
