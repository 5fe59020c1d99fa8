"""The CPU speedrun end to end at its tiny size (2 stages, a few iterations), and its link scaling."""

import json

import pytest

from benchmarks.speedrun import __main__ as speedrun
from benchmarks.common import codecs
from benchmarks.speedrun import runs, simulate


def test_the_link_makes_bf16_link_bound_by_the_factor_with_the_reference_latency_share():
    size = runs.SIZES["full"]
    nbytes = runs.message_nbytes("bf16", size)[0]
    assert nbytes == 16 + 64 * 1 * 128 * 2  # the none codec: a 16-byte header and the raw bf16 message
    link = speedrun.scale_link(0.9, size, nbytes)
    f, b = simulate.compute_per_micro_batch(0.9, size.stages, size.micro_batches)
    step = simulate.simulate_step(size.stages, size.micro_batches, f, b, nbytes, nbytes, link.rate_bps, link.latency_s)
    assert step == pytest.approx(speedrun.LINK_BOUND * 0.9, rel=1e-6)
    assert 2 * size.micro_batches * link.latency_s == pytest.approx(speedrun.LATENCY_SHARE * step)
    assert link.flags()[-1] == "inbound"


def test_codec_flags_and_bytes_come_from_one_declaration():
    assert codecs.codec_flags("fixedpoint4") == ["--tah-forward-codec", "fixedpoint", "--tah-forward-bits", "4",
                                               "--tah-tile-size", "64", "--tah-backward-codec", "fixedpoint",
                                               "--tah-backward-bits", "6", "--tah-backward-tile-size", "32"]
    size = runs.SIZES["full"]
    fwd, bwd = runs.message_nbytes("fixedpoint4", size)
    values = 64 * 1 * 128
    assert 4.0 < 8 * fwd / values < 5.0 and 6.0 < 8 * bwd / values < 7.5
    with pytest.raises(ValueError, match="measures"):
        runs.message_nbytes("auto", size)


def test_the_channel_h4_preset_is_the_codec_the_speedrun_measured():
    """The preset sends exactly what the speedrun's ``channel_h4`` runs sent (same codecs, same wire), so the
    steps measured under the explicit flags are the preset's."""
    import torch

    from megatron_tah.config import TahConfig

    preset, measured = TahConfig(tah_preset="channel_h4"), TahConfig(**codecs.CODECS["channel_h4"])
    for build in ("forward_codec", "backward_codec"):
        a, b = getattr(preset, build)(), getattr(measured, build)()
        assert a.config() == b.config() and a.name == b.name
        assert a.wire_nbytes((1024, 8, 1024), torch.bfloat16) == b.wire_nbytes((1024, 8, 1024), torch.bfloat16)
    assert preset.forward_codec().config()["outlier_tokens"] == 1


def test_an_emulated_loss_run_is_one_process_with_the_codec_at_every_stage_boundary(tmp_path):
    run = runs.loss_run("paper", 1234, runs.SIZES["full"], [], emulated=True)
    cmd = run.command(tmp_path)
    assert run.pipeline == 1 and run.name == "emulated_paper_s1234"
    assert cmd[1:5] == ["-m", "benchmarks.depth.run", "--boundaries", "1,2,3,4,5,6,7"]
    assert json.loads(cmd[cmd.index("--forward") + 1]) == {"tah_preset": "paper"}
    assert json.loads(cmd[cmd.index("--backward") + 1]) == {"tah_preset": "paper"}
    assert not any(flag.startswith("--tah-preset") for flag in cmd[cmd.index("--"):])
    with pytest.raises(ValueError, match="emulated boundaries"):
        runs.loss_run("auto", 1234, runs.SIZES["full"], [], emulated=True)


