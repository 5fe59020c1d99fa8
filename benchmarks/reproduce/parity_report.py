"""The parity study's verdicts against its goals and its page (``write_page``: ``docs/PARITY.md``), from the
table ``parity.collect`` reads out of the committed record and the logs present."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from ..common import stats
from . import convergence
from .convergence import _mean  # (None-tolerant mean)
from .plots import DATA
from .parity import (COMPACT, COMPACT_CANDIDATES, COMPACT_SEEDS, EVAL_BOTH, GOAL_BOTH_RATIO, GOAL_BWD_ADDED,
                     GOAL_BWD_BITS, GOAL_BWD_UPPER, GOAL_FWD_BITS, GOAL_FWD_GAP, GOAL_FWD_UPPER, HEADLINE, MORE_SEEDS,
                     RECORD_NAME, RESOLUTION, SEEDS, SHOWN, STRETCH_FWD, WIDTHS, _link_key, collect, update_record)


def _diagnostic(codec: str) -> bool:
    """A run that explains a gap rather than competing for the goal (no verdict, not against the default)."""
    return "(diagnostic)" in convergence.CODECS[codec][0]


def gaps(table: dict, hidden: int, codec: str, ref: str = "none", key: str = "late") -> list[float]:
    """Same-seed relative gaps of ``codec`` to ``ref`` at ``hidden`` (seeds where both ran)."""
    a, b = table.get(hidden, {}).get(codec, {}), table.get(hidden, {}).get(ref, {})
    return [convergence.relative_gap(a[s][key], b[s][key]) for s in a if s in b]


def _pct(x, spec="+.2f") -> str:
    return "n/a" if x is None else f"{100 * x:{spec}}%"


def _interval_text(values: list[float]) -> str:
    interval = stats.interval95(values)
    return "n/a" if interval is None else f"{_pct(interval[0])} to {_pct(interval[1])}"


def goal_verdict(bits: float | None, values: list[float], goal: tuple[float, float, float]) -> str:
    """``met``, ``not met`` or ``unresolved`` for a codec of ``bits`` with the same-seed gaps ``values`` against
    ``goal`` = (most bits, largest mean gap, bound on the interval's upper end): not met when the bits exceed
    it or the interval lies above the gap, met when the mean is within it and the upper end below the bound."""
    max_bits, max_gap, upper = goal
    if bits is not None and bits > max_bits:
        return "not met"
    interval = stats.interval95(values)
    if interval is None:
        return "unresolved"
    if _mean(values) <= max_gap and interval[1] < upper:
        return "met"
    return "not met" if interval[0] > max_gap else "unresolved"


def width_verdict(table: dict, hidden: int, codec: str,
                  goal: tuple[float, float, float] = (GOAL_FWD_BITS, GOAL_FWD_GAP, GOAL_FWD_UPPER)) -> str:
    """The forward goal's verdict (:func:`goal_verdict`) for ``codec`` at ``hidden``, or ``not run`` (no run
    of ``codec`` at that width)."""
    rows = table.get(hidden, {}).get(codec)
    if not rows:
        return "not run"
    return goal_verdict(_mean([r["fwd_bits"] for r in rows.values()]), gaps(table, hidden, codec), goal)


def verdicts(table: dict) -> dict[str, str]:
    """Per candidate (diagnostic runs left out): the forward goal's verdict over every width (``met``,
    ``not met``, or ``unresolved``)."""
    out = {}
    for codec in SHOWN:
        if codec == "none" or _diagnostic(codec) or not _ran(table, codec):
            continue
        per_width = [width_verdict(table, hidden, codec) for hidden in WIDTHS]
        out[codec] = ("met" if all(v == "met" for v in per_width) else
                      "not met" if "not met" in per_width else "unresolved")
    return out


def _seed_text(table: dict) -> str:
    """``"hidden 128: seeds 1234-1236, 1240 (4); ..."``: the seeds that ran, per width."""
    parts = []
    for hidden in sorted(table):
        seeds = sorted({s for runs in table[hidden].values() for s in runs})
        spans, start = [], None
        for i, seed in enumerate(seeds):
            start = seed if start is None else start
            if i + 1 == len(seeds) or seeds[i + 1] != seed + 1:
                spans.append(str(seed) if seed == start else f"{start}-{seed}")
                start = None
        parts.append(f"hidden {hidden}: seeds {', '.join(spans)} ({len(seeds)})")
    return "; ".join(parts)


def _protocol_text(size: str, protocol: str) -> str:
    """What the runs of ``protocol`` train, from :data:`convergence.PROTOCOLS` and :data:`convergence.SIZES`."""
    cfg = convergence.SIZES[size]
    if protocol == "gpt2":
        return (f"Part `parity` (`benchmarks/reproduce/parity.py`): pretraining as in RESULTS.md section 2 (4 layers, "
                f"PP {cfg['pipeline']}, {cfg['pretrain_iters']} iterations, GPT-2's 50257-id vocabulary) at hidden "
                f"{' and '.join(map(str, WIDTHS))}, seeds {', '.join(map(str, SEEDS))}; part `parity-seeds` adds "
                f"seeds ({', '.join(map(str, MORE_SEEDS))} unless `--seeds` says others) for "
                f"{', '.join(convergence.CODECS[c][0] for c in HEADLINE)}. ")
    spec = convergence.PROTOCOLS[protocol].get(size, {})
    flags = convergence.pretrain_runs(Path("."), size, codecs=("none",), protocol=protocol)[0].flags  # as run
    get = lambda name: flags[flags.index(name) + 1]  # noqa: E731
    return (f"Part `parity-{protocol}` (`benchmarks/reproduce/parity.py`, protocol `{protocol}` of "
            "`convergence.PROTOCOLS`): the same GPT (4 layers, PP "
            f"{cfg['pipeline']}) and corpus, with GPT-2's ids renumbered into a {spec.get('vocab_limit')}-id vocabulary "
            "(`python -m megatron_tah.data --vocab-limit`: the most frequent ids of the train split, the rest "
            f"`<unk>`), {get('--global-batch-size')} sequences of {get('--seq-length')} tokens per iteration "
            f"({get('--micro-batch-size')} per micro-batch), {get('--train-iters')} iterations, learning rate "
            f"{get('--lr')} ({get('--lr-warmup-iters')} warm-up iterations, cosine to {get('--min-lr')}), an evaluation "
            f"of {get('--eval-iters')} batches every {get('--eval-interval')} iterations; candidates "
            f"{', '.join(convergence.CODECS[c][0] for c in COMPACT_CANDIDATES if c != 'none')}; seeds "
            f"{', '.join(map(str, COMPACT_SEEDS))} unless `--seeds` says others. ")


def noise_floor(table: dict, hidden: int, control: str = "int8_both") -> tuple[float | None, float | None, int]:
    """Mean and seed-to-seed standard deviation of the control's same-seed gaps at ``hidden`` (a perturbation
    far below any 4-bit codec's): how far two trajectories drift apart for reasons other than the codec."""
    values = gaps(table, hidden, control)
    return _mean(values), (statistics.stdev(values) if len(values) >= 2 else None), len(values)


