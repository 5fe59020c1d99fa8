"""Regenerate ``docs/RESULTS.md`` and its PNG plots from the logs under ``runs/reproduce``.

Every measured number in the page is computed here from the runs' JSON logs (the plugin's `--tah-log-json`) and the
runner's meta files; the only constants are the papers' reported numbers (``PAPER_*``,
from the papers) and the targets set for them (``TARGETS``). Sections whose runs are
missing say so instead of showing numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..common.runner import read_meta
from . import convergence, parity, parity_report, throughput
from .report_convergence import _ablation_section, _convergence_section
from .report_throughput import _throughput_section
from .targets import TARGETS, _f, _mib, _ok, _pct, _x


def _memory_section(root: Path) -> tuple[list[str], dict]:
    path = Path(root) / "memory" / "memory.json"
    lines = ["## 5. Memory: AQ-SGD's buffer vs TAH-Quant's", ""]
    if not path.is_file():
        return lines + ["Not run yet (`scripts/reproduce.sh memory`).", ""], {}
    m = json.loads(path.read_text())
    rss = m["max_rss_kb"]
    logged = m.get("logged_buffer_bytes") or {}
    lines += [f"For the fine-tuning run ({m['samples']} samples of [{m['seq']}, {m['hidden']}], PP {m['pipeline']}): "
              "AQ-SGD's buffer measured by replaying every training sample through one `AqSgdCodec` link end "
              "(`buffer_nbytes()`), times the 2 (p - 1) link ends of the pipeline; TAH-Quant keeps nothing per "
              f"sample (checked: encoding a tensor again after others gives identical bytes: {m['tah_stateless']}).", "",
              "| | AQ-SGD | TAH-Quant |", "|---|---:|---:|",
              f"| buffer per link end | {m['aqsgd_buffer_bytes_per_link_end'] / 2**20:.2f} MiB | 0 |",
              f"| buffer per sample per link end | {m['aqsgd_buffer_bytes_per_sample_per_end'] / 1024:.1f} KiB | 0 |",
              f"| buffer, whole run ({2 * (m['pipeline'] - 1)} link ends) | "
              f"{m['aqsgd_buffer_bytes_run'] / 2**20:.2f} MiB | 0 |",
              *([f"| buffer at the end of the fine-tuning run, logged by the plugin (all stages) | "
                 f"{logged['aqsgd']['final'] / 2**20:.2f} MiB | "
                 f"{_f(None if not logged.get('tah') else logged['tah']['final'] / 2**20, '.2f')} MiB |"]
                if logged.get("aqsgd") else []),
              f"| peak RSS of the largest stage process (fine-tuning run) | {_f(_mib(rss.get('aqsgd')), '.0f')} MiB | "
              f"{_f(_mib(rss.get('tah')), '.0f')} MiB |", "",
              f"Peak RSS of the uncompressed fine-tuning run: {_f(_mib(rss.get('none')), '.0f')} MiB. At the AQ-SGD "
              f"paper's GPT2-XL setting (seq 1024, hidden 1600, fp16 buffer) a middle stage holds two link ends, "
              f"{m['gpt2_xl_bytes_per_sample_per_middle_rank'] / 1e6:.1f} MB per training sample (computed, matching "
              "SPEC's ~6.5 MB), which TAH-Quant does not need.", ""]
    if logged.get("aqsgd") and m.get("valid_samples") is not None:
        per_sample = m["aqsgd_buffer_bytes_per_sample_per_end"] * 2 * (m["pipeline"] - 1)
        held = logged["aqsgd"]["final"] / per_sample
        expected = m["samples"] + m["valid_samples"]
        count = (f"{held:.0f} samples per link end: the {m['samples']} training samples plus the "
                 f"{m['valid_samples']} validation samples" if held == expected else
                 f"{held:.1f} samples per link end, against {m['samples']} training plus {m['valid_samples']} "
                 "validation samples expected")
        lines += [f"The logged count is {count} (the fixed validation batches cross the same links, forward "
                  "only, and AQ-SGD buffers every sample id it sees); the replay above counts training samples "
                  "only.", ""]
    if rss.get("aqsgd") and rss.get("tah"):
        diff = (rss["aqsgd"] - rss["tah"]) * 1024
        lines += [f"Peak RSS does not resolve the buffer at this size: the AQ-SGD run's largest stage peaked "
                  f"{diff / 2**20:+.0f} MiB from the TAH-Quant run's, while one link end's buffer is "
                  f"{m['aqsgd_buffer_bytes_per_link_end'] / 2**20:.1f} MiB "
                  f"({_pct(m['aqsgd_buffer_bytes_per_link_end'] / (rss['aqsgd'] * 1024), '.1f')} of that peak: model, "
                  "optimizer, megatron-core, torch and gloo dominate, and vary from run to run); the codec's own "
                  "count above is the measurement.", ""]
    return lines, {"memory_reported": True}


def _summary(checks: dict) -> list[str]:
    lines = ["## Summary: the claims and what was measured here", "",
             "| claim (target) | result | status |", "|---|---|---|"]
    bound_keys = sorted(k for k in checks if k.startswith("tah_of_bound_"))
    if bound_keys:
        met = [k.removeprefix("tah_of_bound_") for k in bound_keys if checks[k]]
        missed = [k.removeprefix("tah_of_bound_") for k in bound_keys if not checks[k]]
        lines.append(f"| TAH-Quant reaches >= 85% of the bound (c+t_raw)/(c+t_wire) | met at: {', '.join(met) or 'none'}; "
                     f"missed at: {', '.join(missed) or 'none'} | {_ok(not missed)} |")
    if "_paper_values" in checks:
        a, b = checks["_paper_values"]
        lines.append(f"| paper regime: TAH-Quant >= 4.3x faster than fp32 | {_x(a)} | {_ok(checks['paper_vs_fp32'])} |")
        lines.append(f"| paper regime: TAH-Quant >= 2.4x faster than bf16 | {_x(b)} | {_ok(checks['paper_vs_bf16'])} |")
    for key, claim in (("auto_vs_best", "auto >= {t}x the best fixed codec's tokens/s at every rate (fp32 pipeline)"),
                       ("auto_vs_bf16", "auto on a bf16 pipeline >= {t}x uncompressed bf16's tokens/s at every rate")):
        if checks.get(f"_{key}") is not None:
            link, value = checks[f"_{key}"]
            lines.append(f"| {claim.format(t=TARGETS['auto'])} | lowest {_x(value)} ({link}) | {_ok(checks[key])} |")
    for phase in ("pretraining", "fine-tuning"):
        if f"_gap_{phase}" in checks:
            lines.append(f"| {phase}: TAH-Quant final validation loss within 1% of uncompressed | "
                         f"{_pct(checks[f'_gap_{phase}'], '+.2f')} ({checks[f'_gap_source_{phase}']}) | "
                         f"{_ok(checks[f'loss_gap_{phase}'])} |")
        if f"_direct3_{phase}" in checks:
            mean, smallest, n = checks[f"_direct3_{phase}"]
            result = (_pct(mean, '+.2f') if n == 1 else
                      f"{_pct(mean, '+.2f')} (mean of {n} seeds; smallest {_pct(smallest, '+.2f')})")
            lines.append(f"| {phase}: direct 3-bit measurably worse than TAH-Quant (final loss above TAH-Quant's "
                         f"by more than {_pct(TARGETS['direct3_worse'])} with every seed) | {result} | "
                         f"{_ok(checks[f'direct3_{phase}'])} |")
    if checks.get("memory_reported"):
        lines.append("| AQ-SGD's buffer memory reported | section 5 | **met** |")
    return lines + [""]


def _timing(root: Path, size: str) -> list[str]:
    lines = ["## How to reproduce, and how long it took here", "",
             "```", "bash scripts/reproduce.sh all        # everything, then the report: about 10 h on 2 cores (or: make reproduce PART=all)",
             "bash scripts/reproduce.sh convergence  # or one part: throughput | convergence | ablations | seeds | "
             "long | parity | parity-seeds | parity-compact | memory | report",
             "```", "", "Results go to `runs/reproduce/<part>/` (one `NAME.jsonl` log from `--tah-log-json`, `NAME.meta.json` "
             "with the command, status, duration, load average and peak RSS, and `NAME.log` per run; the training "
             "parts share `runs/reproduce/convergence/`); finished runs are skipped on a rerun (`--force` reruns "
             "them). Measured time of each part on this machine:", "",
             "| part | runs | sum of run times | longest run |", "|---|---:|---:|---:|"]
    here = Path(root) / "convergence"
    parts = (
        ("convergence", here, [*convergence.PRETRAIN_CODECS, *(f"ft_{c}" for c in convergence.FINETUNE_CODECS)]),
        ("ablations", here, [n for g in convergence.ABLATIONS.values() for n, _, _ in g if n != "tah"]),
        ("seeds", here, convergence.seed_run_names()),
        ("long", here, [f"long_{c}" for c in convergence.LONG_CODECS]),
        ("parity", here, [r.name for r in parity.parity_runs(root, size)]),
        ("parity-seeds", here, [r.name for r in parity.more_seed_runs(root, size)]),
        ("parity-compact", here, [r.name for r in parity.compact_runs(root, size)]),
        ("throughput", Path(root) / "throughput",
         sorted(p.name.removesuffix(".meta.json") for p in (Path(root) / "throughput").glob("*.meta.json"))),
    )
    for part, folder, names in parts:
        metas = [m for m in (read_meta(folder, n) for n in dict.fromkeys(names)) if m]
        total = sum(m.get("seconds", 0) for m in metas)
        longest = max((m.get("seconds", 0) for m in metas), default=None)
        lines.append(f"| {part} | {len(metas)} | {total / 60:.1f} min | "
                     f"{_f(None if longest is None else longest / 60, '.1f')} min |")
    lines += ["", "The training runs above mostly ran two at a time (`--jobs 2`, or two parts side by side), so each "
              "shared the 2 cores with another run; a training part with `--jobs 2` takes about half its sum of "
              "run times (the parts were run in several sittings, so no wall time is quoted for them; their losses "
              "do not depend on timing). The throughput part runs one run at a time, after waiting for the "
              "1-minute load average to drop below 3 (its sum of run times is close to its wall time); each of its "
              "rows records the load average at its start."]
    return lines + [""]


def _machine(t: dict) -> list[str]:
    m = t.get("machine")
    if not m:
        return []
    return ["## Machine", "", f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, Linux {m['kernel']}, "
            f"Python {m['python']}, torch {m['torch']}, no GPU. Throughput machine record written {m['date']} (end of the rate sweep); 1-minute load "
            f"average {m['load_start']:.2f} at their start and {_f(m['load_end'])} at their end.", ""]


PLACES_RESULTS = Path(__file__).resolve().parents[2] / "docs" / "RESULTS_TACO_AGOQ.md"


def _places_section(path: Path = PLACES_RESULTS) -> list[str]:
    """The TACO / AGoQ measurements (``scripts/measure_places.py``, written up in ``path``), headings one level down."""
    lines = ["## 6. Tensor-parallel, data-parallel and activation-memory compression (TACO, AGoQ)", ""]
    if not path.is_file():
        return lines + ["Not measured yet (`python scripts/measure_places.py`).", ""]
    body = path.read_text().splitlines()
    body = body[1:] if body and body[0].startswith("# ") else body  # its title is this section's heading
    lines += [f"From `docs/{path.name}` (not generated from `runs/reproduce`; its commands are listed there)."]
    return lines + [("#" + line) if line.startswith("## ") else line for line in body] + [""]


COMPACT_HEADING = "## 4b. "
COMPACT_TITLE = COMPACT_HEADING + "The low-noise protocol (compact vocabulary): part parity-compact"
NEXT_SECTION = "## 5. "  # the heading section 4b comes before


def _compact_section(size: str, docs: Path, recorded: dict) -> list[str]:
    """Section 4b, the low-noise parity protocol: a pointer to PARITY.md, which holds its tables (written from the
    same record by ``parity-report``), so that the two pages never disagree."""
    title = parity_report.PAGE_SECTIONS[parity.COMPACT][0].removeprefix("## ")
    return [COMPACT_TITLE, "",
            f"Its tables, verdicts and plots are on [{parity_report.PAGE_NAME}]({parity_report.PAGE_NAME}), section *{title}*, "
            f"written from the committed record `{parity.RECORD_NAME}` by `python -m benchmarks.reproduce "
            "parity-report`.", ""]


def refresh_compact_section(docs: Path, size: str = "full", recorded: dict | None = None) -> Path | None:
    """Rewrite (or insert before section 5) section 4b of an existing ``docs/RESULTS.md`` from the record
    (``parity-report``): every other section, section 4 included, stays as ``report`` wrote it from its
    machine's logs. None when there is no RESULTS.md; ``ValueError`` when it has no section 5."""
    docs = Path(docs)
    path = docs / "RESULTS.md"
    if not path.exists():
        return None
    lines = path.read_text().split("\n")
    ends = [i for i, line in enumerate(lines) if line.startswith(NEXT_SECTION)]
    if not ends:
        raise ValueError(f"{path}: no '{NEXT_SECTION.strip()}' section to put section 4b before; "
                         "regenerate it whole with `python -m benchmarks.reproduce report`")
    starts = [i for i, line in enumerate(lines[:ends[0]]) if line.startswith(COMPACT_HEADING)]
    if recorded is None:
        recorded = parity.load_record(docs / parity.RECORD_NAME)
    lines[starts[0] if starts else ends[0]:ends[0]] = _compact_section(size, docs, recorded)
    path.write_text("\n".join(lines))
    return path


