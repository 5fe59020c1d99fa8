"""The README and the docs pages written by hand: their measured numbers come from files a script in the repo
wrote (committed under docs/), their tables are those files' numbers, and every file they point to exists."""

import json
import re
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
README = (REPO / "README.md").read_text()
# Pages written by hand from the records: the guide (README) and the docs pages it links.
GUIDES = ["README.md", "docs/DEMO.md", "docs/CODECS.md", "docs/KERNELS.md", "docs/USAGE.md", "docs/REPRODUCTION.md",
          "docs/DESIGN.md", "docs/DOCKER.md"]
FIGURE = re.compile(r"[+-]?\d+\.\d+(?:%|x)")


def _records() -> str:
    """Every Markdown, text and JSON file under docs/ that is not a guide: generated pages, data files, the
    demo's and the benchmarks' output, and the pages that are the first record of their measurements."""
    guides = {REPO / g for g in GUIDES}
    return "\n".join(path.read_text(errors="replace") for path in sorted(DOCS.rglob("*"))
                     if path.suffix in (".md", ".txt", ".json") and path not in guides)


def test_the_guides_exist_and_the_readme_links_each():
    for guide in GUIDES:
        assert (REPO / guide).is_file(), guide
        assert guide == "README.md" or f"]({guide})" in README, f"README does not link {guide}"


@pytest.mark.parametrize("guide", GUIDES)
def test_every_percentage_and_ratio_in_a_guide_is_in_a_record(guide):
    """A figure such as ``+1.64%`` or ``1.33x`` must appear in some record under docs/ (the same text, a leading
    ``+`` aside), not only in another guide. It checks presence, not context: it finds a number with no source."""
    records = _records()
    figures = set(FIGURE.findall((REPO / guide).read_text()))
    unbacked = sorted(f for f in figures if f not in records and f.lstrip("+") not in records)
    assert unbacked == [], f"{guide}: figures found in no record under docs/: {unbacked}"


def test_the_checks_read_the_figures():
    """The figure check has figures to check: the README's tables and the study pages' summaries."""
    assert len(set(FIGURE.findall(README))) >= 10
    assert sum(len(set(FIGURE.findall((REPO / g).read_text()))) for g in GUIDES) > 100


def _table(text: str, header: str) -> str:
    table = text[text.index(header):]
    return table.split("\n\n")[0]


def _table_rows(text: str, first_cell: str) -> dict[str, list[str]]:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if "|" in line else line.split()
        if line.startswith("|") and cells and cells[0] != first_cell and not cells[0].startswith("---"):
            rows[cells[0]] = cells[1:]
    return rows


def test_the_codec_table_is_the_committed_codec_report():
    """docs/CODECS.md's codec table: bits, ratios and relative error of each row as docs/data/codec_report.txt
    printed them."""
    report = (DOCS / "data" / "codec_report.txt").read_text()
    rows = _table_rows(_table((DOCS / "CODECS.md").read_text(), "| codec | bits/element |"), "codec")
    assert len(rows) == 19
    for label, cells in rows.items():
        name = label.rstrip(" ¹²").strip()
        line = next((row for row in report.splitlines() if row.startswith(name + "  ")), None)
        assert line is not None, f"{name} is not in docs/data/codec_report.txt"
        printed = line[len(name):].split()[:4]
        assert cells == printed, (name, cells, printed)


def test_kernel_table_is_the_committed_kernel_report():
    """Registers and instructions per element of docs/KERNELS.md's kernel table are in the committed sm_90 report."""
    import json

    report = json.loads((DOCS / "benchmarks" / "kernel-report-sm90-triton3.8.json").read_text())
    assert report["triton"].startswith("3.8")
    registers = {r["registers"] for r in report["results"] if r["target"] == "sm_90"}
    per_element = {f"{r['per_element']:.1f}" for r in report["results"] if r["target"] == "sm_90"}
    rows = _table_rows(_table((DOCS / "KERNELS.md").read_text(), "| kernel | registers |"), "kernel")
    assert len(rows) == 7
    for kernel, (regs, spills, instructions) in rows.items():
        assert {int(v) for v in re.findall(r"\d+", regs)} <= registers, kernel
        assert spills == "0"
        assert set(re.findall(r"\d+\.\d", instructions)) <= per_element, kernel


