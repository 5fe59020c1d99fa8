"""The parity study (part ``parity``): which runs, and what the report computes from their logs."""

import json
import math
import statistics
from pathlib import Path

import pytest

from benchmarks.common import stats
from benchmarks.reproduce import convergence, parity, parity_report, report


def _flag(flags, name):
    return flags[flags.index(name) + 1]


def test_runs_cover_widths_seeds_candidates_seed_by_seed(tmp_path):
    runs = parity.parity_runs(tmp_path, "tiny")  # tiny's own width is 64: every width gets WIDE_CANDIDATES
    assert len(runs) == len(parity.WIDTHS) * len(parity.SEEDS) * len(parity.WIDE_CANDIDATES)
    assert len({r.name for r in runs}) == len(runs)
    seeds = [r.info["seed"] for r in runs]
    assert seeds == sorted(seeds)  # a part stopped early still has complete seeds
    for r in runs:
        assert _flag(r.flags, "--hidden-size") == str(r.info["hidden"]) and r.name.startswith(f"w{r.info['hidden']}_")
        assert "--save" not in r.flags and _flag(r.flags, "--train-iters") == str(
            convergence.SIZES["tiny"]["pretrain_iters"])
        assert ("--seed" in r.flags) == (r.info["seed"] != convergence.DEFAULT_SEED)
    by_name = {r.name: r for r in runs}
    sr = by_name["w256_tah_bwd4sr_s1235"].flags
    assert _flag(sr, "--tah-backward-codec") == "hadint" and "--tah-backward-stochastic-rounding" in sr


def test_runs_at_the_size_width_are_the_convergence_and_seed_runs(tmp_path):
    """At hidden 128 (the full size's own width) the study reuses the convergence/seeds parts' runs:
    same names and the same flags, so they are never run twice."""
    runs = {r.name: r for r in parity.parity_runs(tmp_path, "full")}
    assert len(runs) == len(parity.SEEDS) * (len(parity.CANDIDATES) + len(parity.WIDE_CANDIDATES))
    assert "tah_warmup20_s1236" in runs and "w256_tah_warmup20_s1236" not in runs
    assert _flag(runs["tah_warmup20"].flags, "--tah-warmup-iters") == "20"
    for seed in parity.SEEDS:
        own = {r.name: r for r in convergence.pretrain_runs(tmp_path, "full", codecs=("none", "tah"), seed=seed)}
        for name, run in own.items():
            assert runs[name].flags == run.flags
    assert "--save" in runs["none"].flags and "--save" not in runs["w256_none"].flags
    assert _flag(runs["w256_tah_s1236"].flags, "--hidden-size") == "256"


def test_parity_seeds_part_adds_seeds_for_the_headline_candidates(tmp_path):
    """Part ``parity-seeds``: the headline candidates at every width with seeds the parity part does not
    run, seed by seed, with the same flags as the parity part's run of the same codec and width."""
    runs = parity.more_seed_runs(tmp_path, "full")
    assert len(runs) == len(parity.MORE_SEEDS) * len(parity.WIDTHS) * len(parity.HEADLINE)
    assert not set(parity.MORE_SEEDS) & set(parity.SEEDS) and set(parity.HEADLINE) <= set(parity.WIDE_CANDIDATES)
    seeds = [r.info["seed"] for r in runs]
    assert seeds == sorted(seeds)
    names = {r.name for r in runs}
    assert "hadint4_bwd4sr_s1237" in names and "w256_tah_s1239" in names
    assert not names & {r.name for r in parity.parity_runs(tmp_path, "full")}
    base = {r.name: r.flags for r in parity.parity_runs(tmp_path, "full")}
    for r in runs:
        assert _flag(r.flags, "--seed") == str(r.info["seed"])
        twin = base[parity.run_name("full", r.info["codec"], parity.SEEDS[1], r.info["hidden"])]
        assert [f for f in r.flags if f != str(r.info["seed"])] == [f for f in twin if f != str(parity.SEEDS[1])]


def _records(late: float, fwd_wire=425, bwd_wire=425, errors=None, iters=8):
    """The lines of a ``--tah-log-json`` file: an evaluation every 2 iterations (9.0 before the last
    quarter, ``late`` in it), then the final evaluation (``0.99 * late``), which ``read_records`` keeps
    in place of the periodic one of the same iteration."""
    recs = []
    for i in range(1, iters + 1):
        rec = {"iteration": i, "lm_loss": 5.0, "ms": 10.0, "fwd_raw_bytes": 3200, "fwd_wire_bytes": fwd_wire,
               "bwd_raw_bytes": 3200, "bwd_wire_bytes": bwd_wire,
               "tah": {"forward": {"rel_error": 0.1, "rotated_fraction": 0.5 if i <= iters / 4 else 0.0}},
               "link_rel_error": (errors or {}).get(i, {})}
        recs.append(rec)
        if i % 2 == 0:
            valid = 9.0 if i < 0.75 * iters else late
            recs.append({"iteration": i, "valid_loss": valid, "valid_ppl": math.exp(valid)})
    recs.append({"iteration": iters, "valid_loss": 0.99 * late, "valid_ppl": math.exp(0.99 * late)})
    return recs