def write(root: Path, docs: Path, size: str = "full") -> Path:
    """Write ``docs/RESULTS.md`` (+ PNGs) from ``root``'s logs; returns the markdown path."""
    root, docs = Path(root), Path(docs)
    docs.mkdir(parents=True, exist_ok=True)
    t = throughput.table_rows(root / "throughput", size)
    tput_lines, checks = _throughput_section(t, docs, size)
    conv_lines, conv_checks = _convergence_section(root, docs, size)
    mem_lines, mem_checks = _memory_section(root)
    checks.update(conv_checks)
    checks.update(mem_checks)
    text = ["# Reproducing the TAH-Quant and AQ-SGD claims at small scale", "",
            "Generated by `python -m benchmarks.reproduce report` from the run logs under `runs/reproduce/` "
            f"(size `{size}`); do not edit by hand. Papers: TAH-Quant (arXiv 2506.01352), AQ-SGD (arXiv 2206.01299); "
            "their numbers are quoted from the papers.", ""]
    text += _summary(checks) + _machine(t) + tput_lines + conv_lines + _ablation_section(root)
    recorded = parity.update_record(root / "convergence", size, docs / parity.RECORD_NAME)
    text += parity_report.section(None, size, docs, recorded=recorded)  # the record holds the logs' runs
    text += _compact_section(size, docs, recorded) + mem_lines
    text += _places_section()
    text += _timing(root, size)
    path = docs / "RESULTS.md"
    path.write_text("\n".join(text))
    return path