def test_the_readme_demo_table_is_the_committed_demo_table():
    """The README's demo table is docs/demo/table.md with some columns left out."""
    committed = _table((DOCS / "demo" / "table.md").read_text(), "| run |")
    header = [c.strip() for c in committed.splitlines()[0].strip("|").split("|")]
    full = _table_rows(committed, "run")
    shown = _table(README, "| run | tokens/s |")
    columns = [c.strip() for c in shown.splitlines()[0].strip("|").split("|")]
    rows = _table_rows(shown, "run")
    assert list(rows) == list(full)
    for run, cells in rows.items():
        assert cells == [full[run][header.index(column) - 1] for column in columns[1:]], run


def test_the_presets_table_is_the_parity_study():
    """Each preset's gaps in the README are its rows of docs/PARITY.md's low-noise protocol (hidden 128, 256)."""
    parity = (DOCS / "PARITY.md").read_text().split("## Low-noise protocol")[1].split("\n## ")[0]
    widths = [_table_rows(_table(parity.split(f"### Hidden {h}\n")[1], "| run |"), "run") for h in (128, 256)]
    labels = {"`paper`": "TAH-Quant (4/3-bit fwd, 6-bit bwd)",
              "`hadint4`": "Hadamard INT4 fwd, Hadamard INT4 bwd with stochastic rounding (4.25 bits each)",
              **{f"`{name}`": next(r for r in widths[0] if r.endswith(f"--tah-preset {name}"))
                 for name in ("lowrank", "channel_h4")}}
    rows = _table_rows(_table(README, "| preset | activations (forward) |"), "preset")
    assert list(rows)[:len(labels)] == list(labels)
    from megatron_tah.config import PRESETS, TahConfig

    assert set(rows) == {f"`{name}`" for name in PRESETS if name != "none"}  # every preset has its row
    for preset in list(rows)[len(labels):]:  # presets the parity study did not run: their bits, computed
        config, cells = TahConfig(tah_preset=preset.strip("`")), rows[preset]
        bits = [8 * codec.wire_nbytes((128, 4, h), torch.bfloat16) / (512 * h)
                for codec, h in ((config.forward_codec(), 128), (config.forward_codec(), 256))]
        assert cells[1] == " / ".join(f"{b:.2f}" for b in bits) and cells[4] == "not run", preset
        bwd = 8 * config.backward_codec().wire_nbytes((128, 4, 128), torch.bfloat16) / (512 * 128)
        assert cells[3] == f"{bwd:.2f}", preset
    # the depth column: within how many steps the committed speedrun's codecs missed the target
    from benchmarks.common.score import missed_text

    speedrun = {r["codec"]: r for r in json.loads((DOCS / "data" / "speedrun.json").read_text())["table"]}
    for preset in ("paper", "hadint4"):
        assert speedrun[preset]["multiplier"] is None
        assert rows[f"`{preset}`"][5] == f"{missed_text(speedrun[preset]['missed_within'])} (docs/SPEEDRUN.md)"
    row = speedrun["lowrank_h3_rn"]  # missed on the toy, measured on the real model
    assert row["multiplier"] is None and rows["`lowrank_h3_rn`"][5] == (
        f"{missed_text(row['missed_within'])}, {len(row['seeds'])} seeds (docs/SPEEDRUN.md); on SmolLM2: the table "
        "above (docs/REAL_MODEL.md)")
    for preset in ("lowrank", "channel_h4"):
        row = speedrun[preset]
        assert len(row["seeds"]) > 1
        assert rows[f"`{preset}`"][5] == f"{row['multiplier']:.2f}x, {len(row['seeds'])} seeds (docs/SPEEDRUN.md)"
    for preset in list(labels):
        cells = rows[preset]
        fwd_bits, bwd_bits, gap = cells[1], cells[3], cells[4]
        assert fwd_bits == " / ".join(w[labels[preset]][0] for w in widths), preset
        assert bwd_bits == widths[0][labels[preset]][1], preset
        assert gap == " / ".join(w[labels[preset]][3] for w in widths), preset
    # docs/CODECS.md's presets table repeats the gaps: the same cells
    codecs_page = _table_rows(_table((DOCS / "CODECS.md").read_text(), "| preset | forward bits, toy / real |"),
                              "preset")
    for name, cells in codecs_page.items():
        if f"`{name.split()[0]}`" in rows:  # (its other rows: auto's candidates the studies measured)
            assert cells[1] == rows[f"`{name.split()[0]}`"][4], name


