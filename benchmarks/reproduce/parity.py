"""The convergence-parity study (part ``parity``): candidate codecs x paired seeds x two widths.

Protocol: the convergence part's pretraining (4 layers, PP 4, 200 iterations, AdamW, cosine
schedule; ``convergence.pretrain_runs``) at hidden sizes :data:`WIDTHS`, every codec of
:data:`CANDIDATES` with every seed of :data:`SEEDS` (same seed = same initialization and data
order as the uncompressed run it is compared with). At the size's own width the runs *are* the
convergence and seeds parts' runs (same names and flags), so they are not run twice; other widths
are named ``w<hidden>_<run>``. Run order: seed by seed, so a part stopped early still has paired
seeds.

Measured per run: the *late validation loss*, the mean of the validation losses of the evaluations
in the last quarter of training (at the full size iterations 150, 175 and 200, where the final
evaluation's value replaces the periodic one as ``read_records`` merges them: 3 x 8 batches;
successive evaluations see different validation batches, the same ones in every run of a seed),
next to the final evaluation's loss alone; bits per value on the wire for each direction (metadata
and headers included; values are fp32 in these CPU runs);
the sampled round-trip error of each pipeline link (``link_rel_error``: stage boundary and
direction), over the first and the second half of training; TAH-Quant's rotated-tile fraction.
Gaps are same-seed relative gaps to ``none``; intervals are Student-t 95% intervals of their mean.

Goal: forward <= 4.5 bits with a mean gap <= 0.5% whose interval excludes 1%, at both
widths; backward <= 5 bits adding <= 0.1%.

Resolving 0.5% takes more paired seeds than one machine-session runs, and logs stay on the machine
that wrote them, so every run's summary (:func:`run_row`, a few KB) goes into the committed record
``docs/data/parity_runs.json`` (:func:`update_record`, one line per run, with the host it ran on); the
tables read the record plus whatever logs are present (``python -m benchmarks.reproduce
parity-report`` writes ``docs/PARITY.md`` from them). ``parity-seeds --seeds S,S --widths W`` runs
further seeds. Runs re-made after their codec changed keep the earlier measurement in the record
(:func:`supersede`), and the page compares the two.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..common.runner import Run, read_log, read_meta
from . import convergence
from .convergence import _mean  # (None-tolerant mean)
from .plots import DATA

WIDTHS = (128, 256)
SEEDS = (1234, 1235, 1236)
# Part ``parity-seeds``: the headline candidates again with more seeds, to narrow their intervals.
MORE_SEEDS = (1237, 1238, 1239)
HEADLINE = ("none", "tah", "hadint4_bwd4sr")
# In the order they are run within a seed (the most informative comparisons first).
CANDIDATES = ("none", "tah", "tah_bwd4sr", "hadint4_bwd4sr", "tah_bwdnone", "tah_bwd6sr", "hadint4", "tah_warmup20",
              "bwd6_only", "tah_evalboth", "hadint4_bwd4sr_evalboth")
# Runs evaluated twice on the same batches (--tah-eval-traffic both): through the codec and uncompressed.
EVAL_BOTH = {"tah_evalboth": "tah", "hadint4_bwd4sr_evalboth": "hadint4_bwd4sr"}  # -> the same training's codec
WIDE_CANDIDATES = ("none", "tah", "tah_bwd4sr", "hadint4_bwd4sr")  # at widths other than the size's own
# Part ``parity-compact``: the low-noise protocol (convergence.PROTOCOLS["compact"]) with a noise-floor control.
COMPACT = "compact"
COMPACT_CANDIDATES = ("none", "tah", "tah_bwd4sr", "hadint4_bwd4sr", "lowrank", "lowrank_r8", "int8_both", "channel9",
                      "channel", "channel6", "channel_h4")
COMPACT_SEEDS = (1234, 1235, 1236)
# With the first seed at the size's own width: which direction costs what, and the forward gap against bits.
COMPACT_DIAGNOSTICS = ("tah_bwdnone", "lowrank_bwdnone", "bwd6_only", "hadint4_bwdnone", "hadint5_bwdnone",
                       "hadint6_bwdnone", "bwd4_only", "bwd5_only")
# With every seed at the size's own width: the backward codecs of at most 5 bits (the backward goal).
COMPACT_BACKWARD = ("bwd4sr_only", "bwd4t16_only")
SHOWN = tuple(dict.fromkeys(CANDIDATES + COMPACT_CANDIDATES + COMPACT_DIAGNOSTICS + COMPACT_BACKWARD))  # table rows
GOAL_FWD_BITS, GOAL_FWD_GAP, GOAL_FWD_UPPER = 4.5, 0.005, 0.01
GOAL_BOTH_RATIO = 1.3  # both directions: at least this many times fewer bytes than the default, at no larger gap
STRETCH_FWD = (4.0, 0.01, 0.015)  # bits, mean gap, interval's upper end: the goal's stretch and margin
GOAL_BWD_BITS, GOAL_BWD_ADDED, GOAL_BWD_UPPER = 5.0, 0.001, 0.002  # upper end: twice the goal, as forward
RESOLUTION = GOAL_FWD_UPPER - GOAL_FWD_GAP  # interval half-width at which a mean at the goal has its upper end at 1%
LATE_FRACTION = 0.25  # the last quarter of training


def candidates_at(size: str, hidden: int) -> tuple[str, ...]:
    """:data:`CANDIDATES` at the size's own width (shared with the other parts), else :data:`WIDE_CANDIDATES`."""
    return CANDIDATES if hidden == convergence.size_width(size) else WIDE_CANDIDATES