def test_auto_runs_the_pipeline_behind_the_link_while_the_others_emulate_their_boundaries(monkeypatch, tmp_path):
    """With emulated loss runs, ``auto``'s loss run is still the real pipeline behind the emulated wire (its
    choice depends on the link); the fixed codecs' runs are one process each, without the link."""
    size, link = runs.SIZES["tiny"], runs.Link(1e6, 0.01)
    started = []
    monkeypatch.setattr(speedrun, "execute_all", lambda todo, *a, **k: started.extend(todo))
    monkeypatch.setattr(speedrun, "loss_results", lambda todo, out, size_: {
        r.name: {**r.info, "validations": [(size.iters, 4.0)], "bytes": (0, 0)} for r in todo})
    speedrun.run_losses(["lowrank", "auto"], lambda c: [1], size, [], tmp_path, 1, link, target=5.0, base={},
                        emulated=True)
    by_codec = {(r.info["codec"], isinstance(r, runs.EmulatedRun)): r for r in started}
    assert set(by_codec) == {("lowrank", True), ("auto", False), ("bf16", False)}  # auto's bf16 twin: a pipeline
    assert set(link.flags()).isdisjoint(by_codec[("bf16", False)].flags)  # the twin runs without the link
    by_codec = {codec: r for (codec, _), r in by_codec.items()}
    assert isinstance(by_codec["lowrank"], runs.EmulatedRun) and by_codec["lowrank"].pipeline == 1
    assert not isinstance(by_codec["auto"], runs.EmulatedRun) and by_codec["auto"].pipeline == size.stages
    assert by_codec["auto"].name == runs.loss_run_name("auto", 1, size.iters, size, False)
    assert set(link.flags()) <= set(by_codec["auto"].flags)
    assert "--tah-emulate-wire" not in by_codec["lowrank"].flags


def test_autos_bytes_are_its_settled_choices_and_its_choices_are_counted_per_direction():
    auto = lambda f, b: {"0->1": {"codec": f}, "1->2": {"codec": f}, "1->0": {"codec": b}, "2->1": {"codec": b}}  # noqa: E731
    records = [{"iteration": i, "fwd_wire_bytes": 1000 if i <= 2 else 300, "bwd_wire_bytes": 1000 if i <= 2 else 200,
                "auto": auto("none", "none") if i <= 2 else auto("lowrank", "hadint4")} for i in range(1, 9)]
    records.insert(4, {"iteration": 4, "valid_loss": 5.0})  # a validation: no bytes, not an iteration
    assert runs.bytes_per_iteration(records, skip=4) == pytest.approx((300, 200))
    assert runs.bytes_per_iteration(records, skip=0) == pytest.approx(((2 * 1000 + 6 * 300) / 8,
                                                                       (2 * 1000 + 6 * 200) / 8))
    choices = runs.auto_choices(records)
    assert {d: list(shares) for d, shares in choices.items()} == {"forward": ["lowrank", "none"],
                                                                  "backward": ["hadint4", "none"]}  # most first
    assert choices["forward"] == pytest.approx({"lowrank": 0.75, "none": 0.25})
    assert choices["backward"] == pytest.approx({"hadint4": 0.75, "none": 0.25})


@pytest.mark.distributed
@pytest.mark.parametrize("modes", [["--loss-runs", "pipeline", "--timing", "measured"],
                                   ["--loss-runs", "emulated", "--timing", "simulated"]], ids=["pipeline", "emulated"])