def section(out: Path | None, size: str, docs: Path | None = None, recorded: dict | None = None,
            title: str = "## 4. Convergence parity study", plot: str = "parity_gaps.png",
            protocol: str = "gpt2") -> list[str]:
    """The parity study's section of RESULTS.md (``title``, headings one level down) from the runs of
    ``protocol`` under ``out`` and the ``recorded`` ones; with ``docs``, its plot (file name ``plot``) goes to
    ``docs/data/``."""
    table = collect(out, size, recorded=recorded, protocol=protocol)
    lines = [title, ""]
    if not any(len(t.get("none", {})) for t in table.values()):
        part = "parity" if protocol == "gpt2" else f"parity-{protocol}"
        return lines + [f"Not run yet (`bash scripts/reproduce.sh {part}`).", ""]
    lines += [_protocol_text(size, protocol) + f"Runs in this table: "
              f"{_seed_text(table)}; the seeds column counts a candidate's. "
              "Gap: same-seed relative gap of the *late validation loss* (mean of the evaluations in the last "
              "quarter of training) to the uncompressed run; the final evaluation alone is shown "
              "too. Bits: wire bits per value (metadata and headers included), per direction. 95% interval: "
              "Student's t over seeds. "
              f"Seeds for +/-{100 * RESOLUTION:g} points: how many paired seeds would make the interval that "
              "narrow (so that a mean gap at the 0.5% goal has its upper end at 1%) if the seeds kept the spread "
              "measured here. Error per boundary: the sampled relative round-trip error of each pipeline "
              "link (stage ranks, forward links going up), over the first and the second half of training, mean "
              "over seeds; n/a for runs made before the logs carried it (the convergence and seeds parts' runs). "
              "Goal: forward <= 4.5 bits with mean gap <= 0.5% and the interval below 1%, at both widths; "
              "backward <= 5 bits adding <= 0.1%.", ""]
    verdict = verdicts(table)
    for hidden in WIDTHS:
        rows = table.get(hidden, {})
        if not rows:
            continue
        lines += [f"### Hidden {hidden}", "",
                  "| run | fwd bits | bwd bits | seeds | late-loss gap, mean | 95% interval | "
                  f"seeds for +/-{100 * RESOLUTION:g} points | same-seed gaps | "
                  "final-eval gap, mean | fwd error per boundary (1st half / 2nd half) | bwd error per boundary |",
                  "|---|---:|---:|---:|---:|---|---:|---|---:|---|---|"]
        for codec in SHOWN:
            runs = rows.get(codec)
            if not runs:
                continue
            values = gaps(table, hidden, codec) if codec != "none" else []
            finals = gaps(table, hidden, codec, key="final") if codec != "none" else []
            fwd_err, bwd_err = _boundary_errors(runs) if codec != "none" else ("-", "-")
            lines.append(
                f"| {convergence.CODECS[codec][0]} | {_mean([r['fwd_bits'] for r in runs.values()]):.2f} | "
                f"{_mean([r['bwd_bits'] for r in runs.values()]):.2f} | {len(runs)} | {_pct(_mean(values))} | "
                f"{_interval_text(values)} | {_needed(values)} | {', '.join(_pct(v) for v in values) or 'n/a'} | "
                f"{_pct(_mean(finals))} | "
                f"{fwd_err} | {bwd_err} |")
        lines.append("")
        r, n = error_gap_correlation(table, hidden)
        if r is not None:
            lines += [f"Forward round-trip error (mean over the forward links and the run) vs late-loss gap over the "
                      f"{n} compressed runs at hidden {hidden} with both: Pearson r = {r:+.2f}.", ""]
        r, n, train_sd, valid_sd = train_valid_spread(table, hidden)
        if r is not None and train_sd is not None:
            lines += [f"Late *training*-loss gap (mean training loss of the last quarter's iterations, every batch of "
                      f"them) vs late validation-loss gap over the {n} compressed runs at hidden {hidden}: Pearson "
                      f"r = {r:+.2f}; seed-to-seed standard deviation of the gap, mean over the candidates with 2 or "
                      f"more seeds: {100 * train_sd:.2f} points (training) vs {100 * valid_sd:.2f} (validation).", ""]
        mean, sd, n = noise_floor(table, hidden)
        if sd is not None:
            lines += [f"Noise floor at hidden {hidden}: the same-seed gaps of "
                      f"'{convergence.CODECS['int8_both'][0]}' (its round-trip error per boundary is in the table above) "
                      f"have mean {_pct(mean)} and standard deviation {100 * sd:.2f} points over {n} seeds.", ""]
        rotated = rows.get("tah", {})
        if rotated:
            first = _mean([r["rotated"][0] for r in rotated.values() if r["rotated"][0] is not None])
            last = _mean([r["rotated"][1] for r in rotated.values() if r["rotated"][1] is not None])
            lines += [f"TAH-Quant's outlier test at hidden {hidden}: "
                      f"{_frac(first)} of tiles rotated in the first quarter of training, "
                      f"{_frac(last)} in the last quarter (mean over seeds).", ""]
    if docs is not None:
        lines += _plot(table, Path(docs) / DATA / plot)
    stretch_bits, stretch_gap, stretch_upper = STRETCH_FWD
    lines += ["### Verdict against the goal", "",
              "| candidate | " + " | ".join(f"hidden {h}" for h in WIDTHS) + " | forward goal, both widths | "
              + " | ".join(f"stretch, hidden {h}" for h in WIDTHS) + " |",
              "|---|" + "---|" * (2 * len(WIDTHS) + 1)]
    lines += [f"| {convergence.CODECS[c][0]} | " + " | ".join(width_verdict(table, h, c) for h in WIDTHS)
              + f" | {v} | " + " | ".join(width_verdict(table, h, c, STRETCH_FWD) for h in WIDTHS) + " |"
              for c, v in verdict.items() if _ran(table, c)]
    lines += ["", "*met*: at every width the bits and the mean gap are within the goal and the interval's upper end "
              "is below 1%; *not met*: at some width the bits exceed it or the interval lies above 0.5%; "
              "*unresolved*: neither (too few seeds for an interval, or an interval straddling the goal, or no run at "
              f"some width). Stretch: the same test at <= {stretch_bits:g} bits, mean gap <= "
              f"{_pct(stretch_gap, 'g')}, upper end below {_pct(stretch_upper, 'g')}, per width.", ""]
    error_png = None if docs is None else Path(docs) / DATA / plot.replace(".png", "_vs_error.png")
    return (lines + _default_reading(table) + _backward_reading(table) + _bits_reading(table, error_png)
            + _evaluation_reading(table) + remeasured_reading(recorded or {}, table, protocol))