THROUGHPUT_HEADING, AFTER_THROUGHPUT = "## 1. ", "## 2. "
SUMMARY_HEADING, MACHINE_HEADING = "## Summary", "## Machine"


def refresh_throughput_section(root: Path, docs: Path, size: str = "full") -> Path | None:
    """Rewrite section 1 (throughput), the machine record and the summary's throughput rows of an existing
    ``docs/RESULTS.md`` from ``root/throughput``'s logs alone (the throughput part), leaving every other
    section as ``report`` wrote it. None when there is no RESULTS.md or no throughput run."""
    path = Path(docs) / "RESULTS.md"
    t = throughput.table_rows(Path(root) / "throughput", size)
    if not path.exists() or t["compute"].get("none") is None:
        return None
    section, checks = _throughput_section(t, Path(docs), size)
    lines = path.read_text().split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith(THROUGHPUT_HEADING))
    end = next(i for i, line in enumerate(lines) if line.startswith(AFTER_THROUGHPUT))
    machine = [i for i, line in enumerate(lines[:start]) if line.startswith(MACHINE_HEADING)]
    lines[machine[0] if machine else start:end] = _machine(t) + section
    # The summary: this part's rows (the first rows of the table, as ``report`` orders them) replaced.
    new_rows = [row for row in _summary(checks) if row.startswith("| ") and not row.startswith("| claim")]
    top = next(i for i, line in enumerate(lines) if line.startswith(SUMMARY_HEADING))
    bottom = next(i for i in range(top + 1, len(lines)) if lines[i].startswith("## "))
    table = [i for i in range(top, bottom) if lines[i].startswith("|")]  # header, rule, rows
    rows = table[2:]
    keep = [lines[i] for i in rows if not lines[i].startswith(("| TAH-Quant reaches", "| paper regime", "| auto"))]
    if len(table) >= 2:
        lines[table[1] + 1:(rows[-1] if rows else table[1]) + 1] = new_rows + keep
    path.write_text("\n".join(lines))
    return path