def _write(folder: Path, codec: str, seed: int, hidden: int, records, size="full", protocol="gpt2"):
    """A completed run's log and meta file, as the runner writes them for the study's run of ``codec``,
    ``seed``, ``hidden`` and ``protocol``; returns its name."""
    folder.mkdir(parents=True, exist_ok=True)
    name = parity.run_name(size, codec, seed, hidden, protocol)
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    info = {"phase": "pretrain", "codec": codec, "seed": seed, "hidden": hidden,
            **({} if protocol == "gpt2" else {"protocol": protocol})}
    (folder / f"{name}.meta.json").write_text(json.dumps({"name": name, "status": 0, "seconds": 60.0, "info": info,
                                                          "started": "2026-11-23T20:00:00Z",
                                                          "host": {"cpu": "test CPU", "cores": 2}}))
    return name


def test_late_loss_bits_and_errors_per_boundary(tmp_path):
    from megatron_tah.megatron.run_log import read_records  # evaluations merged as the runner reads them

    name = _write(tmp_path, "tah", 1234, 128,
                  _records(4.0, errors={1: {"0->1": 0.2, "1->0": 0.05}, 3: {"0->1": 0.4}, 7: {"0->1": 0.1}}))
    records = read_records(tmp_path / f"{name}.jsonl")
    assert parity.late_valid_loss(records) == pytest.approx((4.0 + 3.96) / 2)  # iteration 6, and 8's final one
    assert parity._bits(records, "fwd") == pytest.approx(4.25)
    assert parity.link_errors(records) == {"0->1": (pytest.approx(0.3), pytest.approx(0.1)), "1->0": (0.05, None)}
    assert parity._rotated(records, True) == 0.5 and parity._rotated(records, False) == 0.0


def _study(root: Path, losses: dict):
    """``losses[(hidden, codec)]``: late losses per seed of :data:`parity.SEEDS`."""
    for (hidden, codec), values in losses.items():
        for seed, late in zip(parity.SEEDS, values):
            wire = {"none": 3200, "tah_warmup20": 800}.get(codec, 425)
            _write(root / "convergence", codec, seed, hidden,
                   _records(late, fwd_wire=wire, bwd_wire=wire if codec != "tah" else 700,
                            errors={2: {"0->1": 0.07, "1->0": 0.03}}))


def test_gaps_intervals_and_verdicts(tmp_path):
    base = [4.00, 4.10, 3.90]
    _study(tmp_path, {(128, "none"): base, (256, "none"): base,
                      # +0.1% everywhere: met at both widths
                      (128, "hadint4"): [b * 1.001 for b in base], (256, "hadint4"): [b * 1.001 for b in base],
                      # +3% at 256: not met; at 128 spread -1%..+2%: unresolved
                      (128, "tah"): [base[0] * 0.99, base[1] * 1.02, base[2] * 1.005],
                      (256, "tah"): [b * 1.03 for b in base],
                      # one width only: unresolved
                      (128, "tah_bwd4sr"): [b * 1.001 for b in base],
                      # more than 4.5 bits forward: not met, whatever the loss (one seed)
                      (128, "tah_warmup20"): [base[0]]})
    table = parity.collect(tmp_path / "convergence", "full")
    assert parity_report.gaps(table, 256, "tah") == [pytest.approx(0.03)] * 3
    assert parity_report.verdicts(table) == {"tah": "not met", "hadint4": "met", "tah_bwd4sr": "unresolved",
                                      "tah_warmup20": "not met"}  # diagnostic and absent runs get no verdict
    md = "\n".join(parity_report.section(tmp_path / "convergence", "full"))
    assert "| Hadamard INT4 fwd (tile 64, 4.25 bits), 6-bit bwd | 4.25 | 4.25 | 3 | +0.10% | +0.10% to +0.10% | 2 |" in md
    assert "| TAH-Quant (4/3-bit fwd, 6-bit bwd) | 4.25 | 7.00 | 3 | +3.00% |" in md
    assert "0->1: 0.070/n/a | 1->0: 0.030/n/a |" in md
    # Every run has the same error, so no correlation can be computed.
    assert parity_report.error_gap_correlation(table, 256) == (None, 6) and "Pearson" not in md
    rows = table[256]["tah"]
    for seed, error in zip(parity.SEEDS, (0.1, 0.2, 0.3)):
        rows[seed]["links"] = {"0->1": (error, None)}
    rows[parity.SEEDS[0]]["late"] *= 0.99  # gaps now +1.97%, +3%, +3% against errors 0.1, 0.2, 0.3
    r, n = parity_report.error_gap_correlation(table, 256)
    assert n == 6 and 0 < r < 1
    assert "50.000% of tiles rotated in the first quarter of training, 0.000% in the last quarter" in md
    assert "| Hadamard INT4 fwd (tile 64, 4.25 bits), 6-bit bwd | met | met | met |" in md
    assert "| TAH-Quant (4/3-bit fwd, 6-bit bwd) | unresolved | not met | not met |" in md
    assert [parity_report.width_verdict(table, h, "tah_bwd4sr") for h in parity.WIDTHS] == ["met", "not run"]
    assert "| TAH-Quant fwd, uncompressed bwd (diagnostic) |" not in md.split("### Verdict")[1]
    # Against the default: hadint4 (4.25 + 4.25 bits) vs tah (4.25 + 7 bits), losses 1.001 / 1.03 at 256.
    assert ("| Hadamard INT4 fwd (tile 64, 4.25 bits), 6-bit bwd | 256 | 3 | 8.50 | 1.32x | -2.82% | "
            "-2.82% to -2.82% |") in md.split("### Against the default")[1]
    # The added-gap table: TAH-Quant + stochastic 4-bit backward vs TAH-Quant at 128.
    assert ("| Hadamard INT4 with stochastic rounding (4.25 bits) vs 6-bit fixed point, TAH-Quant forward | 128 | 3 | "
            in md)