def test_tiny_speedrun_scores_every_codec_and_writes_its_page(tmp_path, modes):
    page = tmp_path / "docs" / "SPEEDRUN.md"
    codecs = "bf16,fixedpoint4" + (",auto" if "emulated" in modes else "")  # auto: always a pipeline behind the link
    status = speedrun.main(["--size", "tiny", "--out", str(tmp_path / "runs"), "--codecs", codecs,
                            "--seeds", "1234", "--jobs", "1", "--write", str(page), *modes])
    assert status == 0
    result = json.loads((tmp_path / "docs" / "data" / "speedrun.json").read_text())
    rows = {r["codec"]: r for r in result["table"]}
    assert set(rows) == set(codecs.split(","))
    if "auto" in rows:  # it compressed once it measured the link, and the page says with what
        assert rows["auto"]["forward_bits"] < 12 and set(rows["auto"]["choices"]) == {"forward", "backward"}
        # its steps are paired with its bf16 pipeline twin's, bf16's own row stays on the emulated runs
        twin = [c for c in result["curves"].values() if c["codec"] == "bf16" and c.get("pipeline")]
        assert len(twin) == 1 and rows["bf16"]["seeds"] == [1234]
        twin_steps = next(v for v in ([i for i, loss in twin[0]["validations"] if loss <= result["target"]] or [None]))
        if twin_steps and rows["auto"]["steps"]:
            assert rows["auto"]["multiplier"] == pytest.approx(rows["auto"]["steps"] / twin_steps)
        assert rows["auto"]["s_per_step"] < rows["bf16"]["s_per_step"]
        assert "`auto` sent the activations with" in page.read_text()
    bf16, fp4 = rows["bf16"], rows["fixedpoint4"]
    # the baseline reaches its own target by construction (at or before 92% of its schedule)
    assert bf16["steps"] is not None and bf16["steps"] <= 0.92 * runs.SIZES["tiny"].iters
    assert bf16["multiplier"] == pytest.approx(1.0) and bf16["T_vs_bf16"] == pytest.approx(1.0)
    # measured bits: bf16 16 bits + header; fixed point 4-bit forward (tile 64) and 6-bit backward (tile 32)
    assert 16.0 < bf16["forward_bits"] < 16.3 and 16.0 < bf16["backward_bits"] < 16.3
    assert 4.4 < fp4["forward_bits"] < 4.8 and 6.9 < fp4["backward_bits"] < 7.3
    assert bf16["s_per_step"] > 0 and fp4["s_per_step"] > 0
    assert fp4["s_per_step"] < bf16["s_per_step"]  # fewer bytes behind a link-bound wire (simulated or measured)
    curves = {c["codec"]: c["validations"] for c in result["curves"].values()}
    assert curves["fixedpoint4"] != curves["bf16"]  # the codec ran at the stage boundaries
    own = {c["codec"]: c.get("validations_uncompressed") for c in result["curves"].values()}  # the model on its own
    assert [i for i, _ in own["fixedpoint4"]] == [i for i, _ in curves["fixedpoint4"]] and own["bf16"] == curves["bf16"]
    assert own["fixedpoint4"] != curves["fixedpoint4"] and rows["fixedpoint4"]["uncompressed"] is not None
    assert own.get("auto") is None  # auto validates through its codecs only
    text = page.read_text()
    assert "| fixedpoint4 |" in text and f"{result['target']:.3f}" in text
    assert (tmp_path / "docs" / "data" / "speedrun.png").stat().st_size > 1000


def test_a_missed_run_gets_a_schedule_long_enough_for_the_loss_it_reached():
    base = {"validations": [(100, 6.0), (200, 5.6), (300, 5.4), (400, 5.3), (500, 5.25)]}
    # the codec ended at 5.6, where bf16 was at 200 of 500: 2.5x the steps, 15% more, rounded to the interval
    codec = {"validations": [(250, 5.9), (500, 5.6)]}
    assert speedrun.longer_schedule(codec, base, 500, 10) == 1440
    # nearly there: at least 1.25x; far off: at most MAX_FACTOR
    assert speedrun.longer_schedule({"validations": [(500, 5.26)]}, base, 500, 10) == 630
    assert speedrun.longer_schedule({"validations": [(500, 7.0)]}, base, 500, 10) == int(speedrun.MAX_FACTOR * 500)


def _built(codec: str, runs_of_codec) -> tuple[dict, dict]:
    """(losses, ``scoring.build``'s result) of bf16 (seed 1 on 500 steps, seed 2 on 500 and 740) and ``codec``'s
    (seed, iters, the step its loss falls under the target 5.5 at) runs, every s/step 1."""
    from benchmarks.speedrun import scoring

    curve = lambda iters, hit: [(i, 5.0 if i >= hit else 6.0) for i in range(10, iters + 1, 10)]  # noqa: E731
    spec = [("bf16", 1, 500, 300), ("bf16", 2, 500, 400), ("bf16", 2, 740, 350), *((codec, *r) for r in runs_of_codec)]
    losses = {f"{c}_{s}_{n}": {"codec": c, "seed": s, "iters": n, "validations": curve(n, hit), "bytes": (1, 1)}
              for c, s, n, hit in spec}
    steady = {c: {"seconds": 1.0, "steady": True} for c in ("bf16", codec)}
    return losses, scoring.build(runs.SIZES["full"], 5.5, 1.0, runs.Link(1e6, 0.01), losses, steady,
                                {"cpu": "x", "cores": 2})