def _plot(table: dict, png: Path) -> list[str]:
    """The per-seed gaps of every compressed candidate with two or more seeds, per width."""
    from . import plots

    points = {}
    for hidden in WIDTHS:
        rows = []
        for codec in (c for c in SHOWN if c != "none"):
            values = gaps(table, hidden, codec)
            if len(values) >= 2:
                rows.append((convergence.CODECS[codec][0], values, stats.interval95(values)))
        if rows:
            points[hidden] = rows
    if not points:
        return []
    png = plots.parity_gaps(points, png, GOAL_FWD_GAP, GOAL_FWD_UPPER)
    return [f"![same-seed gaps per candidate and width]({plots.link(png)})", ""]


def _forward_error(row: dict) -> float | None:
    values = [v for link, halves in row["links"].items() for v in halves
              if v is not None and _link_key(link)[1] > _link_key(link)[0]]
    return _mean(values)


def error_gap_correlation(table: dict, hidden: int) -> tuple[float | None, int]:
    """Pearson r between a run's forward error and its same-seed late-loss gap, over the compressed
    runs at ``hidden`` that logged per-link errors (None with fewer than 3)."""
    pairs = []
    for codec, runs in table.get(hidden, {}).items():
        base = table[hidden].get("none", {})
        for seed, row in runs.items():
            error = _forward_error(row)
            if codec != "none" and seed in base and error:
                pairs.append((error, convergence.relative_gap(row["late"], base[seed]["late"])))
    return _pearson(pairs), len(pairs)