def test_report_has_the_section_or_says_how_to_run_it(tmp_path):
    md = report.write(tmp_path, tmp_path / "docs", size="tiny").read_text()
    assert "## 4. Convergence parity study\n" in md and "Not run yet (`bash scripts/reproduce.sh parity`)" in md


def test_more_seeds_enter_the_intervals_and_the_plot(tmp_path):
    """A run of the parity-seeds part counts as one more paired seed in the same table and plot."""
    base = [4.00, 4.10, 3.90]
    _study(tmp_path, {(256, "none"): base, (256, "tah"): [base[0] * 1.01, base[1] * 1.02, base[2] * 1.03]})
    extra = parity.MORE_SEEDS[0]
    _write(tmp_path / "convergence", "none", extra, 256, _records(4.0))
    _write(tmp_path / "convergence", "tah", extra, 256, _records(4.0 * 1.04))
    table = parity.collect(tmp_path / "convergence", "full")
    assert sorted(parity_report.gaps(table, 256, "tah")) == [pytest.approx(g) for g in (0.01, 0.02, 0.03, 0.04)]
    docs = tmp_path / "docs"
    docs.mkdir()
    md = "\n".join(parity_report.section(tmp_path / "convergence", "full", docs))
    assert "| 4 | +2.50% |" in md
    assert "![same-seed gaps per candidate and width](data/parity_gaps.png)" in md
    assert (docs / "data" / "parity_gaps.png").read_bytes()[:4] == b"\x89PNG"
    # Without two seeds of a compressed candidate there is nothing to plot.
    single = tmp_path / "single"
    _write(single / "convergence", "none", extra, 256, _records(4.0))
    _write(single / "convergence", "tah", extra, 256, _records(4.1))
    assert "parity_gaps.png" not in "\n".join(parity_report.section(single / "convergence", "full", docs))


def test_t_quantiles_intervals_and_seeds_needed():
    # Tabulated points, and the expansion beyond the table against known quantiles (31, 60, 120, 1000 df).
    assert stats.t975(1) == 12.706 and stats.t975(30) == 2.042
    for df, exact in ((31, 2.0395), (60, 2.0003), (120, 1.9799), (1000, 1.9623)):
        assert stats.t975(df) == pytest.approx(exact, abs=1e-3)
    with pytest.raises(ValueError):
        stats.t975(0)
    assert stats.interval95([0.01]) is None
    lo, hi = stats.interval95([0.01, 0.03])  # mean 0.02, sd 0.01414: half width 12.706 * 0.01
    assert (lo, hi) == (pytest.approx(0.02 - 0.12706), pytest.approx(0.02 + 0.12706))
    values = [0.01 * (i % 3) for i in range(12)]  # 12 values: beyond the old 10-value table
    assert stats.interval95(values) is not None
    # Spread 0.01 (sd of 0, 0.01, 0.02): n with t(n-1) * 0.01 / sqrt(n) <= 0.005 is 18 (t(17) = 2.110).
    n = convergence.seeds_needed([0.0, 0.01, 0.02], 0.005)
    assert n == 18 and stats.t975(n - 2) * 0.01 / (n - 1) ** 0.5 > 0.005
    assert convergence.seeds_needed([0.01], 0.005) is None and convergence.seeds_needed([0.01, 0.01], 0.005) == 2
    assert convergence.seeds_needed([0.0, 1.0], 1e-6) == 1000


def test_late_training_loss_and_where_the_spread_comes_from(tmp_path):
    records = [{"iteration": i, "lm_loss": float(i)} for i in range(1, 9)] + [{"iteration": 8, "valid_loss": 1.0}]
    assert parity.late_train_loss(records) == pytest.approx((7 + 8) / 2)  # iterations after 6 of 8
    with pytest.raises(ValueError):
        parity.late_train_loss([{"iteration": 8, "valid_loss": 1.0}])
    # Training gaps 2x the validation gaps, seed by seed: r = +1, and twice the spread.
    table = {256: {"none": {}, "tah": {}}}
    for seed, gap in zip(parity.SEEDS, (0.01, 0.02, 0.04)):
        table[256]["none"][seed] = {"late": 4.0, "late_train": 5.0}
        table[256]["tah"][seed] = {"late": 4.0 * (1 + gap), "late_train": 5.0 * (1 + 2 * gap)}
    r, n, train_sd, valid_sd = parity_report.train_valid_spread(table, 256)
    assert n == 3 and r == pytest.approx(1.0) and train_sd == pytest.approx(2 * valid_sd)
    assert valid_sd == pytest.approx(statistics.stdev([0.01, 0.02, 0.04]))
    assert parity_report.train_valid_spread(table, 128) == (None, 0, None, None)