def test_a_codec_that_misses_through_its_codecs_is_scored_on_its_own_where_it_validated_uncompressed_too():
    """Both evaluations: through the codecs the codec misses; evaluated uncompressed it reaches the target, and its
    multiplier there pairs with bf16's same-seed, same-schedule steps; runs that validated through the codecs
    only say "not measured"."""
    from benchmarks.speedrun import report, scoring

    losses, _ = _built("paper", ((1, 500, 10_000), (2, 500, 10_000)))
    for seed, hit in ((1, 330), (2, 480)):
        losses[f"paper_{seed}_500"]["validations_uncompressed"] = [(i, 5.0 if i >= hit else 6.0)
                                                                   for i in range(10, 501, 10)]
    steady = {c: {"seconds": 1.0, "steady": True} for c in ("bf16", "paper")}
    result = scoring.build(runs.SIZES["full"], 5.5, 1.0, runs.Link(1e6, 0.01), losses, steady, {"cpu": "x", "cores": 2})
    row = next(r for r in result["table"] if r["codec"] == "paper")
    assert row["multiplier"] is None and row["missed_within"] == {"1": 500, "2": 500}
    own = row["uncompressed"]
    assert own["steps_by_seed"] == {"1": 330, "2": 480} and own["missed_within"] == {}
    assert own["multiplier"] == pytest.approx((330 / 300 + 480 / 400) / 2)
    assert report._on_its_own_text(row).startswith(f"{own['multiplier']:.2f}x [")
    assert "validations_uncompressed" in result["curves"]["paper_1_500"]
    page = {"size": "full", "curves": {"emulated_paper_s1": result["curves"]["paper_1_500"]}}
    again = scoring.losses_from_page(page)  # the page's JSON keeps both curves
    assert again["emulated_paper_s1"]["validations_uncompressed"] == losses["paper_1_500"]["validations_uncompressed"]
    del losses["paper_1_500"]["validations_uncompressed"], losses["paper_2_500"]["validations_uncompressed"]
    result = scoring.build(runs.SIZES["full"], 5.5, 1.0, runs.Link(1e6, 0.01), losses, steady, {"cpu": "x", "cores": 2})
    assert report._on_its_own_text(next(r for r in result["table"] if r["codec"] == "paper")) == "not measured"


def test_a_loss_run_of_a_codec_validates_through_its_codecs_and_uncompressed_and_bf16_once():
    size = runs.SIZES["tiny"]
    codec = runs.loss_run("paper", 1, size, [], emulated=True).flags
    assert codec[codec.index("--tah-eval-traffic") + 1] == "both"
    assert "--tah-eval-traffic" not in runs.loss_run("bf16", 1, size, []).flags
    # auto chooses from the link it measures: a second, uncompressed evaluation would change what it measures
    assert "--tah-eval-traffic" not in runs.loss_run("auto", 1, size, [], link=runs.Link(1e6, 0.01)).flags
    records = [{"iteration": 10, "valid_loss": 5.0, "valid_loss_uncompressed": 4.9}, {"iteration": 11, "lm_loss": 5}]
    assert runs.validations(records) == [(10, 5.0)]
    assert runs.validations(records, "valid_loss_uncompressed") == [(10, 4.9)]


def test_a_codec_that_missed_is_missed_within_its_longest_schedule_with_no_multiplier():
    """A codec that misses the target on every schedule it ran: "missed within N steps", no multiplier, no T, not
    projected; its measured lower bound is N over bf16's steps on the same seed and schedule."""
    from benchmarks.speedrun import frontier, report

    losses, result = _built("paper", ((1, 500, 10_000), (2, 500, 10_000), (2, 740, 10_000)))
    row = next(r for r in result["table"] if r["codec"] == "paper")
    assert row["multiplier"] is None and row["T"] is None and row["T_vs_bf16"] is None
    assert row["missed_within"] == {"1": 500, "2": 740} and row["bf16_steps_by_seed"] == {"1": 300, "2": 350}
    assert "multiplier_at_least" not in row and not hasattr(report, "_missed_bound")
    assert frontier.lower_bound(row) == pytest.approx(min(500 / 300, 740 / 350))
    assert report._steps_text(row) == "missed within 500 steps (seed 1) and 740 steps (seed 2)"
    assert report._multiplier_text(row) == "–"
    projected = next(r for r in result["projection"] if r["codec"] == "paper")
    assert projected["T"] is None and projected["steps"] is None
    assert projected["steps_label"] == "missed within 500/740 steps at CPU scale: not projected"
    assert "| paper |" in report.projection_markdown(result) and "– (missed within 500/740 steps" in \
        report.projection_markdown(result)
    today = __import__("datetime").date.today().isoformat()
    assert all(c["measured"] == {"date": today, "cpu": "x"} for c in result["curves"].values())  # new runs: here
    assert report.headline_text(result).startswith("No codec reached the target")
    assert "`paper` (" in report.headline_text(result) and "missed within 500 steps (seed 1)" in \
        report.headline_text(result)
    assert speedrun.longer_schedule({"validations": [(500, 5.6)]}, losses["bf16_1_500"], 500, 10,
                                    max_factor=1.0) == 500