def parity_runs(root: Path, size: str, widths=WIDTHS, seeds=SEEDS) -> list[Run]:
    """Every (seed, width, candidate) run, seed by seed (45 at the full size, 7 of them shared with the
    convergence and seeds parts: about 3.8 hours, 2 at a time)."""
    return [run for seed in seeds for hidden in widths
            for run in convergence.pretrain_runs(root, size, codecs=candidates_at(size, hidden), seed=seed,
                                                 hidden=hidden)]


def more_seed_runs(root: Path, size: str, widths=WIDTHS, seeds=MORE_SEEDS) -> list[Run]:
    """Part ``parity-seeds``: :data:`HEADLINE` at every width with each of :data:`MORE_SEEDS`, seed by
    seed (18 runs at the full size: about 1.6 hours, 2 at a time)."""
    return [run for seed in seeds for hidden in widths
            for run in convergence.pretrain_runs(root, size, codecs=HEADLINE, seed=seed, hidden=hidden)]


def compact_runs(root: Path, size: str, widths=WIDTHS, seeds=COMPACT_SEEDS) -> list[Run]:
    """Part ``parity-compact``: :data:`COMPACT_CANDIDATES` at every width with every seed under the
    ``compact`` protocol, seed by seed, :data:`COMPACT_BACKWARD` with every seed and :data:`COMPACT_DIAGNOSTICS`
    with the first seed at the size's own width (56 runs at the full size: about 3.6 hours, 2 at a time)."""
    width = convergence.size_width(size)
    return [run for i, seed in enumerate(seeds) for hidden in widths
            for run in convergence.pretrain_runs(
                root, size, seed=seed, hidden=hidden, protocol=COMPACT,
                codecs=COMPACT_CANDIDATES + ((COMPACT_DIAGNOSTICS if i == 0 else ()) + COMPACT_BACKWARD
                                             if hidden == width else ()))]


def run_name(size: str, codec: str, seed: int, hidden: int, protocol: str = "gpt2") -> str:
    return (("" if protocol == "gpt2" else f"{protocol}_") + ("" if hidden == convergence.size_width(size)
                                                             else f"w{hidden}_") + convergence.seed_name(codec, seed))


def late_valid_loss(records: list[dict], fraction: float = LATE_FRACTION, key: str = "valid_loss") -> float:
    """Mean validation loss (``key``) of the evaluations at or after ``(1 - fraction)`` of the last iteration."""
    last = records[-1]["iteration"]
    values = [r[key] for r in records if key in r and r["iteration"] >= (1 - fraction) * last]
    if not values:
        raise ValueError(f"no {key} record in the last part of training")
    return sum(values) / len(values)


def late_train_loss(records: list[dict], fraction: float = LATE_FRACTION) -> float:
    """Mean training loss of the iterations after ``(1 - fraction)`` of the last one (every batch of them)."""
    last = records[-1]["iteration"]
    values = [r["lm_loss"] for r in records if "lm_loss" in r and r["iteration"] > (1 - fraction) * last]
    if not values:
        raise ValueError("no training record in the last part of training")
    return sum(values) / len(values)