def test_evaluation_share_of_the_gap(tmp_path):
    """tah_evalboth logs each evaluation through the codec and uncompressed (same batches): the table
    splits its gap into the two."""
    base = [4.00, 4.10, 3.90]
    _study(tmp_path, {(128, "none"): base, (128, "tah_evalboth"): [b * 1.03 for b in base]})
    for seed, b, extra in zip(parity.SEEDS, base, (0.01, 0.02, 0.03)):
        path = tmp_path / "convergence" / f"{parity.run_name('full', 'tah_evalboth', seed, 128)}.jsonl"
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        for r in lines:
            if "valid_loss" in r:
                r["valid_loss_uncompressed"] = r["valid_loss"] - b * extra  # the gap less 1, 2, 3 points
        path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    table = parity.collect(tmp_path / "convergence", "full")
    assert "tah_evalboth" not in parity_report.verdicts(table)  # a diagnostic
    md = "\n".join(parity_report.section(tmp_path / "convergence", "full"))
    row = next(line for line in md.splitlines() if line.startswith("| TAH-Quant, evaluated through the codec and "
                                                                       "uncompressed (diagnostic) | 128 | 3 |"))
    # Late losses are means with the final evaluation (0.99 x): the 1, 2, 3 points become x / 0.995 of it.
    assert "| +3.00% | +0.99% | +2.01% | -0.49% to +4.51% | +1.01%, +2.01%, +3.02% |" in row
    # Next to tah's own runs of the same seeds: the same configuration trained twice.
    _study(tmp_path, {(128, "tah"): [b * 1.02 for b in base]})
    path = tmp_path / "convergence" / f"{parity.run_name('full', 'tah', parity.SEEDS[1], 128)}.jsonl"
    path.write_text(path.read_text().replace('"iteration": 3, "lm_loss": 5.0', '"iteration": 3, "lm_loss": 5.01'))
    md = "\n".join(parity_report.section(tmp_path / "convergence", "full"))
    assert "| TAH-Quant (4/3-bit fwd, 6-bit bwd) | 128 | 1234 | +2.00% | +3.00% | +1.00% | identical |" in md
    assert "| TAH-Quant (4/3-bit fwd, 6-bit bwd) | 128 | 1235 | +2.00% | +3.00% | +1.00% | differ from iteration 3 |" in md
    # Runs without the uncompressed evaluation get no such table.
    other = tmp_path / "other"
    _study(other, {(128, "none"): base, (128, "tah"): base})
    md = "\n".join(parity_report.section(other / "convergence", "full"))
    assert "What evaluating through the codec adds" not in md and "trained twice" not in md


def test_seeds_outside_the_parts_own_enter_the_table(tmp_path):
    """Runs of any seed (``parity-seeds --seeds 1240``) count; ablations and other phases do not."""
    folder = tmp_path / "convergence"
    for seed, gap in ((1240, 0.01), (1251, 0.03)):
        _write(folder, "none", seed, 128, _records(4.0))
        _write(folder, "hadint4_bwd4sr", seed, 128, _records(4.0 * (1 + gap)))
    name = _write(folder, "tah", 1240, 128, _records(5.0))
    meta = json.loads((folder / f"{name}.meta.json").read_text())
    meta["info"]["phase"] = "finetune"  # same name pattern, another phase: not the study's
    (folder / f"{name}.meta.json").write_text(json.dumps(meta))
    table = parity.collect(folder, "full")
    assert sorted(parity_report.gaps(table, 128, "hadint4_bwd4sr")) == [pytest.approx(0.01), pytest.approx(0.03)]
    assert "tah" not in table[128]
    md = "\n".join(parity_report.section(folder, "full"))
    assert "hidden 128: seeds 1240, 1251 (2)" in md
    assert "| Hadamard INT4 fwd, Hadamard INT4 bwd with stochastic rounding (4.25 bits each) | unresolved | not run |" in md
    assert "What the backward codec adds" not in md  # no pair of runs differing in it alone


def test_the_committed_record_keeps_runs_whose_logs_are_gone(tmp_path):
    """update_record keeps one entry per study run; a table from the record alone equals the table from the
    logs; a log present again wins over its entry; a record of another version is refused."""
    base = [4.00, 4.10, 3.90]
    _study(tmp_path, {(128, "none"): base, (128, "hadint4_bwd4sr"): [b * 1.02 for b in base],
                      (256, "none"): base, (256, "tah"): [b * 1.01 for b in base]})
    folder, record = tmp_path / "convergence", tmp_path / "docs" / parity.RECORD_NAME
    from_logs = parity.collect(folder, "full")
    recorded = parity.update_record(folder, "full", record)
    assert len(recorded) == 12 and record.read_text().count("\n") == 12 + 2  # one line per run
    assert parity.load_record(record) == recorded
    assert {e["host"]["cpu"] for e in recorded.values()} == {"test CPU"}  # which machine ran each seed
    elsewhere = tmp_path / "fresh_machine"  # no logs at all: the same study from the record
    assert parity.collect(elsewhere, "full", recorded=parity.load_record(record)) == from_logs
    # New seeds run on the fresh machine add to the record; the old entries stay.
    _write(elsewhere, "none", 1240, 128, _records(4.0))
    _write(elsewhere, "hadint4_bwd4sr", 1240, 128, _records(4.0 * 1.05))
    merged = parity.update_record(elsewhere, "full", record)
    assert len(merged) == 14
    table = parity.collect(elsewhere, "full", recorded=merged)
    assert sorted(parity_report.gaps(table, 128, "hadint4_bwd4sr")) == [pytest.approx(0.02)] * 3 + [pytest.approx(0.05)]
    # A log here replaces the recorded run of the same name.
    _write(elsewhere, "hadint4_bwd4sr", 1234, 128, _records(4.0 * 1.10))
    table = parity.collect(elsewhere, "full", recorded=parity.load_record(record))
    assert parity_report.gaps(table, 128, "hadint4_bwd4sr")[0] == pytest.approx(0.10)
    record.write_text(record.read_text().replace('"version": 1', '"version": 99'))
    with pytest.raises(ValueError, match="record version 99"):
        parity.load_record(record)
    assert parity.load_record(tmp_path / "absent.json") == {}