def test_a_pages_runs_are_reused_and_only_new_runs_would_run(tmp_path):
    """``--from-page``: each curve of the page's JSON becomes a complete run under ``--out`` (the same
    validations read back), its compute step is returned; a page of another size is refused."""
    from benchmarks.common.runner import ReproduceError, is_complete

    size = runs.SIZES["tiny"]
    curve = [[i, 6.0 - i / 100] for i in range(size.eval_interval, size.iters + 1, size.eval_interval)]
    page = {"size": size.name, "setup": size.setup(), "compute_s_per_step": 1.25, "date": "2026-01-02",
            "host": {"cpu": "old cpu", "cores": 2},
            "curves": {runs.loss_run_name("bf16", 7, size.iters, size, True):
                       {"codec": "bf16", "seed": 7, "iters": size.iters, "validations": curve}}}
    path = tmp_path / "page.json"
    path.write_text(json.dumps(page))
    out = tmp_path / "out"
    compute, reused_page = speedrun.restore_from_page(path, out, size)
    assert compute == 1.25 and reused_page["runs"] == [runs.loss_run_name("bf16", 7, size.iters, size, True)]
    reused = runs.loss_run("bf16", 7, size, [], emulated=True)
    new = runs.loss_run("bf16", 8, size, [], emulated=True)
    assert is_complete(reused, out) and not is_complete(new, out)
    got = speedrun.loss_results([reused], out, size)[reused.name]
    assert [list(v) for v in got["validations"]] == curve and got["codec"] == "bf16"
    # a page without per-curve provenance: its own date and machine stand for its curves' and its compute step's
    assert reused_page["compute_measured"] == {"date": "2026-01-02", "cpu": "old cpu"} == got["measured"]
    # a pipeline run's measured bytes and auto's choices travel with the page (its log keeps only validations)
    auto_name = runs.loss_run_name("auto", 7, size.iters, size)
    page["curves"][auto_name] = {"codec": "auto", "seed": 7, "iters": size.iters, "validations": curve,
                                 "bytes": [640.0, 512.0], "choices": {"forward": {"lowrank": 1.0}},
                                 "measured": {"date": "2026-01-03", "cpu": "other cpu"}}
    path.write_text(json.dumps(page))
    speedrun.restore_from_page(path, tmp_path / "with_auto", size)
    auto = speedrun.loss_results([runs.loss_run("auto", 7, size, [], link=runs.Link(1e6, 0.01))],
                                 tmp_path / "with_auto", size)[auto_name]
    assert auto["bytes"] == (640.0, 512.0) and auto["choices"] == {"forward": {"lowrank": 1.0}}
    assert auto["measured"] == {"date": "2026-01-03", "cpu": "other cpu"}  # a curve's own provenance is kept
    path.write_text(json.dumps({**page, "size": "full", "setup": runs.SIZES["full"].setup()}))
    with pytest.raises(ReproduceError, match="run without --from-page"):
        speedrun.restore_from_page(path, tmp_path / "other", size)