def _pearson(pairs: list[tuple[float, float]]) -> float | None:
    """Pearson r of ``(x, y)`` pairs (None with fewer than 3 or no spread)."""
    if len(pairs) < 3:
        return None
    try:
        return statistics.correlation(*zip(*pairs))
    except statistics.StatisticsError:  # a constant input
        return None


def train_valid_spread(table: dict, hidden: int) -> tuple[float | None, int, float | None, float | None]:
    """Whether the seeds' spread comes from the evaluation: Pearson r between each compressed run's late
    training-loss gap and its late validation-loss gap, their number, and the seed-to-seed standard
    deviation of each kind of gap (mean over the candidates with 2 or more seeds)."""
    pairs, train_sd, valid_sd = [], [], []
    for codec in table.get(hidden, {}):
        if codec == "none":
            continue
        valid, train = gaps(table, hidden, codec), gaps(table, hidden, codec, key="late_train")
        pairs += list(zip(train, valid))
        if len(valid) >= 2:
            valid_sd.append(statistics.stdev(valid))
            train_sd.append(statistics.stdev(train))
    return _pearson(pairs), len(pairs), _mean(train_sd), _mean(valid_sd)


def _needed(values: list[float]) -> str:
    n = convergence.seeds_needed(values, RESOLUTION)
    return "n/a" if n is None else ">= 1000" if n >= 1000 else str(n)


def _frac(x) -> str:
    return "n/a" if x is None else f"{100 * x:.3f}%"


def _ran(table: dict, codec: str) -> bool:
    return any(codec in rows for rows in table.values())


def _boundary_errors(runs: dict) -> tuple[str, str]:
    """``"0->1: 0.071/0.068, ..."`` per direction (forward links go up the ranks), mean over seeds."""
    merged: dict[str, list] = {}
    for row in runs.values():
        for link, halves in row["links"].items():
            merged.setdefault(link, []).append(halves)
    fwd, bwd = [], []
    for link, values in sorted(merged.items(), key=lambda kv: _link_key(kv[0])):
        first = _mean([v[0] for v in values if v[0] is not None])
        second = _mean([v[1] for v in values if v[1] is not None])
        text = f"{link}: {_num(first)}/{_num(second)}"
        src, dst = _link_key(link)
        (fwd if dst > src else bwd).append(text)
    return ", ".join(fwd) or "n/a", ", ".join(bwd) or "n/a"