def test_a_superseded_run_is_kept_out_of_the_tables_and_compared_with_its_rerun(tmp_path):
    """supersede keeps the recorded runs under ``<name>@<tag>``; their re-runs' logs take the names; the tables
    show the re-runs only, and the re-measured table compares the two over the same seeds and baseline."""
    base = [4.00, 4.10, 3.90]
    _study(tmp_path, {(128, "none"): base, (128, "lowrank"): [b * (1 + g) for b, g in zip(base, (0.002, 0.003, 0.004))]})
    record = tmp_path / "docs" / parity.RECORD_NAME
    parity.update_record(tmp_path / "convergence", "full", record)
    names = [parity.run_name("full", "lowrank", s, 128) for s in parity.SEEDS]
    with pytest.raises(ValueError, match="no current entry lowrank_s1239"):
        parity.supersede(record, names + ["lowrank_s1239"], "old", "old basis")
    assert len(parity.load_record(record)) == 6  # refused: nothing kept
    kept = parity.supersede(record, names, "old", "old basis")
    assert kept["lowrank@old"]["superseded"] == "old basis" and kept["lowrank@old"]["row"] == kept["lowrank"]["row"]
    with pytest.raises(ValueError, match="already kept as lowrank@old"):
        parity.supersede(record, names[:1], "old", "old basis")
    with pytest.raises(ValueError, match="no current entry lowrank@old"):
        parity.supersede(record, ["lowrank@old"], "older", "older basis")
    rerun = tmp_path / "rerun"
    for seed, b, gap in zip(parity.SEEDS, base, (0.001, 0.001, 0.004)):
        _write(rerun, "lowrank", seed, 128, _records(b * (1 + gap), errors={2: {"0->1": 0.05}}))
    recorded = parity.update_record(rerun, "full", record)
    assert len(recorded) == 9 and record.read_text().count("\n") == 9 + 2
    table = parity.collect(None, "full", recorded=parity.load_record(record))
    assert parity_report.gaps(table, 128, "lowrank") == [pytest.approx(g) for g in (0.001, 0.001, 0.004)]
    lines = parity_report.remeasured_reading(recorded, table, "gpt2")
    row = next(line for line in lines if line.startswith("| lowrank: 16 principal"))
    before, after = [0.002, 0.003, 0.004], [0.001, 0.001, 0.004]
    low, high = stats.interval95(before)
    assert f"| 128 | 3 | old basis | 2026-11-23 20:00-20:00 UTC | yes | +0.30% | {100 * low:+.2f}% to {100 * high:+.2f}% |" in row
    assert f"| 0.070 | 2026-11-23 20:00-20:00 UTC | yes | +0.20% | {parity_report._interval_text(after)} | 0.050 | yes |" in row
    assert row.endswith(f"| {parity_report._interval_text([a - b for a, b in zip(after, before)])} |")
    assert parity_report.remeasured_reading(recorded, table, "compact") == []  # another protocol's runs: none
    for seed in parity.SEEDS[:2]:  # two re-runs made on another machine than their uncompressed runs
        recorded[parity.run_name("full", "lowrank", seed, 128)]["host"] = {"cpu": "other CPU", "cores": 2}
    assert "| 2026-11-23 20:00-20:00 UTC | partly | +0.20% |" in parity_report.remeasured_reading(recorded, table, "gpt2")[-2]
    page = parity_report.write_page(tmp_path / "nothing", tmp_path / "docs").read_text()
    assert "### Rows re-measured after their codec changed" in page and "test CPU, 2 cores, torch ?, megatron-core ?: 6 runs." in page


def test_parity_report_writes_the_page_from_the_record(tmp_path):
    from benchmarks.reproduce.__main__ import main

    base = [4.00, 4.10, 3.90]
    _study(tmp_path, {(128, "none"): base, (128, "hadint4_bwd4sr"): [b * 1.002 for b in base]})
    docs = tmp_path / "docs"
    assert main(["parity-report", "--out", str(tmp_path), "--docs", str(docs)]) == 0
    page = (docs / parity_report.PAGE_NAME).read_text()
    assert page.startswith("# Convergence parity study\n") and "\n### Hidden 128\n" in page
    assert "| 3 | +0.20% |" in page and (docs / "data" / parity_report.PAGE_PLOT).is_file()
    assert "test CPU, 2 cores, torch ?, megatron-core ?: 6 runs." in page
    assert not (docs / "data" / "parity_gaps.png").exists()  # RESULTS.md's plot is left alone
    # On another machine (no logs), the page is the same, from the committed record.
    (docs / "data" / parity_report.PAGE_PLOT).unlink()
    assert main(["parity-report", "--out", str(tmp_path / "elsewhere"), "--docs", str(docs)]) == 0
    assert (docs / parity_report.PAGE_NAME).read_text() == page


DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_committed_docs_regenerate_byte_identical_from_the_committed_record(tmp_path):
    """parity-report, run on a machine with no logs, writes docs/PARITY.md, RESULTS.md's section 4b (a pointer to
    PARITY.md) and the plots byte for byte as committed; the record is left as it is; section 6 is docs/RESULTS_TACO_AGOQ.md's.
    (RESULTS.md's other sections come from run logs that are not committed.)"""
    from benchmarks.reproduce.__main__ import main

    docs = tmp_path / "docs"
    (docs / "data").mkdir(parents=True)
    for name in (parity.RECORD_NAME, "data/real_activations.json", "data/spectrum.json"):  # the last two: real activations
        (docs / name).write_bytes((DOCS / name).read_bytes())
    results = (DOCS / "RESULTS.md").read_text().split("\n")
    start = next(i for i, line in enumerate(results) if line.startswith(report.COMPACT_HEADING))
    end = next(i for i, line in enumerate(results) if line.startswith(report.NEXT_SECTION))
    assert end - start >= 3  # the section (a pointer) is there, and is removed before the regeneration
    (docs / "RESULTS.md").write_text("\n".join(results[:start] + results[end:]))
    assert main(["parity-report", "--out", str(tmp_path / "runs"), "--docs", str(docs)]) == 0
    for name in (parity_report.PAGE_NAME, "RESULTS.md", parity.RECORD_NAME, f"data/{parity_report.PAGE_PLOT}",
                 "data/parity_compact_gaps.png", "data/parity_compact_gaps_vs_error.png"):
        assert (docs / name).read_bytes() == (DOCS / name).read_bytes(), name
    assert "\n".join(report._places_section()) in (DOCS / "RESULTS.md").read_text()


def test_seeds_and_widths_flags(tmp_path, monkeypatch):
    from benchmarks.reproduce import __main__ as cli

    chosen = []
    prepared = []
    monkeypatch.setattr(cli.convergence, "prepare_data", lambda root, size, protocol="gpt2": prepared.append(protocol))
    monkeypatch.setattr(cli, "execute_all", lambda runs, out, **kw: chosen.extend(runs))
    assert cli.main(["parity-seeds", "--out", str(tmp_path), "--seeds", "1240,1241", "--widths", "128"]) == 0
    assert [r.name for r in chosen] == [f"{c}_s{s}" for s in (1240, 1241) for c in parity.HEADLINE]
    chosen.clear()
    assert cli.main(["parity", "--out", str(tmp_path), "--seeds", "1240", "--only", "w256_tah_s1240"]) == 0
    assert [(r.name, r.info["hidden"], r.info["seed"]) for r in chosen] == [("w256_tah_s1240", 256, 1240)]
    assert cli.main(["convergence", "--out", str(tmp_path), "--seeds", "1240"]) == 2  # not a parity part
    assert cli.main(["parity-seeds", "--out", str(tmp_path), "--seeds", "12a"]) == 2
    chosen.clear()
    prepared.clear()
    assert cli.main(["parity-compact", "--out", str(tmp_path), "--seeds", "1240", "--widths", "256"]) == 0
    assert [r.name for r in chosen] == [f"compact_w256_{c}_s1240" for c in parity.COMPACT_CANDIDATES]
    assert prepared == ["gpt2", parity.COMPACT]  # the compact vocabulary's data next to the GPT-2 ids'


def test_compact_protocol_runs(tmp_path):
    """Part ``parity-compact``: the candidates and the control at both widths, seed by seed, with the compact
    protocol's values in place of the gpt2 protocol's and every other flag the same."""
    runs = parity.compact_runs(tmp_path, "full")
    assert len(runs) == (len(parity.COMPACT_SEEDS) * (len(parity.WIDTHS) * len(parity.COMPACT_CANDIDATES)
                                                      + len(parity.COMPACT_BACKWARD)) + len(parity.COMPACT_DIAGNOSTICS))
    assert [r.info["seed"] for r in runs] == sorted(r.info["seed"] for r in runs)
    diagnostics = [r for r in runs if r.info["codec"] in parity.COMPACT_DIAGNOSTICS]
    assert {(r.info["seed"], r.info["hidden"]) for r in diagnostics} == {(parity.COMPACT_SEEDS[0], 128)}
    backward = {(r.info["seed"], r.info["hidden"]) for r in runs if r.info["codec"] in parity.COMPACT_BACKWARD}
    assert backward == {(seed, 128) for seed in parity.COMPACT_SEEDS}
    assert all(parity_report._diagnostic(c) for c in parity.COMPACT_DIAGNOSTICS + parity.COMPACT_BACKWARD + ("int8_both",))
    twins = {(r.info["codec"], r.info["seed"], r.info["hidden"]): r for seed in parity.COMPACT_SEEDS
             for hidden in parity.WIDTHS for r in convergence.pretrain_runs(
                 tmp_path, "full", codecs=parity.COMPACT_CANDIDATES + parity.COMPACT_DIAGNOSTICS
                 + parity.COMPACT_BACKWARD, seed=seed,
                 hidden=hidden)}
    changed = {"--vocab-size": "4096", "--global-batch-size": "16", "--micro-batch-size": "4", "--train-iters": "300",
               "--lr": "1e-3", "--min-lr": "1e-4", "--lr-warmup-iters": "30", "--eval-interval": "50",
               "--eval-iters": "16"}
    for r in runs:
        codec, seed, hidden = r.info["codec"], r.info["seed"], r.info["hidden"]
        assert r.info["protocol"] == "compact" and r.name == parity.run_name("full", codec, seed, hidden, "compact")
        assert r.name.startswith("compact_") and "--save" not in r.flags
        assert {k: _flag(r.flags, k) for k in changed} == changed
        assert _flag(r.flags, "--train-data-path").endswith("shakespeare_full_v4096_train_text_document")
        twin = twins[(codec, seed, hidden)].flags
        if "--save" in twin:  # the gpt2 protocol's main uncompressed run saves the fine-tuning checkpoint
            twin = twin[:twin.index("--save")] + twin[twin.index("--save-interval") + 2:]
        assert len(twin) == len(r.flags)
        differ = {twin[i - 1] for i, (a, b) in enumerate(zip(twin, r.flags)) if a != b}
        assert differ <= {*changed, "--train-data-path", "--valid-data-path"}
    names = {r.name for r in runs}
    assert {"compact_none", "compact_w256_int8_both_s1236"} <= names
    assert _flag(next(r for r in runs if r.name == "compact_int8_both").flags, "--tah-backward-codec") == "int8"
    default_width = convergence.pretrain_runs(tmp_path, "full", codecs=("tah",), protocol="compact")[0]
    assert default_width.name == "compact_tah" and _flag(default_width.flags, "--hidden-size") == "128"
    with pytest.raises(ValueError, match="unknown protocol 'nope'"):
        convergence.pretrain_runs(tmp_path, "full", protocol="nope")
    with pytest.raises(ValueError, match="replaces --global-batch-size, which the run does not set"):
        convergence.protocol_flags(["--vocab-size", "50257"], "full", "compact")


