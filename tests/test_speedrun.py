"""The CPU speedrun end to end at its tiny size (2 stages, a few iterations), and its link scaling."""

import json

import pytest

from benchmarks.speedrun import __main__ as speedrun
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
    assert runs.codec_flags("fixedpoint4") == ["--tah-forward-codec", "fixedpoint", "--tah-forward-bits", "4",
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

    preset, measured = TahConfig(tah_preset="channel_h4"), TahConfig(**runs.CODECS["channel_h4"])
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


def test_a_codec_that_missed_gets_a_lower_bound_on_its_steps_multiplier():
    from benchmarks.speedrun import report

    size = runs.SIZES["full"]
    bf16 = {"codec": "bf16", "seed": 1, "iters": 500, "validations": [(100, 6.0), (200, 5.6), (400, 5.3), (500, 5.2)]}
    paper = {"codec": "paper", "seed": 1, "iters": 500, "validations": [(250, 5.9), (500, 5.6)]}
    losses = {"b": bf16, "p": paper}
    # paper ended at 5.6, bf16's loss at step 200: its 500 steps did what bf16 did in 200, > 2.5x
    assert report._missed_bound(losses, "paper", {}, {1: 500}, size) == pytest.approx(2.5)
    assert report._missed_bound(losses, "paper", {1: 480}, {1: 500}, size) is None  # it reached the target
    assert speedrun.longer_schedule({"validations": [(500, 5.6)]}, bf16, 500, 10, max_factor=1.0) == 500


def test_a_pages_runs_are_reused_and_only_new_runs_would_run(tmp_path):
    """``--from-page``: each curve of the page's JSON becomes a complete run under ``--out`` (the same
    validations read back), its compute step is returned; a page of another size is refused."""
    from benchmarks.reproduce.runner import ReproduceError, is_complete

    size = runs.SIZES["tiny"]
    curve = [[i, 6.0 - i / 100] for i in range(size.eval_interval, size.iters + 1, size.eval_interval)]
    page = {"size": size.name, "setup": size.setup(), "compute_s_per_step": 1.25,
            "curves": {runs.loss_run_name("bf16", 7, size.iters, size, True):
                       {"codec": "bf16", "seed": 7, "iters": size.iters, "validations": curve}}}
    path = tmp_path / "page.json"
    path.write_text(json.dumps(page))
    out = tmp_path / "out"
    compute, reused = speedrun.restore_from_page(path, out, size)
    assert compute == 1.25 and reused["runs"] == [runs.loss_run_name("bf16", 7, size.iters, size, True)]
    reused = runs.loss_run("bf16", 7, size, [], emulated=True)
    new = runs.loss_run("bf16", 8, size, [], emulated=True)
    assert is_complete(reused, out) and not is_complete(new, out)
    got = speedrun.loss_results([reused], out, size)[reused.name]
    assert [list(v) for v in got["validations"]] == curve and got["codec"] == "bf16"
    # a pipeline run's measured bytes and auto's choices travel with the page (its log keeps only validations)
    auto_name = runs.loss_run_name("auto", 7, size.iters, size)
    page["curves"][auto_name] = {"codec": "auto", "seed": 7, "iters": size.iters, "validations": curve,
                                 "bytes": [640.0, 512.0], "choices": {"forward": {"lowrank": 1.0}}}
    path.write_text(json.dumps(page))
    speedrun.restore_from_page(path, tmp_path / "with_auto", size)
    auto = speedrun.loss_results([runs.loss_run("auto", 7, size, [], link=runs.Link(1e6, 0.01))],
                                 tmp_path / "with_auto", size)[auto_name]
    assert auto["bytes"] == (640.0, 512.0) and auto["choices"] == {"forward": {"lowrank": 1.0}}
    path.write_text(json.dumps({**page, "size": "full", "setup": runs.SIZES["full"].setup()}))
    with pytest.raises(ReproduceError, match="run without --from-page"):
        speedrun.restore_from_page(path, tmp_path / "other", size)


def test_only_the_codecs_asked_for_run_longer_schedules(monkeypatch, tmp_path):
    """``--longer``: a codec that missed the target runs a longer schedule only when named, and bf16 with it;
    the others keep their one schedule (the page shows their lower bound)."""
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
    from benchmarks.speedrun import report

    size = runs.SIZES["full"]
    curve = lambda iters, hit: [(i, 5.0 if i >= hit else 6.0) for i in range(10, iters + 1, 10)]  # noqa: E731
    losses = {f"{c}_{s}_{n}": {"codec": c, "seed": s, "iters": n, "validations": curve(n, hit), "bytes": (1, 1)}
              for c, s, n, hit in (("bf16", 1, 500, 300), ("bf16", 2, 500, 400), ("bf16", 2, 740, 350),
                                   ("channel9", 1, 500, 330), ("channel9", 2, 500, 10_000), ("channel9", 2, 740, 380))}
    steady = {c: {"seconds": 1.0, "steady": True} for c in ("bf16", "channel9")}
    result = report.build(size, 5.5, 1.0, runs.Link(1e6, 0.01), losses, steady, {"cpu": "x", "cores": 2})
    row = next(r for r in result["table"] if r["codec"] == "channel9")
    assert row["multiplier"] == pytest.approx((330 / 300 + 380 / 350) / 2)
    assert row["bf16_schedule_by_seed"] == {"1": 500, "2": 740}
    assert row["T_vs_bf16"] == pytest.approx(row["multiplier"])


def test_seeds_per_codec():
    seeds_for = speedrun.seeds_by_codec([1, 2, 3], "channel9,channel=1+2")
    assert seeds_for("bf16") == [1, 2, 3] and seeds_for("channel9") == [1, 2, 3]
    assert seeds_for("channel") == [1, 2] and seeds_for("paper") == [1]


def test_the_frontier_keeps_the_codecs_no_other_beats_in_both_bits_and_steps():
    from benchmarks.speedrun import report

    def row(codec, bits, mult=None, bound=None, seeds=(1, 2, 3)):
        return {"codec": codec, "seeds": list(seeds), "forward_bits": bits / 2 + 0.5, "backward_bits": bits / 2 + 0.5,
                "multiplier": mult, "multiplier_low": mult and mult - 0.1, "multiplier_high": mult and mult + 0.1,
                "multiplier_at_least": bound}

    table = [row("bf16", 32, 1.0), row("a", 8, 1.09), row("b", 9, 1.2, seeds=(1,)), row("c", 10, 1.05),
             row("d", 6, bound=1.8, seeds=(1,)), row("e", 11, bound=1.5, seeds=(1,))]
    projection = [{"codec": "none" if r["codec"] == "bf16" else r["codec"], "forward_bits": r["forward_bits"] - 0.5,
                   "backward_bits": r["backward_bits"] - 0.5, "T": 1000.0 * (r["multiplier"] or r["multiplier_at_least"])}
                  for r in table]
    result = {"table": table, "projection": projection}
    rows = {r["codec"]: r for r in report.frontier(result)}
    assert [r["codec"] for r in report.frontier(result)] == ["d", "a", "b", "c", "e", "bf16"]  # by bits
    assert rows["a"]["bits"] == pytest.approx(8) and rows["a"]["bits_cpu"] == pytest.approx(9)
    assert rows["a"]["on_frontier"] and rows["c"]["on_frontier"] and rows["bf16"]["on_frontier"]
    assert rows["b"]["on_frontier"] is False  # a: fewer bits, fewer steps
    assert rows["e"]["on_frontier"] is False  # missed at >= 1.5x; a has fewer bits and 1.09x
    assert rows["d"]["on_frontier"] is None  # missed, and nothing with <= 6 bits was measured
    text = report.frontier_markdown(result)
    assert "| b | 9.00 | 10.00 | 1.20x (one seed) | 1 |" in text and "| d | 6.00 | 7.00 | >= 1.80x (missed)" in text
    assert "lowest projected T is `c`" in report._frontier_best(result)
    assert "no codec measured here is in the goal's corner" in report._frontier_best(result)


def test_the_headline_is_the_best_codec_run_on_three_seeds_and_names_lower_ones_on_fewer():
    from benchmarks.speedrun.report import headline_text

    def row(codec, t, seeds, low=0.9, high=1.1):
        return {"codec": codec, "T": t, "T_vs_bf16": t / 100, "seeds": list(range(seeds)), "forward_bits": 6.0,
                "backward_bits": 4.0, "multiplier": 1.0, "multiplier_low": low, "multiplier_high": high}

    table = [row("bf16", 100, 3), row("a", 50, 3), row("b", 40, 1), row("c", 45, 2), row("d", 60, 3)]
    text = headline_text({"table": table})
    assert text.startswith("**Best: `a`, T = 0.500x bf16's** (6.00 + 4.00 bits per value, steps 1.00x [0.90, 1.10]")
    assert text.index("`b`, T = 0.400x") < text.index("`c`, T = 0.450x") and "one seed" in text and "2 seeds" in text
    assert "`d`" not in text
    # no codec with three seeds: the most seeds any has
    assert headline_text({"table": [row("bf16", 100, 2), row("b", 40, 1), row("c", 45, 2)]}).startswith("**Best: `c`")