def test_only_the_codecs_asked_for_run_longer_schedules(monkeypatch, tmp_path):
    """``--longer``: a codec that missed the target runs a longer schedule only when named, and bf16 with it;
    the others keep their one schedule (the page says which codecs it applied to)."""
    size = runs.SIZES["tiny"]
    started = []
    monkeypatch.setattr(speedrun, "execute_all", lambda todo, *a, **k: started.extend(r.name for r in todo))
    curve = [(i, 6.0 - i / 1000) for i in range(size.eval_interval, 4 * size.iters + 1, size.eval_interval)]
    monkeypatch.setattr(speedrun, "loss_results", lambda todo, out, size_: {
        r.name: {**r.info, "validations": [v for v in curve if v[0] <= r.info["iters"]], "bytes": (0, 0)}
        for r in todo})
    base = {runs.loss_run_name("bf16", 1, size.iters, size, True): {"validations": [(size.iters, 5.0)]}}
    speedrun.run_losses(["channel", "channel9"], lambda c: [1], size, [], tmp_path, 1, None, target=5.0, base=base,
                        emulated=True, max_factor=2, longer_for={"channel9"})
    longer = [n for n in started if n.count("_") == 3]  # emulated_<codec>_s<seed>_<iters>
    codec_runs = [n for n in longer if n.startswith("emulated_channel9_s1_")]
    assert codec_runs and not any(n.startswith("emulated_channel_s1_") for n in longer), started
    # bf16 runs every longer schedule too, same seed: steps are compared on the same schedule
    assert {n.replace("channel9", "bf16") for n in codec_runs} <= set(longer), started


def test_a_seed_that_ran_only_a_longer_schedule_is_not_run_again_on_the_base_one(monkeypatch, tmp_path):
    """A codec's seed whose longer schedule ran to completion with its bf16 twin (and whose base schedule never ran)
    stands on that run: nothing new starts, the pair is read."""
    size = runs.SIZES["tiny"]
    longer = 2 * size.iters
    for codec in ("lowrank", "bf16"):
        (tmp_path / f"{runs.loss_run_name(codec, 1, longer, size, True)}.meta.json").write_text('{"status": 0}')
    started = []
    monkeypatch.setattr(speedrun, "execute_all", lambda todo, *a, **k: started.append([r.name for r in todo]))
    monkeypatch.setattr(speedrun, "loss_results", lambda todo, out, size_: {
        r.name: {**r.info, "validations": [(r.info["iters"], 4.0)], "bytes": (0, 0)} for r in todo})
    results = speedrun.run_losses(["lowrank", "paper"], lambda c: [1], size, [], tmp_path, 1, None, target=5.0,
                                  base={}, emulated=True, max_factor=2)
    assert started[0] == [runs.loss_run_name("lowrank", 1, longer, size, True),
                          runs.loss_run_name("bf16", 1, longer, size, True),
                          runs.loss_run_name("paper", 1, size.iters, size, True)]
    assert set(results) == set(started[0]) and len(started) == 1  # all reached the target: no longer schedules


def test_a_longer_schedule_counts_against_bf16_on_the_same_schedule():
    """Seed 2 reached the target only on a 740-step schedule: its steps there are paired with bf16's on 740
    steps (a longer cosine alone reaches a loss sooner), not bf16's on the base schedule."""
    _, result = _built("channel9", ((1, 500, 330), (2, 500, 10_000), (2, 740, 380)))
    row = next(r for r in result["table"] if r["codec"] == "channel9")
    assert row["multiplier"] == pytest.approx((330 / 300 + 380 / 350) / 2)
    assert row["bf16_schedule_by_seed"] == {"1": 500, "2": 740}
    assert row["T_vs_bf16"] == pytest.approx(row["multiplier"])


def test_seeds_per_codec():
    seeds_for = speedrun.seeds_by_codec([1, 2, 3], "channel9,channel=1+2")
    assert seeds_for("bf16") == [1, 2, 3] and seeds_for("channel9") == [1, 2, 3]
    assert seeds_for("channel") == [1, 2] and seeds_for("paper") == [1]