def test_protocols_have_separate_tables_and_page_sections(tmp_path):
    """Runs of the compact protocol and the gpt2 protocol with the same codec, seed and width are different
    runs: each protocol's table holds its own, the record keeps both, the page has a section for each."""
    folder = tmp_path / "convergence"
    for seed, (gpt2_gap, compact_gap, control) in zip(parity.SEEDS, ((0.03, 0.010, 0.001), (0.00, 0.012, -0.001),
                                                                     (0.02, 0.014, 0.0005))):
        for protocol, gap in (("gpt2", gpt2_gap), ("compact", compact_gap)):
            _write(folder, "none", seed, 128, _records(4.0), protocol=protocol)
            _write(folder, "tah", seed, 128, _records(4.0 * (1 + gap)), protocol=protocol)
        _write(folder, "int8_both", seed, 128, _records(4.0 * (1 + control)), protocol="compact")
    # Forward-only diagnostics (uncompressed backward: 32 bits), first seed only: the gap against the bits.
    for codec, wire, gap in (("hadint5_bwdnone", 525, 0.004), ("hadint4_bwdnone", 425, 0.009),
                             ("lowrank_bwdnone", 438, 0.002)):
        _write(folder, codec, parity.SEEDS[0], 128, _records(4.0 * (1 + gap), fwd_wire=wire, bwd_wire=3200,
                                                             errors={2: {"0->1": wire / 1e4, "1->0": 0.0}}),
               protocol="compact")
    gpt2 = parity.collect(folder, "full")
    compact = parity.collect(folder, "full", protocol="compact")
    assert sorted(parity_report.gaps(gpt2, 128, "tah")) == [pytest.approx(g) for g in (0.0, 0.02, 0.03)]
    assert parity_report.gaps(compact, 128, "tah") == [pytest.approx(g) for g in (0.010, 0.012, 0.014)]
    assert "int8_both" not in gpt2[128]
    mean, sd, n = parity_report.noise_floor(compact, 128)
    assert n == 3 and mean == pytest.approx(0.0005 / 3) and sd == pytest.approx(statistics.stdev([0.001, -0.001, 0.0005]))
    assert parity_report.noise_floor(gpt2, 128) == (None, None, 0)
    assert parity_report.verdicts(compact) == {"tah": "not met"}  # the control is a diagnostic: no verdict
    docs = tmp_path / "docs"
    recorded = parity.update_record(folder, "full", docs / parity.RECORD_NAME)
    assert len(recorded) == 18 and {e.get("protocol") for e in recorded.values()} == {None, "compact"}
    assert parity.collect(None, "full", recorded=parity.load_record(docs / parity.RECORD_NAME),
                          protocol="compact") == compact
    page = parity_report.write_page(folder, docs).read_text()
    low, old = page.split("## Low-noise protocol")[1].split("## GPT-2-vocabulary protocol")
    assert "| TAH-Quant (4/3-bit fwd, 6-bit bwd) | 4.25 | 4.25 | 3 | +1.20% |" in low
    assert "| TAH-Quant (4/3-bit fwd, 6-bit bwd) | 4.25 | 4.25 | 3 | +1.67% |" in old
    assert "4096-id vocabulary" in low and "16 sequences of 128 tokens" in low and "300 iterations" in low
    assert "Noise floor at hidden 128" in low and "Noise floor" not in old
    bits = low.split("### The forward's gap against its bits")[1]
    assert bits.index("| Hadamard INT4 fwd (4.25 bits), uncompressed bwd (diagnostic) | 128 | 4.25 | 1 | +0.90% | n/a | 0.043 |") < \
        bits.index("| Hadamard INT5 fwd (5.25 bits), uncompressed bwd (diagnostic) | 128 | 5.25 | 1 | +0.40% | n/a | 0.052 |")
    assert "gap against its bits" not in old
    assert "reaches 0.5%" not in bits  # 0.4% and 0.9% (lowrank's 0.2% is not a scalar codec's): not between them
    assert "the lowrank codec's forward (4.38 bits) has an error of 0.044 and a gap of +0.20%" in bits
    assert (docs / "data" / "parity_compact_gaps.png").is_file() and (docs / "data" / parity_report.PAGE_PLOT).is_file()
    # parity-report writes RESULTS.md's section 4b (the low-noise protocol: a pointer to PARITY.md, the one page
    # with its tables) before section 5, and leaves the others, section 4 included (the full report writes that
    # one from its machine's logs).
    results = docs / "RESULTS.md"
    results.write_text("# R\n\n## 4. Convergence parity\nkept 4\n## 5. Memory\nkept 5\n")
    assert report.refresh_compact_section(docs) == results
    once = results.read_text()
    assert "kept 4" in once and once.endswith("## 5. Memory\nkept 5\n")
    assert once.index("## 4. Convergence parity\nkept 4") < once.index("## 4b. The low-noise") < once.index("## 5.")
    pointer = once.split("## 4b.")[1].split("## 5.")[0]
    assert "[PARITY.md](PARITY.md)" in pointer and "| TAH-Quant" not in pointer and "+1.20%" not in pointer
    assert report.refresh_compact_section(docs).read_text() == once  # replaced, not added again
    results.write_text("# R\n\n## 4. Convergence parity\n")
    with pytest.raises(ValueError, match="no '## 5.' section"):
        report.refresh_compact_section(docs)
    assert report.refresh_compact_section(tmp_path) is None  # no RESULTS.md there