def test_the_codecs_pages_preset_table_is_the_committed_real_activation_run():
    """docs/CODECS.md's presets on real activations: bits, token error and the per-bit verdict of each preset
    per model, as docs/data/real_activations.json holds them; every preset, and every candidate of auto the studies
    measured, has its row (``real_report.PRESETS``)."""
    from benchmarks.codec_report.real import PRESETS, _range, preset_summary

    result = json.loads((DOCS / "data" / "real_activations.json").read_text())
    by_model = [preset_summary({"models": [model]}) for model in result["models"]]
    rows = _table_rows(_table((DOCS / "CODECS.md").read_text(), "| preset | forward bits, toy / real |"), "preset")
    rows = {name.split()[0]: cells for name, cells in rows.items()}
    assert set(rows) == set(PRESETS)
    for name, (bits, _gap, error, per_bit) in rows.items():
        real_bits = [format(m[name]["bits"][0], ".2f") for m in by_model]
        assert bits.split(" / ")[1] == (real_bits[0] if len(set(real_bits)) == 1 else ", ".join(real_bits)), name
        assert error == " / ".join(_range(m[name]["token_rel_error"]) for m in by_model), name
        if name != "hadint4":  # the reference itself
            assert per_bit == " / ".join(f"{m[name]['as_good']} of {m[name]['layers']}" for m in by_model), name
    smollm2 = by_model[0]
    page = " ".join((DOCS / "CODECS.md").read_text().split())
    # a preset without its own row says whose forward codec it sends with: the same fields
    from megatron_tah.config import PRESETS as PRODUCT_PRESETS

    forward = lambda p: {k: v for k, v in PRODUCT_PRESETS[p].fields.items() if "backward" not in k}  # noqa: E731
    assert "`lowrank_h3_rn` sends its activations with `lowrank`'s forward codec (the same fields)" in page
    assert forward("lowrank_h3_rn") == forward("lowrank")
    assert (f"a token error of {_range(smollm2['channel']['token_rel_error'])} at 4 bits and "
            f"{_range(smollm2['channel9']['token_rel_error'])} at 6 bits") in page
    assert (f"without its first token: {_range(smollm2['channel']['token_rel_error_without_first'])} and "
            f"{_range(smollm2['channel9']['token_rel_error_without_first'])}") in page
    h4 = smollm2["channel_h4"]
    assert (f"`channel_h4` sends each sequence's largest token apart in bf16 (`--tah-channel-outlier-tokens 1`): on "
            f"SmolLM2 a token error of {_range(h4['token_rel_error'])} at {h4['bits'][0]:.2f} bits, as good per bit as "
            f"Hadamard INT at {h4['as_good']} of {h4['layers']} cuts") in page