def _num(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def _default_reading(table: dict, default: str = "tah") -> list[str]:
    """Each compressed candidate against the default configuration, seed by seed: bytes of both
    directions relative to the default's, and the difference of their same-seed gaps (losses relative
    to each other; negative: lower loss than the default)."""
    rows = []
    for hidden in WIDTHS:
        runs = table.get(hidden, {})
        if default not in runs:
            continue
        base_bits = _mean([r["fwd_bits"] + r["bwd_bits"] for r in runs[default].values()])
        for codec in SHOWN:
            if codec in ("none", default) or _diagnostic(codec):
                continue
            values = gaps(table, hidden, codec, default)
            if not values:
                continue
            bits = _mean([r["fwd_bits"] + r["bwd_bits"] for r in runs[codec].values()])
            rows.append(f"| {convergence.CODECS[codec][0]} | {hidden} | {len(values)} | {bits:.2f} | "
                        f"{base_bits / bits:.2f}x | {_pct(_mean(values))} | {_interval_text(values)} | "
                        f"{both_verdict(base_bits / bits, values)} |")
    if not rows:
        return []
    return ["### Against the default", "",
            f"Same-seed loss of each candidate relative to the default ({convergence.CODECS[default][0]}): the "
            f"goal asks for at least {GOAL_BOTH_RATIO:g}x fewer bytes than the default at an equal or smaller gap: "
            "*met* when the bytes are and the interval lies below zero, *not met* when the bytes are not or the "
            "interval lies above zero, else *unresolved* (equal within the interval).", "",
            "| candidate | width | seeds | bits, both directions | fewer bytes than the default | "
            "late loss vs the default, mean | 95% interval | both-directions goal |",
            "|---|---:|---:|---:|---:|---:|---|---|", *rows, ""]


def both_verdict(ratio: float, against_default: list[float]) -> str:
    """The both-directions goal for a candidate with ``ratio`` times fewer bytes than the default and the
    same-seed loss differences ``against_default`` (negative: below the default's loss)."""
    interval = stats.interval95(against_default)
    if ratio < GOAL_BOTH_RATIO or (interval is not None and interval[0] > 0):
        return "not met"
    return "met" if interval is not None and interval[1] < 0 else "unresolved"


def _backward_reading(table: dict) -> list[str]:
    """What the backward codec adds: same-seed gap differences between runs that differ only in it."""
    pairs = [("tah", "tah_bwdnone", "6-bit fixed point (7 bits) vs uncompressed, TAH-Quant forward"),
             ("tah_bwd4sr", "tah_bwdnone", "Hadamard INT4 with stochastic rounding (4.25 bits) vs uncompressed, "
              "TAH-Quant forward"),
             ("tah_bwd4sr", "tah", "Hadamard INT4 with stochastic rounding (4.25 bits) vs 6-bit fixed point, "
              "TAH-Quant forward"),
             ("hadint4_bwd4sr", "hadint4", "Hadamard INT4 with stochastic rounding (4.25 bits) vs 6-bit fixed "
              "point, Hadamard INT4 forward"),
             ("hadint4_bwd4sr", "hadint4_bwdnone", "Hadamard INT4 with stochastic rounding (4.25 bits) vs "
              "uncompressed, Hadamard INT4 forward"),
             ("bwd6_only", "none", "6-bit fixed point (7 bits) vs uncompressed, uncompressed forward"),
             ("bwd4_only", "none", "Hadamard INT4 (4.25 bits) vs uncompressed, uncompressed forward"),
             ("bwd4sr_only", "none", "Hadamard INT4 with stochastic rounding (4.25 bits) vs uncompressed, "
              "uncompressed forward"),
             ("bwd4t16_only", "none", "Hadamard INT4, tile 16 (5 bits) vs uncompressed, uncompressed forward"),
             ("bwd5_only", "none", "Hadamard INT5 (5.25 bits) vs uncompressed, uncompressed forward")]
    rows = []
    for codec, ref, label in pairs:
        for hidden in WIDTHS:
            values = gaps(table, hidden, codec, ref)
            if values:
                bits = _mean([r["bwd_bits"] for r in table[hidden][codec].values()])
                rows.append(f"| {label} | {hidden} | {len(values)} | {bits:.2f} | {_pct(_mean(values))} | "
                            f"{_interval_text(values)} | {backward_verdict(bits, values)} |")
    lines = ["### What the backward codec adds", "",
             "Same-seed gap between runs that differ in the backward codec alone. Backward goal: <= "
             f"{GOAL_BWD_BITS:g} bits adding <= {100 * GOAL_BWD_ADDED:g}%: *met* when the mean is within it and the "
             f"interval's upper end below {100 * GOAL_BWD_UPPER:g}%, *not met* when the bits exceed it or the "
             "interval lies above it, else *unresolved*.", "",
             "| comparison | width | seeds | bwd bits | added gap, mean | 95% interval | backward goal |",
             "|---|---:|---:|---:|---:|---|---|", *rows, ""]
    return lines if rows else []


def backward_verdict(bits: float | None, added: list[float]) -> str:
    """The backward goal's verdict (:func:`goal_verdict`) for a backward codec of ``bits`` (compared as shown, to
    two decimals: the 16-byte message header adds about 0.002 bits per value here) adding the gaps ``added``."""
    return goal_verdict(None if bits is None else round(bits, 2), added,
                        (GOAL_BWD_BITS, GOAL_BWD_ADDED, GOAL_BWD_UPPER))


def _bits_reading(table: dict, png: Path | None = None) -> list[str]:
    """The forward gap against the forward's bits: the runs whose backward is uncompressed, fewest bits first;
    with ``png``, a plot of the gap against the forward error there."""
    rows, notes, plotted, crossings = [], [], {}, {}
    for hidden in WIDTHS:
        runs = table.get(hidden, {})
        chosen = [(statistics.fmean(r["fwd_bits"] for r in runs[c].values()), c) for c in SHOWN
                  if c != "none" and runs.get(c) and all(r["bwd_bits"] is not None and r["bwd_bits"] >= 32
                                                         for r in runs[c].values())]
        points, joint = [], []
        for bits, codec in sorted(chosen):
            values = gaps(table, hidden, codec)
            error = _mean([_forward_error(r) for r in runs[codec].values()])
            rows.append(f"| {convergence.CODECS[codec][0]} | {hidden} | {bits:.2f} | {len(values)} | "
                        f"{_pct(_mean(values))} | {_interval_text(values)} | {_num(error)} |")
            if error and values:
                (joint if _codes_jointly(codec) else points).append((error, _mean(values), bits))
        crossing = error_for_gap(points, GOAL_FWD_GAP)  # the scalar codecs' bits for an error
        if points or joint:
            plotted[hidden] = [(f"{bits:.2f} bits", error, gap) for error, gap, bits in sorted(points + joint)]
        for error, gap, bits in joint:
            notes.append(f"At hidden {hidden} the lowrank codec's forward ({bits:.2f} bits) has an error of {error:.3f} "
                         f"and a gap of {_pct(gap)}: it sends the directions shared by a message's tokens once, not "
                         "with every value, so the bound below, for values coded one by one, does not hold for it.")
        if crossing is not None:
            error, bits = crossings[hidden] = crossing
            notes.append(f"At hidden {hidden} the forward-only gap reaches {_pct(GOAL_FWD_GAP, 'g')} at a forward error "
                         f"of about {error:.3f} (interpolated between the two runs around it, log gap against log "
                         f"error), at about {bits:.1f} bits per value with their codecs. A codec that codes the rotated "
                         "(close to Gaussian) values independently cannot get below a relative error of 2^-R at R bits "
                         "per value (Shannon's bound for a memoryless Gaussian source), so it needs at least "
                         f"{math.log2(1 / error):.1f} bits per value, before any metadata, for that error.")
    if len(rows) < 2:
        return []
    picture = []
    if png is not None and any(len(p) >= 2 for p in plotted.values()):
        from . import plots

        png = plots.gap_against_error(plotted, {h: e for h, (e, _) in crossings.items()}, png, GOAL_FWD_GAP)
        picture = [f"![forward gap against forward error]({plots.link(png)})", ""]
    return ["### The forward's gap against its bits", "",
            "Runs whose backward is uncompressed, so that the gap is the forward codec's alone, fewest forward bits "
            "first (forward error: mean relative round-trip error over the forward links and the run).", "",
            "| run | width | fwd bits | seeds | late-loss gap, mean | 95% interval | fwd error |",
            "|---|---:|---:|---:|---:|---|---:|", *rows, "", *(line for note in notes for line in (note, "")), *picture]


def _codes_jointly(codec: str) -> bool:
    """Whether the run's forward codec is lowrank (a message's shared directions sent once, not per value)."""
    return "lowrank" in convergence.CODECS[codec][1]


def error_for_gap(points: list[tuple[float, float, float]], goal: float) -> tuple[float, float] | None:
    """``(error, bits)`` at which the gap crosses ``goal``, from ``(error, gap, bits)`` points: between the two
    points of adjacent errors whose gaps lie on either side of it, log gap interpolated linearly in log error
    (linearly where a gap is <= 0), bits linearly in the same fraction. None when no pair brackets the goal."""
    ordered = sorted(points)
    for (e_low, g_low, b_low), (e_high, g_high, b_high) in zip(ordered, ordered[1:]):
        if g_low <= goal <= g_high and g_low != g_high:
            if g_low > 0:
                t = math.log(goal / g_low) / math.log(g_high / g_low)
                error = math.exp(math.log(e_low) + t * math.log(e_high / e_low))
            else:
                t = (goal - g_low) / (g_high - g_low)
                error = e_low + t * (e_high - e_low)
            return error, b_low + t * (b_high - b_low)
    return None


def _evaluation_reading(table: dict) -> list[str]:
    """The gap split into what training through the codec cost and what evaluating through it adds
    (:data:`EVAL_BOTH`: both evaluations in the same run, on the same batches)."""
    lines = ["### What evaluating through the codec adds", "",
             "Runs evaluated twice on the same batches (`--tah-eval-traffic both`): through the codec, as every "
             "other run of this study, and uncompressed. The uncompressed evaluation's gap is what training "
             "through the codec cost the model; the difference is what the codec adds to the reported "
             "validation loss.", "",
             "| run | width | seeds | gap, evaluated through the codec | gap, evaluated uncompressed | "
             "added by evaluating through the codec, mean | 95% interval | same-seed additions |",
             "|---|---:|---:|---:|---:|---:|---|---|"]
    rows = 0
    for codec in EVAL_BOTH:
        for hidden in WIDTHS:
            runs, base = table.get(hidden, {}).get(codec, {}), table.get(hidden, {}).get("none", {})
            seeds = [s for s, row in runs.items() if s in base and row["late_uncompressed"] is not None]
            if not seeds:
                continue
            through = [convergence.relative_gap(runs[s]["late"], base[s]["late"]) for s in seeds]
            clean = [convergence.relative_gap(runs[s]["late_uncompressed"], base[s]["late"]) for s in seeds]
            added = [a - b for a, b in zip(through, clean)]
            rows += 1
            lines.append(f"| {convergence.CODECS[codec][0]} | {hidden} | {len(seeds)} | {_pct(_mean(through))} | "
                         f"{_pct(_mean(clean))} | {_pct(_mean(added))} | {_interval_text(added)} | "
                         f"{', '.join(_pct(v) for v in added)} |")
    if not rows:
        return []
    return lines + [""] + _replicates(table)


def _replicates(table: dict) -> list[str]:
    """Each EVAL_BOTH run next to its codec's run of the same seed: the same configuration trained
    again, bit-identical or not (runs made by different commits of the project can differ in the last
    bits of a float from the first iterations on)."""
    lines = ["### The same configuration trained twice", "",
             "Each run above evaluated both ways is its codec's configuration trained again with the same seed "
             "(the flag only adds the uncompressed evaluation). Where the project's code changed between the "
             "two runs the training losses can differ in the last bits from an early iteration on; the "
             "difference in the gap is then how far two such trajectories drift apart.", "",
             "| configuration | width | seed | gap, parity run | gap, run evaluated both ways | difference | "
             "training losses |", "|---|---:|---:|---:|---:|---:|---|"]
    rows = 0
    for codec, twin in EVAL_BOTH.items():
        for hidden in WIDTHS:
            runs = table.get(hidden, {})
            for seed in sorted(runs.get(codec, {})):
                if seed not in runs.get(twin, {}) or seed not in runs.get("none", {}):
                    continue
                a, b, ref = runs[twin][seed], runs[codec][seed], runs["none"][seed]["late"]
                gap_a, gap_b = convergence.relative_gap(a["late"], ref), convergence.relative_gap(b["late"], ref)
                first = next((i + 1 for i, (x, y) in enumerate(zip(a["train"], b["train"])) if x != y), None)
                rows += 1
                lines.append(f"| {convergence.CODECS[twin][0]} | {hidden} | {seed} | {_pct(gap_a)} | {_pct(gap_b)} | "
                             f"{_pct(gap_b - gap_a)} | "
                             f"{'identical' if first is None else f'differ from iteration {first}'} |")
    return lines + [""] if rows else []


def _host_text(entry: dict) -> str:
    """The recorded run's machine and software, as the page names them (runs on different ones drift apart)."""
    host = entry.get("host") or {}
    return (f"{host.get('cpu', 'unknown CPU')}, {host.get('cores', '?')} cores, torch {host.get('torch', '?')}, "
            f"megatron-core {host.get('megatron_core', '?')}") if host else "host not recorded"


def _same_host(entries: list[dict], references: list[dict]) -> str:
    """``yes`` when every entry ran where its reference (same position) ran, ``no`` when none did, else ``partly``."""
    same = [_host_text(e) == _host_text(r) for e, r in zip(entries, references)]
    return "yes" if all(same) else "no" if not any(same) else "partly"


def _when(entries: list[dict]) -> str:
    """``"2026-11-24 15:55-16:17 UTC"``: when the ``entries`` started (first and last start)."""
    starts = sorted(e["started"] for e in entries if e.get("started"))
    if not starts:
        return "n/a"
    first, last = starts[0], starts[-1]
    end = last[11:16] if last[:10] == first[:10] else f"{last[:10]} {last[11:16]}"
    return f"{first[:10]} {first[11:16]}-{end} UTC"


def remeasured_reading(recorded: dict, table: dict, protocol: str) -> list[str]:
    """Rows re-run after their codec changed (the earlier runs kept by :func:`supersede`): per codec and width,
    the earlier and the current same-seed gaps to the same uncompressed runs, over the seeds that have both."""
    groups: dict = {}
    for entry in recorded.values():
        if "superseded" in entry and entry.get("protocol", "gpt2") == protocol:
            groups.setdefault((entry["codec"], entry["hidden"], entry["superseded"]), {})[entry["seed"]] = entry
    current = {(e["codec"], e["hidden"], e["seed"]): e for e in recorded.values()
               if "superseded" not in e and e.get("protocol", "gpt2") == protocol}
    rows = []
    for (codec, hidden, reason), earlier in sorted(groups.items(), key=lambda kv: (SHOWN.index(kv[0][0]), kv[0][1:])):
        base = table.get(hidden, {}).get("none", {})
        seeds = sorted(s for s in earlier if s in base and (codec, hidden, s) in current
                       and ("none", hidden, s) in current)
        if not seeds:
            continue
        before = [convergence.relative_gap(earlier[s]["row"]["late"], base[s]["late"]) for s in seeds]
        after = [convergence.relative_gap(current[(codec, hidden, s)]["row"]["late"], base[s]["late"]) for s in seeds]
        interval = stats.interval95(before)
        inside = ("n/a" if interval is None else
                  "yes" if interval[0] <= _mean(after) <= interval[1] else "no")
        olds, news = [earlier[s] for s in seeds], [current[(codec, hidden, s)] for s in seeds]
        bases = [current[("none", hidden, s)] for s in seeds]
        errors = [_mean([_forward_error(e["row"]) for e in group]) for group in (olds, news)]
        rows.append(f"| {convergence.CODECS[codec][0]} | {hidden} | {len(seeds)} | {reason} | "
                    f"{_when(olds)} | {_same_host(olds, bases)} | {_pct(_mean(before))} | {_interval_text(before)} | "
                    f"{_num(errors[0])} | {_when(news)} | {_same_host(news, bases)} | {_pct(_mean(after))} | "
                    f"{_interval_text(after)} | {_num(errors[1])} | {inside} | "
                    f"{_interval_text([a - b for a, b in zip(after, before)])} |")
    if not rows:
        return []
    return ["### Rows re-measured after their codec changed", "",
            "The rows above of these codecs and widths are re-runs, same seeds, against the same uncompressed runs; "
            "the record keeps the earlier runs (as `<run>@<tag>`, marked with what changed since). *Within*: "
            "whether the re-run's mean gap lies in the earlier runs' 95% interval. Change: the same-seed "
            "difference of the gaps (re-run minus earlier), its 95% interval. *Host*: whether the runs ran on the "
            "machine and software of the uncompressed runs they are compared with (on another, a run differs in "
            "the last bits from the first iterations on: a smaller perturbation than the noise-floor control's).", "",
            "| run | width | seeds | earlier runs | earlier runs started | host | gap, mean | 95% interval | "
            "fwd error | re-runs started | host | gap, mean | 95% interval | fwd error | within | "
            "change, 95% interval |",
            "|---|---:|---:|---|---|---|---:|---|---:|---|---|---:|---|---:|---|---|", *rows, ""]


PAGE_NAME, PAGE_PLOT = "PARITY.md", "parity_record_gaps.png"
PAGE_SECTIONS = {COMPACT: ("## Low-noise protocol (compact vocabulary): part parity-compact", "parity_compact_gaps.png"),
                 "gpt2": ("## GPT-2-vocabulary protocol: parts parity and parity-seeds", PAGE_PLOT)}
"""PARITY.md's sections: protocol -> (heading, plot file)."""


def write_page(out: Path, docs: Path, size: str = "full") -> Path:
    """Refresh ``docs/data/parity_runs.json`` from the logs under ``out`` and write ``docs/PARITY.md`` (and its
    plot ``docs/data/parity_record_gaps.png``) from the record: the study alone, which needs no other part's logs."""
    docs = Path(docs)
    recorded = update_record(out, size, docs / RECORD_NAME)
    intro = ["# Convergence parity study", "",
             f"Generated by `python -m benchmarks.reproduce parity-report` from `{RECORD_NAME}` (one entry per "
             "run, committed, so that seeds run on different machines add up) and the logs under "
             "`runs/reproduce/convergence/`; do not edit by hand. This page is the study's only write-up of the "
             "low-noise protocol (section 4b of RESULTS.md points here). Two protocols: the low-noise one "
             "(compact vocabulary, larger batches), whose same-seed gaps spread little enough to resolve 0.5%, "
             "and the earlier GPT-2-vocabulary one, whose trajectories drift apart by more than the codecs' effect."]
    hosts: dict[str, int] = {}
    for entry in (e for e in recorded.values() if "superseded" not in e):
        key = _host_text(entry)
        hosts[key] = hosts.get(key, 0) + 1
    if hosts:
        intro += ["", "Where the recorded runs ran (the parts run a seed's runs together, on one machine; the same "
                  "run on another CPU or software version differs in the last bits and drifts apart): "
                  + "; ".join(f"{key}: {n} runs" for key, n in hosts.items()) + "."]
    # The record was just refreshed from the logs under ``out``: it is the only source (logs read once).
    body = intro + [""]
    for protocol, (title, plot) in PAGE_SECTIONS.items():
        body += section(None, size, docs, recorded=recorded, title=title, plot=plot, protocol=protocol)
    from ..codec_report.real import parity_section  # the codecs on real activations, the spectrum

    body += parity_section(docs)
    path = docs / PAGE_NAME
    path.write_text("\n".join(body))
    return path