def test_error_for_gap_interpolates_between_the_runs_around_the_goal():
    # Gaps 2% at error 0.1 (4 bits) and 0.25% at 0.025 (6 bits): log-log, 0.5% lies 1/3 of the way from 0.025 up
    # (ln 2 / ln 8): error 0.025 * 4^(1/3) = 0.0397, bits 6 - 2/3.
    points = [(0.1, 0.02, 4.0), (0.025, 0.0025, 6.0), (0.05, 0.004, 5.0)]
    error, bits = parity_report.error_for_gap([(0.1, 0.02, 4.0), (0.025, 0.0025, 6.0)], 0.005)
    assert error == pytest.approx(0.025 * 4 ** (1 / 3)) and bits == pytest.approx(6 - 2 / 3)
    error, bits = parity_report.error_for_gap(points, 0.005)  # now between 0.05 (0.4%) and 0.1 (2%)
    t = math.log(0.005 / 0.004) / math.log(0.02 / 0.004)
    assert error == pytest.approx(0.05 * 2 ** t) and bits == pytest.approx(5 - t)
    assert parity_report.error_for_gap([(0.02, -0.001, 7.0), (0.04, 0.009, 6.0)], 0.005) == (
        pytest.approx(0.032), pytest.approx(6.4))  # a gap <= 0: linear
    assert parity_report.error_for_gap([(0.1, 0.02, 4.0), (0.05, 0.01, 5.0)], 0.005) is None  # not bracketed
    table = {128: {"none": {1: {"late": 4.0, "fwd_bits": 32.0, "bwd_bits": 32.0, "links": {}}}}}
    for (error, gap, bits), codec in zip(points, ("hadint4_bwdnone", "hadint6_bwdnone", "hadint5_bwdnone")):
        table[128][codec] = {1: {"late": 4.0 * (1 + gap), "fwd_bits": bits, "bwd_bits": 32.0,
                                 "links": {"0->1": (error, error), "1->0": (None, None)}}}
    text = "\n".join(parity_report._bits_reading(table))
    expected = 0.05 * 2 ** t
    assert f"forward error of about {expected:.3f}" in text and f"at least {math.log2(1 / expected):.1f} bits" in text


def test_backward_verdict():
    """<= 5 bits adding <= 0.1% with the interval's upper end below 0.2%: met; more bits or an interval above
    0.1%: not met; one seed or an interval straddling: unresolved."""
    assert parity_report.backward_verdict(4.25, [0.0005, 0.0006, 0.0004]) == "met"
    assert parity_report.backward_verdict(7.0, [0.0, 0.0, 0.0]) == "not met"
    assert parity_report.backward_verdict(4.25, [0.003, 0.004, 0.0035]) == "not met"
    assert parity_report.backward_verdict(4.25, [0.0005]) == "unresolved"
    assert parity_report.backward_verdict(5.002, [0.0005, 0.0006, 0.0004]) == "met"  # 5.00 as shown: the header's 0.002
    assert parity_report.backward_verdict(5.01, [0.0005, 0.0006, 0.0004]) == "not met"
    assert parity_report.backward_verdict(4.25, [-0.002, 0.004, 0.001]) == "unresolved"


def test_every_study_codec_is_a_valid_megatron_tah_command_line():
    """Each run's --tah-* flags parse and validate as megatron_tah's own (a preset plus a conflicting flag,
    or a stochastic-rounding flag on a codec without it, would fail every run of the codec at start)."""
    import argparse

    from megatron_tah.megatron import arguments

    for codec, (label, flags) in convergence.CODECS.items():
        args = arguments.add_tah_arguments(argparse.ArgumentParser()).parse_args(flags)
        config = arguments.tah_config_from_args(args)
        if "lowrank" in codec:
            assert config.forward_codec().name == "lowrank" and f"{config.tah_lowrank_rank} principal" in label


def test_both_directions_verdict():
    assert parity_report.both_verdict(1.4, [-0.010, -0.012, -0.011]) == "met"
    assert parity_report.both_verdict(1.2, [-0.010, -0.012, -0.011]) == "not met"  # too few bytes saved
    assert parity_report.both_verdict(1.4, [0.010, 0.012, 0.011]) == "not met"  # a resolved larger gap
    assert parity_report.both_verdict(1.4, [-0.010, 0.012, 0.001]) == "unresolved"
    assert parity_report.both_verdict(1.4, [-0.010]) == "unresolved"  # one seed: no interval