def test_make_reproduce_needs_a_part():
    """docs/REPRODUCTION.md states the behaviour of a bare `make reproduce`; the script does it (usage, exit
    status 2)."""
    import subprocess

    page = (DOCS / "REPRODUCTION.md").read_text()
    assert "without one, `make reproduce` prints the parts with their durations and exits (status 2)" in page
    result = subprocess.run(["bash", str(REPO / "scripts" / "reproduce.sh")], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert "about 10 hours" in result.stderr and "parity-report" in result.stderr and "~10 h" in result.stderr


# ----- what the pages point to -----------------------------------------------------------------------------
PAGES = ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in DOCS.rglob("*.md") if "data" not in p.parts)]
LINK = re.compile(r"\]\(([^)\s]+)\)|^\[[^\]]+\]:\s*(\S+)", re.M)
# A repository path in backquotes: a top-level folder of the repo, then a path without placeholders.
REPO_PATH = re.compile(r"`((?:docs|scripts|tests|benchmarks|megatron_tah|patches)/[\w./-]+)`")
PENDING = " (pending)"  # a page another measurement will add, named as such


@pytest.mark.parametrize("page", PAGES)
def test_every_file_a_page_points_to_exists(page):
    """Markdown links (relative to the page) and backquoted repository paths (relative to the repository root)
    name files or folders that are in the repository; a path followed by ``(pending)`` is announced, not linked."""
    text = (REPO / page).read_text()
    base = (REPO / page).parent
    missing = []
    for match in LINK.finditer(text):
        target = (match.group(1) or match.group(2)).split("#")[0]
        if target and not re.match(r"[a-z]+:", target) and not (base / target).exists():
            missing.append(target)
    for match in REPO_PATH.finditer(text):
        path = match.group(1).rstrip(".")
        if not (REPO / path).exists() and not text[match.end():].startswith(PENDING):
            missing.append(path)
    assert missing == [], f"{page} points to files that are not in the repository: {missing}"


ISSUE_NUMBER = re.compile(r"\b[Ii]ssues? #?\d+|(?<![\w&/#])#\d+\b")


@pytest.mark.parametrize("page", PAGES)
def test_no_issue_numbers_in_the_docs(page):
    """Issue numbers point into a tracker a reader of the repository does not have."""
    assert ISSUE_NUMBER.findall((REPO / page).read_text()) == [], page


def test_the_first_screens_table_is_the_real_model_study():
    """The README's results table is ``benchmarks.real_model.readme.readme_table`` of the committed study's JSON (bf16
    and the presets it measured, at most 8 rows, both evaluations): every cell is the page's number."""
    from benchmarks.real_model.readme import WHOLE_RUN_DATA, readme_table, wire_bits

    result = json.loads((DOCS / "data" / "real_model.json").read_text())
    table = readme_table(result, wire=wire_bits(REPO / WHOLE_RUN_DATA))
    assert table in README
    assert table.count("\n| [") <= 8 and result["table"][0]["codec"] == "bf16"
    assert README.index(table) < README.index("## Install")
    assert "served on its own" in table and "served through the pipeline" in table
    assert "WAN ledger, real 8-stage pipeline with the coder" in table.splitlines()[0]


def test_the_preset_for_each_depth_and_use_is_the_one_the_real_model_supports():
    """The first screen's preset per depth (2, 4, 8) and per use (a model served on its own, or through the same
    compressed pipeline) is the study's choice (``report.presets_text``), each depth measured or said not to be, but
    where the whole run's verdict is in: its choice."""
    from benchmarks.real_model.readme import WHOLE_RUN_DATA, read_whole_run, whole_run_verdicts
    from benchmarks.real_model.report import presets_text

    result = json.loads((DOCS / "data" / "real_model.json").read_text())
    final = whole_run_verdicts(read_whole_run(REPO / WHOLE_RUN_DATA))
    table = presets_text(result, depths=(2, 4, 8), flag=True, override=final)
    assert table in README and README.index(table) < README.index("## Install")
    rows = _table_rows(_table(README, "| pipeline depth |"), "pipeline depth")
    assert set(rows) == {"2", "4", "8"}