def test_the_frontier_keeps_the_codecs_no_other_beats_in_both_bits_and_steps():
    """Beaten: another codec with at most its bits takes fewer steps beyond noise (the paired interval of their
    same-seed steps ratio below 1); a codec that missed: another's interval below its measured lower bound."""
    from benchmarks.common import score
    from benchmarks.speedrun import frontier

    def row(codec, bits, by_seed=None, missed=None):
        r = {"codec": codec, "seeds": sorted(by_seed or missed), "forward_bits": bits / 2 + 0.5,
             "backward_bits": bits / 2 + 0.5, "multiplier": None}
        if by_seed:
            ratio = score.mean_interval(list(by_seed.values()))
            r.update(multiplier=ratio.mean, multiplier_low=ratio.low, multiplier_high=ratio.high,
                     multiplier_by_seed={str(s): v for s, v in by_seed.items()})
        else:
            r.update(missed_within={str(s): n for s, n in missed.items()},
                     bf16_steps_by_seed={str(s): 300 for s in missed})
        return r

    table = [row("bf16", 32, {1: 1.0, 2: 1.0, 3: 1.0}), row("a", 8, {1: 1.05, 2: 1.10, 3: 1.12}),
             row("b", 9, {1: 1.25, 2: 1.30, 3: 1.35}), row("c", 10, {1: 1.0, 2: 1.1, 3: 1.05}),
             row("d", 6, missed={1: 500}), row("e", 11, missed={1: 450}), row("f", 12, {1: 1.08, 2: 1.0, 3: 1.1})]
    projection = [{"codec": "none" if r["codec"] == "bf16" else r["codec"], "forward_bits": r["forward_bits"] - 0.5,
                   "backward_bits": r["backward_bits"] - 0.5, "s_per_step": 1.0,
                   "T": None if r["multiplier"] is None else 1000.0 * r["multiplier"]} for r in table]
    result = {"table": table, "projection": projection}
    rows = {r["codec"]: r for r in frontier.frontier(result)}
    assert [r["codec"] for r in frontier.frontier(result)] == ["d", "a", "b", "c", "e", "f", "bf16"]  # by bits
    assert rows["a"]["bits"] == pytest.approx(8) and rows["a"]["bits_cpu"] == pytest.approx(9)
    assert rows["a"]["on_frontier"] and rows["c"]["on_frontier"] and rows["bf16"]["on_frontier"]
    assert rows["b"]["on_frontier"] is False and rows["b"]["beaten_by"] == ["a"]  # a / b: about 0.84 on every seed
    assert rows["f"]["on_frontier"] and rows["f"]["close"] == ["c"]  # c: fewer steps on average, within noise
    assert rows["e"]["on_frontier"] is False  # missed within 450 steps, at least 1.5x; a's interval lies below
    assert rows["d"]["on_frontier"] is None and rows["d"]["lower_bound"] == pytest.approx(500 / 300)  # none cheaper
    text = frontier.markdown(result)
    assert "| b | 9.00 | 10.00 | 1.30x [1.18, 1.42] | 3 | 1,300 | no: `a` (fewer bits, fewer steps beyond noise) |" \
        in text
    assert "| d | 6.00 | 7.00 | missed within 500 steps | 1 | – | unknown (missed) |" in text
    assert "| f | 12.00 | 13.00 | 1.06x [0.93, 1.19] | 3 | 1,060 | yes; fewer bits and steps within noise: `c` |" \
        in text
    best = frontier.best_text(result)
    assert "lowest projected T is `c`" in best and "against the next, `f` (1,060 s)" in best
    compared = score.compare({1: 1.0, 2: 1.1, 3: 1.05}, {1: 1.08, 2: 1.0, 3: 1.1})
    assert compared.text() + ";" in best and compared.verdict == "within noise"
    assert "no codec measured here is in the goal's corner" in best


def test_the_headline_compares_the_best_codec_with_the_next_by_the_paired_interval_of_their_T_ratio():
    from benchmarks.common import score
    from benchmarks.speedrun.report import headline_text

    def row(codec, t, by_seed):
        ratio = score.mean_interval(by_seed)
        return {"codec": codec, "T": t, "T_vs_bf16": t / 100, "seeds": list(range(len(by_seed))),
                "forward_bits": 6.0, "backward_bits": 4.0, "s_per_step": t / 100, "multiplier": ratio.mean,
                "multiplier_low": ratio.low, "multiplier_high": ratio.high,
                "multiplier_by_seed": {str(s): v for s, v in enumerate(by_seed)}}

    table = [row("bf16", 100, [1.0, 1.0, 1.0]), row("a", 50, [1.0, 1.1, 0.9]), row("b", 40, [1.0]),
             row("c", 45, [1.0, 1.0]), row("d", 60, [1.0, 1.0, 1.0])]
    text = headline_text({"table": table})
    assert text.startswith("**Best: `a`, T = 0.500x bf16's** (6.00 + 4.00 bits per value, steps 1.00x [0.75, 1.25]")
    # a / d per seed: the steps ratio times the s/step ratio 50 / 60
    a_vs_d = score.compare({0: 1.0, 1: 1.1, 2: 0.9}, {0: 1.0, 1: 1.0, 2: 1.0}, 50 / 60)
    assert a_vs_d.verdict == "within noise"
    assert f"against the next, `d` (T = 0.600x bf16's): T ratio {a_vs_d.text()}." in text
    assert text.index("`b`, T = 0.400x") < text.index("`c`, T = 0.450x") and "one seed" in text and "2 seeds" in text
    assert "against `a`: T ratio 0.80x (one seed)." in text  # b: one common seed, no interval
    assert f"against `a`: T ratio {score.compare({0: 1.0, 1: 1.0}, {0: 1.0, 1: 1.1}, 45 / 50).text()}." in text
    # no codec with three seeds: the most seeds any has; one other: no comparison
    two = headline_text({"table": [row("bf16", 100, [1.0, 1.0]), row("b", 40, [1.0]), row("c", 45, [1.0, 1.0])]})
    assert two.startswith("**Best: `c`") and "against the next" not in two