def _bits(records: list[dict], direction: str) -> float | None:
    """Wire bits per fp32 value sent in ``direction`` ("fwd"/"bwd"), averaged over the run."""
    raw = sum(r[f"{direction}_raw_bytes"] for r in records)
    wire = sum(r[f"{direction}_wire_bytes"] for r in records)
    return 32.0 * wire / raw if raw else None


def link_errors(records: list[dict]) -> dict[str, tuple[float | None, float | None]]:
    """``{"src->dst": (mean error over the first half, over the second half)}`` from ``link_rel_error``."""
    last = records[-1]["iteration"]
    halves: dict[str, tuple[list, list]] = {}
    for r in records:
        for link, value in (r.get("link_rel_error") or {}).items():
            halves.setdefault(link, ([], []))[r["iteration"] > last / 2].append(value)
    return {link: (_mean(a), _mean(b)) for link, (a, b) in sorted(halves.items(), key=lambda kv: _link_key(kv[0]))}


def _link_key(link: str) -> tuple[int, int]:
    src, dst = link.split("->")
    return int(src), int(dst)


def _rotated(records: list[dict], first: bool) -> float | None:
    last = records[-1]["iteration"]
    chosen = [r for r in records if (r["iteration"] <= last / 4) == first and (first or r["iteration"] > 3 * last / 4)]
    return _mean([((r.get("tah") or {}).get("forward") or {}).get("rotated_fraction") for r in chosen])


def run_row(records: list[dict]) -> dict:
    """What the study keeps of one run's log: ``late``, ``late_train``, ``train`` (every training loss),
    ``late_uncompressed``, ``final``, ``fwd_bits``, ``bwd_bits``, ``links`` and ``rotated`` (first
    quarter, last quarter)."""
    valid = [r for r in records if "valid_loss" in r]
    if not valid:
        raise ValueError("log has no validation records")
    return {"late": late_valid_loss(records), "late_train": late_train_loss(records),
            "train": [r["lm_loss"] for r in records if "lm_loss" in r],
            "late_uncompressed": (late_valid_loss(records, key="valid_loss_uncompressed")
                                  if any("valid_loss_uncompressed" in r for r in records) else None),
            "final": valid[-1]["valid_loss"],
            "fwd_bits": _bits(records, "fwd"), "bwd_bits": _bits(records, "bwd"),
            "links": link_errors(records), "rotated": (_rotated(records, True), _rotated(records, False))}


def _logged_runs(out: Path, size: str, widths, candidates, protocol: str = "gpt2") -> dict[str, tuple[str, int, int]]:
    """``{name: (codec, seed, hidden)}`` of the completed runs of ``protocol`` under ``out`` that belong to
    the study (any seed: the meta file's ``info`` says which; ablations and fine-tuning runs are left out)."""
    found = {}
    for path in sorted(Path(out).glob("*.meta.json")):
        meta = read_meta(out, path.name.removesuffix(".meta.json"))
        info = (meta or {}).get("info") or {}
        codec, seed, hidden = info.get("codec"), info.get("seed"), info.get("hidden")
        if (meta.get("status") == 0 and info.get("phase") == "pretrain" and codec in candidates
                and hidden in widths and isinstance(seed, int) and info.get("protocol", "gpt2") == protocol
                and meta["name"] == run_name(size, codec, seed, hidden, protocol)
                and (Path(out) / f"{meta['name']}.jsonl").is_file()):
            found[meta["name"]] = (codec, seed, hidden)
    return found


def collect(out: Path | None, size: str, widths=WIDTHS, candidates=SHOWN,
            recorded: dict | None = None, protocol: str = "gpt2") -> dict:
    """``{hidden: {codec: {seed: row}}}`` (rows as :func:`run_row`) for the study's completed runs of
    ``protocol`` under ``out`` (None: no logs), whatever their seed, plus the ``recorded`` runs
    (:func:`load_record`) whose logs are not there: a log present here wins over its record. Superseded
    entries (:func:`supersede`) are left out."""
    result: dict = {}
    for entry in (recorded or {}).values():
        if (entry["codec"] in candidates and entry["hidden"] in widths and "superseded" not in entry
                and entry.get("protocol", "gpt2") == protocol):
            result.setdefault(entry["hidden"], {}).setdefault(entry["codec"], {})[entry["seed"]] = entry["row"]
    for name, (codec, seed, hidden) in (_logged_runs(out, size, widths, candidates, protocol) if out else {}).items():
        row = run_row(read_log(Path(out) / f"{name}.jsonl"))
        result.setdefault(hidden, {}).setdefault(codec, {})[seed] = row
    return result