def test_the_readme_is_at_most_250_lines():
    assert len(README.splitlines()) <= 250


def test_the_readme_s_study_sections_are_what_the_committed_json_writes(tmp_path):
    """Every section between ``<!-- real_model:... -->`` markers (the table, the rule with the choice per depth, what
    the study found) is ``readme.write_readme`` of docs/data/real_model.json: rewriting leaves the README as it is."""
    from benchmarks.real_model import readme, report, verdicts

    copy = tmp_path / "README.md"
    copy.write_text(README)
    result = json.loads((DOCS / "data" / "real_model.json").read_text())
    assert readme.write_readme(result, copy, REPO / readme.WHOLE_RUN_DATA) and copy.read_text() == README
    assert set(readme.README_SECTIONS) == {"table", "presets", "found", "whole_run"}
    page = " ".join((DOCS / "REAL_MODEL.md").read_text().split())
    assert " ".join(verdicts.rule_text().split()) in page  # the page states the same rule
    assert report.presets_text(result) in (DOCS / "REAL_MODEL.md").read_text()


def _study_prose() -> str:
    """The README's prose about the real-model study: from its heading to Install, tables left out."""
    part = README[README.index("## What it does to a real model"):README.index("## Install")]
    return " ".join(line for line in part.splitlines() if not line.startswith("|"))


def test_no_readme_sentence_contradicts_its_tables():
    """The choice the README's prose names per use is the presets table's, depth by depth; every steps multiplier it
    quotes is one of the committed JSON's (a mean or an interval's end, at some depth, either evaluation) or a goal's;
    a sentence that says a codec was measured at one depth only names one that was."""
    from benchmarks.real_model import verdicts

    result = json.loads((DOCS / "data" / "real_model.json").read_text())
    prose = _study_prose()
    rows = _table_rows(_table(README, "| pipeline depth |"), "pipeline depth")
    flags = {verdicts.flag_line(c): c for t in ({str(result["depth"]): result["table"]}, result["depths"])
             for rows_ in t.values() for c in (r["codec"] for r in rows_) if c != "bf16"}
    for use, column in (("**served on its own**", 0), ("**Served through the pipeline**", 1)):
        sentence = prose[prose.index(use):]
        choice = sentence[sentence.index("The choice is "):].split(".")[0]
        whole = {d for ds in re.findall(r"the whole run's at depths? ([\d, and]+)", choice) for d in re.findall(r"\d+", ds)}
        choice = choice.split("the whole run's")[0]  # the depths where the whole run's verdict replaced the choice
        named = dict((d, c) for c, ds in re.findall(r"`(\w+)` at depths? ([\d, and]+)", choice)
                     for d in re.findall(r"\d+", ds))
        assert named == {d: flags[cells[column].strip("`")] for d, cells in rows.items() if d not in whole}, (use, choice)
        assert set(named) | whole == set(rows), (use, choice)
    tables = {str(result["depth"]): result["table"], **result["depths"]}
    quoted = {f"{v:.2f}x" for rows_ in tables.values() for r in rows_ for t in ("uncompressed", "compressed")
              for k in ("multiplier", "multiplier_low", "multiplier_high") if (v := r[t].get(k)) is not None}
    quoted |= {f"{v:.2f}x" for g in verdicts.GOALS for v in (g.steps, g.steps_high, g.serving) if v is not None}
    whole = json.loads((DOCS / "data" / "whole_run.json").read_text())  # the whole run's word: its JSON's ratios
    quoted |= {f"{p['ratio']:.2f}x" for rows_ in whole["tables"].values() for r in rows_ for t in ("uncompressed",
               "compressed") for p in (r.get(t) or {}).get("points", {}).values() if p.get("ratio") is not None}
    quoted.add(f"{whole['rule']['goal_ratio']:.2f}x")
    assert set(re.findall(r"\d+\.\d\dx", prose)) <= quoted
    for match in re.finditer(r"measured at depth (\d+) only", prose):  # some codec of its sentence was, only there
        sentence = re.split(r"\.\s", prose[:match.start()])[-1]
        depths = [{d for d, rows_ in tables.items() if any(r["codec"] == c for r in rows_)}
                  for c in re.findall(r"`(\w+)`", sentence)]
        assert {match.group(1)} in depths, sentence