def test_a_curves_provenance_is_the_first_committed_page_that_measured_it():
    """A curve counts from the first page version holding it, unless that page lists it among its reused runs (then
    the version before's); the compute step from the first version with its value; ``fill`` keeps what is set."""
    from benchmarks.speedrun import provenance, report

    def page(date, cpu, names, compute=1.0, reused=()):
        return {"date": date, "host": {"cpu": cpu}, "compute_s_per_step": compute,
                "curves": {n: {"codec": "bf16"} for n in names}, **({"reused": {"runs": list(reused)}} if reused else {})}

    pages = [page("d1", "A", ["x", "y"]), page("d2", "B", ["x", "y", "z"], reused=["x", "z"]),
             page("d3", "C", ["x", "y", "z", "w"], compute=2.0, reused=["x", "y", "z"])]
    found, compute = provenance.first_measured(pages)
    assert found == {"x": {"date": "d1", "cpu": "A"}, "y": {"date": "d1", "cpu": "A"},
                     "z": {"date": "d1", "cpu": "A"},  # reused on its first page: the page before's
                     "w": {"date": "d3", "cpu": "C"}}
    assert compute == {"date": "d3", "cpu": "C"}  # the compute step changed on d3
    assert provenance.first_measured(pages[:2])[1] == {"date": "d1", "cpu": "A"}
    data = page("d4", "D", ["x", "w", "v"])
    data["curves"]["w"]["measured"] = {"date": "d0", "cpu": "Z"}
    assert provenance.fill(data, pages) == ["v"]  # not in the history: left without
    assert data["curves"]["x"]["measured"] == {"date": "d1", "cpu": "A"} and data["compute_measured"] == compute
    assert data["curves"]["w"]["measured"] == {"date": "d0", "cpu": "Z"}
    data["curves"]["v"]["measured"] = {"date": "d4", "cpu": "D"}
    assert report.provenance_text(data) == ("Loss runs measured 1 on d0 (Z), 1 on d1 (A), 1 on d4 (D); the compute "
                                            "step, which sets the wire and every s/step, on d3 (C).")


def test_the_parameter_count_is_megatrons(tmp_path):
    """``Size.parameters``: by hand for the full size (untied, vocabulary 8192, 8 layers of 12 h^2 + 13 h), and what
    megatron-core's GPTModel with the local spec holds at the tiny size."""
    import torch
    import torch.distributed as dist

    h, full = 128, runs.SIZES["full"]
    assert full.parameters() == 2 * 8192 * h + 64 * h + 8 * (12 * h * h + 13 * h) + 2 * h == 3_691_776
    tiny = runs.SIZES["tiny"]
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_tah.megatron.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(1, force_reset_rng=True)
        config = TransformerConfig(num_layers=tiny.stages, hidden_size=tiny.hidden, num_attention_heads=tiny.heads,
                                   use_cpu_initialization=True, params_dtype=torch.float32)
        model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=runs.VOCAB, max_sequence_length=tiny.seq,
                         share_embeddings_and_output_weights=False)
        assert sum(p.numel() for p in model.parameters()) == tiny.parameters()
    finally:
        parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()