RECORD_NAME = f"{DATA}/parity_runs.json"  # under docs/
"""The study's runs, one entry each (what :func:`run_row` keeps of its log, a few KB), committed next to
the docs: logs stay on the machine that ran them, so the seeds of different machines and sessions
add up only through this file."""
RECORD_VERSION = 1


def load_record(path: Path) -> dict:
    """``{name: {"codec", "seed", "hidden", "started", "seconds", "host", "row"}}`` (and ``"protocol"``
    for runs of a protocol other than ``gpt2``, ``"superseded"`` for a measurement kept after its codec
    changed: :func:`supersede`) from ``path`` ({} when absent); a file of another format version is an
    error, not an empty study."""
    path = Path(path)
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if data.get("version") != RECORD_VERSION:
        raise ValueError(f"{path}: record version {data.get('version')!r}, this code reads {RECORD_VERSION}")
    runs = data["runs"]
    for entry in runs.values():
        row = entry["row"]
        row["links"] = {link: tuple(halves) for link, halves in row["links"].items()}
        row["rotated"] = tuple(row["rotated"])
    return runs


def update_record(out: Path, size: str, path: Path) -> dict:
    """Add (or refresh) the entry of every study run whose log is under ``out`` to the record at
    ``path``; entries of runs whose logs are elsewhere stay. Returns the updated record."""
    runs = load_record(path)
    for protocol in convergence.PROTOCOLS:
        for name, (codec, seed, hidden) in _logged_runs(out, size, WIDTHS, SHOWN, protocol).items():
            meta = read_meta(out, name)
            runs[name] = {"codec": codec, "seed": seed, "hidden": hidden, "started": meta.get("started"),
                          "seconds": meta.get("seconds"), "host": meta.get("host"),
                          **({} if protocol == "gpt2" else {"protocol": protocol}),
                          "row": run_row(read_log(Path(out) / f"{name}.jsonl"))}
    _write_record(path, runs)
    return runs


def _write_record(path: Path, runs: dict) -> None:
    """One line per entry, ordered by protocol, width, seed, codec (a superseded entry after the current one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ordered = sorted(runs.items(), key=lambda kv: (kv[1].get("protocol", "gpt2") != "gpt2", kv[1]["hidden"],
                                                   kv[1]["seed"], kv[1]["codec"], kv[1].get("superseded", "")))
    lines = [f"{json.dumps(name)}: {json.dumps(entry, sort_keys=True)}" for name, entry in ordered]
    path.write_text(f'{{"version": {RECORD_VERSION}, "runs": {{\n' + ",\n".join(lines) + "\n}}\n")


def supersede(path: Path, names: list[str], tag: str, reason: str) -> dict:
    """Keep a copy of each recorded run of ``names`` as ``<name>@<tag>`` marked ``"superseded": reason`` (what
    changed in its codec since it ran), before its re-run's log is folded in under ``name``
    (:func:`update_record`): the tables show the re-run, :func:`remeasured_reading` compares the two.
    A name not in the record, or already kept under ``tag``, is an error (the record is then left as it was).
    Returns the updated record."""
    runs = load_record(path)
    missing = [n for n in names if n not in runs or "superseded" in runs[n]]
    taken = [f"{n}@{tag}" for n in names if f"{n}@{tag}" in runs]
    if missing or taken or not names:
        raise ValueError(f"{path}: cannot supersede {', '.join(names) or 'no runs'}: "
                         + (f"no current entry {', '.join(missing)}" if missing else
                            f"already kept as {', '.join(taken)}" if taken else "no names given"))
    for name in names:
        runs[f"{name}@{tag}"] = {**runs[name], "superseded": reason}
    _write_record(path, runs)
    return runs