def test_the_first_screen_is_a_guide():
    """README's first 60 lines: the two set-up commands, the preset per depth, and no prose paragraph with more than a
    dozen numbers (tables and code aside; a digit inside a name such as `channel_h4` is not a number)."""
    first = "\n".join(README.splitlines()[:60])
    assert re.findall(r"^make (\S+)", first, re.M) == ["demo", "test"] and "`make test-all`" in first
    assert "| pipeline depth |" in first
    paragraphs = [p for p in re.split(r"\n\s*\n", first.split("```bash")[0] + first.split("```", 2)[-1])
                  if not p.lstrip().startswith(("|", "<!--"))]  # (a table between a study's markers)
    counts = {p[:40]: len(re.findall(r"(?<![\w.])\d+(?:[.,]\d+)*", p)) for p in paragraphs}  # not in a name
    assert max(counts.values()) <= 12, counts


def test_the_lossless_pages_are_the_committed_measurement():
    """CODECS.md's and USAGE.md's reading of the lossless coder's table, as `python -m benchmarks.lossless` wrote it."""
    result = json.loads((DOCS / "data" / "lossless.json").read_text())
    rows = [r for r in result["rows"] if r["preset"] == "lowrank"]
    saved = 1 - sum(r["coded"] for r in rows) / sum(r["bits"] for r in rows)
    from megatron_tah.link import frames

    assert 0 < saved < 1
    codecs = " ".join((DOCS / "CODECS.md").read_text().split())
    assert ("the default coder, `zstd`, sends at most 0.05 bits per value above each section's order-0 entropy on "
            "every row, and below it where a section of 16-bit scales goes as two byte planes (`paper`)") in codecs
    assert all(r["coded"] - r["order0"] <= 0.05 for r in result["rows"])
    assert all(r["coded"] < r["order0"] for r in result["rows"] if r["preset"] == "paper")
    assert result["host_entropy"]["coder"] == "zstd"
    host = result["host_entropy"]
    assert all(host[d]["coder_ms"] < host[d]["link_saved_ms"] for d in ("forward", "backward"))  # "saves more"
    assert "at 200 Mb/s `zstd` saves more wire time than it costs" in codecs
    row = {r["preset"]: r for r in result["projected"]}["lowrank_h3_rn"]
    assert row["T_coded"] < row["T_coder_time"] < row["T"]  # "the projected T falls with it even on the host"
    from benchmarks.speedrun import check

    from benchmarks.lossless.measure import CANDIDATES

    both = {}
    for r in (r for r in result["rows"] if r["preset"] not in CANDIDATES):  # "a preset's messages"
        sums = both.setdefault(r["preset"], [0.0, 0.0])
        sums[0], sums[1] = sums[0] + r["bits"], sums[1] + r["coded"]
    shares = sorted(round(100 * (1 - c / b)) for b, c in both.values())
    usage = " ".join((DOCS / "USAGE.md").read_text().split())
    assert (f"It codes a preset's messages of a real model in {shares[0]}-{shares[-1]}% fewer bytes (on NCCL its "
            f"frames add {frames.MARGIN:.0%}; on gloo each message goes at its own length)") in usage
    (coded_row, base_row), = check.entropy_pairs(check.load())
    (cf, cb), (bf, bb) = coded_row["message_nbytes"], base_row["message_nbytes"]
    assert (f"`{base_row['codec']}` through it sent {cf / bf - 1:+.1%} bytes per activation message and "
            f"{cb / bb - 1:+.1%} per gradient message, and took "
            f"{coded_row['measured_s'] / base_row['measured_s'] - 1:+.1%} seconds per step") in codecs


def test_the_transfer_claims_are_the_committed_run():
    """docs/CODECS.md's and docs/SPEEDRUN.md's sentences on whether the toy's errors carry over: docs/data/transfer.json's."""
    data = json.loads((DOCS / "data" / "transfer.json").read_text())
    rows = {r["codec"]: r for r in data["rows"]}
    ratio = lambda codec, d: f"{rows[codec]['ratio'][d]:.1f}x"  # noqa: E731
    held = [c for c, r in rows.items() if max(r["ratio"].values()) <= 1.5]
    assert held == ["paper", "hadint4"]
    speedrun_page = " ".join((DOCS / "SPEEDRUN.md").read_text().split())
    assert "only `paper` and `hadint4` code the real model's as well in both directions" in speedrun_page
    page = " ".join((DOCS / "CODECS.md").read_text().split())
    err = lambda codec, d, where: f"{rows[codec][where + '_error'][d]:.2f}"  # noqa: E731
    share = lambda where, d: f"{data[where + '_share16'][d]:.2f}"  # noqa: E731
    assert rows["channel_h4"]["ratio"]["backward"] <= 1.5 and rows["channel_h4"]["real_error"]["forward"] == min(
        r["real_error"]["forward"] for r in rows.values())
    err3 = lambda codec: f"{rows[codec]['real_error']['forward']:.3f}"  # noqa: E731
    assert (f"per-channel 6-bit activations err {err3('channel_h4')} on SmolLM2's against {err3('channel9')} "
            f"without (`channel9`), and 5-bit ones {err3('channel5_h4')}: {ratio('channel_h4', 'forward')} their") in " ".join((DOCS / "CODECS.md").read_text().split())
    assert (f"err {err('channel9', 'backward', 'real')} on SmolLM2's gradients against "
            f"{err('channel9', 'backward', 'toy')} on the toy's") in page
    assert f"errs {err('hadint4', 'backward', 'real')} on both" in page
    assert err("hadint4", "backward", "toy") == err("hadint4", "backward", "real")
    assert (f"the toy's gradients hold {share('toy', 'backward')} of their energy in 16 directions, SmolLM2's "
            f"{share('real', 'backward')}, so its error is {err('lowrank2', 'backward', 'toy')} on the toy's and "
            f"{err('lowrank2', 'backward', 'real')} on SmolLM2's") in page
    assert (f"`lowrank`'s error on SmolLM2's is {ratio('lowrank', 'forward')} its error on the toy's "
            f"({err('lowrank', 'forward', 'real')}: the toy's activations hold {share('toy', 'forward')} of their "
            f"energy in 16 directions, SmolLM2's {share('real', 'forward')}), `channel9`'s "
            f"{ratio('channel9', 'forward')}") in page
    for codec in ("channel", "channel9", "channel_f5", "lowrank_g3"):
        assert rows[codec]["real_error"]["backward"] == rows["channel9"]["real_error"]["backward"]


def test_the_depth_pages_remedies_are_the_committed_speedrun():
    """docs/DEPTH.md quotes the speedrun's steps for the remedies as its committed JSON holds them, and its reading
    (at 5 and 6 forward bits Hadamard INT4 gradients take fewer steps than per-channel 3-bit ones) holds there."""
    from benchmarks.depth.report import remedies

    page = " ".join((DOCS / "DEPTH.md").read_text().split())
    assert remedies(DOCS / "data" / "speedrun.json") in page
    assert "at 5 and 6 forward bits, Hadamard INT4 gradients (4.25 bits) take fewer steps than per-channel 3-bit ones" in page
    rows = {r["codec"]: r for r in json.loads((DOCS / "data" / "speedrun.json").read_text())["table"]}
    assert rows["channel_h4"]["multiplier"] < rows["channel9"]["multiplier"]
    assert rows["channel5_h4"]["multiplier"] < rows["channel_f5"]["multiplier"]
